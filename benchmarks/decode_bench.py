"""Decode at the memory bound: MF-<preset> against its Pythia-shaped twin, each step's tokens/s beside the bytes that
step must read and the machine's read bandwidth measured in the same run.

    python -m benchmarks.decode_bench                                  # MF-tiny, -small, -base; bf16 and int8
    python -m benchmarks.decode_bench --presets tiny --storage bf16 --batches 1 --paths eager

What a decode step must read (computed from the model, `step_bytes`): the K table rows of every Memory Layer for
every sequence of the batch (int8: the codes and their row scale and offset), the LM head whole (both models: the
few-row pass reads it once for up to 4 sequences), every other weight matrix whole (the twin), norms, biases, one
embedding row per sequence, and the KV cache each sequence attends over (its mean length over the timed steps).
Efficiency = bytes per step x steps per second / the read bound: the best of two probes over a 128 MB buffer, its
lines flushed from every cache level before each read (`flushed_probe`: a large shared L3 otherwise serves part of it),
on transparent huge pages as both models' weights are (`cpu_load.stream_buffer`), all threads, measured in the same
worker before and after the timing and around each timed `generate` call: `torch.sum` and `torch.dot` of the buffer's
halves (a plain streaming read; the sum's cascade reads 70-85% as fast on a Zen 1), so the fraction of the machine's
memory speed the step reaches. Beside it, the share per call (`paired_efficiency`): each timed call's bytes/s over the
better of the two dot probes right before and after it, the median over the calls; where the host moves the memory
speed between minutes (14 and 24 GB/s on the Zen 1 of docs/performance.md), it pairs each call's steps with the bound
of its own minute. 1.0 is the bound; a latency-bound gather of scattered rows cannot quite reach it. Older results:
before 2026-11-28 the probes read 4 KB pages (up to a quarter slower there); before 2026-11-30 (no "probe_flushed")
the buffer was not flushed; without "read_gbps" the bound is the sum's.

The read bound suits streamed weights; MemoryFormer's table rows are scattered reads, a few KB each at unrelated
addresses, which a machine serves at a fraction of its streaming speed, set by its memory latency (benchmarks/results/
2026-11-30-xeon-amx: 4-11 GB/s for 0.5-3 KB spans against 27 GB/s streamed). So each MemoryFormer cell also probes
that rate on the model's own tables (`benchmarks.scatter_probe.step_read_gbps`: the rows decode steps read, layer by
layer, a random row per table and sequence, per row width, whole rows dealt to the threads in turn, right before and
after each timed call; int8: rows of the [R, d + 8] block of codes, scale and offset) and states the step against the
read + gather bound: rows at the probe's rate, every other byte at the read bound ("share of read + gather bound", per
call as above). It is a reference more than a hard bound: the kernel reads the same rows with another loop (one token's row
split over the threads), and a share above 100% means it beat the probe's loop. Beside the rates, the latency behind
them (`table_latency_ns`: one thread's dependent reads at random row starts of all the tables, after each timed call):
on a virtual machine it grows with the tables' footprint (62 ns over 64 MB, 313 over 1 GB, 819 over 12 GB on that
Xeon), and the rows a step can keep in flight over that latency set the gather rate.

Before the timed calls, `--warmup` untimed ones and more until `--warmup-s` seconds (10) have passed (`warm_up`, their
step times kept in the results): a model just built decoded several times slower for its first seconds there.

The step time is read inside one `generate` call: the LM head records when every step reaches it (MemoryFormer's head
class with its methods wrapped for the call, the twin's head with a forward pre-hook, a logits processor where the step
is compiled: `StepClock`), and the median interval between consecutive steps after the first (which follows the
prefill) is the step time. So the prefill and `generate`'s setup are out of it, and what is
timed is what a user's plain `generate` spends per token (a logits processor of one's own would make MemoryFormer's
loop check the model at every step: modeling_memoryformer/decode_loop.py).

Paths (both models take each):
- eager: `generate` with the dynamic KV cache, as transformers runs by default. Attention: a decode step's single
  query position runs the fused kernel's decode attention in both models (MemoryFormer does by default; the twin is
  given it as its attention implementation, `modeling_memoryformer.decode_attention_forward`), so the attention is
  the same code in both; the prefill runs scaled_dot_product_attention in both. In bf16 every linear of the twin
  (its LM head and weight matrices) runs the few-row pass MemoryFormer's LM head runs (`use_few_row_linears`).
- compiled: `generate(cache_implementation="static", compile_config=CompileConfig(...))`: the decode step compiled
  by torch.compile (Inductor's C++ backend on the CPU) over a static KV cache (`modeling_memoryformer.compiled_decode_kwargs`).
  Its first call compiles; the timing is of later calls. The greedy tokens are checked against the eager path's.

Storage: bf16 (every parameter bfloat16, both models) and int8 (MemoryFormer: int8 tables and int8 LM head, the rest
float32; the twin: PyTorch's dynamic int8 Linear for every nn.Linear, the LM head included, the rest float32).

Paired cells (`--paired-paths`, eager by default): after the two cells of a preset, storage and path, a third process
builds both models and alternates their timed calls (`run_pair`), so each pair's ratio compares calls of the same
minute; the cells' "vs twin" divides tokens/s measured minutes apart, which on a host whose memory speed moves can
move the ratio by a third between runs (MF-base int8 3.55x and 5.36x on one Zen 4 guest an hour apart).
`--pair-mixed` adds a paired cell with each model on its faster path: MemoryFormer eager (its fused decode stack, in
one call a step; compiled, the same stack over the static cache, `decode_stack_static`, behind Dynamo's guards and
Inductor's wrapper), the twin compiled (transformers' modules, 18-38% of their bound when eager).

Each cell runs in a fresh subprocess, so its peak RSS (VmHWM: build + decode) is its own. MemoryFormer and its twin
are built on the meta device and materialised in their storage dtype (`build_in_dtype`): MF-base in bf16 never
exists in float32 (13.5 GB instead of 27).
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from modeling_memoryformer.evaluation.cpu_load import stream_buffer

from . import scatter_probe
from .common import (
    GB,
    MB,
    NOISY_CORES,
    REPO_ROOT,
    cpu_snapshot,
    environment,
    memory_read_gbps,
    memory_stream_gbps,
    other_cores_since,
    peak_rss_bytes,
    use_few_row_linears,
)

PRESETS = ("tiny", "small", "base")
STORAGES = ("bf16", "int8")
PATHS = ("eager", "compiled")
MF_NAMES = {"tiny": "MF-tiny", "small": "MF-small", "base": "MF-base"}
TWIN_NAMES = {"tiny": "Pythia-70M-shaped twin", "small": "Pythia-160M-shaped twin", "base": "Pythia-410M-shaped twin"}


# ---------------------------------------------------------------------------------------------------------------------
# Models, built in their storage dtype


def model_config(kind: str, preset: str, storage: str):
    from .model_bench import ModelSpec
    from .model_bench import model_config as bench_config

    config = bench_config(kind, preset, ModelSpec())
    if kind == "mf" and storage == "int8":
        config.table_dtype = "int8"
        config.lm_head_dtype = "int8"
        config.tie_word_embeddings = False
    return config


def build_in_dtype(kind: str, preset: str, storage: str, seed: int = 0):
    """The model on the meta device, materialised on the CPU in its storage dtype and initialised there (bf16: every
    tensor bfloat16 from the start; int8: float32 except MemoryFormer's int8 tables and head; the twin's linears are
    then swapped for dynamic int8 ones, one at a time, so the float32 twin exists once), its large weights then
    moved onto huge pages."""
    from transformers import GPTNeoXForCausalLM

    from modeling_memoryformer import MemoryFormerForCausalLM
    from modeling_memoryformer.huge_pages import place_on_huge_pages

    config = model_config(kind, preset, storage)
    cls = MemoryFormerForCausalLM if kind == "mf" else GPTNeoXForCausalLM
    dtype = torch.bfloat16 if storage == "bf16" else torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights()
        for module in model.modules():  # the init skips buffers: the rotary tables are recomputed on the CPU
            if type(module).__name__.endswith("RotaryEmbedding"):
                _reset_rotary(module, model.config)
    model.eval()
    if kind == "twin":
        use_decode_attention(model)
    if kind == "twin" and storage == "bf16":
        use_few_row_linears(model)
    if kind == "twin" and storage == "int8":
        model = dynamic_int8_in_place(model)
    # Both models' large weights on huge pages, as from_pretrained leaves a MemoryFormer (huge_pages.py; the int8
    # twin's packed linears are FBGEMM's own objects and stay where FBGEMM put them).
    place_on_huge_pages(model)
    return model


def use_decode_attention(model) -> None:
    """The twin's attention as MemoryFormer's: the fused decode attention for a decode step, SDPA otherwise."""
    from transformers import AttentionInterface

    from modeling_memoryformer.modeling_memoryformer import decode_attention_forward

    AttentionInterface.register("memoryformer_decode", decode_attention_forward)
    model.set_attn_implementation("memoryformer_decode")


def _reset_rotary(module, config) -> None:
    """Recompute a rotary embedding's inv_freq (a buffer `to_empty` left uninitialised)."""
    if hasattr(module, "compute_default_rope_parameters"):
        inv_freq, scaling = module.compute_default_rope_parameters(config, device="cpu")
    else:
        inv_freq, scaling = module.rope_init_fn(module.config, "cpu")
    module.inv_freq = inv_freq.to(module.inv_freq.dtype)
    if hasattr(module, "original_inv_freq"):
        module.original_inv_freq = module.inv_freq
    module.attention_scaling = scaling


