"""The project's main job: train a MemoryFormer and its Pythia-shaped dense twin side by side, and report.

Both models get the same tokenizer, data, block size, batch and number of steps (the same token budget); the twin
trains at the dense learning rate of its size, the MemoryFormer at 3x (paper section 4.1, see
`training.trainer.default_learning_rate`). The report folder holds, for each model, its final checkpoint and metrics,
and for the pair: `summary.json`, `report.md` (the table the command also prints), `loss_curves.png`,
`buckets.png` / `bucket_stats.json` (paper Fig. 4 on validation text) and `samples.md`.

With no data given it runs on the embedded default (the CPython documentation in `pydoc_data`, with a byte-level
BPE tokenizer trained on it in seconds), so it needs no file and no network.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from ..training.settings import DataSettings, ModelShape, option

if TYPE_CHECKING:  # imported where used: `memoryformer demo --help` reads DemoSettings without loading torch
    import torch


@dataclass
class DemoSettings(DataSettings, ModelShape):
    """What `memoryformer demo` trains on and how long: the data and shape fields of `DataSettings` and `ModelShape`,
    and those below. Defaults take a few minutes per model on 2 CPU cores."""

    out: str = option("memoryformer-demo", "report folder")
    eval_text: str | None = option(
        None, "a text file for an extra out-of-domain perplexity of both models, e.g. WikiText-2 (default: none)")
    batch_size: int = option(8, "sequences per step")
    max_steps: int = option(400, "training steps, same for both models")
    eval_points: int = option(8, "validation evaluations along each model's run (the points of the loss curves)")
    lr_multiplier: float | None = option(
        None, "MemoryFormer learning rate over the twin's (default: 3, the paper's rule)")
    decode_tokens: int = option(64, "tokens generated for the decode speed and the samples")
    prompt_tokens: int = option(16, "prompt tokens for the decode speed and the samples")
    seed: int = option(0, "random seed")
    overwrite: bool = option(False, "replace an existing report folder")
    progress: bool = option(True, "no progress bars", flag="--no-progress")
    extra_config: dict = option({}, cli=False)  # more MemoryFormerConfig fields


def memoryformer_config_for(settings: DemoSettings, tokenizer):
    """The MemoryFormer of the demo: a preset, or the small default shape; vocabulary and special tokens from the
    tokenizer."""
    from ..training.trainer import config_for_tokenizer

    return config_for_tokenizer(tokenizer, settings.preset, settings.shape(), settings.block_size,
                                **settings.extra_config)


def measure_decode(model, prompt_ids: torch.Tensor, new_tokens: int, repeats: int = 3) -> float:
    """Greedy decode tokens/s with the KV cache (batch 1): the median of `repeats` timed generations of exactly
    `new_tokens` tokens, after a short warm-up."""
    import torch

    model.eval()
    kwargs = dict(do_sample=False, pad_token_id=model.config.pad_token_id, eos_token_id=None)
    rates = []
    with torch.inference_mode():
        model.generate(prompt_ids, max_new_tokens=4, min_new_tokens=4, **kwargs)
        for _ in range(repeats):
            start = time.perf_counter()
            out = model.generate(prompt_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
            seconds = time.perf_counter() - start
            generated = out.shape[1] - prompt_ids.shape[1]
            if generated != new_tokens:
                raise RuntimeError(f"decode measurement generated {generated} tokens instead of {new_tokens}")
            rates.append(generated / seconds)
    return sorted(rates)[len(rates) // 2]


def sample_text(model, tokenizer, prompt_ids: torch.Tensor, new_tokens: int, seed: int) -> str:
    """A sampled continuation (top-k 40, temperature 0.8, fixed seed) of the prompt, decoded."""
    import torch

    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(
            prompt_ids, max_new_tokens=new_tokens, do_sample=True, top_k=40, temperature=0.8,
            pad_token_id=model.config.pad_token_id,
        )
    return tokenizer.decode(out[0, prompt_ids.shape[1]:])


def loss_curves(log_history: list[dict], tokens_per_step: int) -> dict[str, list]:
    """Train and eval loss against training tokens, from a Trainer log history."""
    train = [(e["step"] * tokens_per_step, e["loss"]) for e in log_history if "loss" in e and "step" in e]
    evals = [(e["step"] * tokens_per_step, e["eval_loss"]) for e in log_history if "eval_loss" in e]
    return {"train": train, "eval": evals}


def plot_loss_curves(curves: dict[str, dict[str, list]], path: str, title: str) -> str:
    """One PNG: training loss (thin) and validation loss (markers) of each model against training tokens."""
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend (e.g. a notebook's) alone

    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    for (name, curve), color in zip(curves.items(), ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        if curve["train"]:
            x, y = zip(*curve["train"])
            ax.plot(x, y, color=color, alpha=0.45, linewidth=1, label=f"{name} train")
        if curve["eval"]:
            x, y = zip(*curve["eval"])
            ax.plot(x, y, color=color, marker="o", linewidth=2, label=f"{name} validation")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def _train_one(output_dir: str, model, data, settings: DemoSettings, learning_rate: float):
    from ..training.trainer import TrainingSettings, train

    run = TrainingSettings(
        output_dir=output_dir,
        max_steps=settings.max_steps,
        per_device_batch_size=settings.batch_size,
        learning_rate=learning_rate,
        eval_points=settings.eval_points,
        report_to="csv",
        seed=settings.seed,
        progress=settings.progress,
    )
    print(f"\n== training {os.path.basename(output_dir)}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, "
          f"lr {learning_rate:g}, {settings.max_steps} steps x {settings.batch_size} x {settings.block_size} tokens")
    return train(model, data, run)


def _out_of_domain_blocks(settings: DemoSettings, tokenizer) -> torch.Tensor | None:
    """[S, block_size] token blocks of `settings.eval_text` (a text file), or None."""
    if settings.eval_text is None:
        return None
    from ..training.data import text_blocks

    with open(settings.eval_text, encoding="utf-8") as f:
        blocks = text_blocks(f.read(), tokenizer, settings.block_size)
    if blocks.shape[0] == 0:
        raise ValueError(f"--eval-text {settings.eval_text!r} has fewer tokens than one block of "
                         f"{settings.block_size}; pass a longer text or a smaller --block-size.")
    return blocks


def run_demo(settings: DemoSettings) -> dict:
    """Train both models, measure, plot and write the report folder; return the summary (also in summary.json).
    The folder is written under a temporary sibling name and renamed when everything is in it (`staged_folder`): a
    failed run leaves nothing behind, and an existing folder is replaced only with `overwrite`."""
    from ..conversion.convert import staged_folder

    if settings.eval_text is not None and not os.path.isfile(settings.eval_text):  # before any work is done
        raise FileNotFoundError(f"--eval-text {settings.eval_text!r} is not a file; pass a path to a text file.")
    with staged_folder(settings.out, settings.overwrite) as work:
        summary = _run_demo(settings, work)
    print("\n" + format_report(summary))
    print(f"Report folder: {settings.out} (report.md, summary.json, loss_curves.png, buckets.png, samples.md)")
    return summary


def _run_demo(settings: DemoSettings, work: str) -> dict:
    import torch
    from transformers import set_seed

    from ..evaluation.buckets import collect_bucket_stats, plot_bucket_histograms
    from ..evaluation.perplexity import blocks_perplexity
    from ..training.data import build_lm_data
    from ..evaluation.flops import per_block_flops, pythia_block_flops
    from ..evaluation.kernel_report import run_facts
    from ..modeling_memoryformer import MemoryFormerForCausalLM
    from ..training.trainer import default_learning_rate
    from .twin import pythia_twin

    start = time.perf_counter()
    facts = run_facts()  # loads (builds) the Memory Layer kernel before anything is trained or timed
    data = build_lm_data(settings.data, settings.tokenizer, block_size=settings.block_size,
                         vocab_size=settings.vocab_size, text_column=settings.text_column,
                         progress=settings.progress)
    tokenizer = data.tokenizer
    ood_blocks = _out_of_domain_blocks(settings, tokenizer)
    mf_config = memoryformer_config_for(settings, tokenizer)
    set_seed(settings.seed)
    models = {"MemoryFormer": MemoryFormerForCausalLM(mf_config)}
    set_seed(settings.seed)
    models["Pythia twin"] = pythia_twin(mf_config)
    twin_lr = default_learning_rate(models["Pythia twin"])
    rates = {
        "MemoryFormer": default_learning_rate(models["MemoryFormer"], lr_multiplier=settings.lr_multiplier),
        "Pythia twin": twin_lr,
    }
    folders = {"MemoryFormer": "memoryformer", "Pythia twin": "pythia-twin"}
    prompt = data.validation[0]["input_ids"][: settings.prompt_tokens].unsqueeze(0)
    tokens_per_step = settings.batch_size * settings.block_size
    seq = settings.block_size
    flops = {"MemoryFormer": per_block_flops(mf_config, seq), "Pythia twin": pythia_block_flops(mf_config, seq)}

    results, curves = {}, {}
    for name, model in models.items():
        result = _train_one(os.path.join(work, folders[name]), model, data, settings, rates[name])
        model.eval()
        results[name] = {
            "parameters": sum(p.numel() for p in model.parameters()),
            "learning_rate": rates[name],
            "validation_loss": result.eval_loss,
            "validation_perplexity": result.perplexity,
            "train_tokens_per_second": result.train_tokens_per_second,
            "train_seconds": result.train_seconds,
            "eval_seconds": result.eval_seconds,
            "evaluations": result.evaluations,
            "decode_tokens_per_second": measure_decode(model, prompt, settings.decode_tokens),
            "flops_per_block_without_attention": flops[name]["without_attention"],
            "flops_per_block_total": flops[name]["total"],
            "sample": sample_text(model, tokenizer, prompt, settings.decode_tokens, settings.seed),
        }
        if ood_blocks is not None:
            results[name]["eval_text_perplexity"] = blocks_perplexity(model, ood_blocks, batch_size=settings.batch_size)
        curves[name] = loss_curves(result.log_history, tokens_per_step)

    validation_batches = torch.utils.data.DataLoader(data.validation, batch_size=settings.batch_size)
    stats = collect_bucket_stats(models["MemoryFormer"], validation_batches, progress=settings.progress)
    stats.to_json(os.path.join(work, "bucket_stats.json"))
    plot_bucket_histograms(stats, os.path.join(work, "buckets.png"),
                           title="MemoryFormer bucket hits on validation text (paper Fig. 4)")
    plot_loss_curves(curves, os.path.join(work, "loss_curves.png"),
                     title=f"{data.description}\nsame tokens for both, MemoryFormer at {rates['MemoryFormer'] / twin_lr:g}x "
                           "the twin's learning rate")
    entropies = stats.normalised_entropy()
    total = time.perf_counter() - start
    training = sum(r["train_seconds"] for r in results.values())
    evaluation = sum(r["eval_seconds"] for r in results.values())
    summary = {
        "settings": asdict(settings),
        "data": data.description,
        "train_tokens": settings.max_steps * tokens_per_step,
        "validation_tokens": data.num_validation_tokens,
        "eval_text": None if ood_blocks is None else {"path": settings.eval_text, "tokens": ood_blocks.numel()},
        "prompt": tokenizer.decode(prompt[0]),
        "models": results,
        "curves": curves,
        "bucket_entropy": {"min": min(entropies.values()), "mean": sum(entropies.values()) / len(entropies),
                           "tables": len(entropies)},
        "memoryformer_config": mf_config.to_dict(),
        "run": facts,  # the kernel that ran, the CPU and its vector features, versions, the kernel build/load time
        # where the time went, both models together; "other": data and tokenizer, kernel build, checkpoints and
        # saves, decode timing, samples, bucket statistics, plots
        "time": {"total_seconds": total, "training_seconds": training, "evaluation_seconds": evaluation,
                 "other_seconds": total - training - evaluation},
    }
    with open(os.path.join(work, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    report = format_report(summary)
    with open(os.path.join(work, "report.md"), "w", encoding="utf-8") as f:
        f.write(report)
    with open(os.path.join(work, "samples.md"), "w", encoding="utf-8") as f:
        for name, r in results.items():
            f.write(f"## {name}\n\nPrompt: {summary['prompt']!r}\n\n```\n{r['sample']}\n```\n\n")
    return summary


def format_report(summary: dict) -> str:
    """The markdown table of `summary` (what the demo prints and writes to report.md)."""
    from ..evaluation.kernel_report import run_facts_line

    models = summary["models"]
    mf, twin = models["MemoryFormer"], models["Pythia twin"]
    rows = [
        ("parameters", lambda r: f"{r['parameters'] / 1e6:.1f} M"),
        ("learning rate", lambda r: f"{r['learning_rate']:g}"),
        ("validation perplexity", lambda r: f"{r['validation_perplexity']:.2f}"),
        ("validation loss", lambda r: f"{r['validation_loss']:.4f}"),
        *([("out-of-domain perplexity (--eval-text)", lambda r: f"{r['eval_text_perplexity']:.2f}")]
          if summary.get("eval_text") else []),
        ("FLOPs per block w/o attention (paper formula)", lambda r: f"{r['flops_per_block_without_attention'] / 1e6:.1f} M"),
        ("FLOPs per block, total", lambda r: f"{r['flops_per_block_total'] / 1e6:.1f} M"),
        ("training tokens/s", lambda r: f"{r['train_tokens_per_second']:.0f}"),
        ("decode tokens/s (batch 1, greedy, KV cache)", lambda r: f"{r['decode_tokens_per_second']:.1f}"),
        *([("training time (steps only)", lambda r: f"{r['train_seconds']:.1f} s"),
           ("evaluation time", lambda r: f"{r['eval_seconds']:.1f} s ({r['evaluations']} evaluations)")]
          if "eval_seconds" in mf else []),
    ]
    settings = summary["settings"]
    lines = [
        "# MemoryFormer vs its Pythia-shaped twin",
        "",
        *([run_facts_line(summary["run"]), ""] if summary.get("run") else []),
        f"Data: {summary['data']}; {summary['train_tokens']:,} training tokens each "
        f"({settings['max_steps']} steps x {settings['batch_size']} x {settings['block_size']}), "
        f"{summary['validation_tokens']:,} validation tokens. FLOPs at sequence length {settings['block_size']}.",
        *([f"Out-of-domain evaluation: {summary['eval_text']['path']} ({summary['eval_text']['tokens']:,} tokens)."]
          if summary.get("eval_text") else []),
        "",
        "| | MemoryFormer | Pythia twin | MF / twin |",
        "|---|---|---|---|",
    ]
    ratio_keys = {"validation perplexity": "validation_perplexity",
                  "out-of-domain perplexity (--eval-text)": "eval_text_perplexity", "training tokens/s": "train_tokens_per_second",
                  "decode tokens/s (batch 1, greedy, KV cache)": "decode_tokens_per_second",
                  "FLOPs per block w/o attention (paper formula)": "flops_per_block_without_attention",
                  "FLOPs per block, total": "flops_per_block_total", "parameters": "parameters"}
    for label, fmt in rows:
        key = ratio_keys.get(label)
        ratio = f"{mf[key] / twin[key]:.2f}x" if key else ""
        lines.append(f"| {label} | {fmt(mf)} | {fmt(twin)} | {ratio} |")
    entropy = summary["bucket_entropy"]
    if summary.get("time"):
        spent = summary["time"]
        lines += ["", f"Time: {spent['total_seconds']:.1f} s in all: training {spent['training_seconds']:.1f} s, "
                      f"evaluation {spent['evaluation_seconds']:.1f} s, other {spent['other_seconds']:.1f} s "
                      "(data and tokenizer, kernel build, saving, decode timing, samples, bucket statistics)."]
    lines += [
        "",
        f"Bucket uniformity (normalised entropy over {entropy['tables']} tables, 1 = uniform): mean "
        f"{entropy['mean']:.3f}, min {entropy['min']:.3f}.",
        "",
        f"Prompt: {summary['prompt']!r}",
        "",
    ]
    for name, r in models.items():
        lines += [f"{name}: {r['sample']!r}", ""]
    return "\n".join(lines)


def run_demo_cli(settings: DemoSettings) -> int:
    """`memoryformer demo` (its options: the fields of DemoSettings)."""
    run_demo(settings)
    return 0
