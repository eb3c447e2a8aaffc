"""In-process A/B: the decode stack growing the KV cache in place (default) against a copy into a new buffer every
step (the marks taken off after each step: an allocation and a whole-cache copy per layer and step, what torch.cat
cost). Usage: PYTHONPATH=. python benchmarks/results/2026-11-27-zen3-head-registers/kv_ab.py small bf16 512"""
import statistics
import sys

import torch
from transformers import LogitsProcessorList

import modeling_memoryformer.modeling_memoryformer as modeling
from benchmarks.decode_bench import StepClock, build_in_dtype
from modeling_memoryformer import decode_layer, memory_kernels

memory_kernels.get_kernel()
torch.set_num_threads(2)
preset, storage, prompt_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = build_in_dtype("mf", preset, storage)
model.generation_config.eos_token_id = None
prompt = torch.randint(0, 1000, (1, prompt_len), generator=torch.Generator().manual_seed(0))
stack_step = decode_layer.decode_stack_step


def unmarked(model, hidden, mask, rotary, cache, kwargs):
    """The stack's step, then every layer's mark removed: the next step copies every layer into a new buffer."""
    out = stack_step(model, hidden, mask, rotary, cache, kwargs)
    for layer in cache.layers if out is not None else ():
        vars(layer.keys).pop(decode_layer._ROOM, None)
        vars(layer.values).pop(decode_layer._ROOM, None)
    return out


def run(in_place: bool):
    modeling.decode_stack_step = stack_step if in_place else unmarked
    clock = StepClock()
    with torch.inference_mode():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=48, do_sample=False,
                             pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
    modeling.decode_stack_step = stack_step
    return statistics.median(clock.step_seconds()) * 1e3, out


times, outputs = {True: [], False: []}, {}
run(True)  # warm-up
for _ in range(4):
    for mode in (True, False):
        ms, outputs[mode] = run(mode)
        times[mode].append(ms)
assert torch.equal(outputs[True], outputs[False])
print(f"{preset} {storage} prompt {prompt_len}: in place {statistics.median(times[True]):.2f} ms/step "
      f"{[round(x, 2) for x in times[True]]}, copy per step {statistics.median(times[False]):.2f} "
      f"{[round(x, 2) for x in times[False]]}")
