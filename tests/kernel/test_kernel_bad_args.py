"""The fused kernel's ops never crash on bad arguments.

Every op gets a table of malformed calls (wrong dims and dtypes, mismatched rows / scores / tables (float or the int8
block) / bias / grad_out, rows out of range or in another table's range, bad rows_per_table, hash_bits, temperatures
and strategies, cache sizes and plan arguments) and of valid edge cases (0 tokens, other dtypes). The calls of one op group run in one child
process (_kernel_bad_args_worker.py) that prints each call's name before making it, so a crash (SIGSEGV, SIGFPE,
abort) fails the test naming the call that killed it; the group is then run again without the calls already made, so
one test run finds every crash. A malformed call must raise (TORCH_CHECK's RuntimeError, or ValueError / IndexError);
a valid one must return the right result; a few calls (non-contiguous operands, an infinite temperature, degenerate
shapes) may do either, but must not crash nor return a wrong result.

The Python entry point `memory_lookup` raises the same ValueError on both kernels for a bad temperature or bias.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch

from modeling_memoryformer import memory_ops

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_kernel_bad_args_worker.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GROUPS = ("hash", "hash_backward", "lookup", "lookup_strategy", "lookup_backward", "int8_lookup", "planning",
          "linear_rows", "table_steps")


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (exit {code})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def run_group(group: str, max_runs: int = 25) -> tuple[list[dict], list[str], bool]:
    """Run the group's calls in child processes until every call has run or crashed.

    Returns (outcomes of the calls that finished, one line per crash, whether the kernel is unavailable)."""
    outcomes: list[dict] = []
    crashes: list[str] = []
    skip: list[str] = []
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for _ in range(max_runs):
        proc = subprocess.run([sys.executable, WORKER, group, *skip], check=False, capture_output=True, text=True,
                              timeout=900, cwd=REPO, env=env)
        started = None
        for line in proc.stdout.splitlines():
            if line.startswith("UNAVAILABLE"):
                return [], [], True
            if line.startswith("MISSING "):
                return [], [f"{group}: the kernel has no op {', '.join(line.split()[1:])} (every op has a group here)"], False
            if line.startswith("CALL "):
                started = line[5:]
            elif line.startswith("DONE "):
                outcome = json.loads(line[5:])
                outcomes.append(outcome)
                skip.append(outcome["name"])
                started = None
        if proc.returncode == 0 and started is None:
            return outcomes, crashes, False
        stderr = [line for line in proc.stderr.strip().splitlines() if not line.startswith("MemoryFormer: loading")]
        tail = " | ".join(stderr[-3:])
        if started is None:  # died outside a call (setup, or at exit): nothing more to learn by rerunning
            crashes.append(f"{group}: the worker died outside any call, {_describe_exit(proc.returncode)}: {tail}")
            return outcomes, crashes, False
        crashes.append(f"{group}/{started}: CRASH, {_describe_exit(proc.returncode)} {tail}".rstrip())
        skip.append(started)
    crashes.append(f"{group}: gave up after {max_runs} crashed runs")
    return outcomes, crashes, False


def problems_of(group: str, outcomes: list[dict]) -> list[str]:
    problems = []
    for o in outcomes:
        name, expect, outcome, detail = f"{group}/{o['name']}", o["expect"], o["outcome"], o["detail"]
        if outcome == "raised-other":
            problems.append(f"{name}: raised an unexpected exception type: {detail}")
        elif expect == "raise" and outcome != "raised":
            problems.append(f"{name}: malformed call did not raise ({outcome}{': ' + detail if detail else ''})")
        elif expect == "ok" and outcome != "returned":
            problems.append(f"{name}: valid call {outcome}: {detail}")
        elif expect == "either" and outcome == "wrong":
            problems.append(f"{name}: returned a wrong result: {detail}")
    return problems


@pytest.mark.slow
@pytest.mark.parametrize("group", GROUPS)
def test_the_ops_reject_malformed_calls_without_crashing(group):
    outcomes, crashes, unavailable = run_group(group)
    if unavailable:
        pytest.skip("the fused CPU kernel is not built in this environment")
    problems = crashes + problems_of(group, outcomes)
    assert outcomes or problems, f"no call of {group} ran"
    assert not problems, f"{len(problems)} of the {group} calls misbehave:\n" + "\n".join(problems)


# ---------------------------------------------------------------------------------------------------------------------
# The Python entry point, on both kernels


@pytest.fixture(params=["fused", "torch"])
def kernel(request):
    if request.param not in memory_ops.available_kernels():
        pytest.skip(f"the {request.param!r} kernel is not available here")
    with memory_ops.use_kernel(request.param):
        yield request.param


@pytest.mark.parametrize("temperature", [0.0, -1.0, math.nan, -math.inf, math.inf])  # finite and > 0, as the config
def test_memory_lookup_rejects_a_bad_temperature_on_both_kernels(kernel, temperature):
    x, tables, bias = torch.randn(8, 16), torch.randn(64, 64), torch.zeros(64)
    with pytest.raises(ValueError, match=r"temperature must be a finite number > 0, got"):
        memory_ops.memory_lookup(x, tables, bias, 4, temperature=temperature)
    with pytest.raises(ValueError, match=r"temperature must be a finite number > 0, got"):
        memory_ops.memory_lookup(x, tables, bias, 4, score="l1", temperature=temperature)


@pytest.mark.parametrize("bias", [torch.zeros(1), torch.zeros(63), torch.zeros(65), torch.zeros(1, 64),
                                  torch.tensor(0.0), torch.zeros(64, dtype=torch.long)],
                         ids=["length 1", "one short", "one long", "2-D", "0-D", "int64"])
def test_memory_lookup_rejects_a_bias_of_the_wrong_shape_or_dtype_on_both_kernels(kernel, bias):
    x, tables = torch.randn(8, 16), torch.randn(64, 64)
    with pytest.raises(ValueError, match=r"bias must be a floating-point vector of out_features=64 values.*"
                                         r"Pass a bias of shape \[64\], or None"):
        memory_ops.memory_lookup(x, tables, bias, 4)


def test_memory_lookup_agrees_on_both_kernels_for_valid_edge_cases():
    kernels = memory_ops.available_kernels()
    x, tables, bias = torch.randn(2, 3, 16), torch.randn(64, 64), torch.randn(64)
    cases = [(x, bias, 1.0), (x, None, 0.5), (x[:, :0], bias, 1.0), (x, bias.double(), 1.0), (x, bias, 1e30)]
    for xs, b, t in cases:
        want = memory_ops.memory_lookup_reference(xs, tables, b, 4, temperature=t)
        for name in kernels:
            with memory_ops.use_kernel(name):
                got = memory_ops.memory_lookup(xs, tables, b, 4, temperature=t)
            assert got.shape == want.shape, (name, t)
            torch.testing.assert_close(got, want.to(got.dtype), atol=1e-5, rtol=1e-5, msg=f"{name}, t={t}")
