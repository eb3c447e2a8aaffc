"""Tables and LM head stored in int8 (a scale and an offset per row) or bfloat16 for inference.

Oracles, all written here: the int8 values dequantised by the formula v = q * scale + offset in float64; the Memory
Layer in float64 on those values (codes from the signs, p(z) = 1 / prod_i (1 + exp(-2|z_i|))); a float64 copy of the
model holding the dequantised tables; and, for the comparison with the float32 model, bounds from the rounding
itself (half a quantisation step per value).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import TINY, require_kernel, tiny_config, tiny_model
from modeling_memoryformer import MemoryFormerConfig, MemoryFormerForCausalLM, MemoryFormerModel, MemoryLayer
from modeling_memoryformer import memory_ops, quantization
from modeling_memoryformer.quantization import (
    Int8LMHead,
    INT8_FUSED_MAX_TOKENS,
    bf16_linear,
    int8_block,
    int8_cpu_path,
    int8_lookup,
    int8_views,
    quantize_int8_rows,
)
from test_generation import _word_level_tokenizer, greedy_by_full_forwards
from test_remote_code import load_without_the_package


TAU = 4


def dequantized_int8(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The formula, in float64: v = q * scale + offset, row by row."""
    return codes.double() * scale.double()[:, None] + offset.double()[:, None]


def layer_oracle(x: torch.Tensor, tables64: torch.Tensor, bias: torch.Tensor | None, tau: int = TAU):
    """y = sum_k p(z_k) T_k[h(z_k)] + b in float64; also the rows and scores: [N, d_in] -> ([N, d_out], rows, p)."""
    z = x.double().reshape(x.shape[0], -1, tau)  # [N, K, tau]
    codes = ((z >= 0).long() * (2 ** torch.arange(tau))).sum(-1)
    rows = codes + torch.arange(z.shape[1]) * 2**tau
    p = 1.0 / torch.prod(1.0 + torch.exp(-2.0 * z.abs()), dim=-1)
    y = (p[..., None] * tables64[rows]).sum(1)
    return (y if bias is None else y + bias.double()), rows, p


