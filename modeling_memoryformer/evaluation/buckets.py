"""Bucket statistics of the hash tables (paper Fig. 4: the buckets of a table are hit with near-uniform frequency).

For every Memory Layer and every one of its K tables, count how many tokens land in each of the 2**tau buckets
h(z_k) = sum_i [z_k,i >= 0] 2^i (the paper's integer() hash, section 2.2). A table whose buckets are hit uniformly
uses all its rows; the paper argues that zero-centred inputs (LayerNorm before every Memory Layer) give exactly that.
Uniformity is read as the normalised entropy H(p) / log(2**tau) of the hit frequencies p of one table: 1 = uniform,
0 = one bucket.

    stats = collect_bucket_stats(model, batches)          # forward pre-hooks on the Memory Layers
    stats.normalised_entropy()                            # {"model.layers.0.attention.query_key_value[3]": 0.98}
    plot_bucket_histograms(stats, "buckets.png")          # the Fig. 4 bar charts

CLI: `memoryformer buckets --model DIR --data TEXT [--out DIR]` (options: `cli.add_bucket_arguments`); the report goes
to DIR/buckets next to the model unless --out says otherwise.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from ..modeling_memoryformer import MemoryLayer
from .settings import BucketSettings


MAX_DEFAULT_PANELS = 6


@dataclass
class BucketStats:
    """Bucket-hit counts of the Memory Layers of a model.

    counts: Memory Layer name (module path relative to the model) -> int64 [K, 2**hash_bits], the number of tokens
        whose chunk z_k fell in each bucket of each of the layer's K tables. Every row sums to `tokens`.
    tokens: tokens counted (non-padding positions).
    """

    counts: dict[str, torch.Tensor]
    tokens: int

    def _frequencies(self, name: str) -> torch.Tensor:
        """float64 [K, 2**bits]: hit frequency p of every bucket, rows summing to 1 (NaN for a table never hit)."""
        counts = self.counts[name].to(torch.float64)
        return counts / counts.sum(-1, keepdim=True)

    def normalised_entropy(self) -> dict[str, float]:
        """One figure per table, key f"{layer}[{k}]": H(p) / log(2**bits) with p = counts / counts.sum() and
        0 log 0 = 0. 1 = every bucket hit equally often; 0 = a single bucket."""
        entropies = {}
        for name, counts in self.counts.items():
            p = self._frequencies(name)  # [K, 2**bits]
            h = -torch.special.xlogy(p, p).sum(-1) / math.log(counts.shape[-1])  # [K]
            entropies.update({f"{name}[{k}]": float(v) for k, v in enumerate(h.tolist())})
        return entropies

    def summary(self) -> dict[str, dict]:
        """Per layer: tables (K), hash_bits, buckets (2**bits), mean / min normalised entropy over its tables, the
        largest / smallest bucket frequency as a ratio to the uniform 1 / 2**bits, the number and fraction of buckets
        never hit, and `uniform_entropy`: the normalised entropy a perfectly uniform table would show on this many
        tokens (the plug-in estimate is biased low by about (B - 1) / (2 N ln B) for N tokens in B buckets
        (Miller-Madow), which matters when N is not much larger than B)."""
        entropies = self.normalised_entropy()
        out = {}
        for name, counts in self.counts.items():
            tables, buckets = counts.shape
            h = [entropies[f"{name}[{k}]"] for k in range(tables)]
            ratio = self._frequencies(name) * buckets  # [K, 2**bits]: 1 = the uniform frequency
            empty = int((counts == 0).sum())
            out[name] = {
                "tables": tables,
                "hash_bits": int(math.log2(buckets)),
                "buckets": buckets,
                "mean_entropy": sum(h) / tables,
                "min_entropy": min(h),
                "max_hit_ratio": float(ratio.max()),
                "min_hit_ratio": float(ratio.min()),
                "empty_buckets": empty,
                "empty_fraction": empty / counts.numel(),
                "uniform_entropy": _uniform_entropy(self.tokens, buckets),
            }
        return out

    def to_json(self, path: str) -> None:
        """Write tokens, counts (nested lists), per-table normalised entropies and the summary to `path`."""
        payload = {
            "tokens": self.tokens,
            "counts": {name: counts.tolist() for name, counts in self.counts.items()},
            "normalised_entropy": self.normalised_entropy(),
            "summary": self.summary(),
        }
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(payload, f)

    @classmethod
    def from_json(cls, path: str) -> BucketStats:
        """Read what `to_json` wrote (entropies and summary are recomputed from the counts)."""
        with open(path, encoding="utf-8") as f:
            payload = json.load(f)
        counts = {name: torch.tensor(rows, dtype=torch.int64) for name, rows in payload["counts"].items()}
        return cls(counts=counts, tokens=int(payload["tokens"]))


def _uniform_entropy(tokens: int, buckets: int) -> float:
    """Expected normalised plug-in entropy of `tokens` uniform draws over `buckets` (Miller-Madow, first order)."""
    if tokens <= 0:
        return float("nan")
    return max(0.0, 1.0 - (buckets - 1) / (2 * tokens * math.log(buckets)))


def memory_layers(model: nn.Module) -> dict[str, MemoryLayer]:
    """Every MemoryLayer in `model`, by module name (e.g. "model.layers.0.memory_block.layer1"), in module order."""
    return {name: module for name, module in model.named_modules() if isinstance(module, MemoryLayer)}


def _choose_layers(model: nn.Module, layers: list[str] | None) -> dict[str, MemoryLayer]:
    available = memory_layers(model)
    if not available:
        raise ValueError(f"{type(model).__name__} has no MemoryLayer to count buckets of.")
    if layers is None:
        return available
    if not layers:
        raise ValueError("`layers` is empty: pass None for every Memory Layer or at least one layer name.")
    unknown = [name for name in layers if name not in available]
    if unknown:
        raise ValueError(f"Unknown Memory Layer name(s) {unknown}; valid names: {list(available)}.")
    return {name: available[name] for name in dict.fromkeys(layers)}


def _as_batch(batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(input_ids [B, T], attention_mask [B, T] or None) on `device`, from a dict batch or a LongTensor."""
    if isinstance(batch, torch.Tensor):
        input_ids, attention_mask = batch, None
    elif isinstance(batch, dict) and "input_ids" in batch:
        input_ids, attention_mask = batch["input_ids"], batch.get("attention_mask")
    else:
        raise TypeError(f"A batch must be a LongTensor [B, T] or a dict with 'input_ids', got {type(batch).__name__}.")
    input_ids = torch.as_tensor(input_ids)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}.")
    if attention_mask is not None:
        attention_mask = torch.as_tensor(attention_mask).to(device)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} differs from input_ids {tuple(input_ids.shape)}."
            )
    return input_ids.to(device), attention_mask


