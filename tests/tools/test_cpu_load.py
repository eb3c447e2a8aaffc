"""evaluation/cpu_load.py: the CPU other processes use while something is timed (the busy flag of the demo's and the
benchmarks' speed rows), against a process the test starts itself."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from modeling_memoryformer.evaluation.cpu_load import cpu_snapshot, other_cores_since, other_cpu_since

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
