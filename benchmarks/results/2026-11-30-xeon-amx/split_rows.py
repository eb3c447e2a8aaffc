"""Scattered row reads (benchmarks/scatter_probe.py) over MF-base-sized bf16 table sets (24 x 128 x 256 x 3072 and
24 x 128 x 1024 x 1024), 2 threads: each row split over the threads by columns ("split"), the halves of different
rows ("split-diff"), first halves only ("half-only"), whole rows dealt to the threads ("whole").
    PYTHONPATH=. .venv/bin/python benchmarks/results/2026-11-30-xeon-amx/split_rows.py
"""
import torch

from benchmarks import scatter_probe as sp
from modeling_memoryformer import huge_pages
groups = {}
for K, P, D in ((128, 256, 3072), (128, 1024, 1024)):
    groups[D * 2] = [huge_pages.huge_page_empty((K * P, D), torch.bfloat16).normal_() for _ in range(24)]
def rate(tabs, mode, seed):
    g = torch.Generator().manual_seed(seed)
    rows = max(24 * 128, (8 << 20) // (tabs[0].shape[1] * 2))

    def draw():
        if mode == "whole":
            return sp.row_starts(tabs, rows, 1, 2, g)
        st, span = sp.row_starts(tabs, rows, 2, 2, g)
        if mode == "split-diff":   # thread 1: second halves of other rows
            st2, _ = sp.row_starts(tabs, rows, 2, 2, g)
            st = torch.stack([st[0], st2[1]])
        if mode == "half-only":   # both threads: first halves only, different rows
            st2, _ = sp.row_starts(tabs, rows, 2, 2, g)
            st = torch.stack([st[0], st2[0]])
        return st, span

    return sp.best_gbps(tabs, draw)


for rep in range(4):
    print("  ".join(f"row {w}: " + " ".join(f"{m} {rate(t, m, rep * 10 + i):5.1f}" for i, m in enumerate(("split", "split-diff", "half-only", "whole"))) for w, t in groups.items()), flush=True)
