"""One process of the A/B of two kernels: `python ab_kernels.py <checkout> <preset>`, run from outside both checkouts.

MF-<preset> bf16 built as decode_bench builds it, 1 untimed and 4 timed `generate` calls of 64 greedy tokens after a
128-token prompt; prints the median step (decode_bench's StepClock), the best read probe around the calls and the last
tokens as one JSON line. The calls must give the same tokens.
"""

import json
import statistics
import sys

root, preset = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)

import torch

from benchmarks.common import memory_read_gbps
from benchmarks.decode_bench import StepClock, build_in_dtype

torch.set_num_threads(2)
model = build_in_dtype("mf", preset, "bf16")
model.generation_config.eos_token_id = None
prompt = torch.randint(0, model.config.vocab_size - 1, (1, 128), generator=torch.Generator().manual_seed(0))
kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=64, do_sample=False, pad_token_id=0)
steps, probes = [], []
with torch.inference_mode():
    first = model.generate(prompt, **kwargs)
    for _ in range(4):
        probes.append(memory_read_gbps(repeats=2))
        clock = StepClock()
        extra, handle = clock.attach(model, "eager")
        out = model.generate(prompt, **extra, **kwargs)
        if handle is not None:
            handle.remove()
        steps += clock.step_seconds()
        assert torch.equal(out, first)
    probes.append(memory_read_gbps(repeats=2))
print(json.dumps({"root": root, "step_ms": statistics.median(steps) * 1e3, "probe": max(probes),
                  "tokens": first[0, -8:].tolist()}))
