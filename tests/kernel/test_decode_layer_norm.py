"""The decode ops' layer norm (`decode_layer_norm`, csrc/cpu/layer_norm.h): ATen's values, bit for bit.

Oracle: torch.nn.functional.layer_norm (nn.LayerNorm's kernel), compared bit for bit; and, for the guard, the same
in a process whose ATen runs another kernel (ATEN_CPU_CAPABILITY=default), where the kernel's own rows must not be
taken.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import require_kernel

WIDTHS = [*range(1, 70), 127, 128, 255, 256, 257, 271, 512, 640, 768, 960, 1024, 1280, 2048, 2560, 4097, 9000]


@pytest.fixture(autouse=True)
def fused_kernel():
    require_kernel("fused")


def ln(*args, **kwargs):
    return torch.ops.memoryformer.decode_layer_norm(*args, **kwargs)


def rows_apply() -> bool:
    return torch.ops.memoryformer.isa() in ("AVX2", "AVX512")


def case(width: int, rows: int, scale: float, seed: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * scale + torch.randn(rows, 1, generator=g) * 3 * scale
    weight = torch.randn(width, generator=g) * 0.5 + 1
    bias = torch.randn(width, generator=g) * 0.1
    return x.to(dtype), weight.to(dtype), bias.to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("path", ["auto", "rows", "aten"])
def test_bfloat16_rows_bit_for_bit_with_torch(path):
    if path == "rows" and not rows_apply():
        pytest.skip("the kernel's own rows are built for x86 with FMA only")
    for i, width in enumerate(WIDTHS):
        for scale in (1e-3, 1.0, 50.0):
            x, weight, bias = case(width, 7, scale, seed=i)
            for eps in (1e-5, 1e-6):
                expected = F.layer_norm(x, (width,), weight, bias, eps)
                assert same_bits(ln(x, weight, bias, eps, path), expected), (path, width, scale, eps)


def test_auto_gives_torch_values_for_other_dtypes_and_shapes():
    x, weight, bias = case(768, 3, 1.0, seed=1)
    for dtype in (torch.float32, torch.float16):
        xd, wd, bd = x.to(dtype), weight.to(dtype), bias.to(dtype)
        assert torch.equal(ln(xd, wd, bd, 1e-5), F.layer_norm(xd, (768,), wd, bd, 1e-5))
    assert same_bits(ln(x, None, None, 1e-5), F.layer_norm(x, (768,), None, None, 1e-5))   # no weight or bias
    x3 = x.reshape(1, 3, 768)
    assert same_bits(ln(x3, weight, bias, 1e-5), F.layer_norm(x3, (768,), weight, bias, 1e-5))   # 3-D
    strided = torch.cat([x, x], dim=1)[:, ::2]   # not contiguous: ATen's kernel
    assert same_bits(ln(strided, weight, bias, 1e-5), F.layer_norm(strided, (768,), weight, bias, 1e-5))
    nan = x.clone()
    nan[0, 5] = float("nan")
    assert same_bits(ln(nan, weight, bias, 1e-5), F.layer_norm(nan, (768,), weight, bias, 1e-5))


def test_rows_path_refuses_what_it_does_not_take():
    x, weight, bias = case(64, 2, 1.0, seed=2)
    with pytest.raises(RuntimeError, match="'rows' path takes contiguous bfloat16 rows"):
        ln(x.float(), weight.float(), bias.float(), 1e-5, "rows")
    with pytest.raises(RuntimeError, match="path must be 'auto', 'rows' or 'aten'"):
        ln(x, weight, bias, 1e-5, "fast")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ATEN_CPU_CAPABILITY is read at torch's start")
def test_auto_keeps_torch_values_where_aten_runs_another_kernel():
    """With ATEN_CPU_CAPABILITY=default ATen's layer norm runs its plain kernel, whose sums the kernel's rows do not
    reproduce: the first call's check must send every call to ATen."""
    script = (
        "import torch, torch.nn.functional as F\n"
        "from modeling_memoryformer.decode_layer import uses_fused\n"
        "uses_fused(torch.zeros(1))\n"
        "g = torch.Generator().manual_seed(0)\n"
        "bad = rows_differ = 0\n"
        "for width in (768, 1024, 100):\n"
        "    x = torch.randn(8, width, generator=g).bfloat16()\n"
        "    w = (torch.randn(width, generator=g) + 1).bfloat16(); b = torch.randn(width, generator=g).bfloat16()\n"
        "    ref = F.layer_norm(x, (width,), w, b, 1e-5)\n"
        "    bad += not torch.equal(torch.ops.memoryformer.decode_layer_norm(x, w, b, 1e-5).view(torch.int16),\n"
        "                           ref.view(torch.int16))\n"
        "    if torch.ops.memoryformer.isa() in ('AVX2', 'AVX512'):\n"
        "        rows = torch.ops.memoryformer.decode_layer_norm(x, w, b, 1e-5, 'rows')\n"
        "        rows_differ += not torch.equal(rows.view(torch.int16), ref.view(torch.int16))\n"
        "print(torch.backends.cpu.get_cpu_capability(), bad, rows_differ)\n"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", script], check=False, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    capability, bad, rows_differ = out.stdout.split()[-3:]
    assert capability == "DEFAULT"
    assert bad == "0"
    if rows_apply():
        assert rows_differ != "0", "the plain kernel gave the AVX2 kernel's bits: this test no longer tests the guard"
