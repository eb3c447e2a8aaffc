"""Model level: MF-<preset> (every available kernel) vs its GPT-NeoX twin (Pythia shape, random init).

Workloads (float32, batch 1 unless said):
- prefill: one forward of `prefill_tokens` tokens under torch.inference_mode, use_cache=True, logits_to_keep=1
  (same call for both models); tokens/s = prefill_tokens / time.
- decode: `model.generate` of `new_tokens` new tokens from a `prompt_tokens`-token prompt, greedy, KV cache,
  min_new_tokens = max_new_tokens (EOS cannot stop it early); tokens/s = new_tokens / time (the time includes
  the prompt's prefill, the same for both).
- train: forward + backward + fused AdamW step + zero_grad(set_to_none) on a [train_batch, train_seq] batch of random
  tokens (labels = inputs); tokens/s = batch * seq / time. MemoryFormer computes its loss by chunks of
  `config.loss_chunk_tokens` tokens (`memory_ops.linear_cross_entropy`: the [tokens, vocab] logits never exist;
  `--loss-chunk-tokens 0` for the full logits); the twin runs transformers' GPT-NeoX as shipped, and a second twin
  contestant, "[chunked loss]", computes its loss by the same chunked pass, so that the ratio against it is the
  MemoryFormer layers' own share of the training gain.

Speed: per preset, both models are built once in this process and every workload is timed round-robin
(`common.round_robin`) across MF [torch], MF [fused] (when available; same model, kernel switched with
`use_kernel`) and the twin. Peak memory cannot be separated inside one shared process, so it is measured in a
fresh subprocess per (contestant, workload): build the model, run the workload once (training: `rss_train_steps`
steps), read VmHWM. Workloads whose estimated memory does not fit are skipped with the reason, not attempted.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from .common import (
    GB,
    MB,
    NOISY_CORES,
    REPO_ROOT,
    Contestant,
    available_memory_bytes,
    cpu_snapshot,
    current_rss_bytes,
    environment,
    make_progress,
    other_cores_since,
    peak_rss_bytes,
    round_robin,
    summary,
    use_few_row_linears,
    wait_for_quiet,
)

WORKLOADS = ("prefill", "decode", "train")
RUNTIME_BYTES = int(0.6 * GB)  # torch + transformers + allocator slack, for the memory estimates
VOCAB = 50304
# GPT-NeoX twins of the MF presets: the Pythia shapes (paper Table 1), random init, untied embeddings.
TWINS = {
    "tiny": ("Pythia-70M twin", dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, intermediate_size=2048)),
    "small": ("Pythia-160M twin", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)),
    "base": ("Pythia-410M twin", dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)),
}


@dataclass
class ModelSpec:
    presets: list[str] = field(default_factory=lambda: ["tiny", "small"])
    workloads: list[str] = field(default_factory=lambda: list(WORKLOADS))
    kernels: list[str] | None = None  # None: every available kernel
    prefill_tokens: int = 2048
    prompt_tokens: int = 16
    new_tokens: int = 128
    train_batch: int = 8
    train_seq: int = 512
    repeats: int = 3
    warmup: int = 1
    layers: int | None = None  # override num_hidden_layers of both models (quick mode only)
    rss: bool = True  # measure peak RSS in subprocesses
    rss_train_steps: int = 2
    rss_workloads: list[str] | None = None  # None: the same as `workloads`
    lr: float = 1e-4
    seed: int = 0
    quiet_wait_s: float = 120.0  # before each workload, wait up to this long for other processes to go quiet
    memory_headroom: float = 0.85  # attempt a workload only if its estimate fits in this fraction of free memory
    table_optimizer: str = "adamw"  # MemoryFormer tables in training: adamw or a rule of training.TABLE_OPTIMIZERS
    table_dtype: str | None = None  # MemoryFormer table storage: None (float32) or "bfloat16"
    dtype: str = "fp32"  # both models' dtype: "fp32", or "bf16" (every parameter cast to bfloat16, both models)
    gradient_checkpointing: bool = False  # training: recompute each decoder layer in the backward (both models)
    loss_chunk_tokens: int | None = None  # MemoryFormer's config.loss_chunk_tokens (None: the config's default)


# ---------------------------------------------------------------------------------------------------------------------
# Models


def mf_label(preset: str) -> str:
    return f"MF-{preset}"


FEW_ROW = "few-row"  # the twin with every nn.Linear on the fused few-row pass (decode only): the fastest dense decode
CHUNKED_LOSS = "chunked-loss"  # the twin computing its training loss by MemoryFormer's chunked pass (train only)
TWIN_VARIANTS = {FEW_ROW: ("decode", " [few-row linears]"), CHUNKED_LOSS: ("train", " [chunked loss]")}


def contestant_name(preset: str, kind: str, kernel: str | None, table_optimizer: str = "adamw",
                    table_dtype: str | None = None, dtype: str = "fp32") -> str:
    whole = "" if dtype == "fp32" else f" {dtype}"
    if kind == "twin":
        return TWINS[preset][0] + whole + (TWIN_VARIANTS[kernel][1] if kernel in TWIN_VARIANTS else "")
    tables = "" if table_optimizer == "adamw" else f", tables {table_optimizer}"
    tables += f", {table_dtype} tables" if table_dtype else ""
    return f"{mf_label(preset)}{whole} [{kernel}{tables}]"


def model_config(kind: str, preset: str, spec: ModelSpec):
    overrides = {} if spec.layers is None else {"num_hidden_layers": spec.layers}
    if kind == "mf":
        from modeling_memoryformer import MemoryFormerConfig

        if spec.loss_chunk_tokens is not None:
            overrides["loss_chunk_tokens"] = spec.loss_chunk_tokens
        return MemoryFormerConfig.from_preset(preset, attn_implementation="sdpa", table_dtype=spec.table_dtype,
                                              **overrides)
    from transformers import GPTNeoXConfig

    shape = dict(TWINS[preset][1], **overrides)
    return GPTNeoXConfig(
        vocab_size=VOCAB,
        rotary_pct=0.25,
        rotary_emb_base=10000,
        use_parallel_residual=True,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
        attn_implementation="sdpa",
        **shape,
    )


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_model(kind: str, preset: str, spec: ModelSpec, device=None):
    from transformers import GPTNeoXForCausalLM

    from modeling_memoryformer import MemoryFormerForCausalLM

    config = model_config(kind, preset, spec)
    cls = MemoryFormerForCausalLM if kind == "mf" else GPTNeoXForCausalLM
    torch.manual_seed(spec.seed)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = cls(config)
    if spec.dtype not in DTYPES:
        raise ValueError(f"ModelSpec.dtype must be one of {', '.join(DTYPES)}, got {spec.dtype!r}.")
    return model.to(DTYPES[spec.dtype])


def model_info(kind: str, preset: str, spec: ModelSpec) -> dict:
    """Parameter counts from a meta-device build (no memory), for the memory estimates and the report."""
    model = build_model(kind, preset, spec, device="meta")
    params = sum(p.numel() for p in model.parameters())
    tables = sum(p.numel() for n, p in model.named_parameters() if n.endswith(".tables"))
    c = model.config
    return {
        "name": (mf_label(preset) if kind == "mf" else TWINS[preset][0]) + ("" if spec.dtype == "fp32" else f" {spec.dtype}"),
        "params": params,
        "table_params": tables,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "intermediate_size": c.intermediate_size,
        "use_parallel_residual": c.use_parallel_residual,
        "attn_implementation": c._attn_implementation,
        "fp32_weights_gb": round(params * 4 / GB, 2),
    }


def memory_estimate(info: dict, workload: str, spec: ModelSpec) -> tuple[int, str]:
    """Rough bytes a workload needs for one model (fp32), and how that number was made."""
    table_bytes = 2 if spec.table_dtype == "bfloat16" else 4
    weights = 4 * info["params"] - (4 - table_bytes) * info.get("table_params", 0)
    hidden, layers = info["hidden_size"], info["num_hidden_layers"]
    runtime = RUNTIME_BYTES
    if workload == "train":
        tokens = spec.train_batch * spec.train_seq
        # logits, their log-softmax and gradient (3 x fp32 [tokens, vocab]) + ~24 saved floats per hidden unit per layer
        activations = tokens * (VOCAB * 4 * 3 + hidden * layers * 4 * 24)
        tables = info.get("table_params", 0) if spec.table_optimizer != "adamw" else 0
        if tables:
            # tables: their weights (+ a float32 first moment for the Adam rules), no gradient; the rest AdamW
            per_table = table_bytes + (4 if spec.table_optimizer.startswith("adam_") else 0)
            need = 16 * (info["params"] - tables) + per_table * tables + activations + runtime
            how = (f"16 B/param x {(info['params'] - tables) / 1e9:.2f} B dense params + {per_table} B/param x "
                   f"{tables / 1e9:.2f} B table params ({spec.table_optimizer}) + ~{activations / GB:.1f} GB activations")
            return need, how
        need = 4 * weights + activations + runtime
        how = (
            f"16 B/param (fp32 weights + grads + 2 AdamW moments) x {info['params'] / 1e9:.2f} B params "
            f"+ ~{activations / GB:.1f} GB activations"
        )
        return need, how
    tokens = spec.prefill_tokens if workload == "prefill" else spec.prompt_tokens + spec.new_tokens
    activations = tokens * hidden * 4 * (64 + 2 * layers)  # temporaries + KV cache
    return weights + activations + runtime, f"fp32 weights {weights / GB:.1f} GB + activations"


def _skip_reason(need: int, how: str, available: int, beside: int = 0) -> str:
    """`beside`: memory already held in this process by the other models built for the same comparison."""
    held = f" next to {beside / GB:.1f} GB held by the other model(s) of this process" if beside > 0 else ""
    return f"skipped: needs ~{need / GB:.1f} GB ({how}){held}; {available / GB:.1f} GB available"


# ---------------------------------------------------------------------------------------------------------------------
# Workloads


def _tokens(spec: ModelSpec, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(spec.seed * 1000 + salt)
    return torch.randint(0, VOCAB, shape, generator=gen)


def workload_fn(model, workload: str, spec: ModelSpec, optimizer=None):
    """(fn, tokens per call). fn runs one unit of the workload."""
    if workload == "prefill":
        ids = _tokens(spec, (1, spec.prefill_tokens), 1)

        def prefill():
            return model(input_ids=ids, use_cache=True, logits_to_keep=1)

        return prefill, spec.prefill_tokens
    if workload == "decode":
        prompt = _tokens(spec, (1, spec.prompt_tokens), 2)
        mask = torch.ones_like(prompt)
        n = spec.new_tokens

        def decode():
            out = model.generate(
                prompt,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
            )
            if out.shape[1] != prompt.shape[1] + n:
                raise RuntimeError(f"generate returned {out.shape[1] - prompt.shape[1]} new tokens, expected {n}")
            return out

        return decode, n
    if workload == "train":
        ids = _tokens(spec, (spec.train_batch, spec.train_seq), 3)
        if spec.gradient_checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})

        def train_step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        return train_step, spec.train_batch * spec.train_seq
    raise ValueError(f"unknown workload {workload!r}")


@contextlib.contextmanager
def few_row_linears(model):
    """Every nn.Linear of `model` computes with `memory_ops.few_rows_linear` (the fused kernel's few-row pass for up
    to 4 rows without autograd, as MemoryFormer's LM head does; F.linear otherwise) while inside: `use_few_row_linears`,
    undone on exit."""
    linears = use_few_row_linears(model)
    try:
        yield
    finally:
        for m in linears:
            del m.forward


@contextlib.contextmanager
def chunked_loss(model, chunk_tokens: int | None = None):
    """A GPT-NeoX causal LM whose forward with labels computes its loss as MemoryFormer does by default
    (`memory_ops.linear_cross_entropy`: chunks of `chunk_tokens` tokens, no [tokens, vocab] logits) while inside."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from modeling_memoryformer.memory_ops import LINEAR_CE_CHUNK_TOKENS, linear_cross_entropy

    chunk_tokens = chunk_tokens or LINEAR_CE_CHUNK_TOKENS

    def forward(input_ids=None, labels=None, **kwargs):
        hidden = model.gpt_neox(input_ids=input_ids, **kwargs).last_hidden_state
        head = model.get_output_embeddings()
        loss = linear_cross_entropy(hidden, head.weight, head.bias, labels, chunk_tokens=chunk_tokens)
        return CausalLMOutputWithPast(loss=loss)

    model.forward = forward
    try:
        yield
    finally:
        del model.forward


def _context(kernel: str | None, workload: str, model=None):
    from modeling_memoryformer.memory_ops import use_kernel

    def ctx():
        stack = contextlib.ExitStack()
        if kernel == FEW_ROW:
            stack.enter_context(use_kernel("fused"))
            stack.enter_context(few_row_linears(model))
        elif kernel == CHUNKED_LOSS:
            stack.enter_context(chunked_loss(model))
        elif kernel is not None:
            stack.enter_context(use_kernel(kernel))
        if workload != "train":
            stack.enter_context(torch.inference_mode())
        return stack

    return ctx


def _optimizer(model, spec: ModelSpec, kind: str):
    # fused: one vectorised pass over all parameters, as `memoryformer train` (the Trainer's adamw_torch_fused); the
    # per-parameter loop costs the MemoryFormer, whose tables hold 90% of its parameters, most of a training step.
    # With spec.table_optimizer, the MemoryFormer's tables take that rule in the backward pass (`--table-optimizer`).
    if kind == "mf" and spec.table_optimizer != "adamw":
        from modeling_memoryformer.training.table_optimizer import TableAdamW, table_param_groups
        from modeling_memoryformer.training.trainer import no_decay_parameter_names

        groups = table_param_groups(model, spec.table_optimizer, 0.1, no_decay_parameter_names(model))
        return TableAdamW(groups, lr=spec.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)


# ---------------------------------------------------------------------------------------------------------------------
# Speed (one process, round-robin) and peak memory (subprocesses)


def _kernels(spec: ModelSpec) -> list[str]:
    from modeling_memoryformer.memory_ops import available_kernels

    available = available_kernels()
    wanted = spec.kernels or available
    return sorted((k for k in wanted if k in available), key=lambda k: (k != "torch", k))


def run(spec: ModelSpec, log=print) -> dict:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    kernels = _kernels(spec)
    env = environment()
    start_all = time.perf_counter()
    section_cpu = cpu_snapshot()
    n_contestants = 1 + len(kernels)
    per_workload = n_contestants * (max(1, spec.warmup) + spec.repeats)
    rss_jobs = len([w for w in spec.workloads if w in (spec.rss_workloads or spec.workloads)]) if spec.rss else 0
    total = len(spec.presets) * (len(spec.workloads) * per_workload + rss_jobs * n_contestants)
    if "fused" in kernels and "decode" in spec.workloads:  # the twin with few-row linears, at decode
        total += len(spec.presets) * (max(1, spec.warmup) + spec.repeats)
    if "train" in spec.workloads:  # the twin with the chunked loss, at train
        rss_train = spec.rss and "train" in (spec.rss_workloads or spec.workloads)
        total += len(spec.presets) * (max(1, spec.warmup) + spec.repeats + int(rss_train))
    bar = make_progress(total, "model")
    say = bar.write
    models, rows, rss_rows = {}, [], []
    try:
        for preset in spec.presets:
            infos = {kind: model_info(kind, preset, spec) for kind in ("mf", "twin")}
            models[preset] = infos
            say(
                f"[{preset}] {infos['mf']['name']}: {infos['mf']['params'] / 1e6:.1f} M params "
                f"({infos['mf']['fp32_weights_gb']} GB fp32) vs {infos['twin']['name']}: "
                f"{infos['twin']['params'] / 1e6:.1f} M params"
            )
            rows += _speed(preset, infos, kernels, spec, bar, say)
            if spec.rss:
                rss_rows += _peak_memory(preset, infos, kernels, spec, bar, say)
    finally:
        bar.close()
    elapsed = time.perf_counter() - start_all
    log(f"Model level done in {elapsed:.0f} s")
    return {
        "meta": dict(env, elapsed_s=round(elapsed, 1), other_cpu_cores=other_cores_since(section_cpu)),
        "spec": asdict(spec) | {"kernels": kernels, "noisy_cores_threshold": NOISY_CORES},
        "models": models,
        "rows": rows,
        "peak_rss": rss_rows,
    }


def _speed(preset: str, infos: dict, kernels: list[str], spec: ModelSpec, bar, say) -> list[dict]:
    rows = []
    kinds = [("mf", k) for k in kernels] + [("twin", None)]
    if "fused" in kernels and "decode" in spec.workloads:
        kinds.append(("twin", FEW_ROW))
    if "train" in spec.workloads:
        kinds.append(("twin", CHUNKED_LOSS))

    def record(workload, kind, kernel, status, c=None, tokens=None):
        row = {
            "preset": preset,
            "workload": workload,
            "contestant": contestant_name(preset, kind, kernel, spec.table_optimizer, spec.table_dtype, spec.dtype),
            "model": kind,
            "kernel": kernel,
            "status": status,
        }
        if c is not None and c.samples:
            row["tokens_per_call"] = tokens
            row["seconds"] = summary(c.samples)
            row["tokens_per_s"] = tokens / c.median
            row["other_cpu_cores"] = round(c.other_cores, 3) if c.other_cores is not None else None
        rows.append(row)

    # Memory plan: build a model only if its lightest workload fits next to the models already built; then,
    # per workload, attempt a model only if its extra memory (beyond its resident weights) still fits.
    available = available_memory_bytes()
    budget = spec.memory_headroom * available
    resident = RUNTIME_BYTES
    build = []
    for kind in ("twin", "mf"):
        weights = 4 * infos[kind]["params"]
        lightest = min(memory_estimate(infos[kind], w, spec)[0] for w in spec.workloads) - RUNTIME_BYTES
        if resident + lightest <= budget:
            build.append(kind)
            resident += weights
    fits: dict[str, dict[str, str | None]] = {}
    for workload in spec.workloads:
        used, fits[workload] = resident, {}
        for kind in ("twin", "mf"):
            need, how = memory_estimate(infos[kind], workload, spec)
            extra = need - RUNTIME_BYTES - 4 * infos[kind]["params"]
            if kind in build and used + extra <= budget:
                fits[workload][kind] = None
                used += extra
            else:
                beside = used - RUNTIME_BYTES - (4 * infos[kind]["params"] if kind in build else 0)
                fits[workload][kind] = _skip_reason(need, how, available, beside)
    built = {}
    for kind in build:
        t0 = time.perf_counter()
        built[kind] = build_model(kind, preset, spec).eval()
        say(f"[{preset}] built {infos[kind]['name']} in {time.perf_counter() - t0:.1f} s")

    for workload in spec.workloads:
        bar.set_postfix_str(f"{preset} {workload}")
        contestants, meta = [], []
        optimizers = {}
        for kind, kernel in kinds:
            if kernel in TWIN_VARIANTS and workload != TWIN_VARIANTS[kernel][0]:
                continue  # a twin variant runs at its own workload only: elsewhere it is the twin
            reason = fits[workload][kind]
            if reason is not None:
                record(workload, kind, kernel, reason)
                bar.update(max(1, spec.warmup) + spec.repeats)
                continue
            model = built[kind]
            model.train(workload == "train")
            optimizer = None
            if workload == "train":
                if kind not in optimizers:  # one per model: the kernels of a model share it
                    optimizers[kind] = _optimizer(model, spec, kind)
                optimizer = optimizers[kind]
            fn, tokens = workload_fn(model, workload, spec, optimizer)
            contestants.append(
                Contestant(contestant_name(preset, kind, kernel, spec.table_optimizer, spec.table_dtype, spec.dtype), fn,
                           _context(kernel, workload, model), kernel=kernel)
            )
            meta.append((kind, kernel, tokens))
        if contestants:
            wait_for_quiet(spec.quiet_wait_s)
            round_robin(contestants, spec.repeats, spec.warmup, tick=bar.update)
        for c, (kind, kernel, tokens) in zip(contestants, meta):
            status = "ok" if c.samples and not c.error else f"error: {c.error or 'no samples'}"
            record(workload, kind, kernel, status, c, tokens)
            if c.samples:
                say(f"[{preset}] {workload:7s} {c.name:24s} {tokens / c.median:10.1f} tokens/s")
        for model in built.values():
            model.zero_grad(set_to_none=True)
            model.eval()
        del optimizers, contestants
        gc.collect()
    built.clear()
    gc.collect()
    return rows


def _peak_memory(preset: str, infos: dict, kernels: list[str], spec: ModelSpec, bar, say) -> list[dict]:
    rows = []
    jobs = [("mf", k) for k in kernels] + [("twin", None)]
    for workload in [w for w in spec.workloads if w in (spec.rss_workloads or spec.workloads)]:
        for kind, kernel in jobs + ([("twin", CHUNKED_LOSS)] if workload == "train" else []):
            name = contestant_name(preset, kind, kernel, spec.table_optimizer, spec.table_dtype, spec.dtype)
            bar.set_postfix_str(f"{preset} peak RSS {workload} {name}")
            row = {"preset": preset, "workload": workload, "contestant": name, "model": kind, "kernel": kernel}
            available = available_memory_bytes()
            need, how = memory_estimate(infos[kind], workload, spec)
            if need > spec.memory_headroom * available:
                rows.append(row | {"status": _skip_reason(need, how, available)})
                bar.update(1)
                continue
            job = {"preset": preset, "model": kind, "kernel": kernel, "workload": workload, "spec": asdict(spec)}
            env = dict(os.environ)
            if kernel is not None and kernel not in TWIN_VARIANTS:
                env["MEMORYFORMER_KERNEL"] = kernel
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(
                    [sys.executable, "-m", "benchmarks.model_bench", "--rss-worker", json.dumps(job)],
                    cwd=REPO_ROOT,
                    env=env,
                    check=False, capture_output=True,
                    text=True,
                    timeout=3600,
                )
                result = next(
                    (json.loads(line[len("RSS_RESULT "):]) for line in proc.stdout.splitlines()
                     if line.startswith("RSS_RESULT ")),
                    None,
                )
                if proc.returncode != 0 or result is None:
                    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                    status = f"error: worker exit {proc.returncode}: {' | '.join(tail)[:300]}"
                    rows.append(row | {"status": status})
                else:
                    rows.append(row | {"status": "ok"} | result)
                    say(f"[{preset}] peak RSS {workload:7s} {name:24s} {result['peak_rss_mb'] / 1e3:6.2f} GB")
            except subprocess.TimeoutExpired:
                rows.append(row | {"status": "error: worker timed out"})
            rows[-1]["wall_s"] = round(time.perf_counter() - t0, 1)
            bar.update(1)
    return rows


def _kernel_source_sha() -> str | None:
    try:
        import hashlib

        from modeling_memoryformer.memory_kernel_source import CPP_SOURCE
    except Exception:
        return None
    return hashlib.sha256(CPP_SOURCE.encode()).hexdigest()[:12]


def _rss_worker(job: dict) -> None:
    """Runs in a fresh process: build one model, run one workload, print peak RSS (VmHWM)."""
    from transformers.utils import logging as hf_logging

    from modeling_memoryformer.memory_ops import get_kernel, set_kernel

    hf_logging.set_verbosity_error()
    spec = ModelSpec(**job["spec"])
    if job["kernel"] is not None and job["kernel"] not in TWIN_VARIANTS:
        set_kernel(job["kernel"])
        if get_kernel() != job["kernel"]:
            raise RuntimeError(f"kernel {job['kernel']!r} requested, {get_kernel()!r} active")
    from modeling_memoryformer.evaluation.kernel_report import load_kernel_timed

    load_kernel_timed()  # the one-time kernel build/load: not in worker_s
    rss_import = current_rss_bytes()
    t0 = time.perf_counter()
    model = build_model(job["model"], job["preset"], spec)
    rss_built = current_rss_bytes()
    workload = job["workload"]
    model.train(workload == "train")
    optimizer = _optimizer(model, spec, job["model"]) if workload == "train" else None
    fn, _ = workload_fn(model, workload, spec, optimizer)
    step_s = []
    with _context(job["kernel"] if job["kernel"] in TWIN_VARIANTS else None, workload, model)():
        for _ in range(spec.rss_train_steps if workload == "train" else 1):
            t_step = time.perf_counter()
            fn()
            step_s.append(round(time.perf_counter() - t_step, 2))
    result = {
        "rss_import_mb": round(rss_import / MB, 1),
        "rss_built_mb": round(rss_built / MB, 1),
        "peak_rss_mb": round(peak_rss_bytes() / MB, 1),
        "worker_s": round(time.perf_counter() - t0, 1),
        "steps": spec.rss_train_steps if workload == "train" else 1,
        "step_s": step_s,  # each call of the workload; the first includes one-time costs (allocation, warm-up)
        "fused_kernel_source_sha256": _kernel_source_sha(),
    }
    print("RSS_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="internal: peak-memory worker of the model benchmark")
    parser.add_argument("--rss-worker", required=True, help="JSON job description")
    _rss_worker(json.loads(parser.parse_args().rss_worker))
