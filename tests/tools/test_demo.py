"""The main job, `memoryformer demo`, at a tiny scale (a slice of the embedded documentation as data): both models
trained on the same tokens, the report folder complete, its figures consistent with independent computations, and the
load of each phase of the run recorded: the module's run trains both models while a process of the test's own keeps a
core busy, and its report must say so."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time

import pytest

from modeling_memoryformer.comparison import demo as demo_module
from modeling_memoryformer.comparison.demo import DemoSettings, format_report, loss_at, remaining_estimate, run_demo
from modeling_memoryformer.training.data import embedded_default_text

TINY_DEMO = dict(vocab_size=320, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, hash_bits=4,
                 expand_bits=1, block_size=32, batch_size=4, max_steps=4, eval_points=2, decode_tokens=4,
                 prompt_tokens=4)

# Slow tier (`make test` only, not `make test-fast`): the module's demo run, which nearly every test reads, takes
# tens of seconds.
pytestmark = pytest.mark.slow


# Another job: one core spun for at most 10 minutes, saying when it has started.
SPIN = ("import sys, time\nprint('spinning', flush=True)\nend = time.perf_counter() + 600\n"
        "while time.perf_counter() < end:\n    pass\n")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The tiny demo, with another process spinning a core while each model trains (from before its first step to
    after its last evaluation), and not otherwise."""
    root = tmp_path_factory.mktemp("demo")
    eval_text = root / "ood.txt"
    eval_text.write_text("An out-of-domain text about rivers, mountains and the sea. " * 40)
    data = root / "data.txt"
    data.write_text(embedded_default_text()[:40_000])
    out = root / "report"
    spinners, train_one = [], demo_module._train_one

    def train_beside_another_job(output_dir, model, *args, **kwargs):
        spinner = subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.PIPE, text=True)
        spinners.append(spinner)
        assert spinner.stdout.readline().strip() == "spinning"
        # The tiny model's 4 steps take about 60 ms, a few of /proc/stat's 10 ms ticks: the load measured over them
        # came out anywhere from 0.37 to 1 core. Each training forward also sleeps 0.1 s, in which the spinner has a
        # core to itself, so the steps' load is measured over about a second (1.0 cores seen) instead of a few ticks.
        hook = model.register_forward_pre_hook(lambda module, inputs: time.sleep(0.1) if module.training else None)
        try:
            return train_one(output_dir, model, *args, **kwargs)
        finally:
            hook.remove()
            # Killed but not waited for until the run is over: a child's CPU counts as this process's own once it
            # is reaped, which would hide the load of the interval it was reaped in.
            os.kill(spinner.pid, signal.SIGKILL)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(demo_module, "_train_one", train_beside_another_job)
        try:
            summary = run_demo(DemoSettings(out=str(out), data=str(data), eval_text=str(eval_text), speed_rounds=3,
                                            **TINY_DEMO))
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()
                spinner.stdout.close()
    assert len(spinners) == 2
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


def test_a_run_whose_training_overlapped_another_job_says_so(demo):
    """The spinner of the fixture kept a core busy during both models' training: the summary records that phase
    (and each model's steps) as busy, and the report says so, names what it spoils and marks those rows."""
    out, summary = demo
    load = json.loads((out / "summary.json").read_text())["load"]
    assert load == summary["load"]
    assert set(load["phases"]) == {"setup", "training", "evaluation", "speed", "rest"}
    training = load["phases"]["training"]
    # one spinning core of 2 (our two torch threads share the rest): about 0.6-1 core of others, whatever else runs
    assert training["busy"] and training["other_cores"] >= 0.5, training
    for name, steps in load["training_by_model"].items():
        assert steps["busy"] and steps["other_cores"] >= 0.5, (name, steps)
    assert "training" in load["busy_phases"]
    for phase, figures in load["phases"].items():
        assert figures["busy"] == (figures["other_cores"] > load["threshold"]) or (phase == "speed" and
                                                                                 summary["speed"]["busy"]), phase
    # the training phase is the steps the Trainer timed: the same intervals, read by two callbacks
    assert training["seconds"] == pytest.approx(summary["time"]["training_seconds"], abs=0.5)
    assert sum(p["seconds"] for p in load["phases"].values()) <= summary["time"]["total_seconds"] + 0.5
    report = (out / "report.md").read_text()
    assert f"BUSY during training: other processes used {training['other_cores']:.2f} cores on average" in report
    assert "training throughput (the 'during the run' rows) and training times are not the machine's" in report
    assert "| training tokens/s during the run (one after the other) (BUSY: see Load) |" in report
    assert "| training time (steps only) (BUSY: see Load) |" in report
    assert "quiet throughout" not in report


