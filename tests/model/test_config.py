"""MemoryFormerConfig: validation (every error names the field and the value), the paper's defaults, presets, round trips."""

from __future__ import annotations

import json

import pytest

from modeling_memoryformer import MemoryFormerConfig

from conftest import TINY, tiny_config


# ---------------------------------------------------------------------------------------------------------------------
# Validation
@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (dict(hidden_size=60, hash_bits=8, num_attention_heads=4), r"hidden_size=60.*hash_bits=8"),
        (dict(hidden_size=64, hash_bits=4, num_attention_heads=6), r"hidden_size=64.*num_attention_heads=6"),
        (dict(hash_bits=0), r"hash_bits.*\b0\b"),
        (dict(hash_temperature=0.0), r"hash_temperature.*0\.0"),
        (dict(hash_temperature=-1.5), r"hash_temperature.*-1\.5"),
        (dict(hash_score="cosine"), r"hash_score.*'cosine'"),
        (dict(norm_type="batchnorm"), r"norm_type.*'batchnorm'"),
        (dict(attention_output="dense"), r"attention_output.*'dense'"),
        (dict(memory_block_activation="relu"), r"memory_block_activation.*'relu'"),
        (dict(vocab_size=0), r"vocab_size.*\b0\b"),
        (dict(vocab_size=-5), r"vocab_size.*-5"),
        (dict(hidden_size=0), r"hidden_size.*\b0\b"),
        (dict(hidden_size=-64), r"hidden_size.*-64"),
        (dict(num_hidden_layers=0), r"num_hidden_layers.*\b0\b"),
        (dict(num_hidden_layers=-1), r"num_hidden_layers.*-1"),
        (dict(num_attention_heads=0), r"num_attention_heads.*\b0\b"),
        (dict(num_attention_heads=-4), r"num_attention_heads.*-4"),
        (dict(intermediate_size=100), r"intermediate_size=100.*6"),  # tau 4 + e 2 = 6 does not divide 100
        (dict(intermediate_size=0), r"intermediate_size.*\b0\b"),
        (dict(expand_bits=-1), r"expand_bits.*-1"),
    ],
    ids=lambda v: "-".join(f"{k}={v}" for k, v in v.items()) if isinstance(v, dict) else "",
)
def test_invalid_config_raises_value_error_naming_field_and_value(overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        tiny_config(**overrides)


def test_hash_bits_17_is_rejected_with_the_table_size_in_bytes():
    with pytest.raises(ValueError, match=r"hash_bits.*17") as info:
        tiny_config(hash_bits=17, hidden_size=17 * 4, num_attention_heads=4)
    message = str(info.value)
    assert "bytes" in message
    # One 68 -> 68 layer with tau=17: K=4 tables of 2**17 rows of 68 float32 values.
    assert f"{4 * 2**17 * 68 * 4:,}" in message


def test_hash_bits_plus_expand_bits_above_16_is_rejected():
    with pytest.raises(ValueError, match=r"expand_bits=4.*hash_bits=14"):
        tiny_config(hash_bits=14, expand_bits=4, hidden_size=56, num_attention_heads=4)


def test_validation_runs_when_loading_a_bad_config_json(tmp_path):
    tiny_config().save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    data["hash_bits"] = 5  # 64 is not a multiple of 5
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"hidden_size=64.*hash_bits=5"):
        MemoryFormerConfig.from_pretrained(tmp_path)

    data["hash_bits"] = 4
    data["hash_score"] = "softmax"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"hash_score.*'softmax'"):
        MemoryFormerConfig.from_pretrained(tmp_path)


def test_validation_runs_when_building_from_a_dict():
    data = tiny_config().to_dict()
    data["hash_temperature"] = -2.0
    with pytest.raises(ValueError, match=r"hash_temperature.*-2"):
        MemoryFormerConfig.from_dict(data)


