"""The project's main job: train a MemoryFormer and its Pythia-shaped dense twin side by side, and report.

Both models get the same tokenizer, data, block size, batch and number of steps (the same token budget); the twin
trains at the dense learning rate of its size, the MemoryFormer at 3x (paper section 4.1, see
`training.trainer.default_learning_rate`). The report folder holds, for each model, its final checkpoint and metrics,
and for the pair: `summary.json`, `report.md` (the table the command also prints), `loss_curves.png`,
`buckets.png` / `bucket_stats.json` (paper Fig. 4 on validation text) and `samples.md`.

The paper's claim is about models that see each token once, so the report says how many epochs the run took (the
default run: about 0.12) and gives each model's final training loss beside its validation loss. Speed is measured
after training and apart from it, both models alternated (`comparison.speed`), with the load of the machine beside
it; the report gives the equal-token view (perplexity after the same tokens) and the equal-time view (perplexity
after the same seconds of training at the measured speeds).

With no data given it runs on the embedded default (`training.data.embedded_default_documents`: the Python standard
library's source and documentation, about 3.4 M tokens, held-out files for validation, a byte-level BPE tokenizer
trained on it in seconds), so it needs no file and no network.
"""

from __future__ import annotations

import functools
import json
import math
import os
import textwrap
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
    speed_rounds: int = option(10, "rounds of the speed measurement after training (both models alternated; medians)")
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


def final_training_loss(curve: dict[str, list], share: float = 0.1) -> float:
    """The mean of the logged training losses over the last `share` of the run (the last log when there is only
    one there): the training side of the generalisation gap."""
    train = curve["train"]
    if not train:
        raise ValueError("the run logged no training loss; log at least once (logging_steps <= max_steps).")
    end = train[-1][0]
    tail = [loss for tokens, loss in train if tokens > (1 - share) * end] or [train[-1][1]]
    return sum(tail) / len(tail)


