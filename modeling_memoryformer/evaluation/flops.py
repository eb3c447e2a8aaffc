"""FLOPs and table memory, counted as the paper counts them (one multiply-add = one FLOP).

Per block at sequence length s and width d (paper section 3.2 and Table 1):
- attention maths, softmax(QK^T)V: 2 s^2 d (same in both models);
- dense transformer (the Pythia twin): fully-connected layers 12 s d^2 (QKV 3d^2, output d^2, MLP 8d^2);
- MemoryFormer: Memory Layers ~ 6 K s d (the paper's approximation, `without_attention`), or exactly
  s * sum over Memory Layers of (K * d_out + d_in), the lookup-accumulate plus one operation per input value for
  hashing (`without_attention_exact`).
Table memory is K * 2**tau * d_out values per Memory Layer (bias excluded, as in paper Tables 3 and 5); the
paper quotes float16 bytes with 1 MB = 1e6 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass


PYTHIA_TWINS = {  # (layers, hidden, heads) -> Pythia checkpoint of the same shape
    (6, 512, 8): "pythia-70m",
    (12, 768, 12): "pythia-160m",
    (24, 1024, 16): "pythia-410m",
    (16, 2048, 8): "pythia-1b",
}


@dataclass(frozen=True)
class MemoryLayerShape:
    name: str
    in_features: int
    out_features: int
    hash_bits: int

    @property
    def num_tables(self) -> int:
        return self.in_features // self.hash_bits

    @property
    def table_values(self) -> int:
        return self.num_tables * 2**self.hash_bits * self.out_features

    def flops_per_token(self) -> int:
        """K * d_out multiply-adds for the weighted sum, plus d_in for hashing and scoring."""
        return self.num_tables * self.out_features + self.in_features


def memory_layer_table_bytes(in_features: int, out_features: int, hash_bits: int, bytes_per_value: int = 2) -> int:
    """Bytes of the K = in_features / hash_bits tables of 2**hash_bits rows of out_features values."""
    return MemoryLayerShape("", in_features, out_features, hash_bits).table_values * bytes_per_value


def memory_layers(config) -> list[MemoryLayerShape]:
    """The Memory Layers of one block, Q, K and V listed separately (they share one hash)."""
    d, tau = config.hidden_size, config.hash_bits
    layers = [MemoryLayerShape(name, d, d, tau) for name in ("query", "key", "value")]
    if config.attention_output == "memory":
        layers.append(MemoryLayerShape("attention_output", d, d, tau))
    layers.append(MemoryLayerShape("memory_block.layer1", d, config.intermediate_size, tau))
    layers.append(MemoryLayerShape("memory_block.layer2", config.intermediate_size, d, tau + config.expand_bits))
    return layers


def attention_flops(hidden_size: int, seq_len: int) -> int:
    """QK^T and (softmax)V: 2 s^2 d."""
    return 2 * seq_len * seq_len * hidden_size


def per_block_flops(config, seq_len: int) -> dict[str, int]:
    """FLOPs of one MemoryFormer block (paper Table 1 counting).

    Keys: attention, without_attention (paper: 6 K s d), total, and without_attention_exact / total_exact
    (the sum over this config's Memory Layers, hashing included).
    """
    d, k = config.hidden_size, config.num_tables
    attention = attention_flops(d, seq_len)
    approx = 6 * k * seq_len * d
    exact = seq_len * sum(layer.flops_per_token() for layer in memory_layers(config))
    return {
        "attention": attention,
        "without_attention": approx,
        "total": attention + approx,
        "without_attention_exact": exact,
        "total_exact": attention + exact,
    }


def pythia_block_flops(config, seq_len: int) -> dict[str, int]:
    """FLOPs of one block of the config's dense twin (GPT-NeoX, 4d MLP): 2 s^2 d + 12 s d^2."""
    d = config.hidden_size
    attention = attention_flops(d, seq_len)
    dense = 12 * seq_len * d * d
    return {"attention": attention, "without_attention": dense, "total": attention + dense}


def table_memory(config, bytes_per_value: int = 2) -> dict[str, int]:
    """Table bytes per Memory Layer of one block, plus `memory_block` (its two layers) and `block` (all)."""
    sizes = {layer.name: layer.table_values * bytes_per_value for layer in memory_layers(config)}
    sizes["memory_block"] = sizes["memory_block.layer1"] + sizes["memory_block.layer2"]
    sizes["block"] = sum(v for name, v in sizes.items() if name != "memory_block")
    return sizes


def pythia_block_weight_bytes(config, bytes_per_value: int = 2) -> int:
    """Bytes of the dense twin's fully-connected weights in one block (12 d^2 values, biases excluded)."""
    return 12 * config.hidden_size**2 * bytes_per_value


def pythia_twin_name(config) -> str:
    key = (config.num_hidden_layers, config.hidden_size, config.num_attention_heads)
    return PYTHIA_TWINS.get(key, f"GPT-NeoX twin (d={config.hidden_size}, {config.num_hidden_layers} layers)")


def _giga(flops: int) -> str:
    return f"{flops / 1e9:.1f} G"


def _mb(num_bytes: int) -> str:
    return f"{num_bytes / 1e6:.1f} MB"


def comparison_table(configs: dict[str, object], seq_len: int, bytes_per_value: int = 2) -> str:
    """Markdown table: FLOPs per block (paper Table 1) and table memory, each MemoryFormer beside its twin."""
    columns, rows = [], {
        "FLOPs w/o attention (paper formula)": [],
        "FLOPs w/o attention (exact sum)": [],
        "attention FLOPs": [],
        "total FLOPs": [],
        "FC weights / tables per block": [],
        "FC weights / tables, whole model": [],
    }
    for name, config in configs.items():
        mf, dense = per_block_flops(config, seq_len), pythia_block_flops(config, seq_len)
        memory, dense_bytes = table_memory(config, bytes_per_value), pythia_block_weight_bytes(config, bytes_per_value)
        columns += [pythia_twin_name(config), f"MF-{name}"]
        rows["FLOPs w/o attention (paper formula)"] += [_giga(dense["without_attention"]), _giga(mf["without_attention"])]
        rows["FLOPs w/o attention (exact sum)"] += [_giga(dense["without_attention"]), _giga(mf["without_attention_exact"])]
        rows["attention FLOPs"] += [_giga(dense["attention"]), _giga(mf["attention"])]
        rows["total FLOPs"] += [_giga(dense["total"]), _giga(mf["total"])]
        rows["FC weights / tables per block"] += [_mb(dense_bytes), _mb(memory["block"])]
        layers = config.num_hidden_layers
        rows["FC weights / tables, whole model"] += [_mb(dense_bytes * layers), _mb(memory["block"] * layers)]
    lines = [
        f"Per block, sequence length {seq_len}; memory in {8 * bytes_per_value}-bit values, 1 MB = 1e6 bytes.",
        "",
        "| | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    lines += [f"| {label} | " + " | ".join(values) + " |" for label, values in rows.items()]
    return "\n".join(lines)


def layer_memory_table(config, bytes_per_value: int = 2) -> str:
    """Markdown table of table memory per Memory Layer of one block."""
    lines = [
        "| Memory Layer | d_in -> d_out | tau | K | table shape | bytes | memory |",
        "|---|---|---|---|---|---|---|",
    ]
    for layer in memory_layers(config):
        lines.append(
            f"| {layer.name} | {layer.in_features} -> {layer.out_features} | {layer.hash_bits} | {layer.num_tables} "
            f"| {layer.num_tables} x [{2**layer.hash_bits} x {layer.out_features}] "
            f"| {layer.table_values * bytes_per_value:,} | {_mb(layer.table_values * bytes_per_value)} |"
        )
    memory = table_memory(config, bytes_per_value)
    lines.append(f"| Memory Block (layer1 + layer2) | | | | | {memory['memory_block']:,} | {_mb(memory['memory_block'])} |")
    lines.append(f"| whole block | | | | | {memory['block']:,} | {_mb(memory['block'])} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# `memoryformer flops` (its options: evaluation.settings.FlopsSettings)

BYTES_PER_VALUE = {"fp16": 2, "bf16": 2, "fp32": 4}


def run_flops(settings) -> int:
    """Print the FLOPs / memory comparison of `settings.presets` against their Pythia twins, and the table memory
    of each preset's Memory Layers."""
    from ..configuration_memoryformer import MemoryFormerConfig

    configs = {name: MemoryFormerConfig.from_preset(name) for name in settings.presets}
    bytes_per_value = BYTES_PER_VALUE[settings.dtype]
    print(comparison_table(configs, settings.seq_len, bytes_per_value))
    for name, config in configs.items():
        print(f"\nMF-{name}: table memory per Memory Layer ({settings.dtype})\n")
        print(layer_memory_table(config, bytes_per_value))
    return 0
