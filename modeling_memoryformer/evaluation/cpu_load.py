"""How busy the machine was while something was timed: CPU used by other processes, from /proc/stat, and a
memory-stream probe for what /proc/stat cannot see.

On a machine of a few cores, one busy core slows every parallel op of torch's thread pool, so a timing means little
without the load beside it. Other processes' CPU = (busy jiffies of the whole machine, steal included) - (this
process's own CPU time, children included). Standard library only at import (torch is imported by the probe); None or
zeros where /proc/stat is missing. `LoadMeter` sums it over a phase of a longer run (the demo's training, evaluation
and speed rows), so that a report can say which of its timings other processes slowed.
"""

from __future__ import annotations

import functools
import math
import os
import time

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
NOISY_CORES = 0.25  # timings taken while others used more than this many cores on average are flagged as busy


def cpu_snapshot() -> tuple[float, float, float] | None:
    """(monotonic time, machine busy CPU seconds, own CPU seconds) or None where /proc/stat is missing."""
    import resource

    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait; user, nice, system, irq, softirq, steal
    own = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        own += usage.ru_utime + usage.ru_stime
    return time.monotonic(), busy / _CLK_TCK, own


def other_cpu_since(before) -> tuple[float, float]:
    """(wall seconds, CPU seconds used by other processes) since `before` = cpu_snapshot()."""
    after = cpu_snapshot()
    if before is None or after is None:
        return 0.0, 0.0
    wall = after[0] - before[0]
    other = (after[1] - before[1]) - (after[2] - before[2])
    return wall, max(0.0, other)


def other_cores_since(before) -> float | None:
    """Average number of cores other processes kept busy since `before` = cpu_snapshot() (None without /proc)."""
    wall, other = other_cpu_since(before)
    return round(other / wall, 3) if wall > 0 else None


# The other guests of a shared host (a VM's neighbours) do not show in this guest's /proc/stat, but their memory
# traffic slows what streams tables from L3 and DRAM (the Memory Layer, the optimizer step over its tables) far more
# than what computes from registers (nn.Linear): on a 2-vCPU AMD EPYC guest the same bf16 lookup took 1.9x as long at
# one hour as at another while nn.Linear took 1.3x, with 0.01 cores of other processes in the guest. A short stream
# over a buffer four times the size of a 32 MB L3, timed next to a measurement, records that.
STREAM_PROBE_MB = 128


# The buffer lies on transparent huge pages where a model's large weights do (`huge_pages.enabled()`: Linux in
# `madvise` mode, where from_pretrained places them): interleaved on the 2-vCPU AMD EPYC Zen 1 of docs/performance.md,
# `torch.dot` read 22-24.4 GB/s there against 17.7-22.4 on the 4 KB pages of a plain tensor (`torch.sum` 21.7-23.3
# against 17.1-18.2), so a bound measured on 4 KB pages understated what the model's memory streams by up to a
# quarter.
@functools.lru_cache(maxsize=1)
def stream_buffer():  # -> torch.Tensor; `stream_buffer.cache_clear()` gives its 128 MB back
    import torch

    from .. import huge_pages

    numel = STREAM_PROBE_MB * (1 << 20) // 4
    if not huge_pages.enabled():
        return torch.ones(numel, dtype=torch.float32)
    buffer = huge_pages.huge_page_empty((numel,), torch.float32)
    with torch.inference_mode(False), torch.no_grad():
        buffer.fill_(1.0)
    return buffer


def _best_gbps(read, nbytes: int, repeats: int, before=None) -> float:
    """GB/s of `read()` over `nbytes`, the best of `repeats` timed calls, each after `before()` (untimed) if given."""
    best = math.inf
    for _ in range(max(1, repeats)):
        if before is not None:
            before()
        start = time.perf_counter()
        read()
        best = min(best, time.perf_counter() - start)
    return round(nbytes / best / 1e9, 2)


def memory_stream_gbps(repeats: int = 3, before=None) -> float:
    """GB/s of `torch.sum` over a STREAM_PROBE_MB float32 buffer (all threads), the best of `repeats`, each after
    `before()` if given (untimed: a benchmark's cache flush of `stream_buffer()`, see memory_read_gbps)."""
    buffer = stream_buffer()
    return _best_gbps(buffer.sum, buffer.numel() * buffer.element_size(), repeats, before)


