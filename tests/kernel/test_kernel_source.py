"""The kernel source module and the loader's handling of builds that fail.

- memory_kernel_source.py is exactly what scripts/generate_kernel_source.py makes of the parts in csrc/cpu/, each
  after a #line directive, so compiler errors name the part and its line (checked by an error injected in each part).
- A compile error is reported with the compiler's first error line (file:line of the part) and a log of the full
  output in the extension build root; the failure is remembered (later processes do not call the compiler);
  MEMORYFORMER_REQUIRE_FUSED=1 turns it into an error and retries it.
- MEMORYFORMER_KERNEL=torch (or set_kernel("torch")) never builds or loads anything.

Builds go to temporary TORCH_EXTENSIONS_DIRs; the only real compile is of the source with an injected error (it
stops before code generation); the other failures use MEMORYFORMER_KERNEL_MARCH=not-a-cpu, which the compiler
rejects at once.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from modeling_memoryformer import memory_backend_cpu, memory_ops
from modeling_memoryformer.memory_kernel_source import CPP_SOURCE


ROOT = Path(__file__).resolve().parents[2]
LINE_NAME = "modeling_memoryformer/csrc/cpu/prelude.h"  # the first part, where the source starts
KERNEL_VARIABLES = ("MEMORYFORMER_KERNEL", "MEMORYFORMER_KERNEL_MARCH", "MEMORYFORMER_REQUIRE_FUSED")


def generator():
    path = ROOT / "scripts" / "generate_kernel_source.py"
    spec = importlib.util.spec_from_file_location("generate_kernel_source", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_module_is_the_generator_output_for_the_parts():
    gen = generator()
    cpp = gen.cpp_source()  # the parts of csrc/cpu/ in order, each after its #line directive
    current = (ROOT / "modeling_memoryformer" / "memory_kernel_source.py").read_text(encoding="utf-8")
    assert current == gen.module_text(cpp), "out of date: run `python scripts/generate_kernel_source.py`"
    assert CPP_SOURCE == cpp and cpp.startswith(f'#line 1 "{LINE_NAME}"\n')


def test_source_starts_with_the_line_directive():
    assert CPP_SOURCE.startswith(f'#line 1 "{LINE_NAME}"\n')


@pytest.mark.slow
def test_a_compile_error_in_any_part_names_that_part_and_its_line():
    """A copy of the parts with an error appended to each, checked by one `g++ -fsyntax-only`: every error names its
    part (modeling_memoryformer/csrc/cpu/<part>) and the line just past the part's end, and there is no other."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    gen = generator()
    parts = gen.read_parts()
    injected = [(name, f'{text}static_assert(sizeof(int) == 0, "memoryformer test: injected into {name}");\n')
                for name, text in parts]
    with pytest.raises(memory_ops.KernelBuildError) as info:
        memory_ops.compile_kernel_syntax("g++", ["-fopenmp"], gen.cpp_source(injected))
    output = info.value.output
    for name, text in parts:
        where = f"{gen.LINE_PREFIX}{name}:{len(text.splitlines()) + 1}:"  # the line after the part
        assert re.search(rf"^{re.escape(where)}\d+: error: .*injected into {re.escape(name)}\b", output, re.M), (
            f"no error at {where}\n{output[-3000:]}")
    assert len(re.findall(r": error: ", output)) == len(parts), output[-3000:]


def broken_source() -> tuple[str, int]:
    """CPP_SOURCE with an error inserted just before the first #include (file scope); returns it and the line of
    prelude.h (the first part) the error is on."""
    lines = CPP_SOURCE.split("\n")  # lines[i] is line i of prelude.h (lines[0] is the #line directive)
    first_include = next(i for i in range(1, len(lines)) if lines[i].startswith("#include"))
    lines.insert(first_include, 'static_assert(sizeof(int) == 0, "memoryformer test: injected compile error");')
    return "\n".join(lines), first_include


