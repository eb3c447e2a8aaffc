"""benchmarks/scatter_probe.py: the scattered-read probe reads exactly the spans it is given, and deals random rows to
the threads as a decode step's lookups read them.

Oracle: the XOR of the 8-byte words of every span, computed here with numpy from the same starts."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from benchmarks import scatter_probe

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="the probe is compiled with the system's C compiler")


def xor_of_spans(tensors, starts, span) -> list[int]:
    out = []
    for thread in starts.tolist():
        x = 0
        for index, offset in thread:
            words = tensors[index].view(-1).view(torch.uint8)[offset:offset + span].numpy().view(np.uint64)
            x ^= int(np.bitwise_xor.reduce(words)) if words.size else 0
        out.append(x)
    return out


@pytest.mark.parametrize("ahead, far", [(0, 0), (4, 12), (16, 48)])
@pytest.mark.parametrize("split", [1, 2])
def test_the_probe_reads_every_span_it_is_given(split, ahead, far):
    g = torch.Generator().manual_seed(split * 100 + ahead)
    tensors = [torch.randint(-2**15, 2**15, (64, 40), dtype=torch.int16, generator=g).view(torch.bfloat16)
               for _ in range(3)]
    starts, span = scatter_probe.row_starts(tensors, 50, split, 2, g)
    assert starts.shape == (2, 50 if split == 2 else 25, 2)
    assert span == (80 if split == 1 else 40)
    seconds, sums = scatter_probe.scatter_read(tensors, starts, span, ahead, far)
    assert seconds > 0
    assert sums == xor_of_spans(tensors, starts, span)


def test_split_rows_give_each_thread_its_columns_of_the_same_rows_and_whole_rows_are_dealt_out():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.zeros(10, 24, dtype=torch.float32), torch.zeros(30, 24, dtype=torch.float32)]
    starts, span = scatter_probe.row_starts(tensors, 400, 2, 2, g)
    assert span == 48
    assert torch.equal(starts[0, :, 0], starts[1, :, 0])
    assert torch.equal(starts[1, :, 1] - starts[0, :, 1], torch.full((400,), 48))
    assert (starts[0, :, 1] % 96 == 0).all()
    # rows uniform over all 40 rows: the second tensor (30 of them) is picked about 3/4 of the time
    assert 0.65 < starts[0, :, 0].float().mean().item() < 0.85
    whole, span = scatter_probe.row_starts(tensors, 401, 1, 2, g)
    assert span == 96 and whole.shape == (2, 200, 2)
    rows = whole[..., 1] // 96
    assert (rows < torch.tensor([10, 30])[whole[..., 0]]).all()


def test_the_rate_is_bytes_over_seconds_of_the_best_setting(monkeypatch):
    calls = []

    def fake_read(tensors, starts, span, ahead, far):
        calls.append((starts.shape, span, ahead, far))
        return {4: 0.004, 8: 0.002}.get(ahead, 0.008), [0] * starts.shape[0]

    monkeypatch.setattr(scatter_probe, "scatter_read", fake_read)
    tensors = [torch.zeros(1000, 512, dtype=torch.bfloat16)]
    rate = scatter_probe.scattered_read_gbps(tensors, 100, 1, 2, settings=((4, 12), (8, 24), (16, 48)))
    rows = scatter_probe.MIN_PROBE_BYTES // 1024   # at least MIN_PROBE_BYTES of 1 KB rows, not just the 100 asked
    assert [c[2] for c in calls] == [4, 8, 16]
    assert calls[0][0] == (2, rows // 2, 2)
    assert rate == pytest.approx(rows * 1024 / 0.002 / 1e9)


def test_bad_starts_and_spans_are_refused_with_the_reason():
    tensors = [torch.zeros(4, 16, dtype=torch.float32)]
    ok = torch.tensor([[[0, 0]]])
    with pytest.raises(ValueError, match="multiple of 8"):
        scatter_probe.scatter_read(tensors, ok, 12)
    with pytest.raises(ValueError, match="fits"):
        scatter_probe.scatter_read(tensors, torch.tensor([[[0, 240]]]), 64)
    with pytest.raises(ValueError, match="fits"):
        scatter_probe.scatter_read(tensors, torch.tensor([[[1, 0]]]), 8)
    with pytest.raises(ValueError, match=r"int64 \[threads, count, 2\]"):
        scatter_probe.scatter_read(tensors, torch.tensor([[0, 0]]), 8)
    with pytest.raises(ValueError, match="one row width"):
        scatter_probe.row_starts([torch.zeros(4, 16), torch.zeros(4, 8)], 4, 1, 2, torch.Generator())


def test_step_rows_follow_a_decode_step_layer_by_layer_one_row_per_table_and_sequence():
    """Two layers' tables (K = 3 tables of 4 rows, then K = 2 of 8 rows), batch 2: the step's rows in order are layer
    0's sequence 0 tables 0, 1, 2, its sequence 1 tables 0, 1, 2, then layer 1's; row j goes to thread j % 2; steps
    repeat with fresh rows up to the bytes asked for."""
    g = torch.Generator().manual_seed(3)
    tensors = [torch.arange(12 * 8, dtype=torch.int64).view(12, 8), torch.zeros(16, 8, dtype=torch.int64)]
    starts, span = scatter_probe.step_starts(tensors, [3, 2], 2, 2, 10 * 5 * 64, g)
    assert span == 64
    flat = starts.transpose(0, 1).reshape(-1, 2)   # back to the step order
    per_step = 2 * 3 + 2 * 2
    assert flat.shape[0] == 5 * per_step  # 640 B per step: 5 steps for 3200 B
    index, row = flat[:, 0], flat[:, 1] // 64
    for s in range(5):
        step_index, step_row = index[s * per_step:(s + 1) * per_step], row[s * per_step:(s + 1) * per_step]
        assert step_index.tolist() == [0] * 6 + [1] * 4
        assert (step_row[:6] // 4).tolist() == [0, 1, 2, 0, 1, 2]
        assert (step_row[6:] // 8).tolist() == [0, 1, 0, 1]
    assert len(set(row.tolist())) > 10   # fresh random rows, not one step repeated
    seconds, sums = scatter_probe.scatter_read(tensors, starts, span, 4, 12)
    assert sums == xor_of_spans(tensors, starts, span)
    with pytest.raises(ValueError, match="their K"):
        scatter_probe.step_starts(tensors, [5, 2], 1, 2, 64, g)


def test_the_chase_reads_the_word_at_every_start_in_turn():
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randint(-2**15, 2**15, (r, w), dtype=torch.int16, generator=g).view(torch.bfloat16)
               for r, w in ((64, 40), (16, 128), (200, 8))]
    starts = scatter_probe.random_row_starts(tensors, 3000, g)
    seconds, checksum = scatter_probe.chase_read(tensors, starts)
    assert seconds > 0
    assert [checksum] == xor_of_spans(tensors, starts.unsqueeze(0), 8)
    assert scatter_probe.read_latency_ns(tensors, reads=500) > 0


def test_random_row_starts_are_row_starts_uniform_over_every_row():
    g = torch.Generator().manual_seed(4)
    tensors = [torch.zeros(10, 6, dtype=torch.float32), torch.zeros(30, 2, dtype=torch.bfloat16)]
    starts = scatter_probe.random_row_starts(tensors, 4000, g)
    index, offset = starts[:, 0], starts[:, 1]
    row_bytes = torch.tensor([24, 4])[index]
    assert (offset % row_bytes == 0).all()
    assert (offset // row_bytes < torch.tensor([10, 30])[index]).all()
    assert 0.70 < index.float().mean().item() < 0.80   # 30 of the 40 rows are the second tensor's
    assert len({tuple(s) for s in starts.tolist()}) == 40   # every row drawn


def test_the_chase_refuses_bad_starts():
    t = [torch.zeros(4, 4, dtype=torch.float32)]
    with pytest.raises(ValueError, match=r"\[count, 2\]"):
        scatter_probe.chase_read(t, torch.zeros(2, 2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="fits"):
        scatter_probe.chase_read(t, torch.tensor([[0, 60]]))
    with pytest.raises(ValueError, match="2-D"):
        scatter_probe.random_row_starts([torch.zeros(8)], 4, torch.Generator())


@pytest.mark.skipif(__import__("platform").machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"),
                    reason="the flush knows x86 and aarch64 only")
def test_a_flush_keeps_the_bytes_it_writes_back_and_refuses_what_it_cannot_flush():
    # Lines written just before the flush are dirty in the caches: the flush must write them back, not drop them.
    g = torch.Generator().manual_seed(5)
    expected = torch.randint(-2**31, 2**31, (3 << 18,), dtype=torch.int32, generator=g)   # 3 MB, over the L2
    buffer = torch.empty_like(expected)
    buffer.copy_(expected)
    assert scatter_probe.flush_caches(buffer, threads=2) >= 0
    assert torch.equal(buffer, expected)
    odd = expected[1:1001]   # a span that starts and ends inside lines
    assert scatter_probe.flush_caches(odd, threads=1) >= 0 and torch.equal(odd, expected[1:1001])
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        scatter_probe.flush_caches(expected.view(-1, 2)[:, 0])
