"""Where a bf16 MemoryFormer's decode step goes: timers around the decode loop's stack call and the LM head's fused
pass (class-level wrappers, as decode_bench's StepClock), with a read probe before each `generate` call. Since
2026-11-29g the loop's session steps run the head's pass in their own kernel call; here they leave it to its own call
(`decode_loop._FUSED_HEAD = False`), so that the two are timed apart.

    PYTHONPATH=. .venv/bin/python benchmarks/results/2026-11-28-zen4-night/where.py base [calls, default 6]
"""
import statistics
import sys
import time

import torch

import modeling_memoryformer.decode_loop as decode_loop
from benchmarks.decode_bench import build_in_dtype
from modeling_memoryformer.evaluation.cpu_load import memory_read_gbps
from modeling_memoryformer.modeling_memoryformer import MemoryFormerLMHead

torch.set_num_threads(2)
preset = sys.argv[1] if len(sys.argv) > 1 else "base"
model = build_in_dtype("mf", preset, "bf16")
model.generation_config.eos_token_id = None
head_bytes = model.get_output_embeddings().weight.nbytes
seconds = {"stack": [], "head": []}
starts: list[float] = []   # when each head call starts: a decode step is the interval between two


def timed(cls, name: str, key: str) -> None:
    method = getattr(cls, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        if key == "head":
            starts.append(start)
        out = method(*args, **kwargs)
        seconds[key].append(time.perf_counter() - start)
        return out

    setattr(cls, name, wrapper)


decode_loop._FUSED_HEAD = False  # the session's steps leave the head to its own call, which is timed apart
timed(decode_loop._StackSession, "step", "stack")
timed(MemoryFormerLMHead, "logits_and_argmax", "head")
ids = torch.randint(0, model.config.vocab_size - 1, (1, 16))
kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=33, do_sample=False, pad_token_id=0)
for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 6):
    for values in (*seconds.values(), starts):
        values.clear()
    probe = memory_read_gbps(repeats=2)
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        total = time.perf_counter() - start
    stack, head = (statistics.median(seconds[key][1:]) * 1e3 for key in ("stack", "head"))
    step = statistics.median(b - a for a, b in zip(starts[1:], starts[2:])) * 1e3
    print(f"probe {probe:.1f} GB/s, generate (prefill + 33 tokens) {total * 1e3:.0f} ms, step {step:.2f} ms: stack "
          f"{stack:.2f} ms, head {head:.2f} ms ({head_bytes / head / 1e6:.1f} GB/s), "
          f"the rest {step - stack - head:.2f} ms", flush=True)
