"""The project's main job: train a MemoryFormer and its Pythia-shaped dense twin side by side, and report.

Both models get the same tokenizer, data, block size, batch and number of steps (the same token budget); the twin
trains at the dense learning rate of its size, the MemoryFormer at 3x (paper section 4.1, see
`training.trainer.default_learning_rate`). The report folder holds, for each model, its final checkpoint and metrics,
and for the pair: `summary.json`, `report.md` (the table the command also prints), `loss_curves.png`,
`buckets.png` / `bucket_stats.json` (paper Fig. 4 on validation text) and `samples.md`.

The paper's claim is about models that see each token once, so the report says how many epochs the run took (the
default run: about 0.12) and gives each model's final training loss beside its validation loss. Speed is measured
after training and apart from it, both models alternated (`comparison.speed`); the report gives the equal-token view
(perplexity after the same tokens) and the equal-time view (perplexity after the same seconds of training at the
measured speeds).

Every timing depends on the machine and on what else runs on it; the perplexities do not. The CPU other processes
used is recorded for each phase of the run (`evaluation.cpu_load.LoadMeter`: setup, training steps, evaluation,
speed rows, the rest), and the report flags each phase they slowed, saying which of its figures that makes
untrustworthy. The time estimate is made once the kernel is built and the data tokenised, from a calibration of both
models then, for a machine as busy as during the calibration, and re-taken at the pace of the first model's
training (when it was long enough to time one).

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
    and those below. The defaults took 4 min 11 s for both models on a quiet 2-vCPU AMD EPYC Zen 4 and 27.5 min on a
    busy 2-vCPU Intel Xeon; the demo prints its own estimate for the machine it runs on."""

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


def _train_one(output_dir: str, model, data, settings: DemoSettings, learning_rate: float, callbacks=()):
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
    return train(model, data, run, callbacks=callbacks)