def away_from_zero(shape, seed=0):
    """Inputs with no value within 0.05 of zero: no hash bit can flip between float32 and float64."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return x + 0.05 * torch.sign(x)


def int8_layer(d_in=16, d_out=24, seed=0) -> tuple[MemoryLayer, MemoryLayer]:
    """(the float32 layer, its int8 copy)."""
    torch.manual_seed(seed)
    layer = MemoryLayer(d_in, d_out, hash_bits=TAU)
    with torch.no_grad():
        layer.bias.normal_()
    quantized = MemoryLayer(d_in, d_out, hash_bits=TAU)
    quantized.load_state_dict(layer.state_dict())
    return layer.eval(), quantized.quantize_tables_("int8")


def oracle_model(quantized: MemoryFormerForCausalLM) -> MemoryFormerForCausalLM:
    """A float64 model holding exactly the values the quantised one stores (int8 dequantised by the formula)."""
    config = MemoryFormerConfig(**{**quantized.config.to_dict(), "table_dtype": None, "lm_head_dtype": None})
    config = MemoryFormerConfig.from_dict(config.to_dict())
    model = MemoryFormerForCausalLM(config).double().eval()
    values = {}
    for name, tensor in quantized.state_dict().items():
        if name.endswith("tables_codes"):
            prefix = name.removesuffix("codes")
            scale, offset = quantized.state_dict()[prefix + "scale"], quantized.state_dict()[prefix + "offset"]
            values[prefix.removesuffix("_")] = dequantized_int8(tensor, scale, offset)
        elif name.endswith("weight_int8"):
            values["lm_head.weight"] = tensor.double() * quantized.state_dict()["lm_head.weight_scale"].double()[:, None]
        elif not name.endswith(("tables_scale", "tables_offset", "weight_scale")):
            values[name] = tensor.double()
    missing, unexpected = model.load_state_dict(values, strict=False)
    assert not unexpected and all("rotary" in name for name in missing), (missing, unexpected)
    return model


def hash_codes_seen(model, run) -> list[torch.Tensor]:
    """The codes h(z_k) every Memory Layer computed during `run()`, [batch, seq, K] each, in call order."""
    seen = []

    def record(module, args):
        z = args[0].reshape(*args[0].shape[:-1], -1, module.hash_bits)
        seen.append(((z >= 0).long() * (2 ** torch.arange(module.hash_bits))).sum(-1))

    hooks = [m.register_forward_pre_hook(record) for m in model.modules() if isinstance(m, MemoryLayer)]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return seen


@pytest.fixture
def ids():
    return torch.randint(3, TINY["vocab_size"], (4, 12), generator=torch.Generator().manual_seed(7))


# ---------------------------------------------------------------------------------------------------------------------
# Storage


def test_int8_rows_hold_the_row_minimum_and_range_and_round_to_the_nearest_step():
    tables = torch.randn(40, 24, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 40)[:, None]
    tables[3] = 0.25  # a constant row
    codes, scale, offset = int8_views(quantize_int8_rows(tables))
    assert codes.dtype == torch.uint8 and codes.shape == (40, 24)
    assert scale.dtype == offset.dtype == torch.float32 and scale.shape == offset.shape == (40,)
    low, high = tables.double().min(1).values, tables.double().max(1).values
    torch.testing.assert_close(offset.double(), low, rtol=1e-6, atol=0)
    torch.testing.assert_close(scale.double(), (high - low) / 255, rtol=1e-5, atol=1e-12)
    error = (dequantized_int8(codes, scale, offset) - tables.double()).abs()
    assert bool((error <= scale.double()[:, None] / 2 * (1 + 1e-4) + 1e-7).all())
    assert float(error[3].max()) < 1e-7


def test_int8_tables_are_views_of_one_block_in_the_embedding_bag_layout():
    _, layer = int8_layer()
    block = int8_block(layer.tables_codes, layer.tables_scale, layer.tables_offset)
    assert block is not None and block.shape == (layer.tables_codes.shape[0], 24 + 8)
    torch.testing.assert_close(torch.ops.quantized.embedding_bag_byte_unpack(block).double(),
                               dequantized_int8(layer.tables_codes, layer.tables_scale, layer.tables_offset))
    separate = [t.clone() for t in (layer.tables_codes, layer.tables_scale, layer.tables_offset)]
    assert int8_block(*separate) is None


# ---------------------------------------------------------------------------------------------------------------------
# The Memory Layer


@pytest.mark.parametrize("tokens", [1, INT8_FUSED_MAX_TOKENS, INT8_FUSED_MAX_TOKENS + 1, 37, 700])
def test_int8_layer_matches_the_float64_oracle_on_its_dequantised_tables(kernel, tokens):
    _, layer = int8_layer()
    x = away_from_zero((tokens, 16))
    tables64 = dequantized_int8(layer.tables_codes, layer.tables_scale, layer.tables_offset)
    expected, rows, p = layer_oracle(x, tables64, layer.bias)
    scale = layer_oracle(x, tables64.abs(), layer.bias.abs())[0]  # the same sum over absolute values
    with torch.no_grad():
        for y in (layer(x), layer(hashed=layer.hash(x))):
            assert y.dtype == torch.float32 and y.shape == (tokens, 24)
            assert bool(((y.double() - expected).abs() <= 1e-6 * scale + 1e-6).all())


def test_int8_layer_is_within_half_a_step_per_row_of_the_float32_layer(kernel):
    """|y_int8 - y_float32| <= sum_k p(z_k) * scale[row_k] / 2: each stored value is off by at most half a step."""
    float_layer, layer = int8_layer()
    x = away_from_zero((300, 16), seed=1)
    _, rows, p = layer_oracle(x, float_layer.tables.double(), None)
    bound = (p * layer.tables_scale.double()[rows] / 2).sum(1, keepdim=True)
    with torch.no_grad():
        error = (layer(x).double() - float_layer(x).double()).abs()
    assert bool((error <= bound * (1 + 1e-4) + 1e-5).all())
    assert float(error.max()) > 0  # the tables really are rounded


def test_the_dequantising_path_of_other_devices_matches_the_embedding_bag():
    """Separate tensors (as on a GPU, or before assembly) take the PyTorch path: few rows gathered and dequantised, or
    the whole table dequantised; both equal the 8-bit embedding bag on the assembled block."""
    _, layer = int8_layer()
    codes, scale, offset = (t.clone() for t in (layer.tables_codes, layer.tables_scale, layer.tables_offset))
    for tokens in (2, 200):  # 2 x 4 rows < 64 table rows; 200 x 4 rows > 64
        x = away_from_zero((tokens, 16), seed=tokens)
        rows, scores = layer.hash(x)
        fast = int8_lookup(rows, scores, layer.tables_codes, layer.tables_scale, layer.tables_offset, layer.bias,
                           torch.float32)
        plain = int8_lookup(rows, scores, codes, scale, offset, layer.bias, torch.float32)
        torch.testing.assert_close(plain, fast, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# The CPU passes over the assembled block: the fused kernel's int8_lookup and FBGEMM's 8-bit embedding bag


def packed_block(rows: int, d: int, seed: int) -> torch.Tensor:
    """A [rows, d + 8] block in the row-wise layout, written byte by byte (any d, also not a multiple of 4, so the
    scale and offset can sit unaligned): random codes, scales of several magnitudes, offsets of both signs."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, d), generator=g, dtype=torch.uint8)
    scale = torch.rand(rows, generator=g) * torch.logspace(-3, 0, rows) + 1e-4
    offset = -128 * scale * (1 + 0.5 * torch.randn(rows, generator=g))
    return torch.cat([codes, scale.view(torch.uint8).reshape(rows, 4), offset.view(torch.uint8).reshape(rows, 4)], 1)


