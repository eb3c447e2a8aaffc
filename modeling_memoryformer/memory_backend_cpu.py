"""The fused CPU backend: builds the C++ of csrc/cpu/ (carried as the string CPP_SOURCE of memory_kernel_source.py)
with torch.utils.cpp_extension at first use and loads it, which registers CPU kernels for the ops of
memory_op_library.py. Without a compiler the PyTorch kernels run instead.

The build is cached in the extension build root (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions/py<version>_cpu)
under a name keyed by everything that changes the binary: the source, the flags, the compiler, the CPU model and the
torch installation (its version and folder: two venvs keep a build each instead of rebuilding each other's).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import warnings

import torch

from .cpu_facts import cpu_model
from .memory_op_library import OPS_NAMESPACE, define_ops


# Flags: -O3 -march=$MEMORYFORMER_KERNEL_MARCH (default native) -fopenmp. The extension name hashes the source, the
# torch version, the compiler (first line of `$CXX --version`), the flags and the CPU model. A failed compile is
# remembered: its compiler output goes to <build root>/<extension name>.failed.log, and later processes that would
# build the same name do not retry while that file exists (delete it to retry). MEMORYFORMER_REQUIRE_FUSED=1 makes a
# kernel that cannot be built an error instead of a fallback, and always retries a remembered failure.

_fused_state: bool | None = None  # None: not tried yet
_fused_error: str | None = None  # why it is not available, repeated under MEMORYFORMER_REQUIRE_FUSED=1


class KernelBuildError(RuntimeError):
    """The fused kernel could not be built. `first_error`: the compiler's first error line; `log_path`: the file holding
    the full compiler output (None when nothing was compiled, e.g. no compiler); `output`: that output."""

    def __init__(self, message: str, first_error: str = "", log_path: str | None = None, output: str = ""):
        super().__init__(message)
        self.first_error = first_error
        self.log_path = log_path
        self.output = output


def fused_state() -> bool | None:
    """Whether the fused kernel is loaded (True), could not be (False), or has not been tried in this process (None)."""
    return _fused_state


def fused_error() -> str | None:
    """Why the fused kernel could not be built or loaded (None when it was, or has not been tried)."""
    return _fused_error


def fused_required() -> bool:
    """Whether MEMORYFORMER_REQUIRE_FUSED is set (to anything but 0/false/no): then a fused kernel that cannot be built
    is an error instead of a fallback to the PyTorch path, and a remembered build failure is retried."""
    return os.environ.get("MEMORYFORMER_REQUIRE_FUSED", "").strip().lower() not in ("", "0", "false", "no")


def load_fused_kernels() -> bool:
    """Build (first time) and load the fused CPU kernels; return whether they are usable.

    When they cannot be built, warns once (quoting the compiler's first error line and the log of its full output) and
    returns False, so that Memory Layers run the PyTorch path; with MEMORYFORMER_REQUIRE_FUSED=1 raises a RuntimeError
    instead, on every call.
    """
    global _fused_state, _fused_error
    if _fused_state is None:
        _check_pool_setting()
        march = _kernel_march()
        try:
            _build_and_register(march=march)
            _fused_state = True
        except Exception as exc:  # a compile error, a missing compiler or ninja: fall back, say so once
            _fused_state = False
            _fused_error = str(exc) if isinstance(exc, KernelBuildError) else (
                f"MemoryFormer's fused CPU kernel could not be built or loaded ({type(exc).__name__}: {exc})."
            )
            if fused_required():
                raise RuntimeError(f"{_fused_error} [MEMORYFORMER_REQUIRE_FUSED=1: no fallback]") from exc
            warnings.warn(
                f"{_fused_error} Memory Layers use the plain PyTorch path (correct, slower).",
                RuntimeWarning,
                stacklevel=3,
            )
    if _fused_state is False and fused_required():
        raise RuntimeError(f"{_fused_error} [MEMORYFORMER_REQUIRE_FUSED=1: no fallback]")
    return _fused_state


def _check_pool_setting() -> None:
    """MEMORYFORMER_GRAD_POOL_MB is read by the C++ kernel, which cannot report a typo: check it here."""
    value = os.environ.get("MEMORYFORMER_GRAD_POOL_MB")
    if value is not None and not value.strip().isdigit():
        raise ValueError(
            f"MEMORYFORMER_GRAD_POOL_MB={value!r} is not a whole number of megabytes; set it to e.g. 16384 (the "
            "default), or 0 to turn the table-gradient pool off."
        )


_MARCH_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


def _kernel_march() -> str:
    """MEMORYFORMER_KERNEL_MARCH (default "native"), checked: it goes into the ninja file unquoted."""
    march = os.environ.get("MEMORYFORMER_KERNEL_MARCH", "native")
    if not _MARCH_PATTERN.fullmatch(march):
        raise ValueError(
            f"MEMORYFORMER_KERNEL_MARCH={march!r} is not a -march value; use e.g. native (the default), x86-64-v3 or "
            "armv8.2-a."
        )
    return march


def _kernel_flags(march: str, namespace: str | None = None) -> list[str]:
    if not _MARCH_PATTERN.fullmatch(march):
        raise ValueError(f"{march!r} is not a -march value (e.g. native, x86-64-v3, armv8.2-a).")
    # -fno-trapping-math: the kernel never reads floating-point exception flags. Without it GCC vectorises a
    # compare-and-select (exp_nonpos's clamp) only through AVX-512's mask registers: on AVX2 and NEON the hash's loops
    # stayed scalar (4.2 ms instead of 0.69 ms for 2048 x 512 values, 2 threads, AVX2-only AMD EPYC Zen 3).
    # tests/kernel/test_kernel_builds.py checks that those loops vectorise for each target.
    flags = ["-O3", f"-march={march}", "-fopenmp", "-fno-trapping-math"]
    if namespace is not None:
        flags.append(f"-DMEMORYFORMER_OPS={namespace}")
    return flags


def _ops_loaded(namespace: str) -> bool:
    """Whether a C++ library registered its CPU kernels for the ops of `namespace` in this process."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{namespace}::lookup", "CPU")