def _step_load_callback(steps, between):
    """A TrainerCallback that adds the training steps to the LoadMeter `steps` and the time between them
    (evaluations, logging, saving) to `between`."""
    from transformers import TrainerCallback

    class StepLoad(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            between.stop()
            steps.start()

        def on_step_end(self, args, state, control, **kwargs):
            steps.stop()
            between.start()

    return StepLoad()


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


ESTIMATE_PARTS = ("training", "evaluation", "speed measurement", "other")
FIXED_OTHER_SECONDS = 10.0  # saving the models, plots, the report: about this on 2 cores, whatever the model


def model_estimates(models: dict, data, settings: DemoSettings) -> dict[str, dict[str, float]]:
    """How long each model's part of the demo will take on this machine as it is now, from a short calibration (a
    warm-up and two training steps on a copy, two evaluation forwards, a short generation): {name: seconds of
    training, evaluation, its share of the speed measurement, and the rest (bucket statistics, samples)}."""
    import torch

    from .speed import greedy_decode, training_step

    batch = data.train.input_ids[: settings.batch_size]
    prompt = data.validation.input_ids[:1, : settings.prompt_tokens]
    evaluation_batches = math.ceil(len(data.validation) / settings.batch_size)
    estimates = {}
    for name, model in models.items():
        step_seconds = _seconds_per_call(training_step(model, batch), calls=2)  # the copy is freed on return
        model.eval()
        with torch.inference_mode():
            forward_seconds = _seconds_per_call(functools.partial(model, input_ids=batch))
        token_seconds = _seconds_per_call(greedy_decode(model, prompt, 8)) / 8
        model.train()
        estimates[name] = {
            "training": settings.max_steps * step_seconds,
            "evaluation": settings.eval_points * evaluation_batches * forward_seconds,
            "speed measurement": (settings.speed_rounds + 1) * (step_seconds + settings.decode_tokens * token_seconds),
            "other": evaluation_batches * forward_seconds + settings.decode_tokens * token_seconds,  # buckets, samples
        }
    return estimates


def estimate_seconds(models: dict, data, settings: DemoSettings) -> dict[str, float]:
    """How long the demo will take on this machine as it is now (`model_estimates` of both models summed): seconds of
    training, evaluation, the speed measurement and the rest (saving, bucket statistics, samples)."""
    return _sum_parts(model_estimates(models, data, settings).values())


def _sum_parts(estimates) -> dict[str, float]:
    parts = dict.fromkeys(ESTIMATE_PARTS, 0.0)
    parts["other"] = FIXED_OTHER_SECONDS
    for estimate in estimates:
        for part in ESTIMATE_PARTS:
            parts[part] += estimate[part]
    return parts


REESTIMATE_AFTER_SECONDS = 20.0  # a shorter training carries more Trainer set-up than steps: its pace says little


def remaining_estimate(estimates: dict[str, dict[str, float]], done: str, seconds: float) -> dict | None:
    """The estimate re-taken once model `done` has trained and evaluated in `seconds`: its pace (those seconds over
    their calibrated estimate, which carries any load that came or went since) applied to what is left, the models
    after it and every model's speed measurement and rest; the fixed saving time as it was. None after the last
    model, or when the training was too short to time a pace (under REESTIMATE_AFTER_SECONDS)."""
    names = list(estimates)
    later = names[names.index(done) + 1:]
    calibrated = estimates[done]["training"] + estimates[done]["evaluation"]
    if not later or seconds < REESTIMATE_AFTER_SECONDS or calibrated <= 0:
        return None
    pace = seconds / calibrated
    left = sum(estimates[name][part] for name in later for part in ESTIMATE_PARTS)
    left += sum(estimates[name][part] for name in names[:names.index(done) + 1]
                for part in ("speed measurement", "other"))
    return {"after": done, "pace": pace, "remaining_seconds": pace * left + FIXED_OTHER_SECONDS}


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _assumed_load(calibration: dict) -> str:
    """What the estimate assumes about the machine: the load it was calibrated under."""
    cores = calibration["other_cores"]
    if cores is None:
        return "for the machine as it was during the calibration (its load is unknown here: no /proc/stat)"
    if calibration["busy"]:
        return (f"for a machine as busy as during the calibration (other processes used {cores:.2f} cores): "
                "shorter if they stop, longer if more start")
    return (f"for a quiet machine, as during the calibration (other processes used {cores:.2f} cores): other jobs "
            "starting meanwhile make it longer, and the report says which phases they slowed")


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
          f"{settings.batch_size} x {settings.block_size} tokens each, then a speed measurement of both. First the "
          "Memory Layer kernel (compiled on the first run of an installation, loaded from its cache after) and the "
          "data (a tokenizer trained, the text tokenised); the time the rest will take on this machine is printed "
          "after them, from a short calibration of both models.", flush=True)
    with staged_folder(settings.out, settings.overwrite) as work:
        summary = _run_demo(settings, work)
    print("\n" + format_report(summary))
    print(f"Report folder: {settings.out} (report.md, summary.json, loss_curves.png, buckets.png, bucket_stats.json, "
          "samples.md, and the two trained models in memoryformer/ and pythia-twin/)")
    return summary