def int8_formula(rows, scores, packed, bias):
    """(sum_k s * (q * scale + offset)[row] (+ b), the same sum over absolute values), float64, from the bytes."""
    d = packed.shape[1] - 8
    scale = packed[:, d : d + 4].contiguous().view(torch.float32).double()
    offset = packed[:, d + 4 :].contiguous().view(torch.float32).double()
    codes = packed[:, :d].double()
    values = codes * scale + offset
    magnitudes = codes * scale.abs() + offset.abs()
    s = scores.double()[..., None]
    y, size = (s * values[rows]).sum(-2), (s.abs() * magnitudes[rows]).sum(-2)
    if bias is not None:
        y, size = y + bias.double(), size + bias.double().abs()
    return y, size


INT8_SHAPES = [  # (tokens, tables, rows per table, d): one token, spans whole and ragged on every vector width
    (1, 4, 16, 24),
    (1, 64, 256, 512),
    (3, 3, 8, 300),
    (5, 4, 16, 30),  # d not a multiple of 4: the scale and offset are unaligned
    (37, 4, 16, 100),
    (130, 8, 16, 776),
    (1, 64, 256, 1536),  # a decode step's Q/K/V rows: the columns split over the threads
    (2, 64, 16, 1000),  # as many columns split per token, ragged
]


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("tokens, tables, per_table, d", INT8_SHAPES)
def test_fused_int8_lookup_matches_the_float64_formula_and_fbgemm(tokens, tables, per_table, d, with_bias):
    require_kernel("fused")
    g = torch.Generator().manual_seed(tokens * 1000 + d)
    packed = packed_block(tables * per_table, d, seed=d)
    rows = torch.randint(0, per_table, (tokens, tables), generator=g) + torch.arange(tables) * per_table
    scores = torch.rand(tokens, tables, generator=g) * 2 - 0.5  # negative weights too
    bias = torch.randn(d, generator=g) if with_bias else None
    expected, size = int8_formula(rows, scores, packed, bias)
    fused = torch.ops.memoryformer.int8_lookup(rows, scores, packed, bias, per_table)
    assert fused.dtype == torch.float32 and fused.shape == (tokens, d)
    assert bool(((fused.double() - expected).abs() <= 1e-6 * size + 1e-7).all())
    fbgemm = torch.ops.quantized.embedding_bag_byte_rowwise_offsets(packed, rows, None, False, 0, False, scores, None,
                                                                    False)
    if bias is not None:
        fbgemm = fbgemm + bias
    assert bool(((fused.double() - fbgemm.double()).abs() <= 2e-6 * size + 2e-7).all())


