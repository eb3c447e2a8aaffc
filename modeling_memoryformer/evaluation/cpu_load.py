"""How busy the machine was while something was timed: CPU used by other processes, from /proc/stat.

On a machine of a few cores, one busy core slows every parallel op of torch's thread pool, so a timing means little
without the load beside it. Other processes' CPU = (busy jiffies of the whole machine, steal included) - (this
process's own CPU time, children included). Standard library only; None or zeros where /proc/stat is missing.
"""

from __future__ import annotations

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