def clean_env(**overrides: str) -> dict[str, str]:
    """This environment without the kernel variables (make test sets MEMORYFORMER_REQUIRE_FUSED=1), plus overrides."""
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_VARIABLES}
    env.update(overrides)
    return env


def run_python(code: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, check=False, capture_output=True, text=True,
        timeout=timeout,
    )


FORBID_COMPILER = """
import torch.utils.cpp_extension as cpp_extension

def _no_build(*args, **kwargs):
    raise AssertionError("the compiler was called")

cpp_extension.load_inline = _no_build
"""


@pytest.fixture(scope="module")
def failed_build(tmp_path_factory):
    """One real build of the broken source in a fresh TORCH_EXTENSIONS_DIR: (dir, source file, line, error, seconds)."""
    ext_dir = tmp_path_factory.mktemp("torch_extensions")
    source, line = broken_source()
    source_file = ext_dir.parent / "broken_kernel.cpp"
    source_file.write_text(source, encoding="utf-8")
    with pytest.MonkeyPatch.context() as mp:
        for name in KERNEL_VARIABLES:
            mp.delenv(name, raising=False)
        mp.setenv("TORCH_EXTENSIONS_DIR", str(ext_dir))
        start = time.perf_counter()
        with pytest.raises(memory_ops.KernelBuildError) as info:
            memory_backend_cpu._build_and_register(source=source)
        seconds = time.perf_counter() - start
    return ext_dir, source_file, line, info.value, seconds


@pytest.mark.slow
def test_a_compile_error_quotes_the_cpp_line_and_keeps_the_full_output(failed_build):
    ext_dir, _, line, error, _ = failed_build
    where = f"{LINE_NAME}:{line}:"
    assert error.first_error.startswith(where) and "error:" in error.first_error, error.first_error
    assert "injected compile error" in error.first_error
    message = str(error)
    assert where in message and error.log_path in message and "delete that file to retry" in message
    assert "install gcc" not in message.lower()  # a compiler is there: no generic advice
    log = Path(error.log_path)
    assert log.parent == ext_dir and log.name.startswith("memoryformer_cpu_") and log.name.endswith(".failed.log")
    assert where in log.read_text(encoding="utf-8")


@pytest.mark.slow
def test_load_fused_kernels_warns_with_the_compiler_error_and_falls_back(failed_build, monkeypatch):
    ext_dir, source_file, line, error, _ = failed_build
    for name in KERNEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext_dir))
    monkeypatch.setattr(memory_backend_cpu, "_fused_state", None)
    monkeypatch.setattr(memory_backend_cpu, "_fused_error", None)
    broken = functools.partial(memory_backend_cpu._build_and_register, source=source_file.read_text(encoding="utf-8"))
    monkeypatch.setattr(memory_backend_cpu, "_build_and_register", broken)
    with pytest.warns(RuntimeWarning) as warned:
        assert memory_ops.load_fused_kernels() is False
    message = str(warned[0].message)
    assert f"{LINE_NAME}:{line}:" in message and error.log_path in message and "PyTorch path" in message


@pytest.mark.slow
def test_a_remembered_failure_is_not_compiled_again_in_a_new_process(failed_build):
    ext_dir, source_file, line, error, build_seconds = failed_build
    build_dir = Path(error.log_path).with_name(Path(error.log_path).name.removesuffix(".failed.log"))
    before = sorted((p.name, p.stat().st_mtime_ns) for p in build_dir.iterdir())
    result = run_python(
        FORBID_COMPILER
        + f"""
import time
from pathlib import Path
from modeling_memoryformer import memory_backend_cpu
start = time.perf_counter()
try:
    memory_backend_cpu._build_and_register(source=Path({str(source_file)!r}).read_text())
except memory_backend_cpu.KernelBuildError as exc:
    print("SECONDS", time.perf_counter() - start)
    print("LOG", exc.log_path)
    print("MESSAGE", exc)
""",
        clean_env(TORCH_EXTENSIONS_DIR=str(ext_dir)),
    )
    assert result.returncode == 0, result.stderr
    out = dict(line.split(" ", 1) for line in result.stdout.splitlines() if line[:3] in ("SEC", "LOG", "MES"))
    assert out["LOG"] == error.log_path
    assert "earlier run" in out["MESSAGE"] and f"{LINE_NAME}:{line}:" in out["MESSAGE"]
    assert float(out["SECONDS"]) < min(1.0, build_seconds / 3), (out["SECONDS"], build_seconds)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in build_dir.iterdir()) == before  # nothing rebuilt