def test_fused_int8_lookup_gives_the_same_bits_on_any_number_of_threads():
    """One token's columns split over 1, 2, 3 or 5 threads: each column is summed in the same order, same bits."""
    require_kernel("fused")
    g = torch.Generator().manual_seed(7)
    packed = packed_block(64 * 64, 1000, seed=3)
    rows = torch.randint(0, 64, (1, 64), generator=g) + torch.arange(64) * 64
    scores = torch.rand(1, 64, generator=g)
    before, results = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3, 5):
            torch.set_num_threads(threads)
            results.append(torch.ops.memoryformer.int8_lookup(rows, scores, packed, None, 64))
    finally:
        torch.set_num_threads(before)
    expected, size = int8_formula(rows, scores, packed, None)
    assert bool(((results[0].double() - expected).abs() <= 1e-6 * size + 1e-7).all())
    assert all(torch.equal(y, results[0]) for y in results[1:])


def test_the_rule_takes_the_fused_pass_for_few_tokens_and_fbgemm_beyond(monkeypatch):
    """int8_cpu_path says "fused" up to INT8_FUSED_MAX_TOKENS tokens, and int8_lookup calls exactly that op."""
    require_kernel("fused")
    assert [int8_cpu_path(n) for n in (1, INT8_FUSED_MAX_TOKENS, INT8_FUSED_MAX_TOKENS + 1, 2048)] == [
        "fused", "fused", "fbgemm", "fbgemm"]
    _, layer = int8_layer()
    calls = []
    for namespace, name in ((torch.ops.memoryformer, "int8_lookup"),
                            (torch.ops.quantized, "embedding_bag_byte_rowwise_offsets")):
        real = getattr(namespace, name)
        monkeypatch.setattr(namespace, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    tables64 = dequantized_int8(layer.tables_codes, layer.tables_scale, layer.tables_offset)
    with memory_ops.use_kernel("fused"), torch.no_grad():
        for tokens in (1, INT8_FUSED_MAX_TOKENS, INT8_FUSED_MAX_TOKENS + 1, 300):
            calls.clear()
            x = away_from_zero((tokens, 16), seed=tokens)
            y = layer(x)
            want = "int8_lookup" if tokens <= INT8_FUSED_MAX_TOKENS else "embedding_bag_byte_rowwise_offsets"
            assert calls == [want], (tokens, calls)
            expected = layer_oracle(x, tables64, layer.bias)[0]
            torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)
    calls.clear()
    with memory_ops.use_kernel("torch"), torch.no_grad():  # without the fused kernel: FBGEMM for any token count
        layer(away_from_zero((1, 16)))
    assert calls == ["embedding_bag_byte_rowwise_offsets"]


