"""The fused CPU kernel's internal strategies, each against an independent float64 oracle.

The `lookup` op switches strategy by size (token-major gather, FBGEMM embedding_bag, the packed pass for float32,
bfloat16 and float16 tables from two lookups per row, and the bucketed pass that streams the tables once, for other
widths beyond the cache with many tokens); the backward always takes the bucketed pass, in chunks of tokens set by the caches and column
blocks of 64. Tiny layers never reach most of these branches, so this file forces each one (`lookup_strategy`, pinned
cache sizes) on shapes around its edges: token counts 1 / 2047 / 2048 / 2049 / 4100 (one to several chunks), widths
below, at and between multiples of 64 (ragged last block), several groups of packed tables, and every table dtype.

Oracle: the dense one-hot formulation in float64, y = S @ T with S[n, row] = score (an [N, R] matrix built by
scatter), so grad_T = S^T @ grad_y and grad_S = grad_y @ T^T, computed by torch.mm, not by any gather.
"""

from __future__ import annotations

import pytest
import torch

from conftest import require_kernel
from modeling_memoryformer import memory_ops


@pytest.fixture(autouse=True)
def fused_kernel():
    """Skip when the fused kernel is not built here; fail under MEMORYFORMER_REQUIRE_FUSED=1 (`make test`)."""
    require_kernel("fused")


def ops():
    return torch.ops.memoryformer


