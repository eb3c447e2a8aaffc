"""The op layer (memory_op_library.py): every op's schema, fake, autograd and kernels checked by
`torch.library.opcheck`, for the fused CPU kernels (torch.ops.memoryformer on CPU tensors) and for the PyTorch kernels
(the same ops defined in a namespace of their own, where no C++ registers anything); both kernels against each other
and the float64 reference; scores and strategies by name, unknown names refused by every kernel."""

from __future__ import annotations

import pytest
import torch

from conftest import require_kernel
from modeling_memoryformer import memory_ops
from modeling_memoryformer.memory_backend_torch import TORCH_BACKEND
from modeling_memoryformer.memory_op_library import OP_SCHEMAS, OPS_NAMESPACE, define_ops, namespace_ops

TORCH_ONLY = "memoryformer_opcheck_torch"  # the ops with only their PyTorch kernels: no C++ registers this namespace
define_ops(TORCH_ONLY)

N, TAU, K, D = 5, 4, 3, 8
P = 1 << TAU


def samples(score: str = "paper"):
    """(op name, args) for every op that takes tensors; inputs that can require gradients do."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, K * TAU, generator=g, requires_grad=True)
    rows = torch.stack([torch.randint(0, P, (N,), generator=g) + k * P for k in range(K)], 1)
    scores = torch.rand(N, K, generator=g, requires_grad=True)
    tables = torch.randn(K * P, D, generator=g, requires_grad=True)
    bias = torch.randn(D, generator=g, requires_grad=True)
    grad_out = torch.randn(N, D, generator=g)
    packed = torch.randint(0, 256, (K * P, D + 8), dtype=torch.uint8, generator=g)
    packed[:, D:D + 4] = torch.full((K * P,), 0.01).view(torch.uint8).view(K * P, 4)
    packed[:, D + 4:] = torch.full((K * P,), -1.0).view(torch.uint8).view(K * P, 4)
    weight = torch.randn(32, 16, generator=g)
    state = torch.rand(K * P, generator=g)
    return [
        ("hash", (x, TAU, score, 0.7)),
        ("hash_backward", (torch.randn(N, K, generator=g), x.detach(), TAU, score, 0.7)),
        ("lookup", (rows, scores, tables, bias, P)),
        ("lookup", (rows, scores, tables, None, P)),
        ("lookup_backward", (grad_out, rows, scores.detach(), tables.detach(), P, True, True)),
        ("lookup_backward_rows", (grad_out, rows, scores.detach(), tables.detach(), P, True)),
        ("int8_lookup", (rows, scores.detach(), packed, bias.detach(), P)),
        ("linear_rows", (torch.randn(2, 16, generator=g), weight, torch.randn(32, generator=g))),
        ("decode_attention", (torch.randn(2, 4, 1, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g),
                              torch.randn(2, 2, 5, 8, generator=g), torch.rand(2, 1, 1, 5, generator=g) > 0.2, 0.35)),
        ("decode_layer_norm", (torch.randn(3, 40, generator=g).bfloat16(), torch.randn(40, generator=g).bfloat16(),
                               torch.randn(40, generator=g).bfloat16(), 1e-5)),
        ("decode_layer_norm", (torch.randn(2, 1, 24, generator=g), None, None, 1e-6)),
        ("rowwise_adagrad_step", (tables.detach().clone(), torch.randn(K * P, D, generator=g), state.clone(), 0.1,
                                  1e-8, 0.01)),
        ("adam_rowwise_step", (tables.detach().clone(), torch.randn(K * P, D, generator=g),
                               torch.zeros(K * P, D), state.clone(), 3, 0.1, 0.9, 0.999, 1e-8, 0.01)),
    ]


def sample_ids():
    return [f"{name}-{i}" for i, (name, _) in enumerate(samples())]


# lookup_backward_rows returns as many rows as were hit: a data-dependent size, which the compiled-graph check of
# opcheck cannot trace without a shape environment; its schema, fake and kernel are still checked. hash returns int64
# rows first, and that check sums all outputs in place into the first one's dtype (float into int64 fails):
# test_hash_compiles_with_dynamic_shapes below does its job for hash.
DYNAMIC_OUTPUT = {"lookup_backward_rows": ("test_schema", "test_autograd_registration"),
                  "hash": ("test_schema", "test_autograd_registration", "test_faketensor")}


@pytest.fixture(scope="module")
def fused():
    require_kernel("fused")  # a skip, or a failure under MEMORYFORMER_REQUIRE_FUSED=1
    return namespace_ops(OPS_NAMESPACE)


@pytest.mark.parametrize("index", range(len(samples())), ids=sample_ids())
@pytest.mark.parametrize("score", ["paper", "l1"])
def test_opcheck_fused_cpu_kernels(fused, index, score):
    name, args = samples(score)[index]
    kwargs = {"test_utils": DYNAMIC_OUTPUT[name]} if name in DYNAMIC_OUTPUT else {}
    torch.library.opcheck(getattr(fused, name), args, **kwargs)


@pytest.mark.parametrize("index", range(len(samples())), ids=sample_ids())
@pytest.mark.parametrize("score", ["paper", "l1"])
def test_opcheck_pytorch_kernels(index, score):
    name, args = samples(score)[index]
    kwargs = {"test_utils": DYNAMIC_OUTPUT[name]} if name in DYNAMIC_OUTPUT else {}
    torch.library.opcheck(getattr(namespace_ops(TORCH_ONLY), name), args, **kwargs)


@pytest.mark.parametrize("namespace", [OPS_NAMESPACE, TORCH_ONLY])
def test_hash_compiles_with_dynamic_shapes(namespace):
    """hash under torch.compile (AOT autograd, dynamic shapes) equals eager, gradients included."""
    if namespace == OPS_NAMESPACE:
        require_kernel("fused")
    ops = namespace_ops(namespace)

    def f(x):
        rows, scores = ops.hash(x, TAU, "l1", 0.7)
        return rows, scores.square().sum()

    compiled = torch.compile(f, backend="aot_eager", dynamic=True, fullgraph=True)
    for tokens in (3, 6):
        x = torch.randn(tokens, K * TAU, requires_grad=True)
        rows, loss = f(x)
        (grad,) = torch.autograd.grad(loss, x)
        rows_c, loss_c = compiled(x)
        (grad_c,) = torch.autograd.grad(loss_c, x)
        assert torch.equal(rows, rows_c)
        torch.testing.assert_close(loss_c, loss)
        torch.testing.assert_close(grad_c, grad)


def _detached(args):
    return tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("index", range(len(samples())), ids=sample_ids())
@pytest.mark.parametrize("score", ["paper", "l1"])
def test_both_kernels_give_the_same_outputs(fused, index, score):
    """Same shapes and dtypes (the op's contract, which the fake states) and the same values; for the in-place
    steps, the same updated tensors."""
    name, args = samples(score)[index]
    ours, theirs = _detached(args), _detached(args)
    out_fused = getattr(fused, name)(*ours)
    out_torch = getattr(TORCH_BACKEND, name)(*theirs)
    if out_fused is None:  # in place: compare the mutated arguments
        out_fused, out_torch = ours, theirs
    flat_fused = out_fused if isinstance(out_fused, (tuple, list)) else (out_fused,)
    flat_torch = out_torch if isinstance(out_torch, (tuple, list)) else (out_torch,)
    assert len(flat_fused) == len(flat_torch)
    for a, b in zip(flat_fused, flat_torch, strict=True):
        if not isinstance(a, torch.Tensor):
            assert a == b
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_ops_equal_the_float64_reference():
    """hash then lookup, through the ops of the PyTorch-only namespace and (below) the fused ones, equals
    memory_lookup_reference in float64, gradients included."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 4 * TAU, dtype=torch.float64, generator=g, requires_grad=True)
    tables = torch.randn(4 * P, D, dtype=torch.float64, generator=g, requires_grad=True)
    for score in memory_ops.HASH_SCORES:
        want = memory_ops.memory_lookup_reference(x, tables, None, TAU, score, 0.5)
        want_grads = torch.autograd.grad(want.square().sum(), (x, tables))
        for ops in (namespace_ops(TORCH_ONLY), namespace_ops(OPS_NAMESPACE)):
            rows, scores = ops.hash(x, TAU, score, 0.5)
            got = ops.lookup(rows, scores, tables, None, P)
            grads = torch.autograd.grad(got.square().sum(), (x, tables))
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
            for a, b in zip(grads, want_grads, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("score", ["cosine", "", "L1", "paper "])
def test_an_unknown_score_is_refused_by_every_kernel(fused, score):
    x = torch.randn(N, K * TAU)
    with pytest.raises(RuntimeError, match=f"unknown score '{score}'"):
        fused.hash(x, TAU, score, 1.0)
    with pytest.raises(RuntimeError, match=f"unknown score '{score}'"):
        fused.hash_backward(torch.ones(N, K), x, TAU, score, 1.0)
    for ops in (namespace_ops(TORCH_ONLY), TORCH_BACKEND):
        with pytest.raises(ValueError, match="is not supported; choose one of 'paper', 'l1'"):
            ops.hash(x, TAU, score, 1.0)
        with pytest.raises(ValueError, match="is not supported; choose one of 'paper', 'l1'"):
            ops.hash_backward(torch.ones(N, K), x, TAU, score, 1.0)


def test_every_score_name_is_one_both_kernels_implement(fused):
    """HASH_SCORES is the one list of scores: each name runs on both kernels, with the same result."""
    x = torch.randn(N, K * TAU)
    for score in memory_ops.HASH_SCORES:
        rows_f, scores_f = fused.hash(x, TAU, score, 1.0)
        rows_t, scores_t = TORCH_BACKEND.hash(x, TAU, score, 1.0)
        assert torch.equal(rows_f, rows_t)
        torch.testing.assert_close(scores_f, scores_t)


def test_strategies_come_from_the_kernel_and_each_one_runs(fused):
    strategies = memory_ops.lookup_strategies()
    assert strategies == list(fused.lookup_strategies()) and len(strategies) == len(set(strategies)) >= 2
    g = torch.Generator().manual_seed(1)
    rows = torch.stack([torch.randint(0, P, (70,), generator=g) + k * P for k in range(K)], 1)
    scores = torch.rand(70, K, generator=g)
    tables = torch.randn(K * P, 32, generator=g)
    want = TORCH_BACKEND.lookup(rows, scores, tables, None, P)
    for strategy in ["auto", *strategies]:
        torch.testing.assert_close(fused.lookup_strategy(rows, scores, tables, None, P, strategy), want)
    with pytest.raises(RuntimeError, match="unknown strategy 'fastest' \\(use auto or one of " + ", ".join(strategies)):
        fused.lookup_strategy(rows, scores, tables, None, P, "fastest")


def test_define_ops_is_idempotent_and_refuses_other_schemas():
    # a second copy of the module (remote code) finds the ops and leaves them, and says so
    assert define_ops(TORCH_ONLY) is False
    fresh = "memoryformer_opcheck_fresh"
    assert define_ops(fresh) is True and define_ops(fresh) is False
    other = "memoryformer_opcheck_other"
    torch.library.define(f"{other}::hash", "(Tensor x, int hash_bits, bool l1, float temperature) -> (Tensor, Tensor)")
    with pytest.raises(RuntimeError, match="already defined in this process with other schemas"):
        define_ops(other)


def test_every_schema_has_a_kernel_somewhere(fused):
    """Each op of OP_SCHEMAS has the PyTorch kernel or a fused one: none is defined without an implementation."""
    for name in OP_SCHEMAS:
        qualname = f"{OPS_NAMESPACE}::{name}"
        keys = [key for key in ("CPU", "CompositeExplicitAutograd")
                if torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key)]
        assert keys, f"{qualname} has no kernel"
