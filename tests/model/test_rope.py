"""RoPE exactly as transformers' GPT-NeoX: every rope_type of transformers' rope utilities, checked
against transformers' own `GPTNeoXRotaryEmbedding` built from a `GPTNeoXConfig` with the same `rope_parameters`."""

import copy

import pytest
import torch
from transformers import GPTNeoXConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

from conftest import tiny_config, tiny_model
from modeling_memoryformer.modeling_memoryformer import MemoryFormerRotaryEmbedding

MAX_POSITIONS = 64  # max_position_embeddings of both configs
HEAD_DIM, HEADS, ROTARY_PCT = 16, 2, 0.5  # rotary width 8: 4 frequencies
HALF = int(HEAD_DIM * ROTARY_PCT) // 2

# The parameters each rope_type needs (transformers' `validate_rope` raises KeyError without the required ones).
ROPE_CASES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn_custom": {"rope_type": "yarn", "factor": 2.0, "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.3,
                    "original_max_position_embeddings": 32},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 16, "factor": 4.0,
                 "short_factor": [1.0, 1.1, 1.3, 1.7][:HALF], "long_factor": [1.5, 2.0, 3.0, 5.0][:HALF]},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "proportional": {"rope_type": "proportional", "factor": 2.0},
}


def test_every_rope_type_of_transformers_is_covered():
    assert {"default", *ROPE_INIT_FUNCTIONS} <= {case["rope_type"] for case in ROPE_CASES.values()}


def _pair(rope_parameters, head_dim=HEAD_DIM, heads=HEADS, rotary_pct=ROTARY_PCT, theta=500.0):
    rope = {**copy.deepcopy(rope_parameters), "rope_theta": theta, "partial_rotary_factor": rotary_pct}
    ours = tiny_config(hidden_size=head_dim * heads, num_attention_heads=heads, hash_bits=4,
                       max_position_embeddings=MAX_POSITIONS, rope_parameters=copy.deepcopy(rope))
    neox = GPTNeoXConfig(hidden_size=head_dim * heads, num_attention_heads=heads, intermediate_size=4,
                         num_hidden_layers=1, max_position_embeddings=MAX_POSITIONS,
                         rope_parameters=copy.deepcopy(rope))
    return ours, neox


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_cos_sin_match_gpt_neox_inside_and_beyond_max_positions(case):
    ours_config, neox_config = _pair(ROPE_CASES[case])
    assert ours_config.rope_parameters == neox_config.rope_parameters
    ours, neox = MemoryFormerRotaryEmbedding(ours_config), GPTNeoXRotaryEmbedding(neox_config)
    assert ours.rope_type == neox.rope_type == ROPE_CASES[case]["rope_type"]
    assert ours.attention_scaling == neox.attention_scaling
    if case in ("yarn", "yarn_custom", "longrope"):
        assert ours.attention_scaling != 1.0  # the scaled types really scale
    torch.testing.assert_close(ours.inv_freq, neox.inv_freq, rtol=0, atol=0)
    x = torch.zeros(1, dtype=torch.float32)
    # Short (inside the original length), long (beyond max_position_embeddings: dynamic/longrope switch), short again
    # (dynamic/longrope switch back), decode-style single positions far out, and a batch of offsets.
    for position_ids in (
        torch.arange(12)[None],
        torch.arange(MAX_POSITIONS)[None],
        torch.arange(3 * MAX_POSITIONS)[None],
        torch.arange(10)[None],
        torch.tensor([[5 * MAX_POSITIONS]]),
        torch.stack([torch.arange(20), torch.arange(100, 120)]),
    ):
        cos, sin = ours(x, position_ids)
        cos_ref, sin_ref = neox(x, position_ids)
        width = HEAD_DIM if case == "proportional" else 2 * HALF  # proportional: zero frequencies past the rotary part
        assert cos.shape == cos_ref.shape == (*position_ids.shape, width)
        torch.testing.assert_close(cos, cos_ref, rtol=0, atol=0)
        torch.testing.assert_close(sin, sin_ref, rtol=0, atol=0)
        torch.testing.assert_close(ours.inv_freq, neox.inv_freq, rtol=0, atol=0)


