"""Training with the paper's recipe through transformers.Trainer: learning rates, parameter groups, the schedule,
logs, exact resume, and data parallelism over two processes."""

from __future__ import annotations

import csv
import math
import os

import pytest
import torch
from transformers import GPTNeoXConfig, TrainerCallback

from _training_data import synthetic_lm_data
from conftest import tiny_model
from modeling_memoryformer import MemoryFormerConfig
from modeling_memoryformer.training.trainer import (
    TrainingSettings,
    build_trainer,
    default_learning_rate,
    dense_learning_rate,
    evaluation_interval,
    logging_interval,
    no_decay_parameter_names,
    train,
)

def trainable_model(seed: int = 0):
    return tiny_model(seed=seed, table_init_std=0.02, initializer_range=0.02).train()


def settings(out, **overrides) -> TrainingSettings:
    fields = dict(output_dir=str(out), max_steps=6, per_device_batch_size=4, logging_steps=1, eval_steps=3,
                  report_to="none", learning_rate=3e-3, progress=False, save_final_model=False)
    return TrainingSettings(**{**fields, **overrides})


def test_learning_rates_follow_pythia_and_the_3x_rule():
    # Pythia-70M / 160M / 410M rates (paper section 4.1); a MemoryFormer of the same width trains at 3x.
    assert dense_learning_rate(512) == 1e-3 and dense_learning_rate(768) == 6e-4 and dense_learning_rate(1024) == 3e-4
    assert dense_learning_rate(256) == 1e-3  # narrower than Pythia-70M: its rate
    tiny, small = MemoryFormerConfig.from_preset("tiny"), MemoryFormerConfig.from_preset("small")
    assert default_learning_rate(tiny) == pytest.approx(3e-3)
    assert default_learning_rate(small) == pytest.approx(1.8e-3)
    assert default_learning_rate(GPTNeoXConfig(hidden_size=512, num_attention_heads=8)) == pytest.approx(1e-3)
    assert default_learning_rate(tiny, lr_multiplier=2.0) == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="lr_multiplier"):
        default_learning_rate(tiny, lr_multiplier=0)


def test_no_weight_decay_exactly_on_biases_and_norms(tmp_path):
    model = trainable_model()
    expected = {name for name, _ in model.named_parameters() if name.endswith(".bias")}
    expected |= {f"{m}.{p}" for m, module in model.named_modules() if isinstance(module, torch.nn.LayerNorm)
                 for p, _ in module.named_parameters(recurse=False)}
    assert no_decay_parameter_names(model) == expected
    trainer = build_trainer(model, synthetic_lm_data(), settings(tmp_path, weight_decay=0.1))
    optimizer = trainer.create_optimizer()
    decay_of = {id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}
    for name, parameter in model.named_parameters():
        assert decay_of[id(parameter)] == (0.0 if name in expected else 0.1), name
    tables = [n for n, _ in model.named_parameters() if n.endswith("tables")]
    assert tables and not set(tables) & expected
    assert optimizer.defaults["betas"] == (0.9, 0.95) and optimizer.defaults["eps"] == 1e-8


@pytest.mark.slow
def test_schedule_is_linear_warmup_then_cosine_to_one_percent(tmp_path):
    peak, steps, warmup_ratio = 3e-3, 20, 0.1
    result = train(trainable_model(), synthetic_lm_data(), settings(
        tmp_path, max_steps=steps, warmup_ratio=warmup_ratio, learning_rate=peak, eval_steps=20))
    warmup = math.ceil(steps * warmup_ratio)

    def oracle(step):  # the rate applied in optimizer step `step` (0-based)
        if step < warmup:
            return peak * step / warmup
        progress = (step - warmup) / (steps - warmup)
        return peak * (0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * progress)))

    logged = [(e["step"], e["learning_rate"]) for e in result.log_history if "learning_rate" in e]
    assert [s for s, _ in logged] == list(range(1, steps + 1))
    for step, lr in logged:  # the log after step s shows the rate of the step s - 1 that just ran
        assert lr == pytest.approx(oracle(step - 1), rel=1e-6, abs=1e-12), step
    assert oracle(steps) == pytest.approx(0.01 * peak)


@pytest.mark.slow
def test_training_learns_and_reports_perplexity(tmp_path):
    data = synthetic_lm_data()
    result = train(trainable_model(), data, settings(tmp_path, max_steps=60, eval_steps=30, warmup_ratio=0.05))
    assert result.perplexity == pytest.approx(math.exp(result.eval_loss))
    # the bigram is deterministic: well below the uniform ln(128) = 4.85 nats
    assert result.eval_loss < 0.5 * math.log(128)
    assert result.train_tokens == 60 * 4 * data.block_size
    assert result.train_tokens_per_second > 0
    evals = [e for e in result.log_history if "eval_loss" in e]
    assert [e["step"] for e in evals] == [30, 60]  # the final step's evaluation is not repeated
    assert all(e["eval_perplexity"] == pytest.approx(math.exp(e["eval_loss"])) for e in evals)