# ---------------------------------------------------------------------------------------------------------------------
# Defaults (the paper's Memory Layer and architecture, and the MF-tiny preset)
def test_defaults_follow_spec():
    config = MemoryFormerConfig()
    assert config.model_type == "memoryformer"
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (
        50304, 512, 6, 8,
    )
    assert config.max_position_embeddings == 2048
    assert config.hash_bits == 8
    assert config.expand_bits == 2
    assert config.num_tables == 512 // 8
    assert config.intermediate_size == (8 + 2) * (512 // 8) == 640
    assert config.rope_parameters["partial_rotary_factor"] == 0.25
    assert config.rope_parameters["rope_theta"] == 10000.0
    assert config.rope_parameters["rope_type"] == "default"
    assert config.tie_word_embeddings is False
    assert config.hash_score == "paper"
    assert config.hash_temperature == 1.0
    assert config.norm_type == "layernorm"
    assert config.memory_bias is True
    assert config.use_parallel_residual is False
    assert config.attention_output == "none"
    assert config.memory_block_activation == "none"
    assert config.table_init_std == 0.02
    assert config.head_dim == 512 // 8


def test_intermediate_size_default_follows_hash_and_expand_bits():
    assert tiny_config(hash_bits=4, expand_bits=0).intermediate_size == 4 * 16
    assert tiny_config(hash_bits=4, expand_bits=3).intermediate_size == 7 * 16
    assert tiny_config(hash_bits=8, expand_bits=1).intermediate_size == 9 * 8
    assert tiny_config(hash_bits=4, intermediate_size=12).intermediate_size == 12


def test_old_style_rotary_keys_are_mapped_to_rope_parameters():
    config = tiny_config(rotary_pct=0.5, rotary_emb_base=500.0)
    assert config.rope_parameters["partial_rotary_factor"] == 0.5
    assert config.rope_parameters["rope_theta"] == 500.0
    explicit = tiny_config(rope_parameters={"rope_theta": 123.0})
    assert explicit.rope_parameters == {"rope_theta": 123.0, "rope_type": "default", "partial_rotary_factor": 0.25}


# ---------------------------------------------------------------------------------------------------------------------
# Presets (paper Table 1)
@pytest.mark.parametrize(
    "name, layers, hidden, heads, tau, tables",
    [("tiny", 6, 512, 8, 8, 64), ("small", 12, 768, 12, 8, 96), ("base", 24, 1024, 16, 8, 128)],
)
def test_presets_have_the_papers_shapes(name, layers, hidden, heads, tau, tables):
    config = MemoryFormerConfig.from_preset(name)
    assert config.num_hidden_layers == layers
    assert config.hidden_size == hidden
    assert config.num_attention_heads == heads
    assert config.hash_bits == tau
    assert config.num_tables == tables
    assert config.vocab_size == 50304
    assert config.max_position_embeddings == 2048
    assert config.expand_bits == 2
    assert config.intermediate_size == (tau + 2) * tables
    assert config.tie_word_embeddings is False


def test_preset_overrides_apply():
    config = MemoryFormerConfig.from_preset("tiny", num_hidden_layers=2, hash_score="l1")
    assert config.num_hidden_layers == 2 and config.hash_score == "l1" and config.hidden_size == 512


def test_unknown_preset_is_rejected():
    with pytest.raises(ValueError, match=r"'huge'.*tiny"):
        MemoryFormerConfig.from_preset("huge")


# ---------------------------------------------------------------------------------------------------------------------
# Round trips
NON_DEFAULTS = dict(
    hash_score="l1",
    hash_temperature=0.7,
    norm_type="rmsnorm",
    use_parallel_residual=True,
    attention_output="memory",
    memory_block_activation="gelu",
    memory_bias=False,
    expand_bits=1,
    rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
)


def test_config_to_dict_from_dict_round_trip():
    config = tiny_config(**NON_DEFAULTS)
    again = MemoryFormerConfig.from_dict(config.to_dict())
    assert again.to_dict() == config.to_dict()
    for name, value in {**TINY, **NON_DEFAULTS}.items():
        assert getattr(again, name) == value, name
    assert again.intermediate_size == (4 + 1) * 16


def test_config_save_and_from_pretrained_round_trip(tmp_path):
    config = tiny_config(**NON_DEFAULTS)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "memoryformer"
    assert saved["hash_score"] == "l1" and saved["intermediate_size"] == 80
    loaded = MemoryFormerConfig.from_pretrained(tmp_path)
    for name, value in {**TINY, **NON_DEFAULTS}.items():
        assert getattr(loaded, name) == value, name
    assert loaded.intermediate_size == config.intermediate_size
    assert loaded.to_diff_dict() == config.to_diff_dict()


# ---------------------------------------------------------------------------------------------------------------------
# Every field: finite where it must be, the right type, a ValueError naming the field and the fix
@pytest.mark.parametrize("name", ["table_init_std", "hash_temperature", "layer_norm_eps", "initializer_range"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), 0.0, -0.02, "0.02", True, None])
def test_positive_float_fields_must_be_finite_and_positive(name, value):
    with pytest.raises(ValueError, match=rf"{name} must be a finite number > 0, got .*\. .*(default|paper)"):
        tiny_config(**{name: value})