def dynamic_int8_in_place(model):
    """Every nn.Linear (the LM head too) swapped for PyTorch's dynamic int8 Linear, module by module."""
    import warnings

    with warnings.catch_warnings():  # torch.ao's quantized modules are deprecated (still PyTorch's int8 Linear)
        warnings.simplefilter("ignore")
        from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
        from torch.ao.quantization import default_dynamic_qconfig

        for name, module in list(model.named_modules()):
            if type(module) is torch.nn.Linear:
                module.qconfig = default_dynamic_qconfig
                parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
                setattr(parent, name.rpartition(".")[2], DynamicLinear.from_float(module))
                del module
                gc.collect()
    return model


# ---------------------------------------------------------------------------------------------------------------------
# What a step reads


def _tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def step_bytes(model, batch: int, context: float) -> dict:
    """Bytes one decode step reads, by part: `batch` sequences, each attending over `context` cached positions.

    MemoryFormer: per Memory Layer and sequence, its K rows (d_out values each, int8: d_out codes + 8 bytes of scale
    and offset) and its bias; the twin: every weight matrix whole (a dynamic int8 Linear: its int8 weight, scales and
    bias). Both: the LM head whole once per step, norms, one embedding row per sequence, and the KV cache of every
    attention layer (keys and values, `context` positions each, in the cache's dtype)."""
    from modeling_memoryformer.memory_layer import MemoryLayer

    parts = {"rows": 0, "weights": 0, "head": 0, "norms": 0, "embedding": 0, "kv_cache": 0}
    config = model.config
    head = model.get_output_embeddings()
    counted: set[int] = set()

    def once(t) -> int:
        if t is None or id(t) in counted:
            return 0
        counted.add(id(t))
        return _tensor_bytes(t)

    for name, module in model.named_modules():
        if isinstance(module, MemoryLayer):
            if module.tables is not None:
                row = module.out_features * module.tables.element_size()
            else:
                row = module.tables_codes.shape[1] + 8  # codes + float32 scale and offset
            parts["rows"] += batch * module.num_tables * row
            parts["rows"] += once(module.bias)
            counted.update(id(t) for t in (module.tables, getattr(module, "tables_codes", None)) if t is not None)
        elif module is head or name.endswith("lm_head") or name.endswith("embed_out"):
            parts["head"] += sum(_module_weight_bytes(module))
            counted.update(id(p) for p in module.parameters())
        elif isinstance(module, torch.nn.Embedding):
            parts["embedding"] += batch * module.weight.shape[1] * module.weight.element_size()
            counted.add(id(module.weight))
        elif isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)) or "Norm" in type(module).__name__:
            parts["norms"] += sum(once(p) for p in module.parameters(recurse=False))
        elif _is_linear(module):
            parts["weights"] += sum(_module_weight_bytes(module))
            counted.update(id(p) for p in module.parameters())
    kv_dtype = _kv_dtype(model)
    layers, hidden = config.num_hidden_layers, config.hidden_size
    parts["kv_cache"] = int(batch * 2 * layers * context * hidden * torch.empty((), dtype=kv_dtype).element_size())
    parts["total"] = sum(parts.values())
    return parts


def _is_linear(module) -> bool:
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Linear" and hasattr(module, "_packed_params")


