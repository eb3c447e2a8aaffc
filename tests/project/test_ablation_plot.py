"""experiments/ablation.py's figure: its title fits in the figure however few groups ran."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ablation():
    spec = importlib.util.spec_from_file_location("ablation", ROOT / "experiments" / "ablation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("groups", [["tau"], ["tau", "lr"], ["tau", "lr", "expand", "gelu", "score"]])
def test_the_title_is_inside_the_figure(ablation, groups, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure plot() saved to measure it
    rows = [dict(group=group, label=label, validation_perplexity=20.0 + i)
            for group in groups for i, label in enumerate((f"{group} a", f"{group} b (base)"))]
    ablation.plot(rows, str(tmp_path / "ablation.png"))
    (figure,) = figures
    figure.canvas.draw()  # at the figure's own dpi, like figure.bbox
    title = figure._suptitle.get_window_extent()
    assert 0 <= title.x0 and title.x1 <= figure.bbox.x1, (title, figure.bbox)
    assert (tmp_path / "ablation.png").read_bytes()[:4] == b"\x89PNG"
    figure.clf()
