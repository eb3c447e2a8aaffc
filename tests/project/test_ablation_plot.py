"""experiments/ablation.py: its figure's title fits however few groups ran; its summary pairs runs by seed."""

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


@pytest.mark.parametrize("groups", [["init"], ["init", "lr"], ["twin", "init", "decay", "norm", "score", "lr"]])
def test_the_title_is_inside_the_figure(ablation, groups, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure plot() saved to measure it
    rows = [dict(group=group, label=f"{group} {label}", seed=seed, validation_perplexity=20.0 + i + 0.3 * seed,
                 validation_loss=3.0, final_training_loss=3.1)
            for group in ["base", *groups] for i, label in enumerate(("a", "b")) for seed in (0, 1, 2)]
    for row in rows:
        if row["group"] == "base":
            row["label"] = ablation.BASE_VARIANT[1]
    rows = ablation.summarise(rows)
    ablation.plot(rows, str(tmp_path / "ablation.png"))
    (figure,) = figures
    figure.canvas.draw()  # at the figure's own dpi, like figure.bbox
    title = figure._suptitle.get_window_extent()
    assert 0 <= title.x0 and title.x1 <= figure.bbox.x1, (title, figure.bbox)
    assert (tmp_path / "ablation.png").read_bytes()[:4] == b"\x89PNG"
    figure.clf()


def test_summary_pairs_seeds_and_judges_by_non_overlapping_ranges(ablation):
    base = ablation.BASE_VARIANT[1]
    runs = [dict(group="base", label=base, seed=s, validation_perplexity=p, validation_loss=1.0,
                 final_training_loss=1.0) for s, p in ((0, 40.0), (1, 41.0), (2, 42.0))]
    runs += [dict(group="x", label="close", seed=s, validation_perplexity=p, validation_loss=1.0,
                  final_training_loss=1.0) for s, p in ((0, 41.5), (1, 42.5), (2, 43.5))]
    runs += [dict(group="x", label="far", seed=s, validation_perplexity=p, validation_loss=1.0,
                  final_training_loss=1.0) for s, p in ((0, 45.0), (1, 44.0), (2, 46.0))]
    runs += [dict(group="twin", label="Pythia twin", seed=s, validation_perplexity=p, validation_loss=1.0,
                  final_training_loss=1.0) for s, p in ((0, 50.0), (1, 50.0), (2, 56.0))]
    runs += [dict(group="twin-lr", label="twin at 3x LR", seed=s, validation_perplexity=p, validation_loss=1.0,
                  final_training_loss=1.0) for s, p in ((0, 47.0), (1, 48.0), (2, 49.0))]
    summary = {e["label"]: e for e in ablation.summarise(runs)}
    # the twin's own learning rates are compared with the twin, not with the MemoryFormer
    assert summary["twin at 3x LR"]["reference"] == "Pythia twin"
    assert summary["twin at 3x LR"]["paired_difference"] == pytest.approx(-4.0)
    assert summary["twin at 3x LR"]["beyond_seed_spread"]
    assert summary["close"]["paired_difference"] == pytest.approx(1.5)
    assert summary["close"]["beyond_seed_spread"] is False
    assert summary["far"]["paired_difference"] == pytest.approx(4.0) and summary["far"]["beyond_seed_spread"]
    assert summary["far"]["std"] == pytest.approx(1.0) and summary["far"]["mean"] == pytest.approx(45.0)
    ratio = summary[base]["ratio_to_twin"]
    assert ratio["per_seed"] == pytest.approx([0.8, 0.82, 0.75])
    assert (ratio["min"], ratio["max"]) == pytest.approx((0.75, 0.82))
