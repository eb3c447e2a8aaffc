"""The read probe (cpu_load.memory_read_gbps: torch.dot of the halves of a 128 MB buffer on huge pages, 2 threads),
three reads back to back, then three reads each after a flush of the buffer from every cache level
(scatter_probe.flush_caches); five rounds. (GB/s, the flush's ms) per flushed read. 05:57 UTC.
    PYTHONPATH=. .venv/bin/python benchmarks/results/2026-11-30-xeon-amx/flush_probe.py
"""
import torch

from benchmarks.scatter_probe import flush_caches
from modeling_memoryformer.evaluation.cpu_load import memory_read_gbps, stream_buffer

torch.set_num_threads(2)
buf = stream_buffer()
for _ in range(5):
    warm = [memory_read_gbps(repeats=1) for _ in range(3)]
    cold = []
    for _ in range(3):
        seconds = flush_caches(buf)
        cold.append((memory_read_gbps(repeats=1), round(seconds * 1e3, 1)))
    print("back to back", warm, "flushed (GB/s, flush ms)", cold, flush=True)
