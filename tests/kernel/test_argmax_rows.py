"""The greedy token of a decode step: the fused kernel's `argmax_rows` op and `memory_ops.argmax_rows` against
torch.argmax(x, dim=-1), the oracle, on values that decide it: ties (the first index wins), NaN (the first NaN wins),
infinities, signed zeros, rows shorter than a vector and not a multiple of one, and every dtype it takes."""

from __future__ import annotations

import pytest
import torch

from conftest import require_kernel
from modeling_memoryformer import memory_ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def fused_kernel():
    require_kernel("fused")
    with memory_ops.use_kernel("fused"):
        yield


def fused(x):
    return torch.ops.memoryformer.argmax_rows(x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [1, 3, 7, 8, 9, 16, 17, 31, 100, 50304])
def test_random_rows_give_torchs_index(dtype, width):
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(width)).to(dtype)
    assert torch.equal(fused(x), torch.argmax(x, dim=-1))
    assert fused(x).dtype == torch.long


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ties_nan_infinities_and_signed_zeros_give_torchs_index(dtype):
    nan, inf = float("nan"), float("inf")
    rows = [
        [1.0, 3.0, 3.0, 2.0, 3.0] + [0.0] * 20,          # a tie: the first of them
        [0.0] * 19 + [5.0] + [0.0] * 4 + [5.0],           # a tie across vectors
        [1.0, nan, 7.0, nan] + [0.0] * 21,                # NaN is the largest: the first NaN
        [0.0] * 24 + [nan],                               # a NaN in the scalar tail
        [-inf] * 25,                                      # all -inf: index 0
        [-inf] * 12 + [inf] + [-inf] * 11 + [inf],        # +inf
        [-0.0, 0.0] + [-1.0] * 23,                        # -0 == +0: the first
        [-3.0] * 10 + [0.0, -0.0] + [-3.0] * 13,
    ]
    x = torch.tensor(rows).to(dtype)
    assert torch.equal(fused(x), torch.argmax(x, dim=-1))
    assert fused(x).tolist()[:5] == [1, 19, 1, 24, 0]


def test_memory_ops_takes_the_op_where_it_applies_and_torch_elsewhere(monkeypatch):
    calls = []
    op = torch.ops.memoryformer.argmax_rows
    monkeypatch.setattr(memory_ops, "fused_call", lambda f, *args: calls.append(f) or f(*args))
    x = torch.randn(2, 50, dtype=torch.bfloat16)
    assert torch.equal(memory_ops.argmax_rows(x), torch.argmax(x, dim=-1)) and calls == [op]
    for other in (x.t(), x.double(), x[None], x[:, :0]):  # strided, float64, 3-D, empty: torch.argmax
        if other.numel():
            assert torch.equal(memory_ops.argmax_rows(other), torch.argmax(other, dim=-1))
    assert calls == [op]
    with memory_ops.use_kernel("torch"):
        assert torch.equal(memory_ops.argmax_rows(x), torch.argmax(x, dim=-1)) and calls == [op]