def loss_at(curve: list[tuple[float, float]], tokens: float) -> float | None:
    """The loss of a validation curve [(tokens, loss), ...] after `tokens` training tokens, linear in log(tokens)
    between its points; None before the first point or after the last."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if t0 <= tokens <= t1:
            w = (math.log(tokens) - math.log(t0)) / (math.log(t1) - math.log(t0)) if t1 > t0 else 0.0
            return l0 + w * (l1 - l0)
    if curve and tokens == curve[-1][0]:
        return curve[-1][1]
    return None


def equal_time_view(curves: dict[str, dict[str, list]], train_speed: dict[str, float], budget: int) -> dict:
    """Both models given the same seconds of training: the time the faster one (by the measured training speed)
    takes for the token budget. The slower one's loss after as many tokens as it trains in that time is read from its
    validation curve (mid-schedule: its learning rate had not decayed yet, so a run planned for that budget would
    do a little better)."""
    fast, slow = sorted(train_speed, key=train_speed.get, reverse=True)
    seconds = budget / train_speed[fast]
    tokens = seconds * train_speed[slow]
    slow_loss = loss_at(curves[slow]["eval"], tokens)
    return {"seconds": seconds, "faster": fast, "slower": slow, "slower_tokens": tokens,
            "faster_loss": curves[fast]["eval"][-1][1] if curves[fast]["eval"] else None, "slower_loss": slow_loss}


def plot_loss_curves(curves: dict[str, dict[str, list]], path: str, title: str,
                     train_speed: dict[str, float] | None = None) -> str:
    """One PNG: training loss (thin) and validation loss (markers) of each model against training tokens, and, with
    `train_speed` (tokens/s per model), the validation loss against the seconds of training at that speed."""
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend (e.g. a notebook's) alone

    panels = 2 if train_speed else 1
    fig = Figure(figsize=(7 * panels, 4.5))
    axes = [fig.add_subplot(1, panels, i + 1) for i in range(panels)]
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red")
    for (name, curve), color in zip(curves.items(), colors):
        if curve["train"]:
            x, y = zip(*curve["train"])
            axes[0].plot(x, y, color=color, alpha=0.45, linewidth=1, label=f"{name} train")
        if curve["eval"]:
            x, y = zip(*curve["eval"])
            axes[0].plot(x, y, color=color, marker="o", linewidth=2, label=f"{name} validation")
            if train_speed:
                axes[1].plot([t / train_speed[name] for t in x], y, color=color, marker="o", linewidth=2,
                             label=f"{name} validation ({train_speed[name]:,.0f} tokens/s)")
    axes[0].set_xlabel("training tokens (equal-token view)")
    if train_speed:
        axes[1].set_xlabel("seconds of training at the measured speed (equal-time view)")
    for ax in axes:
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
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


def estimate_seconds(models: dict, data, settings: DemoSettings) -> dict[str, float]:
    """How long the demo will take on this machine, from a short calibration of each model (a warm-up and two
    training steps on a copy, two evaluation forwards, a short generation): seconds of training, evaluation, the
    speed measurement and the rest (saving, bucket statistics, samples)."""
    import torch

    from .speed import greedy_decode, training_step

    batch = data.train.input_ids[: settings.batch_size]
    prompt = data.validation.input_ids[:1, : settings.prompt_tokens]
    evaluation_batches = math.ceil(len(data.validation) / settings.batch_size)
    parts = {"training": 0.0, "evaluation": 0.0, "speed measurement": 0.0, "other": 10.0}
    for model in models.values():
        step_seconds = _seconds_per_call(training_step(model, batch), calls=2)  # the copy is freed on return
        model.eval()
        with torch.inference_mode():
            forward_seconds = _seconds_per_call(functools.partial(model, input_ids=batch))
        token_seconds = _seconds_per_call(greedy_decode(model, prompt, 8)) / 8
        model.train()
        parts["training"] += settings.max_steps * step_seconds
        parts["evaluation"] += settings.eval_points * evaluation_batches * forward_seconds
        parts["speed measurement"] += (settings.speed_rounds + 1) * (step_seconds + settings.decode_tokens * token_seconds)
        parts["other"] += evaluation_batches * forward_seconds + settings.decode_tokens * token_seconds  # buckets, samples
    return parts


def _seconds_per_call(fn, calls: int = 1) -> float:
    """Seconds per call of `fn`, the mean of `calls` timed calls after one untimed (warm-up) call."""
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def run_demo(settings: DemoSettings) -> dict:
    """Train both models, measure, plot and write the report folder; return the summary (also in summary.json).
    The folder is written under a temporary sibling name and renamed when everything is in it (`staged_folder`): a
    failed run leaves nothing behind, and an existing folder is replaced only with `overwrite`."""
    from ..conversion.convert import staged_folder

    if settings.eval_text is not None and not os.path.isfile(settings.eval_text):  # before any work is done
        raise FileNotFoundError(f"--eval-text {settings.eval_text!r} is not a file; pass a path to a text file.")
    if settings.speed_rounds < 1:
        raise ValueError(f"speed_rounds must be >= 1, got {settings.speed_rounds}.")
    print(f"memoryformer demo: a MemoryFormer and its Pythia-shaped twin, {settings.max_steps} steps x "
          f"{settings.batch_size} x {settings.block_size} tokens each, then a speed measurement of both. The time it "
          "will take on this machine is printed after the data is ready and a short calibration.", flush=True)
    with staged_folder(settings.out, settings.overwrite) as work:
        summary = _run_demo(settings, work)
    print("\n" + format_report(summary))
    print(f"Report folder: {settings.out} (report.md, summary.json, loss_curves.png, buckets.png, samples.md)")
    return summary


def _run_demo(settings: DemoSettings, work: str) -> dict:
    import torch
    from transformers import set_seed

    from ..evaluation.buckets import collect_bucket_stats, plot_bucket_histograms
    from ..evaluation.flops import per_block_flops, pythia_block_flops
    from ..evaluation.kernel_report import run_facts
    from ..evaluation.perplexity import blocks_perplexity
    from ..modeling_memoryformer import MemoryFormerForCausalLM
    from ..training.data import build_lm_data
    from ..training.trainer import default_learning_rate
    from .speed import measure_speed
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
    prompt = data.validation.input_ids[:1, : settings.prompt_tokens]
    tokens_per_step = settings.batch_size * settings.block_size
    budget = settings.max_steps * tokens_per_step
    epochs = budget / data.num_train_tokens
    seq = settings.block_size
    flops = {"MemoryFormer": per_block_flops(mf_config, seq), "Pythia twin": pythia_block_flops(mf_config, seq)}

    estimate = estimate_seconds(models, data, settings)
    set_seed(settings.seed)  # the calibration drew no random numbers the training uses, but start from the seed
    elapsed = time.perf_counter() - start
    print(f"\nEstimated time on this machine: about {(elapsed + sum(estimate.values())) / 60:.0f} min in all "
          f"({', '.join(f'{name} {seconds:.0f} s' for name, seconds in estimate.items())}, "
          f"{elapsed:.0f} s spent on the kernel and the data). "
          f"Data: {budget:,} training tokens per model of {data.num_train_tokens:,} ({epochs:.2f} epochs"
          f"{'' if epochs <= 1 else ': THE DATA REPEATS'}).", flush=True)

    results, curves = {}, {}
    for name, model in models.items():
        result = _train_one(os.path.join(work, folders[name]), model, data, settings, rates[name])
        model.eval()
        curves[name] = loss_curves(result.log_history, tokens_per_step)
        train_loss = final_training_loss(curves[name])
        results[name] = {
            "parameters": sum(p.numel() for p in model.parameters()),
            "learning_rate": rates[name],
            "validation_loss": result.eval_loss,
            "validation_perplexity": result.perplexity,
            "final_training_loss": train_loss,
            "generalisation_gap": result.eval_loss - train_loss,
            "train_loop_tokens_per_second": result.train_tokens_per_second,
            "train_seconds": result.train_seconds,
            "eval_seconds": result.eval_seconds,
            "evaluations": result.evaluations,
            "flops_per_block_without_attention": flops[name]["without_attention"],
            "flops_per_block_total": flops[name]["total"],
            "sample": sample_text(model, tokenizer, prompt, settings.decode_tokens, settings.seed),
        }
        if ood_blocks is not None:
            results[name]["eval_text_perplexity"] = blocks_perplexity(model, ood_blocks, batch_size=settings.batch_size)

    print(f"\n== speed, apart from training: {settings.speed_rounds} rounds, both models alternated", flush=True)
    speed_start = time.perf_counter()
    speed = measure_speed(models, data.train.input_ids[: settings.batch_size], prompt, settings.decode_tokens,
                          rounds=settings.speed_rounds, progress=settings.progress)
    speed_seconds = time.perf_counter() - speed_start
    for name, r in results.items():
        r["train_tokens_per_second"] = speed["models"][name]["train"]["tokens_per_second"]
        r["decode_tokens_per_second"] = speed["models"][name]["decode"]["tokens_per_second"]
    train_speed = {name: r["train_tokens_per_second"] for name, r in results.items()}

    validation_batches = torch.utils.data.DataLoader(data.validation, batch_size=settings.batch_size)
    stats = collect_bucket_stats(models["MemoryFormer"], validation_batches, progress=settings.progress)
    stats.to_json(os.path.join(work, "bucket_stats.json"))
    plot_bucket_histograms(stats, os.path.join(work, "buckets.png"),
                           title="MemoryFormer bucket hits on validation text (paper Fig. 4)")
    plot_loss_curves(curves, os.path.join(work, "loss_curves.png"), train_speed=train_speed,
                     title=textwrap.fill(data.description, 160) + f"\n{budget:,} tokens each ({epochs:.2f} epochs), "
                           f"MemoryFormer at {rates['MemoryFormer'] / twin_lr:g}x the twin's learning rate")
    entropies = stats.normalised_entropy()
    total = time.perf_counter() - start
    training = sum(r["train_seconds"] for r in results.values())
    evaluation = sum(r["eval_seconds"] for r in results.values())
    summary = {
        "settings": asdict(settings),
        "data": data.description,
        "train_tokens": budget,
        "train_tokens_available": data.num_train_tokens,
        "epochs": epochs,
        "validation_tokens": data.num_validation_tokens,
        "eval_text": None if ood_blocks is None else {"path": settings.eval_text, "tokens": ood_blocks.numel()},
        "prompt": tokenizer.decode(prompt[0]),
        "models": results,
        "curves": curves,
        "speed": speed,
        "equal_time": equal_time_view(curves, train_speed, budget),
        "bucket_entropy": {"min": min(entropies.values()), "mean": sum(entropies.values()) / len(entropies),
                           "tables": len(entropies)},
        "memoryformer_config": mf_config.to_dict(),
        "run": facts,  # the kernel that ran, the CPU and its vector features, versions, the kernel build/load time
        # where the time went, both models together; "other": data and tokenizer, kernel build, calibration,
        # checkpoints and saves, samples, bucket statistics, plots
        "time": {"total_seconds": total, "training_seconds": training, "evaluation_seconds": evaluation,
                 "speed_seconds": speed_seconds, "other_seconds": total - training - evaluation - speed_seconds,
                 "estimated_seconds": elapsed + sum(estimate.values())},
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


def _data_line(summary: dict) -> str:
    settings = summary["settings"]
    seen = (f"{summary['train_tokens']:,} training tokens each ({settings['max_steps']} steps x "
            f"{settings['batch_size']} x {settings['block_size']}) of {summary['train_tokens_available']:,}: "
            f"{summary['epochs']:.2f} epochs, ")
    if summary["epochs"] <= 1:
        seen += "every training token seen at most once."
    else:
        seen += ("THE DATA REPEATS: the models are compared on memorising it, not on what the paper measures. Pass "
                 "more text (--data) or fewer --max-steps.")
    return (f"Data: {summary['data']}. {seen} {summary['validation_tokens']:,} validation tokens. FLOPs at sequence "
            f"length {settings['block_size']}.")


def _speed_lines(summary: dict) -> list[str]:
    speed = summary["speed"]
    load = speed["other_cores"]
    if load is None:
        state = "the load of the machine is unknown here (no /proc/stat)"
    elif speed["busy"]:
        state = (f"BUSY: other processes used {load:.2f} cores on average, {speed['max_other_cores']:.2f} at most "
                 f"(above {speed['threshold']} cores); these speed rows are not trustworthy: rerun on a quiet machine")
    else:
        state = (f"quiet: other processes used {load:.2f} cores on average, {speed['max_other_cores']:.2f} at most "
                 f"(flagged above {speed['threshold']})")
    stream = speed.get("memory_stream_gbps")
    if stream:
        state += (f"; memory streamed at {stream['median']:.0f} GB/s (median of a 128 MB sum per round, "
                  f"{stream['min']:.0f}-{stream['max']:.0f}: the host's other tenants, which /proc/stat does not "
                  "show, lower it and slow the MemoryFormer's optimizer step over its tables more than the twin's)")
    batch, decode = speed["train_batch"], speed["decode"]
    lines = [f"Speed rows: measured after training and apart from it, {speed['rounds']} rounds with the models "
             f"alternated, medians (the spread is in summary.json); a training step is {batch[0]} x {batch[1]} tokens "
             f"with AdamW, decode is {decode['new_tokens']} greedy tokens after a {decode['prompt_tokens']}-token "
             f"prompt (batch 1, KV cache). Machine {state}."]
    same = summary["equal_time"]
    mf, twin = summary["models"]["MemoryFormer"], summary["models"]["Pythia twin"]
    lines += ["", f"Equal tokens: after {summary['train_tokens']:,} training tokens each, validation perplexity "
                  f"{mf['validation_perplexity']:.2f} (MemoryFormer) and {twin['validation_perplexity']:.2f} (twin)."]
    if same["slower_loss"] is None:
        lines.append(f"Equal time: in {same['seconds']:.0f} s of training the {same['slower']} trains "
                     f"{same['slower_tokens']:,.0f} tokens, before its first validation point; no figure.")
    else:
        lines.append(f"Equal time: in the {same['seconds']:.0f} s of training the {same['faster']} needs for the whole "
                     f"budget at its measured speed, the {same['slower']} trains {same['slower_tokens']:,.0f} tokens "
                     f"and reaches validation perplexity {math.exp(same['slower_loss']):.2f} (from its validation "
                     f"curve, mid-schedule), against {math.exp(same['faster_loss']):.2f}.")
    return lines


def format_report(summary: dict) -> str:
    """The markdown table of `summary` (what the demo prints and writes to report.md)."""
    from ..evaluation.kernel_report import run_facts_line

    models = summary["models"]
    mf, twin = models["MemoryFormer"], models["Pythia twin"]
    rows = [
        ("parameters", "parameters", lambda r: f"{r['parameters'] / 1e6:.1f} M"),
        ("learning rate", None, lambda r: f"{r['learning_rate']:g}"),
        ("validation perplexity", "validation_perplexity", lambda r: f"{r['validation_perplexity']:.2f}"),
        ("validation loss", None, lambda r: f"{r['validation_loss']:.4f}"),
        ("final training loss (last 10% of steps)", None, lambda r: f"{r['final_training_loss']:.4f}"),
        ("generalisation gap (validation - training loss)", None, lambda r: f"{r['generalisation_gap']:+.4f}"),
        *([("out-of-domain perplexity (--eval-text)", "eval_text_perplexity",
            lambda r: f"{r['eval_text_perplexity']:.2f}")] if summary.get("eval_text") else []),
        ("FLOPs per block w/o attention (paper formula)", "flops_per_block_without_attention",
         lambda r: f"{r['flops_per_block_without_attention'] / 1e6:.1f} M"),
        ("FLOPs per block, total", "flops_per_block_total", lambda r: f"{r['flops_per_block_total'] / 1e6:.1f} M"),
        ("training tokens/s (speed measurement)", "train_tokens_per_second",
         lambda r: f"{r['train_tokens_per_second']:.0f}"),
        ("decode tokens/s (speed measurement)", "decode_tokens_per_second",
         lambda r: f"{r['decode_tokens_per_second']:.1f}"),
        ("training tokens/s during the run (one after the other)", "train_loop_tokens_per_second",
         lambda r: f"{r['train_loop_tokens_per_second']:.0f}"),
        ("training time (steps only)", None, lambda r: f"{r['train_seconds']:.1f} s"),
        ("evaluation time", None, lambda r: f"{r['eval_seconds']:.1f} s ({r['evaluations']} evaluations)"),
    ]
    lines = [
        "# MemoryFormer vs its Pythia-shaped twin",
        "",
        *([run_facts_line(summary["run"]), ""] if summary.get("run") else []),
        _data_line(summary),
        *([f"Out-of-domain evaluation: {summary['eval_text']['path']} ({summary['eval_text']['tokens']:,} tokens)."]
          if summary.get("eval_text") else []),
        "",
        "| | MemoryFormer | Pythia twin | MF / twin |",
        "|---|---|---|---|",
    ]
    for label, key, fmt in rows:
        ratio = f"{mf[key] / twin[key]:.2f}x" if key else ""
        lines.append(f"| {label} | {fmt(mf)} | {fmt(twin)} | {ratio} |")
    lines += ["", *_speed_lines(summary), "",
              f"One seed ({summary['settings']['seed']}); the spread over seeds of the perplexity ratio is measured by "
              "experiments/ablation.py (3 seeds per variant)."]
    spent = summary["time"]
    lines += ["", f"Time: {spent['total_seconds']:.0f} s in all (estimated at the start: "
                  f"{spent['estimated_seconds']:.0f} s): training {spent['training_seconds']:.0f} s, evaluation "
                  f"{spent['evaluation_seconds']:.0f} s, speed measurement {spent['speed_seconds']:.0f} s, other "
                  f"{spent['other_seconds']:.0f} s (data and tokenizer, kernel, calibration, saving, samples, bucket "
                  "statistics)."]
    entropy = summary["bucket_entropy"]
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