def _with_loads(summary: dict, **busy_cores: float) -> dict:
    """`summary` with every phase quiet (0.02 cores) but the ones given (cores of other processes)."""
    threshold = summary["load"]["threshold"]

    def figures(cores):
        return {"seconds": 30.0, "other_cores": cores, "max_other_cores": cores + 0.1, "busy": cores > threshold,
                "threshold": threshold}

    phases = {phase: figures(busy_cores.get(phase, 0.02)) for phase in summary["load"]["phases"]}
    load = dict(summary["load"], phases=phases, whole_run=figures(max(busy_cores.values(), default=0.02)),
                training_by_model={name: figures(busy_cores.get("training", 0.02)) for name in summary["models"]},
                busy_phases=[phase for phase, f in phases.items() if f["busy"]],
                calibration=figures(busy_cores.get("setup", 0.02)))
    speed = dict(summary["speed"], busy=False, other_cores=phases["speed"]["other_cores"], max_other_cores=0.05)
    return dict(summary, load=load, speed=speed)


def test_the_report_of_a_quiet_run_says_quiet_throughout_and_flags_nothing(demo):
    _, summary = demo
    report = format_report(_with_loads(summary))
    assert "quiet throughout: other processes used 0.02 cores on average" in report
    assert "BUSY" not in report
    assert "quiet during these timings" in report  # the speed rows' own verdict, for their timed calls only


def test_a_run_busy_only_during_its_speed_rows_is_flagged_there_and_not_in_training(demo):
    _, summary = demo
    report = format_report(_with_loads(summary, speed=1.4))
    assert "BUSY during the speed rows: other processes used 1.40 cores on average" in report
    assert "the speed rows and the equal-time view are not the machine's" in report
    assert "BUSY during training" not in report and "quiet throughout" not in report
    assert "Quiet during the setup (kernel, data, calibration) (0.02), training (0.02)" in report
    assert "| decode tokens/s (speed measurement) (BUSY: see Load) |" in report
    assert "| training time (steps only) |" in report  # not marked: training was quiet
    assert "benchmarks.demo_bench --demo-folder" in report


def test_without_proc_stat_the_load_is_unknown_not_quiet(demo):
    _, summary = demo
    unknown = {"seconds": 30.0, "other_cores": None, "max_other_cores": None, "busy": None, "threshold": 0.25}
    load = dict(summary["load"], whole_run=unknown, phases=dict.fromkeys(summary["load"]["phases"], unknown),
                busy_phases=[])
    report = format_report(dict(summary, load=load))
    assert "unknown here (no /proc/stat)" in report and "quiet throughout" not in report


def test_a_summary_without_loads_still_formats(demo):
    """Report folders written before the loads were recorded (e.g. the committed demo runs) still format."""
    _, summary = demo
    old = {key: value for key, value in summary.items() if key != "load"}
    old["time"] = {key: summary["time"][key] for key in ("total_seconds", "training_seconds", "evaluation_seconds",
                                                         "speed_seconds", "other_seconds", "estimated_seconds")}
    report = format_report(old)
    assert "Load of the machine" not in report and "estimated at the start" in report


def test_the_time_estimate_is_made_after_the_kernel_and_the_data_and_says_its_load(demo):
    out, summary = demo
    spent, calibration = summary["time"], summary["load"]["calibration"]
    assert spent["estimate_made_at_seconds"] >= spent["kernel_seconds"] + spent["data_seconds"]
    assert spent["estimated_seconds"] == pytest.approx(spent["estimate_made_at_seconds"] + sum(spent["estimate"].values()))
    assert set(spent["estimate"]) == {"training", "evaluation", "speed measurement", "other"}
    assert spent["reestimate"] is None  # a 4-step training is too short to time a pace: see the test below
    report = (out / "report.md").read_text()
    assert (f"{spent['estimate_made_at_seconds']:.0f} s in, after the kernel and the data, for the load during the "
            f"calibration: other processes {calibration['other_cores']:.2f} cores") in report


def test_the_estimate_is_re_taken_at_the_first_models_pace():
    """Numbers by hand: the MemoryFormer was estimated at 100 + 20 s and took 180 s (1.5x); what is left is the
    twin's four parts, both models' speed measurement and rest, at 1.5x, and the fixed 10 s of saving."""
    estimates = {"MemoryFormer": {"training": 100.0, "evaluation": 20.0, "speed measurement": 5.0, "other": 3.0},
                 "Pythia twin": {"training": 80.0, "evaluation": 30.0, "speed measurement": 4.0, "other": 2.0}}
    again = remaining_estimate(estimates, "MemoryFormer", 180.0)
    assert again == {"after": "MemoryFormer", "pace": 1.5, "remaining_seconds": pytest.approx(1.5 * 124 + 10)}
    assert remaining_estimate(estimates, "Pythia twin", 180.0) is None  # nothing left to train
    assert remaining_estimate(estimates, "MemoryFormer", 5.0) is None  # too short to time a pace
