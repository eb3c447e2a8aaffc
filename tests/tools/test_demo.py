"""The main job, `memoryformer demo`, at a tiny scale (a slice of the embedded documentation as data): both models
trained on the same tokens, the report folder complete, its figures consistent with independent computations."""

from __future__ import annotations

import csv
import json
import math
import statistics

import pytest

from modeling_memoryformer.comparison.demo import DemoSettings, format_report, loss_at, run_demo
from modeling_memoryformer.training.data import embedded_default_text

TINY_DEMO = dict(vocab_size=320, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, hash_bits=4,
                 expand_bits=1, block_size=32, batch_size=4, max_steps=4, eval_points=2, decode_tokens=4,
                 prompt_tokens=4)

# Slow tier (`make test` only, not `make test-fast`): the module's demo run, which nearly every test reads, takes
# tens of seconds.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    eval_text = root / "ood.txt"
    eval_text.write_text("An out-of-domain text about rivers, mountains and the sea. " * 40)
    data = root / "data.txt"
    data.write_text(embedded_default_text()[:40_000])
    out = root / "report"
    summary = run_demo(DemoSettings(out=str(out), data=str(data), eval_text=str(eval_text), speed_rounds=3, **TINY_DEMO))
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
        spent["training_seconds"] + spent["evaluation_seconds"] + spent["speed_seconds"] + spent["other_seconds"])
    assert spent["estimated_seconds"] > 0
    for name, model in summary["models"].items():  # eval_points=2 over 4 steps: at steps 2 and 4
        assert model["evaluations"] == 2 == len(summary["curves"][name]["eval"]), name
    report = (out / "report.md").read_text()
    assert (f"training {spent['training_seconds']:.0f} s, evaluation {spent['evaluation_seconds']:.0f} s"
            in report)
    assert f"{summary['models']['MemoryFormer']['eval_seconds']:.1f} s (2 evaluations)" in report


def test_epochs_are_the_budget_over_the_training_tokens_and_the_report_says_each_is_seen_once(demo):
    out, summary = demo
    assert summary["train_tokens_available"] > summary["train_tokens"]
    assert summary["epochs"] == pytest.approx(summary["train_tokens"] / summary["train_tokens_available"])
    assert "every training token seen at most once" in (out / "report.md").read_text()
    repeated = dict(summary, epochs=3.7)
    assert "THE DATA REPEATS" in format_report(repeated) and "at most once" not in format_report(repeated)


def test_final_training_loss_and_gap_come_from_the_logged_losses(demo):
    out, summary = demo
    for name, folder in (("MemoryFormer", "memoryformer"), ("Pythia twin", "pythia-twin")):
        with open(out / folder / "log.csv", newline="") as f:
            rows = [row for row in csv.DictReader(f) if row["loss"]]
        last = int(rows[-1]["step"])
        tail = [float(row["loss"]) for row in rows if int(row["step"]) > 0.9 * last]  # 4 steps: the last one
        model = summary["models"][name]
        assert model["final_training_loss"] == pytest.approx(sum(tail) / len(tail))
        assert model["generalisation_gap"] == pytest.approx(model["validation_loss"] - model["final_training_loss"])


def test_speed_rows_are_medians_of_alternated_rounds_with_the_load_recorded(demo):
    _, summary = demo
    speed = summary["speed"]
    assert speed["rounds"] == 3 and speed["train_batch"] == [4, 32]
    for name, model in summary["models"].items():
        for workload, key in (("train", "train_tokens_per_second"), ("decode", "decode_tokens_per_second")):
            timings = speed["models"][name][workload]
            assert len(timings["seconds"]) == 3
            assert timings["tokens"] == (4 * 32 if workload == "train" else 4)
            assert model[key] == pytest.approx(timings["tokens"] / statistics.median(timings["seconds"]))
    stream = speed["memory_stream_gbps"]
    assert 0 < stream["min"] <= stream["median"] <= stream["max"]
    loads = [w["other_cores"] for m in speed["models"].values() for w in m.values()]
    assert speed["busy"] == (max(loads) > speed["threshold"])
    report = format_report(dict(summary, speed=dict(speed, busy=True, other_cores=0.9, max_other_cores=1.2)))
    assert "BUSY" in report and "not trustworthy" in report


def test_equal_time_view_reads_the_slower_model_at_the_faster_ones_time(demo):
    _, summary = demo
    speeds = {name: m["train_tokens_per_second"] for name, m in summary["models"].items()}
    fast, slow = sorted(speeds, key=speeds.get, reverse=True)
    view = summary["equal_time"]
    assert (view["faster"], view["slower"]) == (fast, slow)
    assert view["seconds"] == pytest.approx(summary["train_tokens"] / speeds[fast])
    assert view["slower_tokens"] == pytest.approx(summary["train_tokens"] * speeds[slow] / speeds[fast])
    curve = summary["curves"][slow]["eval"]
    (t0, l0), (t1, l1) = curve  # eval_points=2: steps 2 and 4
    tokens = view["slower_tokens"]
    if tokens < t0:
        assert view["slower_loss"] is None
    else:
        w = math.log(tokens / t0) / math.log(t1 / t0)
        assert view["slower_loss"] == pytest.approx(l0 + w * (l1 - l0))


def test_loss_at_interpolates_in_log_tokens():
    curve = [(100, 2.0), (1000, 1.0), (10000, 0.5)]
    assert loss_at(curve, math.sqrt(100 * 1000)) == pytest.approx(1.5)
    assert loss_at(curve, 1000) == pytest.approx(1.0) and loss_at(curve, 10000) == pytest.approx(0.5)
    assert loss_at(curve, 99) is None and loss_at(curve, 10001) is None
