"""The GPU entry point (benchmarks/gpu.py), run on CPU at toy sizes: every section produces its rows, the results
folder is written, and without a GPU the CUDA run refuses with a message naming the CPU form."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu

pytestmark = pytest.mark.slow


def test_the_smoke_run_writes_every_section(tmp_path):
    assert gpu.main(["--device", "cpu", "--smoke", "--skip-tests", "--repeats", "2", "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert {row["mode"] for row in result["layer"]} == {"forward", "forward+backward"}
    assert all(row["ratio"] > 0 for row in result["layer"])
    assert {row["model"] for row in result["model"]} == {"memoryformer", "twin"}
    assert all(row["training_step_ms"] > 0 and row["prefill_ms"] > 0 for row in result["model"])
    assert result["targets"] == gpu.TARGETS and result["facts"]["device"] == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_the_cuda_run_refuses(capsys, tmp_path):
    assert gpu.main(["--out-dir", str(tmp_path)]) == 2
    assert "--device cpu --smoke" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()
