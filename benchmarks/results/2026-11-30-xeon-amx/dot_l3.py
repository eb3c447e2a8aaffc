"""Is decode_bench's read probe (`torch.dot` of the halves of a 128 MB buffer, cpu_load.memory_read_gbps) served from
this guest's 480 MB L3 when it runs back to back? Per round: a 1 GB read to evict it, the probe once (cold), three
times back to back, and a dot over 2 GB (larger than the L3). 2 threads.
    PYTHONPATH=. .venv/bin/python benchmarks/results/2026-11-30-xeon-amx/dot_l3.py
"""
import time

import torch

from modeling_memoryformer.evaluation.cpu_load import memory_read_gbps
from modeling_memoryformer.huge_pages import huge_page_empty

torch.set_num_threads(2)
evict = huge_page_empty((1 << 28,), torch.float32).fill_(1.0)   # 1 GB
big = huge_page_empty((1 << 29,), torch.float32).fill_(1.0)     # 2 GB


def dot_big() -> float:
    half = big.numel() // 2
    start = time.perf_counter()
    torch.dot(big[:half], big[half:])
    return big.numel() * 4 / (time.perf_counter() - start) / 1e9


for _ in range(6):
    evict.sum()
    cold = memory_read_gbps(repeats=1)
    warm = [memory_read_gbps(repeats=1) for _ in range(3)]
    print(f"128 MB dot: after a 1 GB read {cold:.1f} GB/s; back to back {warm}; 2 GB dot {dot_big():.1f}", flush=True)
