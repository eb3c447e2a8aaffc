"""Scattered row reads (benchmarks/scatter_probe.py), MF-base-sized table sets: 2 threads splitting each row, 1 thread
reading whole rows, 2 threads dealt whole rows.
    PYTHONPATH=. .venv/bin/python benchmarks/results/2026-11-30-xeon-amx/threads_rows.py
"""
import torch

from benchmarks import scatter_probe as sp
from modeling_memoryformer import huge_pages
groups = {}
for K, P, D in ((128, 256, 3072), (128, 1024, 1024)):
    groups[D * 2] = [huge_pages.huge_page_empty((K * P, D), torch.bfloat16).normal_() for _ in range(24)]
def rate(tabs, split, threads, seed):
    return sp.scattered_read_gbps(tabs, 24 * 128, split, threads, seed)


for rep in range(4):
    print("  ".join(f"row {w}: 2t-split {rate(t, 2, 2, rep):5.1f} 1t-whole {rate(t, 1, 1, rep+1):5.1f} 2t-whole {rate(t, 1, 2, rep+2):5.1f}" for w, t in groups.items()), flush=True)
