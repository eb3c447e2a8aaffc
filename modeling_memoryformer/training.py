"""Training a MemoryFormer (or its dense twin) with `transformers.Trainer` and the paper's recipe.

The recipe (paper section 4.1 and the authors' GPT-NeoX configs, SPEC section 4):

- AdamW with betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on the tables, embeddings and LM head, none on biases
  and norm parameters (`no_decay_parameter_names`);
- gradient clipping at 1.0; linear warmup over the first 1% of steps, then a cosine decay to 1% of the peak rate;
- the learning rate of the Pythia model of the same width (Pythia-70M 1e-3, 160M 6e-4, 410M 3e-4) for a dense
  model, and **3x that rate for a MemoryFormer** (`MEMORYFORMER_LR_MULTIPLIER`): a table row only receives a gradient
  from the tokens that hash to it, so the tables see sparse, small updates and want a larger rate (paper Table 4:
  3x is best). Override with `learning_rate=` (absolute) or `lr_multiplier=` (relative to the Pythia rate).

Everything else is the Trainer: progress bars, evaluation loss (and perplexity = exp(loss)), logs (a CSV file, or
TensorBoard and any other Trainer integration), checkpoints, exact resume (`resume_from_checkpoint`: optimizer,
schedule, RNG and data position are restored, so the resumed run continues the uninterrupted loss curve), bf16
autocast and distributed data parallelism under `torchrun` / `accelerate launch`.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

# (hidden size, learning rate) of the Pythia suite, smallest first: the dense rate of a model is that of the widest
# Pythia model not wider than it (models narrower than Pythia-70M take its rate).
PYTHIA_LEARNING_RATES = ((512, 1e-3), (768, 6e-4), (1024, 3e-4), (2048, 2e-4), (2560, 1.6e-4), (4096, 1.2e-4))
MEMORYFORMER_LR_MULTIPLIER = 3.0


def dense_learning_rate(hidden_size: int) -> float:
    """The Pythia learning rate for a model of width `hidden_size` (see `PYTHIA_LEARNING_RATES`)."""
    rate = PYTHIA_LEARNING_RATES[0][1]
    for width, lr in PYTHIA_LEARNING_RATES:
        if hidden_size >= width:
            rate = lr
    return rate


def is_memoryformer(model_or_config) -> bool:
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "model_type", None) == "memoryformer"


def default_learning_rate(model_or_config, lr_multiplier: float | None = None) -> float:
    """Peak learning rate of the recipe: the Pythia rate of the model's width times `lr_multiplier` (default: 3 for
    a MemoryFormer, 1 for anything else, e.g. the dense twin)."""
    config = getattr(model_or_config, "config", model_or_config)
    if lr_multiplier is None:
        lr_multiplier = MEMORYFORMER_LR_MULTIPLIER if is_memoryformer(config) else 1.0
    if not lr_multiplier > 0:
        raise ValueError(f"lr_multiplier must be > 0, got {lr_multiplier}.")
    return dense_learning_rate(config.hidden_size) * lr_multiplier


def no_decay_parameter_names(model: nn.Module) -> set[str]:
    """Names of the parameters trained without weight decay: every bias, and every parameter of a norm module
    (LayerNorm, RMSNorm, ... recognised by class name, so remote-code and peft-wrapped models are covered too)."""
    names = set()
    for module_name, module in model.named_modules():
        is_norm = isinstance(module, nn.LayerNorm) or type(module).__name__.lower().endswith("norm")
        for param_name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if is_norm or param_name == "bias" or param_name.endswith("_bias"):
                names.add(full)
    return names


class MemoryFormerTrainer(Trainer):
    """`Trainer` with the recipe's parameter groups (`no_decay_parameter_names`) that logs perplexity = exp(loss)
    with every evaluation loss."""

    def get_decay_parameter_names(self, model: nn.Module) -> list[str]:
        excluded = no_decay_parameter_names(model)
        return [name for name, _ in model.named_parameters() if name not in excluded]

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        # Added in place, so the metrics `evaluate()` returns, the log history and every callback all carry it.
        for prefix in ("eval_", "test_"):
            if f"{prefix}loss" in logs:
                logs[f"{prefix}perplexity"] = math.exp(min(logs[f"{prefix}loss"], 700.0))
        super().log(logs, *args, **kwargs)

    def _save_checkpoint(self, model, trial) -> None:
        # Nothing lost: the completion marker is removed before any file of checkpoint-N is (re)written and written
        # after the last one, so a write interrupted at any point (kill -9) is never taken for a complete checkpoint.
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        from .checkpoints import remove_complete_marker, write_complete_marker

        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save and os.path.isdir(folder):
            remove_complete_marker(folder)
        super()._save_checkpoint(model, trial)
        if self.args.should_save and os.path.isdir(folder):
            write_complete_marker(folder, self.state.global_step)


class CSVLogger(TrainerCallback):
    """Appends every Trainer log entry (loss, learning rate, grad norm, eval loss, perplexity) to `path` as CSV.

    On resume, rows logged after the checkpoint's step by the interrupted run are dropped first, so the file holds
    one row per step of the final curve."""

    COLUMNS = ("step", "epoch", "loss", "eval_loss", "eval_perplexity", "learning_rate", "grad_norm", "tokens")

    def __init__(self, path: str, tokens_per_step: int):
        self.path = path
        self.tokens_per_step = tokens_per_step

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        rows = []
        if os.path.exists(self.path):
            with open(self.path, newline="", encoding="utf-8") as f:
                rows = [row for row in csv.DictReader(f) if int(row["step"]) <= state.global_step]
        with open(self.path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=self.COLUMNS)
            writer.writeheader()
            writer.writerows(rows)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        row = {key: logs[key] for key in self.COLUMNS if key in logs}
        if not any(key in row for key in ("loss", "eval_loss")):
            return  # the end-of-training summary has its own fields
        row.update(step=state.global_step, epoch=state.epoch, tokens=state.global_step * self.tokens_per_step)
        with open(self.path, "a", newline="", encoding="utf-8") as f:
            csv.DictWriter(f, fieldnames=self.COLUMNS).writerow(row)


class StepTimer(TrainerCallback):
    """Wall time spent in training steps only (forward, backward, optimizer; not evaluation or checkpointing)."""

    def __init__(self):
        self.seconds = 0.0
        self.steps = 0
        self._start = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.steps += 1
            self._start = None


@dataclass
class TrainingSettings:
    """How to train; the defaults are the paper's recipe (see the module docstring). `learning_rate=None` means
    `default_learning_rate(model, lr_multiplier)`."""

    output_dir: str
    max_steps: int = 1000
    per_device_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float | None = None
    lr_multiplier: float | None = None
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    warmup_ratio: float = 0.01
    min_lr_ratio: float = 0.01
    bf16: bool = False
    eval_steps: int | None = None  # None: evaluate 10 times over the run
    logging_steps: int = 10
    save_steps: int | None = None  # None: no intermediate checkpoints
    save_total_limit: int | None = 2
    report_to: str = "csv"  # "csv", "none", or any Trainer integration ("tensorboard", ...); comma-separated
    seed: int = 0
    resume_from_checkpoint: str | bool | None = None  # True: the newest complete checkpoint in output_dir
    resume_partial: bool = False  # resume from a checkpoint without optimizer/scheduler state (fresh ones)
    save_final_model: bool = True
    progress: bool = True
    extra_arguments: dict = field(default_factory=dict)  # any other TrainingArguments field

    def __post_init__(self):
        for name in ("max_steps", "per_device_batch_size", "gradient_accumulation_steps", "logging_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        for name in ("eval_steps", "save_steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {getattr(self, name)}.")
        if self.learning_rate is not None and not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}.")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}.")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}.")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}.")
        check_output_dir(self.output_dir, "output_dir")


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


@dataclass
class TrainingResult:
    eval_loss: float
    perplexity: float
    steps: int
    train_tokens: int
    train_seconds: float  # time in training steps (see StepTimer)
    train_tokens_per_second: float
    log_history: list[dict]
    output_dir: str


def training_arguments(settings: TrainingSettings, model: nn.Module) -> TrainingArguments:
    """The `TrainingArguments` of `settings` for `model` (learning rate resolved)."""
    learning_rate = settings.learning_rate or default_learning_rate(model, settings.lr_multiplier)
    report_to = [r for r in settings.report_to.split(",") if r and r not in ("csv", "none")]
    eval_steps = settings.eval_steps or max(1, settings.max_steps // 10)
    arguments = dict(
        output_dir=settings.output_dir,
        max_steps=settings.max_steps,
        per_device_train_batch_size=settings.per_device_batch_size,
        per_device_eval_batch_size=settings.per_device_batch_size,
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
        learning_rate=learning_rate,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2,
        adam_epsilon=settings.adam_epsilon,
        max_grad_norm=settings.max_grad_norm,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": settings.min_lr_ratio},
        warmup_steps=settings.warmup_ratio,  # a float in [0, 1) is a fraction of max_steps
        optim="adamw_torch_fused",  # one vectorised pass over every parameter: 8x faster than the loop on CPU
        bf16=settings.bf16,
        eval_strategy="steps",
        eval_steps=eval_steps,
        logging_steps=settings.logging_steps,
        save_strategy="steps" if settings.save_steps else "no",
        save_steps=settings.save_steps or 500,
        save_total_limit=settings.save_total_limit,
        report_to=report_to or "none",
        seed=settings.seed,
        data_seed=settings.seed,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        disable_tqdm=not settings.progress,
        use_cpu=not torch.cuda.is_available(),
    )
    arguments.update(settings.extra_arguments)
    return TrainingArguments(**arguments)


def tokens_per_step(args: TrainingArguments, block_size: int) -> int:
    """Tokens one optimizer step consumes over all processes."""
    return args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size * block_size


def build_trainer(model: nn.Module, data, settings: TrainingSettings, callbacks=()) -> MemoryFormerTrainer:
    """A `MemoryFormerTrainer` for `model` on `data` (an `LMData`: `.train`, `.validation`, `.tokenizer`)."""
    args = training_arguments(settings, model)
    extra = []
    if "csv" in settings.report_to.split(","):
        extra.append(CSVLogger(os.path.join(settings.output_dir, "log.csv"), tokens_per_step(args, data.block_size)))
    return MemoryFormerTrainer(
        model=model,
        args=args,
        train_dataset=data.train,
        eval_dataset=data.validation,
        processing_class=data.tokenizer,
        callbacks=[*extra, *callbacks],
    )


def resolve_resume(settings: TrainingSettings, say=None) -> str | None:
    """The checkpoint folder to resume from (None: a fresh run). `True` is the newest *complete* checkpoint in
    output_dir: newer incomplete ones (an interrupted write) are skipped and reported through `say`. A checkpoint
    without optimizer or scheduler state is an error naming the missing file unless `settings.resume_partial`."""
    from .checkpoints import IncompleteCheckpointError, checkpoint_problems, latest_complete_checkpoint

    say = say or (lambda message: print(message, file=sys.stderr))
    resume = settings.resume_from_checkpoint
    if resume is None or resume is False:
        return None
    if isinstance(resume, str) and not os.path.isdir(resume):
        raise FileNotFoundError(
            f"resume_from_checkpoint={resume!r} is not a folder; pass a checkpoint folder "
            f"(e.g. {os.path.join(settings.output_dir, 'checkpoint-500')}) or True for the latest in output_dir."
        )
    if resume is True:
        folder, skipped = latest_complete_checkpoint(settings.output_dir)
        for path, problems in skipped:
            say(f"skipping incomplete checkpoint {path}: {'; '.join(problems)}")
        if folder is None:
            if skipped:
                raise IncompleteCheckpointError(
                    f"No complete checkpoint-* folder in {settings.output_dir!r} to resume from: "
                    f"{len(skipped)} incomplete one(s) skipped ({os.path.basename(skipped[0][0])}: "
                    f"{'; '.join(skipped[0][1])}). Pass one explicitly with --resume PATH "
                    f"(and --resume-partial if it lacks optimizer or scheduler state), or start a new run."
                )
            raise FileNotFoundError(
                f"No checkpoint-* folder in {settings.output_dir!r} to resume from; train with --save-steps first."
            )
        if skipped:
            say(f"resuming from {folder}, the newest complete checkpoint")
        resume = folder
    problems = checkpoint_problems(resume, require_marker=False, partial=settings.resume_partial)
    if problems:
        hint = ("" if settings.resume_partial else
                " Pass --resume-partial (resume_partial=True) to resume without the missing optimizer/scheduler "
                "state (a fresh optimizer and schedule)," )
        raise IncompleteCheckpointError(
            f"Cannot resume from {resume!r}: {'; '.join(problems)}.{hint} Or pass another checkpoint."
        )
    return resume


def train(model: nn.Module, data, settings: TrainingSettings, callbacks=()) -> TrainingResult:
    """Train `model` on `data` (an `LMData`) with `settings`; evaluate at the end; save the final model (and the
    tokenizer) to `settings.output_dir` unless `save_final_model=False`. Returns a `TrainingResult`."""
    if len(data.train) == 0 or len(data.validation) == 0:
        raise ValueError("The training data needs at least one training and one validation block.")
    resume = resolve_resume(settings)
    os.makedirs(settings.output_dir, exist_ok=True)
    timer = StepTimer()
    trainer = build_trainer(model, data, settings, callbacks=[timer, *callbacks])
    trainer.train(resume_from_checkpoint=resume)
    last = trainer.state.log_history[-2:] if trainer.state.log_history else []
    final = [e for e in last if "eval_loss" in e and e.get("step") == trainer.state.global_step]
    metrics = final[-1] if final else trainer.evaluate()  # the last step may have evaluated already
    if settings.save_final_model:
        trainer.save_model(settings.output_dir)
        trainer.save_state()
    step_tokens = tokens_per_step(trainer.args, data.block_size)
    return TrainingResult(
        eval_loss=metrics["eval_loss"],
        perplexity=metrics["eval_perplexity"],
        steps=trainer.state.global_step,
        train_tokens=trainer.state.global_step * step_tokens,
        train_seconds=timer.seconds,
        train_tokens_per_second=timer.steps * step_tokens / timer.seconds if timer.seconds else float("nan"),
        log_history=list(trainer.state.log_history),
        output_dir=settings.output_dir,
    )


def config_for_tokenizer(tokenizer, preset: str | None, shape: dict, block_size: int, **overrides):
    """A MemoryFormerConfig whose vocabulary and special tokens are the tokenizer's: the preset's shape (with
    `overrides`), or `shape` (hidden_size, num_hidden_layers, ... fields) when no preset is named."""
    from .configuration_memoryformer import MemoryFormerConfig

    special = dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_position_embeddings=max(block_size, 2048),
    )
    if preset:
        return MemoryFormerConfig.from_preset(preset, **special, **overrides)
    return MemoryFormerConfig(**shape, **special, **overrides)


# ---------------------------------------------------------------------------------------------------------------
# `memoryformer train`


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output folder: checkpoints, log.csv, the final model")
    parser.add_argument("--data", default=None,
                        help="text file, folder of .txt files, local dataset folder or Hub dataset id "
                             "(default: the embedded CPython documentation)")
    parser.add_argument("--text-column", default="text", help="text column of a dataset (default: %(default)s)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer path or Hub id (default: --model's own, else a byte-level BPE trained on the "
                             "training text)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="of the trained BPE tokenizer")
    parser.add_argument("--model", default=None, help="a saved MemoryFormer (folder or Hub id) to continue training")
    parser.add_argument("--preset", default=None, help="MemoryFormer preset (tiny, small, base)")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--hash-bits", type=int, default=8)
    parser.add_argument("--expand-bits", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8, help="per device (process)")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the recipe's)")
    parser.add_argument("--lr-multiplier", type=float, default=None,
                        help="times the Pythia rate of this width (default: 3, the paper's rule)")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup-ratio", type=float, default=0.01)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    parser.add_argument("--eval-steps", type=int, default=None)
    parser.add_argument("--logging-steps", type=int, default=10)
    parser.add_argument("--save-steps", type=int, default=None, help="checkpoint every N steps (resumable)")
    parser.add_argument("--report-to", default="csv", help="csv, tensorboard, none, ... (comma-separated)")
    parser.add_argument("--resume", default=None,
                        help="checkpoint folder to resume from, or 'latest' for the newest complete one in --out")
    parser.add_argument("--resume-partial", action="store_true",
                        help="allow resuming from a checkpoint without optimizer/scheduler state (fresh ones)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier run in --out (its checkpoints are deleted, its model replaced)")
    parser.add_argument("--seed", type=int, default=0)


def run_train(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM, set_seed

    from .data import build_lm_data
    from .modeling_memoryformer import MemoryFormerForCausalLM

    # settings first: bad values fail before any data is read or tokenizer trained
    from .checkpoints import check_train_output, checkpoint_folders, load_pretrained_strict

    resume = {"latest": True, None: None}.get(args.resume, args.resume)
    check_output_dir(args.out, "--out")
    check_train_output(args.out, resume, args.overwrite)
    settings = TrainingSettings(
        output_dir=args.out, max_steps=args.max_steps, per_device_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr, lr_multiplier=args.lr_multiplier,
        weight_decay=args.weight_decay, warmup_ratio=args.warmup_ratio, bf16=args.bf16, eval_steps=args.eval_steps,
        logging_steps=args.logging_steps, save_steps=args.save_steps, report_to=args.report_to, seed=args.seed,
        resume_from_checkpoint=resume, resume_partial=args.resume_partial,
    )
    if resume:
        resolve_resume(settings, say=lambda message: None)  # before any data is read; train() reports skips
    # before any data is read: a damaged --model (missing or unexpected tensors) fails at once, naming them
    model = load_pretrained_strict(AutoModelForCausalLM, args.model, "--model") if args.model else None
    # a saved model keeps its own tokenizer: a freshly trained BPE would not match its embeddings
    tokenizer = args.tokenizer or args.model
    data = build_lm_data(args.data, tokenizer, block_size=args.block_size, vocab_size=args.vocab_size,
                         text_column=args.text_column)
    set_seed(args.seed)
    if args.model:
        if model.config.vocab_size < len(data.tokenizer):
            raise ValueError(f"The model's vocabulary ({model.config.vocab_size}) is smaller than the tokenizer's "
                             f"({len(data.tokenizer)}); pass the model's own tokenizer with --tokenizer.")
    else:
        shape = dict(hidden_size=args.hidden_size, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                     hash_bits=args.hash_bits, expand_bits=args.expand_bits)
        config = config_for_tokenizer(data.tokenizer, args.preset, shape, args.block_size)
        model = MemoryFormerForCausalLM(config)
    main_process = int(os.environ.get("RANK", "0")) == 0  # under torchrun / accelerate, rank 0 reports
    say = print if main_process else (lambda *a, **k: None)
    say(f"{data.description}: {data.num_train_tokens:,} training / {data.num_validation_tokens:,} validation "
          f"tokens; {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters; "
          f"lr {settings.learning_rate or default_learning_rate(model, settings.lr_multiplier):g}")
    if args.overwrite and not resume:
        # the earlier run's checkpoints would otherwise mix with this run's (and --resume latest could pick them)
        import shutil

        for folder in checkpoint_folders(args.out):
            shutil.rmtree(folder)
    result = train(model, data, settings)
    say(f"validation loss {result.eval_loss:.4f}, perplexity {result.perplexity:.2f}; "
          f"{result.train_tokens_per_second:,.0f} training tokens/s; model saved to {args.out}")
    return 0


__all__ = [
    "MEMORYFORMER_LR_MULTIPLIER",
    "PYTHIA_LEARNING_RATES",
    "CSVLogger",
    "MemoryFormerTrainer",
    "TrainingResult",
    "TrainingSettings",
    "build_trainer",
    "config_for_tokenizer",
    "default_learning_rate",
    "dense_learning_rate",
    "no_decay_parameter_names",
    "train",
    "training_arguments",
]
