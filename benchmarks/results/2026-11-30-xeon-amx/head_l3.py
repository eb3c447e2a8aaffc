"""Is a decode step's LM head read from the L3? The fused kernel's few-row pass (`linear_rows`) on [1, d] x [vocab, d]
bf16 weights (the MF-tiny / -small / -base heads: 52 / 77 / 103 MB), back to back, and with a 1 GB streaming read
between calls (which leaves none of the head in any cache); beside it the `torch.dot` read probe over 128 MB and over
1.9 GB (every call of the latter from DRAM).

    PYTHONPATH=. .venv/bin/python benchmarks/results/2026-11-30-xeon-amx/head_l3.py
"""
import statistics
import time

import torch

from modeling_memoryformer import huge_pages
from modeling_memoryformer.memory_kernels import fused_ops, load_fused_kernels

torch.set_num_threads(2)
assert load_fused_kernels(), "the fused kernel did not build"
ops = fused_ops()
evict = huge_pages.huge_page_empty((1 << 28,), torch.float32).fill_(1.0)   # 1 GB
probes = {mb: huge_pages.huge_page_empty((mb << 18,), torch.float32).fill_(1.0) for mb in (128, 1920)}


def dot_gbps(buffer) -> float:
    half = buffer.numel() // 2
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        torch.dot(buffer[:half], buffer[half:2 * half])
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best / 1e9


def timed(x, w) -> float:
    start = time.perf_counter()
    ops.linear_rows(x, w, None)
    return time.perf_counter() - start


for d in (512, 768, 1024):
    w = huge_pages.huge_page_empty((50304, d), torch.bfloat16).normal_()
    x = torch.randn(1, d, dtype=torch.bfloat16)
    mb = w.numel() * 2 / 1e6
    for _ in range(5):
        ops.linear_rows(x, w, None)
    for _round in range(3):
        hot = statistics.median(timed(x, w) for _ in range(20))
        cold = []
        for _ in range(20):
            evict.sum()
            cold.append(timed(x, w))
        cold = statistics.median(cold)
        print(f"head {mb:.0f} MB: back to back {hot * 1e3:.2f} ms ({mb / 1e3 / hot:.1f} GB/s), after a 1 GB read "
              f"{cold * 1e3:.2f} ms ({mb / 1e3 / cold:.1f} GB/s); dot 128 MB {dot_gbps(probes[128]):.1f}, "
              f"1.9 GB {dot_gbps(probes[1920]):.1f} GB/s", flush=True)
