"""Packaging: the wheel builds without a setuptools warning (SPDX license, every preset folder a package), ships the
presets, the converter (conversion/ as modeling_memoryformer.conversion, without its experiments) and the license,
and `make setup` installs torch first, pinned, with one progress line per stage."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PRESET_FOLDERS = sorted(p.parent.name for p in (ROOT / "configuration").glob("*/config.json"))


def test_license_is_an_spdx_expression_setuptools_accepts():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    requirement = next(r for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools"))
    minimum = tuple(int(x) for x in re.search(r">=\s*([\d.]+)", requirement).group(1).split("."))
    assert minimum >= (77,)  # the first setuptools that reads `license` as an SPDX string


def test_every_preset_folder_is_a_package():
    assert PRESET_FOLDERS == ["base", "small", "tiny"]
    packages = PYPROJECT["tool"]["setuptools"]["packages"]
    for name in PRESET_FOLDERS:
        assert f"modeling_memoryformer.presets.{name}" in packages, name


@pytest.mark.slow
def test_the_wheel_builds_without_warnings_and_ships_presets_and_license(tmp_path):
    setuptools = pytest.importorskip("setuptools")
    if tuple(int(x) for x in setuptools.__version__.split(".")[:1]) < (77,):
        pytest.skip(f"setuptools {setuptools.__version__} predates SPDX license strings (77)")
    source = tmp_path / "src"  # a copy: building in the work tree would leave build/ and egg-info behind
    for name in ("modeling_memoryformer", "configuration", "conversion"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.o"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, source / name)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w",
         str(tmp_path / "dist"), str(source)], check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    output = result.stdout + result.stderr
    warnings = [line for line in output.splitlines() if re.search(r"warn|deprecat", line, re.I)]
    assert warnings == [], "\n".join(warnings)
    (wheel,) = (tmp_path / "dist").glob("memoryformer_hf-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    for preset in PRESET_FOLDERS:
        assert f"modeling_memoryformer/presets/{preset}/config.json" in names, preset
    # every module, the converter and the presets under the package's namespace, and nothing else: no top-level
    # `conversion`, no conversion/experiments
    sources = {path.relative_to(ROOT).as_posix() for path in (ROOT / "modeling_memoryformer").rglob("*.py")}
    for folder, package in (("conversion", "conversion"), ("configuration", "presets")):
        sources |= {f"modeling_memoryformer/{package}/{path.name}" for path in (ROOT / folder).glob("*.py")}
    assert {name for name in names if name.endswith(".py")} == sources
    assert re.search(r"^License-Expression: Apache-2.0$", metadata, re.M)
    import modeling_memoryformer

    assert re.search(rf"^Version: {re.escape(modeling_memoryformer.__version__)}$", metadata, re.M)
    if (ROOT / "LICENSE").exists():
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


def test_make_setup_installs_torch_first_and_pinned_with_a_line_per_stage(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    result = subprocess.run(["make", "-n", "-B", "setup", f"VENV={tmp_path / 'venv'}", "PYTHON=python3"],
                            cwd=ROOT, check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    stages = [line for line in lines if re.match(r'echo "\[\d/\d\]', line)]
    assert [re.match(r'echo "\[(\d)/4\]', line).group(1) for line in stages] == ["1", "2", "3", "4"]
    installs = [line for line in lines if "pip install" in line and "--upgrade pip" not in line]
    assert len(installs) == 2
    assert re.search(r"pip install --quiet torch==2\.13\.0$", installs[0])  # torch alone, first
    assert '-e ".[dev]"' in installs[1] and installs[1].endswith("torch==2.13.0")  # and kept: no other build
    assert all("--quiet" in line for line in installs)


def test_the_declared_transformers_range_is_the_tested_one():
    """pyproject.toml's floor is the release `make test` runs the version tests under (the Makefile's
    TRANSFORMERS_FLOOR), with no ceiling below the next major; the default release of `make setup` and 5.24.0 (whose
    cache rename the model handles) are inside it; the README names the floor and the default."""
    from packaging.specifiers import SpecifierSet

    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    floor = re.search(r"^TRANSFORMERS_FLOOR := (\S+)$", makefile, re.M).group(1)
    default = re.search(r"^TRANSFORMERS_DEFAULT := (\S+)$", makefile, re.M).group(1)
    (requirement,) = [r for r in PYPROJECT["project"]["dependencies"] if re.match(r"transformers\b", r)]
    declared = SpecifierSet(requirement.removeprefix("transformers"))
    assert declared == SpecifierSet(f">={floor},<6")
    assert default in declared and "5.24.0" in declared and "5.99.0" in declared
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"transformers >= {floor}" in readme and f"`make setup` installs {default}" in readme


def test_the_version_has_one_source():
    """pyproject.toml reads the version from `modeling_memoryformer.__version__`; the installed distribution (the
    editable install of `make setup`) reports the same (the wheel's metadata is checked in the test above)."""
    import importlib.metadata

    import modeling_memoryformer

    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "modeling_memoryformer.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|rc\d+)?", modeling_memoryformer.__version__)
    assert importlib.metadata.version("memoryformer-hf") == modeling_memoryformer.__version__
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    release = modeling_memoryformer.__version__.split(".dev")[0]  # a development version is the coming release
    assert re.search(rf"^## \[{re.escape(release)}\]", changelog, re.M), f"CHANGELOG.md has no section for {release}"
