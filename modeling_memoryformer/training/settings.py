"""What a training run is given: `TrainingSettings` (the recipe), `DataSettings` (the text and its tokenizer),
`ModelShape` (the shape of a new MemoryFormer) and `TrainCommandSettings` (what `memoryformer train` adds).

Each setting is defined once, here: its type, default and help, from which `memoryformer train` and `memoryformer
demo` make their options (`cli.arguments`), and checked once, in `__post_init__`. A light module (standard library
only), so that `--help` answers at once.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from . import TABLE_OPTIMIZERS

# configuration_memoryformer.PRESETS, repeated here because that module imports transformers (and torch);
# tests/tools/test_cli_help.py checks that the two agree.
PRESETS = ("tiny", "small", "base")


def option(default=None, help: str = "", **metadata):
    """A settings field that is a command-line option: its default, help and metadata (`flag`, `choices`, ...,
    `cli=False` to keep it off the command line). A list or dict default becomes a default factory."""
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"help": help, **metadata})
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


def required(help: str, **metadata):
    """A settings field without a default: a required option."""
    return dataclasses.field(metadata={"help": help, **metadata})


def check_table_optimizer_setup(rule: str, gradient_accumulation_steps: int) -> None:
    """A ValueError naming the problem and the fix when a table rule cannot run as asked. (Several processes are
    fine: `TableAdamW` averages each table's gradient over the ranks before its update.)"""
    if rule not in TABLE_OPTIMIZERS:
        raise ValueError(f"table optimizer must be one of {', '.join(TABLE_OPTIMIZERS)}, got {rule!r}.")
    if rule == "adamw":
        return
    if gradient_accumulation_steps > 1:
        raise ValueError(
            f"--table-optimizer {rule} updates each table in the backward pass, so it cannot accumulate gradients over "
            f"{gradient_accumulation_steps} micro-batches. Use --grad-accum 1 with a larger "
            "--batch-size, or --table-optimizer adamw."
        )


def check_output_dir(path, flag: str = "--out") -> None:
    """A ValueError when `path` cannot become a folder: it is a file, or a file stands where a parent folder should.
    Checked before any data is read, so that the run does not fail at its first save."""
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a file, not a folder. Pass a folder path (it is created if missing).")
    parent = os.path.dirname(path)
    while parent and not os.path.exists(parent):
        parent, last = os.path.dirname(parent), parent
        if parent == last:
            break
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise ValueError(
            f"{flag} {path!r} is under {parent!r}, which is a file, not a folder. Pass a folder path outside it."
        )


def check_at_least(settings, names: tuple[str, ...], low: int = 1, optional: bool = False) -> None:
    """A ValueError naming the first of `names` whose value is below `low` (None is allowed when `optional`)."""
    for name in names:
        value = getattr(settings, name)
        if value is None and optional:
            continue
        if value is None or value < low:
            allowed = " or None (the default)" if optional else ""
            raise ValueError(f"{name} must be >= {low}{allowed}, got {value}.")


@dataclass
class TrainingSettings:
    """How to train; the defaults are the paper's recipe (see `training.trainer`). `learning_rate=None` means
    `default_learning_rate(model, lr_multiplier)`."""

    output_dir: str = required("output folder: checkpoints, log.csv, the final model", flag="--out")
    max_steps: int = option(1000, "optimizer steps of the whole run")
    per_device_batch_size: int = option(8, "sequences per step, per device (process)", flag="--batch-size")
    gradient_accumulation_steps: int = option(1, "gradient accumulation steps", flag="--grad-accum")
    learning_rate: float | None = option(None, "peak learning rate (default: the recipe's)", flag="--lr")
    lr_multiplier: float | None = option(
        None, "times the Pythia rate of this width (default: 3 for a MemoryFormer, the paper's rule)")
    weight_decay: float = option(0.1, "AdamW weight decay (not on biases, norms)")
    table_weight_decay: bool = option(
        True, "train the Memory Layer tables without weight decay (default: they get --weight-decay, as in the "
        "authors' code)", flag="--no-table-weight-decay")
    adam_beta1: float = option(0.9, "AdamW beta1")
    adam_beta2: float = option(0.95, "AdamW beta2")
    adam_epsilon: float = option(1e-8, "AdamW epsilon")
    max_grad_norm: float = option(1.0, "gradient clipping: global norm of the AdamW-trained gradients")
    warmup_ratio: float = option(0.01, "fraction of the steps warming up")
    min_lr_ratio: float = option(0.01, "the cosine decay ends at this fraction of the peak rate")
    bf16: bool = option(False, "bfloat16 autocast")
    eval_steps: int | None = option(None, "evaluate every N steps instead (default: from --eval-points)")
    eval_points: int | None = option(
        None, "validation evaluations over the run, evenly spaced, the last at --max-steps (default: 10, at least 10 "
        "steps apart: one, at the end, for a run of 10 steps or fewer)")
    logging_steps: int | None = option(
        None, "log the training loss every N steps (default: about 50 logs per run)")
    save_steps: int | None = option(
        None, "checkpoint every N steps, resumable (default: no checkpoints, only the final model)")
    save_total_limit: int | None = option(2, "checkpoints kept, the newest ones")
    report_to: str = option("csv", "csv, tensorboard, none, ... (comma-separated)")
    seed: int = option(0, "random seed")
    resume_from_checkpoint: str | bool | None = option(
        None, "checkpoint folder to resume from, or 'latest' for the newest complete one in --out (default: a new "
        "run)", flag="--resume")
    resume_partial: bool = option(
        False, "allow resuming from a checkpoint without optimizer/scheduler state (fresh ones)")
    table_optimizer: str = option(
        "adamw", "optimizer of the Memory Layer tables: adamw (like every parameter), rowwise_adagrad (4 bytes of "
        "state per row) or adam_rowwise (a first moment and a row-wise second one); both are fused into the "
        "backward pass, with no table gradient (DDP too); no --grad-accum", choices=TABLE_OPTIMIZERS)
    table_lr_multiplier: float = option(
        1.0, "learning rate of the table rule (--table-optimizer other than adamw) over the run's rate")
    fsdp: bool = option(
        False, "shard the model over the processes (torchrun / accelerate launch) with PyTorch FSDP2: each rank holds "
        "1/N of every table, its gradient and its AdamW state; AdamW tables only")
    save_final_model: bool = option(True, cli=False)
    progress: bool = option(True, "no progress bars", flag="--no-progress")
    extra_arguments: dict = option({}, cli=False)  # any other TrainingArguments field

    def __post_init__(self):
        if self.resume_from_checkpoint == "latest":
            self.resume_from_checkpoint = True  # the newest complete checkpoint in output_dir
        check_at_least(self, ("max_steps", "per_device_batch_size", "gradient_accumulation_steps"))
        check_at_least(self, ("eval_steps", "eval_points", "logging_steps", "save_steps", "save_total_limit"),
                       optional=True)
        if self.eval_steps is not None and self.eval_points is not None:
            raise ValueError(f"eval_steps ({self.eval_steps}) and eval_points ({self.eval_points}) both set the "
                             "evaluation interval; pass one of them.")
        if self.learning_rate is not None and not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}.")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}.")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}.")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}.")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}.")
        if not self.adam_epsilon > 0:
            raise ValueError(f"adam_epsilon must be > 0, got {self.adam_epsilon}.")
        if not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {self.max_grad_norm}.")
        if not self.table_lr_multiplier > 0:
            raise ValueError(f"table_lr_multiplier must be > 0, got {self.table_lr_multiplier}.")
        if self.fsdp and self.table_optimizer != "adamw":
            raise ValueError(
                f"fsdp=True and table_optimizer={self.table_optimizer!r} do not compose: the table rule updates each table "
                "from its whole gradient in the backward pass, and FSDP2 hands every rank only its reduce-scattered "
                "shard after it. Use table_optimizer='adamw' with fsdp, or the table rule on one process."
            )
        check_table_optimizer_setup(self.table_optimizer, self.gradient_accumulation_steps)
        check_output_dir(self.output_dir, "output_dir")