@pytest.mark.parametrize("path", ["fused", "fbgemm"])
def test_a_forced_int8_path_is_taken_at_any_token_count(monkeypatch, path):
    require_kernel("fused")
    monkeypatch.setattr(quantization, "FORCE_INT8_PATH", path)
    assert int8_cpu_path(1) == int8_cpu_path(4096) == path
    _, layer = int8_layer()
    x = away_from_zero((300, 16), seed=3)
    tables64 = dequantized_int8(layer.tables_codes, layer.tables_scale, layer.tables_offset)
    with memory_ops.use_kernel("fused"), torch.no_grad():
        torch.testing.assert_close(layer(x).double(), layer_oracle(x, tables64, layer.bias)[0], rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(quantization, "FORCE_INT8_PATH", "fast")
    with pytest.raises(ValueError, match=r"FORCE_INT8_PATH must be one of \('fused', 'fbgemm'\) or None, got 'fast'"):
        int8_cpu_path(1)


def test_a_loaded_int8_layer_is_assembled_into_one_block_on_first_use():
    _, layer = int8_layer()
    fresh = MemoryLayer(16, 24, hash_bits=TAU, table_dtype="int8")
    fresh.load_state_dict(layer.state_dict())
    for name in ("tables_codes", "tables_scale", "tables_offset"):  # three separate tensors, as from_pretrained sets
        setattr(fresh, name, getattr(layer, name).clone())
    assert int8_block(fresh.tables_codes, fresh.tables_scale, fresh.tables_offset) is None
    x = away_from_zero((5, 16))
    with torch.no_grad():
        assert torch.equal(fresh(x), layer(x))
    assert int8_block(fresh.tables_codes, fresh.tables_scale, fresh.tables_offset) is not None


# ---------------------------------------------------------------------------------------------------------------------
# The LM head


def test_int8_head_is_within_its_rounding_of_the_float64_product():
    """W ~ q * s with s = max|row| / 127; PyTorch's dynamic linear also rounds the input to 7-bit steps of
    (max(x, 0) - min(x, 0)) / 127 over the whole input: |error| <= step / 2 * sum_i |W_vi| per logit."""
    weight = torch.randn(TINY["vocab_size"], 64, generator=torch.Generator().manual_seed(0))
    head = Int8LMHead.from_weight(weight)
    torch.testing.assert_close(head.weight_scale, weight.abs().amax(1) / 127)
    w64 = head.weight_int8.double() * head.weight_scale.double()[:, None]
    assert bool(((w64 - weight.double()).abs() <= head.weight_scale.double()[:, None] / 2 * (1 + 1e-5)).all())
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1))
    step = (x.max().clamp(min=0) - x.min().clamp(max=0)).double() / 127
    bound = step / 2 * w64.abs().sum(1) * (1 + 1e-3) + 1e-5
    with torch.no_grad():
        y = head(x)
    assert y.shape == (3, 5, TINY["vocab_size"]) and y.dtype == torch.float32
    assert bool(((y.double() - x.double() @ w64.T).abs() <= bound).all())


def test_int8_head_without_the_quantised_linear_op_dequantises(monkeypatch):
    head = Int8LMHead.from_weight(torch.randn(50, 64, generator=torch.Generator().manual_seed(0)))
    monkeypatch.setattr(head, "_fbgemm_weight", lambda: None)  # as on a device without FBGEMM
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(1))
    w64 = head.weight_int8.double() * head.weight_scale.double()[:, None]
    with torch.no_grad():
        torch.testing.assert_close(head(x).double(), x.double() @ w64.T, rtol=1e-5, atol=1e-5)


def test_bf16_head_rounds_the_input_once_and_sums_in_float32():
    weight = torch.randn(50, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(1))
    y = bf16_linear(x, weight, None)
    assert y.dtype == torch.float32
    expected = x.double() @ weight.double().T
    # the input rounded to bfloat16 (2**-9 relative) and the output too (2**-9 of |y|): 2**-8 of sum |x| |W| bounds both
    bound = 2.0**-8 * (x.double().abs() @ weight.double().abs().T) + 1e-6
    assert bool(((y.double() - expected).abs() <= bound).all())


# ---------------------------------------------------------------------------------------------------------------------
# The model


@pytest.mark.parametrize("lm_head", [None, "int8", "bf16"])
def test_int8_model_matches_a_float64_model_holding_the_dequantised_values(kernel, ids, lm_head):
    model = tiny_model().quantize_tables("int8", lm_head=lm_head)
    oracle = oracle_model(model)
    with torch.no_grad():
        logits = model(ids).logits
        expected = oracle(ids).logits
    codes = hash_codes_seen(model, lambda: model(ids))
    oracle_codes = hash_codes_seen(oracle, lambda: oracle(ids))
    assert all(torch.equal(a, b) for a, b in zip(codes, oracle_codes))  # no hash flips from float rounding alone
    # float32 sums: 1e-4 of the logits' scale; the int8 head also rounds its input (3e-2, see the head's own test)
    tolerance = {None: 1e-4, "bf16": 1e-2, "int8": 3e-2}[lm_head] * float(expected.abs().max())
    assert float((logits.double() - expected).abs().max()) <= tolerance


