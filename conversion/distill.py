"""Distillation of a converted MemoryFormer from its dense teacher, through `transformers.Trainer`.

The loss is KL(teacher || student) per token, sum_v p_T(v) (log p_T(v) - log p_S(v)), averaged over all positions:
the student learns the teacher's whole next-token distribution, not only the observed token. The same loop without a
teacher (`teacher=None`) trains with the usual next-token cross-entropy, which is how the from-scratch baseline of
the same CPU budget is trained.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.lr_scheduler import LambdaLR
from tqdm.auto import tqdm
from transformers import Trainer, TrainerCallback, TrainingArguments

from ..training.data import TokenBlocks


@dataclass
class TrainingBudget:
    """How long and how hard to train: `steps` optimizer steps, or `cpu_minutes` of process CPU time (all threads
    counted), or whichever ends first when both are given. AdamW; the learning rate warms up linearly over the first
    `warmup_fraction` of the budget and then follows a cosine to zero, where the budget's progress is
    max(step / steps, CPU time / cpu_minutes), so a CPU-time budget gets a complete schedule whatever a step costs.
    `train_embeddings=False` freezes the token embeddings and the LM head (copied from the teacher when converting)."""

    steps: int | None = None
    cpu_minutes: float | None = None
    learning_rate: float = 1e-3
    batch_size: int = 8
    warmup_fraction: float = 0.05
    weight_decay: float = 0.0
    train_embeddings: bool = True
    seed: int = 0

    def __post_init__(self):
        if not (self.steps or self.cpu_minutes):
            raise ValueError("A TrainingBudget needs steps > 0 or cpu_minutes > 0.")


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || student); logits [..., vocab]."""
    student_log_probs = F.log_softmax(student_logits.float(), dim=-1).flatten(0, -2)
    teacher_log_probs = F.log_softmax(teacher_logits.float(), dim=-1).flatten(0, -2)
    return F.kl_div(student_log_probs, teacher_log_probs, log_target=True, reduction="batchmean")


class BudgetTrainer(Trainer):
    """A Trainer whose learning-rate schedule is a `BudgetSchedule` (so the logged rate is the one applied)."""

    def __init__(self, *args, schedule: BudgetSchedule, **kwargs):
        self.schedule = schedule
        super().__init__(*args, callbacks=[schedule], **kwargs)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None:
            self.lr_scheduler = LambdaLR(optimizer or self.optimizer, self.schedule.factor)
        return self.lr_scheduler


class DistillationTrainer(BudgetTrainer):
    """A Trainer whose loss is `distillation_loss` against a frozen `teacher` (kept in eval mode, no gradients)."""

    def __init__(self, *args, teacher: nn.Module, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher = teacher.eval().requires_grad_(False)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with torch.no_grad():
            teacher_logits = self.teacher(input_ids=inputs["input_ids"]).logits
        outputs = model(input_ids=inputs["input_ids"])
        loss = distillation_loss(outputs.logits, teacher_logits)
        return (loss, outputs) if return_outputs else loss


class BudgetSchedule(TrainerCallback):
    """The learning-rate factor of every step from the budget's progress (see `TrainingBudget`); as a callback it
    stops training when the budget is spent and shows the progress (tqdm over the budget)."""

    def __init__(self, budget: TrainingBudget, progress: bool = True):
        self.budget = budget
        self.show = progress
        self.start = time.process_time()
        self.last_spent = 0.0
        self.bar = None

    def cpu_fraction(self) -> float:
        """Share of the CPU-time budget spent since training began (0 without a CPU-time budget)."""
        if not self.budget.cpu_minutes:
            return 0.0
        return (time.process_time() - self.start) / (60.0 * self.budget.cpu_minutes)

    def progress(self, step: int) -> float:
        return max(step / self.budget.steps if self.budget.steps else 0.0, self.cpu_fraction())

    def factor(self, step: int) -> float:
        """Multiplier of the peak rate for the step about to run: linear warmup, then a cosine to zero."""
        progress, warmup = self.progress(step), self.budget.warmup_fraction
        if progress < warmup:
            return progress / warmup
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (progress - warmup) / (1.0 - warmup))))

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.process_time()
        self.last_spent = 0.0
        self.bar = tqdm(total=1000, desc="training (budget per mille)", disable=not self.show, leave=False)

    def on_step_end(self, args, state, control, **kwargs):
        self.bar.update(min(1000, int(1000 * self.progress(state.global_step))) - self.bar.n)
        spent = self.cpu_fraction()
        if spent + (spent - self.last_spent) >= 1.0:  # stop before a step that would overrun the CPU budget
            control.should_training_stop = True
        self.last_spent = spent

    def on_train_end(self, args, state, control, **kwargs):
        self.bar.close()


def train_student(
    model: nn.Module,
    train_ids: torch.Tensor,
    budget: TrainingBudget,
    teacher: nn.Module | None = None,
    progress: bool = True,
) -> dict:
    """Train `model` in place on the sequences `train_ids` [S, T] (shuffled, cycled): distillation from `teacher`, or
    cross-entropy from the data when `teacher` is None. Returns {"steps", "tokens", "cpu_seconds", "wall_seconds",
    "losses": [(step, loss), ...]}."""
    frozen = [] if budget.train_embeddings else [model.get_input_embeddings(), model.get_output_embeddings()]
    for module in frozen:
        module.requires_grad_(False)
    with tempfile.TemporaryDirectory(prefix="memoryformer-train-") as scratch:
        arguments = TrainingArguments(
            output_dir=scratch,
            max_steps=budget.steps or 10**9,  # a CPU-time budget stops the run through BudgetSchedule
            per_device_train_batch_size=budget.batch_size,
            learning_rate=budget.learning_rate,
            weight_decay=budget.weight_decay,
            adam_beta2=0.95,
            max_grad_norm=1.0,
            logging_steps=10,
            save_strategy="no",
            eval_strategy="no",
            report_to=[],
            use_cpu=True,
            dataloader_num_workers=0,
            remove_unused_columns=False,
            disable_tqdm=True,
            seed=budget.seed,
        )
        trainer_class, extra = (BudgetTrainer, {}) if teacher is None else (DistillationTrainer, {"teacher": teacher})
        trainer = trainer_class(
            model=model,
            args=arguments,
            train_dataset=TokenBlocks(train_ids),
            schedule=BudgetSchedule(budget, progress),
            **extra,
        )
        cpu, wall = time.process_time(), time.perf_counter()
        trainer.train()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    for module in frozen:
        module.requires_grad_(True)
    model.eval()
    steps = trainer.state.global_step
    return {
        "steps": steps,
        "tokens": steps * budget.batch_size * train_ids.shape[1],
        "cpu_seconds": cpu,
        "wall_seconds": wall,
        "losses": [(entry["step"], entry["loss"]) for entry in trainer.state.log_history if "loss" in entry],
    }


__all__ = ["BudgetSchedule", "BudgetTrainer", "DistillationTrainer", "TrainingBudget", "distillation_loss", "train_student"]
