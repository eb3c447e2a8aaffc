"""Every report states the kernel that ran, the CPU and its vector features and the versions, and no timing includes
the one-time kernel build/load (`kernel_report.run_facts`, `load_kernel_timed`)."""

from __future__ import annotations

import re
import time

import pytest
import torch
import transformers

from modeling_memoryformer import __version__, cli, memory_backend_cpu, memory_kernels, memory_ops
from modeling_memoryformer.evaluation import kernel_report
from modeling_memoryformer.comparison import demo


def test_run_facts_fields_and_types():
    facts = kernel_report.run_facts()
    assert facts["memory_layer_kernel"] in ("fused", "torch")
    assert facts["memory_layer_kernel"] == memory_ops.get_kernel()
    assert isinstance(facts["cpu_model"], str) and facts["cpu_model"]
    assert isinstance(facts["cpu_features"], list) and all(isinstance(f, str) for f in facts["cpu_features"])
    assert isinstance(facts["threads"], int) and facts["threads"] >= 1
    assert set(facts["caches"]) == {"l1d_bytes", "l2_bytes", "l3_bytes", "source"}
    assert facts["torch"] == torch.__version__ and facts["transformers"] == transformers.__version__
    assert facts["memoryformer"] == __version__ and facts["python"]
    assert isinstance(facts["kernel_build_load_seconds"], float) and facts["kernel_build_load_seconds"] >= 0
    if facts["fused_kernel_loaded"]:
        assert isinstance(facts["fused_kernel_isa"], str) and facts["fused_kernel_isa"]
        assert facts["fused_kernel_march"]
    else:
        assert facts["fused_kernel_isa"] is None and facts["fused_kernel_march"] is None
    line = kernel_report.run_facts_line(facts)
    assert "\n" not in line and line.startswith(f"Memory Layer kernel: {facts['memory_layer_kernel']}")
    assert facts["cpu_model"] in line and f"torch {torch.__version__}" in line and "not in the timings" in line
    if facts["memory_layer_kernel"] == "fused":
        assert f"-march={facts['fused_kernel_march']}" in line and facts["fused_kernel_isa"] in line


def test_line_names_the_fallback_and_its_reason():
    facts = {**kernel_report.run_facts(), "memory_layer_kernel": "torch", "kernel_setting": "auto",
             "fused_kernel_loaded": False, "fused_kernel_isa": None, "fused_kernel_march": None,
             "fused_kernel_unavailable_reason": "no compiler\nfound"}
    assert "torch (the fused kernel is not available: no compiler found)" in kernel_report.run_facts_line(facts)


@pytest.fixture
def slow_first_load(monkeypatch):
    """load_fused_kernels takes 0.5 s more on its first call, as a first build would; the load is timed afresh."""
    original, calls = memory_backend_cpu.load_fused_kernels, []

    def slow(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.5)
        return original(*args, **kwargs)

    monkeypatch.setattr(memory_backend_cpu, "load_fused_kernels", slow)
    monkeypatch.setattr(kernel_report, "_load_seconds", None)
    monkeypatch.setattr(kernel_report, "_load_error", None)
    monkeypatch.setattr(memory_kernels, "_kernel_choice", "auto")
    return calls


@pytest.mark.slow
def test_generate_prints_the_line_first_and_times_the_forward_without_the_load(slow_first_load, capsys):
    assert cli.main(["generate", "--preset", "tiny", "--layers", "1", "--new-tokens", "2", "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("Memory Layer kernel: ") and "not in the timings" in first
    load_s = float(re.search(r"kernel build/load ([0-9.]+) s", first).group(1))
    assert load_s >= 0.5
    forward_ms = float(re.search(r"forward of \d+ tokens: .* in (\d+) ms", out).group(1))
    assert forward_ms < 400, out  # the 0.5 s first load happened before, outside the timing


def test_demo_summary_and_report_state_the_run_facts(monkeypatch):
    facts = kernel_report.run_facts()
    model = {"parameters": 1e6, "learning_rate": 1e-3, "validation_perplexity": 2.0, "validation_loss": 0.69,
             "final_training_loss": 0.6, "generalisation_gap": 0.09, "flops_per_block_without_attention": 1e6,
             "flops_per_block_total": 2e6, "train_tokens_per_second": 10.0, "train_loop_tokens_per_second": 9.0,
             "decode_tokens_per_second": 5.0, "train_seconds": 1.0, "eval_seconds": 1.0, "evaluations": 1,
             "sample": "s"}
    summary = {
        "settings": {"max_steps": 1, "batch_size": 1, "block_size": 8, "seed": 0}, "data": "d", "train_tokens": 8,
        "train_tokens_available": 80, "epochs": 0.1, "validation_tokens": 8, "eval_text": None, "prompt": "p",
        "bucket_entropy": {"min": 1, "mean": 1, "tables": 1},
        "models": {name: dict(model) for name in ("MemoryFormer", "Pythia twin")},
        "speed": {"other_cores": 0.0, "max_other_cores": 0.0, "busy": False, "threshold": 0.25, "rounds": 1,
                  "train_batch": [1, 8], "decode": {"prompt_tokens": 1, "new_tokens": 1}},
        "equal_time": {"seconds": 0.8, "faster": "MemoryFormer", "slower": "Pythia twin", "slower_tokens": 7.2,
                       "faster_loss": 0.69, "slower_loss": None},
        "time": {"total_seconds": 3.0, "training_seconds": 2.0, "evaluation_seconds": 0.5, "speed_seconds": 0.2,
                 "other_seconds": 0.3, "estimated_seconds": 3.0},
        "run": facts,
    }
    report = demo.format_report(summary)
    assert report.splitlines()[2] == kernel_report.run_facts_line(facts)  # right under the title
