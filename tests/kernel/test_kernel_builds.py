"""The kernel source builds for each x86-64 level and for aarch64, and each build computes the right function.

The production kernel is built with -march=native, so a run on one machine checks only its own vector layer. Here
`memory_ops.build_kernel_variant` builds the same source for -march=x86-64 (the DEFAULT layer), x86-64-v3 (AVX2) and
x86-64-v4 (AVX-512), each with its ops in a namespace of its own; a build failure fails the test. When this CPU can run
a build, its ops are checked against a float64 oracle: every forward strategy, the backward, hash and hash_backward,
on shapes around the chunk and column-block edges (see test_fused_paths.py). aarch64 is checked with a cross
compiler (syntax only). Each build takes well under a minute and is cached in the extension build root.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from modeling_memoryformer import cpu_facts, memory_backend_cpu, memory_ops
from test_fused_paths import assert_close_scaled, assert_forward_matches_oracle, hashed_inputs, one_hot_scores


ISA_OF_MARCH = {"x86-64": "DEFAULT", "x86-64-v3": "AVX2", "x86-64-v4": "AVX512"}
ON_X86 = platform.machine().lower() in ("x86_64", "amd64")
# L1d, L2, L3 given to each build (set_cache_sizes): 4096-token packed chunks, 2048-token bucketed chunks (float32
# accumulation), 256 KB packed groups, as on the 2-core EPYC the kernel was tuned on.
CACHES = (32 << 10, 1 << 20, 32 << 20)

# Slow tier (`make test` only, not `make test-fast`): each -march build and the cross-compiles take tens of seconds.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=list(ISA_OF_MARCH))
def variant(request):
    """(march, ops namespace or None when this CPU cannot run the build); the build itself must succeed."""
    march = request.param
    if not ON_X86:
        pytest.skip(f"-march={march} is an x86-64 target and this host is {platform.machine()}")
    runs = cpu_facts.cpu_can_run(march)
    namespace = memory_ops.build_kernel_variant(march, load=runs)  # raises (fails the test) when it does not build
    if not runs:
        yield march, namespace, runs
        return
    ops = getattr(torch.ops, namespace)
    ops.set_cache_sizes(*CACHES)  # the chunk lengths the shapes below are chosen around, on any machine
    try:
        yield march, namespace, runs
    finally:
        ops.set_cache_sizes(0, 0, 0)


def runnable(variant):
    march, namespace, runs = variant
    if not runs:
        pytest.skip(f"built for -march={march}, but this CPU cannot run it (its /proc/cpuinfo flags)")
    return getattr(torch.ops, namespace)


def test_variant_builds(variant):
    march, namespace, _ = variant
    assert namespace == "memoryformer_cpu_" + march.replace("-", "_")


def test_variant_reports_the_vector_layer_of_its_march(variant):
    ops = runnable(variant)
    assert ops.isa() == ISA_OF_MARCH[variant[0]]


# tokens, tables, tau, width (chunk lengths as set by CACHES): one token; two chunks of the bucketed pass (2048 + 1)
# with a ragged last 64-column block (160 = 64 + 64 + 32); two packed chunks (4100 > 4096) and three bucketed ones;
# 20 tables of 256 rows (several packed groups, the next copied while the current one is summed).
FORWARD_SHAPES = [(1, 3, 4, 32), (2049, 3, 6, 160), (4100, 2, 5, 96), (5, 20, 8, 64)]
FORWARD_CASES = [
    (strategy, dtype)
    for strategy in ("token", "embedding_bag", "packed", "bucketed")
    for dtype in (torch.float32, torch.bfloat16)  # packed: widths above are multiples of 32
]


@pytest.mark.parametrize("strategy, dtype", FORWARD_CASES, ids=str)
def test_forward_strategies_equal_one_hot_matmul(variant, strategy, dtype):
    ops = runnable(variant)
    for n, num_tables, hash_bits, out_features in FORWARD_SHAPES:
        rows, scores, tables, bias = hashed_inputs(n, num_tables, hash_bits, out_features, dtype, seed=n)
        y = ops.lookup_strategy(rows, scores, tables, bias, 2**hash_bits, strategy)
        assert_forward_matches_oracle(y, rows, scores, tables, bias, dtype)
    rows, scores, tables, bias = hashed_inputs(300, 4, 4, 96, dtype, seed=1)
    assert_forward_matches_oracle(ops.lookup(rows, scores, tables, bias, 16), rows, scores, tables, bias, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backward_equals_one_hot_transposes(variant, dtype):
    ops = runnable(variant)
    for n, num_tables, hash_bits, out_features in [(1, 3, 4, 5), (2049, 3, 6, 160), (4100, 2, 3, 200)]:
        rows, scores, tables, _ = hashed_inputs(n, num_tables, hash_bits, out_features, dtype, seed=n + 1)
        grad_y = torch.randn(n, out_features, generator=torch.Generator().manual_seed(n)).to(dtype)
        grad_scores, grad_tables = ops.lookup_backward(grad_y, rows, scores, tables, 2**hash_bits, True, True)
        s = one_hot_scores(rows, scores, tables.shape[0])
        gy = grad_y.double()
        assert grad_tables.dtype == dtype
        assert_close_scaled(grad_tables, s.T @ gy, s.abs().T @ gy.abs(), dtype)
        t = tables.double()
        assert_close_scaled(grad_scores, (gy @ t.T).gather(1, rows), (gy.abs() @ t.abs().T).gather(1, rows), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("score, temperature", [("paper", 1.0), ("l1", 0.5)])
def test_hash_and_its_backward_equal_the_float64_formulation(variant, dtype, score, temperature):
    ops = runnable(variant)
    g = torch.Generator().manual_seed(3)
    for n, in_features, hash_bits in [(1, 16, 4), (67, 48, 8), (300, 160, 5), (9, 64, 16)]:
        x = (torch.randn(n, in_features, generator=g) * 2).to(dtype)
        rows, scores = ops.hash(x, hash_bits, score, temperature)
        x64 = x.double().requires_grad_(True)
        expected_rows = memory_ops.table_rows(memory_ops.hash_codes(x64.detach(), hash_bits), hash_bits)
        expected = memory_ops.hash_scores(x64, hash_bits, score, temperature)
        assert torch.equal(rows, expected_rows)
        torch.testing.assert_close(scores.double(), expected.detach(), rtol=2e-5, atol=1e-30)

        grad_scores = torch.randn(scores.shape, generator=g).to(scores.dtype)
        (expected_grad,) = torch.autograd.grad(expected, x64, grad_scores.double())
        grad_x = ops.hash_backward(grad_scores, x, hash_bits, score, temperature)
        assert grad_x.dtype == dtype and grad_x.shape == x.shape
        rtol = 1e-4 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(grad_x.double(), expected_grad, rtol=rtol, atol=rtol * expected_grad.abs().max())


def test_few_rows_linear_equals_the_float64_product(variant):
    ops = runnable(variant)
    g = torch.Generator().manual_seed(4)
    for rows in range(1, ops.linear_rows_max() + 1):
        for out_features, in_features in [(1, 1), (7, 37), (1001, 512), (64, 48)]:  # tails below one vector, odd rows
            x = torch.randn(rows, in_features, generator=g)
            w = torch.randn(out_features, in_features, generator=g)
            b = torch.randn(out_features, generator=g)
            y = ops.linear_rows(x, w, b)
            expected = x.double() @ w.double().T + b.double()
            scale = x.double().abs() @ w.double().abs().T + b.double().abs()
            assert_close_scaled(y, expected, scale, torch.float32)


def test_decode_attention_equals_float64_attention(variant):
    ops = runnable(variant)
    g = torch.Generator().manual_seed(6)
    for (B, H, Hkv, T, D), dtype in zip([(1, 4, 4, 9, 64), (2, 6, 2, 33, 37), (3, 2, 1, 1, 5)],
                                        [torch.float32, torch.bfloat16, torch.float32]):
        q, k, v = (torch.randn(B, h, n, D, generator=g) for h, n in ((H, 1), (Hkv, T), (Hkv, T)))
        keep = torch.rand(B, 1, 1, T, generator=g) > 0.4
        keep[..., -1] = True
        out = ops.decode_attention(q.to(dtype), k.to(dtype), v.to(dtype), keep, D**-0.5)
        group = H // Hkv
        expected = torch.nn.functional.scaled_dot_product_attention(
            q.to(dtype).double(), k.to(dtype).double().repeat_interleave(group, 1),
            v.to(dtype).double().repeat_interleave(group, 1), attn_mask=keep, scale=D**-0.5).transpose(1, 2)
        tolerance = 1e-5 if dtype == torch.float32 else 2**-7
        assert out.dtype == dtype and (out.double() - expected).abs().max() <= tolerance * v.abs().max() * 2


AARCH64_CXX = "aarch64-linux-gnu-g++"


def test_the_source_compiles_for_aarch64():
    if shutil.which(AARCH64_CXX) is None:
        pytest.skip(f"{AARCH64_CXX} is not installed (Debian package g++-aarch64-linux-gnu provides it)")
    memory_ops.compile_kernel_syntax(
        AARCH64_CXX, ["-march=armv8.2-a", "-fopenmp", "-DMEMORYFORMER_OPS=memoryformer_cpu_armv8_2_a"]
    )


# The hash's two exp passes (forward scores, backward derivative) must compile to vector loops on every target. With
# AVX-512 GCC vectorises a compare-and-select through mask registers whatever the flags; on AVX2 and NEON it needs
# -fno-trapping-math, and without it both passes ran scalar (the hash took 4.2 instead of 0.69 ms for 2048 x 512
# values on an AVX2-only AMD EPYC, the largest part of the layer there) while every test passed.
KERNEL_CPP = Path(memory_ops.__file__).parent / "csrc" / "cpu" / "hash.h"  # the kernel part holding the hash


def _forward_exp_loop() -> int:
    """Line (in csrc/cpu/hash.h) of the hash's forward exp loop body: `pr[k] *= A(1) + exp_nonpos(-c * a);`."""
    lines = KERNEL_CPP.read_text().splitlines()
    return next(i for i, line in enumerate(lines) if "pr[k] *= A(1) + exp_nonpos(-c * a);" in line) + 1