def memory_read_gbps(repeats: int = 3, before=None) -> float:
    """GB/s of `torch.dot` of the two halves of the STREAM_PROBE_MB buffer (all threads), the best of `repeats`: a
    plain streaming read of every byte once. `torch.sum`'s cascade sum reads the same buffer at 70-85% of it on the
    2-vCPU AMD EPYC Zen 1 of docs/performance.md (15-16.5 against 18.6-21 GB/s, where a hand-written AVX2 read loop
    reached 19-23.5), so a decode step's share of the read bound (benchmarks/decode_bench.py) takes the better of the
    two probes.

    `before()`, if given, runs untimed before each repeat. Read back to back, the buffer stays partly in an L3 larger
    than it (a cloud guest of a 480 MB-L3 Xeon read 38-48 GB/s on the second and third reads against 33 from DRAM), so
    a benchmark that wants DRAM's rate passes a flush of the buffer's lines (benchmarks/scatter_probe.flush_caches)."""
    import torch

    buffer = stream_buffer()
    half = buffer.numel() // 2
    first, second = buffer[:half], buffer[half:2 * half]
    return _best_gbps(lambda: torch.dot(first, second), 2 * half * buffer.element_size(), repeats, before)



class LoadMeter:
    """Other processes' CPU over one phase of a longer run (the demo's training, its evaluations, its speed rows):
    the sum of the intervals between `start()` and `stop()` (or inside `with meter.measure():`), which may be many
    (every training step of a model), and the load of each stretch of about `window_seconds` of measured time.

    A phase's mean says whether its timings are the machine's; its busiest window says whether a burst hid in a quiet
    mean. Without /proc/stat every figure is None."""

    def __init__(self, window_seconds: float = 5.0):
        self.window_seconds = window_seconds
        self.wall_seconds = 0.0
        self.other_cpu_seconds = 0.0
        self.windows: list[float] = []  # cores other processes used in each complete window
        self.known = True  # False once an interval could not be read (no /proc/stat)
        self._window = (0.0, 0.0)  # wall, other CPU seconds of the window being filled
        self._open = None

    def start(self) -> None:
        self._open = cpu_snapshot()
        if self._open is None:
            self.known = False

    def stop(self) -> None:
        """Ends the interval `start()` opened (nothing when none is open)."""
        if self._open is None:
            return
        wall, other = other_cpu_since(self._open)
        self._open = None
        self.add(wall, other)

    def add(self, wall: float, other: float) -> None:
        """Adds an interval of `wall` seconds in which other processes used `other` CPU seconds."""
        if wall <= 0:
            return
        self.wall_seconds += wall
        self.other_cpu_seconds += other
        wall, other = self._window[0] + wall, self._window[1] + other
        if wall >= self.window_seconds:
            self.windows.append(other / wall)
            wall, other = 0.0, 0.0
        self._window = (wall, other)

    def measure(self):
        """A context manager: `with meter.measure(): ...` adds the block's interval."""
        import contextlib

        @contextlib.contextmanager
        def interval():
            self.start()
            try:
                yield self
            finally:
                self.stop()

        return interval()

    def _all_windows(self) -> list[float]:
        """The complete windows, and the last, unfinished one when it is at least half a window long."""
        wall, other = self._window
        return self.windows + ([other / wall] if wall >= self.window_seconds / 2 else [])

    @property
    def other_cores(self) -> float | None:
        """Mean number of cores other processes kept busy over the measured intervals (None: unknown or empty)."""
        if not self.known or self.wall_seconds <= 0:
            return None
        return self.other_cpu_seconds / self.wall_seconds

    def summary(self, threshold: float = NOISY_CORES) -> dict:
        """{"seconds", "other_cores" (mean), "max_other_cores" (the busiest window; the mean when the phase was
        shorter than half a window), "busy" (the mean above `threshold`; None when unknown), "threshold"}."""
        mean = self.other_cores
        if mean is None:
            return {"seconds": round(self.wall_seconds, 3), "other_cores": None, "max_other_cores": None,
                    "busy": None, "threshold": threshold}
        busiest = max(self._all_windows(), default=mean)
        return {"seconds": round(self.wall_seconds, 3), "other_cores": round(mean, 3),
                "max_other_cores": round(busiest, 3), "busy": mean > threshold, "threshold": threshold}

    @classmethod
    def combined(cls, meters) -> LoadMeter:
        """One meter holding the intervals of `meters` (e.g. the training steps of both models)."""
        meters = list(meters)
        total = cls(window_seconds=meters[0].window_seconds if meters else 5.0)
        for meter in meters:
            total.wall_seconds += meter.wall_seconds
            total.other_cpu_seconds += meter.other_cpu_seconds
            total.windows += meter._all_windows()
            total.known = total.known and meter.known
        return total
