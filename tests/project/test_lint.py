"""ruff, configured in pyproject.toml ([tool.ruff]), finds nothing in the tree: part of the test command, so a lint
finding fails CI like a failing test. ruff comes with the dev extra (`make setup`); its absence fails, not skips."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _ruff() -> str:
    beside_python = Path(sys.executable).with_name("ruff")
    found = str(beside_python) if beside_python.exists() else shutil.which("ruff")
    assert found, "ruff is not installed: run `make setup` (the dev extra installs it) or `pip install ruff`"
    return found


def test_ruff_finds_nothing():
    result = subprocess.run([_ruff(), "check", "--no-cache", "--output-format", "concise", str(ROOT)], cwd=ROOT,
                            check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"ruff findings (fix them, or `ruff check --fix`):\n{result.stdout}{result.stderr}"


def test_ruff_reads_the_projects_configuration():
    """The selection in pyproject.toml is what runs: a lambda assignment (E731, in the selection) is found."""
    result = subprocess.run([_ruff(), "check", "--no-cache", "--stdin-filename", str(ROOT / "probe.py"), "-"],
                            input="f = lambda: 0\n", cwd=ROOT, check=False, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1 and "E731" in result.stdout, result.stdout + result.stderr
