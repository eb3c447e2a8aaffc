"""The main job, `memoryformer demo`, at a tiny scale on the embedded default: both models trained on the same
tokens, the report folder complete, its figures consistent with independent computations."""

from __future__ import annotations

import json
import math

import pytest

from modeling_memoryformer.comparison.demo import DemoSettings, run_demo

TINY_DEMO = dict(vocab_size=320, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, hash_bits=4,
                 expand_bits=1, block_size=32, batch_size=4, max_steps=4, eval_points=2, decode_tokens=4,
                 prompt_tokens=4)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    eval_text = root / "ood.txt"
    eval_text.write_text("An out-of-domain text about rivers, mountains and the sea. " * 40)
    out = root / "report"
    summary = run_demo(DemoSettings(out=str(out), eval_text=str(eval_text), **TINY_DEMO))
    return out, summary


def test_report_folder_is_complete_and_nothing_is_left_half_written(demo):
    out, _ = demo
    for name in ("summary.json", "report.md", "loss_curves.png", "buckets.png", "bucket_stats.json", "samples.md"):
        assert (out / name).is_file(), name
    for name in ("loss_curves.png", "buckets.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for model in ("memoryformer", "pythia-twin"):
        assert (out / model / "model.safetensors").is_file() and (out / model / "log.csv").is_file()
        assert (out / model / "tokenizer.json").is_file()  # the trained BPE travels with the model
    assert not [p.name for p in out.parent.iterdir() if "incomplete" in p.name]  # the staging folder is gone


def test_both_models_see_the_same_tokens_at_their_own_rates(demo):
    _, summary = demo
    mf, twin = summary["models"]["MemoryFormer"], summary["models"]["Pythia twin"]
    assert summary["train_tokens"] == 4 * 4 * 32
    assert mf["learning_rate"] == pytest.approx(3 * twin["learning_rate"])  # the paper's 3x rule
    for model in (mf, twin):
        assert math.isfinite(model["validation_perplexity"])
        assert model["validation_perplexity"] == pytest.approx(math.exp(model["validation_loss"]))
        assert model["decode_tokens_per_second"] > 0 and model["train_tokens_per_second"] > 0
        assert math.isfinite(model["eval_text_perplexity"]) and model["sample"]
    curves = summary["curves"]
    assert [t for t, _ in curves["MemoryFormer"]["train"]] == [t for t, _ in curves["Pythia twin"]["train"]]


def test_flops_are_the_paper_formulas(demo):
    _, summary = demo
    s, d = 32, 32
    k = d // 4  # tau = 4
    mf, twin = summary["models"]["MemoryFormer"], summary["models"]["Pythia twin"]
    assert twin["flops_per_block_without_attention"] == 12 * s * d * d
    assert mf["flops_per_block_without_attention"] == 6 * k * s * d
    assert mf["flops_per_block_total"] == 6 * k * s * d + 2 * s * s * d == twin["flops_per_block_total"] - 12 * s * d * d + 6 * k * s * d


def test_report_states_the_figures_of_the_summary(demo):
    out, summary = demo
    report = (out / "report.md").read_text()
    mf = summary["models"]["MemoryFormer"]
    assert f"{mf['validation_perplexity']:.2f}" in report
    assert "Out-of-domain" in report and "Bucket uniformity" in report
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["models"]["Pythia twin"]["validation_loss"] == summary["models"]["Pythia twin"]["validation_loss"]
    entropy = summary["bucket_entropy"]
    assert 0 < entropy["min"] <= entropy["mean"] <= 1


def test_existing_report_is_not_clobbered_and_failures_leave_nothing(tmp_path, demo):
    out, _ = demo
    with pytest.raises(FileExistsError, match="--overwrite"):
        run_demo(DemoSettings(out=str(out), **TINY_DEMO))
    fresh = tmp_path / "new"
    with pytest.raises(FileNotFoundError, match="eval-text"):
        run_demo(DemoSettings(out=str(fresh), eval_text=str(tmp_path / "missing.txt"), **TINY_DEMO))
    assert not fresh.exists() and not [p.name for p in tmp_path.iterdir() if "incomplete" in p.name]


def test_summary_and_report_state_the_kernel_cpu_and_versions(demo):
    out, summary = demo
    run = json.loads((out / "summary.json").read_text())["run"]
    assert run == summary["run"]
    assert run["memory_layer_kernel"] in ("fused", "torch") and run["cpu_model"] and run["torch"]
    assert run["kernel_build_load_seconds"] >= 0
    assert "Memory Layer kernel: " in (out / "report.md").read_text().splitlines()[2]


def test_summary_and_report_split_the_time_between_training_and_evaluation(demo):
    out, summary = demo
    models = summary["models"].values()
    spent = summary["time"]
    assert spent["training_seconds"] == pytest.approx(sum(m["train_seconds"] for m in models))
    assert spent["evaluation_seconds"] == pytest.approx(sum(m["eval_seconds"] for m in models))
    assert spent["training_seconds"] > 0 and spent["evaluation_seconds"] > 0 and spent["other_seconds"] >= 0
    assert spent["total_seconds"] == pytest.approx(
        spent["training_seconds"] + spent["evaluation_seconds"] + spent["other_seconds"])
    for name, model in summary["models"].items():  # eval_points=2 over 4 steps: at steps 2 and 4
        assert model["evaluations"] == 2 == len(summary["curves"][name]["eval"]), name
    report = (out / "report.md").read_text()
    assert (f"training {spent['training_seconds']:.1f} s, evaluation {spent['evaluation_seconds']:.1f} s"
            in report)
    assert f"{summary['models']['MemoryFormer']['eval_seconds']:.1f} s (2 evaluations)" in report
