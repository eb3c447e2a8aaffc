"""ruff, configured in pyproject.toml ([tool.ruff]), finds nothing in the tree: part of the test command, so a lint
finding fails CI like a failing test. ruff comes with the dev extra (`make setup`); its absence fails, not skips."""

import re
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


# Text that only makes sense next to the project's tracker or private notes ("issue 13", "(issue 5, part 5)",
# "SPEC section 2"), anywhere; and, in the user documentation, development history ("at git 0630197": a commit
# names where a fixture came from in a test, not what a user reads).
OUTSIDE_REFERENCE = re.compile(r"\b(?:issue\s+#?\d+|SPEC\s+(?:section|§))", re.IGNORECASE)
GIT_HASH = re.compile(r"\bgit\s+[0-9a-f]{7,40}\b")
USER_DOCS = ["README.md", "CONTRIBUTING.md", "CHANGELOG.md", "conversion/README.md", "notebooks/README.md",
             *(f"docs/{path.name}" for path in sorted((ROOT / "docs").glob("*.md")))]


def _tracked(*patterns: str) -> list[Path]:
    result = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, check=False, capture_output=True, text=True,
                            timeout=60)
    if result.returncode != 0:  # not a git checkout (an unpacked archive): every matching file instead
        return sorted(p for pattern in patterns for p in ROOT.glob(f"**/{pattern}") if ".venv" not in p.parts)
    return [ROOT / line for line in result.stdout.splitlines()]


def test_docs_and_code_point_at_the_paper_not_at_the_tracker():
    docs = [ROOT / name for name in USER_DOCS if (ROOT / name).exists()]
    code = [path for path in _tracked("*.py", "*.cpp", "*.h") if path != Path(__file__).resolve()]
    found = []
    for path in docs + code:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if OUTSIDE_REFERENCE.search(line) or (path in docs and GIT_HASH.search(line)):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == [], "references to the tracker or notes outside the repository:\n" + "\n".join(found)


def test_the_reference_pattern_finds_what_it_should():
    for text in ("see issue 13", "(issue #5, part 5)", "SPEC section 2", "SPEC § 4"):
        assert OUTSIDE_REFERENCE.search(text), text
    for text in ("the paper's section 2.3", "an issue with the cache", "GitHub issues", "the spec of the op"):
        assert not OUTSIDE_REFERENCE.search(text), text
    assert GIT_HASH.search("measured at git 0630197") and not GIT_HASH.search("digest 0630197")


def test_no_hand_written_module_of_the_model_unit_is_over_700_lines():
    """The model unit stays readable: each module one job, none over 700 lines (the generated kernel source aside),
    and each C++ part of the kernel (csrc/cpu/) under 400."""
    unit = ROOT / "modeling_memoryformer"
    long = [f"{path.name}: {n}" for path in sorted(unit.glob("*.py")) if path.name != "memory_kernel_source.py"
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > 700]
    long += [f"csrc/cpu/{path.name}: {n}" for path in sorted((unit / "csrc" / "cpu").glob("*.[ch]*"))
             if (n := len(path.read_text(encoding="utf-8").splitlines())) > 400]
    assert long == [], "split these by concern (CONTRIBUTING, 'One place per concept'):\n" + "\n".join(long)