@pytest.mark.parametrize(
    "tables, lm_head, tolerance",
    [("int8", None, 0.02), ("int8", "int8", 0.05), ("bf16", None, 0.01), ("bf16", "bf16", 0.01)],
)
def test_quantized_logits_stay_close_to_the_float32_model_away_from_hash_boundaries(kernel, tables, lm_head,
                                                                                     tolerance):
    """One block, so a hash bit flipped by the rounding at position t changes position t only (the Q/K/V layer hashes
    the embeddings, which are not quantised): compare the positions where every Memory Layer chose the same buckets
    in both models. Tolerance, as a share of the largest |logit|: about 2.5x the largest error seen on these seeds
    (int8 tables 0.8%, int8 head 2.1%, bf16 0.5%)."""
    ids = torch.randint(3, TINY["vocab_size"], (8, 16), generator=torch.Generator().manual_seed(1))
    reference = tiny_model(num_hidden_layers=1)
    model = tiny_model(num_hidden_layers=1).quantize_tables(tables, lm_head=lm_head)
    with torch.no_grad():
        codes = hash_codes_seen(reference, lambda: reference(ids))
        quantized_codes = hash_codes_seen(model, lambda: model(ids))
        expected, logits = reference(ids).logits, model(ids).logits
    same = torch.ones(ids.shape, dtype=torch.bool)
    for a, b in zip(codes, quantized_codes):
        same &= (a == b).all(-1)
    assert float(same.float().mean()) >= 0.5, "too few positions away from the hash boundaries to compare"
    error = (logits - expected).abs().amax(-1)[same]
    assert float(error.max()) <= tolerance * float(expected.abs().max())


def test_bf16_tables_are_bfloat16_parameters_and_the_outputs_stay_float32(ids):
    model = tiny_model().quantize_tables("bf16", lm_head="bf16")
    layers = [m for m in model.modules() if isinstance(m, MemoryLayer)]
    assert all(layer.tables.dtype == torch.bfloat16 and layer.bias.dtype == torch.float32 for layer in layers)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.config.table_dtype == "bfloat16" and model.config.lm_head_dtype == "bfloat16"
    with torch.no_grad():
        assert model(ids).logits.dtype == torch.float32


def test_generate_with_int8_tables_is_the_greedy_loop_of_the_float64_oracle(ids):
    model = tiny_model().quantize_tables("int8")
    prompt = ids[:2, :5]
    with torch.no_grad():
        generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
    assert torch.equal(generated, greedy_by_full_forwards(oracle_model(model), prompt, 8))


