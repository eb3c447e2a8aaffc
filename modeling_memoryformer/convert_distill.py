"""Distillation of a converted MemoryFormer from its dense teacher, through `transformers.Trainer`.

The loss is KL(teacher || student) per token, sum_v p_T(v) (log p_T(v) - log p_S(v)), averaged over all positions:
the student learns the teacher's whole next-token distribution, not only the observed token. The same loop without a
teacher (`teacher=None`) trains with the usual next-token cross-entropy, which is how the from-scratch baseline of
the same CPU budget is trained.
"""

from __future__ import annotations

import tempfile
import time
import copy
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.nn import functional as F
from transformers import Trainer, TrainerCallback, TrainingArguments


@dataclass
class TrainingBudget:
    """How long and how hard to train: at most `steps` optimizer steps and `cpu_minutes` of process CPU time (all
    threads; the run stops early once spent). With `steps=None` the number of steps that fits the CPU budget is
    measured by a short probe run (`steps_for_cpu_budget`). AdamW with a cosine schedule over the steps after a linear
    warmup."""

    steps: int | None
    cpu_minutes: float | None = None
    learning_rate: float = 1e-3
    batch_size: int = 8
    warmup_fraction: float = 0.05
    weight_decay: float = 0.0
    seed: int = 0


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || student); logits [..., vocab]."""
    student_log_probs = F.log_softmax(student_logits.float(), dim=-1).flatten(0, -2)
    teacher_log_probs = F.log_softmax(teacher_logits.float(), dim=-1).flatten(0, -2)
    return F.kl_div(student_log_probs, teacher_log_probs, log_target=True, reduction="batchmean")


class DistillationTrainer(Trainer):
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


class StepClock(TrainerCallback):
    """Process CPU time at the end of every optimizer step (`times`), to measure the steady-state cost of a step."""

    def __init__(self):
        self.times: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.process_time())


class CpuBudgetCallback(TrainerCallback):
    """Stops training once the process has used `seconds` of CPU time since the start of training."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.start = 0.0
        self.stopped = False

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.process_time()

    def on_step_end(self, args, state, control, **kwargs):
        if time.process_time() - self.start >= self.seconds:
            self.stopped = control.should_training_stop = True


class TokenBlocks(torch.utils.data.Dataset):
    """Fixed-length token sequences as causal-LM examples: {"input_ids", "labels"} (labels = input ids; the model
    shifts them)."""

    def __init__(self, input_ids: torch.Tensor):
        self.input_ids = input_ids

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "labels": self.input_ids[index]}


def train_student(
    model: nn.Module,
    train_ids: torch.Tensor,
    budget: TrainingBudget,
    teacher: nn.Module | None = None,
    callbacks: list[TrainerCallback] | None = None,
) -> dict:
    """Train `model` in place on the sequences `train_ids` [S, T]: distillation from `teacher`, or cross-entropy from
    the data when `teacher` is None; `callbacks` are added to the Trainer. Returns {"steps", "planned_steps",
    "cpu_seconds", "wall_seconds", "stopped_by_budget", "losses": [(step, loss), ...]}."""
    if budget.steps is None:
        budget = replace(budget, steps=steps_for_cpu_budget(model, train_ids, budget, teacher))
    callback = CpuBudgetCallback(60.0 * budget.cpu_minutes) if budget.cpu_minutes else None
    callbacks = [*(callbacks or []), *([callback] if callback else [])]
    with tempfile.TemporaryDirectory(prefix="memoryformer-train-") as scratch:
        arguments = TrainingArguments(
            output_dir=scratch,
            max_steps=budget.steps,
            per_device_train_batch_size=budget.batch_size,
            learning_rate=budget.learning_rate,
            lr_scheduler_type="cosine",
            warmup_steps=budget.warmup_fraction,
            weight_decay=budget.weight_decay,
            adam_beta2=0.95,
            max_grad_norm=1.0,
            logging_steps=max(1, budget.steps // 20),
            save_strategy="no",
            eval_strategy="no",
            report_to=[],
            use_cpu=True,
            dataloader_num_workers=0,
            remove_unused_columns=False,
            seed=budget.seed,
        )
        trainer_class, extra = (Trainer, {}) if teacher is None else (DistillationTrainer, {"teacher": teacher})
        trainer = trainer_class(
            model=model,
            args=arguments,
            train_dataset=TokenBlocks(train_ids),
            callbacks=callbacks,
            **extra,
        )
        cpu, wall = time.process_time(), time.perf_counter()
        trainer.train()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    model.eval()
    return {
        "steps": trainer.state.global_step,
        "planned_steps": budget.steps,
        "cpu_seconds": cpu,
        "wall_seconds": wall,
        "stopped_by_budget": bool(callback and callback.stopped),
        "losses": [(entry["step"], entry["loss"]) for entry in trainer.state.log_history if "loss" in entry],
    }


def steps_for_cpu_budget(
    model: nn.Module, train_ids: torch.Tensor, budget: TrainingBudget, teacher: nn.Module | None = None,
    probe_steps: int = 5, margin: float = 0.95,
) -> int:
    """How many steps of `train_student` fit in `budget.cpu_minutes`: the steady-state CPU time per step, measured
    between the first and the last of `probe_steps` steps on a copy of `model` (the first step pays one-off set-up
    costs), times `margin`."""
    if not budget.cpu_minutes:
        raise ValueError("steps_for_cpu_budget needs budget.cpu_minutes.")
    clock = StepClock()
    probe = replace(budget, steps=probe_steps, cpu_minutes=None)
    train_student(copy.deepcopy(model), train_ids[: probe_steps * budget.batch_size], probe, teacher, [clock])
    per_step = (clock.times[-1] - clock.times[0]) / (len(clock.times) - 1)
    return max(1, int(margin * 60.0 * budget.cpu_minutes / per_step))


__all__ = ["DistillationTrainer", "TrainingBudget", "distillation_loss", "steps_for_cpu_budget", "train_student"]
