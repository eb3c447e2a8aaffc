"""Shared helpers: the round-robin timer, environment metadata and memory readings."""

from __future__ import annotations

import contextlib
import datetime
import gc
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from modeling_memoryformer.evaluation.cpu_load import (  # re-exported: the benchmarks import them from here
    NOISY_CORES,
    STREAM_PROBE_MB,  # noqa: F401
    cpu_snapshot,
    memory_read_gbps,  # noqa: F401
    memory_stream_gbps,  # noqa: F401
    other_cores_since,  # noqa: F401
    other_cpu_since,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1e9
MB = 1e6


# ---------------------------------------------------------------------------------------------------------------------
# Timing


@dataclass
class Contestant:
    """One thing being timed. `fn()` is one unit of work; `context()` is entered around every timed sample
    (outside the timed region), e.g. `use_kernel("fused")` or `torch.inference_mode()`."""

    name: str
    fn: Callable[[], object]
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    kernel: str | None = None
    inner: int = 1  # calls per timed sample (calibrated so that one sample lasts >= min_sample_s)
    samples: list[float] = field(default_factory=list)  # seconds per call, one entry per repeat
    error: str | None = None
    timed_wall_s: float = 0.0  # wall time of all timed samples
    other_cpu_s: float = 0.0  # CPU time other processes (and hypervisor steal) used meanwhile

    @property
    def other_cores(self) -> float | None:
        """Average number of cores other processes kept busy while this contestant was timed."""
        return self.other_cpu_s / self.timed_wall_s if self.timed_wall_s > 0 else None

    @property
    def median(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= 300 else text[:297] + "..."


def round_robin(
    contestants: list[Contestant],
    repeats: int,
    warmup: int,
    min_sample_s: float = 0.0,
    max_inner: int = 100_000,
    tick: Callable[[int], None] | None = None,
) -> list[Contestant]:
    """Time every contestant `repeats` times, interleaved, after `warmup` untimed calls each.

    Repeat r runs every contestant once (the starting contestant rotates with r, so no contestant always
    follows the same one), so slow drift of the machine (thermal, other tenants, page cache) hits all
    contestants alike. A timed sample is `inner` back-to-back calls (time.perf_counter), `inner` chosen after
    warm-up so that a sample lasts at least `min_sample_s`; the sample is stored per call. The garbage
    collector is paused inside a sample. A contestant that raises is marked with its error and dropped; the
    others go on. `tick(n)` reports progress (one unit per call of warm-up or per timed sample).
    """
    tick = tick or (lambda n: None)
    warmup = max(1, warmup)  # at least one untimed call: first calls pay for allocation, JIT and kernel loading
    for c in contestants:
        if c.error:
            tick(warmup)
            continue
        done = 0
        try:
            with c.context():
                fastest = math.inf
                for _ in range(warmup):
                    start = time.perf_counter()
                    c.fn()
                    fastest = min(fastest, time.perf_counter() - start)
                    done += 1
                    tick(1)
                if min_sample_s > 0:
                    c.inner = max(1, min(max_inner, math.ceil(min_sample_s / max(fastest, 1e-9))))
                    if c.inner > 1:  # one untimed sample at the calibrated size
                        for _ in range(c.inner):
                            c.fn()
        except Exception as exc:
            c.error = _describe(exc)
            tick(warmup - done)
    for r in range(repeats):
        k = r % len(contestants)
        for c in contestants[k:] + contestants[:k]:
            if c.error:
                tick(1)
                continue
            try:
                before = cpu_snapshot()
                with c.context():
                    gc.disable()
                    try:
                        start = time.perf_counter()
                        for _ in range(c.inner):
                            c.fn()
                        elapsed = time.perf_counter() - start
                    finally:
                        gc.enable()
                c.samples.append(elapsed / c.inner)
                wall, other = other_cpu_since(before)
                c.timed_wall_s += wall
                c.other_cpu_s += other
            except Exception as exc:
                c.error = _describe(exc)
            tick(1)
        gc.collect()
    return contestants


def summary(samples: list[float], scale: float = 1.0) -> dict:
    """median / min / max / quartiles of `samples` multiplied by `scale`."""
    if not samples:
        return {}
    values = sorted(s * scale for s in samples)
    quartiles = statistics.quantiles(values, n=4) if len(values) >= 2 else [values[0]] * 3
    return {
        "median": statistics.median(values),
        "min": values[0],
        "max": values[-1],
        "q1": quartiles[0],
        "q3": quartiles[2],
        "samples": [s * scale for s in samples],  # in repeat order
    }


def make_progress(total: int, desc: str):
    """A tqdm bar on stderr (a no-op object when tqdm is missing)."""
    try:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, file=sys.stderr, mininterval=0.5, dynamic_ncols=True, leave=True)
    except ImportError:  # pragma: no cover - tqdm is a dependency of the package

        class _Null:
            def update(self, n=1):
                pass

            def set_postfix_str(self, s):
                pass

            def write(self, s):
                print(s, file=sys.stderr)

            def close(self):
                pass

        return _Null()


# ---------------------------------------------------------------------------------------------------------------------
# CPU contention: the machine may be shared (2 cores, other jobs compiling or testing). With every core in use by
# torch's thread pool, one busy core slows small parallel ops several-fold, so the results record how much CPU
# other processes took while we measured: (busy jiffies of the whole machine, steal included) - (our own CPU time).

# cpu_snapshot, other_cpu_since, other_cores_since and NOISY_CORES live in the package (evaluation.cpu_load), shared
# with `memoryformer demo`.


def wait_for_quiet(max_wait_s: float, probe_s: float = 0.5, threshold: float = NOISY_CORES) -> float:
    """Wait (up to max_wait_s) until other processes use at most `threshold` cores over a `probe_s` window.
    Returns the seconds waited beyond the first probe."""
    if max_wait_s <= 0 or cpu_snapshot() is None:
        return 0.0
    start = time.monotonic()
    while True:
        before = cpu_snapshot()
        time.sleep(probe_s)
        wall, other = other_cpu_since(before)
        waited = time.monotonic() - start - probe_s
        if wall <= 0 or other / wall <= threshold or waited >= max_wait_s:
            return max(0.0, waited)


# The memory-stream probe (memory_stream_gbps, STREAM_PROBE_MB, imported above) lives in the package's
# evaluation.cpu_load, where the demo's speed rows use it too.
NOISY_STREAM = 0.8  # a cell whose probe streamed below this fraction of the section's best is marked


# ---------------------------------------------------------------------------------------------------------------------
# Memory


def _proc_status_kb(key: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def current_rss_bytes() -> int | None:
    kb = _proc_status_kb("VmRSS")
    return None if kb is None else kb * 1024


def peak_rss_bytes() -> int:
    """Peak resident set size of this process: VmHWM (Linux), else getrusage's ru_maxrss."""
    kb = _proc_status_kb("VmHWM")
    if kb is not None:
        return kb * 1024
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def available_memory_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def total_memory_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        return None


# ---------------------------------------------------------------------------------------------------------------------
# Environment


def loaded_kernel_library():
    """The fused kernel's shared library this process loaded, opened with ctypes: a development build's extern "C"
    functions (the step timers of benchmarks/results/*/step_timers.py, lookup_sweep.py) are read through it."""
    import ctypes

    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "memoryformer_cpu_" in line and line.rstrip().endswith(".so")}
    assert len(paths) == 1, paths
    return ctypes.CDLL(paths.pop())


def tsc_hz(lib, seconds: float = 0.5) -> float:
    """Ticks per second of the time-stamp counter, from `lib.mf_tsc()` (a development build's rdtsc) over `seconds`."""
    import ctypes

    lib.mf_tsc.restype = ctypes.c_ulonglong
    t0, c0 = time.perf_counter(), lib.mf_tsc()
    time.sleep(seconds)
    return (lib.mf_tsc() - c0) / (time.perf_counter() - t0)


def cpu_model() -> str:
    """The CPU's name, as `memoryformer kernels` prints it."""
    from modeling_memoryformer.cpu_facts import cpu_model as model

    return model()


def cpu_flags() -> list[str]:
    """The CPU's vector features that matter for the kernels (x86 SSE4.2 ... AVX-512, AMX; aarch64 ASIMD, SVE)."""
    from modeling_memoryformer.cpu_facts import cpu_features

    return cpu_features()


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, check=False, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def command_line() -> str:
    """The command that started this process, as typed from the repository root."""
    exe = sys.executable
    try:
        rel = os.path.relpath(exe, os.getcwd())
        if not rel.startswith(".."):
            exe = rel
    except ValueError:
        pass
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    target = f"-m {spec.name}" if spec is not None and spec.name else shlex.quote(sys.argv[0])
    args = " ".join(shlex.quote(a) for a in sys.argv[1:])
    prefix = "".join(
        f"{var}={os.environ[var]} " for var in ("MEMORYFORMER_KERNEL", "MEMORYFORMER_KERNEL_MARCH") if os.environ.get(var)
    )
    return f"{prefix}{exe} {target} {args}".strip()


def fused_kernel_facts() -> dict:
    """What the fused kernel was built for and what it sees: the -march, its vector layer, the caches it plans with."""
    import torch

    from modeling_memoryformer import memory_ops

    facts = {"fused_kernel_march": os.environ.get("MEMORYFORMER_KERNEL_MARCH", "native")}
    if "fused" in memory_ops.available_kernels():
        ops = torch.ops.memoryformer
        l1, l2, l3, threads, vector_bytes = ops.machine_info()
        facts.update(fused_kernel_isa=ops.isa(), fused_kernel_vector_bytes=vector_bytes,
                     caches_bytes={"l1d": l1, "l2": l2, "l3": l3})
    return facts


def environment() -> dict:
    import torch
    import transformers

    from modeling_memoryformer import memory_ops
    from modeling_memoryformer.evaluation.kernel_report import load_kernel_timed

    # first: builds/loads the fused kernel (once per process) before anything is timed, and reports how long it took
    kernel_build_load_seconds = round(load_kernel_timed(), 3)
    dirty = _git("status", "--porcelain", "--", "modeling_memoryformer", "configuration", "pyproject.toml")
    try:
        import hashlib

        from modeling_memoryformer.memory_kernel_source import CPP_SOURCE

        kernel_source = hashlib.sha256(CPP_SOURCE.encode()).hexdigest()[:12]
    except Exception:
        kernel_source = None
    return {
        "date": datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat(),
        "command": command_line(),
        "cwd": os.getcwd(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "logical_cpus": os.cpu_count(),
        "total_memory_gb": round((total_memory_bytes() or 0) / GB, 1),
        "available_memory_gb": round(available_memory_bytes() / GB, 1),
        "kernels_available": memory_ops.available_kernels(),
        "kernel_build_load_seconds": kernel_build_load_seconds,  # one-time, not in any timing
        **fused_kernel_facts(),
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "package_dirty": bool(dirty),
        "fused_kernel_source_sha256": kernel_source,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
    }


def use_few_row_linears(model) -> list:
    """Every nn.Linear of `model` (a dense twin's LM head and weight matrices) computes as MemoryFormer's LM head does:
    the fused kernel's few-row pass for up to 4 rows without autograd (`memory_ops.few_rows_linear`), F.linear
    otherwise. Returns those linears (deleting their `forward` undoes it). On the Zen 3 measured, that pass streams a
    bf16 weight at 26-29 GB/s and F.linear's GEMV at about 15: a twin given it gets the faster of the two, so a decode
    ratio measures the bytes each architecture reads, not which kernel each one got."""
    import functools

    import torch

    from modeling_memoryformer.memory_ops import few_rows_linear

    linears = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    for module in linears:
        module.forward = functools.partial(few_rows_linear, weight=module.weight, bias=module.bias)
    return linears
