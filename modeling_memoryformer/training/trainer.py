"""Training a MemoryFormer (or its dense twin) with `transformers.Trainer` and the paper's recipe.

The recipe (paper section 3.1 and the authors' GPT-NeoX configs):

- AdamW with betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on the tables (as the authors' code;
  `table_weight_decay=False` exempts them), embeddings and LM head, none on biases and norm parameters
  (`no_decay_parameter_names`);
  or, with `table_optimizer`, a row-wise rule on the tables applied in the backward pass and AdamW on the rest
  (`training.table_optimizer`: its semantics for clipping, accumulation and several processes);
- gradient clipping at 1.0; linear warmup over the first 1% of steps, then a cosine decay to 1% of the peak rate;
- the learning rate of the Pythia model of the same width (Pythia-70M 1e-3, 160M 6e-4, 410M 3e-4) for a dense
  model, and **3x that rate for a MemoryFormer** (`MEMORYFORMER_LR_MULTIPLIER`): a table row only receives a gradient
  from the tokens that hash to it, so the tables see sparse, small updates and want a larger rate (paper Table 4:
  3x is best). Override with `learning_rate=` (absolute) or `lr_multiplier=` (relative to the Pythia rate).

Evaluation and logging intervals scale with the run (`evaluation_interval`, `logging_interval`): by default a run
evaluates 10 times, at least 10 steps apart (once, at the end, for a run of 10 steps or fewer), and logs the training
loss about 50 times, whatever its length.

Everything else is the Trainer: progress bars, evaluation loss (and perplexity = exp(loss)), logs (a CSV file, or
TensorBoard and any other Trainer integration), checkpoints, exact resume (`resume_from_checkpoint`: optimizer,
schedule, RNG and data position are restored, so the resumed run continues the uninterrupted loss curve), bf16
autocast and distributed data parallelism under `torchrun` / `accelerate launch`.
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainerState, TrainingArguments

from .settings import (
    DataSettings,
    ModelShape,
    TrainCommandSettings,
    TrainingSettings,
    check_table_optimizer_setup,
)
from .table_optimizer import TableAdamW, exclude_tables_from_ddp, table_param_groups, table_parameters

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


def no_decay_parameter_names(model: nn.Module, table_weight_decay: bool = True) -> set[str]:
    """Names of the parameters trained without weight decay: every bias, every parameter of a norm module
    (LayerNorm, RMSNorm, ... recognised by class name, so remote-code and peft-wrapped models are covered too) and,
    when `table_weight_decay` is False, the Memory Layer tables."""
    tables = set() if table_weight_decay else {id(p) for p in table_parameters(model)}
    names = {name for name, p in model.named_parameters() if id(p) in tables}
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
        excluded = no_decay_parameter_names(model, self.table_weight_decay)
        return [name for name, _ in model.named_parameters() if name not in excluded]

    table_optimizer = "adamw"  # set by build_trainer; a row-wise rule trains the tables in the backward pass
    table_lr_multiplier = 1.0  # the rule's learning rate over the run's (set by build_trainer)
    table_weight_decay = True  # False: the tables train without weight decay (set by build_trainer)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.is_fsdp_enabled:  # on gloo, FSDP2's gradients are reduced with SUM, never AVG (see below)
            self.add_callback(_GlooSumReductions())

    def create_accelerator_and_postprocess(self) -> None:
        # FSDP asked for (args.fsdp, or accelerate launch --use_fsdp) shards on CPU too, where accelerate alone would
        # fall back to DDP (training.sharding.enable_fsdp_on_cpu).
        from .sharding import enable_fsdp_on_cpu

        super().create_accelerator_and_postprocess()
        enable_fsdp_on_cpu(self)

    def create_optimizer(self, model=None):
        """AdamW (the Trainer's own) or, with a table rule, `TableAdamW`: the same AdamW on the dense parameters and
        the rule on the Memory Layer tables, applied in the backward pass (see training.table_optimizer)."""
        if self.table_optimizer == "adamw" or self.optimizer is not None:
            if self.optimizer is None:
                check_adamw_tables(self.model if model is None else model)
            return super().create_optimizer(model)
        model = self.model if model is None else model
        args = self.args
        check_table_optimizer_setup(self.table_optimizer, args.gradient_accumulation_steps)
        exclude_tables_from_ddp(model)  # before accelerate wraps the model in DDP: the rule's hooks reduce them
        groups = table_param_groups(model, self.table_optimizer, args.weight_decay, no_decay_parameter_names(model))
        for group in groups:  # the schedule scales every group's own rate, so the ratio holds over the run
            if group.get("table_rule"):
                group["lr"] = args.learning_rate * self.table_lr_multiplier
                group["weight_decay"] = args.weight_decay if self.table_weight_decay else 0.0
        self.optimizer = TableAdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                    eps=args.adam_epsilon, weight_decay=args.weight_decay,
                                    fused=args.optim == "adamw_torch_fused")
        return self.optimizer

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
        from .outputs import write_errors_named

        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save and os.path.isdir(folder):
            remove_complete_marker(folder)
        kept = "It is left without its completion marker (--resume skips it); the earlier checkpoints are kept."
        with write_errors_named(folder, kept):
            super()._save_checkpoint(model, trial)
        if self.args.should_save and os.path.isdir(folder):
            write_complete_marker(folder, self.state.global_step)


def check_adamw_tables(model: nn.Module) -> None:
    """A ValueError when `model` keeps bfloat16 tables beside float32 parameters and AdamW would train them: AdamW
    rounds every update to the nearest bfloat16 value, so updates smaller than half a bfloat16 step (most late in a
    run) are lost; the table rules round stochastically (training.table_optimizer)."""
    from .table_optimizer import table_parameters

    tables = table_parameters(model)
    table_ids = {id(t) for t in tables}
    others = [p for p in model.parameters() if p.requires_grad and id(p) not in table_ids]
    if any(t.dtype == torch.bfloat16 for t in tables) and any(p.dtype == torch.float32 for p in others):
        raise ValueError(
            "The tables are stored in bfloat16 (table_dtype='bfloat16'), and AdamW would round every table update to "
            "the nearest bfloat16 value, losing the small ones. Train them with a table rule, which rounds "
            "stochastically: --table-optimizer rowwise_adagrad or adam_rowwise."
        )


class _GlooSumReductions(TrainerCallback):
    """Once the Trainer has sharded the model: SUM (not AVG) gradient reductions on gloo."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from .sharding import sum_reductions_on_gloo

        sum_reductions_on_gloo(model)


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
    """Wall time spent in training steps only (forward, backward, optimizer; not evaluation or checkpointing), and,
    apart, in evaluations (the Trainer's `eval_runtime` of each)."""

    def __init__(self):
        self.seconds = 0.0
        self.steps = 0
        self.eval_seconds = 0.0
        self.evaluations = 0
        self._start = None

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.eval_seconds += (metrics or {}).get("eval_runtime", 0.0)
        self.evaluations += 1

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.steps += 1
            self._start = None


DEFAULT_EVAL_POINTS = 10
MIN_DEFAULT_EVAL_INTERVAL = 10  # steps: short runs do not spend most of their time evaluating
DEFAULT_LOGS = 50


def evaluation_interval(settings: TrainingSettings) -> int:
    """Steps between evaluations: `eval_steps`; else `eval_points` evaluations spread over `max_steps`, the last at
    `max_steps` (ceil(max_steps / eval_points) steps apart, so never more than eval_points of them, counting the
    final one); by default 10 evaluations, at least 10 steps apart, so a 10-step run evaluates once, at its end."""
    if settings.eval_steps is not None:
        return settings.eval_steps
    if settings.eval_points is not None:
        return max(1, math.ceil(settings.max_steps / settings.eval_points))
    spread = max(math.ceil(settings.max_steps / DEFAULT_EVAL_POINTS), MIN_DEFAULT_EVAL_INTERVAL)
    return min(settings.max_steps, spread)


def logging_interval(settings: TrainingSettings) -> int:
    """Steps between training-loss logs: `logging_steps`, else about 50 logs over the run (at least every step)."""
    if settings.logging_steps is not None:
        return settings.logging_steps
    return max(1, math.ceil(settings.max_steps / DEFAULT_LOGS))


def schedule_line(settings: TrainingSettings) -> str:
    """One line telling how often the run evaluates and logs, and how to change it."""
    every = evaluation_interval(settings)
    count = settings.max_steps // every + (settings.max_steps % every > 0)
    return (f"{settings.max_steps} steps: evaluating every {every} step{'s' * (every > 1)} ({count} evaluation"
            f"{'s' * (count > 1)}), logging every {logging_interval(settings)} (--eval-points, --eval-steps, "
            "--logging-steps to change)")


@dataclass
class TrainingResult:
    eval_loss: float
    perplexity: float
    steps: int
    train_tokens: int
    train_seconds: float  # time in training steps (see StepTimer)
    train_tokens_per_second: float
    eval_seconds: float  # time in the evaluations of this call (the final one included)
    evaluations: int
    log_history: list[dict]
    output_dir: str


# TrainingSettings fields that are TrainingArguments fields of the same name and meaning: copied as they are.
SAME_AS_TRAINING_ARGUMENTS = ("output_dir", "max_steps", "gradient_accumulation_steps", "weight_decay", "adam_beta1",
                              "adam_beta2", "adam_epsilon", "max_grad_norm", "bf16", "save_total_limit", "seed")


def training_arguments(settings: TrainingSettings, model: nn.Module) -> TrainingArguments:
    """The `TrainingArguments` of `settings` for `model` (learning rate resolved): the fields of the same name
    copied, the others translated to the Trainer's terms, then `settings.extra_arguments`."""
    report_to = [r for r in settings.report_to.split(",") if r and r not in ("csv", "none")]
    arguments = {name: getattr(settings, name) for name in SAME_AS_TRAINING_ARGUMENTS}
    arguments.update(
        per_device_train_batch_size=settings.per_device_batch_size,
        per_device_eval_batch_size=settings.per_device_batch_size,
        learning_rate=settings.learning_rate or default_learning_rate(model, settings.lr_multiplier),
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": settings.min_lr_ratio},
        warmup_steps=settings.warmup_ratio,  # a float in [0, 1) is a fraction of max_steps
        optim="adamw_torch_fused",  # one vectorised pass over every parameter: 8x faster than the loop on CPU
        eval_strategy="steps",
        eval_steps=evaluation_interval(settings),
        logging_steps=logging_interval(settings),
        save_strategy="steps" if settings.save_steps else "no",
        save_steps=settings.save_steps or 500,
        report_to=report_to or "none",
        data_seed=settings.seed,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        prediction_loss_only=True,  # evaluation needs the loss only: the Trainer would otherwise keep every logit
        disable_tqdm=not settings.progress,
        use_cpu=not torch.cuda.is_available(),
    )
    if settings.fsdp:
        from .sharding import fsdp_training_arguments

        arguments.update(fsdp_training_arguments())
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
    trainer = MemoryFormerTrainer(
        model=model,
        args=args,
        train_dataset=data.train,
        eval_dataset=data.validation,
        processing_class=data.tokenizer,
        callbacks=[*extra, *callbacks],
    )
    trainer.table_optimizer = settings.table_optimizer
    trainer.table_lr_multiplier = settings.table_lr_multiplier
    trainer.table_weight_decay = settings.table_weight_decay
    return trainer


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


def checkpoint_step(folder: str) -> int:
    """The optimizer step a Trainer checkpoint (or a final save) was written at: `global_step` of its
    trainer_state.json."""
    with open(os.path.join(folder, "trainer_state.json"), encoding="utf-8") as f:
        return int(json.load(f)["global_step"])


def finished_message(step: int, max_steps: int) -> str:
    """The line a resumed run prints when its checkpoint is at (or past) max_steps."""
    if step == max_steps:
        return f"run already finished at step {step} of {max_steps}; nothing to train"
    return f"run already at step {step}, past max_steps {max_steps}; nothing to train"


def train(model: nn.Module, data, settings: TrainingSettings, callbacks=()) -> TrainingResult:
    """Train `model` on `data` (an `LMData`) with `settings`; evaluate at the end; save the final model (and the
    tokenizer) to `settings.output_dir` unless `save_final_model=False`. Returns a `TrainingResult`.

    Resuming a run whose checkpoint is at (or past) `max_steps` trains nothing: `model` gets the checkpoint's
    weights, and the result its last evaluation."""
    if len(data.train) == 0 or len(data.validation) == 0:
        raise ValueError("The training data needs at least one training and one validation block.")
    resume = resolve_resume(settings)
    os.makedirs(settings.output_dir, exist_ok=True)
    timer = StepTimer()
    trainer = build_trainer(model, data, settings, callbacks=[timer, *callbacks])
    done = checkpoint_step(resume) if resume else 0
    if done >= settings.max_steps:
        # Not handed to trainer.train(): its loop tests max_steps only after a step (DefaultFlowCallback at
        # on_step_end), and a checkpoint in the middle of an epoch puts it back inside the epoch loop, so a finished
        # run would train step max_steps + 1 and save checkpoint-(max_steps + 1).
        if trainer.is_world_process_zero():
            print(finished_message(done, settings.max_steps))
        trainer._load_from_checkpoint(resume)
        trainer.state = TrainerState.load_from_json(os.path.join(resume, "trainer_state.json"))
    else:
        trainer.train(resume_from_checkpoint=resume)
    last = trainer.state.log_history[-2:] if trainer.state.log_history else []
    final = [e for e in last if "eval_loss" in e and e.get("step") == trainer.state.global_step]
    metrics = final[-1] if final else trainer.evaluate()  # the last step may have evaluated already
    if settings.save_final_model:
        from .outputs import staged_files
        from .sharding import full_state_dict

        # Written beside the earlier run's final model (--overwrite) and swapped in once complete: a failed write
        # (a full disk) leaves that model as it was. A sharded run still leaves a model that from_pretrained loads.
        with full_state_dict(trainer), staged_files(settings.output_dir,
                                                     main_process=trainer.is_world_process_zero()) as staging:
            trainer.save_model(staging)
        trainer.save_state()
    step_tokens = tokens_per_step(trainer.args, data.block_size)
    return TrainingResult(
        eval_loss=metrics["eval_loss"],
        perplexity=metrics["eval_perplexity"],
        steps=trainer.state.global_step,
        train_tokens=trainer.state.global_step * step_tokens,
        train_seconds=timer.seconds,
        train_tokens_per_second=timer.steps * step_tokens / timer.seconds if timer.seconds else float("nan"),
        eval_seconds=timer.eval_seconds,
        evaluations=timer.evaluations,
        log_history=list(trainer.state.log_history),
        output_dir=settings.output_dir,
    )


def config_for_tokenizer(tokenizer, preset: str | None, shape: dict, block_size: int, **overrides):
    """A MemoryFormerConfig whose vocabulary and special tokens are the tokenizer's: the preset's shape (with
    `overrides`), or `shape` (hidden_size, num_hidden_layers, ... fields) when no preset is named."""
    from ..configuration_memoryformer import MemoryFormerConfig

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
# `memoryformer train` (its options: the fields of TrainingSettings, DataSettings, ModelShape, TrainCommandSettings)


def run_train(settings: TrainingSettings, data_settings: DataSettings, shape: ModelShape,
              command: TrainCommandSettings) -> int:
    from transformers import AutoModelForCausalLM, set_seed

    from .data import build_lm_data
    from ..modeling_memoryformer import MemoryFormerForCausalLM

    # settings first: bad values fail before any data is read or tokenizer trained
    from .checkpoints import check_train_output, checkpoint_folders, load_pretrained_strict

    out = settings.output_dir
    resume = settings.resume_from_checkpoint
    check_train_output(out, resume, command.overwrite)
    main_process = int(os.environ.get("RANK", "0")) == 0  # under torchrun / accelerate, rank 0 reports
    say = print if main_process else (lambda *a, **k: None)
    if resume:
        folder = resolve_resume(settings, say=lambda message: None)  # before any data is read; train() reports skips
        done = checkpoint_step(folder)
        if done >= settings.max_steps and _final_model_saved(out, done):
            say(f"{finished_message(done, settings.max_steps)} ({os.path.basename(folder)}; the final model is in "
                f"{out})")
            return 0
    # before any data is read: a damaged --model (missing or unexpected tensors) fails at once, naming them
    model = load_pretrained_strict(AutoModelForCausalLM, command.model, "--model") if command.model else None
    # a saved model keeps its own tokenizer: a freshly trained BPE would not match its embeddings
    tokenizer = data_settings.tokenizer or command.model
    data = build_lm_data(data_settings.data, tokenizer, block_size=data_settings.block_size,
                         vocab_size=data_settings.vocab_size, text_column=data_settings.text_column,
                         progress=settings.progress)
    set_seed(settings.seed)
    if command.model:
        if model.config.vocab_size < len(data.tokenizer):
            raise ValueError(f"The model's vocabulary ({model.config.vocab_size}) is smaller than the tokenizer's "
                             f"({len(data.tokenizer)}); pass the model's own tokenizer with --tokenizer.")
    else:
        storage = {"table_dtype": command.table_dtype} if command.table_dtype else {}
        config = config_for_tokenizer(data.tokenizer, shape.preset, shape.shape(), data_settings.block_size, **storage)
        model = MemoryFormerForCausalLM(config)
    if command.model and command.table_dtype:
        model.quantize_tables(command.table_dtype)  # bfloat16 tables stay trainable parameters
    say(f"{data.description}: {data.num_train_tokens:,} training / {data.num_validation_tokens:,} validation "
        f"tokens; {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters; "
        f"lr {settings.learning_rate or default_learning_rate(model, settings.lr_multiplier):g}")
    if command.overwrite and not resume:
        # the earlier run's checkpoints would otherwise mix with this run's (and --resume latest could pick them)
        import shutil

        for folder in checkpoint_folders(out):
            shutil.rmtree(folder)
    say(schedule_line(settings))
    if settings.fsdp or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":  # or accelerate's flag
        world = int(os.environ.get("WORLD_SIZE", "1"))
        say(f"FSDP2 over {world} process{'es' * (world > 1)}: each holds 1/{world} of every table, its gradient and "
            "its AdamW state, and gathers one decoder layer at a time")
    result = train(model, data, settings)
    speed = f"{result.train_tokens_per_second:,.0f} training tokens/s; " if result.train_seconds else ""
    say(f"validation loss {result.eval_loss:.4f}, perplexity {result.perplexity:.2f}; {speed}"
        f"{result.train_seconds:.0f} s training, {result.eval_seconds:.0f} s in {result.evaluations} evaluations; "
        f"model saved to {out}")
    return 0


def _final_model_saved(out: str, step: int) -> bool:
    """Whether `out` holds the final model of a run that ended at `step` (train() saves it after the last checkpoint,
    so a run killed in between has none yet: then train() writes it from the checkpoint)."""
    try:
        return os.path.isfile(os.path.join(out, "config.json")) and checkpoint_step(out) >= step
    except (OSError, ValueError, KeyError):
        return False


__all__ = [
    "MEMORYFORMER_LR_MULTIPLIER",
    "PYTHIA_LEARNING_RATES",
    "CSVLogger",
    "MemoryFormerTrainer",
    "TrainingResult",
    "TrainingSettings",
    "build_trainer",
    "checkpoint_step",
    "evaluation_interval",
    "logging_interval",
    "config_for_tokenizer",
    "default_learning_rate",
    "dense_learning_rate",
    "no_decay_parameter_names",
    "train",
    "training_arguments",
]
