"""The Triton backend (memory_backend_triton.py): its kernels against the float64 reference (forward 1e-5 relative in
float32, gradients 1e-4), on a GPU when there is one, else on CPU tensors under Triton's interpreter (conftest.py sets
TRITON_INTERPRET=1 before triton is imported). triton is a dev dependency: without it this module fails, it does not
skip. The interpreter is slow: small shapes."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  (a missing triton fails here)

from modeling_memoryformer import memory_kernels, memory_ops
from modeling_memoryformer.memory_backend_triton import TRITON_NAMESPACE, triton_ops
from modeling_memoryformer.memory_layer import MemoryLayer
from modeling_memoryformer.memory_math import memory_lookup_reference, table_rows, hash_codes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # relative to the largest output
SHAPES = [(1, 4, 2, 8), (7, 3, 5, 13), (5, 8, 2, 130), (3, 16, 1, 4)]  # tokens, tau, tables, width


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def problem(tokens, tau, tables, width, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, tables * tau, generator=g).to(DEVICE, dtype).requires_grad_()
    t = torch.randn(tables << tau, width, generator=g).to(DEVICE, dtype).requires_grad_()
    b = torch.randn(width, generator=g).to(DEVICE, dtype).requires_grad_()
    return x, t, b


@pytest.mark.parametrize("shape", SHAPES, ids=[f"N{n}-tau{t}-K{k}-D{d}" for n, t, k, d in SHAPES])
@pytest.mark.parametrize("score", memory_ops.HASH_SCORES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_forward_equals_the_float64_reference(shape, score, dtype):
    tokens, tau, tables, width = shape
    x, t, b = problem(*shape, dtype)
    ops = triton_ops()
    rows, scores = ops.hash(x, tau, score, 0.7)
    assert torch.equal(rows, table_rows(hash_codes(x.detach(), tau), tau))
    y = ops.lookup(rows, scores, t, b, 1 << tau)
    assert y.dtype == dtype and y.shape == (tokens, width)
    want = memory_lookup_reference(x.detach().double(), t.detach().double(), b.detach().double(), tau, score, 0.7)
    assert relative(y, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("shape", SHAPES[1:3], ids=["odd", "two-column-blocks"])
@pytest.mark.parametrize("score", memory_ops.HASH_SCORES)
def test_gradients_equal_the_float64_reference(shape, score):
    tau = shape[1]
    x, t, b = problem(*shape, torch.float32, seed=1)
    ops = triton_ops()
    rows, scores = ops.hash(x, tau, score, 0.7)
    y = ops.lookup(rows, scores, t, b, 1 << tau)
    grads = torch.autograd.grad(y.square().sum(), (x, t, b))
    x64, t64, b64 = (v.detach().double().requires_grad_() for v in (x, t, b))
    want = torch.autograd.grad(memory_lookup_reference(x64, t64, b64, tau, score, 0.7).square().sum(), (x64, t64, b64))
    for got, expected in zip(grads, want, strict=True):
        assert relative(got, expected) < 1e-4


def test_the_memory_layer_runs_on_triton_when_asked():
    """MEMORYFORMER_KERNEL=triton (here use_kernel): a MemoryLayer's forward and backward go through the Triton
    ops, and equal the PyTorch kernels' to float32 precision."""
    torch.manual_seed(0)
    layer = MemoryLayer(24, 10, 4).to(DEVICE)
    x = torch.randn(2, 3, 24, device=DEVICE, requires_grad=True)
    with memory_kernels.use_kernel("torch"):
        want = layer(x)
        want_grads = torch.autograd.grad(want.square().sum(), (x, layer.tables))
    with memory_kernels.use_kernel("triton"):
        assert memory_kernels.get_kernel() == "triton" and memory_kernels.backend_for(x).name == "triton"
        got = layer(x)
        got_grads = torch.autograd.grad(got.square().sum(), (x, layer.tables))
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"{TRITON_NAMESPACE}::lookup", DEVICE.upper())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("op", ["hash", "lookup"])
def test_opcheck_triton_kernels(op):
    x, t, b = problem(3, 4, 2, 8, torch.float32)
    ops = triton_ops()
    if op == "hash":  # see test_op_library: opcheck's compiled-graph check cannot sum an int64 first output
        torch.library.opcheck(ops.hash, (x, 4, "l1", 0.7),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    else:
        rows, scores = ops.hash(x.detach(), 4, "paper", 1.0)
        torch.library.opcheck(ops.lookup, (rows, scores.requires_grad_(), t, b, 16))


def test_an_unknown_score_is_refused():
    with pytest.raises(ValueError, match="is not supported"):
        triton_ops().hash(torch.randn(2, 8, device=DEVICE), 4, "cosine", 1.0)
