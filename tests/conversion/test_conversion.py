"""Pythia (GPT-NeoX) -> MemoryFormer conversion, against independent oracles:

- the mapping: the converted architecture with every Memory Layer swapped for the dense layer it replaces must
  compute the teacher's logits (GPT-NeoX's own forward is the oracle), and the QKV permutation must reproduce
  GPT-NeoX's per-head split;
- the data-free tables: a Monte-Carlo least-squares fit under the same input model;
- the calibrated fit: a direct dense solve of the ridge normal equations in float64;
- bad input: errors before any output exists, and no half-written folder after a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig

import modeling_memoryformer  # noqa: F401  (registers the Auto classes)
from modeling_memoryformer import MemoryFormerForCausalLM
from modeling_memoryformer.cli import parse_settings
from modeling_memoryformer.conversion import convert
from modeling_memoryformer.conversion.distill import BudgetSchedule, TrainingBudget, distillation_loss, train_student
from modeling_memoryformer.conversion.evaluate import layer_errors
from modeling_memoryformer.conversion.initialization import calibrate, data_free_init
from modeling_memoryformer.conversion.mapping import (
    MEMORY_LAYER_NAMES,
    ConversionError,
    copy_dense_weights,
    dense_layers,
    memoryformer_config_from_gpt_neox,
    qkv_permutation,
)
from modeling_memoryformer.conversion.tables import (
    CoordinateMoments,
    data_free_tables,
    fit_tables_ridge,
    gaussian_inputs,
    normal_nodes,
)
from modeling_memoryformer.memory_ops import hash_codes, hash_scores, table_rows


DATA = "/work/shared/data"
TOKENIZER = os.path.join(DATA, "pythia-tokenizer")
TEXT = os.path.join(DATA, "tinyshakespeare.txt")
needs_text = pytest.mark.skipif(
    not (os.path.isfile(os.path.join(TOKENIZER, "tokenizer.json")) and os.path.isfile(TEXT)),
    reason="the Pythia tokenizer and Tiny Shakespeare are not in ../shared/data",
)


def tiny_teacher(seed: int = 0, vocab_size: int = 96, **overrides) -> GPTNeoXForCausalLM:
    """A random GPT-NeoX (d=32, 2 layers, 4 heads, 4d MLP) with non-trivial LayerNorm affine params and a larger
    init, so that a wrong permutation, norm or bias shows in the outputs."""
    torch.manual_seed(seed)
    fields = dict(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, initializer_range=0.2, rotary_pct=0.5, rotary_emb_base=1000.0,
        bos_token_id=0, eos_token_id=0,
    )
    model = GPTNeoXForCausalLM(GPTNeoXConfig(**{**fields, **overrides})).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(0.3 * torch.randn_like(parameter))
            elif name.endswith("bias"):
                parameter.normal_(0.0, 0.1)
    return model


def converted(teacher: GPTNeoXForCausalLM, hash_bits: int = 4) -> MemoryFormerForCausalLM:
    student = MemoryFormerForCausalLM(memoryformer_config_from_gpt_neox(teacher.config, hash_bits)).eval()
    copy_dense_weights(teacher, student)
    return student


def random_ids(count: int, length: int = 32, vocab: int = 96, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (count, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def teacher_folder(tmp_path):
    """A tiny GPT-NeoX saved as safetensors, without a tokenizer (vocabulary large enough for Pythia's)."""
    folder = tmp_path / "teacher"
    tiny_teacher(vocab_size=50304).save_pretrained(folder)
    return folder


@pytest.fixture
def teacher_with_tokenizer(teacher_folder):
    """The tiny GPT-NeoX folder with the Pythia tokenizer copied in."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOKENIZER, name), teacher_folder)
    return teacher_folder


# ---------------------------------------------------------------------------------------------------------------------
# Mapping


def test_qkv_permutation_reproduces_gpt_neox_per_head_split():
    heads, head_dim = 4, 8
    fused = torch.randn(5, 3 * heads * head_dim)  # a GPT-NeoX query_key_value output, [tokens, 3d]
    # GPT-NeoX's own split (modeling_gpt_neox.GPTNeoXAttention.forward): view [heads, 3 head_dim], chunk into q, k, v
    q, k, v = fused.view(5, heads, 3 * head_dim).chunk(3, dim=-1)
    reordered = fused[:, qkv_permutation(heads, head_dim)]
    q2, k2, v2 = (t.view(5, heads, head_dim) for t in reordered.chunk(3, dim=-1))  # MemoryFormer's [Q | K | V]
    assert torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(v, v2)


class _DenseStandIn(nn.Module):
    def __init__(self, dense):
        super().__init__()
        self.dense = dense

    def forward(self, x):
        return self.dense(x)


@pytest.mark.parametrize("parallel", [True, False])
def test_converted_architecture_with_dense_layers_computes_the_teachers_logits(parallel):
    """Swap every Memory Layer for the dense layer it replaces (and the inner norm for the identity): what is left is
    the mapping (embeddings, norms, residual layout, rotary, QKV order, head), which must then match GPT-NeoX."""
    teacher = tiny_teacher(use_parallel_residual=parallel).double()
    student = converted(teacher).double()
    for layer, dense in zip(student.model.layers, dense_layers(teacher)):
        for name in MEMORY_LAYER_NAMES:
            parent, _, child = name.rpartition(".")
            setattr(layer.get_submodule(parent), child, _DenseStandIn(dense[name]))
        layer.memory_block.norm = nn.Identity()
    ids = random_ids(2, 20)
    with torch.no_grad():
        torch.testing.assert_close(student(ids).logits, teacher(ids).logits, rtol=1e-10, atol=1e-10)


def test_copied_weights_are_identical():
    teacher = tiny_teacher()
    student = converted(teacher)
    source, target = teacher.gpt_neox, student.model
    assert torch.equal(target.embed_tokens.weight, source.embed_in.weight)
    assert torch.equal(student.lm_head.weight, teacher.lm_head.weight)
    assert torch.equal(target.norm.weight, source.final_layer_norm.weight)
    assert torch.equal(target.norm.bias, source.final_layer_norm.bias)
    perm = qkv_permutation(4, 8)
    for mine, theirs in zip(target.layers, source.layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            assert torch.equal(getattr(mine, norm).weight, getattr(theirs, norm).weight)
            assert torch.equal(getattr(mine, norm).bias, getattr(theirs, norm).bias)
        assert torch.equal(mine.attention.query_key_value.bias, theirs.attention.query_key_value.bias[perm])
        assert torch.equal(mine.attention.dense.bias, theirs.attention.dense.bias)
        assert torch.equal(mine.memory_block.layer1.bias, theirs.mlp.dense_h_to_4h.bias)
        assert torch.equal(mine.memory_block.layer2.bias, theirs.mlp.dense_4h_to_h.bias)
        assert torch.equal(mine.memory_block.norm.weight, torch.ones(128))
        assert torch.equal(mine.memory_block.norm.bias, torch.zeros(128))


def test_converted_config_takes_the_source_settings():
    teacher = tiny_teacher(use_parallel_residual=False, layer_norm_eps=1e-6)
    config = memoryformer_config_from_gpt_neox(teacher.config, hash_bits=4)
    assert (config.use_parallel_residual, config.layer_norm_eps, config.intermediate_size) == (False, 1e-6, 128)
    assert config.rope_parameters["partial_rotary_factor"] == 0.5 and config.rope_parameters["rope_theta"] == 1000.0
    assert (config.attention_output, config.memory_block_activation, config.expand_bits) == ("memory", "gelu", 0)


# ---------------------------------------------------------------------------------------------------------------------
# Data-free tables


def _design(x: torch.Tensor, hash_bits: int) -> torch.Tensor:
    """The dense design matrix Phi [N, K 2^tau] of a Memory Layer (paper score, t = 1), built naively."""
    rows = table_rows(hash_codes(x, hash_bits), hash_bits)
    phi = torch.zeros(x.shape[0], rows.shape[1] << hash_bits, dtype=x.dtype)
    phi.scatter_(1, rows, hash_scores(x, hash_bits))
    return phi


def test_data_free_tables_equal_a_monte_carlo_least_squares_fit():
    """Oracle: sample the input model (independent Gaussians, non-zero means, unequal scales), fit tables + intercept
    by ordinary least squares on the samples, compare with the closed form."""
    generator = torch.Generator().manual_seed(0)
    mean = torch.tensor([0.3, -0.5, 0.0, 0.8, -0.2, 0.1], dtype=torch.float64)
    std = torch.tensor([1.0, 0.6, 1.5, 0.8, 1.2, 0.9], dtype=torch.float64)
    weight = torch.randn(3, 6, generator=generator, dtype=torch.float64)
    bias = torch.randn(3, generator=generator, dtype=torch.float64)
    x = mean + std * torch.randn(400_000, 6, generator=generator, dtype=torch.float64)
    design = torch.cat([_design(x, 3), torch.ones(x.shape[0], 1, dtype=torch.float64)], dim=1)
    solution = torch.linalg.lstsq(design, x @ weight.T + bias).solution
    moments = CoordinateMoments.of(gaussian_inputs(mean, std, normal_nodes(8192)), temperature=1.0)
    tables, new_bias = data_free_tables(moments, weight, bias, hash_bits=3)
    assert (tables - solution[:-1]).norm() / solution[:-1].norm() < 0.02
    assert (new_bias - solution[-1]).norm() / solution[-1].norm() < 0.02


def test_data_free_tables_of_a_symmetric_input_are_the_scaled_sign_patterns():
    """Zero-mean unit Gaussian input: T_k[c] = alpha W_k s_c with alpha = E[p |z_1|] / E[p^2] (Monte Carlo here)."""
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(5, 8, generator=generator, dtype=torch.float64)
    bias = torch.randn(5, generator=generator, dtype=torch.float64)
    moments = CoordinateMoments.of(gaussian_inputs(torch.zeros(8), torch.ones(8), normal_nodes(8192)), 1.0)
    tables, new_bias = data_free_tables(moments, weight, bias, hash_bits=4)
    z = torch.randn(1_000_000, 4, generator=generator, dtype=torch.float64)
    p = hash_scores(z, 4)[:, 0]
    alpha = (p * z[:, 0].abs()).mean() / p.pow(2).mean()
    signs = torch.tensor([[1.0 if (c >> j) & 1 else -1.0 for j in range(4)] for c in range(16)], dtype=torch.float64)
    expected = torch.cat([alpha * signs @ weight[:, 4 * k : 4 * k + 4].T for k in range(2)])
    torch.testing.assert_close(tables, expected, rtol=5e-3, atol=1e-3)
    torch.testing.assert_close(new_bias, bias, rtol=0, atol=1e-9)


# ---------------------------------------------------------------------------------------------------------------------
# Calibrated fit


def test_ridge_fit_equals_a_direct_dense_solve():
    """Oracle: the full normal equations of min ||Phi T + 1 b - Y||^2 + lambda ||T - T0||^2, solved densely."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(300, 6, generator=generator, dtype=torch.float64)  # K = 3 tables of 2^2 rows
    targets = torch.randn(300, 5, generator=generator, dtype=torch.float64) + x[:, :5]
    prior = torch.randn(12, 5, generator=generator, dtype=torch.float64)
    rows = table_rows(hash_codes(x, 2), 2)
    fit = fit_tables_ridge(rows, hash_scores(x, 2), targets, prior, ridge=0.3, max_sweeps=500, tolerance=1e-13)

    phi = _design(x, 2)
    ridge_lambda = 0.3 * phi.pow(2).sum(0).mean()
    assert fit.ridge_lambda == pytest.approx(ridge_lambda.item(), rel=1e-12)
    ones = torch.ones(300, 1, dtype=torch.float64)
    full = torch.cat([phi, ones], dim=1)
    penalty = torch.diag(torch.cat([torch.full((12,), ridge_lambda.item()), torch.zeros(1)]).double())
    penalty[:12, :12] = ridge_lambda * torch.eye(12, dtype=torch.float64)  # lambda in full float64 precision
    rhs = full.T @ targets + torch.cat([ridge_lambda * prior, torch.zeros(1, 5, dtype=torch.float64)])
    solution = torch.linalg.solve(full.T @ full + penalty, rhs)
    torch.testing.assert_close(fit.tables, solution[:-1], rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(fit.bias, solution[-1], rtol=1e-8, atol=1e-8)


@pytest.mark.slow
def test_calibrated_layers_beat_data_free_on_held_out_tokens():
    """Per Memory Layer, relative error against its dense layer on tokens not used for calibration: data-free < 1
    (better than predicting zero), calibrated < data-free."""
    teacher = tiny_teacher()
    dense = dense_layers(teacher)
    student = converted(teacher)
    data_free_init(student, dense)
    held_out = random_ids(16, seed=1)
    data_free_errors = layer_errors(student, dense, held_out)
    calibrate(student, dense, random_ids(128, seed=2), max_sweeps=5, progress=False)
    calibrated_errors = layer_errors(student, dense, held_out)
    for block_free, block_calibrated in zip(data_free_errors, calibrated_errors):
        for name in MEMORY_LAYER_NAMES:
            assert block_free[name] < 1.0, name
            assert block_calibrated[name] < block_free[name], name


def test_layer_errors_match_a_direct_computation():
    """The hook-based per-layer error of block 0's QKV against a direct computation from the norm's output."""
    teacher = tiny_teacher()
    dense = dense_layers(teacher)
    student = converted(teacher)
    data_free_init(student, dense)
    ids = random_ids(4)
    errors = layer_errors(student, dense, ids, batch_size=3)
    with torch.no_grad():
        x = student.model.layers[0].input_layernorm(student.model.embed_tokens(ids))
        memory = student.model.layers[0].attention.query_key_value(x)
        reference = dense[0]["attention.query_key_value"](x)
    expected = ((memory - reference).norm() / reference.norm()).item()
    assert errors[0]["attention.query_key_value"] == pytest.approx(expected, rel=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# Distillation


def test_distillation_loss_is_the_kl_divergence_from_the_teacher():
    generator = torch.Generator().manual_seed(3)
    student_logits = torch.randn(2, 3, 7, generator=generator, dtype=torch.float64)
    teacher_logits = torch.randn(2, 3, 7, generator=generator, dtype=torch.float64)
    p, q = teacher_logits.softmax(-1), student_logits.softmax(-1)
    expected = (p * (p.log() - q.log())).sum(-1).mean()
    assert distillation_loss(student_logits, teacher_logits).item() == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.slow
def test_distillation_brings_the_student_closer_to_the_teacher():
    teacher = tiny_teacher()
    dense = dense_layers(teacher)
    student = converted(teacher)
    data_free_init(student, dense)
    held_out = random_ids(8, seed=5)

    def kl() -> float:
        with torch.no_grad():
            return distillation_loss(student(held_out).logits, teacher(held_out).logits).item()

    before = kl()
    run = train_student(student, random_ids(64, seed=6), TrainingBudget(steps=30, learning_rate=3e-3), teacher, progress=False)
    assert run["steps"] == 30
    assert kl() < 0.8 * before


def test_budget_schedule_warms_up_then_follows_a_cosine_to_zero():
    schedule = BudgetSchedule(TrainingBudget(steps=100, warmup_fraction=0.1), progress=False)
    assert [schedule.factor(step) for step in (0, 5, 10, 55, 100)] == pytest.approx([0.0, 0.5, 1.0, 0.5, 0.0])


@pytest.mark.slow
def test_the_trainer_applies_the_budget_schedule():
    teacher = tiny_teacher()
    student = converted(teacher)
    rates = []
    original_step = torch.optim.AdamW.step

    def recording_step(optimizer, *args, **kwargs):
        rates.append(optimizer.param_groups[0]["lr"])
        return original_step(optimizer, *args, **kwargs)

    budget = TrainingBudget(steps=8, learning_rate=1e-3, warmup_fraction=0.25)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.optim.AdamW, "step", recording_step)
        train_student(student, random_ids(32, seed=8), budget, teacher, progress=False)
    schedule = BudgetSchedule(budget, progress=False)
    assert rates == pytest.approx([1e-3 * schedule.factor(step) for step in range(8)])


def test_a_cpu_time_budget_ends_training_and_frozen_embeddings_stay_put():
    teacher = tiny_teacher()
    student = converted(teacher)
    embeddings = student.model.embed_tokens.weight.detach().clone()
    tables = student.model.layers[0].attention.query_key_value.tables.detach().clone()
    budget = TrainingBudget(cpu_minutes=0.01, learning_rate=1e-3, train_embeddings=False)
    run = train_student(student, random_ids(64, seed=7), budget, teacher=teacher, progress=False)
    assert run["steps"] >= 1
    assert torch.equal(student.model.embed_tokens.weight, embeddings)
    assert not torch.equal(student.model.layers[0].attention.query_key_value.tables, tables)
    assert student.model.embed_tokens.weight.requires_grad  # unfrozen again afterwards


# ---------------------------------------------------------------------------------------------------------------------
# The command: output folder, loading, report, errors


def _settings(source, out, **overrides) -> convert.ConvertSettings:
    fields = dict(source=str(source), out=str(out), hash_bits=4, progress=False, seq_len=32, calib_tokens=2048,
                  eval_tokens=512, batch_size=8, sweeps=3)
    return convert.ConvertSettings(**{**fields, **overrides})


@pytest.mark.slow
def test_data_free_conversion_writes_a_folder_that_loads_with_auto_and_remote_code(teacher_folder, tmp_path):
    out = tmp_path / "converted"
    convert.convert_pythia(_settings(teacher_folder, out))  # no text, no tokenizer: nothing measured
    assert (out / "model.safetensors").is_file() and (out / "conversion_report.json").is_file()
    assert not (out / "tokenizer.json").exists()
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(model, MemoryFormerForCausalLM)
    teacher = GPTNeoXForCausalLM.from_pretrained(teacher_folder)
    assert torch.equal(model.model.embed_tokens.weight, teacher.gpt_neox.embed_in.weight)
    ids = random_ids(1, 12, vocab=50304)
    torch.save(ids, tmp_path / "ids.pt")
    with torch.no_grad():
        expected = model(ids).logits
    child = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "modeling_memoryformer":
                    raise ImportError(name)
        sys.meta_path.insert(0, Block())
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            torch.save(model(torch.load(sys.argv[2])).logits, sys.argv[3])
        """
    )
    subprocess.run([sys.executable, "-c", child, str(out), str(tmp_path / "ids.pt"), str(tmp_path / "logits.pt")],
                   check=True, cwd=tmp_path, env={**os.environ, "MEMORYFORMER_KERNEL": "torch"})
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@needs_text
def test_calibrated_command_reports_every_stage(teacher_with_tokenizer, tmp_path):
    out = tmp_path / "converted"
    settings = parse_settings(
        ["convert", "--from", str(teacher_with_tokenizer), "--out", str(out), "--calib-text", TEXT, "--hash-bits", "4", "--seq-len", "32",
         "--calib-tokens", "2048", "--eval-tokens", "512", "--sweeps", "3", "--distill-steps", "2", "--no-progress"]
    )
    assert convert.run_convert(*settings) == 0
    report = json.loads((out / "conversion_report.json").read_text())
    assert list(report["stages"]) == ["teacher", "random_init", "random_tables", "data_free", "calibrated", "distilled"]
    assert report["run"]["memory_layer_kernel"] in ("fused", "torch") and report["run"]["cpu_model"]
    assert "Memory Layer kernel: " in (out / "conversion_report.md").read_text()
    assert all(stage["perplexity"] > 1 for stage in report["stages"].values())
    calibrated, data_free = report["stages"]["calibrated"], report["stages"]["data_free"]
    for block_c, block_d in zip(calibrated["layer_errors"], data_free["layer_errors"]):
        assert all(block_c[name] < block_d[name] < 1 for name in MEMORY_LAYER_NAMES)
    assert (out / "conversion_report.md").is_file() and (out / "layer_errors.png").is_file()
    assert (out / "tokenizer.json").is_file()


def _assert_nothing_written(tmp_path, out) -> None:
    assert not out.exists()
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".incomplete")]


def test_another_model_type_is_rejected_before_any_output(tmp_path):
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4).save_pretrained(
        tmp_path / "llama"
    )
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match="'llama' model; only GPT-NeoX"):
        convert.convert_pythia(_settings(tmp_path / "llama", out))
    _assert_nothing_written(tmp_path, out)


def test_shapes_not_divisible_by_hash_bits_are_rejected_before_any_output(tmp_path):
    tiny_teacher(hidden_size=36, num_attention_heads=4, intermediate_size=144).save_pretrained(tmp_path / "src")
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match="hidden_size=36 is not divisible by hash_bits=8"):
        convert.convert_pythia(_settings(tmp_path / "src", out, hash_bits=8))
    _assert_nothing_written(tmp_path, out)


def test_unsupported_activation_and_rope_scaling_are_rejected():
    with pytest.raises(ConversionError, match="hidden_act='relu'"):
        memoryformer_config_from_gpt_neox(tiny_teacher(hidden_act="relu").config, 4)
    config = tiny_teacher().config
    config.rope_parameters = {**config.rope_parameters, "rope_type": "linear", "factor": 2.0}
    with pytest.raises(ConversionError, match="rope_type.*'linear' is not supported"):
        memoryformer_config_from_gpt_neox(config, 4)


def test_missing_source_folder_and_existing_output_are_rejected(teacher_folder, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match="does not exist"):
        convert.convert_pythia(_settings(tmp_path / "nowhere", out))
    _assert_nothing_written(tmp_path, out)
    out.mkdir()
    with pytest.raises(ConversionError, match="already exists.*--overwrite"):
        convert.convert_pythia(_settings(teacher_folder, out))
    with pytest.raises(ConversionError, match="--init calibrated needs calibration text"):
        convert.convert_pythia(_settings(teacher_folder, tmp_path / "other", init="calibrated"))


def test_text_without_a_tokenizer_is_rejected_before_any_output(teacher_folder, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question. " * 50)
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match="has no tokenizer files.*--tokenizer"):
        convert.convert_pythia(_settings(teacher_folder, out, calib_text=str(text)))
    _assert_nothing_written(tmp_path, out)


def test_a_failure_while_writing_leaves_no_folder(teacher_folder, tmp_path, monkeypatch):
    def broken(report, folder):
        raise RuntimeError("disk full")

    monkeypatch.setattr(convert, "write_report", broken)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="disk full"):
        convert.convert_pythia(_settings(teacher_folder, out))
    _assert_nothing_written(tmp_path, out)


@pytest.mark.slow
def test_command_exits_with_a_clear_error(tmp_path):
    command = [sys.executable, "-m", "modeling_memoryformer.cli", "convert"]  # `memoryformer convert`, via -m
    result = subprocess.run([*command, "--from", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")],
                            check=False, capture_output=True, text=True)
    assert result.returncode == 2
    assert "does not exist" in result.stderr


@pytest.mark.slow
def test_conversion_stored_as_int8_saves_the_quantized_model_it_converted(teacher_folder, tmp_path):
    """`convert --table-dtype int8 --lm-head-dtype bf16`: the saved folder is the float conversion quantised (the
    oracle: the float conversion, quantised here by the model's own method, gives the same logits)."""
    from modeling_memoryformer.evaluation.settings import StorageSettings

    convert.convert_pythia(_settings(teacher_folder, tmp_path / "float"))
    convert.convert_pythia(_settings(teacher_folder, tmp_path / "int8"), StorageSettings("int8", "bf16"))
    stored = AutoModelForCausalLM.from_pretrained(tmp_path / "int8").eval()
    assert (stored.config.table_dtype, stored.config.lm_head_dtype) == ("int8", "bfloat16")
    oracle = AutoModelForCausalLM.from_pretrained(tmp_path / "float").eval()
    oracle.quantize_tables("int8", lm_head="bf16")
    ids = random_ids(2, 12, vocab=50304)
    with torch.no_grad():
        torch.testing.assert_close(stored(ids).logits, oracle(ids).logits, rtol=0, atol=0)
    report = json.loads((tmp_path / "int8" / "conversion_report.json").read_text())
    assert report["storage"] == {"table_dtype": "int8", "lm_head_dtype": "bf16"}


def test_a_storage_the_model_cannot_take_is_refused_before_any_work(tmp_path, capsys):
    from modeling_memoryformer import cli

    source = tmp_path / "odd"  # width 34: int8 rows need a multiple of 4 values; only the config is read
    GPTNeoXConfig(vocab_size=96, hidden_size=34, num_hidden_layers=1, num_attention_heads=2, intermediate_size=136,
                  max_position_embeddings=64).save_pretrained(source)
    code = cli.main(["convert", "--from", str(source), "--out", str(tmp_path / "out"), "--hash-bits", "2",
                     "--table-dtype", "int8"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --table-dtype") and "multiple of 4" in err, err
    assert not (tmp_path / "out").exists()
