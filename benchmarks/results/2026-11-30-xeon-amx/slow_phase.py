"""In a slow minute: MF-base's decode step beside what the probes see in the same process: the rows of its own tables
(decode_bench.gather_rates), the rows of 2.4 GB of freshly allocated tables, its LM head's few-row pass (back to back)
and the dot read probe; argv[1] rounds.

    PYTHONPATH=. .venv/bin/python benchmarks/results/2026-11-30-xeon-amx/slow_phase.py 6
"""
import statistics
import sys
import time

import torch

from benchmarks.decode_bench import build_in_dtype, gather_groups, gather_rates
from benchmarks import scatter_probe
from modeling_memoryformer import huge_pages
from modeling_memoryformer.memory_kernels import fused_ops
from modeling_memoryformer.evaluation.cpu_load import memory_read_gbps
torch.set_num_threads(2)
model = build_in_dtype("mf", "base", "bf16")
model.generation_config.eos_token_id = None
groups = gather_groups(model)
ops = fused_ops()
head = model.get_output_embeddings().weight
ids = torch.randint(0, 5000, (1, 16))
kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
fresh = [huge_pages.huge_page_empty((128 * 256, 3072), torch.bfloat16).normal_() for _ in range(12)]  # 2.4 GB
x = torch.randn(1, 1024, dtype=torch.bfloat16)
with torch.inference_mode():
    model.generate(ids, max_new_tokens=4, **kw)
    for r in range(int(sys.argv[1])):
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=33, **kw)
        long = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kw)
        short = time.perf_counter() - t
        g = gather_rates(groups, 1, 2, seed=r)
        fr = scatter_probe.step_read_gbps(fresh, [128] * 12, 1, 2, seed=r)
        hs = []
        for _ in range(5):
            t = time.perf_counter()
            ops.linear_rows(x, head, None)
            hs.append(time.perf_counter() - t)
        print(f"step {(long - short) / 32 * 1e3:6.2f} ms | model rows {g} GB/s | fresh 6 KB rows {fr:.1f} GB/s | "
              f"head {statistics.median(hs) * 1e3:.2f} ms | dot {memory_read_gbps(repeats=2):.1f}", flush=True)