def _build_and_register(source: str | None = None, march: str | None = None) -> None:
    """Build and load the production kernel: its CPU kernels join the ops of torch.ops.memoryformer (defined by
    memory_op_library). `source` replaces CPP_SOURCE: the tests build broken sources through it."""
    if source is None:
        if _ops_loaded(OPS_NAMESPACE):
            return  # already loaded in this process (e.g. by another copy of this module)
        from .memory_kernel_source import CPP_SOURCE

        source = CPP_SOURCE
    flags = _kernel_flags(_kernel_march() if march is None else march)
    name = _extension_name("memoryformer_cpu", source, flags)  # the CPU backend's library
    _compile(name, source, flags, trust_remembered_failure=not fused_required(), announce=True)


def build_kernel_variant(march: str, load: bool = True) -> str:
    """Build the kernel source for `-march=<march>` with its ops in their own namespace and return that namespace.

    Flags: -O3 -march=<march> -fopenmp -DMEMORYFORMER_OPS=memoryformer_cpu_<march, non-alphanumerics as _>, under
    an extension name of its own (cached like the production kernel). With `load` (default) the library is loaded
    into this process, its ops under torch.ops.<namespace> (defined first, as the production ones): check
    `cpu_facts.cpu_can_run(march)` first, as code for a newer CPU may not even load. With load=False the source is only compiled
    to an object file (no link, nothing loaded, nothing cached). A remembered failure is always retried. Raises a
    KernelBuildError (a RuntimeError) quoting the compiler's first error line and the log of its full output.
    """
    from .memory_kernel_source import CPP_SOURCE

    namespace = f"memoryformer_cpu_{re.sub(r'[^0-9A-Za-z]+', '_', march).strip('_')}"
    flags = _kernel_flags(march, namespace)
    if "MEMORYFORMER_OPS" not in CPP_SOURCE:
        raise RuntimeError(
            "The kernel source does not take its op namespace from the MEMORYFORMER_OPS macro: a variant build would "
            f"register its ops as {OPS_NAMESPACE}, not {namespace}."
        )
    if not load:
        _check_compiles(_compiler(), flags, CPP_SOURCE, ["-c", "-o", os.devnull])
        return namespace
    define_ops(namespace)
    if _ops_loaded(namespace):
        return namespace
    _compile(_extension_name(namespace, CPP_SOURCE, flags), CPP_SOURCE, flags, trust_remembered_failure=False)
    if not _ops_loaded(namespace):
        raise RuntimeError(f"The -march={march} build loaded but defines no torch.ops.{namespace}.lookup.")
    return namespace