def test_pipeline_generates_with_int8_tables_and_head():
    from transformers import pipeline

    tokenizer = _word_level_tokenizer()
    model = tiny_model().quantize_tables("int8", lm_head="int8")
    text = "w5 w17 w99 w42 w8"
    ids = tokenizer(text, return_tensors="pt").input_ids
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    out = generator(text, max_new_tokens=6, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
    assert out == greedy_by_full_forwards(model, ids, 6)[0].tolist()


def test_quantize_tables_divides_the_table_bytes():
    def table_bytes(model):
        return sum(t.numel() * t.element_size() for name, t in model.state_dict().items() if ".tables" in name)

    float_bytes = table_bytes(tiny_model())
    rows = sum(m.tables.shape[0] for m in tiny_model().modules() if isinstance(m, MemoryLayer))
    assert table_bytes(tiny_model().quantize_tables("bf16")) == float_bytes // 2
    assert table_bytes(tiny_model().quantize_tables("int8")) == float_bytes // 4 + 8 * rows


# ---------------------------------------------------------------------------------------------------------------------
# Saving and loading


@pytest.mark.parametrize("tables, lm_head", [("int8", "int8"), ("bf16", "bf16"), ("int8", None)])
def test_save_and_load_round_trip_is_exact(tmp_path, ids, tables, lm_head):
    model = tiny_model().quantize_tables(tables, lm_head=lm_head)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    state = model.state_dict()
    assert sorted(saved) == sorted(state)
    for name, tensor in state.items():
        assert saved[name].dtype == tensor.dtype and torch.equal(saved[name], tensor), name
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["table_dtype"] == {"int8": "int8", "bf16": "bfloat16"}[tables]
    assert config["lm_head_dtype"] == {None: None, "int8": "int8", "bf16": "bfloat16"}[lm_head]
    if tables == "int8":
        assert saved["model.layers.0.attention.query_key_value.tables_codes"].dtype == torch.uint8
        assert not any(name.endswith(".tables") for name in saved)

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is MemoryFormerForCausalLM and loaded.config.table_dtype == model.config.table_dtype
    for name, tensor in loaded.state_dict().items():
        assert tensor.dtype == state[name].dtype and torch.equal(tensor, state[name]), name
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.slow
def test_a_quantized_folder_loads_with_remote_code_without_the_package(tmp_path, ids):
    model = tiny_model(attention_output="memory").quantize_tables("int8", lm_head="int8")
    folder = tmp_path / "quantized"
    model.save_pretrained(folder)
    assert (folder / "quantization.py").read_bytes() == Path(quantization.__file__).read_bytes()
    report, remote = load_without_the_package(folder, ids, tmp_path)
    assert report["lm_class"].startswith("transformers_modules.")
    with torch.no_grad():
        logits = model(ids).logits
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert torch.equal(remote["logits"], logits)
    assert torch.equal(remote["generated"], generated)


# ---------------------------------------------------------------------------------------------------------------------
# Training is refused


@pytest.mark.parametrize("tables, lm_head", [("int8", None), (None, "int8")])
def test_a_quantized_model_refuses_train_and_backward_naming_the_fix(ids, tables, lm_head):
    model = tiny_model()
    if tables:
        model.quantize_tables(tables, lm_head=lm_head)
    else:
        model.quantize_lm_head(lm_head)
    with pytest.raises(RuntimeError, match=r"inference only.*dequantize_tables\(\)"):
        model.train()
    assert not any(m.training for m in model.modules())  # refused before any submodule changed mode
    loss = model(ids, labels=ids).loss  # a forward with autograd on works (inference without no_grad) ...
    with pytest.raises(RuntimeError, match=r"inference only.*dequantize_tables\(\)"):
        loss.backward()  # ... but no gradient comes out of it


def test_dequantize_tables_gives_trainable_float32_tables_holding_the_int8_values(ids):
    model = tiny_model().quantize_tables("int8", lm_head="int8")
    layer = model.model.layers[0].memory_block.layer2
    expected = dequantized_int8(layer.tables_codes, layer.tables_scale, layer.tables_offset)
    head = model.lm_head.weight_int8.double() * model.lm_head.weight_scale.double()[:, None]
    model.dequantize_tables()
    assert model.config.table_dtype is None and model.config.lm_head_dtype is None
    assert layer.tables.dtype == torch.float32 and layer.tables.requires_grad
    torch.testing.assert_close(layer.tables.double(), expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(model.lm_head.weight.double(), head, rtol=1e-6, atol=1e-7)
    model.train()
    model(ids, labels=ids).loss.backward()
    assert layer.tables.grad is not None and model.lm_head.weight.grad is not None


# ---------------------------------------------------------------------------------------------------------------------
# Bad arguments


@pytest.mark.parametrize("dtype", ["int4", "fp8", "float16", 8])
def test_unknown_dtypes_are_rejected_naming_the_choices(dtype):
    with pytest.raises(ValueError, match="choose 'int8'"):
        tiny_model().quantize_tables(dtype)
    with pytest.raises(ValueError, match="choose 'int8'"):
        tiny_config(table_dtype=dtype)
    with pytest.raises(ValueError, match="choose 'int8'"):
        tiny_config(lm_head_dtype=dtype)


def test_aliases_are_read_as_one_name():
    assert tiny_config(table_dtype="bf16").table_dtype == "bfloat16"
    assert tiny_config(table_dtype=torch.bfloat16).table_dtype == "bfloat16"
    assert tiny_config(lm_head_dtype="INT8").lm_head_dtype == "int8"
    assert tiny_config().table_dtype is None and tiny_config().lm_head_dtype is None


def test_bad_combinations_are_rejected_with_the_fix():
    with pytest.raises(ValueError, match="quantize_lm_head"):
        tiny_model().quantize_tables(None)
    with pytest.raises(ValueError, match="round them twice"):
        tiny_model().quantize_tables("int8").quantize_tables("bf16")
    with pytest.raises(ValueError, match="round it twice"):
        tiny_model().quantize_lm_head("int8").quantize_lm_head("bf16")
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        tiny_config(lm_head_dtype="int8", tie_word_embeddings=True)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        tiny_model(tie_word_embeddings=True).quantize_lm_head("int8")
    with pytest.raises(ValueError, match="multiple of 4"):
        MemoryFormerConfig(vocab_size=32, hidden_size=6, num_attention_heads=2, hash_bits=3, table_dtype="int8")
    with pytest.raises(ValueError, match="multiple of 4"):
        MemoryLayer(8, 6, hash_bits=4, table_dtype="int8")
    with pytest.raises(ValueError, match="LM head"):
        MemoryFormerModel(tiny_config()).quantize_lm_head("int8")


def test_an_int8_checkpoint_without_its_scales_is_refused(tmp_path):
    """Before: it loaded with a log warning, and its logits were NaN."""
    from safetensors.torch import save_file

    tiny_model().quantize_tables("int8").save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    state = {k: v for k, v in load_file(path).items() if not k.endswith(".tables_scale")}
    save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"6 missing \(model\.layers\.0\.attention\.query_key_value\.tables_scale"):
        MemoryFormerForCausalLM.from_pretrained(tmp_path)


def test_an_int8_lm_head_without_its_scales_is_refused(tmp_path):
    from safetensors.torch import save_file

    tiny_model().quantize_lm_head("int8").save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    state = {k: v for k, v in load_file(path).items() if k != "lm_head.weight_scale"}
    save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"1 missing \(lm_head\.weight_scale\).*without their scales"):
        MemoryFormerForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("direction", ["int8 config over a float head", "float config over an int8 head"])
