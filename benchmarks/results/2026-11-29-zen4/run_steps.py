"""Decode steps for the timers of stack_timers.patch: builds a preset (bf16 or int8, as decode_bench does), then runs
`calls` greedy `generate` calls of 33 tokens after a 16-token prompt, and prints the time per token. With the patch
applied (`git apply benchmarks/results/2026-11-29-zen4/stack_timers.patch`, then
`python scripts/generate_kernel_source.py`), the kernel prints each part of decode_stack's layers per step at exit;
AB=1 (or AB=2: the other parity) alternates the code before and after a change step by step (SPANMAX=3: the span
order for units of at most 3 spans; AHEAD, BAHEAD: the prefetch distances tried), "A" and "B" columns.

    AB=1 SPANMAX=3 PYTHONPATH=. .venv/bin/python benchmarks/results/2026-11-29-zen4/run_steps.py base 12 bf16
"""
import sys
import time

import torch

from benchmarks.decode_bench import build_in_dtype
from modeling_memoryformer.memory_kernels import uses_fused

torch.set_num_threads(2)
uses_fused(torch.zeros(1))  # builds the fused kernel before the model
preset, calls = sys.argv[1], int(sys.argv[2])
storage = sys.argv[3] if len(sys.argv) > 3 else "bf16"
model = build_in_dtype("mf", preset, storage)
model.generation_config.eos_token_id = None
ids = torch.randint(0, model.config.vocab_size - 1, (1, 16))
kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=33, do_sample=False, pad_token_id=0)
with torch.inference_mode():
    model.generate(ids, **kwargs)
    start = time.perf_counter()
    for _ in range(calls):
        model.generate(ids, **kwargs)
    seconds = time.perf_counter() - start
print(f"{preset} {storage}: {seconds / calls / 33 * 1e3:.2f} ms per token (prefill included)", flush=True)