def _run_demo(settings: DemoSettings, work: str) -> dict:
    import torch
    from transformers import set_seed

    from ..evaluation.buckets import collect_bucket_stats, plot_bucket_histograms
    from ..evaluation.cpu_load import NOISY_CORES, LoadMeter
    from ..evaluation.flops import per_block_flops, pythia_block_flops
    from ..evaluation.kernel_report import run_facts
    from ..evaluation.perplexity import blocks_perplexity
    from ..modeling_memoryformer import MemoryFormerForCausalLM
    from ..training.data import build_lm_data
    from ..training.trainer import default_learning_rate
    from .speed import measure_speed
    from .twin import pythia_twin

    # Other processes' CPU, phase by phase (see format_report): the setup, each model's training steps and the time
    # between them (evaluations, saving), the speed rows, and the rest (samples, bucket statistics, plots).
    meters = {"setup": LoadMeter(), "speed": LoadMeter(), "rest": LoadMeter(), "calibration": LoadMeter()}
    meters["setup"].start()
    start = time.perf_counter()
    facts = run_facts()  # loads (builds) the Memory Layer kernel before anything is trained or timed
    kernel_seconds = time.perf_counter() - start
    print(f"Memory Layer kernel: {facts['memory_layer_kernel']}, ready in {kernel_seconds:.1f} s (a first run on this "
          "installation compiles it; later runs load it from the cache)", flush=True)
    data_start = time.perf_counter()
    data = build_lm_data(settings.data, settings.tokenizer, block_size=settings.block_size,
                         vocab_size=settings.vocab_size, text_column=settings.text_column,
                         progress=settings.progress)
    tokenizer = data.tokenizer
    ood_blocks = _out_of_domain_blocks(settings, tokenizer)
    data_seconds = time.perf_counter() - data_start
    print(f"Data ready in {data_seconds:.1f} s (tokenizer and tokenised text).", flush=True)
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

    # The estimate: from a calibration taken now, after the kernel and the data, under the machine's present load.
    calibration_start = time.perf_counter()
    with meters["calibration"].measure():
        estimates = model_estimates(models, data, settings)
    calibration_seconds = time.perf_counter() - calibration_start
    calibration = meters["calibration"].summary()
    estimate = _sum_parts(estimates.values())
    set_seed(settings.seed)  # the calibration drew no random numbers the training uses, but start from the seed
    meters["setup"].stop()
    elapsed = time.perf_counter() - start
    print(f"\nEstimated time from here on this machine: about {_minutes(sum(estimate.values()))} "
          f"({', '.join(f'{name} {seconds:.0f} s' for name, seconds in estimate.items())}), "
          f"{_assumed_load(calibration)}. {elapsed:.0f} s spent so far: kernel {kernel_seconds:.0f} s, data "
          f"{data_seconds:.0f} s, calibration {calibration_seconds:.0f} s. "
          f"Data: {budget:,} training tokens per model of {data.num_train_tokens:,} ({epochs:.2f} epochs"
          f"{'' if epochs <= 1 else ': THE DATA REPEATS'}).", flush=True)

    results, curves, steps_load, between_load, reestimate = {}, {}, {}, {}, None
    for name, model in models.items():
        steps_load[name], between_load[name] = LoadMeter(), LoadMeter()
        between_load[name].start()
        result = _train_one(os.path.join(work, folders[name]), model, data, settings, rates[name],
                            callbacks=[_step_load_callback(steps_load[name], between_load[name])])
        between_load[name].stop()
        meters["rest"].start()
        print(_training_done_line(name, result, estimates[name], steps_load[name].summary()), flush=True)
        again = remaining_estimate(estimates, name, result.train_seconds + result.eval_seconds)
        if again is not None:
            reestimate = dict(again, at_seconds=time.perf_counter() - start)
            print(f"Estimate re-taken at the {name}'s pace ({again['pace']:.2f}x the calibration's): about "
                  f"{_minutes(again['remaining_seconds'])} to go.", flush=True)
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
        meters["rest"].stop()

    print(f"\n== speed, apart from training: {settings.speed_rounds} rounds, both models alternated", flush=True)
    speed_start = time.perf_counter()
    with meters["speed"].measure():
        speed = measure_speed(models, data.train.input_ids[: settings.batch_size], prompt, settings.decode_tokens,
                              rounds=settings.speed_rounds, progress=settings.progress)
    speed_seconds = time.perf_counter() - speed_start
    meters["rest"].start()
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
    meters["rest"].stop()
    total = time.perf_counter() - start
    training = sum(r["train_seconds"] for r in results.values())
    evaluation = sum(r["eval_seconds"] for r in results.values())
    phases = {
        "setup": meters["setup"],
        "training": LoadMeter.combined(steps_load.values()),
        "evaluation": LoadMeter.combined(between_load.values()),
        "speed": meters["speed"],
        "rest": meters["rest"],
    }
    load = {
        "threshold": NOISY_CORES,
        "window_seconds": meters["setup"].window_seconds,
        "whole_run": LoadMeter.combined(phases.values()).summary(),
        "phases": {phase: meter.summary() for phase, meter in phases.items()},
        "training_by_model": {name: meter.summary() for name, meter in steps_load.items()},
        "evaluation_by_model": {name: meter.summary() for name, meter in between_load.items()},
        "calibration": calibration,
    }
    if speed["busy"]:  # the timings' own verdict (the busiest model-workload) flags the speed rows too
        load["phases"]["speed"]["busy"] = True
    load["busy_phases"] = [phase for phase, figures in load["phases"].items() if figures["busy"]]
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
        "load": load,  # other processes' CPU in each phase of the run, and which phases they slowed
        # where the time went, both models together; "other": data and tokenizer, kernel build, calibration,
        # checkpoints and saves, samples, bucket statistics, plots
        "time": {"total_seconds": total, "training_seconds": training, "evaluation_seconds": evaluation,
                 "speed_seconds": speed_seconds, "other_seconds": total - training - evaluation - speed_seconds,
                 "kernel_seconds": kernel_seconds, "data_seconds": data_seconds,
                 "calibration_seconds": calibration_seconds,
                 # made `estimate_made_at_seconds` into the run, for the load of the calibration
                 "estimated_seconds": elapsed + sum(estimate.values()), "estimate_made_at_seconds": elapsed,
                 "estimate": estimate, "reestimate": reestimate},
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