def test_a_config_whose_lm_head_dtype_contradicts_the_weights_is_refused_with_the_fix(tmp_path, direction):
    model = tiny_model()
    if direction == "float config over an int8 head":
        model.quantize_lm_head("int8")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["lm_head_dtype"] = None if config.get("lm_head_dtype") == "int8" else "int8"
    (tmp_path / "config.json").write_text(json.dumps(config))
    fix = "set lm_head_dtype to null in config.json" if config["lm_head_dtype"] == "int8" else "does not say lm_head"
    with pytest.raises(ValueError, match=fix):
        MemoryFormerForCausalLM.from_pretrained(tmp_path)


def test_a_base_model_checkpoint_gets_a_new_int8_head(tmp_path):
    """transformers' convention for a missing head, in the storage config.json asks for: the int8 rounding of an
    N(0, initializer_range) head (not the uninitialised memory transformers leaves in a buffer), reported missing."""
    base = MemoryFormerModel(tiny_config(lm_head_dtype="int8"))
    base.save_pretrained(tmp_path)
    model, info = MemoryFormerForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert set(info["missing_keys"]) == {"lm_head.weight_int8", "lm_head.weight_scale"}
    weight = model.lm_head.dequantized_weight()
    assert abs(weight.std().item() - TINY["initializer_range"]) < 0.05 and abs(weight.mean().item()) < 0.05
    assert torch.all(model.lm_head.weight_int8.abs().amax(dim=1) == 127) and torch.all(model.lm_head.weight_scale > 0)
    assert torch.isfinite(model(torch.tensor([[5, 6, 7]])).logits).all()


@pytest.mark.parametrize("direction", ["int8 config over float tables", "float config over int8 tables"])
def test_a_config_whose_table_dtype_contradicts_the_weights_is_refused_with_the_fix(tmp_path, direction):
    """Before: int8 in config.json over float32 tables loaded with random int8 tables (9 tensors missing)."""
    model = tiny_model()
    if direction == "float config over int8 tables":
        model.quantize_tables("int8")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["table_dtype"] = None if config.get("table_dtype") == "int8" else "int8"
    (tmp_path / "config.json").write_text(json.dumps(config))
    fix = "set table_dtype to null in config.json" if config["table_dtype"] == "int8" else "does not say table_dtype"
    with pytest.raises(ValueError, match=fix):
        MemoryFormerForCausalLM.from_pretrained(tmp_path)