def collect_bucket_stats(
    model: nn.Module,
    batches: Iterable,
    layers: list[str] | None = None,
    progress: bool = True,
) -> BucketStats:
    """Count, for every chosen Memory Layer (default: all), the bucket of every table hit by every counted token.

    `batches` yields LongTensors [B, T] of token ids or dicts with "input_ids" [B, T] and optionally
    "attention_mask" [B, T] (0 = padding, not counted; other keys are ignored). The model runs in eval mode under
    no_grad; a forward pre-hook on each chosen layer hashes the layer's input ([B, T, d_in] -> codes [B, T, K]) and
    adds one bincount over table-offset codes k * 2**bits + h(z_k). Hooks are removed and the training mode
    restored even when the model raises. Returns BucketStats with counts int64 [K, 2**bits] per layer (on CPU).
    """
    chosen = _choose_layers(model, layers)
    device = next(model.parameters()).device
    counts = {
        name: torch.zeros(layer.num_tables << layer.hash_bits, dtype=torch.int64, device=device)
        for name, layer in chosen.items()
    }
    current_mask: list[torch.Tensor | None] = [None]  # the batch being run, read by the hooks

    def make_hook(name: str, layer: MemoryLayer):
        offsets = torch.arange(layer.num_tables, device=device) << layer.hash_bits  # [K]

        def hook(module: MemoryLayer, args: tuple, kwargs: dict) -> None:
            x, hashed = (args[0] if args else kwargs.get("x")), kwargs.get("hashed")
            if hashed is not None:  # the layer uses a shared hash: its rows are already table-offset codes
                rows = hashed[0]
            elif x is not None:
                rows = module.hash_codes(x) + offsets  # [..., K]
            else:  # nothing to hash: the layer's own forward reports the error
                return
            mask = current_mask[0]
            if mask is not None:
                if rows.shape[:-1] != mask.shape:
                    raise RuntimeError(
                        f"{name}: input positions {tuple(rows.shape[:-1])} do not match the attention mask "
                        f"{tuple(mask.shape)}, so padding cannot be excluded."
                    )
                rows = rows[mask]  # [counted tokens, K]
            counts[name] += torch.bincount(rows.reshape(-1), minlength=counts[name].numel())

        return hook

    # Only the Memory Layers are of interest: keep just one position of logits and no KV cache when the model allows.
    parameters = inspect.signature(model.forward).parameters
    extra = {"use_cache": False} if "use_cache" in parameters else {}
    if "logits_to_keep" in parameters:
        extra["logits_to_keep"] = 1

    was_training = model.training
    handles = [layer.register_forward_pre_hook(make_hook(n, layer), with_kwargs=True) for n, layer in chosen.items()]
    tokens = 0
    try:
        model.eval()
        total = len(batches) if hasattr(batches, "__len__") else None
        with torch.no_grad():
            for batch in tqdm(batches, total=total, desc="bucket counts", unit="batch", disable=not progress):
                input_ids, attention_mask = _as_batch(batch, device)
                current_mask[0] = None if attention_mask is None or attention_mask.all() else attention_mask.bool()
                kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
                model(input_ids=input_ids, **kwargs, **extra)
                tokens += input_ids.numel() if current_mask[0] is None else int(current_mask[0].sum())
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    if tokens == 0:
        raise ValueError("No tokens were counted: `batches` was empty or fully masked.")
    return BucketStats(
        counts={name: c.view(chosen[name].num_tables, -1).cpu() for name, c in counts.items()},
        tokens=tokens,
    )