def _training_done_line(name: str, result, estimate: dict[str, float], load: dict) -> str:
    """What a model's training took against its estimate, and, when other processes slowed it, that."""
    line = (f"{name}: {result.train_seconds:.0f} s of training steps and {result.eval_seconds:.0f} s of evaluation "
            f"(estimated {estimate['training']:.0f} s and {estimate['evaluation']:.0f} s).")
    if load["busy"]:
        line += (f" BUSY: other processes used {load['other_cores']:.2f} cores on average during its steps: its "
                 "training throughput is not the machine's.")
    return line


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


# The phases of a run whose load the report states (summary["load"]["phases"]), what each is, and which figures of
# the report other processes' work during it makes wrong.
PHASES = {
    "setup": ("the setup (kernel, data, calibration)", "the setup time and the time estimate (calibrated under this "
                                                       "load) are not the machine's"),
    "training": ("training", "training throughput (the 'during the run' rows) and training times are not the "
                             "machine's"),
    "evaluation": ("evaluation (between the training steps)", "the evaluation times are not the machine's"),
    "speed": ("the speed rows", "the speed rows and the equal-time view are not the machine's"),
    "rest": ("the rest (samples, bucket statistics, plots)", "the total time is longer than the machine's"),
}
# Which rows of the table each phase's load bears on (their labels get a BUSY mark when it was busy).
ROW_PHASES = {"train_tokens_per_second": "speed", "decode_tokens_per_second": "speed",
              "train_loop_tokens_per_second": "training", "training time (steps only)": "training",
              "evaluation time": "evaluation"}


def _rerun_hint(summary: dict) -> str:
    folder = summary["settings"].get("out", "memoryformer-demo")
    return (f"rerun on a quiet machine, or time the saved models again with `python -m benchmarks.demo_bench "
            f"--demo-folder {folder}`")


def _load_lines(summary: dict) -> list[str]:
    """The load of the machine over the whole run, phase by phase, with a BUSY verdict for each phase other
    processes slowed and what that makes untrustworthy (empty for a summary written before loads were recorded)."""
    load = summary.get("load")
    if not load:
        return []
    head = (f"Load of the machine over the whole run (CPU used by other processes, from /proc/stat; a phase is "
            f"busy above {load['threshold']:g} cores on average; perplexities, losses and FLOPs do not depend "
            "on it, every time and speed does): ")
    phases, whole, window = load["phases"], load["whole_run"], load["window_seconds"]
    if whole["other_cores"] is None:
        return [head + "unknown here (no /proc/stat): the timings may include other processes' work."]
    busy = [phase for phase in PHASES if phases.get(phase, {}).get("busy")]
    quiet = [phase for phase in PHASES if phase in phases and phases[phase]["other_cores"] is not None
             and not phases[phase]["busy"]]
    if not busy:
        each = ", ".join(f"{phase} {phases[phase]['other_cores']:.2f}" for phase in quiet)
        return [head + f"quiet throughout: other processes used {whole['other_cores']:.2f} cores on average over "
                       f"{whole['seconds']:.0f} s ({each}; {whole['max_other_cores']:.2f} in the busiest {window:g} s)."]
    parts = []
    for phase in busy:
        figures = phases[phase]
        what, consequence = PHASES[phase]
        text = f"BUSY during {what}: other processes used {figures['other_cores']:.2f} cores on average"
        if figures["seconds"] >= 2 * window and figures["max_other_cores"] is not None:
            text += f", {figures['max_other_cores']:.2f} in its busiest {window:g} s"
        by_model = load.get("training_by_model") if phase == "training" else None
        if by_model:
            text += " (" + ", ".join(f"{name} {m['other_cores']:.2f}" for name, m in by_model.items()
                                     if m["other_cores"] is not None) + ")"
        parts.append(f"{text}; {consequence}.")
    if quiet:
        names = [f"{PHASES[phase][0]} ({phases[phase]['other_cores']:.2f})" for phase in quiet]
        parts.append("Quiet during " + (", ".join(names[:-1]) + " and " if len(names) > 1 else "") + names[-1] + ".")
    if {"training", "speed"} & set(busy):
        parts.append(f"For this machine's own figures, {_rerun_hint(summary)}.")
    return [head + " ".join(parts)]


