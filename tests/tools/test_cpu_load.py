"""evaluation/cpu_load.py: the CPU other processes use while something is timed (the busy flag of the demo's and the
benchmarks' speed rows), against a process the test starts itself."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from modeling_memoryformer.evaluation.cpu_load import LoadMeter, cpu_snapshot, other_cores_since, other_cpu_since

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc/stat (Linux)")

SPIN = "import time\nend = time.perf_counter() + 3\nwhile time.perf_counter() < end:\n    pass\n"


def test_a_spinning_process_shows_as_about_one_core_of_others():
    spinner = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        time.sleep(0.3)  # the interpreter has started and spins
        before = cpu_snapshot()
        time.sleep(1.0)  # this process sleeps: the busy time is the spinner's (and whatever else runs)
        cores = other_cores_since(before)
    finally:
        spinner.kill()
        spinner.wait()
    assert cores is not None and 0.7 <= cores <= os.cpu_count() + 0.1, cores


@pytest.mark.slow
def test_this_process_own_work_is_not_counted_as_others():
    def others(spin: bool) -> float:
        before = cpu_snapshot()
        end = time.perf_counter() + 1.0
        while spin and time.perf_counter() < end:  # one core of our own
            pass
        time.sleep(0 if spin else 1.0)
        wall, other = other_cpu_since(before)
        assert wall == pytest.approx(1.0, abs=0.3)
        return other / wall

    idle, spinning = others(spin=False), others(spin=True)
    # counted as another process's, our own core would add about 1.0 on a machine with a core to spare
    assert spinning < idle + 0.5, (idle, spinning)


def test_load_meter_sums_intervals_and_keeps_the_busiest_window():
    """Synthetic intervals (wall, other CPU seconds) against sums done by hand: 5 s windows of measured time."""
    meter = LoadMeter(window_seconds=5.0)
    for wall, other in ((2, 0), (2, 4), (2, 0), (1, 2)):  # a window of 6 s with 4 CPU s, then 1 s with 2
        meter.add(wall, other)
    assert meter.other_cores == pytest.approx(6 / 7)
    assert meter.windows == [pytest.approx(4 / 6)]  # the last second is under half a window: not a window of its own
    summary = meter.summary(threshold=0.25)
    assert summary == {"seconds": 7.0, "other_cores": round(6 / 7, 3), "max_other_cores": round(4 / 6, 3),
                       "busy": True, "threshold": 0.25}
    meter.add(2, 6)  # 3 s with 8 CPU s: at least half a window, so it counts as the busiest
    assert meter.summary()["max_other_cores"] == pytest.approx(8 / 3, abs=1e-3)
    quiet = LoadMeter()
    quiet.add(3, 0.03)
    assert quiet.summary(threshold=0.25)["busy"] is False
    assert quiet.summary()["max_other_cores"] == pytest.approx(0.01)  # the mean: under one window in all
    both = LoadMeter.combined([meter, quiet])
    assert both.wall_seconds == 12 and both.other_cpu_seconds == pytest.approx(12.03)
    assert both.summary()["max_other_cores"] == pytest.approx(8 / 3, abs=1e-3)
    assert LoadMeter().summary()["other_cores"] is None  # nothing measured: unknown, not quiet


def test_load_meter_without_proc_stat_is_unknown(monkeypatch):
    from modeling_memoryformer.evaluation import cpu_load

    monkeypatch.setattr(cpu_load, "cpu_snapshot", lambda: None)
    meter = LoadMeter()
    with meter.measure():
        pass
    assert meter.summary() == {"seconds": 0.0, "other_cores": None, "max_other_cores": None, "busy": None,
                               "threshold": 0.25}


@pytest.mark.slow
def test_load_meter_sees_a_spinning_process_only_in_the_intervals_it_measures():
    """Intervals measured while another process spins a core read about one core of others; the gaps between them,
    where this process spins itself (its own CPU is never another's), are not measured at all."""
    spinner = subprocess.Popen([sys.executable, "-c", SPIN])
    meter = LoadMeter(window_seconds=0.5)
    try:
        time.sleep(0.3)  # the interpreter has started and spins
        for _ in range(3):
            with meter.measure():
                time.sleep(0.4)
            end = time.perf_counter() + 0.2
            while time.perf_counter() < end:
                pass
    finally:
        spinner.kill()
        spinner.wait()
    summary = meter.summary()
    assert summary["seconds"] == pytest.approx(1.2, abs=0.3)
    assert 0.7 <= summary["other_cores"] <= os.cpu_count() + 0.1 and summary["busy"], summary