def _module_weight_bytes(module) -> list[int]:
    """The bytes of a linear-like module's weight and bias: float, the MemoryFormer int8 head, or torch.ao's dynamic
    int8 Linear (int8 weight + one float32 scale per output row + bias)."""
    if hasattr(module, "_packed_params"):
        weight, bias = module._packed_params._weight_bias()
        scales = weight.q_per_channel_scales() if weight.qscheme() in (torch.per_channel_affine,
                                                                        torch.per_channel_symmetric) else None
        return [weight.numel(), 4 * weight.shape[0] if scales is not None else 8, _tensor_bytes(bias)]
    return [_tensor_bytes(t) for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))]


def gather_groups(model) -> dict[int, dict]:
    """MemoryFormer's tables by the bytes of a row: {row bytes: {"tensors": the tables (int8: the block of codes and
    row scales and offsets the lookup reads), "tables": each one's K, "rows": the rows one token reads from them
    (their K summed)}}, in the layers' order. The twin has none."""
    from modeling_memoryformer.memory_layer import MemoryLayer

    groups: dict[int, dict] = {}
    for module in model.modules():
        if isinstance(module, MemoryLayer):
            if module.tables is not None:
                tables = module.tables
            else:   # int8: the [R, d + 8] block of codes, scale and offset the kernel reads rows of
                block = module._int8_tables()[3] if module.tables_codes.device.type == "cpu" else None
                tables = block if block is not None else module.tables_codes
            group = groups.setdefault(tables.shape[1] * tables.element_size(), {"tensors": [], "tables": [],
                                                                                "rows": 0})
            group["tensors"].append(tables.detach())
            group["tables"].append(module.num_tables)
            group["rows"] += module.num_tables
    return groups


def gather_rates(groups: dict[int, dict], batch: int, threads: int, seed: int) -> dict[str, float]:
    """GB/s of each group's rows as decode steps of `batch` sequences read them (`scatter_probe.step_read_gbps`: layer
    by layer, a random row per table and sequence, whole rows dealt to `threads` threads, at least
    scatter_probe.MIN_PROBE_BYTES)."""
    return {str(width): round(scatter_probe.step_read_gbps(g["tensors"], g["tables"], batch, threads,
                                                           seed=seed + width), 2)
            for width, g in groups.items()}


def table_latency_ns(groups: dict[int, dict], seed: int) -> float:
    """Nanoseconds per dependent read at random row starts of all the model's tables (`scatter_probe.read_latency_ns`):
    the memory latency the step's gathers hide behind their prefetches, address translation over the tables' whole
    footprint included (it grows with the footprint on virtual machines: benchmarks/results/2026-11-30-xeon-amx)."""
    return scatter_probe.read_latency_ns([t for g in groups.values() for t in g["tensors"]], seed=seed)


def gather_bound_s(groups: dict[int, dict], batch: int, total_bytes: float, gather: dict[str, float],
                   read_gbps: float) -> float:
    """Seconds a step needs at the read + gather bound: each group's rows at its scattered-read rate, every other byte
    (the LM head, norms, biases, the KV cache, int8 row scales) at the read bound."""
    rows = {width: batch * g["rows"] * width for width, g in groups.items()}
    gathered = sum(b / (gather[str(width)] * 1e9) for width, b in rows.items())
    return gathered + (total_bytes - sum(rows.values())) / (read_gbps * 1e9)


def _kv_dtype(model) -> torch.dtype:
    """The dtype the KV cache holds: the attention input's, i.e. the model's float dtype (an int8-table model
    computes in float32)."""
    for p in model.parameters():
        if p.is_floating_point() and p.dim() == 1:  # a norm weight: the activations' dtype
            return p.dtype
    return torch.float32


# ---------------------------------------------------------------------------------------------------------------------
# Timing one cell (in its own process)


