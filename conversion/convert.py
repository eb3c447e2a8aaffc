"""`convert_pythia`: the converter's steps in order (see the package's docstring for the module of each), and
`run_convert`, the `memoryformer convert` command.

The output folder holds the MemoryFormer (`save_pretrained`, safetensors, remote code), the tokenizer when there is
one, `conversion_report.json`, `conversion_report.md` and `layer_errors.png`. It is written to a temporary sibling
folder and renamed at the end, so a failed conversion leaves nothing behind; every check on the source, the options
and the output path runs before anything is loaded or written.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import sys
import time
from dataclasses import asdict

import torch

from ..training import checkpoints, outputs
from ..training.data import load_tokenizer, refused_checkpoint_message, text_blocks
from .distill import TrainingBudget, train_student
from ..evaluation.perplexity import blocks_perplexity
from .evaluate import layer_errors
from .initialization import calibrate, data_free_init
from .mapping import (
    MEMORY_LAYER_NAMES,
    copy_dense_weights,
    dense_layers,
    memoryformer_config_from_gpt_neox,
)
from ..evaluation.settings import StorageSettings
from .settings import ConversionError, ConvertSettings


SHORT_NAMES = dict(zip(MEMORY_LAYER_NAMES, ("qkv", "attn-out", "mlp-1", "mlp-2")))


# ---------------------------------------------------------------------------------------------------------------------
# Checks: everything that can be known before loading weights or writing a byte


def check_settings(settings: ConvertSettings):
    """Validate options, output path and source config; return (source GPTNeoXConfig, MemoryFormerConfig)."""
    for flag, path in (("--calib-text", settings.calib_text), ("--eval-text", settings.eval_text)):
        if path is not None and not os.path.isfile(path):
            raise ConversionError(f"{flag} {path!r} is not a file. Pass a plain-text file.")
    check_not_nested(settings.source, settings.out)  # --overwrite would delete the source
    check_output_folder(settings.out, settings.overwrite)
    source_config = load_source_config(settings.source)
    config = memoryformer_config_from_gpt_neox(source_config, settings.hash_bits, settings.hash_temperature)
    return source_config, config


class OutputExistsError(ConversionError, checkpoints.OutputExistsError):
    """The output folder exists and replacing it was not asked for."""


def check_not_nested(source, out, source_flag: str = "--from", out_flag: str = "--out") -> None:
    """Refuse an `out` that is, contains or lies inside the local folder `source` (symlinks resolved): replacing
    `out` would delete the source."""
    if not os.path.exists(source):
        return  # a Hub id
    src, dst = os.path.realpath(source), os.path.realpath(out)
    if src == dst:
        relation = "is"
    elif dst.startswith(src.rstrip(os.sep) + os.sep):
        relation = "lies inside"
    elif src.startswith(dst.rstrip(os.sep) + os.sep):
        relation = "contains"
    else:
        return
    raise ConversionError(
        f"{out_flag} {out!r} {relation} {source_flag} {source!r} ({dst} vs {src}): writing it would overwrite or "
        f"delete the source. Choose an output folder outside the source."
    )


def check_output_folder(out: str, overwrite: bool) -> None:
    """An existing output is replaced only when it is a folder and `overwrite` is set."""
    if os.path.exists(out) and not (overwrite and os.path.isdir(out)):
        raise OutputExistsError(
            f"--out {out!r} already exists. Choose a new folder, or pass --overwrite to replace a folder."
        )


def load_source_config(source: str):
    """The source's config: a local folder with config.json, or a Hub id through the normal `from_pretrained` path."""
    from transformers import AutoConfig

    if os.path.exists(source) and not os.path.isfile(os.path.join(source, "config.json")):
        raise ConversionError(f"--from {source!r} is not a model folder: it has no config.json.")
    if not os.path.exists(source) and (source.startswith((".", "/", "~")) or source.count("/") > 1):
        raise ConversionError(f"--from {source!r} does not exist. Pass a GPT-NeoX model folder or a Hub id.")
    try:
        return AutoConfig.from_pretrained(source)
    except (OSError, ValueError, KeyError) as error:
        raise ConversionError(
            f"Could not load the config of --from {source!r} (a local folder or a Hub id): {error}"
        ) from error


