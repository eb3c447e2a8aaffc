"""Sparse table gradients (`MemoryLayer(sparse=True)`, `MemoryFormerConfig(sparse_table_gradients=True)`).

Oracle: the dense one-hot formulation in float64. For hashed rows R [N, K] and scores S [N, K], the layer is
y = A @ T + b with A[n, R[n, k]] = S[n, k] (an [N, rows] matrix built by scatter), so the table gradient is A^T @ g;
its nonzero rows are exactly the distinct rows hit, whose set comes from the reference hash (`hash_codes`).
"""

from __future__ import annotations

import pytest
import torch

from conftest import require_kernel, tiny_config
from modeling_memoryformer import MemoryFormerConfig, MemoryFormerForCausalLM, MemoryLayer, memory_ops

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def one_hot(rows: torch.Tensor, scores: torch.Tensor, num_rows: int) -> torch.Tensor:
    a = torch.zeros(rows.shape[0], num_rows, dtype=torch.float64)
    return a.scatter_add_(1, rows, scores.double())


def layer_pair(dtype, d_in=64, d_out=40, hash_bits=4, seed=0):
    torch.manual_seed(seed)
    dense = MemoryLayer(d_in, d_out, hash_bits, dtype=dtype)
    sparse = MemoryLayer(d_in, d_out, hash_bits, sparse=True, dtype=dtype)
    sparse.load_state_dict(dense.state_dict())
    return dense, sparse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [1, 7, 300])  # 300 tokens: more than the 16 rows of a table, so rows repeat
def test_sparse_layer_gradients_equal_the_float64_oracle(kernel, dtype, n):
    dense, sparse = layer_pair(dtype)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 64, generator=g).to(dtype)
    grad_y = torch.randn(n, 40, generator=g).to(dtype)
    results = []
    for layer in (dense, sparse):
        xr = x.clone().requires_grad_(True)
        y = layer(xr)
        results.append((y, *torch.autograd.grad((y.float() * grad_y.float()).sum(), [xr, layer.tables, layer.bias])))
    (y0, gx0, gt0, gb0), (y1, gx1, gt1, gb1) = results
    assert gt1.layout == torch.sparse_coo and not gt0.is_sparse
    assert gt1.dtype == dtype and gt1.shape == sparse.tables.shape
    # the same forward and input / bias gradients as the dense layer (same kernels, same order of sums)
    assert torch.equal(y0, y1)
    tol = TOL[dtype]
    assert torch.allclose(gx0.float(), gx1.float(), rtol=tol, atol=tol * float(gx0.abs().max()))
    assert torch.equal(gb0, gb1)
    # the table gradient against the oracle, and its rows are exactly the rows hit
    rows = memory_ops.table_rows(memory_ops.hash_codes(x, 4), 4)
    scores = memory_ops.hash_scores(x.float(), 4)
    a = one_hot(rows, scores, sparse.tables.shape[0])
    expected = a.T @ grad_y.double()
    scale = a.abs().T @ grad_y.double().abs()
    assert ((gt1.to_dense().double() - expected).abs() <= tol * scale + 1e-30).all()
    hit = torch.unique(rows)
    coalesced = gt1.coalesce()
    assert torch.equal(coalesced.indices()[0], hit)
    if kernel == "fused":  # the kernel's gradient is coalesced as made: one entry per row hit, ascending
        assert gt1.is_coalesced() and torch.equal(gt1.indices()[0], hit)


def test_lookup_backward_rows_op_equals_the_one_hot_transposes():
    require_kernel("fused")
    ops = torch.ops.memoryformer
    g = torch.Generator().manual_seed(3)
    # below half a lookup per row (2 n < p) the per-row pass, with rows hit twice or more among 40 tokens of 64 rows;
    # from there the dense backward and its rows hit
    for n, k, p, d, dtype in [(0, 3, 8, 16, torch.float32), (1, 3, 8, 16, torch.float32), (40, 3, 96, 40, torch.float32),
                              (30, 4, 256, 33, torch.bfloat16), (50, 4, 8, 33, torch.float32),
                              (400, 2, 16, 70, torch.bfloat16), (64, 5, 4, 300, torch.float16)]:
        rows = (torch.randint(0, p, (n, k), generator=g) + torch.arange(k) * p).contiguous()
        scores = torch.rand(n, k, generator=g) + 0.1
        tables = torch.randn(k * p, d, generator=g).to(dtype)
        grad = torch.randn(n, d, generator=g)
        gs, hit, values = ops.lookup_backward_rows(grad, rows, scores, tables, p, True)
        a = one_hot(rows, scores, k * p)
        assert torch.equal(hit, torch.unique(rows))
        if n == 40:
            assert hit.numel() < n * k  # rows hit more than once: their gradients are sums
        assert values.dtype == dtype and values.shape == (hit.numel(), d)
        expected = (a.T @ grad.double())[hit]
        scale = (a.abs().T @ grad.double().abs())[hit]
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert ((values.double() - expected).abs() <= tol * scale + 1e-30).all()
        expected_scores = (grad.double() @ tables.double().T).gather(1, rows)
        scores_scale = grad.double().abs() @ tables.double().abs().T
        assert ((gs.double() - expected_scores).abs() <= 1e-5 * scores_scale.gather(1, rows) + 1e-30).all()
        none, _, _ = ops.lookup_backward_rows(grad, rows, scores, tables, p, False)
        assert none is None


