"""FLOPs and table memory as the paper counts them (paper section 2.3, Tables 1, 3 and 5) and the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from modeling_memoryformer import MemoryFormerConfig
from modeling_memoryformer import cli
from modeling_memoryformer.evaluation.flops import (
    memory_layer_table_bytes,
    per_block_flops,
    pythia_block_flops,
    table_memory,
)

from conftest import tiny_config


SEQ = 2048
G = 1e9
MB = 1e6

# Paper Table 1 (s = 2048): preset -> (Pythia w/o attention, Pythia total, MF w/o attention, MF total), in GFLOPs.
TABLE_1 = {
    "tiny": (6.4, 10.7, 0.4, 4.7),
    "small": (14.5, 20.9, 1.0, 7.4),
    "base": (25.8, 34.4, 1.6, 10.2),
}


def giga(flops: int) -> float:
    return round(flops / G, 1)


@pytest.mark.parametrize("preset", ["tiny", "small", "base"])
def test_pythia_block_flops_reproduce_paper_table_1(preset):
    config = MemoryFormerConfig.from_preset(preset)
    d = config.hidden_size
    flops = pythia_block_flops(config, SEQ)
    assert flops["attention"] == 2 * SEQ * SEQ * d
    assert flops["without_attention"] == 12 * SEQ * d * d
    assert flops["total"] == 2 * SEQ * SEQ * d + 12 * SEQ * d * d
    assert (giga(flops["without_attention"]), giga(flops["total"])) == TABLE_1[preset][:2]


@pytest.mark.parametrize("preset", ["tiny", "base"])
def test_memoryformer_block_flops_reproduce_paper_table_1(preset):
    config = MemoryFormerConfig.from_preset(preset)
    d, k = config.hidden_size, config.num_tables
    flops = per_block_flops(config, SEQ)
    assert flops["attention"] == 2 * SEQ * SEQ * d
    assert flops["without_attention"] == 6 * k * SEQ * d
    assert flops["total"] == flops["attention"] + flops["without_attention"]
    assert (giga(flops["without_attention"]), giga(flops["total"])) == TABLE_1[preset][2:]


def test_memoryformer_small_flops_follow_the_formula_not_the_papers_rounding():
    """The paper prints 1.0 G for MF-small w/o attention; 6 K s d = 6 * 96 * 2048 * 768 = 0.906e9."""
    config = MemoryFormerConfig.from_preset("small")
    flops = per_block_flops(config, SEQ)
    assert flops["without_attention"] == 6 * 96 * 2048 * 768 == 905_969_664
    assert round(flops["without_attention"] / G, 3) == 0.906
    paper_total = TABLE_1["small"][3]
    assert abs(flops["total"] / G - paper_total) <= 0.1
    assert flops["total"] == 2 * SEQ * SEQ * 768 + 905_969_664


@pytest.mark.parametrize(
    "overrides",
    [{}, {"attention_output": "memory"}, {"expand_bits": 0}, {"hash_bits": 4}],
    ids=["default", "attention_output_memory", "e0", "tau4"],
)
def test_exact_flops_sum_k_dout_plus_hashing_over_memory_layers(overrides):
    config = MemoryFormerConfig.from_preset("tiny", **overrides)
    d, tau, e, m = config.hidden_size, config.hash_bits, config.expand_bits, config.intermediate_size
    k = d // tau
    per_token = 3 * (k * d + d)  # Q, K, V (one hash shared, counted per layer as the module documents)
    if config.attention_output == "memory":
        per_token += k * d + d
    per_token += k * m + d  # Memory Block layer 1: d -> m
    per_token += (m // (tau + e)) * d + m  # layer 2: m -> d with tau + e bits
    flops = per_block_flops(config, SEQ)
    assert flops["without_attention_exact"] == SEQ * per_token
    assert flops["total_exact"] == 2 * SEQ * SEQ * d + SEQ * per_token


@pytest.mark.parametrize(
    "in_features, hash_bits, megabytes",
    [(512, 4, 2.1), (512, 8, 16.8), (510, 10, 53.5)],  # paper Table 3: tau 4/8/10 -> K 128/64/51
)
def test_memory_layer_table_bytes_reproduce_paper_table_3(in_features, hash_bits, megabytes):
    num_bytes = memory_layer_table_bytes(in_features, 512, hash_bits)
    assert num_bytes == (in_features // hash_bits) * 2**hash_bits * 512 * 2
    assert round(num_bytes / MB, 1) == megabytes
    assert memory_layer_table_bytes(in_features, 512, hash_bits, bytes_per_value=4) == 2 * num_bytes


@pytest.mark.parametrize("expand_bits, megabytes", [(0, 33.6), (1, 52.4), (2, 88.1), (3, 157.3)])
def test_memory_block_table_memory_reproduces_paper_table_5(expand_bits, megabytes):
    config = MemoryFormerConfig.from_preset("tiny", expand_bits=expand_bits)  # d = 512, tau = 8, K = 64
    memory = table_memory(config)
    tau, k, d = 8, 64, 512
    layer1 = k * 2**tau * (tau + expand_bits) * k * 2
    layer2 = k * 2 ** (tau + expand_bits) * d * 2
    assert memory["memory_block.layer1"] == layer1
    assert memory["memory_block.layer2"] == layer2
    assert memory["memory_block"] == layer1 + layer2
    assert round(memory["memory_block"] / MB, 1) == megabytes


def test_table_memory_of_a_block_sums_every_memory_layer():
    config = MemoryFormerConfig.from_preset("tiny")
    memory = table_memory(config)
    qkv = 3 * 64 * 256 * 512 * 2
    assert round(memory["query"] / MB, 1) == 16.8
    assert memory["query"] == memory["key"] == memory["value"] == qkv // 3
    assert memory["block"] == qkv + memory["memory_block"]
    with_output = table_memory(MemoryFormerConfig.from_preset("tiny", attention_output="memory"))
    assert with_output["block"] == memory["block"] + qkv // 3


def test_table_memory_matches_the_model_parameters():
    """The accounting describes the modules that are really built (counted in values, without biases)."""
    from modeling_memoryformer import MemoryFormerModel

    config = tiny_config(attention_output="memory")
    model = MemoryFormerModel(config)
    values = sum(p.numel() for name, p in model.layers[0].named_parameters() if name.endswith("tables"))
    assert table_memory(config, bytes_per_value=1)["block"] == values


# ---------------------------------------------------------------------------------------------------------------------
# The CLI
EXPECTED_CLI_STRINGS = ["6.4 G", "0.4 G", "10.7 G", "4.7 G", "16.8 MB", "pythia-70m", "MF-tiny"]


def test_cli_flops_prints_the_table(capsys):
    assert cli.main(["flops", "--preset", "tiny", "--seq-len", "2048"]) == 0
    out = capsys.readouterr().out
    for expected in EXPECTED_CLI_STRINGS:
        assert expected in out, expected
    assert "MF-small" not in out


def test_cli_flops_rejects_a_non_positive_sequence_length(capsys):
    assert cli.main(["flops", "--preset", "tiny", "--seq-len", "0"]) == 2
    assert "--seq-len" in capsys.readouterr().err


def test_cli_flops_rejects_an_unknown_preset(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["flops", "--preset", "huge"])
    assert info.value.code == 2


@pytest.mark.slow
def test_installed_console_script_prints_the_table():
    script = Path(sys.executable).parent / "memoryformer"
    assert script.exists(), f"console script not installed next to {sys.executable}"
    result = subprocess.run(
        [str(script), "flops", "--preset", "tiny", "--seq-len", "2048"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    for expected in EXPECTED_CLI_STRINGS:
        assert expected in result.stdout, expected
