"""MF-base's LM head ([50304, 1024] bf16, 103 MB) read cold (a 1 GB streaming read before every call): the fused
few-row pass with its prefetches off and on (`linear_rows_prefetch` 0 / 1), oneDNN's `F.linear`, and `torch.sum` of
the same weight; 15 calls each, median.

    PYTHONPATH=. .venv/bin/python benchmarks/results/2026-11-30-xeon-amx/head_cold.py
"""
import statistics
import time

import torch
import torch.nn.functional as F

from modeling_memoryformer import huge_pages
from modeling_memoryformer.memory_kernels import fused_ops, load_fused_kernels

torch.set_num_threads(2)
assert load_fused_kernels(), "the fused kernel did not build"
ops = fused_ops()
evict = huge_pages.huge_page_empty((1 << 28,), torch.float32).fill_(1.0)
w = huge_pages.huge_page_empty((50304, 1024), torch.bfloat16).normal_()
x = torch.randn(1, 1024, dtype=torch.bfloat16)
MB = w.numel() * 2 / 1e6


def cold(fn, n: int = 15) -> float:
    times = []
    for _ in range(n):
        evict.sum()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def show(name: str, seconds: float) -> str:
    return f"{name} {seconds * 1e3:.2f} ms ({MB / 1e3 / seconds:.1f} GB/s)"


for _ in range(30):
    ops.linear_rows(x, w, None)
for _round in range(3):
    row = []
    for setting in (0, 1):
        ops.linear_rows_prefetch(setting)
        row.append(show(f"linear_rows prefetch {setting}", cold(lambda: ops.linear_rows(x, w, None))))
    ops.linear_rows_prefetch(-1)
    row.append(show("F.linear", cold(lambda: F.linear(x, w))))
    row.append(show("torch.sum", cold(lambda: torch.sum(w))))
    print("; ".join(row), flush=True)