def _source_through_the_hash() -> str:
    """The kernel's parts up to and including hash.h, the anonymous namespace closed: the translation unit the hash
    is compiled in, without the strategies after it (a third of the compile time of the whole source)."""
    spec = importlib.util.spec_from_file_location("generate_kernel_source",
                                                  Path(__file__).resolve().parents[2] / "scripts" / "generate_kernel_source.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    parts = gen.read_parts()
    names = [name for name, _ in parts]
    # The ops' addresses, kept by variables of external linkage: else the anonymous namespace's unused functions are
    # dropped before the vectoriser sees them.
    return gen.cpp_source(parts[: names.index("hash.h") + 1]) + (
        "}  // namespace\nauto keep_hash = &hash_op;\nauto keep_hash_backward = &hash_backward_op;\n")


def _vectorizer_report(compiler: str, flags: list[str]) -> list[tuple[int, str]]:
    """(line, message) of GCC's vectoriser report (-fopt-info-vec-all) for the kernel source built with `flags`."""
    from torch.utils.cpp_extension import include_paths

    command = [compiler, "-c", "-o", os.devnull, "-std=c++20", "-fPIC", "-DTORCH_API_INCLUDE_EXTENSION_H",
               "-DTORCH_EXTENSION_NAME=memoryformer_vec_check", *flags, "-fopt-info-vec-all"]
    for include in include_paths("cpu"):
        command += ["-isystem", include]
    result = subprocess.run(command + ["-x", "c++", "-"], input=_source_through_the_hash(), capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return [(int(line), message) for line, message in
            re.findall(r"csrc/cpu/hash\.h:(\d+):\d+: (.*)", result.stderr)]


def _hash_loops_vectorise(report: list[tuple[int, str]]) -> bool:
    """The hash's forward exp loop is vectorised (GCC reports it at its `for` or a line of its body, at most three
    lines above the marker). The backward's exp pass calls the same exp_nonpos and vectorises under the same
    condition; GCC's report names it at a neighbouring loop's line, so it is not checked by line."""
    loop = _forward_exp_loop()
    return any(loop - 3 <= line <= loop and "loop vectorized" in message for line, message in report)


# The hash's exp passes (forward scores, backward derivative) must compile to vector loops on every target. With
# AVX-512 GCC vectorises a compare-and-select through mask registers whatever the flags; on AVX2 and NEON it needs
# -fno-trapping-math, and without it these loops ran scalar (the hash took 4.2 instead of 0.69 ms for 2048 x 512
# values on an AVX2-only AMD EPYC, the largest part of the layer there) while every test passed.
@pytest.mark.parametrize("target", ["x86-64-v3", "x86-64-v4", "armv8.2-a"])
def test_the_hash_loops_vectorise_on_every_vector_target(target):
    compiler = AARCH64_CXX if target.startswith("armv8") else "g++"
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} is not installed (Debian package g++-aarch64-linux-gnu provides the aarch64 one)")
    if not target.startswith("armv8") and not ON_X86:
        pytest.skip(f"{target} is an x86-64 target and this host is {platform.machine()}")
    flags = memory_backend_cpu._kernel_flags(target)
    assert _hash_loops_vectorise(_vectorizer_report(compiler, flags)), f"-march={target}: the hash loops are scalar"
    if target == "x86-64-v3":  # the check itself sees the failure it guards against
        without = [f for f in flags if f != "-fno-trapping-math"]
        assert not _hash_loops_vectorise(_vectorizer_report(compiler, without))