@pytest.mark.slow
def test_csv_log_has_one_row_per_logged_step(tmp_path):
    result = train(trainable_model(), synthetic_lm_data(), settings(tmp_path, report_to="csv", logging_steps=2))
    with open(tmp_path / "log.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    train_rows = [r for r in rows if r["loss"]]
    assert [int(r["step"]) for r in train_rows] == [2, 4, 6]
    losses = [e["loss"] for e in result.log_history if "loss" in e]
    assert [float(r["loss"]) for r in train_rows] == pytest.approx(losses)
    assert [int(r["tokens"]) for r in train_rows] == [s * 4 * 16 for s in (2, 4, 6)]
    assert any(r["eval_perplexity"] for r in rows)


@pytest.mark.slow
def test_final_model_and_tokenizer_are_saved_and_reload(tmp_path):
    from transformers import AutoModelForCausalLM

    model = trainable_model()
    train(model, synthetic_lm_data(), settings(tmp_path, max_steps=2, save_final_model=True))
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model.eval()(ids).logits, rtol=0, atol=0)


@pytest.mark.slow
def test_bf16_autocast_trains(tmp_path):
    result = train(trainable_model(), synthetic_lm_data(), settings(tmp_path, bf16=True, max_steps=4))
    losses = [e["loss"] for e in result.log_history if "loss" in e]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
    assert math.isfinite(result.eval_loss)


