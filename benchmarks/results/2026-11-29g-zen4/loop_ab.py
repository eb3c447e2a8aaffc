"""MemoryFormer's decode loop at the start of 2026-11-29g against the current one, alternating `generate` calls in
one process (the order swapped every pair), both timed by decode_bench's StepClock, with a read probe before each
pair. The old loop is a copy of modeling_memoryformer/decode_loop.py as it was before the change (its session calls
`decode_stack` with the embedding, the rotary rows and the final norm in Python, and the LM head apart):

    git show cabde9c:modeling_memoryformer/decode_loop.py > modeling_memoryformer/_old_loop.py
    PYTHONPATH=. .venv/bin/python benchmarks/results/2026-11-29g-zen4/loop_ab.py small 16 87.96
    rm modeling_memoryformer/_old_loop.py

Arguments: the preset, the pairs, and optionally the model's bytes per step in MB (then each step's share of the
probe is printed). Both loops run the same kernel build (the rotation change is in both).
"""
import statistics
import sys

import torch

import modeling_memoryformer._old_loop as old
import modeling_memoryformer.decode_loop as new
from benchmarks.decode_bench import StepClock, build_in_dtype
from modeling_memoryformer.evaluation.cpu_load import memory_read_gbps

torch.set_num_threads(2)
model = build_in_dtype("mf", sys.argv[1], "bf16")
model.generation_config.eos_token_id = None
ids = torch.randint(0, model.config.vocab_size - 1, (1, 16))
kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=33, do_sample=False, pad_token_id=0)
mb = float(sys.argv[3]) if len(sys.argv) > 3 else None
steps = {"old": [], "new": []}
outputs = {}
cls = type(model)
with torch.inference_mode():
    for pair in range(int(sys.argv[2])):
        probe = memory_read_gbps(repeats=2)
        line = []
        for name in ("old", "new") if pair % 2 == 0 else ("new", "old"):
            cls._sample = (old if name == "old" else new).sample
            clock = StepClock()
            extra, handle = clock.attach(model, "eager")
            outputs.setdefault(name, model.generate(ids, **kwargs))
            handle.remove()
            step = statistics.median(clock.step_seconds()) * 1e3
            steps[name].append(step)
            line.append(f"{name} {step:.3f} ms" + (f" ({mb / step / probe * 100:.0f}%)" if mb else ""))
        print(f"probe {probe:.1f} GB/s | " + " | ".join(line), flush=True)
print("same tokens:", torch.equal(outputs["old"], outputs["new"]))
for name, values in steps.items():
    print(f"{name}: median step {statistics.median(values):.3f} ms")
print(f"old - new, per pair: median {statistics.median(a - b for a, b in zip(steps['old'], steps['new'])) * 1e3:.0f} us")