def compile_kernel_syntax(compiler: str, flags: list[str], source: str | None = None) -> None:
    """Check that `compiler` accepts the kernel source with `flags` (e.g. a cross compiler: "aarch64-linux-gnu-g++",
    ["-march=armv8.2-a", "-fopenmp"]): `<compiler> -fsyntax-only -std=c++20 <flags> <torch includes> -x c++ -`, the
    source (with its #line directive) on stdin. -std=c++20 is what torch.utils.cpp_extension builds with.
    Raises a KernelBuildError quoting the first error line (its `output` holds all of it)."""
    if source is None:
        from .memory_kernel_source import CPP_SOURCE

        source = CPP_SOURCE
    _check_compiles(compiler, list(flags), source, ["-fsyntax-only"])


def _check_compiles(compiler: str, flags: list[str], source: str, mode: list[str]) -> None:
    from torch.utils.cpp_extension import include_paths

    command = [*shlex.split(compiler), *mode, "-std=c++20", "-fPIC", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    command += ["-DTORCH_EXTENSION_NAME=memoryformer_cpu_check", *flags]
    for include in include_paths("cpu"):
        command += ["-isystem", include]
    command += ["-x", "c++", "-"]
    try:
        result = subprocess.run(command, input=source, check=False, capture_output=True, text=True, errors="replace")
    except FileNotFoundError as exc:
        raise KernelBuildError(f"The compiler `{compiler}` was not found.") from exc
    if result.returncode != 0:
        output = result.stdout + result.stderr
        first = _first_error_line(output)
        message = f"`{compiler}` {' '.join(flags)} rejects the kernel source: {first}"
        raise KernelBuildError(message, first, None, output)


def _compiler() -> str:
    return os.environ.get("CXX", "c++")  # what torch.utils.cpp_extension compiles with


@functools.cache
def _compiler_identity(compiler: str) -> str:
    """First line of `<compiler> --version`; a KernelBuildError when there is no such compiler."""
    try:
        result = subprocess.run([*shlex.split(compiler), "--version"], check=False, capture_output=True, text=True,
                                timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(
            f"MemoryFormer's fused CPU kernel cannot be built: the C++ compiler `{compiler}` was not found or does not "
            f"run ({exc}). Install gcc/g++ (and `pip install ninja`) to enable it."
        ) from exc
    lines = (result.stdout or result.stderr).splitlines()
    return lines[0].strip() if lines else compiler


def _extension_name(prefix: str, source: str, flags: list[str]) -> str:
    """A name per source, flags, machine, compiler and torch installation: two venvs with the same torch version
    have their own build folders (each build.ninja names its venv's torch headers, so a shared folder would be
    rebuilt every time the other venv used it)."""
    torch_installation = os.path.realpath(os.path.dirname(torch.__file__))
    key = "\0".join(
        [source, torch.__version__, torch_installation, platform.machine(), cpu_model(),
         _compiler_identity(_compiler()), *flags]
    )
    return f"{prefix}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _build_root() -> str:
    """The folder torch.utils.cpp_extension builds extensions in (each in a subfolder named after it)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:
        return root
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return os.path.join(get_default_build_root(), f"{python}_{accelerator}")


def failure_log_path(name: str) -> str:
    """Where the compiler output of a failed build of extension `name` is kept (its presence stops retries)."""
    return os.path.join(_build_root(), f"{name}.failed.log")


def _first_error_line(output: str) -> str:
    lines = [line.strip() for line in output.splitlines()]
    for line in lines:
        if "error:" in line:
            return line
    return next((line for line in reversed(lines) if line), "(no compiler output)")


def _compiler_output(exc: BaseException) -> str | None:
    """The compiler output of a failed load_inline build (in the CalledProcessError it raises from); None for other
    failures (e.g. loading the library)."""
    cause = exc.__cause__
    if isinstance(cause, subprocess.CalledProcessError):
        output = cause.output or b""
        return output.decode(errors="replace") if isinstance(output, bytes) else str(output)
    if isinstance(exc, RuntimeError) and str(exc).startswith("Error building extension"):
        return str(exc)
    return None


def _failure_message(first_error: str, log_path: str, flags: list[str], remembered: bool) -> str:
    what = (
        "failed to compile in an earlier run with the same source, compiler and flags (not retried)"
        if remembered
        else "failed to compile"
    )
    return (
        f"MemoryFormer's fused CPU kernel {what} [{_compiler()} {' '.join(flags)}]: {first_error} -- full compiler "
        f"output in {log_path}; delete that file to retry the build (MEMORYFORMER_REQUIRE_FUSED=1 always retries)."
    )


def _remembered_failure(log_path: str, flags: list[str]) -> KernelBuildError:
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            output = f.read()
    except OSError:
        output = ""
    first = _first_error_line(output)
    return KernelBuildError(_failure_message(first, log_path, flags, remembered=True), first, log_path, output)


def _compile(name: str, source: str, flags: list[str], trust_remembered_failure: bool, announce: bool = False) -> None:
    """load_inline(name, source, flags), remembering a failed compile in failure_log_path(name)."""
    from torch.utils.cpp_extension import load_inline

    if shutil.which("ninja") is None and not _ninja_in_venv():
        raise KernelBuildError(
            "MemoryFormer's fused CPU kernel cannot be built: `ninja` was not found on PATH. `pip install ninja` "
            "(and have gcc/g++) to enable it."
        )
    log_path = failure_log_path(name)
    if trust_remembered_failure and os.path.exists(log_path):
        raise _remembered_failure(log_path, flags)
    if announce and not os.path.exists(os.path.join(_build_root(), name, f"{name}.so")):
        # Said only when this build does not exist yet: loading a cached one is silent.
        print(f"MemoryFormer: compiling the fused CPU kernel once for this torch installation and CPU (on 2 vCPUs: 25 s on a "
              "quiet AMD EPYC Zen 4, 31 s on a quiet Zen 3, 49-57 s on busy Intel Xeon and Zen 3 machines; cached in "
              f"{os.path.join(_build_root(), name)})...", file=sys.stderr, flush=True)
    try:
        # The source includes the ATen and torch/library.h headers it needs: no implicit <torch/extension.h> (nor the
        # Python headers behind it), which cuts about a third of the compile time.
        load_inline(
            name=name,
            cpp_sources=[source],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
            no_implicit_headers=True,
        )
    except Exception as exc:
        output = _compiler_output(exc)
        if output is None:
            if os.path.exists(log_path):  # another process's build of the same name failed while this one waited
                raise _remembered_failure(log_path, flags) from exc
            raise
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        with open(log_path, "w", encoding="utf-8") as f:
            f.write(f"# MemoryFormer fused kernel build {name}: {_compiler_identity(_compiler())}\n")
            f.write(f"# flags: {' '.join(flags)}; torch {torch.__version__}\n")
            f.write("# While this file exists, processes that would build the same extension do not retry.\n")
            f.write("# Delete it to retry.\n")
            f.write(output)
        first = _first_error_line(output)
        message = _failure_message(first, log_path, flags, remembered=False)
        raise KernelBuildError(message, first, log_path, output) from exc
    if os.path.exists(log_path):
        os.remove(log_path)  # an earlier failure of this exact build is gone


def _ninja_in_venv() -> bool:
    if os.path.exists(os.path.join(os.path.dirname(sys.executable), "ninja")):
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        return True
    return False