def _split_table(key: str) -> tuple[str, int]:
    """"model.layers.0.memory_block.layer1[3]" -> ("model.layers.0.memory_block.layer1", 3)."""
    name, _, index = key.rpartition("[")
    if not name or not index.endswith("]") or not index[:-1].isdigit():
        raise ValueError(f"A table is named 'LAYER[k]', got {key!r}.")
    return name, int(index[:-1])


def _block_index(name: str) -> int | None:
    """The first numeric component of a module path (the decoder block), or None."""
    return next((int(part) for part in name.split(".") if part.isdigit()), None)


def default_tables(stats: BucketStats, limit: int = MAX_DEFAULT_PANELS) -> list[str]:
    """Table 0 of every kind of Memory Layer (qkv, dense, layer1, layer2) of the first and last block, thinned
    evenly to at most `limit`; layers outside numbered blocks are all candidates."""
    names = list(stats.counts)
    blocks = {_block_index(name) for name in names} - {None}
    ends = {min(blocks), max(blocks)} if blocks else set()
    candidates = [name for name in names if not blocks or _block_index(name) in ends]
    if len(candidates) > limit:
        step = (len(candidates) - 1) / (limit - 1) if limit > 1 else 0
        candidates = [candidates[round(i * step)] for i in range(limit)]
    return [f"{name}[0]" for name in candidates]


