"""The rotary embedding's table for a decode step's few positions (`decode_layer.rotary_table_rows`): the
same bits as computing the positions' cos and sin (`_compute`) and as transformers' `GPTNeoXRotaryEmbedding`, in every
dtype and rotary width, past max_position_embeddings too; made again when what it was made from changes; not taken
where `inv_freq` follows the sequence length or where the positions are many."""

import pytest
import torch
from transformers import GPTNeoXConfig
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

from conftest import tiny_config
from modeling_memoryformer.decode_layer import rotary_table_rows
from modeling_memoryformer.modeling_memoryformer import MemoryFormerRotaryEmbedding

MAX_POSITIONS = 64


def _rotary(rope=None, head_dim=16, heads=2, rotary_pct=0.5):
    rope = {"rope_type": "default", **(rope or {}), "rope_theta": 500.0, "partial_rotary_factor": rotary_pct}
    config = tiny_config(hidden_size=head_dim * heads, num_attention_heads=heads, hash_bits=4,
                         max_position_embeddings=MAX_POSITIONS, rope_parameters=dict(rope))
    neox = GPTNeoXConfig(hidden_size=head_dim * heads, num_attention_heads=heads, intermediate_size=4,
                         num_hidden_layers=1, max_position_embeddings=MAX_POSITIONS, rope_parameters=dict(rope))
    return MemoryFormerRotaryEmbedding(config), GPTNeoXRotaryEmbedding(neox)


def _decode_positions(generator):
    """Decode-style position ids: one sequence, a batch of 4, inside and far beyond max_position_embeddings."""
    yield torch.tensor([[0]])
    yield torch.tensor([[MAX_POSITIONS - 1]])
    for _ in range(20):
        yield torch.randint(0, 40 * MAX_POSITIONS, (1, 1), generator=generator)
        yield torch.randint(0, 40 * MAX_POSITIONS, (4, 1), generator=generator)
    yield torch.tensor([[3, 4, 5, 6, 7]])  # a short chunk of one sequence


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim, heads, rotary_pct, rope", [
    (16, 2, 0.5, None),
    (64, 2, 0.25, None),        # MF-tiny's and MF-small's width: 16
    (64, 2, 1.0, None),
    (12, 2, 0.25, None),        # an odd width, rounded up as GPT-NeoX does
    (16, 2, 0.5, {"rope_type": "linear", "factor": 2.0}),
    (16, 2, 0.5, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
])
def test_table_rows_equal_the_computed_ones_and_gpt_neox_bit_for_bit(dtype, head_dim, heads, rotary_pct, rope):
    ours, neox = _rotary(rope, head_dim, heads, rotary_pct)
    x = torch.zeros(1, dtype=dtype)
    for positions in _decode_positions(torch.Generator().manual_seed(0)):
        rows = rotary_table_rows(ours, x, positions)
        assert rows is not None, positions  # the fast path is taken for these
        computed, reference = ours._compute(x, positions), neox(x, positions)
        for got, want, ref in zip(rows, computed, reference):
            assert got.dtype == want.dtype == dtype and got.shape == want.shape == (*positions.shape, want.shape[-1])
            assert torch.equal(got, want) and torch.equal(got, ref), positions
        assert torch.equal(ours(x, positions)[0], rows[0])  # forward returns them


def test_table_is_made_once_and_again_when_what_it_was_made_from_changes():
    ours, _ = _rotary()
    x = torch.zeros(1)
    calls = []
    compute = ours._compute
    ours._compute = lambda *args: calls.append(args[1].shape) or compute(*args)
    for step in range(50):
        ours(x, torch.tensor([[step]]))
    assert len(calls) == 1  # the table, made on the first call
    ours(x, torch.tensor([[10 * MAX_POSITIONS]]))  # past the table's end: a longer table
    assert len(calls) == 2 and calls[-1][1] > 10 * MAX_POSITIONS
    before = ours(x, torch.tensor([[7]]))[1]
    with torch.no_grad():
        ours.inv_freq.mul_(0.5)  # changed in place: its version moves
    after = ours(x, torch.tensor([[7]]))[1]
    assert len(calls) == 3 and not torch.equal(before, after)
    assert torch.equal(after, compute(x, torch.tensor([[7]]))[1])
    ours.attention_scaling = 0.5
    assert torch.equal(ours(x, torch.tensor([[7]]))[0], compute(x, torch.tensor([[7]]))[0]) and len(calls) == 4
    ours.to(torch.float64)  # inv_freq converted: another tensor
    x64 = torch.zeros(1, dtype=torch.float64)
    got = ours(x64, torch.tensor([[9]]))
    assert len(calls) == 5 and got[0].dtype == torch.float64 and torch.equal(got[0], compute(x64, torch.tensor([[9]]))[0])


def test_table_made_in_inference_mode_serves_calls_outside_it():
    ours, _ = _rotary()
    x = torch.zeros(1)
    with torch.inference_mode():
        ours(x, torch.tensor([[3]]))
    cos, sin = ours(x, torch.tensor([[4]]))
    assert not cos.is_inference() and torch.equal(cos, ours._compute(x, torch.tensor([[4]]))[0])
    (cos.sum() + torch.ones(1, requires_grad=True)).backward()  # usable in an autograd graph


@pytest.mark.parametrize("positions", [
    torch.arange(MAX_POSITIONS + 1)[None],            # more positions than a decode step has
    torch.tensor([[-1]]),                             # negative: computed, as before
    torch.tensor([[2.0]]),                            # not integer ids
    torch.tensor([[[1]]]),                            # not [batch, seq]
    torch.tensor([[10 ** 7]]),                        # beyond what a table of _TABLE_BYTES holds
])
def test_table_is_not_taken_for_other_inputs(positions):
    ours, neox = _rotary()
    assert rotary_table_rows(ours, torch.zeros(1), positions) is None
    if positions.dtype == torch.long and positions.dim() == 2:
        for got, want in zip(ours(torch.zeros(1), positions), neox(torch.zeros(1), positions)):
            assert torch.equal(got, want)  # computed, as before


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "longrope", "original_max_position_embeddings": 16, "factor": 4.0,
                                   "short_factor": [1.0, 1.1, 1.3, 1.7], "long_factor": [1.5, 2.0, 3.0, 5.0]}])
def test_types_whose_frequencies_follow_the_length_are_computed(rope):
    ours, neox = _rotary(rope)
    x = torch.zeros(1)
    assert rotary_table_rows(ours, x, torch.tensor([[5]])) is None
    for positions in (torch.arange(3 * MAX_POSITIONS)[None], torch.tensor([[5]])):  # grows, then resets
        for got, want in zip(ours(x, positions), neox(x, positions)):
            assert torch.equal(got, want)
