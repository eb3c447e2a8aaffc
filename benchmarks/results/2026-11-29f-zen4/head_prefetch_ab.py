"""The LM head's row pass with and without its software prefetches, in one process.

MF-small's bf16 head shape (50304 x 768) on huge pages, read cold (a 256 MB sum before each pass): 10 passes (the
first 8 are the prefetch trial) checked bit for bit, the trial's state printed, then the two fixed settings alternated
pass by pass, 3 each per round, with a read probe per round. Run from the repository root:

    .venv/bin/python benchmarks/results/2026-11-29f-zen4/head_prefetch_ab.py
"""
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from modeling_memoryformer.decode_layer import fused_ops, uses_fused
from modeling_memoryformer.evaluation.cpu_load import memory_read_gbps
from modeling_memoryformer.huge_pages import huge_page_copy

torch.set_num_threads(2)
uses_fused(torch.zeros(1))
fused_ops()
setting = torch.ops.memoryformer.linear_rows_prefetch
w = huge_page_copy(torch.randn(50304, 768, dtype=torch.bfloat16))
x = torch.randn(1, 768, dtype=torch.bfloat16)
flush = torch.ones(64 << 20)
op = torch.ops.memoryformer.linear_rows_argmax
first = op(x, w, None)
for _ in range(10):
    flush.sum()
    assert torch.equal(op(x, w, None)[0], first[0])
# [the fixed setting, then the choice and the timed passes per kind: bf16 within, beyond the LLC; float32 the same]
print("trial:", setting(-2))
for _ in range(6):
    probe = memory_read_gbps(repeats=1)
    seconds = {0: [], 1: []}
    for _ in range(3):
        for s in seconds:
            setting(s)
            flush.sum()
            start = time.perf_counter()
            out = op(x, w, None)
            seconds[s].append(time.perf_counter() - start)
            assert torch.equal(out[0], first[0])
    rates = " | ".join(f"prefetch {s}: {w.nbytes / statistics.median(t) / 1e9:5.1f}" for s, t in seconds.items())
    print(f"probe {probe:5.1f} GB/s | {rates} GB/s", flush=True)
setting(-1)
