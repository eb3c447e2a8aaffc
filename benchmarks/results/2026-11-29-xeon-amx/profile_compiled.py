"""Where MemoryFormer's compiled decode step goes: eager and compiled ms per step ((33-token generate - 1-token) / 32),
then torch.profiler over one compiled 33-token `generate` call, its ops by self CPU time.

    PYTHONPATH=. .venv/bin/python benchmarks/results/2026-11-29-xeon-amx/profile_compiled.py small
"""
import sys
import time

import torch

from benchmarks.decode_bench import build_in_dtype
from modeling_memoryformer import compiled_decode_kwargs


def main() -> None:
    torch.set_num_threads(2)
    model = build_in_dtype("mf", sys.argv[1] if len(sys.argv) > 1 else "small", "bf16")
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, 5000, (1, 16))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=33, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        for path, extra in (("eager", {}), ("compiled", compiled_decode_kwargs())):
            model.generate(ids, **kwargs, **extra)
            start = time.perf_counter()
            model.generate(ids, **kwargs, **extra)
            long = time.perf_counter() - start
            start = time.perf_counter()
            model.generate(ids, **dict(kwargs, max_new_tokens=1), **extra)
            short = time.perf_counter() - start
            print(path, f"{(long - short) / 32 * 1e3:.2f} ms/step", flush=True)
        with torch.profiler.profile() as prof:
            model.generate(ids, **kwargs, **compiled_decode_kwargs())
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
