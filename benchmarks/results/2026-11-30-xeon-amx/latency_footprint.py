"""Dependent-read latency at random row starts against the footprint the rows are drawn from: the memory latency a
decode step's gathers hide behind their prefetches, for tables the size of MF-tiny's (about 1 GB in bf16), MF-small's
(about 4 GB) and MF-base's (about 13 GB). Rows of 2 KB (MF-base's layer-2 rows), tensors of 192 MB (one Memory Layer's
tables) on transparent huge pages as from_pretrained places them, and on 4 KB pages for comparison. Each figure is
`scatter_probe.read_latency_ns` (one thread, 20,000 dependent reads, the median of 3 passes over fresh rows), taken 4
times after one untimed pass: the median and the range.
    PYTHONPATH=. .venv/bin/python benchmarks/results/2026-11-30-xeon-amx/latency_footprint.py 64 256 1024 4096 12288
"""
import statistics
import sys
import time

import torch

from benchmarks import scatter_probe
from modeling_memoryformer.huge_pages import huge_page_empty

ROW = 1024            # bf16 values: 2 KB rows
PER_TENSOR = 192 << 20
for mb in map(int, sys.argv[1:]):
    for pages in ("THP", "4 KB") if mb <= 4096 else ("THP",):
        count = max(1, (mb << 20) // PER_TENSOR)
        rows = min(mb << 20, PER_TENSOR) // (2 * ROW)
        if pages == "THP":
            tensors = [huge_page_empty((rows, ROW), torch.bfloat16).fill_(1.0) for _ in range(count)]
        else:
            tensors = [torch.empty(rows, ROW, dtype=torch.bfloat16).fill_(1.0) for _ in range(count)]
        scatter_probe.read_latency_ns(tensors, seed=99)
        runs = [scatter_probe.read_latency_ns(tensors, seed=i) for i in range(4)]
        print(f"{time.strftime('%H:%M:%S')} {mb:6d} MB {pages:4s} pages: {statistics.median(runs):5.0f} ns "
              f"({min(runs):.0f}-{max(runs):.0f})", flush=True)
        del tensors
