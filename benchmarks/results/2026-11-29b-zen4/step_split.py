"""Where a decode step goes at the Python level: builds a preset (bf16 or int8, as decode_bench does), runs `calls`
greedy `generate` calls of 33 tokens after a 16-token prompt, and prints the time of the decode loop's stack calls
(`_StackSession.step`: embedding, `decode_stack`, final norm), of the LM head's logits-and-argmax pass, and of the whole
call, per call and per decode token; with `faults`, the minor page faults per call too.

    PYTHONPATH=. .venv/bin/python benchmarks/results/2026-11-29b-zen4/step_split.py base 6 bf16
"""
import resource
import sys
import time
from collections import defaultdict

import torch

import modeling_memoryformer.decode_loop as decode_loop
from benchmarks.decode_bench import build_in_dtype
from modeling_memoryformer.memory_kernels import uses_fused
from modeling_memoryformer.modeling_memoryformer import MemoryFormerLMHead

seconds, counts = defaultdict(float), defaultdict(int)


def timed(owner, name: str, key: str) -> None:
    method = getattr(owner, name)

    def run(*args, **kwargs):
        start = time.perf_counter()
        out = method(*args, **kwargs)
        seconds[key] += time.perf_counter() - start
        counts[key] += 1
        return out

    setattr(owner, name, run)


torch.set_num_threads(2)
uses_fused(torch.zeros(1))  # builds the fused kernel before the model
timed(decode_loop._StackSession, "step", "stack step")
timed(MemoryFormerLMHead, "logits_and_argmax", "LM head")
preset, calls, storage = sys.argv[1], int(sys.argv[2]), sys.argv[3]
model = build_in_dtype("mf", preset, storage)
model.generation_config.eos_token_id = None
ids = torch.randint(0, model.config.vocab_size - 1, (1, 16))
kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=33, do_sample=False, pad_token_id=0)
with torch.inference_mode():
    model.generate(ids, **kwargs)
    seconds.clear()
    counts.clear()
    timed(type(model), "generate", "generate")
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        model.generate(ids, **kwargs)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
for key, total in seconds.items():
    print(f"{key:12s} {total / counts[key] * 1e3:8.3f} ms a call, {counts[key] / calls:.0f} a generate call: "
          f"{total / calls / 32 * 1e3:.3f} ms per decode token")
print(f"{faults / calls:.0f} minor page faults per generate call")