def plot_bucket_histograms(
    stats: BucketStats, path: str, tables: list[str] | None = None, title: str | None = None
) -> str:
    """Write a PNG with one panel per table ("LAYER[k]"; default `default_tables`): the hit frequency of every bucket
    index as a filled histogram, the uniform frequency 1 / 2**bits as a dashed line, the normalised entropy in the panel title.
    Returns `path`."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, safe in threads and headless runs

    tables = default_tables(stats) if tables is None else list(tables)
    if not tables:
        raise ValueError("No tables to plot.")
    entropies = stats.normalised_entropy()
    for key in tables:
        name, k = _split_table(key)
        if name not in stats.counts or k >= stats.counts[name].shape[0]:
            raise ValueError(f"Unknown table {key!r}; layers: {list(stats.counts)} (tables LAYER[0..K-1]).")

    columns = min(3, len(tables))
    rows = math.ceil(len(tables) / columns)
    fig = Figure(figsize=(4.6 * columns, 3.2 * rows + (0.5 if title else 0)))
    for i, key in enumerate(tables):
        name, k = _split_table(key)
        counts = stats.counts[name][k].to(torch.float64)
        buckets = counts.numel()
        ax = fig.add_subplot(rows, columns, i + 1)
        # a filled step outline: bars of 1024 buckets would be narrower than a pixel and vanish when rendered
        ax.stairs((counts / counts.sum()).tolist(), [b - 0.5 for b in range(buckets + 1)], fill=True,
                  color="tab:blue", linewidth=0.6)
        ax.axhline(1.0 / buckets, color="tab:red", linestyle="--", linewidth=1, label="uniform 1/2^bits")
        ax.set_xlim(-0.5, buckets - 0.5)
        ax.set_title(f"{name.removeprefix('model.')}[{k}]\nnormalised entropy {entropies[key]:.3f}", fontsize=8)
        ax.set_xlabel("bucket index", fontsize=8)
        ax.set_ylabel("hit frequency", fontsize=8)
        ax.tick_params(labelsize=7)
        if i == 0:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110, format="png")
    return path


def format_summary(stats: BucketStats) -> str:
    """A plain-text table: one row per layer with K, buckets, mean / min normalised entropy and the uniform mark."""
    summary = stats.summary()
    width = max(len("layer"), *(len(name) for name in summary))
    lines = [
        f"{'layer':<{width}}  {'K':>4}  {'buckets':>7}  {'mean H':>7}  {'min H':>7}  {'uniform':>7}  {'max/unif':>8}",
    ]
    for name, s in summary.items():
        lines.append(
            f"{name:<{width}}  {s['tables']:>4}  {s['buckets']:>7}  {s['mean_entropy']:>7.4f}  "
            f"{s['min_entropy']:>7.4f}  {s['uniform_entropy']:>7.4f}  {s['max_hit_ratio']:>8.2f}"
        )
    return "\n".join(lines)


def default_bucket_folder(model: str) -> str:
    """Where `memoryformer buckets` writes without --out: the `buckets` folder inside a local model folder, so the
    statistics stay with the model (or run) they describe. A Hub id has no local folder: --out is required."""
    if not os.path.isdir(model):
        raise ValueError(f"--model {model!r} is not a local folder, so there is no default output folder next to it; "
                         "pass --out DIR for bucket_stats.json and buckets.png.")
    return os.path.join(model, "buckets")


def run_buckets(settings: BucketSettings) -> int:
    """`memoryformer buckets`: count bucket hits of a model on text, write bucket_stats.json and buckets.png into
    --out (default: MODEL/buckets) and print the per-layer table. Returns the exit code."""
    from transformers import AutoModelForCausalLM

    from ..training.data import build_lm_data  # the training/data tools are only needed by the CLI

    from ..training.checkpoints import load_pretrained_strict

    out = settings.out if settings.out is not None else default_bucket_folder(settings.model)
    model = load_pretrained_strict(AutoModelForCausalLM, settings.model, "--model")
    data = build_lm_data(settings.data, settings.tokenizer or settings.model, block_size=settings.block_size)
    if len(data.tokenizer) > model.config.vocab_size:
        raise ValueError(
            f"The tokenizer has {len(data.tokenizer)} tokens but the model's vocabulary is {model.config.vocab_size}: "
            "pass the tokenizer the model was trained with (--tokenizer)."
        )
    dataset = data.validation
    if settings.split == "all":
        dataset = torch.utils.data.ConcatDataset([data.train, data.validation])
    if settings.max_tokens is not None:
        blocks = math.ceil(settings.max_tokens / settings.block_size)
        dataset = torch.utils.data.Subset(dataset, range(min(len(dataset), blocks)))
    if len(dataset) == 0:
        print(f"error: no {settings.split} blocks of {settings.block_size} tokens in the data", file=sys.stderr)
        return 2
    batches = torch.utils.data.DataLoader(dataset, batch_size=settings.batch_size)

    stats = collect_bucket_stats(model, batches, layers=settings.layers, progress=settings.progress)
    os.makedirs(out, exist_ok=True)
    stats.to_json(os.path.join(out, "bucket_stats.json"))
    plot_bucket_histograms(stats, os.path.join(out, "buckets.png"),
                           title=f"Bucket hits of {os.path.basename(settings.model.rstrip('/'))} ({stats.tokens:,} tokens)")
    entropies = list(stats.normalised_entropy().values())
    print(f"Bucket hits over {stats.tokens:,} tokens ({settings.split}); normalised entropy, 1 = uniform:\n")
    print(format_summary(stats))
    print(f"\nAll {len(entropies)} tables: mean {sum(entropies) / len(entropies):.4f}, min {min(entropies):.4f}.")
    print(f"Wrote {os.path.join(out, 'bucket_stats.json')} and {os.path.join(out, 'buckets.png')}")
    return 0


__all__ = [
    "BucketStats",
    "memory_layers",
    "collect_bucket_stats",
    "default_tables",
    "plot_bucket_histograms",
    "format_summary",
    "default_bucket_folder",
    "run_buckets",
]