class StopAt(TrainerCallback):
    """Simulates an interruption: training stops after step `step` (its checkpoint is written first)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path):
    data = synthetic_lm_data()
    common = dict(max_steps=8, save_steps=4, eval_steps=8, warmup_ratio=0.25, report_to="csv")

    whole_model = trainable_model()
    whole = train(whole_model, data, settings(tmp_path / "whole", **common))

    interrupted_model = trainable_model()
    first = train(interrupted_model, data, settings(tmp_path / "resumed", **common), callbacks=[StopAt(4)])
    assert first.steps == 4 and os.path.isdir(tmp_path / "resumed" / "checkpoint-4")
    resumed_model = trainable_model(seed=123)  # fresh weights: everything must come from the checkpoint
    resumed = train(resumed_model, data, settings(tmp_path / "resumed", **common, resume_from_checkpoint=True))

    def curve(result):
        return [(e["step"], e["loss"], e["learning_rate"]) for e in result.log_history if "loss" in e]

    assert resumed.steps == 8
    assert curve(resumed) == curve(whole)  # bit for bit: same batches, same updates
    for (name, a), (_, b) in zip(whole_model.named_parameters(), resumed_model.named_parameters()):
        assert torch.equal(a, b), name
    with open(tmp_path / "resumed" / "log.csv", newline="") as f:
        steps = [int(r["step"]) for r in csv.DictReader(f) if r["loss"]]
    assert steps == list(range(1, 9))  # the resumed log continues the interrupted one without duplicates


def test_resume_from_a_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint"):
        train(trainable_model(), synthetic_lm_data(), settings(tmp_path, resume_from_checkpoint=True))
    with pytest.raises(FileNotFoundError, match="not a folder"):
        train(trainable_model(), synthetic_lm_data(),
              settings(tmp_path, resume_from_checkpoint=str(tmp_path / "checkpoint-9")))


@pytest.mark.parametrize("field,value", [("max_steps", 0), ("per_device_batch_size", 0), ("learning_rate", -1.0),
                                         ("warmup_ratio", 1.0), ("weight_decay", -0.1), ("eval_steps", 0)])
def test_invalid_settings_name_the_field(tmp_path, field, value):
    with pytest.raises(ValueError, match=field):
        settings(tmp_path, **{field: value})


@pytest.mark.slow
def test_resuming_a_finished_run_trains_nothing_and_writes_no_checkpoint(tmp_path, capsys):
    data = synthetic_lm_data()
    finished_model = trainable_model()
    common = dict(max_steps=6, save_steps=3, report_to="csv")  # 6 steps of a 16-step epoch: resumed mid-epoch
    first = train(finished_model, data, settings(tmp_path, **common))
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    log_before = (tmp_path / "log.csv").read_text()
    capsys.readouterr()

    resumed_model = trainable_model(seed=123)  # other weights: the finished run's must come from checkpoint-6
    again = train(resumed_model, data, settings(tmp_path, **common, resume_from_checkpoint=True))
    assert "run already finished at step 6 of 6; nothing to train" in capsys.readouterr().out
    assert again.steps == 6 and again.train_seconds == 0
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    assert (tmp_path / "log.csv").read_text() == log_before
    assert again.eval_loss == first.eval_loss  # the finished run's last evaluation
    for (name, a), (_, b) in zip(finished_model.named_parameters(), resumed_model.named_parameters()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_resuming_past_max_steps_trains_nothing(tmp_path, capsys):
    data = synthetic_lm_data()
    train(trainable_model(), data, settings(tmp_path, max_steps=6, save_steps=6))
    capsys.readouterr()
    result = train(trainable_model(), data, settings(tmp_path, max_steps=4, save_steps=6, resume_from_checkpoint=True))
    assert "run already at step 6, past max_steps 4; nothing to train" in capsys.readouterr().out
    assert result.steps == 6 and sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-6"]


@pytest.mark.slow
@pytest.mark.parametrize("max_steps,eval_points,expected_eval_steps", [
    (6, None, [6]),  # default: 10 evaluations at least 10 steps apart -> a short run evaluates once, at the end
    (10, None, [10]),
    (25, None, [10, 20, 25]),
    (7, 3, [3, 6, 7]),  # ceil(7 / 3) = 3 steps apart, the last at max_steps: never more than eval_points
    (6, 6, [1, 2, 3, 4, 5, 6]),
])
def test_evaluations_are_spread_over_the_run(tmp_path, max_steps, eval_points, expected_eval_steps):
    run = settings(tmp_path, max_steps=max_steps, eval_steps=None, eval_points=eval_points, logging_steps=None)
    result = train(trainable_model(), synthetic_lm_data(train_blocks=128), run)
    assert [e["step"] for e in result.log_history if "eval_loss" in e] == expected_eval_steps
    assert result.evaluations == len(expected_eval_steps)
    runtimes = [e["eval_runtime"] for e in result.log_history if "eval_runtime" in e]
    assert result.eval_seconds == pytest.approx(sum(runtimes)) and result.eval_seconds > 0


@pytest.mark.parametrize("max_steps,eval_every,log_every", [
    (1, 1, 1), (10, 10, 1), (50, 10, 1), (51, 10, 2), (101, 11, 3), (1000, 100, 20), (100_000, 10_000, 2000),
])
def test_default_intervals_scale_with_max_steps(tmp_path, max_steps, eval_every, log_every):
    run = settings(tmp_path, max_steps=max_steps, eval_steps=None, logging_steps=None)
    assert evaluation_interval(run) == eval_every and logging_interval(run) == log_every
    explicit = settings(tmp_path, max_steps=max_steps, eval_steps=7, logging_steps=3)
    assert evaluation_interval(explicit) == 7 and logging_interval(explicit) == 3


@pytest.mark.slow
def test_default_logging_logs_about_50_times_a_run(tmp_path):
    result = train(trainable_model(), synthetic_lm_data(train_blocks=128),
                   settings(tmp_path, max_steps=60, logging_steps=None, eval_steps=60))
    assert [e["step"] for e in result.log_history if "loss" in e] == list(range(2, 61, 2))  # ceil(60 / 50) = 2


def test_eval_steps_and_eval_points_together_are_an_error(tmp_path):
    with pytest.raises(ValueError, match="eval_steps .* and eval_points .* pass one of them"):
        settings(tmp_path, eval_steps=3, eval_points=2)
    with pytest.raises(ValueError, match="eval_points must be >= 1"):
        settings(tmp_path, eval_steps=None, eval_points=0)


def test_training_arguments_carry_every_setting(tmp_path):
    """Each TrainingSettings field reaches the Trainer: the same-named ones as they are, the others translated."""
    import dataclasses

    from transformers import TrainingArguments

    from modeling_memoryformer.training.trainer import SAME_AS_TRAINING_ARGUMENTS, training_arguments

    trainer_fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert set(SAME_AS_TRAINING_ARGUMENTS) <= trainer_fields & {f.name for f in dataclasses.fields(TrainingSettings)}
    settings = TrainingSettings(
        output_dir=str(tmp_path / "run"), max_steps=70, per_device_batch_size=3, gradient_accumulation_steps=2,
        learning_rate=2e-3, weight_decay=0.2, adam_beta1=0.8, adam_beta2=0.9, adam_epsilon=1e-6, max_grad_norm=0.5,
        warmup_ratio=0.2, min_lr_ratio=0.1, eval_steps=7, logging_steps=5, save_steps=35, save_total_limit=3,
        report_to="none", seed=5, progress=False)
    args = training_arguments(settings, model=None)  # the model is only read for the default learning rate
    for name in SAME_AS_TRAINING_ARGUMENTS:
        assert getattr(args, name) == getattr(settings, name), name
    assert (args.per_device_train_batch_size, args.per_device_eval_batch_size, args.learning_rate) == (3, 3, 2e-3)
    assert args.lr_scheduler_kwargs == {"min_lr_rate": 0.1} and args.get_warmup_steps(70) == 14  # 0.2 of the steps
    assert (args.eval_steps, args.logging_steps, args.save_steps, args.save_strategy) == (7, 5, 35, "steps")
    assert args.data_seed == 5 and args.disable_tqdm and args.report_to == []
