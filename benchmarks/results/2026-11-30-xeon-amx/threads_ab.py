"""MF-<preset> bf16 eager decode on 1 and 2 threads, alternating in one process (argv: preset, rounds); run under
OMP_WAIT_POLICY=ACTIVE and unset for the wait-policy comparison.

    PYTHONPATH=. .venv/bin/python benchmarks/results/2026-11-30-xeon-amx/threads_ab.py small 4
"""
import sys
import time

import torch

from benchmarks.decode_bench import build_in_dtype
torch.set_num_threads(2)
model = build_in_dtype("mf", sys.argv[1], "bf16")
model.generation_config.eos_token_id = None
ids = torch.randint(0, 5000, (1, 16))
kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
with torch.inference_mode():
    model.generate(ids, max_new_tokens=4, **kw)
    for r in range(int(sys.argv[2])):
        row = []
        for n in ((1, 2) if r % 2 else (2, 1)):
            torch.set_num_threads(n)
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=33, **kw)
            long = time.perf_counter() - t
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=1, **kw)
            short = time.perf_counter() - t
            row.append(f"{n} thread(s) {(long - short) / 32 * 1e3:6.2f} ms")
        print("  ".join(sorted(row)), flush=True)
