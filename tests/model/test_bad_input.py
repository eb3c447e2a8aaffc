"""Bad inputs to a Memory Layer get errors that name the problem."""

import pytest
import torch

from modeling_memoryformer import MemoryLayer


def test_hashed_rows_outside_the_tables_are_rejected():
    layer = MemoryLayer(16, 8, 4)  # 4 tables of 16 rows = 64 rows
    rows, scores = layer.hash(torch.randn(3, 16))
    with pytest.raises(ValueError, match=r"rows\[\.\.\., k\] must index table k"):
        layer(hashed=(rows + 64, scores))


def test_hashed_rows_of_the_wrong_table_are_rejected():
    """A row inside the parameter but in another column's table (e.g. columns swapped) is an error, not a lookup."""
    layer = MemoryLayer(16, 8, 4)
    rows, scores = layer.hash(torch.randn(3, 16))
    with pytest.raises(ValueError, match=r"must index table k \(rows k \* 16"):
        layer(hashed=(rows.flip(-1), scores))


def test_fused_ops_reject_rows_of_the_wrong_table_instead_of_reading_out_of_bounds():
    from conftest import require_kernel

    require_kernel("fused")  # a skip, or a failure under MEMORYFORMER_REQUIRE_FUSED=1
    ops = torch.ops.memoryformer_cpu
    tables = torch.randn(4 * 16, 32)
    rows = torch.tensor([[0, 16, 32, 48], [15, 31, 47, 63]])
    bad = rows.clone()
    bad[1, 2] = 70  # beyond the parameter
    scores = torch.ones(2, 4)
    strategies = ["token", "embedding_bag", "bucketed", "packed"]
    for op in (
        lambda r: ops.lookup(r, scores, tables, None, 16),
        *(lambda r, how=how: ops.lookup_strategy(r, scores, tables, None, 16, how) for how in strategies),
        lambda r: ops.lookup_backward(torch.ones(2, 32), r, scores, tables, 16, True, True),
    ):
        op(rows)  # valid rows work
        with pytest.raises(RuntimeError, match="must index table 2"):
            op(bad)


def test_input_of_the_wrong_width_is_rejected():
    layer = MemoryLayer(16, 8, 4)
    with pytest.raises(ValueError, match="in_features=16"):
        layer(torch.randn(3, 12))


def test_a_malformed_gradient_pool_setting_is_an_error(monkeypatch):
    from modeling_memoryformer import memory_ops

    monkeypatch.setenv("MEMORYFORMER_GRAD_POOL_MB", "16GB")
    with pytest.raises(ValueError, match="MEMORYFORMER_GRAD_POOL_MB='16GB' is not a whole number"):
        memory_ops._check_pool_setting()
    monkeypatch.setenv("MEMORYFORMER_GRAD_POOL_MB", "0")
    memory_ops._check_pool_setting()


@pytest.mark.parametrize("shape", [(1, 0), (2, 0)])
def test_an_input_without_tokens_is_a_clear_error(kernel, shape):
    """[batch, 0] ids (and the embeddings of them) raise a ValueError naming the input and its shape, on both kernels,
    instead of a reshape error from deep inside attention."""
    from conftest import tiny_model

    model = tiny_model()
    with pytest.raises(ValueError, match=r"input_ids has shape \(\d, 0\); pass at least one token"):
        model(torch.zeros(shape, dtype=torch.long))
    with pytest.raises(ValueError, match=r"inputs_embeds has shape \(\d, 0, 64\)"):
        model(inputs_embeds=torch.zeros(*shape, 64))
    assert model(torch.ones(shape[0], 1, dtype=torch.long)).logits.shape == (shape[0], 1, 128)