def _speed_lines(summary: dict) -> list[str]:
    speed = summary["speed"]
    load = speed["other_cores"]
    if load is None:
        state = "the load of the machine during these timings is unknown here (no /proc/stat)"
    elif speed["busy"]:
        state = (f"BUSY during these timings: other processes used {load:.2f} cores on average, "
                 f"{speed['max_other_cores']:.2f} at most (above {speed['threshold']} cores); these speed rows are not "
                 f"trustworthy: {_rerun_hint(summary)}")
    else:
        state = (f"quiet during these timings: other processes used {load:.2f} cores on average, "
                 f"{speed['max_other_cores']:.2f} at most (flagged above {speed['threshold']}"
                 f"{'; the other phases: Load above' if summary.get('load') else ''})")
    stream = speed.get("memory_stream_gbps")
    if stream:
        state += (f"; memory streamed at {stream['median']:.0f} GB/s (median of a 128 MB sum per round, "
                  f"{stream['min']:.0f}-{stream['max']:.0f}: the host's other tenants, which /proc/stat does not "
                  "show, lower it and slow the MemoryFormer's optimizer step over its tables more than the twin's)")
    batch, decode = speed["train_batch"], speed["decode"]
    lines = [f"Speed rows: measured after training and apart from it, {speed['rounds']} rounds with the models "
             f"alternated, medians (the spread is in summary.json); a training step is {batch[0]} x {batch[1]} tokens "
             f"with AdamW, decode is {decode['new_tokens']} greedy tokens after a {decode['prompt_tokens']}-token "
             f"prompt (batch 1, KV cache). They are measurements of this CPU, at its load: other CPUs give other "
             f"ratios. Machine {state}."]
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


def _time_line(summary: dict) -> str:
    spent = summary["time"]
    if "estimate_made_at_seconds" in spent:
        calibration = summary.get("load", {}).get("calibration", {})
        cores = calibration.get("other_cores")
        assumed = ("" if cores is None else
                   f", for the load during the calibration: other processes {cores:.2f} cores"
                   f"{', BUSY' if calibration.get('busy') else ''}")
        estimated = (f"estimated {spent['estimated_seconds']:.0f} s, {spent['estimate_made_at_seconds']:.0f} s in, "
                     f"after the kernel and the data{assumed}")
        setup = (f"; of the other: kernel {spent['kernel_seconds']:.0f} s, data and tokenizer "
                 f"{spent['data_seconds']:.0f} s, calibration {spent['calibration_seconds']:.0f} s")
        again = spent.get("reestimate")
        if again:
            estimated += (f"; re-taken after the {again['after']} trained, at {again['pace']:.2f}x the calibration's "
                          f"pace: {again['at_seconds'] + again['remaining_seconds']:.0f} s")
    else:  # a summary written before the estimate was made after the setup
        estimated, setup = f"estimated at the start: {spent['estimated_seconds']:.0f} s", ""
    return (f"Time on this machine: {spent['total_seconds']:.0f} s in all ({estimated}): training "
            f"{spent['training_seconds']:.0f} s, evaluation {spent['evaluation_seconds']:.0f} s, speed measurement "
            f"{spent['speed_seconds']:.0f} s, other {spent['other_seconds']:.0f} s (data and tokenizer, kernel, "
            f"calibration, saving, samples, bucket statistics){setup}.")


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
    busy = set(summary.get("load", {}).get("busy_phases", ()))
    for label, key, fmt in rows:
        ratio = f"{mf[key] / twin[key]:.2f}x" if key else ""
        if ROW_PHASES.get(key or label) in busy:
            label += " (BUSY: see Load)"
        lines.append(f"| {label} | {fmt(mf)} | {fmt(twin)} | {ratio} |")
    lines += ["", *(_load_lines(summary) + [""] if summary.get("load") else []), *_speed_lines(summary), "",
              f"One seed ({summary['settings']['seed']}); the spread over seeds of the perplexity ratio is measured by "
              "experiments/ablation.py (3 seeds per variant)."]
    lines += ["", _time_line(summary)]
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