def test_lookup_backward_rows_refuses_what_it_cannot_take():
    require_kernel("fused")
    ops = torch.ops.memoryformer
    rows = torch.tensor([[0, 9]])
    scores = torch.ones(1, 2)
    with pytest.raises(RuntimeError, match="float64 tables take the dense backward"):
        ops.lookup_backward_rows(torch.ones(1, 4), rows, scores, torch.zeros(16, 4, dtype=torch.float64), 8, True)
    with pytest.raises(RuntimeError, match=r"grad_out must be \[N, D\] = \[1, 4\]"):
        ops.lookup_backward_rows(torch.ones(2, 4), rows, scores, torch.zeros(16, 4), 8, True)
    with pytest.raises(RuntimeError, match=r"rows\[:, 1\] must index table 1"):
        ops.lookup_backward_rows(torch.ones(1, 4), torch.tensor([[0, 3]]), scores, torch.zeros(16, 4), 8, True)


def test_a_sparse_model_trains_like_the_dense_one_with_sparse_adam(kernel):
    """Same weights, same batch: the sparse model's loss, dense-parameter gradients and (densified) table gradients
    equal the dense model's; a SparseAdam step on the tables then moves only the rows hit."""
    torch.manual_seed(0)
    dense = MemoryFormerForCausalLM(tiny_config()).train()
    sparse = MemoryFormerForCausalLM(tiny_config(sparse_table_gradients=True)).train()
    sparse.load_state_dict(dense.state_dict())
    ids = torch.randint(0, dense.config.vocab_size, (2, 6))
    for model in (dense, sparse):
        model(input_ids=ids, labels=ids).loss.backward()
    for (name, p0), (_, p1) in zip(dense.named_parameters(), sparse.named_parameters()):
        if name.endswith("tables"):
            assert p1.grad.is_sparse and not p0.grad.is_sparse, name
            assert torch.allclose(p1.grad.to_dense(), p0.grad, rtol=1e-4, atol=1e-7), name
        else:
            assert not p1.grad.is_sparse
            assert torch.allclose(p1.grad, p0.grad, rtol=1e-4, atol=1e-7), name
    tables = [p for n, p in sparse.named_parameters() if n.endswith("tables")]
    before = [t.detach().clone() for t in tables]
    torch.optim.SparseAdam(tables, lr=1e-2).step()
    for t, b in zip(tables, before):
        moved = (t.detach() != b).any(dim=1)
        grad = t.grad.coalesce()
        assert moved.any()
        # the rows hit with a nonzero gradient (the last position has no label: rows only it hit get zeros)
        assert torch.equal(moved.nonzero().flatten(), grad.indices()[0][grad.values().abs().amax(dim=1) > 0])


def test_sparse_table_gradients_is_a_checked_saved_config_field(tmp_path):
    with pytest.raises(ValueError, match="sparse_table_gradients must be True or False, got 'yes'"):
        MemoryFormerConfig(sparse_table_gradients="yes")
    with pytest.raises(ValueError, match="sparse must be True or False"):
        MemoryLayer(8, 8, 4, sparse=1)
    tiny_config(sparse_table_gradients=True).save_pretrained(tmp_path)
    assert MemoryFormerConfig.from_pretrained(tmp_path).sparse_table_gradients is True
    model = MemoryFormerForCausalLM(tiny_config(sparse_table_gradients=True))
    assert all(m.sparse for m in model.modules() if isinstance(m, MemoryLayer))
    assert "sparse=True" in repr(model)


def test_lookup_backward_rows_passes_opcheck():
    """Schema, fake (data-dependent row count) and dispatch of the new op, as torch.library checks them."""
    require_kernel("fused")
    ops = torch.ops.memoryformer
    rows = torch.tensor([[0, 9], [1, 9], [0, 12]])
    scores, tables, grad = torch.rand(3, 2), torch.randn(16, 5), torch.randn(3, 5)
    result = torch.library.opcheck(ops.lookup_backward_rows, (grad, rows, scores, tables, 8, True))
    assert set(result.values()) == {"SUCCESS"}, result
