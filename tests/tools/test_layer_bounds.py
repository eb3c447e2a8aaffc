"""benchmarks/layer_bench.py: each Memory Layer forward record names its bound on the running machine.

Oracle: the byte and multiply-add counts written out for d = 512, tau = 8 (64 tables of 256 rows of 512 values)."""

from __future__ import annotations

import pytest

from benchmarks.layer_bench import add_forward_bounds, forward_bound


def test_one_token_in_bf16_moves_its_rows_and_is_bound_by_the_slower_of_bytes_and_multiply_adds():
    rows = 64 * 512 * 2  # 64 rows of 512 bf16 values
    moved = rows + 2 * 512 * 2  # + input and output
    memory_bound = forward_bound(512, 1, "bf16", 8, stream_gbps=10.0, mac_per_s=1e12)
    assert memory_bound["bytes"] == moved and memory_bound["bound"] == "gathers"
    assert memory_bound["bound_ms"] == pytest.approx(moved / 10e9 * 1e3)
    compute_bound = forward_bound(512, 1, "bf16", 8, stream_gbps=10.0, mac_per_s=1e9)
    assert compute_bound["bound"] == "multiply-adds" and compute_bound["macs"] == 64 * 512
    assert compute_bound["bound_ms"] == pytest.approx(64 * 512 / 1e9 * 1e3)


def test_many_tokens_stream_each_table_once_and_int8_rows_carry_their_scale_and_offset():
    bound = forward_bound(512, 8192, "int8", 8, stream_gbps=20.0, mac_per_s=None)
    tables = 64 * 256 * (512 + 8)  # every row once: fewer bytes than 8192 x 64 gathered rows
    assert bound["bound"] == "table stream"
    assert bound["bytes"] == tables + 2 * 8192 * 512 * 4  # float32 input and output


def test_records_get_their_distance_from_the_dense_layers_best_rate_in_any_dtype():
    ms = lambda value: {"median": value}  # noqa: E731
    rows = [
        dict(mode="forward", contestant="Linear", kernel=None, dtype="fp32", d=512, tokens=2048, ms=ms(2.0)),
        dict(mode="forward", contestant="Linear", kernel=None, dtype="bf16", d=512, tokens=2048, ms=ms(20.0)),
        dict(mode="forward", contestant="MemoryLayer[fused]", kernel="fused", dtype="fp32", d=512, tokens=2048,
             ms=ms(4.0), host_stream_gbps=20.0),
        dict(mode="fwd_bwd", contestant="MemoryLayer[fused]", kernel="fused", dtype="fp32", d=512, tokens=2048,
             ms=ms(9.0), host_stream_gbps=20.0),
    ]
    add_forward_bounds(rows, 8)
    rate = 2048 * 512 * 512 / 2e-3
    assert rows[2]["bound"]["dense_mac_per_s"] == pytest.approx(rate)  # float32's, not the slower bf16 GEMM's
    expected = forward_bound(512, 2048, "fp32", 8, 20.0, rate)["bound_ms"]
    assert rows[2]["bound"]["distance"] == pytest.approx(4.0 / expected)
    assert "bound" not in rows[0] and "bound" not in rows[1] and "bound" not in rows[3]