@dataclass
class DataSettings:
    """The text a model trains on and its tokenizer (see `training.data.build_lm_data`)."""

    data: str | None = option(
        None, "text file, folder of .txt files, local dataset folder or Hub dataset id (default: the embedded "
        "corpus, the Python standard library's source and documentation, about 3.4 M tokens)")
    text_column: str = option("text", "text column of a dataset")
    tokenizer: str | None = option(
        None, "tokenizer path or Hub id (default: a saved model's own, else a byte-level BPE trained on the "
        "training text)")
    vocab_size: int = option(4096, "of the trained BPE tokenizer")
    block_size: int = option(128, "tokens per training sequence")
    # checked where they are used: build_lm_data (block_size, data, tokenizer) and the BPE trainer (vocab_size)


@dataclass
class ModelShape:
    """The shape of a new MemoryFormer: a preset, or the fields below (their names are MemoryFormerConfig's)."""

    preset: str | None = option(
        None, "MemoryFormer preset (default: the shape of --hidden-size, --layers, ...)", choices=PRESETS)
    hidden_size: int = option(256, "width d")
    num_hidden_layers: int = option(4, "number of blocks", flag="--layers")
    num_attention_heads: int = option(4, "attention heads", flag="--heads")
    hash_bits: int = option(8, "tau, bits per hash code (tables of 2^tau rows)")
    expand_bits: int = option(2, "e of the Memory Block")

    def shape(self) -> dict:
        """The MemoryFormerConfig fields of this shape (used when no preset is named; the config checks them)."""
        return dict(hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
                    num_attention_heads=self.num_attention_heads, hash_bits=self.hash_bits,
                    expand_bits=self.expand_bits)


@dataclass
class TrainCommandSettings:
    """What `memoryformer train` adds to the settings above: the model to start from, and whether to replace an
    earlier run."""

    model: str | None = option(
        None, "a saved MemoryFormer (folder or Hub id) to continue training (default: a new model of the shape "
        "below)")
    overwrite: bool = option(
        False, "replace an earlier run in --out (its checkpoints are deleted, its model replaced)")
    table_dtype: str | None = option(
        None, "store the Memory Layer tables in bfloat16 (half their memory; float32 everywhere else, sums in float32), "
        "updated by a --table-optimizer rule with stochastic rounding (default: the model's dtype)",
        choices=("bfloat16",))


__all__ = [
    "PRESETS",
    "DataSettings",
    "ModelShape",
    "TrainCommandSettings",
    "TrainingSettings",
    "check_output_dir",
    "check_table_optimizer_setup",
    "option",
    "required",
]