# ---------------------------------------------------------------------------------------------------------------------
# Data


def split_text(settings: ConvertSettings) -> tuple[str, str | None]:
    """(training / calibration text, held-out text): --eval-text when given, else the last eval_fraction of the
    calibration text (split by characters, the first part for calibration and distillation)."""
    with open(settings.calib_text, encoding="utf-8") as f:
        text = f.read()
    if settings.eval_text:
        with open(settings.eval_text, encoding="utf-8") as f:
            return text, f.read()
    cut = int(len(text) * (1 - settings.eval_fraction))
    return text[:cut], text[cut:]


def sample_blocks(blocks: torch.Tensor, max_tokens: int, seed: int) -> torch.Tensor:
    """At most max_tokens worth of sequences, drawn without replacement (seeded), in their original order."""
    count = min(blocks.shape[0], max_tokens // blocks.shape[1])
    chosen = torch.randperm(blocks.shape[0], generator=torch.Generator().manual_seed(seed))[:count]
    return blocks[chosen.sort().values]


# ---------------------------------------------------------------------------------------------------------------------
# The pipeline


def convert_pythia(settings: ConvertSettings, storage: StorageSettings | None = None) -> dict:
    """Run the conversion and write the output folder; returns the report (also saved as conversion_report.json).
    With `storage` (int8 / bf16 tables or LM head), the converted model is stored that way, its held-out perplexity
    measured again as the stage "stored", and saved so."""
    _, config = check_settings(settings)
    _check_storage(config, storage)
    teacher, tokenizer = _load_teacher(settings)
    data = _load_data(settings, tokenizer)
    from ..evaluation.kernel_report import run_facts

    facts = run_facts()  # loads (builds) the Memory Layer kernel before any stage is timed
    torch.manual_seed(settings.seed)
    report = {"source": settings.source, "settings": asdict(settings), "init": settings.resolved_init, "stages": {}}
    report["run"] = facts  # the kernel that ran, the CPU and its vector features, versions, kernel build/load time
    report["data"] = {name: int(ids.numel()) for name, ids in data.items()}
    report["config"] = {k: getattr(config, k) for k in ("hidden_size", "num_hidden_layers", "intermediate_size",
                                                        "hash_bits", "num_tables", "hash_temperature")}
    student = _convert(config, teacher, data, settings, report)
    if storage is not None and storage.requested:
        storage.apply(student)
        report["storage"] = {"table_dtype": storage.table_dtype, "lm_head_dtype": storage.lm_head_dtype}
        if data.get("eval") is not None:
            report["stages"]["stored"] = {"perplexity": blocks_perplexity(student, data["eval"], settings.batch_size,
                                                                          settings.progress)}
    _write_output(student, tokenizer, report, settings)
    return report


def _check_storage(config, storage: StorageSettings | None) -> None:
    """Refuse, before any work, a storage the converted model cannot take (e.g. int8 rows need a multiple of 4)."""
    if storage is None or not storage.requested:
        return
    try:
        type(config).from_dict({**config.to_dict(), "table_dtype": storage.table_dtype,
                                "lm_head_dtype": storage.lm_head_dtype})
    except ValueError as error:
        raise ConversionError(f"--table-dtype / --lm-head-dtype: {error}") from error


def _load_teacher(settings: ConvertSettings):
    from transformers import GPTNeoXForCausalLM

    try:
        teacher = checkpoints.load_pretrained_strict(GPTNeoXForCausalLM, settings.source, "--from",
                                                     dtype=torch.float32).eval()
    except (OSError, ValueError) as error:
        raise ConversionError(f"Could not load the weights of --from {settings.source!r}: {error}") from error
    except pickle.UnpicklingError as error:
        raise ConversionError(refused_checkpoint_message(settings.source, "--from", error)) from error
    location = settings.tokenizer or settings.source
    try:  # optional: only the text options (--tokenizer, --calib-text) need one
        tokenizer = load_tokenizer(location, hint="The text options need one: pass --tokenizer PATH.",
                                   pad_with_eos=False)
    except (ValueError, FileNotFoundError) as error:
        if settings.tokenizer or settings.calib_text:
            raise ConversionError(str(error)) from error
        tokenizer = None
    return teacher, tokenizer


def _load_data(settings: ConvertSettings, tokenizer) -> dict[str, torch.Tensor]:
    """Token sequences: "train" (all of the training text), "calibration" (a capped sample of it), "eval"."""
    if not settings.calib_text:
        return {}
    train_text, eval_text = split_text(settings)
    train = text_blocks(train_text, tokenizer, settings.seq_len)
    held_out = text_blocks(eval_text, tokenizer, settings.seq_len)
    if train.shape[0] == 0 or held_out.shape[0] == 0:
        raise ConversionError(
            f"The text gives {train.numel()} training and {held_out.numel()} held-out tokens: both need at least one "
            f"sequence of --seq-len {settings.seq_len}. Use more text or a shorter --seq-len."
        )
    return {
        "train": train,
        "calibration": sample_blocks(train, settings.calib_tokens, settings.seed),
        "eval": held_out[: max(1, settings.eval_tokens // settings.seq_len)],
    }


def _convert(config, teacher, data: dict[str, torch.Tensor], settings: ConvertSettings, report: dict):
    from ..modeling_memoryformer import MemoryFormerForCausalLM

    dense = dense_layers(teacher)
    stages = report["stages"]
    evaluate = _Evaluator(dense, data.get("eval"), settings)
    stages["teacher"] = evaluate.perplexity_only(teacher)
    stages["random_init"] = evaluate(MemoryFormerForCausalLM(config).eval())
    student = MemoryFormerForCausalLM(config).eval()
    copy_dense_weights(teacher, student)
    stages["random_tables"] = evaluate(student)
    with _Stopwatch() as clock:
        data_free_init(student, dense)
    stages["data_free"] = {**evaluate(student), **clock.seconds}
    if settings.resolved_init == "calibrated":
        with _Stopwatch() as clock:
            fit = calibrate(student, dense, data["calibration"], settings.ridge, settings.sweeps, settings.tolerance,
                            batch_size=settings.batch_size, progress=settings.progress)
        stages["calibrated"] = {**evaluate(student), **clock.seconds, "fit": fit}
    if settings.distill_steps or settings.distill_cpu_minutes:
        budget = TrainingBudget(settings.distill_steps or None, settings.distill_cpu_minutes, settings.distill_lr,
                                settings.batch_size, train_embeddings=settings.distill_embeddings, seed=settings.seed)
        run = train_student(student, data["train"], budget, teacher=teacher, progress=settings.progress)
        stages["distilled"] = {**evaluate(student), "training": run}
    report["final_stage"] = list(stages)[-1]
    return student


class _Evaluator:
    """Held-out perplexity and per-layer errors of a stage (nothing when there is no held-out text)."""

    def __init__(self, dense, eval_ids: torch.Tensor | None, settings: ConvertSettings):
        self.dense, self.eval_ids, self.settings = dense, eval_ids, settings

    def perplexity_only(self, model) -> dict:
        if self.eval_ids is None:
            return {}
        return {"perplexity": blocks_perplexity(model, self.eval_ids, self.settings.batch_size, self.settings.progress)}

    def __call__(self, student) -> dict:
        if self.eval_ids is None:
            return {}
        errors = layer_errors(student, self.dense, self.eval_ids, self.settings.batch_size, self.settings.progress)
        return {**self.perplexity_only(student), "layer_errors": errors}


class _Stopwatch:
    """Process CPU time and wall time of a `with` block, as {"cpu_seconds", "wall_seconds"} in `.seconds`."""

    def __enter__(self):
        self._cpu, self._wall = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = {"cpu_seconds": time.process_time() - self._cpu, "wall_seconds": time.perf_counter() - self._wall}


# ---------------------------------------------------------------------------------------------------------------------
# Output


@contextlib.contextmanager
def staged_folder(out: str, overwrite: bool = False):
    """Yield a temporary sibling folder of `out` to write into; when complete it replaces `out` (an existing folder
    only when `overwrite`, and kept until the new one is in place); on any failure it is deleted and `out` is left as
    it was (`training.outputs.staged_folder`)."""
    check_output_folder(out, overwrite)
    with outputs.staged_folder(out) as staging:
        yield staging


def _write_output(student, tokenizer, report: dict, settings: ConvertSettings) -> None:
    """The model, the tokenizer (when there is one) and the report, written through `staged_folder`."""
    with staged_folder(settings.out, settings.overwrite) as staging:
        student.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        write_report(report, staging)


def write_report(report: dict, folder: str) -> None:
    """conversion_report.json, conversion_report.md and (with matplotlib) layer_errors.png in `folder`."""
    with open(os.path.join(folder, "conversion_report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(folder, "conversion_report.md"), "w", encoding="utf-8") as f:
        f.write(report_markdown(report))
    plot_layer_errors(report, os.path.join(folder, "layer_errors.png"))


def report_markdown(report: dict) -> str:
    """The summary: held-out perplexity per stage, then the relative error of every Memory Layer per stage."""
    stages = report["stages"]
    from ..evaluation.kernel_report import run_facts_line

    lines = [f"# Conversion of `{report['source']}` ({report['init']} init)", ""]
    if report.get("run"):
        lines += [run_facts_line(report["run"]), ""]
    teacher = stages.get("teacher", {}).get("perplexity")
    if teacher is None:
        return "\n".join(lines + ["No held-out text was given: no perplexity or per-layer errors measured.", ""])
    lines += ["| stage | held-out perplexity | / teacher |", "|---|---|---|"]
    for name, stage in stages.items():
        lines.append(f"| {name} | {stage['perplexity']:.2f} | {stage['perplexity'] / teacher:.2f}x |")
    with_errors = [name for name, stage in stages.items() if "layer_errors" in stage]
    lines += ["", "Relative L2 error of each Memory Layer against the dense layer it replaces (held-out tokens):", ""]
    lines += ["| layer | " + " | ".join(with_errors) + " |", "|---" * (len(with_errors) + 1) + "|"]
    for block, names in enumerate(stages[with_errors[0]]["layer_errors"]):
        for name in names:
            values = " | ".join(f"{stages[s]['layer_errors'][block][name]:.3f}" for s in with_errors)
            lines.append(f"| {block}.{SHORT_NAMES[name]} | {values} |")
    return "\n".join(lines + [""])


def plot_layer_errors(report: dict, path: str) -> bool:
    """Per-layer relative errors, one line per stage; returns False (and writes nothing) without matplotlib or data."""
    try:
        from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend (e.g. a notebook's) alone
    except ImportError:
        return False
    stages = {name: s["layer_errors"] for name, s in report["stages"].items() if "layer_errors" in s}
    if not stages:
        return False
    labels = [f"{block}.{SHORT_NAMES[name]}" for block, names in enumerate(next(iter(stages.values()))) for name in names]
    figure = Figure(figsize=(max(6, 0.45 * len(labels)), 4))
    axis = figure.add_subplot()
    for name, errors in stages.items():
        axis.plot(labels, [value for block in errors for value in block.values()], marker="o", label=name)
    axis.set_ylabel("relative L2 error vs dense layer")
    axis.set_xlabel("block.Memory Layer")
    axis.set_title("Memory Layer errors on held-out tokens")
    axis.tick_params(axis="x", rotation=60)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True


# ---------------------------------------------------------------------------------------------------------------------
# Command line


def run_convert(settings: ConvertSettings, storage: StorageSettings | None = None) -> int:
    """`memoryformer convert`: 0 on success, 2 (with the reason on stderr) when the input cannot be converted."""
    try:
        report = convert_pythia(settings, storage)
    except ConversionError as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)  # one line, whatever the cause printed
        return 2
    print(report_markdown(report))
    print(f"Saved the MemoryFormer and its report to {os.path.abspath(settings.out)}")
    return 0


__all__ = [
    "ConvertSettings",
    "ConversionError",
    "check_settings",
    "convert_pythia",
    "run_convert",
    "split_text",
    "staged_folder",
    "text_blocks",
]