@pytest.mark.parametrize("head_dim, heads, rotary_pct", [(4, 4, 0.25), (12, 2, 0.25), (8, 2, 0.375)])
def test_odd_or_one_dim_rotary_width_behaves_as_gpt_neox(head_dim, heads, rotary_pct):
    """head_dim 4 with rotary_pct 0.25 (width 1) is accepted, as GPT-NeoX accepts it: the width rounds up to even."""
    ours_config, neox_config = _pair({"rope_type": "default"}, head_dim, heads, rotary_pct)
    ours, neox = MemoryFormerRotaryEmbedding(ours_config), GPTNeoXRotaryEmbedding(neox_config)
    positions = torch.arange(2 * MAX_POSITIONS)[None]
    x = torch.zeros(1)
    for got, want in zip(ours(x, positions), neox(x, positions)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    model = tiny_model(hidden_size=head_dim * heads, num_attention_heads=heads, hash_bits=4,
                       rope_parameters={"rope_type": "default", "partial_rotary_factor": rotary_pct})
    out = model(torch.tensor([[1, 2, 3, 4, 5]]))
    assert torch.isfinite(out.logits).all()


def test_old_style_and_rope_scaling_keys_are_read_as_gpt_neox_reads_them():
    legacy = {"rotary_pct": 0.5, "rotary_emb_base": 300.0, "rope_scaling": {"rope_type": "linear", "factor": 3.0}}
    ours = tiny_config(hidden_size=32, num_attention_heads=2, hash_bits=4, **copy.deepcopy(legacy))
    neox = GPTNeoXConfig(hidden_size=32, num_attention_heads=2, **copy.deepcopy(legacy))
    assert ours.rope_parameters == neox.rope_parameters


@pytest.mark.parametrize(
    "rope_parameters, error",
    [
        ({"rope_type": "linear"}, KeyError),  # missing factor: transformers' validate_rope, as for GPT-NeoX
        ({"rope_type": "yarn"}, KeyError),
        ({"rope_type": "llama3", "factor": 8.0}, KeyError),
        ({"rope_type": "longrope", "factor": 2.0}, KeyError),
        ({"rope_type": "not-a-rope"}, ValueError),  # GPT-NeoX fails later (KeyError building the model): fail early
    ],
)
def test_incomplete_or_unknown_rope_parameters_are_refused(rope_parameters, error):
    with pytest.raises(error, match="rope"):
        tiny_config(rope_parameters=rope_parameters)
    if error is KeyError:
        with pytest.raises(KeyError):
            GPTNeoXConfig(hidden_size=32, num_attention_heads=2, rope_parameters=copy.deepcopy(rope_parameters))


@pytest.mark.parametrize("case", ["linear", "dynamic", "yarn", "longrope", "llama3"])
def test_tiny_model_with_scaled_rope_runs_and_reloads(case, tmp_path):
    rope = copy.deepcopy(ROPE_CASES[case])
    if case == "longrope":
        rope["short_factor"], rope["long_factor"] = [1.0, 1.2], [2.0, 4.0]  # tiny head_dim 16 x 0.25: 2 frequencies
    model = tiny_model(max_position_embeddings=MAX_POSITIONS, rope_parameters=rope).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, MAX_POSITIONS + 8))  # beyond max_position_embeddings
    out = model(ids).logits
    assert out.shape == (1, MAX_POSITIONS + 8, model.config.vocab_size) and torch.isfinite(out).all()
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    assert loaded.config.rope_parameters == model.config.rope_parameters
    torch.testing.assert_close(loaded.model.rotary_emb.original_inv_freq, model.model.rotary_emb.original_inv_freq)
    torch.testing.assert_close(loaded(ids).logits, out)
    generated = model.generate(ids[:, :5], max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 9)
