"""The example notebooks (notebooks/*.ipynb) run from top to bottom, so they never rot, and the committed copies
keep their outputs and figures.

Each notebook is executed in a temporary copy (the committed file is never rewritten) with the `python3` kernel of
this interpreter and cwd = notebooks/, one cell at a time with a 600 s limit; all five take about 1-4 minutes on 2
cores. Kernels run with one OpenMP thread: the models are too small to gain from more, and on a busy machine
OpenMP threads waiting for each other can make a step tens of times slower.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest


NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = (
    "01_quickstart.ipynb",
    "02_training_vs_pythia_twin.ipynb",
    "03_converting_pythia.ipynb",
    "04_bucket_distribution.ipynb",
    "05_lora_finetuning.ipynb",
)
WITH_PLOTS = NOTEBOOKS[:4]  # 05 makes no figure
CELL_TIMEOUT = 600  # seconds


def notebook_tools():
    """(nbclient, nbformat), or skip when the notebook tools of the `dev` extra are not installed."""
    try:
        import ipykernel  # noqa: F401  (the kernel nbclient starts)
        import nbclient
        import nbformat
    except ImportError as error:
        pytest.skip(f"executing notebooks needs nbclient, nbformat and ipykernel ({error}); "
                    'install them with `pip install -e ".[dev]"`')
    return nbclient, nbformat


def committed(name: str) -> dict:
    with open(NOTEBOOKS_DIR / name, encoding="utf-8") as f:
        return json.load(f)


def outputs(notebook: dict) -> list[dict]:
    return [output for cell in notebook["cells"] if cell["cell_type"] == "code" for output in cell["outputs"]]


def test_the_notebooks_folder_holds_the_five_notebooks():
    assert sorted(path.name for path in NOTEBOOKS_DIR.glob("*.ipynb")) == sorted(NOTEBOOKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_opens_with_a_markdown_cell_saying_what_it_shows_and_how_long_it_takes(name):
    first = committed(name)["cells"][0]
    assert first["cell_type"] == "markdown"
    text = "".join(first["source"])
    assert text.startswith("# ") and "Run time" in text


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_was_saved_with_every_cell_executed_and_no_error(name):
    cells = [cell for cell in committed(name)["cells"] if cell["cell_type"] == "code"]
    assert all(cell["execution_count"] is not None for cell in cells)
    assert not [output for output in outputs(committed(name)) if output["output_type"] == "error"]


@pytest.mark.parametrize("name", WITH_PLOTS)
def test_committed_notebook_embeds_its_plots_as_png(name):
    assert any("image/png" in output.get("data", {}) for output in outputs(committed(name)))


def test_committed_notebooks_have_the_cells_build_notebooks_writes():
    notebook_tools()
    spec = importlib.util.spec_from_file_location("build_notebooks", NOTEBOOKS_DIR / "build_notebooks.py")
    build_notebooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_notebooks)
    assert list(build_notebooks.NOTEBOOKS) == list(NOTEBOOKS)
    for name, cells in build_notebooks.NOTEBOOKS.items():
        built = build_notebooks.build(cells)
        saved = committed(name)["cells"]
        expected = [(cell.cell_type, cell.source) for cell in built.cells]
        assert expected == [(cell["cell_type"], "".join(cell["source"])) for cell in saved], (
            f"{name} differs from build_notebooks.py: regenerate it with "
            "`.venv/bin/python notebooks/build_notebooks.py --execute`"
        )


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_from_top_to_bottom_without_error(name, tmp_path):
    nbclient, nbformat = notebook_tools()
    copy = tmp_path / name
    shutil.copyfile(NOTEBOOKS_DIR / name, copy)
    notebook = nbformat.read(copy, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=CELL_TIMEOUT, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS_DIR)}}
    )
    client.execute(env={**os.environ, "OMP_NUM_THREADS": "1"})  # raises CellExecutionError naming the cell
    nbformat.write(notebook, copy)  # the executed copy stays in tmp_path for a look after a failure
    assert not [output for output in outputs(notebook) if output["output_type"] == "error"]
    if name in WITH_PLOTS:
        assert any("image/png" in output.get("data", {}) for output in outputs(notebook))
