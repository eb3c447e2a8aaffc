"""Run during this morning's slow phase (04:05-04:15 UTC): MF-base's decode stack (`decode_stack`, every decoder layer
of a step, no LM head; another hidden state per call) timed in rounds of 10 calls on 1 thread and 10 on 2, beside a
single-thread pointer chase over a 2 GB buffer on transparent huge pages (chase.c: each load's address is the word the
load before it returned). It ran from /tmp as a development script with the same code; only the paths and the layout
differ here. Stopped by hand after 183 rounds.
    cc -O2 -shared -fPIC benchmarks/results/2026-11-30-xeon-amx/chase.c -o /tmp/chase.so
    PYTHONPATH=. .venv/bin/python benchmarks/results/2026-11-30-xeon-amx/slow_phase_threads.py base 200
"""
import ctypes
import statistics
import sys
import time

import torch

from benchmarks.decode_bench import build_in_dtype
from modeling_memoryformer.decode_layer import _stack_plan, fused_ops
from modeling_memoryformer.huge_pages import huge_page_empty
from modeling_memoryformer.memory_kernels import load_fused_kernels

lib = ctypes.CDLL("/tmp/chase.so")
lib.chase.restype = ctypes.c_double
lib.chase.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
lines = (2 << 30) // 64
buf = huge_page_empty((lines * 8,), torch.int64)
perm = torch.randperm(lines)
nxt = torch.empty(lines, dtype=torch.int64)
nxt[perm] = torch.roll(perm, -1)
buf.view(lines, 8)[:, 0] = nxt
out = ctypes.c_uint64()


def latency_ns():
    return min(lib.chase(buf.data_ptr(), int(perm[i * 1000]), 100000, ctypes.byref(out)) for i in range(3)) * 1e9


model = build_in_dtype("mf", sys.argv[1], "bf16")
load_fused_kernels()
ops, bf = fused_ops(), torch.bfloat16
tensors, floats, ints, heads, scaling, head_dim, L = _stack_plan(model.model, bf, 1).stack
keys = [torch.randn(1, heads, 48, head_dim, dtype=bf) for _ in range(L)]
vals = [torch.randn(1, heads, 48, head_dim, dtype=bf) for _ in range(L)]
cos = torch.randn(1, 1, model.model.rotary_emb.inv_freq.numel() * 2, dtype=bf)
sin = torch.randn_like(cos)
xs = [torch.randn(1, model.config.hidden_size, dtype=bf) for _ in range(997)]
it = iter(range(10 ** 9))


def dyn():
    x = xs[next(it) % 997]
    return ops.decode_stack(x, keys, vals, None, cos, sin, heads, scaling, tensors, floats, ints, [])[0]


with torch.inference_mode():
    for _ in range(int(sys.argv[2])):
        lat = latency_ns()
        r = {}
        for th in (1, 2):
            torch.set_num_threads(th)
            v = []
            for _ in range(10):
                t = time.perf_counter()
                dyn()
                v.append(time.perf_counter() - t)
            r[th] = statistics.median(v) * 1e3
        torch.set_num_threads(2)
        print(time.strftime("%H:%M:%S"), f"chase {lat:.0f} ns  stack 1T {r[1]:.2f} ms  2T {r[2]:.2f} ms  ratio "
              f"{r[1] / r[2]:.2f}", flush=True)