def test_bad_input_is_refused_with_the_shape_and_dtype():
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16 \\[N, V\\] with V >= 1"):
        fused(torch.zeros(2, 0))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        fused(torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="linear_rows_argmax: the weight has no rows .* at least one output column"):
        torch.ops.memoryformer.linear_rows_argmax(torch.zeros(1, 8), torch.zeros(0, 8), None)
    with pytest.raises(RuntimeError, match="weight must be \\[V, D\\] with D = 8"):
        torch.ops.memoryformer.linear_rows_argmax(torch.zeros(1, 8), torch.zeros(4, 6), None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_row_split_over_the_threads_gives_torchs_index(dtype):
    """Rows of 50304 and 5000 columns, which the op splits over the threads at the few-row pass's chunks (1024 columns
    at a time, each thread a contiguous range): the largest value at a chunk's edges, tied across the split (the
    first wins), a NaN in the second half only, in both halves, and a row the first half of which is all -inf."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the split needs two threads (set here for any machine)
    try:
        check_split_rows(dtype)
    finally:
        torch.set_num_threads(threads)


def check_split_rows(dtype):
    nan, inf = float("nan"), float("inf")
    for width in (50304, 5000):
        half = (width + 1) // 2  # where at::parallel_for's two chunks meet
        rows = torch.randn(8, width, generator=torch.Generator().manual_seed(width))
        rows[0, half] = 50.0                                    # the largest is the second chunk's first value
        rows[1, half - 1] = 50.0                                # the first chunk's last value
        rows[2, 3], rows[2, half + 5] = 60.0, 60.0              # tied across the chunks: the first chunk's
        rows[3, half + 7] = nan                                 # a NaN in the second chunk only
        rows[4, half + 1], rows[4, 9] = nan, nan                # NaN in both: the first
        rows[5, :half] = -inf                                   # the first chunk all -inf
        rows[6, :] = -inf                                       # all -inf: index 0
        rows[7, width - 1] = inf                                # +inf at the end
        x = rows.to(dtype)
        got, want = fused(x), torch.argmax(x, dim=-1)
        assert torch.equal(got, want), (width, got.tolist(), want.tolist())
        assert got[:5].tolist() == [half, half - 1, 3, half + 7, 9]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_the_head_pass_with_its_argmax_gives_linear_rows_bits_and_torchs_index(dtype, rows):
    """`linear_rows_argmax`: the few-row pass's logits, bit for bit, and torch.argmax of them, each thread taking the
    argmax of the outputs it just stored: on 1, 2 and 3 threads, over a vocabulary of several chunks, with a bias
    that puts the largest value at the second chunk's first column, ties across the chunks (1e30 absorbs x W), NaN
    in both halves, all -inf, and +inf at the end."""
    g = torch.Generator().manual_seed(rows)
    V, D = 5000, 72  # D not a multiple of a vector: the ragged tail too
    half = V // 2
    x, w = torch.randn(rows, D, generator=g).to(dtype), torch.randn(V, D, generator=g).to(dtype)
    biases = [None, torch.zeros(V), torch.zeros(V), torch.zeros(V), torch.full((V,), float("-inf")), torch.zeros(V)]
    biases[1][half] = 1e4
    biases[2][3], biases[2][half + 5] = 1e30, 1e30
    biases[3][half + 1], biases[3][9] = float("nan"), float("nan")
    biases[5][V - 1] = float("inf")
    op, plain = torch.ops.memoryformer.linear_rows_argmax, torch.ops.memoryformer.linear_rows
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            for b in biases:
                b = None if b is None else b.to(dtype)
                y, tokens = op(x, w, b)
                bits = torch.int32 if dtype == torch.float32 else torch.int16  # NaN's bits compared too
                assert torch.equal(y.view(bits), plain(x, w, b).view(bits)) and y.dtype == dtype
                assert tokens.dtype == torch.long and torch.equal(tokens, torch.argmax(y, dim=-1)), (n, tokens)
    finally:
        torch.set_num_threads(threads)
    assert op(x, w, biases[1].to(dtype))[1].tolist() == [half] * rows
    assert op(x, w, biases[3].to(dtype))[1].tolist() == [9] * rows


def test_memory_ops_gives_the_logits_and_tokens_where_the_head_pass_applies():
    """few_rows_linear_argmax: (few_rows_linear, argmax_rows) of a [batch, 1, D] hidden state in one call where the
    few-row pass applies; None elsewhere (the caller runs the two)."""
    g = torch.Generator().manual_seed(0)
    hidden, w = torch.randn(3, 1, 64, generator=g).bfloat16(), torch.randn(3000, 64, generator=g).bfloat16()
    logits, tokens = memory_ops.few_rows_linear_argmax(hidden, w)
    assert torch.equal(logits, memory_ops.few_rows_linear(hidden, w)) and logits.shape == (3, 1, 3000)
    assert torch.equal(tokens, torch.argmax(logits, dim=-1)) and tokens.shape == (3, 1)
    for args in ((hidden.double(), w.double()), (torch.randn(5, 64).bfloat16(), w), (hidden, w.float()),
                 (hidden, w.t().contiguous().t())):
        assert memory_ops.few_rows_linear_argmax(*args) is None
    with memory_ops.use_kernel("torch"):
        assert memory_ops.few_rows_linear_argmax(hidden, w) is None
    from modeling_memoryformer.memory_backend_torch import TORCH_BACKEND

    y, t = TORCH_BACKEND.linear_rows_argmax(hidden[:, 0], w, None)
    assert torch.equal(t, torch.argmax(y, dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_late_thread_leaves_its_rows_to_the_others_with_the_same_logits_and_tokens(dtype):
    """The few-row pass balances its threads as they run: each starts with a contiguous share of the weight's rows,
    taken piece by piece, and a thread whose share is done takes the pieces left at the back of another's. With one
    thread held back (`linear_rows_balance`, a test setting), the others take its pieces; the logits keep their bits
    and the tokens are torch.argmax's, with the largest value, ties, NaN and -inf placed at piece edges of both the
    late thread's share and the others'."""
    D = 64
    piece = max(8, (256 << 10) // (D * torch.empty((), dtype=dtype).element_size()) // 8 * 8)
    V = 20 * piece + 37  # 21 pieces, the last ragged
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(2, D, generator=g).to(dtype), torch.randn(V, D, generator=g).to(dtype)
    nan, inf = float("nan"), float("inf")
    biases = [torch.zeros(V) for _ in range(6)]
    biases[0][piece] = 1e4                                   # a piece's first row, in the first share
    biases[1][V - piece - 37] = 1e4                          # the last whole piece's first row
    biases[2][piece - 1], biases[2][V - 1] = 1e30, 1e30      # tied: the first
    biases[3][V - 2], biases[3][2 * piece] = nan, nan        # NaN in both shares: the first
    biases[4][: V // 2] = -inf                               # the first half all -inf
    biases[5][:] = -inf                                      # all -inf: index 0
    op, balance = torch.ops.memoryformer.linear_rows_argmax, torch.ops.memoryformer.linear_rows_balance
    threads = torch.get_num_threads()
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    try:
        for n in (2, 3):
            torch.set_num_threads(n)
            for b in biases:
                b = b.to(dtype)
                balance(-1, 0)
                y0, t0 = op(x, w, b)
                assert torch.equal(t0, torch.argmax(y0, dim=-1)), (n, t0)
                for late in range(n):
                    for _ in range(3):  # the others must finish their shares while it sleeps (a busy host: again)
                        balance(late, 200_000)
                        y, t = op(x, w, b)
                        if balance(-1, 0) > 0:
                            break
                    assert balance(-1, 0) > 0, f"no piece was taken from the late thread {late} of {n}"
                    assert torch.equal(y.view(bits), y0.view(bits)) and torch.equal(t, t0), (n, late, t, t0)
    finally:
        balance(-1, 0)
        torch.set_num_threads(threads)
    torch.set_num_threads(1)
    try:
        balance(0, 200_000)  # one thread: no split, no delay
        assert torch.equal(op(x, w, biases[0].to(dtype))[1], torch.tensor([piece, piece]))
        assert balance(-1, 0) == 0
    finally:
        balance(-1, 0)
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="slot must be >= -1"):
        balance(-2, 0)


@pytest.mark.parametrize("shape", [(768, 3072), (1024, 4096), (512, 1024)], ids=str)
def test_a_weight_of_few_rows_and_many_pieces_is_split_over_the_threads(shape):
    """The few-row pass splits a weight by its pieces (256 KB each), however few its rows: a dense model's down
    projection ([768, 3072] bfloat16: 18 pieces) ran on one thread under a rule of 1024 rows per thread. With the
    second thread held back, the first takes pieces of its share; the output is F.linear's."""
    V, D = shape
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(1, D, generator=g).to(torch.bfloat16), torch.randn(V, D, generator=g).to(torch.bfloat16)
    b = torch.randn(V, generator=g).to(torch.bfloat16)
    op, balance = torch.ops.memoryformer.linear_rows_argmax, torch.ops.memoryformer.linear_rows_balance
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        balance(-1, 0)
        for _ in range(3):  # the first thread must finish its share while the second sleeps (a busy host: again)
            balance(1, 200_000)
            y, t = op(x, w, b)
            if balance(-1, 0) > 0:
                break
        assert balance(-1, 0) > 0, f"no piece of the second thread's share was taken: {shape} ran on one thread"
    finally:
        balance(-1, 0)
        torch.set_num_threads(threads)
    want = torch.nn.functional.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=2e-2)
    assert torch.equal(t, torch.argmax(y, dim=-1))