def test_table_init_std_inf_is_rejected_instead_of_giving_nan_logits():
    with pytest.raises(ValueError, match=r"table_init_std must be a finite number > 0, got inf\. Use .* 0\.02"):
        tiny_config(table_init_std=float("inf"))


@pytest.mark.parametrize("name", ["attention_dropout", "hidden_dropout"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.1, 1.0, "0.1", True])
def test_dropouts_must_be_probabilities_below_one(name, value):
    with pytest.raises(ValueError, match=rf"{name} must be a number in \[0, 1\), got .*\. Use 0\.0"):
        tiny_config(**{name: value})


@pytest.mark.parametrize(
    "name", ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings"]
)
@pytest.mark.parametrize("value", ["64", 64.0, True, None])
def test_integer_fields_reject_strings_floats_and_bools(name, value):
    with pytest.raises(ValueError, match=rf"{name} must be a positive integer, got .*\. Use "):
        tiny_config(**{name: value})


@pytest.mark.parametrize("name, value", [("hash_bits", "4"), ("hash_bits", 4.0), ("expand_bits", 2.0),
                                         ("expand_bits", "2"), ("intermediate_size", 96.0), ("intermediate_size", "96")])
def test_hash_shape_fields_reject_wrong_types(name, value):
    with pytest.raises(ValueError, match=rf"{name}"):
        tiny_config(**{name: value})


@pytest.mark.parametrize("name", ["memory_bias", "use_parallel_residual", "use_cache", "tie_word_embeddings"])
@pytest.mark.parametrize("value", ["false", 0, 1, None])
def test_flags_must_be_bools(name, value):
    with pytest.raises(ValueError, match=rf"{name} must be True or False, got {value!r}\. Pass a bool"):
        tiny_config(**{name: value})


@pytest.mark.parametrize("name", ["hash_score", "norm_type", "attention_output", "memory_block_activation"])
@pytest.mark.parametrize("value", [None, 1, ["paper"]])
def test_choice_fields_reject_non_strings(name, value):
    with pytest.raises(ValueError, match=rf"{name}=.* is not supported; choose one of"):
        tiny_config(**{name: value})


@pytest.mark.parametrize("name", ["bos_token_id", "eos_token_id", "pad_token_id"])
@pytest.mark.parametrize("value", ["0", 1.0, -1, 10**9, True])
def test_token_ids_must_be_ids_in_the_vocabulary(name, value):
    with pytest.raises(ValueError, match=rf"{name} must be an integer token id.*vocab_size=.*Use the tokenizer's"):
        tiny_config(**{name: value})


def test_token_ids_accept_none_and_an_eos_list():
    config = tiny_config(bos_token_id=None, eos_token_id=[0, 1], pad_token_id=None)
    assert config.eos_token_id == [0, 1]
    with pytest.raises(ValueError, match=r"eos_token_id"):
        tiny_config(eos_token_id=[0, -1])


def test_a_config_json_with_a_string_number_is_a_value_error(tmp_path):
    tiny_config().save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    values = json.loads(path.read_text())
    values["table_init_std"] = "0.02"
    path.write_text(json.dumps(values))
    with pytest.raises(ValueError, match=r"table_init_std must be a finite number > 0, got '0\.02'"):
        MemoryFormerConfig.from_pretrained(tmp_path)
