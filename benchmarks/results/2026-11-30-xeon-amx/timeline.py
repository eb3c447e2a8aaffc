"""MF-base bf16 eager decode, ms per step ((33-token generate - 1-token) / 32) every ~10 s after the build, beside the
dot read probe, until `seconds` (argv[1]) after the start.

    PYTHONPATH=. .venv/bin/python benchmarks/results/2026-11-30-xeon-amx/timeline.py 480
"""
import sys
import time

import torch

from benchmarks.decode_bench import build_in_dtype
from modeling_memoryformer.evaluation.cpu_load import memory_read_gbps
torch.set_num_threads(2)
t0 = time.time()
model = build_in_dtype("mf", "base", "bf16")
print(f"built at {time.time() - t0:.0f} s", flush=True)
model.generation_config.eos_token_id = None
ids = torch.randint(0, 5000, (1, 16))
kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
with torch.inference_mode():
    while time.time() - t0 < float(sys.argv[1]):
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=33, **kw)
        long = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kw)
        short = time.perf_counter() - t
        print(f"{time.time() - t0:5.0f} s: {(long - short) / 32 * 1e3:6.2f} ms/step  dot {memory_read_gbps(repeats=2):.1f}", flush=True)
        time.sleep(10)