@pytest.mark.slow
def test_a_broken_build_falls_back_is_remembered_and_is_an_error_under_require_fused(tmp_path):
    """MEMORYFORMER_KERNEL_MARCH=not-a-cpu: the production build fails at once. Without MEMORYFORMER_REQUIRE_FUSED the
    layer falls back to PyTorch and the failure is remembered; with it, the build is retried and is an error."""
    get_kernel = """
import warnings
from modeling_memoryformer import memory_ops
with warnings.catch_warnings(record=True) as warned:
    warnings.simplefilter("always")
    try:
        print("KERNEL", memory_ops.get_kernel())
    except RuntimeError as exc:
        print("ERROR", exc)
for w in warned:
    print("WARNING", w.message)
"""
    env = clean_env(TORCH_EXTENSIONS_DIR=str(tmp_path), MEMORYFORMER_KERNEL_MARCH="not-a-cpu")

    first = run_python(get_kernel, env)
    assert first.returncode == 0, first.stderr
    assert "KERNEL torch" in first.stdout
    warning = next(line for line in first.stdout.splitlines() if line.startswith("WARNING"))
    assert "error: bad value" in warning and "not-a-cpu" in warning and "earlier run" not in warning
    (log,) = tmp_path.glob("memoryformer_cpu_*.failed.log")
    assert str(log) in warning

    again = run_python(FORBID_COMPILER + get_kernel, env)  # remembered: the compiler is not called
    assert again.returncode == 0, again.stderr
    assert "KERNEL torch" in again.stdout and "earlier run" in again.stdout and str(log) in again.stdout

    required = run_python(get_kernel, {**env, "MEMORYFORMER_REQUIRE_FUSED": "1"})
    assert required.returncode == 0, required.stderr
    error = next(line for line in required.stdout.splitlines() if line.startswith("ERROR"))
    assert "error: bad value" in error and str(log) in error and "MEMORYFORMER_REQUIRE_FUSED=1" in error
    assert "earlier run" not in error  # retried, not trusted
    assert "KERNEL" not in required.stdout


@pytest.mark.slow
@pytest.mark.parametrize("how", ["environment", "set_kernel"])
def test_the_torch_kernel_never_builds_or_loads_the_fused_one(tmp_path, how):
    ext_dir = tmp_path / "torch_extensions"
    env = clean_env(TORCH_EXTENSIONS_DIR=str(ext_dir), MEMORYFORMER_REQUIRE_FUSED="1")
    if how == "environment":
        env["MEMORYFORMER_KERNEL"] = "torch"
    result = run_python(
        FORBID_COMPILER
        + f"""
import torch
from modeling_memoryformer import MemoryLayer, memory_backend_cpu, memory_ops
if {how == "set_kernel"}:
    memory_ops.set_kernel("torch")
layer = MemoryLayer(16, 8, 4)
layer(torch.randn(3, 16)).sum().backward()
print("KERNEL", memory_ops.get_kernel(), memory_backend_cpu.fused_state())
print("LOADED", torch._C._dispatch_has_kernel_for_dispatch_key("memoryformer::lookup", "CPU"))
""",
        env,
    )
    assert result.returncode == 0, result.stderr
    assert "KERNEL torch None" in result.stdout and "LOADED False" in result.stdout
    assert not ext_dir.exists()