class StepClock:
    """Records when each step reaches the LM head, changing nothing: MemoryFormer's head class (`MemoryFormerLMHead`)
    with its `forward` and `logits_and_argmax` wrapped for the call (a hook on the head would make MemoryFormer's loop
    call the head as a module and take the argmax apart, and a logits processor of one's own would make it check the
    model again at every step, modeling_memoryformer/decode_loop.py), and the loop's session steps that run the head's
    pass inside their kernel call (`_StackSession.step` with the head: recorded as the step starts, so one time per
    step either way); any other head (the twin's) with a forward pre-hook; where the step is compiled (a hook would be
    traced into it), as a logits processor (called with the step's logits)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores

    def hook(self, module, args) -> None:
        self.times.append(time.perf_counter())

    def attach(self, model, path: str) -> tuple[dict, object | None]:
        """(generate keywords, a hook handle to remove): the hook on the LM head, or for the compiled path a
        logits processor."""
        from transformers import LogitsProcessorList

        from modeling_memoryformer.modeling_memoryformer import MemoryFormerLMHead

        if path == "compiled":
            return {"logits_processor": LogitsProcessorList([self])}, None
        head = model.get_output_embeddings()
        if type(head) is MemoryFormerLMHead:
            from modeling_memoryformer.decode_loop import _StackSession

            return {}, _ClassWrap(MemoryFormerLMHead, ("forward", "logits_and_argmax"), self.times,
                                  (_StackSession, "step", lambda session, *args: session.head is not None))
        return {}, head.register_forward_pre_hook(self.hook)

    def step_seconds(self) -> list[float]:
        """Intervals between consecutive steps, the first (after the prefill) left out."""
        return [b - a for a, b in zip(self.times[1:], self.times[2:])]


class _ClassWrap:
    """`names` of class `cls` replaced by wrappers that append perf_counter() to `times` before each call, until
    remove() (a hook handle's interface); `also` (a class, a method name, a test of the call's arguments): that method
    wrapped too, timed where the test holds."""

    def __init__(self, cls, names, times: list, also=None):
        self.saved = [(cls, name, cls.__dict__[name], None) for name in names]
        if also is not None:
            self.saved.append((also[0], also[1], also[0].__dict__[also[1]], also[2]))
        for owner, name, method, test in self.saved:
            def timed(*args, _method=method, _test=test, **kwargs):
                if _test is None or _test(*args):
                    times.append(time.perf_counter())
                return _method(*args, **kwargs)
            setattr(owner, name, timed)

    def remove(self) -> None:
        for owner, name, method, _ in self.saved:
            setattr(owner, name, method)


def generate_kwargs(path: str) -> dict:
    from modeling_memoryformer import compiled_decode_kwargs

    return compiled_decode_kwargs() if path == "compiled" else {}


def run_cell(job: dict) -> dict:
    """Build one model, time its decode at every batch size, and report (in this process)."""
    torch.set_num_threads(job["threads"])
    kind, preset, storage, path = job["kind"], job["preset"], job["storage"], job["path"]
    started = time.perf_counter()
    say = functools.partial(print, "   ", file=sys.stderr, flush=True)
    say(f"building {label(job)} on the meta device, then in {storage} on the CPU")
    model = build_in_dtype(kind, preset, storage, seed=job["seed"])
    build_s = time.perf_counter() - started
    # No end-of-sequence token: every call runs all its steps without `min_new_tokens`, whose processor scans the
    # whole vocabulary every step (0.4 ms on MF-tiny, not the model's time); random weights could emit one.
    model.generation_config.eos_token_id = None
    result = {**job, "build_s": round(build_s, 1), "params": sum(p.numel() for p in model.parameters()),
              "batches": {}}
    gen = torch.Generator().manual_seed(job["seed"])
    cold = flushed_probe(say)
    streams, reads = [memory_stream_gbps(before=cold)], [memory_read_gbps(before=cold)]
    result["probe_flushed"] = cold is not None
    kwargs = generate_kwargs(path)
    groups = gather_groups(model)
    probes = itertools.count()   # a fresh seed, so fresh random rows, for every gather probe
    gathers = functools.partial(gather_rates, groups, threads=job["threads"]) if groups else None
    for batch in job["batches"]:
        prompt = torch.randint(0, model.config.vocab_size - 1, (batch, job["prompt_tokens"]), generator=gen)
        new = job["new_tokens"]
        common = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False, pad_token_id=0)
        cell: dict = {}
        say(f"batch {batch}: {job['warmup']} untimed generate call(s) of {new} tokens (more until "
            f"{job.get('warmup_s', 0):g} s have passed), then {job['repeats']} timed ones"
            + (" (the first compiles)" if path == "compiled" else ""))
        with torch.inference_mode():
            if path != "eager":  # the eager tokens, to check the fast path against
                eager = model.generate(prompt, **common)
            cell["warmup_step_ms"] = warm_up(model, prompt, path, {**common, **kwargs}, job)
            steps, cores, calls, call_gathers, latencies = [], [], [], [], []
            for _ in range(job["repeats"]):
                probe = memory_read_gbps(repeats=2, before=cold)   # the read bound right before the call
                gather = gathers(batch, seed=next(probes)) if gathers else None
                out, call_steps, busy = timed_call(model, prompt, path, {**common, **kwargs})
                cores.append(busy)
                after = memory_read_gbps(repeats=2, before=cold)   # ... and right after it
                reads += [probe, after]
                steps += call_steps
                calls.append((statistics.median(call_steps), max(probe, after)))
                if gathers:
                    later = gathers(batch, seed=next(probes))
                    call_gathers.append({w: max(gather[w], later[w]) for w in gather})
                    latencies.append(table_latency_ns(groups, seed=next(probes)))
            if path != "eager":
                cell["same_tokens_as_eager"] = bool(torch.equal(out, eager))
        step = statistics.median(steps)
        context = job["prompt_tokens"] + new / 2  # mean cached positions a timed step attends over
        cell.update(step_ms=round(step * 1e3, 3), tokens_per_s=round(batch / step, 2),
                    step_ms_p90=round(sorted(steps)[int(0.9 * (len(steps) - 1))] * 1e3, 3),
                    bytes=step_bytes(model, batch, context),
                    other_cores=max((c for c in cores if c is not None), default=None))
        cell["calls"] = [{"step_ms": round(s * 1e3, 3), "bound_gbps": b} for s, b in calls]
        cell["efficiency_per_call"] = paired_efficiency(cell["bytes"]["total"], calls)
        if call_gathers:
            for entry, rates, latency in zip(cell["calls"], call_gathers, latencies):
                entry["gather_gbps"] = rates
                entry["latency_ns"] = round(latency)
            cell["latency_ns"] = round(statistics.median(latencies))
            cell["gather_gbps"] = {w: max(r[w] for r in call_gathers) for w in call_gathers[0]}
            cell["gather_rows_bytes"] = {str(w): batch * g["rows"] * w for w, g in groups.items()}
            cell["efficiency_gather_per_call"] = round(statistics.median(
                gather_bound_s(groups, batch, cell["bytes"]["total"], rates, bound) / seconds
                for (seconds, bound), rates in zip(calls, call_gathers)), 3)
        result["batches"][str(batch)] = cell
    streams.append(memory_stream_gbps(before=cold))
    reads.append(memory_read_gbps(before=cold))
    result["stream_gbps"] = max(streams)   # torch.sum's
    result["stream_gbps_all"] = streams
    result["read_gbps"] = max(reads)       # torch.dot's: a plain streaming read
    result["read_gbps_all"] = reads
    result["bound_gbps"] = read_bound(streams, reads)
    for batch, cell in result["batches"].items():
        cell["gbps"] = round(cell["bytes"]["total"] / (cell["step_ms"] / 1e3) / 1e9, 2)
        cell["efficiency"] = round(cell["gbps"] / result["bound_gbps"], 3)
        cell["efficiency_vs_sum"] = round(cell["gbps"] / result["stream_gbps"], 3)
        if "gather_gbps" in cell:   # the read + gather bound at the cell's best probes
            bound_s = gather_bound_s(groups, int(batch), cell["bytes"]["total"], cell["gather_gbps"],
                                     result["bound_gbps"])
            cell["gather_bound_ms"] = round(bound_s * 1e3, 3)
            cell["efficiency_gather"] = round(bound_s * 1e3 / cell["step_ms"], 3)
    result["peak_rss_gb"] = round(peak_rss_bytes() / GB, 2)
    return result


def flushed_probe(say=None):
    """What the read probes run before each timed read: a flush of the probe's buffer from every cache level
    (`scatter_probe.flush_caches`), so each reads DRAM. None (probes unflushed, said through `say`) where the flush
    cannot run: no C compiler, or a CPU other than x86 and aarch64. Unflushed, the 128 MB buffer read back to back
    came partly from the 480 MB L3 of the Xeon guest of benchmarks/results/2026-11-30-xeon-amx (38-48 GB/s on its
    second and third reads; flushed, 32-33.5, as a dot over 2 GB), which made the cell's best probe overstate the
    bound the model's gigabytes of weights and tables are read at."""
    buffer = stream_buffer()
    try:
        scatter_probe.flush_caches(buffer)
    except RuntimeError as exc:
        if say is not None:
            say(f"the read probes run unflushed (their buffer may be read partly from the L3): {exc}")
        return None
    return functools.partial(scatter_probe.flush_caches, buffer)