def hashed_inputs(n, num_tables, hash_bits, out_features, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    per_table = 2**hash_bits
    codes = torch.randint(0, per_table, (n, num_tables), generator=g)
    rows = codes + torch.arange(num_tables) * per_table
    scores = torch.rand(n, num_tables, generator=g) + 0.1
    tables = torch.randn(num_tables * per_table, out_features, generator=g).to(dtype)
    bias = torch.randn(out_features, generator=g).to(dtype)
    return rows.contiguous(), scores.contiguous(), tables.contiguous(), bias


def one_hot_scores(rows, scores, num_rows):
    """S [N, R] in float64 with S[n, rows[n, k]] = scores[n, k]."""
    s = torch.zeros(rows.shape[0], num_rows, dtype=torch.float64)
    return s.scatter_add_(1, rows, scores.double())


TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def assert_close_scaled(actual, expected, scale, dtype):
    """|actual - expected| <= tol * scale elementwise, scale = the same sum over absolute values."""
    assert actual.shape == expected.shape
    if actual.numel() == 0:
        return
    err = (actual.double() - expected).abs()
    bound = TOLERANCE[dtype] * (scale + 1e-30)
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"max error {err.max().item():.3g} exceeds {TOLERANCE[dtype]} x scale (ratio {worst:.2f})"


def assert_forward_matches_oracle(y, rows, scores, tables, bias, dtype):
    assert y.dtype == dtype and y.shape == (rows.shape[0], tables.shape[1])
    s = one_hot_scores(rows, scores, tables.shape[0])
    b = bias.double() if bias is not None else torch.zeros(tables.shape[1], dtype=torch.float64)
    expected = s @ tables.double() + b
    scale = s.abs() @ tables.double().abs() + b.abs()
    assert_close_scaled(y, expected, scale, dtype)


STRATEGY_DTYPES = [
    (strategy, dtype)
    for strategy in ("token", "embedding_bag", "bucketed")
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    if not (strategy == "embedding_bag" and dtype == torch.float64)  # float64 always takes the token kernel
]


@pytest.mark.parametrize("strategy, dtype", STRATEGY_DTYPES, ids=lambda v: str(v))
@pytest.mark.parametrize(
    "n, num_tables, hash_bits, out_features",
    [(1, 3, 4, 5), (37, 4, 4, 64), (2047, 2, 6, 65), (2048, 3, 4, 128), (2049, 2, 5, 130), (4100, 2, 3, 200)],
)
def test_forward_strategy_equals_one_hot_matmul(n, num_tables, hash_bits, out_features, dtype, strategy):
    rows, scores, tables, bias = hashed_inputs(n, num_tables, hash_bits, out_features, dtype)
    y = ops().lookup_strategy(rows, scores, tables, bias, 2**hash_bits, strategy)
    assert_forward_matches_oracle(y, rows, scores, tables, bias, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "n, num_tables, hash_bits, out_features",
    [(1, 64, 4, 1000), (1, 128, 2, 3072), (3, 64, 4, 1536), (2, 16, 3, 4100), (1, 48, 4, 768)],
)
def test_token_kernel_splits_columns_over_threads_with_the_same_bits(n, num_tables, hash_bits, out_features, dtype):
    """Fewer tokens than threads (a decode step): the token-major pass splits each token's columns over the threads
    (even ranges of whole vectors, the last one ragged; 768 columns, MF-small's Memory Block layer 2, in 384-column
    ranges on 2 threads, 1.5 spans of 256 under AVX-512). Each column is summed over the same rows in the same order
    whatever the split, so 1, 2, 3 and 5 threads give the same bits, and the float64 oracle holds."""
    rows, scores, tables, bias = hashed_inputs(n, num_tables, hash_bits, out_features, dtype)
    before = torch.get_num_threads()
    results = {}
    try:
        for threads in (1, 2, 3, 5):
            torch.set_num_threads(threads)
            results[threads] = ops().lookup_strategy(rows, scores, tables, bias, 2**hash_bits, "token")
    finally:
        torch.set_num_threads(before)
    assert_forward_matches_oracle(results[1], rows, scores, tables, bias, dtype)
    for threads, y in results.items():
        assert torch.equal(y, results[1]), f"{threads} threads changed the sums"


def sequential_float32_sums(start, weights, values, fused):
    """start [N, D] + sum_k weights[:, k] * values[:, k] in float32, one row at a time in table order. fused: each
    step w * v + acc rounded once (a fused multiply-add: the exact product and sum in float64, which holds a product
    of two float32 values exactly, then rounded to float32); else the product rounded before its add."""
    acc = start.clone()
    for k in range(weights.shape[1]):
        w, v = weights[:, k : k + 1], values[:, k]
        acc = (acc.double() + w.double() * v.double()).float() if fused else acc + w * v
    return acc


def one_of_the_roundings(y, start, weights, values, dtype=torch.float32) -> bool:
    """y is the row-by-row float32 sum with fused multiply-adds (what the compiler emits for a target that has them)
    or with a rounded product per add (a target without), bit for bit, rounded once to dtype."""
    return any(torch.equal(y, sequential_float32_sums(start, weights, values, fused).to(dtype)) for fused in (True, False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n, out_features", [(1, 1024), (3, 520), (2, 64)])
def test_token_kernel_sums_rows_in_order_in_float32_in_whole_and_ragged_spans(n, out_features, dtype):
    """The token-major pass sums whole spans of columns in vector registers and the ragged rest one value at a time.
    Both must give float32 sums taken row by row in table order, rounded once to the tables' dtype, bit for bit; and
    the same rounding: a column summed in the ragged span (the last 24 columns of a width 24 short of whole spans)
    has the bits it has in a whole span."""
    rows, scores, tables, bias = hashed_inputs(n, 24, 4, out_features, dtype, seed=3)
    y = ops().lookup_strategy(rows, scores, tables, bias, 16, "token")
    assert one_of_the_roundings(y, bias.float().expand(n, -1), scores.float(), tables[rows].float(), dtype)
    ragged = ops().lookup_strategy(rows, scores, tables[:, :-24].contiguous(), bias[:-24], 16, "token")
    assert torch.equal(ragged, y[:, :-24])


@pytest.mark.parametrize("num_tables", [1, 2, 3, 5, 13])
@pytest.mark.parametrize("n, out_features", [(1, 600), (3, 512), (2, 776), (2, 160), (3, 192), (1, 3072), (2, 1536),
                                             (1, 384), (2, 448), (1, 768), (1, 960), (1, 3616), (2, 3616)])
def test_token_kernel_sums_few_rows_in_narrow_units_in_order(n, out_features, num_tables):
    """A unit of at most 6 whole spans per row (spans of 256 columns with AVX-512, 64 with AVX2: the widths here give
    units of 1-7 spans under either, 6 at 3072 and 1536 columns on 1-2 threads under AVX-512, at 384 under AVX2, 7 at
    448) is summed span by span over all K rows, the rows 4 and 12 ahead prefetched: past the last row the next span's
    first rows, then the next token's, which must stay within the K rows there are when K is smaller than the
    distance. A unit's last span can be narrower than the others, summed in as many vectors as it has (600 and 960
    columns under AVX-512: 2 spans and 5 vectors, 3 spans and 12 vectors), and a wide unit sums its whole spans in
    the row-block order and its narrower rest in the span order (3616 columns: 14 spans and 2 vectors under AVX-512,
    7 spans and a vector per unit where 13 tables' rows are split over 2 threads). The float32 sums are still taken
    row by row in table order, bit for bit, on 1, 2 and 3 threads."""
    rows, scores, tables, bias = hashed_inputs(n, num_tables, 4, out_features, torch.bfloat16, seed=5)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(ops().lookup_strategy(rows, scores, tables, bias, 16, "token"))
    finally:
        torch.set_num_threads(before)
    assert one_of_the_roundings(results[0], bias.float().expand(n, -1), scores.float(), tables[rows].float(),
                                torch.bfloat16)
    assert all(torch.equal(y, results[0]) for y in results[1:])


@pytest.mark.parametrize("n, out_features", [(1, 1024), (2, 520)])
def test_int8_token_pass_sums_rows_in_order_in_float32_in_whole_and_ragged_spans(n, out_features):
    """int8 tables: the weights s_k scale_k rounded to float32, the per-token offset sum_k s_k offset_k, then
    offset + bias + sum_k w_k q_k row by row, bit for bit; a ragged span's columns have a whole span's bits."""
    g = torch.Generator().manual_seed(5)
    K, per_table = 24, 16
    rows = (torch.randint(0, per_table, (n, K), generator=g) + torch.arange(K) * per_table).contiguous()
    scores = torch.rand(n, K, generator=g) + 0.1
    tables = torch.randn(K * per_table, out_features, generator=g)
    packed = torch.ops.quantized.embedding_bag_byte_prepack(tables)
    bias = torch.randn(out_features, generator=g)
    y = ops().int8_lookup(rows, scores, packed, bias, per_table)
    codes = packed[:, :out_features].float()
    scale = packed[:, out_features : out_features + 4].contiguous().view(torch.float32)[:, 0]
    offset = packed[:, out_features + 4 :].contiguous().view(torch.float32)[:, 0]
    assert any(   # each of the two sums as the compiler contracted it (fused multiply-adds or not)
        torch.equal(y, sequential_float32_sums(
            sequential_float32_sums(torch.zeros(n, 1), scores, offset[rows].unsqueeze(-1), fused_offset) + bias,
            scores * scale[rows], codes[rows], fused))
        for fused_offset in (True, False) for fused in (True, False)
    )
    narrow = torch.cat([packed[:, : out_features - 24], packed[:, out_features:]], dim=1)   # the same rows' codes
    assert torch.equal(ops().int8_lookup(rows, scores, narrow, bias[:-24], per_table), y[:, :-24])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize(
    "n, num_tables, hash_bits, out_features",
    [
        (0, 3, 4, 32),  # no tokens
        (1, 3, 4, 32),  # fewer tokens than one step of four
        (5, 20, 8, 64),  # 20 tables of 256 rows: packed groups of 8, 8 and 4 (1 MB L2), one token after a step of four
        (3, 20, 8, 64),  # the same with no full step of four tokens
        (4099, 20, 8, 96),  # two chunks of 2050 and 2049 tokens (4096-token chunks with a 1 MB L2)
        (8195, 4, 8, 32),  # three chunks of 2732, 2732 and 2731 tokens
        (2048, 3, 10, 32),  # 1024 rows per table: groups of two
        (300, 3, 12, 64),  # 4096 rows per table: larger than one group's budget, one table per group
        (8195, 4, 8, 128),  # 16-bit tables on 32 vector registers: rows of two column blocks, two spans, 2 chunks
        (700, 9, 8, 160),  # five column blocks: 16-bit rows cannot pair, one block per row
    ],
)
def test_packed_forward_equals_one_hot_matmul(n, num_tables, hash_bits, out_features, with_bias, dtype):
    """16-bit tables are packed as 16-bit rows (twice the rows per group: other group boundaries than float32's) and
    summed in float32: the oracle is the float64 sum of the same 16-bit values, within one rounding of the output."""
    rows, scores, tables, bias = hashed_inputs(n, num_tables, hash_bits, out_features, dtype, seed=n)
    bias = bias if with_bias else None
    y = ops().lookup_strategy(rows, scores, tables, bias, 2**hash_bits, "packed")
    assert_forward_matches_oracle(y, rows, scores, tables, bias, dtype)
    if dtype != torch.float32 and n:
        # The same float32 multiply-adds in the same order (from the bias, table 0 to K - 1) as the float32 pass on
        # the widened tables, whatever the grouping, then one rounding: the same bits.
        wide = ops().lookup_strategy(rows, scores, tables.float(), None if bias is None else bias.float(),
                                     2**hash_bits, "packed")
        assert torch.equal(y, wide.to(dtype))


def test_packed_and_bucketed_passes_give_the_same_bits_on_any_number_of_threads():
    """Threads split the work by whole column blocks, each summed in a fixed order: the thread count cannot change
    a single bit of the output."""
    rows, scores, tables, bias = hashed_inputs(4099, 20, 8, 96, torch.float32, seed=5)
    before = torch.get_num_threads()
    results = {}
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results[threads] = [
                ops().lookup_strategy(rows, scores, tables, bias, 256, how) for how in ("packed", "bucketed")
            ]
    finally:
        torch.set_num_threads(before)
    for threads in (2, 3):
        for single, multi in zip(results[1], results[threads]):
            assert torch.equal(single, multi)


@pytest.fixture
def machine():
    """Pin the machine the strategy choice sees: set(l1, l2, l3, threads); detection and threads come back after."""
    threads = torch.get_num_threads()

    def set_machine(l1, l2, l3, num_threads):
        ops().set_cache_sizes(l1, l2, l3)
        torch.set_num_threads(num_threads)

    yield set_machine
    ops().set_cache_sizes(0, 0, 0)
    torch.set_num_threads(threads)


def test_packed_forward_is_picked_for_float32_tables_from_two_lookups_per_row(machine):
    """d = 512, tau = 8: 33.5 MB of tables. With 2 threads, float32 tables and >= 2 lookups per row (N >= 512)
    `lookup` takes the packed pass, and equals it, whatever the L3 (the table is streamed once per chunk either way);
    below that, embedding_bag; with 32 threads the packed pass has fewer units (16 column blocks) than threads."""
    rows, scores, tables, bias = hashed_inputs(2048, 64, 8, 512, torch.float32, seed=3)
    for l3 in (16 << 20, 32 << 20, 64 << 20):
        machine(32 << 10, 1 << 20, l3, 2)
        assert ops().plan(2048, 64, 256, 512, torch.float32, False) == "packed"
        assert ops().plan(512, 64, 256, 512, torch.float32, False) == "packed"
        assert ops().plan(511, 64, 256, 512, torch.float32, False) == "embedding_bag"
    picked = ops().lookup(rows, scores, tables, bias, 256)
    assert torch.equal(picked, ops().lookup_strategy(rows, scores, tables, bias, 256, "packed"))
    assert not torch.equal(picked, ops().lookup_strategy(rows, scores, tables, bias, 256, "embedding_bag"))
    machine(32 << 10, 1 << 20, 32 << 20, 32)
    assert ops().plan(2048, 64, 256, 512, torch.float32, False) == "embedding_bag"
    assert ops().plan(16, 64, 256, 512, torch.float32, False) == "token"
    assert ops().plan(2048, 64, 256, 512, torch.float32, True) == "bucketed"


def test_16_bit_tables_are_packed_like_float32_ones(machine):
    """bfloat16 and float16 tables of whole 32-column blocks take the packed pass from 2 lookups per row, inside the L3
    or beyond it, and `lookup` equals it."""
    machine(32 << 10, 1 << 20, 32 << 20, 2)
    for dtype in (torch.bfloat16, torch.float16):
        assert ops().plan(4096, 64, 256, 512, dtype, False) == "packed"  # 16.8 MB: inside the L3
        assert ops().plan(2048, 64, 1024, 512, dtype, False) == "packed"  # 64 MB: beyond it
        assert ops().plan(511, 64, 256, 512, dtype, False) == "embedding_bag"
    rows, scores, tables, bias = hashed_inputs(600, 4, 8, 96, torch.bfloat16, seed=7)
    assert ops().plan(600, 4, 256, 96, torch.bfloat16, False) == "packed"
    assert torch.equal(ops().lookup(rows, scores, tables, bias, 256),
                       ops().lookup_strategy(rows, scores, tables, bias, 256, "packed"))


def test_tables_beyond_the_cache_that_packing_cannot_take_are_streamed_from_two_lookups_per_row(machine):
    """Tables whose width is not whole 32-column blocks, beyond 3/2 of the L3: from 2 lookups per row one sequential
    pass over the tables (bucketed) replaces the random row reads (embedding_bag); inside the cache the row reads
    stay."""
    machine(32 << 10, 1 << 20, 32 << 20, 2)
    # 64 tables of 1024 rows x 520 bf16 = 68 MB; x 520 float32 = 136 MB
    for dtype in (torch.bfloat16, torch.float32):
        assert ops().plan(2047, 64, 1024, 520, dtype, False) == "embedding_bag"
        assert ops().plan(2048, 64, 1024, 520, dtype, False) == "bucketed"
        assert ops().plan(4096, 64, 1024, 520, dtype, False) == "bucketed"
    assert ops().plan(4096, 64, 256, 520, torch.bfloat16, False) == "embedding_bag"  # 17 MB: inside the L3
    rows, scores, tables, bias = hashed_inputs(600, 4, 8, 100, torch.bfloat16, seed=6)
    machine(32 << 10, 1 << 20, 64 << 10, 2)  # 4 x 256 x 100 bf16 = 205 KB, beyond 3/2 of a 64 KB "L3"
    assert ops().plan(600, 4, 256, 100, torch.bfloat16, False) == "bucketed"
    assert torch.equal(ops().lookup(rows, scores, tables, bias, 256),
                       ops().lookup_strategy(rows, scores, tables, bias, 256, "bucketed"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_packed_pass_under_a_small_l2_gives_the_same_bits(machine, dtype):
    """A 256 KB L2: 512-token chunks and groups of 2 tables of 64-column rows (4 of 32-column rows where rows do not
    pair): the 16-bit packed pass runs many chunks and groups and still equals the float32 pass on the widened tables
    rounded once, and the float64 oracle."""
    for out_features in (512, 96):
        rows, scores, tables, bias = hashed_inputs(2051, 16, 8, out_features, dtype, seed=11)
        machine(32 << 10, 256 << 10, 32 << 20, 2)
        small = ops().lookup_strategy(rows, scores, tables, bias, 256, "packed")
        wide = ops().lookup_strategy(rows, scores, tables.float(), bias.float(), 256, "packed")
        assert_forward_matches_oracle(small, rows, scores, tables, bias, dtype)
        assert torch.equal(small, wide.to(dtype))


@pytest.mark.slow
def test_packed_sizes_follow_l2_and_compute_the_same_function(machine):
    """A 256 KB L2 gives 64 KB packed groups (2 tables of 256 x 32 floats instead of 8) and 512-token chunks: the
    packed pass then runs 4 chunks and 32 groups per column block and must still give exactly the same output."""
    rows, scores, tables, bias = hashed_inputs(2048, 64, 8, 512, torch.float32, seed=4)
    machine(32 << 10, 1 << 20, 32 << 20, 2)
    reference = ops().lookup_strategy(rows, scores, tables, bias, 256, "packed")
    machine(32 << 10, 256 << 10, 32 << 20, 2)
    small = ops().lookup_strategy(rows, scores, tables, bias, 256, "packed")
    # Same sums per (token, column) in a different grouping of tables: equal up to float32 rounding.
    assert_forward_matches_oracle(small, rows, scores, tables, bias, torch.float32)
    assert torch.allclose(small, reference, rtol=1e-5, atol=1e-5)


def test_strategy_errors_name_the_problem():
    rows, scores, tables, bias = hashed_inputs(8, 2, 3, 40, torch.float32)
    with pytest.raises(RuntimeError, match="unknown strategy 'fast'"):
        ops().lookup_strategy(rows, scores, tables, bias, 8, "fast")
    with pytest.raises(RuntimeError, match="'packed' needs float32, bfloat16 or float16 tables with a width that is "
                                           "a multiple of 32, got Float tables of width 40"):
        ops().lookup_strategy(rows, scores, tables, bias, 8, "packed")
    with pytest.raises(RuntimeError, match="'packed' needs float32, bfloat16 or float16 tables .* got Double"):
        ops().lookup_strategy(rows, scores, tables[:, :32].double().contiguous(), None, 8, "packed")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [1, 300, 2049, 4100])
def test_lookup_op_matches_the_bucketed_pass_at_every_size(n, dtype):
    """Whatever strategy `lookup` picks for a size, it computes the same function as the bucketed pass."""
    rows, scores, tables, bias = hashed_inputs(n, 4, 4, 96, dtype, seed=n)
    picked = ops().lookup(rows, scores, tables, bias, 16)
    bucketed = ops().lookup_strategy(rows, scores, tables, bias, 16, "bucketed")
    s = one_hot_scores(rows, scores, tables.shape[0])
    scale = s.abs() @ tables.double().abs() + bias.double().abs()
    assert_close_scaled(picked, bucketed.double(), scale, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "n, num_tables, hash_bits, out_features",
    [(0, 2, 3, 8), (1, 3, 4, 5), (2047, 2, 6, 65), (2048, 3, 4, 128), (2049, 2, 5, 130), (4100, 2, 3, 200)],
)
@pytest.mark.parametrize("caches", ["detected", "small"])
def test_bucketed_backward_equals_one_hot_transposes(n, num_tables, hash_bits, out_features, dtype, caches, machine):
    """With the detected caches a backward of up to 16384 tokens is one chunk here (a quarter of a 32 MB L3 for each of
    2 threads); 'small' caches (256 KB L2, 1 MB L3, 2 threads: 512-token chunks in float32, 256 in float64) make the
    larger token counts several chunks, whose later ones add to the table gradient the first one wrote."""
    if caches == "small":
        machine(32 << 10, 256 << 10, 1 << 20, 2)
    rows, scores, tables, _ = hashed_inputs(n, num_tables, hash_bits, out_features, dtype, seed=1)
    g = torch.Generator().manual_seed(7)
    grad_y = torch.randn(n, out_features, generator=g).to(dtype)
    grad_scores, grad_tables = ops().lookup_backward(grad_y, rows, scores, tables, 2**hash_bits, True, True)
    assert grad_tables.dtype == dtype and grad_tables.shape == tables.shape
    s = one_hot_scores(rows, scores, tables.shape[0])
    gy = grad_y.double()
    assert_close_scaled(grad_tables, s.T @ gy, s.abs().T @ gy.abs(), dtype)
    # grad_scores[n, k] = <grad_y[n], T[rows[n, k]]>
    full = gy @ tables.double().T  # [N, R]
    expected_scores = full.gather(1, rows)
    scale_scores = (gy.abs() @ tables.double().abs().T).gather(1, rows)
    assert_close_scaled(grad_scores, expected_scores, scale_scores, dtype)
    hit = torch.zeros(tables.shape[0], dtype=torch.bool)
    hit[rows.reshape(-1)] = True
    assert torch.all(grad_tables[~hit] == 0), "rows no token retrieved must have an exactly zero gradient"

    only_tables = ops().lookup_backward(grad_y, rows, scores, tables, 2**hash_bits, True, False)[1]
    only_scores = ops().lookup_backward(grad_y, rows, scores, tables, 2**hash_bits, False, True)[0]
    assert torch.equal(only_tables, grad_tables)
    assert torch.equal(only_scores, grad_scores)


@pytest.mark.parametrize(
    "table_dtype, grad_dtype",
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.float16, torch.float16),
     (torch.bfloat16, torch.float32)],
    ids=str,
)
def test_backward_widens_a_16_bit_grad_y_exactly(table_dtype, grad_dtype):
    """A bfloat16 / float16 grad_y is widened to float32 column block by column block inside the pass (not copied
    whole first): the gradients equal those of the same grad_y given in float32, bit for bit, on a ragged width."""
    rows, scores, tables, _ = hashed_inputs(2049, 3, 5, 130, table_dtype, seed=2)
    grad_y = torch.randn(2049, 130, generator=torch.Generator().manual_seed(3)).to(grad_dtype)
    narrow = ops().lookup_backward(grad_y, rows, scores, tables, 32, True, True)
    wide = ops().lookup_backward(grad_y.float(), rows, scores, tables, 32, True, True)
    assert narrow[1].dtype == table_dtype
    assert torch.equal(narrow[0], wide[0]) and torch.equal(narrow[1], wide[1])


def test_gradient_memory_is_reused_once_freed_and_never_while_held():
    """A table gradient comes from a pool: a block is handed out again only after its tensor is freed, and a reused
    block is fully overwritten (rows nobody retrieved are zero, not the previous gradient)."""
    rows_a, scores_a, tables, _ = hashed_inputs(3000, 2, 6, 96, torch.float32, seed=2)
    rows_b, scores_b, _, _ = hashed_inputs(3, 2, 6, 96, torch.float32, seed=3)  # 6 lookups: most rows unhit
    grad_a = ops().lookup_backward(torch.ones(3000, 96), rows_a, scores_a, tables, 64, True, False)[1]
    kept = grad_a.clone()
    grad_b = ops().lookup_backward(torch.ones(3, 96), rows_b, scores_b, tables, 64, True, False)[1]
    assert grad_b.data_ptr() != grad_a.data_ptr()
    assert torch.equal(grad_a, kept), "a held gradient must not be overwritten by the next backward"

    pointer = grad_a.data_ptr()
    del grad_a
    grad_c = ops().lookup_backward(torch.ones(3, 96), rows_b, scores_b, tables, 64, True, False)[1]
    assert grad_c.data_ptr() == pointer, "the freed block is reused"
    assert torch.equal(grad_c, grad_b), "a reused block holds exactly the new gradient"
    assert int((grad_c != 0).any(1).sum()) <= 6

    view = grad_c[:5]  # a view keeps the block alive after the tensor itself is dropped
    del grad_b, grad_c
    grad_d = ops().lookup_backward(torch.ones(3000, 96), rows_a, scores_a, tables, 64, True, False)[1]
    assert view.data_ptr() != grad_d.data_ptr()
    assert torch.equal(grad_d, kept)
    del view, grad_d
    assert ops().release_gradient_pool() >= tables.nbytes


def test_training_with_pooled_gradients_matches_the_torch_path():
    """Several optimizer steps with zero_grad(set_to_none=True) (blocks recycled every step) give the same weights
    as the plain PyTorch path."""
    from modeling_memoryformer import MemoryLayer

    results = {}
    for kernel in ("fused", "torch"):
        torch.manual_seed(0)
        layer = MemoryLayer(64, 80, hash_bits=4)
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(5)
        with memory_ops.use_kernel(kernel):
            for _ in range(4):
                x = torch.randn(2100, 64, generator=g)
                loss = layer(x).square().mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        results[kernel] = layer.tables.detach().clone()
    torch.testing.assert_close(results["fused"], results["torch"], rtol=1e-5, atol=1e-6)


def test_release_gradient_memory_returns_idle_blocks():
    rows, scores, tables, _ = hashed_inputs(50, 2, 6, 96, torch.float32, seed=4)
    grad = ops().lookup_backward(torch.ones(50, 96), rows, scores, tables, 64, True, False)[1]
    expected = grad.clone()
    memory_ops.release_gradient_memory()  # frees whatever is idle; the block of `grad` is in use and stays
    assert torch.equal(grad, expected)
    del grad
    assert memory_ops.release_gradient_memory() >= tables.nbytes  # now it is idle and freed
    assert memory_ops.release_gradient_memory() == 0


def test_hash_backward_gradients_from_the_pool_never_alias_and_few_idle_ones_are_kept():
    """The hash backward's input gradient comes from the gradient pool as a transient block: a block is never handed
    out while its tensor (or a view of it) is alive, and of the freed ones only the 8 most recently freed are kept, so
    changing shapes cannot pile up idle memory (the pool rounds blocks up to 2 MB)."""
    memory_ops.release_gradient_memory()
    block = 2 << 20
    g = torch.Generator().manual_seed(6)
    shapes = [(1000 + 300 * i, 64) for i in range(12)]  # 12 distinct sizes, 1-4 blocks of 2 MB each
    held, copies = [], []
    for n, d in shapes:
        x = torch.randn(n, d, generator=g)
        grad_scores = torch.randn(n, d // 4, generator=g)
        gx = ops().hash_backward(grad_scores, x, 4, "paper", 1.0)
        held.append(gx[: n // 2])  # a view keeps the block alive
        copies.append(gx.clone())
        del gx
    pointers = {t.data_ptr() for t in held}
    assert len(pointers) == len(shapes), "a block in use was handed out again"
    for t, c in zip(held, copies):
        assert torch.equal(t, c[: t.shape[0]]), "a held gradient was overwritten by a later backward"

    sizes = [-(-n * d * 4 // block) * block for n, d in shapes]
    del t
    for i in range(len(held)):
        held[i] = None  # freed in order: the last 8 stay idle in the pool
    assert memory_ops.release_gradient_memory() == sum(sizes[-8:])
    assert memory_ops.release_gradient_memory() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("score", ["paper", "l1"])
def test_16_bit_hash_is_the_float32_hash_of_the_same_values(dtype, score):
    """A 16-bit model hashes in float32: the codes come from the same signs and the scores are the float32 scores of
    the widened values, bit for bit; the input gradient is the float32 one rounded once to the input's dtype."""
    g = torch.Generator().manual_seed(12)
    for n, in_features, hash_bits in [(1, 16, 4), (67, 48, 8), (2049, 512, 8), (9, 640, 10)]:
        x = (torch.randn(n, in_features, generator=g) * 2).to(dtype)
        wide = x.float()
        rows, scores = ops().hash(x, hash_bits, score, 1.0)
        rows32, scores32 = ops().hash(wide, hash_bits, score, 1.0)
        assert scores.dtype == torch.float32
        assert torch.equal(rows, rows32) and torch.equal(scores, scores32)
        grad_scores = torch.randn(scores.shape, generator=g)
        grad_x = ops().hash_backward(grad_scores, x, hash_bits, score, 1.0)
        grad_x32 = ops().hash_backward(grad_scores, wide, hash_bits, score, 1.0)
        assert grad_x.dtype == dtype and torch.equal(grad_x, grad_x32.to(dtype))
