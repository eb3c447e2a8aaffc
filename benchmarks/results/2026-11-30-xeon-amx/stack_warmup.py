"""MF-base's decode stack (every decoder layer of a step, one `decode_stack` call: the table rows, no LM head) timed
from the moment the model is built, in blocks: 20 calls on 2 threads, 20 calls on 1 thread, then the dependent-read
latency at random row starts of the model's own tables and of a 2 GB buffer re-read every block
(`scatter_probe.read_latency_ns`). Each call takes another hidden state, so other rows (a fixed one would find its rows
in the caches). Asks: is a slow stack slow on one thread too (then not the parallel regions' synchronisation), and does
the latency of the model's own memory move with it?
    PYTHONPATH=. .venv/bin/python benchmarks/results/2026-11-30-xeon-amx/stack_warmup.py base 40
"""
import statistics
import sys
import time

import torch

from benchmarks import scatter_probe
from benchmarks.decode_bench import build_in_dtype, gather_groups
from modeling_memoryformer.decode_layer import _stack_plan, fused_ops
from modeling_memoryformer.huge_pages import huge_page_empty
from modeling_memoryformer.memory_kernels import load_fused_kernels

assert load_fused_kernels(), "the fused kernel did not build"
started = time.perf_counter()
model = build_in_dtype("mf", sys.argv[1], "bf16")
print(f"built in {time.perf_counter() - started:.0f} s", flush=True)
ops, bf = fused_ops(), torch.bfloat16
tensors, floats, ints, heads, scaling, head_dim, layers = _stack_plan(model.model, bf, 1).stack
tables = [t for g in gather_groups(model).values() for t in g["tensors"]]
hot = [huge_page_empty((1 << 20, 1024), bf).fill_(1.0)]   # 2 GB
keys = [torch.randn(1, heads, 48, head_dim, dtype=bf) for _ in range(layers)]
values = [torch.randn(1, heads, 48, head_dim, dtype=bf) for _ in range(layers)]
rotary = model.model.rotary_emb.inv_freq.numel() * 2
cos, sin = torch.randn(1, 1, rotary, dtype=bf), torch.randn(1, 1, rotary, dtype=bf)
xs = torch.randn(997, 1, model.config.hidden_size, dtype=bf)
calls = iter(range(10 ** 9))


def stack_ms(threads: int, n: int = 20) -> float:
    torch.set_num_threads(threads)
    times = []
    for _ in range(n):
        x = xs[next(calls) % len(xs)]
        t = time.perf_counter()
        ops.decode_stack(x, keys, values, None, cos, sin, heads, scaling, tensors, floats, ints, [])
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


with torch.inference_mode():
    for block in range(int(sys.argv[2])):
        two, one = stack_ms(2), stack_ms(1)
        own = scatter_probe.read_latency_ns(tables, seed=block)
        buffer = scatter_probe.read_latency_ns(hot, seed=block)
        print(f"{time.strftime('%H:%M:%S')} +{time.perf_counter() - started:5.0f} s  stack 2 threads {two:6.2f} ms, "
              f"1 thread {one:6.2f} ms  latency: tables {own:5.0f} ns, 2 GB buffer {buffer:4.0f} ns", flush=True)