def warm_up(model, prompt: torch.Tensor, path: str, kwargs: dict, job: dict) -> list[float | None]:
    """Untimed `generate` calls before the timed ones: job["warmup"] of them, and more until job["warmup_s"] seconds
    have passed (default 0). A model just built can decode several times slower for its first seconds on a cloud guest
    (MF-base on the Xeon of benchmarks/results/2026-11-30-xeon-amx: 50-110 ms a step of its stack for about 10 s,
    then 7-10 ms), which a single call does not cover. Returns each call's median step in ms (None: no step timed)."""
    started, out = time.perf_counter(), []
    while len(out) < job["warmup"] or time.perf_counter() - started < job.get("warmup_s", 0.0):
        _, steps, _ = timed_call(model, prompt, path, kwargs)
        out.append(round(statistics.median(steps) * 1e3, 3) if steps else None)
    return out


def timed_call(model, prompt: torch.Tensor, path: str, kwargs: dict) -> tuple[torch.Tensor, list[float], float | None]:
    """One `generate` call with its steps timed (StepClock): (its output, the intervals between its decode steps, other
    processes' cores during it). Raises if it returned fewer or more tokens than asked for."""
    clock = StepClock()
    extra, handle = clock.attach(model, path)
    before = cpu_snapshot()
    try:
        out = model.generate(prompt, **extra, **kwargs)
    finally:
        if handle is not None:
            handle.remove()
    busy = other_cores_since(before)
    new = kwargs["max_new_tokens"]
    if out.shape[1] != prompt.shape[1] + new:
        raise RuntimeError(f"generate returned {out.shape[1] - prompt.shape[1]} tokens, expected {new}")
    return out, clock.step_seconds(), busy


def run_pair(job: dict) -> dict:
    """MemoryFormer and its twin built in one process, their timed `generate` calls alternating (MF, twin, twin, MF,
    MF, twin, ...: each model first in half of the pairs), so that each pair's ratio (the twin's median step time in
    its call over MemoryFormer's in the call beside it) compares two calls of the same minute. The cells' own ratio
    divides tokens/s measured minutes apart, in separate processes, on a host whose memory speed may change between
    them (2-vCPU cloud guests: 21-74 GB/s read by the same probe within an hour, docs/performance.md)."""
    torch.set_num_threads(job["threads"])
    preset, storage = job["preset"], job["storage"]
    paths = {"mf": job["path"], "twin": job.get("twin_path", job["path"])}
    say = functools.partial(print, "   ", file=sys.stderr, flush=True)
    started = time.perf_counter()
    models = {}
    for kind in ("mf", "twin"):
        say(f"building {label({**job, 'kind': kind, 'path': paths[kind]})} on the meta device, then in {storage} on "
            "the CPU")
        models[kind] = build_in_dtype(kind, preset, storage, seed=job["seed"])
        models[kind].generation_config.eos_token_id = None   # every call runs all its steps (as run_cell)
    result = {**job, "build_s": round(time.perf_counter() - started, 1), "batches": {}}
    gen = torch.Generator().manual_seed(job["seed"])
    for batch in job["batches"]:
        prompt = torch.randint(0, models["mf"].config.vocab_size - 1, (batch, job["prompt_tokens"]), generator=gen)
        common = {kind: dict(attention_mask=torch.ones_like(prompt), max_new_tokens=job["new_tokens"], do_sample=False,
                             pad_token_id=0, **generate_kwargs(paths[kind])) for kind in paths}
        say(f"batch {batch}: {job['warmup']} untimed call(s) each, then {job['repeats']} pairs of calls, alternating")
        calls = {"mf": [], "twin": []}
        cores = []
        with torch.inference_mode():
            warm = {kind: warm_up(models[kind], prompt, paths[kind], common[kind], job) for kind in ("mf", "twin")}
            for r in range(job["repeats"]):
                for kind in pair_order(r):
                    _, steps, busy = timed_call(models[kind], prompt, paths[kind], common[kind])
                    calls[kind].append(statistics.median(steps))
                    cores.append(busy)
        context = job["prompt_tokens"] + job["new_tokens"] / 2
        ratios = [t / m for m, t in zip(calls["mf"], calls["twin"])]
        result["batches"][str(batch)] = {
            "mf_step_ms": [round(s * 1e3, 3) for s in calls["mf"]],
            "twin_step_ms": [round(s * 1e3, 3) for s in calls["twin"]],
            "ratios": [round(r, 3) for r in ratios], "ratio": round(statistics.median(ratios), 3),
            "mf_warmup_step_ms": warm["mf"], "twin_warmup_step_ms": warm["twin"],
            "bound_on_ratio": round(step_bytes(models["twin"], batch, context)["total"]
                                    / step_bytes(models["mf"], batch, context)["total"], 3),
            "other_cores": max((c for c in cores if c is not None), default=None)}
    result["peak_rss_gb"] = round(peak_rss_bytes() / GB, 2)
    return result


def pair_paths(cell: dict) -> str:
    """A paired cell's path, or both where the twin took another ("MF eager, twin compiled": --pair-mixed)."""
    twin_path = cell.get("twin_path", cell["path"])
    return cell["path"] if twin_path == cell["path"] else f"MF {cell['path']}, twin {twin_path}"


def pair_order(r: int) -> tuple[str, str]:
    """Which model runs first in pair r: MemoryFormer in pairs 0, 2, 4..., the twin in 1, 3, 5... (so a drift of the
    host's speed within a pair favours neither)."""
    return ("mf", "twin") if r % 2 == 0 else ("twin", "mf")


