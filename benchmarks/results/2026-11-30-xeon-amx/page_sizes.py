"""Random K-row lookups (MF-base Q/K/V shape: 128 tables x 256 rows x 3072 bf16, 8 such table sets) through the
kernel's lookup op, the tables on 1 GB hugetlb pages, 2 MB hugetlb pages, transparent huge pages (madvise) and 4 KB
pages. Needs root-reserved hugetlb pages for 1g/2m:
    echo 2 > /sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages
    echo 1600 > /sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages
    PYTHONPATH=. .venv/bin/python benchmarks/results/2026-11-30-xeon-amx/page_sizes.py 1g 2m thp 4k
"""
import sys
import time
import mmap
import torch

from modeling_memoryformer.memory_kernels import fused_ops, load_fused_kernels
from modeling_memoryformer import huge_pages
assert load_fused_kernels(), "the fused kernel did not build"
ops = fused_ops()
torch.set_num_threads(2)
K, R, D = 128, 256, 3072
LB = K * R * D * 2
NL = 8
MAP_HUGETLB = 0x40000
def hugetlb(nbytes, shift):
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_HUGETLB | (shift << 26))
    return m
def tabs_from(kind):
    if kind == "thp":
        return [huge_pages.huge_page_empty((K * R, D), torch.bfloat16).normal_() for _ in range(NL)], None
    if kind == "4k":
        return [torch.empty(K * R, D, dtype=torch.bfloat16).normal_() for _ in range(NL)], None
    shift = 30 if kind == "1g" else 21
    page = 1 << shift
    total = (NL * LB + page - 1) // page * page
    m = hugetlb(total, shift)
    buf = torch.frombuffer(m, dtype=torch.bfloat16)
    return [buf[i * LB // 2:(i + 1) * LB // 2].view(K * R, D).normal_() for i in range(NL)], m
g = torch.Generator().manual_seed(0)
rs = []
for _ in range(600):
    rows, scores = ops.hash(torch.randn(1, K * 8, generator=g), 8, "paper", 1.0)
    rs.append((rows, scores))
kinds = sys.argv[1:]
T = {k: tabs_from(k) for k in kinds}
for _round in range(4):
    line = []
    for k in kinds:
        tabs = T[k][0]
        t0 = time.perf_counter()
        for c in range(600):
            ops.lookup(rs[c][0], rs[c][1], tabs[(c * 7) % NL], None, R)
        dt = (time.perf_counter() - t0) / 600
        line.append(f"{k}: {dt*1e6:6.1f} us ({K*D*2/dt/1e9:4.1f} GB/s)")
    print("  ".join(line), flush=True)
