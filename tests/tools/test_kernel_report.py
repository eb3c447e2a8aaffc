"""`memoryformer kernels`: the Memory Layer shapes it plans for are the model's, its JSON has every field, and the
plans follow the cache sizes the kernel is given."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch

from modeling_memoryformer import MemoryFormerConfig, MemoryFormerForCausalLM, cli, cpu_facts, memory_ops
from modeling_memoryformer.memory_kernels import lookup_strategies
from modeling_memoryformer.evaluation import kernel_report
from modeling_memoryformer.configuration_memoryformer import PRESETS
from modeling_memoryformer.modeling_memoryformer import MemoryLayer

from conftest import tiny_config


def _model_layers(model) -> Counter:
    """(name inside a decoder layer, d_in, d_out, tau) of every MemoryLayer module, with how often it occurs."""
    found = Counter()
    for name, module in model.named_modules():
        if isinstance(module, MemoryLayer):
            match = re.fullmatch(r"model\.layers\.\d+\.(.+)", name)
            assert match, f"a Memory Layer outside the decoder layers: {name}"
            found[(match.group(1), module.in_features, module.out_features, module.hash_bits)] += 1
    return found


def _listed_layers(config) -> Counter:
    return Counter({(s.name, s.in_features, s.out_features, s.hash_bits): s.count
                    for s in kernel_report.memory_layer_shapes(config)})


@pytest.mark.parametrize("overrides", [
    {},
    {"attention_output": "memory"},
    {"expand_bits": 0, "hash_bits": 8},
    {"intermediate_size": 96, "expand_bits": 2},  # (4 + 2) * 16 = 96 by default; here explicitly
    {"intermediate_size": 48, "expand_bits": 0, "num_hidden_layers": 3},
])
def test_listed_shapes_are_the_memory_layers_of_a_real_tiny_model(overrides):
    torch.manual_seed(0)
    config = tiny_config(**overrides)
    model = MemoryFormerForCausalLM(config)
    assert _listed_layers(config) == _model_layers(model)
    for shape in kernel_report.memory_layer_shapes(config):  # the table the kernel sees is the parameter's shape
        module = next(m for n, m in model.named_modules() if n.endswith("layers.0." + shape.name))
        assert tuple(module.tables.shape) == (shape.num_tables * shape.rows_per_table, shape.out_features)
        assert shape.table_bytes(4) == module.tables.numel() * 4


@pytest.mark.parametrize("preset", PRESETS)
def test_listed_shapes_match_every_preset_built_on_the_meta_device(preset):
    config = MemoryFormerConfig.from_preset(preset)
    with torch.device("meta"):  # no memory, no initialisation cost
        model = MemoryFormerForCausalLM(config)
    assert _listed_layers(config) == _model_layers(model)


def test_cpu_features_from_cpuinfo(monkeypatch):
    x86 = ["processor\t: 0", "model name\t: Some CPU 9000",
           "flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512bw amx_tile"]
    monkeypatch.setattr(cpu_facts, "cpuinfo_lines", lambda: x86)
    assert kernel_report.cpu_model() == "Some CPU 9000"
    assert kernel_report.cpu_features() == ["sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "amx_tile"]
    arm = ["processor\t: 0", "Features\t: fp asimd evtstrm aes sve sve2 bf16 i8mm", "CPU implementer\t: 0x41"]
    monkeypatch.setattr(cpu_facts, "cpuinfo_lines", lambda: arm)
    assert kernel_report.cpu_features() == ["asimd", "bf16", "i8mm", "sve", "sve2"]


def test_sizes_parse_and_print_in_binary_units():
    assert [kernel_report.parse_size(s) for s in ("48K", "1M", "32MiB", "1G", "4096", "1.5M")] == [
        48 << 10, 1 << 20, 32 << 20, 1 << 30, 4096, 3 << 19]
    with pytest.raises(ValueError, match="not a size"):
        kernel_report.parse_size("lots")
    assert kernel_report.format_bytes(32 << 20) == "32 MiB"
    assert kernel_report.format_bytes(int(100.5 * (1 << 20))) == "100.5 MiB"


def test_json_report_has_every_field(capsys):
    assert cli.main(["kernels", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) >= {"cpu", "threads", "caches", "os_caches", "machine_info", "kernel", "preset", "config",
                           "dtype", "workloads", "layers"}
    assert report["cpu"]["model"] and isinstance(report["cpu"]["features"], list)
    assert report["threads"] == torch.get_num_threads()
    assert set(report["caches"]) == {"l1d_bytes", "l2_bytes", "l3_bytes", "source"}
    assert set(report["kernel"]) >= {"loaded", "reason", "isa", "selected"}
    assert report["preset"] == "tiny" and report["dtype"] == "float32"
    assert [w["tokens"] for w in report["workloads"]] == [1, 2048, 4096]  # decode, prefill 1 x 2048, training 8 x 512
    assert [layer["name"] for layer in report["layers"]] == [
        "attention.query_key_value", "memory_block.layer1", "memory_block.layer2"]
    for layer in report["layers"]:
        assert set(layer) >= {"in_features", "out_features", "hash_bits", "num_tables", "rows_per_table",
                              "table_bytes", "count", "plans"}
        assert [p["tokens"] for p in layer["plans"]] == [1, 2048, 4096]
    kernel = report["kernel"]
    if kernel["loaded"]:
        assert kernel["reason"] is None
        assert kernel["isa"] in ("AVX512", "AVX2", "NEON", "DEFAULT")
        assert report["caches"]["source"] == "kernel"
        info = report["machine_info"]
        assert info["l1d_bytes"] > 0 and info["l2_bytes"] > 0 and info["threads"] >= 1 and info["vector_bytes"] >= 8
        for layer in report["layers"]:
            for plan in layer["plans"]:
                assert plan["forward"] in lookup_strategies() and plan["backward"] in lookup_strategies()
    else:
        assert kernel["reason"]


def test_the_command_prints_a_table_through_main(capsys):
    assert cli.main(["kernels", "--preset", "small", "--tokens", "1", "64", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    for text in ("CPU:", "caches:", "threads:", "kernel:", "MF-small", "bfloat16",
                 "| attention.query_key_value (x12) | 768 -> 2304 | 8 | 96 |", "N=1 (decode, batch 1)", "N=64 |"):
        assert text in out, text
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "kernels" in capsys.readouterr().out


def test_bad_arguments_are_one_line_errors(capsys):
    assert cli.main(["kernels", "--tokens", "-1"]) == 2
    assert "--tokens must be >= 0" in capsys.readouterr().err
    assert cli.main(["kernels", "--cache-sizes", "48K", "lots", "32M"]) == 2
    assert "not a size" in capsys.readouterr().err


def _kernel_with(*ops: str):
    if not memory_ops.load_fused_kernels():
        pytest.skip("the fused CPU kernel is not built in this environment")
    missing = [op for op in ops if not hasattr(torch.ops.memoryformer, op)]
    if missing:
        pytest.fail(f"the fused kernel lacks {', '.join(missing)} (the ops `memoryformer kernels` reports on)")
    return torch.ops.memoryformer


# Shapes around the strategy boundaries: tables inside L2, inside L3, about L3 (d=512 -> 512), beyond L3.
BOUNDARY_SHAPES = [
    kernel_report.LayerShape("small", 64, 64, 4, 1),
    kernel_report.LayerShape("l3-ish", 256, 512, 8, 1),
    kernel_report.LayerShape("d512", 512, 512, 8, 1),
    kernel_report.LayerShape("qkv", 512, 1536, 8, 1),
]


def _llc_shape(ops) -> kernel_report.LayerShape:
    """A layer whose bfloat16 tables are about the size of this machine's last-level cache (L3, or L2 without one),
    with a width the packed pass does not take (not a multiple of its 32 columns) and a column block per thread: the
    forward is bucketed from 3/2 of the LLC, so such a layer changes plan when the caches shrink, on any CPU (the fixed
    shapes above straddle a boundary on some machines only: none of them moved on a 512 KB-L2 Zen 3)."""
    l1, l2, l3 = list(ops.machine_info())[:3]
    width = 64 * max(2, torch.get_num_threads()) + 2
    num_tables = max(1, (l3 or l2) // (256 * width * 2))
    return kernel_report.LayerShape("llc", num_tables * 8, width, 8, 1)


def _plans(ops, shapes=tuple(BOUNDARY_SHAPES), tokens=(64, 65, 512, 2048, 4096, 16384)):
    """Plans for float32 tables (packed or not by lookups per row, units per thread: the L2 sets the chunks) and
    bfloat16 ones (bucketed or not by table size against the L3)."""
    return {(s.name, n, backward, str(dtype)): kernel_report.plan_strategy(n, s, dtype, backward)
            for s in shapes for n in tokens for backward in (False, True)
            for dtype in (torch.float32, torch.bfloat16)}


def test_plans_follow_the_cache_sizes_and_detection_comes_back():
    ops = _kernel_with("machine_info", "set_cache_sizes", "plan")
    detected = list(ops.machine_info())
    shapes = (*BOUNDARY_SHAPES, _llc_shape(ops))
    before = _plans(ops, shapes)
    assert set(before.values()) <= set(lookup_strategies()), before
    l1, l2, l3 = detected[:3]
    try:
        ops.set_cache_sizes(max(1, l1 // 8), max(1, l2 // 16), max(1, l3 // 16))
        assert list(ops.machine_info())[:3] == [max(1, l1 // 8), max(1, l2 // 16), max(1, l3 // 16)]
        shrunk = _plans(ops, shapes)
        ops.set_cache_sizes(l1 * 64, l2 * 64, l3 * 64)
        grown = _plans(ops, shapes)
    finally:
        ops.set_cache_sizes(0, 0, 0)
    assert list(ops.machine_info()) == detected  # 0, 0, 0 detects again
    assert _plans(ops, shapes) == before
    assert set(shrunk.values()) | set(grown.values()) <= set(lookup_strategies()), (shrunk, grown)
    changed = {key: (before[key], shrunk[key]) for key in before if before[key] != shrunk[key]}
    assert changed, f"no plan changed when the caches shrank 16x: {before}"
    for n in (2048, 4096):  # about the LLC: gathered row by row; 16x beyond the shrunk LLC: bucketed
        assert (before[("llc", n, False, "torch.bfloat16")], shrunk[("llc", n, False, "torch.bfloat16")]) == (
            "embedding_bag", "bucketed"), (shapes[-1], n)


def test_cache_override_in_the_report_is_applied_then_undone(capsys):
    ops = _kernel_with("machine_info", "set_cache_sizes", "plan")
    detected = list(ops.machine_info())
    l1, l2, l3 = detected[:3]
    small = (max(1, l1 // 8), max(1, l2 // 16), max(1, l3 // 16))
    config = MemoryFormerConfig.from_preset("tiny")
    plain = kernel_report.collect(config, [64, 2048, 4096])
    report = kernel_report.collect(config, [64, 2048, 4096], cache_sizes=small)
    assert list(ops.machine_info()) == detected
    assert report["caches"] == {"l1d_bytes": small[0], "l2_bytes": small[1], "l3_bytes": small[2], "source": "override"}
    assert plain["caches"]["source"] == "kernel" and plain["caches"]["l3_bytes"] == l3
    for layer in report["layers"]:
        for plan in layer["plans"]:
            assert plan["forward"] in lookup_strategies() and plan["backward"] in lookup_strategies()
    sizes = [f"{small[0]}", f"{small[1]}", f"{small[2]}"]
    assert cli.main(["kernels", "--cache-sizes", *sizes]) == 0
    assert "overridden with --cache-sizes" in capsys.readouterr().out
    assert list(ops.machine_info()) == detected