def _worker_main() -> int:
    job = json.loads(sys.argv[2])
    try:
        print(json.dumps(run_pair(job) if job["kind"] == "pair" else run_cell(job)))
    except Exception as exc:  # reported in the results, not hidden
        import traceback

        traceback.print_exc()
        print(json.dumps({**job, "error": f"{type(exc).__name__}: {exc}"}))
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# The run


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode_bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", choices=PRESETS, default=list(PRESETS))
    p.add_argument("--storage", nargs="+", choices=STORAGES, default=list(STORAGES))
    p.add_argument("--paths", nargs="*", choices=PATHS, default=list(PATHS),
                   help="paths of the cells (none: only the --pair-mixed cells)")
    p.add_argument("--compiled-storage", nargs="+", choices=STORAGES, default=["bf16"],
                   help="storages the compiled path runs for (default bf16: the twin's dynamic int8 Linear does not "
                        "compile to anything faster, and compiling is minutes per cell)")
    p.add_argument("--paired-paths", nargs="*", choices=PATHS, default=["eager"],
                   help="paths on which a paired cell follows each MemoryFormer / twin pair of cells: both models in "
                        "one process, their calls alternating, each pair's ratio from calls of the same minute "
                        "(default eager; none: --paired-paths with no value)")
    p.add_argument("--pair-repeats", type=int, default=6, help="pairs of timed calls in a paired cell")
    p.add_argument("--pair-mixed", action="store_true",
                   help="one more paired cell per preset and storage of --compiled-storage: MemoryFormer on the "
                        "eager path (its fused decode stack), the twin compiled (its faster path)")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed generate calls first (the compiled path compiles)")
    p.add_argument("--warmup-s", type=float, default=10.0,
                   help="and more untimed calls until this many seconds have passed (a model just built decodes "
                        "slower for its first seconds on some cloud guests; 0: --warmup calls only)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: every core torch sees)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "benchmarks", "results", "decode"))
    args = p.parse_args(argv)
    if not args.paths and not args.pair_mixed:
        p.error("--paths with no value runs only the --pair-mixed cells: give a path or --pair-mixed")
    if any(b < 1 for b in args.batches) or args.new_tokens < 3 or args.prompt_tokens < 1 or args.pair_repeats < 1:
        p.error("--batches must be >= 1, --new-tokens >= 3 (two timed intervals), --prompt-tokens >= 1 and "
                "--pair-repeats >= 1")
    return args


def jobs(args) -> list[dict]:
    out = []
    for preset in args.presets:
        for storage in args.storage:
            common = dict(preset=preset, storage=storage, batches=args.batches, prompt_tokens=args.prompt_tokens,
                          new_tokens=args.new_tokens, warmup=args.warmup, warmup_s=args.warmup_s, seed=args.seed,
                          threads=args.threads or torch.get_num_threads())
            for path in args.paths:
                if path == "compiled" and storage not in args.compiled_storage:
                    continue
                out += [dict(kind=kind, path=path, repeats=args.repeats, **common) for kind in ("mf", "twin")]
                if path in args.paired_paths:
                    out.append(dict(kind="pair", path=path, repeats=args.pair_repeats, **common))
            if args.pair_mixed and storage in args.compiled_storage:
                out.append(dict(kind="pair", path="eager", twin_path="compiled", repeats=args.pair_repeats, **common))
    return out


def run_job(job: dict) -> dict:
    started = time.perf_counter()
    # the worker's progress and errors go to this terminal as they happen; its result comes back on stdout
    proc = subprocess.run([sys.executable, "-m", "benchmarks.decode_bench", "--worker", json.dumps(job)],
                          cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {**job, "error": f"worker exited {proc.returncode} with no result (its error is printed above)"}
    result = json.loads(lines[-1])
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def read_bound(streams: list[float], reads: list[float]) -> float:
    """The read bandwidth a step's bytes are measured against: the best of every probe around the cell, `torch.sum`'s
    and `torch.dot`'s (cpu_load.memory_read_gbps: the sum's cascade reads slower than the dot on some CPUs, and the
    bound is what the machine can read, not what one library reduction reaches)."""
    return max([*streams, *reads])


def paired_efficiency(step_bytes_total: float, calls: list[tuple[float, float]]) -> float | None:
    """The median over timed `generate` calls of bytes per step / the call's median step time / the better of the read
    probes taken right before and right after that call: each call against the bound of its own minute. The cell's
    `efficiency` divides by the best probe of the whole cell instead, which on a host whose memory speed moves (the
    2-vCPU Zen 1 of docs/performance.md read 14 GB/s in some minutes and 24 GB/s in others) can pair a slow minute's
    steps with a fast minute's probe, or the reverse."""
    if not calls:
        return None
    return round(statistics.median(step_bytes_total / seconds / 1e9 / bound for seconds, bound in calls), 3)


def label(cell: dict) -> str:
    if cell["kind"] == "pair":
        return f"{MF_NAMES[cell['preset']]} and its twin, paired, {cell['storage']} [{pair_paths(cell)}]"
    name = MF_NAMES[cell["preset"]] if cell["kind"] == "mf" else TWIN_NAMES[cell["preset"]]
    return f"{name} {cell['storage']} [{cell['path']}]"


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return _worker_main()
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    todo = jobs(args)
    from modeling_memoryformer.cpu_facts import cpu_description

    results = {"benchmark": "decode", "environment": {**environment(), "cpu_description": cpu_description()},
               "args": vars(args), "cells": [], "paired": []}
    print(f"decode_bench: {len(todo)} cells (a fresh process each) -> {args.out}", flush=True)
    for i, job in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {label(job)} ...", flush=True)
        cell = run_job(job)
        results["paired" if job["kind"] == "pair" else "cells"].append(cell)
        print("    " + _cell_line(cell), flush=True)
        write(results, args.out)  # after every cell: an interrupted run keeps what it measured
    print(f"wrote {', '.join(write(results, args.out))}")
    return 0


def _cell_line(cell: dict) -> str:
    if "error" in cell:
        return f"error: {cell['error'][:300]}"
    if cell["kind"] == "pair":
        return "; ".join(f"batch {batch}: MemoryFormer {b['ratio']:.2f}x its twin (median of {len(b['ratios'])} "
                         f"pairs, {min(b['ratios']):.2f}-{max(b['ratios']):.2f}x)"
                         for batch, b in cell["batches"].items())
    parts = [f"built in {cell['build_s']} s, peak RSS {cell['peak_rss_gb']} GB, read bound {_bound(cell)} GB/s "
             f"(sum {cell['stream_gbps']}, dot {cell.get('read_gbps', '-')})"]
    for batch, b in cell["batches"].items():
        same = "" if "same_tokens_as_eager" not in b else f", tokens {'==' if b['same_tokens_as_eager'] else '!='} eager"
        per_call = "" if b.get("efficiency_per_call") is None else (
            f" ({100 * b['efficiency_per_call']:.0f}% against the probes around each call)")
        gather = "" if "efficiency_gather" not in b else (
            f", {100 * b['efficiency_gather']:.0f}% of the read + gather bound ({b['gather_bound_ms']} ms; rows at "
            + ", ".join(f"{r} GB/s ({w} B)" for w, r in b["gather_gbps"].items())
            + (f"; latency {b['latency_ns']} ns" if "latency_ns" in b else "") + ")")
        parts.append(f"batch {batch}: {b['tokens_per_s']} tok/s, {b['step_ms']} ms/step, "
                     f"{b['bytes']['total'] / MB:.1f} MB/step, {100 * b['efficiency']:.0f}% of the read bound"
                     f"{per_call}{gather}{same}")
    return "; ".join(parts)


def _bound(cell: dict) -> float:
    """The cell's read bound (a result written before the dot probe existed: its torch.sum stream)."""
    return cell.get("bound_gbps", cell["stream_gbps"])


# ---------------------------------------------------------------------------------------------------------------------
# Report


def pairs(results: dict):
    """(mf cell, twin cell) for every preset, storage and path measured."""
    cells = [c for c in results["cells"]]
    for mf in (c for c in cells if c["kind"] == "mf"):
        twin = next((c for c in cells if c["kind"] == "twin" and all(c[k] == mf[k] for k in
                                                                     ("preset", "storage", "path"))), None)
        yield mf, twin


def markdown(results: dict) -> str:
    env = results["environment"]
    args = results["args"]
    lines = [
        "# Decode against the memory bound",
        "",
        f"CPU: {env.get('cpu_description', env.get('cpu'))}; {env.get('threads')} threads; torch {env.get('torch')}, transformers "
        f"{env.get('transformers')}; {env.get('date', '')}.",
        f"Prompt {args['prompt_tokens']} tokens, {args['new_tokens']} new tokens, greedy; step time: median interval "
        f"between decode steps inside `generate` over {args['repeats']} calls.",
        "Efficiency: bytes the step must read x steps/s / the read bound measured in the same process: the best of "
        "`torch.sum` and `torch.dot` over a 128 MB buffer"
        + (", its lines flushed from the caches before each read," if all(
            c.get("probe_flushed") for c in results["cells"] if "error" not in c) else " (not flushed from the caches)")
        + " before and after the cell and around each timed call "
        "(\"sum / dot\"); \"per call\": the median over the timed calls of each call's bytes/s over the better of the "
        "two `torch.dot` probes right before and after it (`paired_efficiency`). "
        "Peak RSS: the whole process (build + decode).",
        *([f"Runs merged here: {'; '.join(results['runs'])}."] if results.get("runs") else []),
        "",
        "| model | path | batch | tokens/s | ms/step | MB/step | GB/s | sum / dot GB/s | efficiency | per call | "
        "vs twin | bound on ratio | peak RSS GB | build s | other cores |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mf, twin in pairs(results):
        for cell, other in ((mf, twin), (twin, None)):
            if cell is None:
                continue
            if "error" in cell:
                lines.append(f"| {label(cell)} | {cell['path']} | | error: {cell['error'][:120]} ||||||||||||")
                continue
            for batch, b in cell["batches"].items():
                ratio = bound = ""
                o = (other or {}).get("batches", {}).get(batch) if other and "error" not in other else None
                if o:
                    ratio = f"{b['tokens_per_s'] / o['tokens_per_s']:.2f}x"
                    bound = f"{o['bytes']['total'] / b['bytes']['total']:.2f}x"
                per_call = "" if b.get("efficiency_per_call") is None else f"{100 * b['efficiency_per_call']:.0f}%"
                lines.append(
                    f"| {label(cell)} | {cell['path']} | {batch} | {b['tokens_per_s']:.1f} | {b['step_ms']:.2f} | "
                    f"{b['bytes']['total'] / MB:.1f} | {b['gbps']:.1f} | {cell['stream_gbps']:.1f} / "
                    f"{format(cell['read_gbps'], '.1f') if 'read_gbps' in cell else '-'} | "
                    f"{100 * b['efficiency']:.0f}% | {per_call} | {ratio} | {bound} | {cell['peak_rss_gb']:.1f} | "
                    f"{cell['build_s']:.0f} | {_busy(b.get('other_cores'))} |")
    lines += ["", "Bytes per step by part (batch 1): rows / weights / head / norms / embedding / KV cache, MB", ""]
    for cell in results["cells"]:
        if "error" in cell or "1" not in cell["batches"]:
            continue
        b = cell["batches"]["1"]["bytes"]
        lines.append(f"- {label(cell)}: " + " / ".join(f"{b[k] / MB:.2f}" for k in
                                                       ("rows", "weights", "head", "norms", "embedding", "kv_cache")))
    lines += ["", "\"vs twin\": MemoryFormer's tokens/s over its twin's on the same path, storage and batch (cells "
              "measured minutes apart); \"bound on ratio\": the twin's bytes per step over MemoryFormer's, what the "
              "ratio would be if both ran at the same fraction of the read bound."]
    lines += bound_twin_markdown(results)
    lines += gather_markdown(results)
    lines += paired_markdown(results.get("paired", []))
    return "\n".join(lines) + "\n"


def _busy(cores: float | None) -> str:
    """A table's "other cores" cell: marked busy above NOISY_CORES, empty where not measured."""
    if cores is None:
        return ""
    return f"**{cores:.2f} (busy)**" if cores > NOISY_CORES else f"{cores:.2f}"


def bound_twin_markdown(results: dict) -> list[str]:
    """MemoryFormer against a twin that would read at the read bound: its share per call x the bound on the ratio (the
    twins of this benchmark run transformers' module path, well below their bound, which a ratio of tokens/s
    credits to MemoryFormer)."""
    lines = []
    for mf, twin in pairs(results):
        if twin is None or "error" in mf or "error" in twin:
            continue
        for batch, b in mf["batches"].items():
            o = twin["batches"].get(batch)
            if o is None or b.get("efficiency_per_call") is None:
                continue
            bound = o["bytes"]["total"] / b["bytes"]["total"]
            twin_share = "" if o.get("efficiency_per_call") is None else (
                f" (the twin here: {100 * o['efficiency_per_call']:.0f}% per call)")
            lines.append(f"- {label(mf)}, batch {batch}: {100 * b['efficiency_per_call']:.0f}% x {bound:.2f}x = "
                         f"**{b['efficiency_per_call'] * bound:.2f}x**{twin_share}")
    if not lines:
        return []
    return ["", "Against a twin that read at the bound (MemoryFormer's share per call x the bound on the ratio; the "
            "twin's own share beside it):", "", *lines]


def gather_markdown(results: dict) -> list[str]:
    """MemoryFormer's cells against the read + gather bound (none measured: no lines)."""
    rows = []
    for cell in results["cells"]:
        if "error" in cell or cell["kind"] != "mf":
            continue
        for batch, b in cell["batches"].items():
            if "efficiency_gather" not in b:
                continue
            widths = list(b["gather_gbps"])
            mb = " / ".join(f"{b['gather_rows_bytes'][w] / MB:.1f}" for w in widths)
            rates = " / ".join(f"{b['gather_gbps'][w]:.1f}" for w in widths)
            rows.append(
                f"| {label(cell)} | {batch} | {mb} | {' / '.join(widths)} | {rates} | {b['gather_bound_ms']:.2f} | "
                f"{b['step_ms']:.2f} | **{100 * b['efficiency_gather']:.0f}%** | "
                f"{100 * b['efficiency_gather_per_call']:.0f}% | {b.get('latency_ns', '-')} |")
    if not rows:
        return []
    return ["", "## MemoryFormer against the read + gather bound", "",
            "A step's table rows are scattered reads; this bound takes them at the rate this machine served the "
            "rows decode steps read (the model's own tables, layer by layer, a random row per table and sequence, "
            "whole rows dealt to the threads: `benchmarks.scatter_probe`, the best of its prefetch settings, right "
            "before and after each timed call; per row width), and every other byte at the read bound. A reference "
            "more than a hard bound: the kernel reads the same rows with another loop, and a share above 100% means "
            "it beat the probe's. \"per call\": each call against the probes around it. \"latency\": nanoseconds per "
            "dependent read at random row starts of all the tables (one thread, the median over the calls): what the "
            "prefetches hide, address translation over the tables' footprint included.", "",
            "| model | batch | rows MB/step | row bytes | gather GB/s | bound ms | ms/step | share | per call | "
            "latency ns |",
            "|---|---|---|---|---|---|---|---|---|---|", *rows]


def paired_markdown(paired: list[dict]) -> list[str]:
    """The paired cells' table (none: no lines)."""
    if not paired:
        return []
    lines = ["", "## Paired: both models in one process, their calls alternating", "",
             "Each pair: one timed `generate` call of each model, one right after the other (MemoryFormer first in "
             "every other pair); its ratio is the twin's median step time in its call over MemoryFormer's. "
             "Ratio: the median over the pairs.", "",
             "| model | path | batch | MF ms/step (calls) | twin ms/step (calls) | ratio | pairs' range | "
             "bound on ratio | other cores |", "|---|---|---|---|---|---|---|---|---|"]
    for cell in paired:
        if "error" in cell:
            lines.append(f"| {label(cell)} | {pair_paths(cell)} | | error: {cell['error'][:120]} ||||||")
            continue
        for batch, b in cell["batches"].items():
            lines.append(
                f"| {MF_NAMES[cell['preset']]} {cell['storage']} | {pair_paths(cell)} | {batch} | "
                f"{', '.join(f'{x:.2f}' for x in b['mf_step_ms'])} | {', '.join(f'{x:.2f}' for x in b['twin_step_ms'])}"
                f" | **{b['ratio']:.2f}x** | {min(b['ratios']):.2f}-{max(b['ratios']):.2f}x | "
                f"{b['bound_on_ratio']:.2f}x | {_busy(b.get('other_cores'))} |")
    return lines


def plot(results: dict, path: str) -> bool:
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cells = [c for c in results["cells"] if "error" not in c]
    paired = [c for c in results.get("paired", []) if "error" not in c]
    if not cells and not paired:
        return False
    panels = (2 if cells else 0) + (1 if paired else 0)
    fig, axes = plt.subplots(1, panels, figsize=(max(11.0, 6.5 * panels - 1), 4.8), squeeze=False)
    axes = axes[0]
    if paired:
        _plot_paired(axes[-1], paired)
    if not cells:
        return _save(fig, plt, results, path)
    names, eff, rates, colors = [], [], [], []
    for c in cells:
        for batch, b in c["batches"].items():
            names.append(f"{label(c)} b{batch}")
            eff.append(100 * b["efficiency"])
            rates.append(b["tokens_per_s"])
            colors.append("tab:blue" if c["kind"] == "mf" else "tab:gray")
    y = range(len(names))
    axes[0].barh(y, eff, color=colors)
    axes[0].set_yticks(list(y), names, fontsize=7)
    axes[0].axvline(100, color="k", lw=0.8)
    axes[0].axvline(60, color="tab:red", lw=0.8, ls="--")
    axes[0].set_xlabel("% of the measured read bound (bytes per step x steps/s)")
    axes[0].invert_yaxis()
    axes[1].barh(y, rates, color=colors)
    axes[1].set_yticks(list(y), [""] * len(names))
    axes[1].set_xscale("log")
    axes[1].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # decade labels only: no overlapping ticks
    axes[1].set_xlabel("tokens/s (log)")
    axes[1].invert_yaxis()
    return _save(fig, plt, results, path)


def _save(fig, plt, results: dict, path: str) -> bool:
    env = results["environment"]
    fig.suptitle(f"Decode: MemoryFormer (blue) vs Pythia-shaped twins (gray)\n"
                 f"{env.get('cpu_description', env.get('cpu'))}, "
                 f"{env.get('threads')} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_paired(ax, paired: list[dict]) -> None:
    """The paired cells' ratios (the median, a line over the pairs' range) beside the bytes bound on the ratio."""
    names, ratios, low, high, bounds = [], [], [], [], []
    for c in paired:
        for batch, b in c["batches"].items():
            names.append(f"{MF_NAMES[c['preset']]} {c['storage']} b{batch}"
                         + ("" if c.get("twin_path", c["path"]) == c["path"] else " (twin compiled)"))
            ratios.append(b["ratio"])
            low.append(b["ratio"] - min(b["ratios"]))
            high.append(max(b["ratios"]) - b["ratio"])
            bounds.append(b["bound_on_ratio"])
    y = list(range(len(names)))
    ax.barh(y, ratios, xerr=[low, high], color="tab:blue", ecolor="k", capsize=2, label="paired ratio (pairs' range)")
    ax.scatter(bounds, y, color="tab:red", marker="|", s=200, zorder=3, label="bytes bound on the ratio")
    ax.axvline(1, color="k", lw=0.8)
    ax.set_yticks(y, names, fontsize=7)
    ax.set_xlabel("MemoryFormer / twin, calls alternating in one process")
    ax.legend(fontsize=7, loc="upper right")
    ax.invert_yaxis()


def write(results: dict, out: str) -> list[str]:
    written = []
    path = os.path.join(out, "results.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(path + ".tmp", path)
    written.append(path)
    md = os.path.join(out, "results.md")
    with open(md, "w") as f:
        f.write(markdown(results))
    written.append(md)
    png = os.path.join(out, "decode.png")
    if plot(results, png):
        written.append(png)
    return written


if __name__ == "__main__":
    sys.exit(main())
