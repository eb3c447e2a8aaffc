"""PEFT / LoRA on MemoryFormer: `modeling_memoryformer.integrations.peft`.

Oracles: the base model's own logits (an adapter that starts at zero, or is disabled, must not change them);
`memory_lookup_reference` (the Memory Layer written from the equations) plus the low-rank path x A^T B^T computed by
hand, or the lookup in the updated tables T + scaling * B A; parameter counts from the config; exact equality after a
save/load round trip; and the unmerged model for merge_and_unload, in float64 (hash codes depend on each layer's
input, so float32 rounding could flip a bit).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer, ParamWrapper
from transformers import Trainer, TrainingArguments

from modeling_memoryformer import MemoryFormerForCausalLM, MemoryLayer
from modeling_memoryformer.memory_ops import memory_lookup_reference
from modeling_memoryformer.integrations.peft import (
    MEMORY_LAYER_NAMES,
    MemoryLayerLoRA,
    load_memoryformer_adapter,
    memoryformer_lora_config,
    register_memoryformer_lora,
)

from conftest import TINY, checkpointing_enable, tiny_model


R, ALPHA = 4, 8
SCALING = ALPHA / R
NUM_TABLES = TINY["hidden_size"] // TINY["hash_bits"]  # K
INTERMEDIATE = (TINY["hash_bits"] + TINY["expand_bits"]) * NUM_TABLES  # (tau + e) K: width inside the Memory Block


def peft_model(kind: str, dtype: torch.dtype = torch.float32, seed: int = 0, **options) -> PeftModel:
    """The seeded tiny model with a rank-R adapter of `kind`, in eval mode (peft creates its wrappers in training
    mode, where LoRA dropout is active and mixed-adapter batches are refused)."""
    config = memoryformer_lora_config(kind, r=R, alpha=ALPHA, **options)
    return get_peft_model(tiny_model(seed, dtype), config).eval()


def randomize_adapters(model: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    """Random A and B in every LoRA layer, so that the adapter really changes the output (B starts at zero)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * std)


def lora_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def first_wrapped(model: PeftModel, layer_name: str) -> LoraLayer:
    return next(m for name, m in model.named_modules() if name.endswith(layer_name) and isinstance(m, LoraLayer))


def lookup(layer: MemoryLayer, x: torch.Tensor, tables: torch.Tensor | None = None) -> torch.Tensor:
    """The Memory Layer from the equations, optionally with other tables."""
    tables = layer.tables if tables is None else tables
    return memory_lookup_reference(x, tables, layer.bias, layer.hash_bits, layer.score, layer.temperature)


def low_rank_path(layer: LoraLayer, x: torch.Tensor, adapter: str = "default") -> torch.Tensor:
    """scaling * x A^T B^T, by hand."""
    a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
    return layer.scaling[adapter] * (x @ a.T @ b.T)


def train_steps(model: torch.nn.Module, ids: torch.Tensor, steps: int = 5, lr: float = 1e-2) -> list[float]:
    model.train()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return losses


@pytest.fixture
def ids():
    generator = torch.Generator().manual_seed(99)
    return torch.randint(3, TINY["vocab_size"], (2, 9), generator=generator)


def layer_input(dtype: torch.dtype = torch.float64, in_features: int = TINY["hidden_size"]) -> torch.Tensor:
    return torch.randn(3, 5, in_features, generator=torch.Generator().manual_seed(7), dtype=dtype)


# ---------------------------------------------------------------------------------------------------------------------
# (a) MemoryLayerLoRA: a dense low-rank path beside the lookup.
@pytest.mark.parametrize("attention_output, per_block", [("none", 3), ("memory", 4)])
def test_memory_layer_lora_wraps_every_memory_layer(attention_output, per_block):
    base = tiny_model(attention_output=attention_output)  # "memory" adds the attention output layer `dense`
    model = get_peft_model(base, memoryformer_lora_config("memory_layers", r=R, alpha=ALPHA))
    wrapped = [name for name, m in model.named_modules() if isinstance(m, MemoryLayerLoRA)]
    memory_layers = [name for name, m in model.named_modules() if type(m) is MemoryLayer]
    assert len(wrapped) == per_block * TINY["num_hidden_layers"]
    assert sorted(f"{name}.base_layer" for name in wrapped) == sorted(memory_layers)


def test_memory_layer_lora_at_init_gives_base_logits(ids):
    base = logits(tiny_model(), ids)
    assert torch.equal(logits(peft_model("memory_layers"), ids), base)


def test_memory_layer_lora_output_is_lookup_plus_low_rank_path():
    model = peft_model("memory_layers", dtype=torch.float64)
    randomize_adapters(model, seed=1)
    for name, in_features in (("query_key_value", TINY["hidden_size"]), ("layer2", INTERMEDIATE)):
        layer = first_wrapped(model, name)
        x = layer_input(in_features=in_features)
        expected = lookup(layer.get_base_layer(), x) + SCALING * (x @ layer.lora_A["default"].weight.T) @ (
            layer.lora_B["default"].weight.T
        )
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-12)


def test_memory_layer_lora_keeps_the_memory_layer_interface():
    model = peft_model("memory_layers", dtype=torch.float64)
    randomize_adapters(model, seed=2)
    layer = first_wrapped(model, "query_key_value")
    base = layer.get_base_layer()
    assert (layer.in_features, layer.out_features) == (base.in_features, base.out_features)
    assert (layer.hash_bits, layer.num_tables, layer.score) == (base.hash_bits, base.num_tables, base.score)
    assert layer.tables is base.tables and layer.bias is base.bias
    x = layer_input()
    hashed = layer.hash(x)
    shared = base(hashed=hashed) + low_rank_path(layer, x)
    torch.testing.assert_close(layer(x, hashed=hashed), shared, rtol=0, atol=1e-12)
    assert torch.equal(layer.hash_codes(x), base.hash_codes(x))
    with pytest.raises(ValueError, match="needs the input x"):
        layer(hashed=hashed)  # the adapter path cannot be computed from the hash alone


def test_lora_dropout_drops_the_adapter_input_in_training_only():
    model = peft_model("memory_layers", dtype=torch.float64, dropout=0.5)
    randomize_adapters(model, seed=3)
    layer = first_wrapped(model, "layer1")
    x = layer_input()
    base = lookup(layer.get_base_layer(), x)
    layer.train()
    torch.manual_seed(11)
    trained = layer(x)
    torch.manual_seed(11)  # the lookup draws no random numbers: the same seed gives the same dropout mask
    dropped = F.dropout(x, p=0.5, training=True)
    torch.testing.assert_close(trained, base + low_rank_path(layer, dropped), rtol=0, atol=1e-12)
    layer.eval()
    torch.testing.assert_close(layer(x), base + low_rank_path(layer, x), rtol=0, atol=1e-12)


def test_only_lora_parameters_are_trainable():
    model = peft_model("memory_layers")
    trainable = {name: p.numel() for name, p in model.named_parameters() if p.requires_grad}
    assert all(".lora_A." in name or ".lora_B." in name for name in trainable)
    hidden = TINY["hidden_size"]
    # r * (d_in + d_out) per Memory Layer: query_key_value d -> 3d, layer1 d -> (tau+e)K, layer2 (tau+e)K -> d.
    per_block = R * ((hidden + 3 * hidden) + (hidden + INTERMEDIATE) + (INTERMEDIATE + hidden))
    assert sum(trainable.values()) == TINY["num_hidden_layers"] * per_block


@pytest.mark.slow
def test_memory_layer_lora_training_reduces_the_loss_and_leaves_the_base_frozen(ids):
    model = peft_model("memory_layers")
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" not in name}
    losses = train_steps(model, ids)
    assert losses[-1] < losses[0]
    assert all(torch.equal(p, frozen[name]) for name, p in model.named_parameters() if "lora_" not in name)


def test_memory_layer_adapter_round_trips_exactly(tmp_path, ids):
    model = peft_model("memory_layers")
    randomize_adapters(model, seed=4)
    expected = logits(model, ids)
    assert not torch.equal(expected, logits(tiny_model(), ids))
    model.save_pretrained(tmp_path)
    loaded = load_memoryformer_adapter(tiny_model(), tmp_path)
    assert isinstance(first_wrapped(loaded, "layer2"), MemoryLayerLoRA)
    assert torch.equal(logits(loaded, ids), expected)


def test_plain_peft_loading_fails_without_the_registration(tmp_path):
    peft_model("memory_layers").save_pretrained(tmp_path)  # adapter_config.json does not record the custom module
    with pytest.raises(ValueError, match="is not supported"):
        PeftModel.from_pretrained(tiny_model(), tmp_path)


def test_disable_adapter_gives_base_logits(ids):
    model = peft_model("memory_layers")
    randomize_adapters(model, seed=5)
    adapted = logits(model, ids)
    with model.disable_adapter():
        assert torch.equal(logits(model, ids), logits(tiny_model(), ids))
    assert torch.equal(logits(model, ids), adapted)


def test_multiple_adapters_switch_and_sum():
    model = peft_model("memory_layers", dtype=torch.float64)
    model.add_adapter("other", memoryformer_lora_config("memory_layers", r=2, alpha=6))
    randomize_adapters(model, seed=6)
    layer = first_wrapped(model, "query_key_value")
    x = layer_input()
    base = lookup(layer.get_base_layer(), x)
    assert layer.scaling == {"default": SCALING, "other": 3.0}
    torch.testing.assert_close(layer(x), base + low_rank_path(layer, x), rtol=0, atol=1e-12)
    model.set_adapter("other")
    torch.testing.assert_close(layer(x), base + low_rank_path(layer, x, "other"), rtol=0, atol=1e-12)
    assert all(p.requires_grad == (".other." in name) for name, p in model.named_parameters() if "lora_" in name)
    layer.set_adapter(["default", "other"])  # several active adapters on one layer add up
    both = base + low_rank_path(layer, x) + low_rank_path(layer, x, "other")
    torch.testing.assert_close(layer(x), both, rtol=0, atol=1e-12)


def test_mixed_adapter_batch_applies_each_row_its_adapter(ids):
    model = peft_model("memory_layers", dtype=torch.float64)
    randomize_adapters(model, seed=7)
    adapted, base = logits(model, ids), logits(tiny_model(dtype=torch.float64), ids)
    with torch.no_grad():
        mixed = model(ids, adapter_names=["default", "__base__"]).logits
    torch.testing.assert_close(mixed[0], adapted[0], rtol=0, atol=1e-10)
    torch.testing.assert_close(mixed[1], base[1], rtol=0, atol=1e-10)


def test_merge_and_unload_of_memory_layer_lora_raises_a_clear_error(ids):
    model = peft_model("memory_layers")
    randomize_adapters(model, seed=8)
    before = logits(model, ids)
    with pytest.raises(ValueError, match=r"not linear in x.*kind=\"tables\""):
        model.merge_and_unload()
    with pytest.raises(ValueError, match="Cannot merge a MemoryLayerLoRA"):
        model.merge_adapter()
    model.unmerge_adapter()  # nothing to undo, and no error
    assert torch.equal(logits(model, ids), before)  # nothing was merged on the way


def test_load_a_second_adapter_into_a_peft_model(tmp_path, ids):
    expected = {}
    for name, seed in (("first", 9), ("second", 10)):
        model = peft_model("memory_layers")
        randomize_adapters(model, seed=seed)
        expected[name] = logits(model, ids)
        model.save_pretrained(tmp_path / name)
    model = load_memoryformer_adapter(tiny_model(), tmp_path / "first")
    assert load_memoryformer_adapter(model, tmp_path / "second", adapter_name="second", is_trainable=True) is model
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".second." in name for name in trainable)  # the first adapter was loaded frozen
    assert torch.equal(logits(model, ids), expected["first"])
    model.set_adapter("second")
    assert torch.equal(logits(model, ids), expected["second"])


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(init_lora_weights="pissa"), "init_lora_weights='pissa' is not supported on a Memory Layer"),
        (dict(use_dora=True), "use_dora=True is not supported on a Memory Layer"),
    ],
)
def test_memory_layer_lora_rejects_dense_weight_methods(options, match):
    with pytest.raises(ValueError, match=match):
        peft_model("memory_layers", **options)


def test_registration_and_table_targets_in_one_config_are_rejected():
    config = register_memoryformer_lora(memoryformer_lora_config("tables", r=R, alpha=ALPHA))
    with pytest.raises(ValueError, match="target_parameters.*second adapter"):
        get_peft_model(tiny_model(), config)


@pytest.mark.parametrize(
    "args, match",
    [
        (dict(kind="dense"), 'kind must be "memory_layers" or "tables"'),
        (dict(kind="tables", dropout=0.1), "dropout=0.1 is not possible with LoRA on the tables"),
        (dict(kind="memory_layers", lm_head_mode="full"), 'lm_head_mode must be "lora" or "modules_to_save"'),
        (dict(kind="memory_layers", memory_layers=[]), "memory_layers must be a non-empty list"),
        (dict(kind="memory_layers", target_modules=["lm_head"]), r"\['target_modules'\] are set by"),
    ],
)
def test_config_helper_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        memoryformer_lora_config(**args)


def test_config_helper_can_restrict_the_memory_layers():
    model = peft_model("memory_layers", memory_layers=["query_key_value"])
    wrapped = [name for name, m in model.named_modules() if isinstance(m, MemoryLayerLoRA)]
    assert len(wrapped) == TINY["num_hidden_layers"] and all(n.endswith("query_key_value") for n in wrapped)
    assert set(MEMORY_LAYER_NAMES) >= {"query_key_value", "layer1", "layer2", "dense"}


# ---------------------------------------------------------------------------------------------------------------------
# (b) LoRA on the `tables` parameters (peft's ParamWrapper): T' = T + scaling * B A, mergeable.
@pytest.mark.parametrize("attention_output, per_block", [("none", 3), ("memory", 4)])
def test_table_lora_wraps_every_tables_parameter(attention_output, per_block):
    base = tiny_model(attention_output=attention_output)
    model = get_peft_model(base, memoryformer_lora_config("tables", r=R, alpha=ALPHA))
    wrapped = [m for m in model.modules() if isinstance(m, ParamWrapper)]
    assert len(wrapped) == per_block * TINY["num_hidden_layers"]
    assert all(m.parameter_name == "tables" and isinstance(m.get_base_layer(), MemoryLayer) for m in wrapped)
    assert all(".lora_A." in n or ".lora_B." in n for n, p in model.named_parameters() if p.requires_grad)


def test_table_lora_at_init_gives_base_logits(ids):
    assert torch.equal(logits(peft_model("tables"), ids), logits(tiny_model(), ids))


def test_table_lora_output_is_the_lookup_in_the_updated_tables():
    model = peft_model("tables", dtype=torch.float64)
    randomize_adapters(model, seed=12)
    layer = first_wrapped(model, "query_key_value")
    base = layer.get_base_layer()
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight  # A [r, d_out], B [K * 2**tau, r]
    assert a.shape == (R, base.out_features) and b.shape == (base.tables.shape[0], R)
    x = layer_input()
    expected = lookup(base, x, base.tables + SCALING * b @ a)
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-12)
    assert not torch.allclose(expected, lookup(base, x))


@pytest.mark.slow
def test_table_lora_training_reduces_the_loss(ids):
    model = peft_model("tables")
    tables = [m.tables.detach().clone() for m in model.modules() if type(m) is MemoryLayer]
    losses = train_steps(model, ids)
    assert losses[-1] < losses[0]
    assert all(torch.equal(m.tables, t) for m, t in zip((m for m in model.modules() if type(m) is MemoryLayer), tables))


def test_table_adapter_round_trips_exactly(tmp_path, ids):
    model = peft_model("tables")
    randomize_adapters(model, seed=13)
    expected = logits(model, ids)
    assert not torch.equal(expected, logits(tiny_model(), ids))
    model.save_pretrained(tmp_path)
    loaded = load_memoryformer_adapter(tiny_model(), tmp_path)
    assert isinstance(first_wrapped(loaded, "layer1"), ParamWrapper)
    assert torch.equal(logits(loaded, ids), expected)


def test_table_lora_merge_and_unload_matches_the_unmerged_model(ids):
    model = peft_model("tables", dtype=torch.float64)
    randomize_adapters(model, seed=14)
    unmerged = logits(model, ids)
    layer = first_wrapped(model, "layer2")
    expected_tables = layer.get_base_layer().tables + SCALING * layer.lora_B["default"].weight @ (
        layer.lora_A["default"].weight
    )
    merged = model.merge_and_unload()
    assert type(merged) is MemoryFormerForCausalLM
    assert not any(isinstance(m, LoraLayer) for m in merged.modules())
    torch.testing.assert_close(merged.model.layers[0].memory_block.layer2.tables, expected_tables, rtol=0, atol=1e-14)
    torch.testing.assert_close(logits(merged, ids), unmerged, rtol=0, atol=1e-10)


# ---------------------------------------------------------------------------------------------------------------------
# (c) The LM head: modules_to_save or LoRA, with either kind.
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["memory_layers", "tables"])
def test_lm_head_modules_to_save_round_trips_the_trained_head(tmp_path, ids, kind):
    model = peft_model(kind, include_lm_head=True)
    original_head = tiny_model().lm_head.weight.detach().clone()
    train_steps(model, ids, steps=2)
    trained_head = model.base_model.model.lm_head.modules_to_save["default"].weight.detach().clone()
    assert not torch.equal(trained_head, original_head)
    expected = logits(model, ids)
    model.save_pretrained(tmp_path)
    loaded = load_memoryformer_adapter(tiny_model(), tmp_path)
    assert torch.equal(loaded.base_model.model.lm_head.modules_to_save["default"].weight, trained_head)
    assert torch.equal(logits(loaded, ids), expected)


@pytest.mark.parametrize("kind", ["memory_layers", "tables"])
def test_lm_head_lora_round_trips(tmp_path, ids, kind):
    model = peft_model(kind, include_lm_head=True, lm_head_mode="lora")
    randomize_adapters(model, seed=15)
    head = model.base_model.model.lm_head
    assert isinstance(head, LoraLayer) and head.lora_A["default"].weight.shape == (R, TINY["hidden_size"])
    expected = logits(model, ids)
    with model.disable_adapter():
        assert not torch.equal(logits(model, ids), expected)
    model.save_pretrained(tmp_path, save_embedding_layers=False)  # the adapter only, not a copy of the base head
    loaded = load_memoryformer_adapter(tiny_model(), tmp_path)
    assert torch.equal(logits(loaded, ids), expected)


def test_table_lora_with_lm_head_lora_merges_exactly(ids):
    model = peft_model("tables", dtype=torch.float64, include_lm_head=True, lm_head_mode="lora")
    randomize_adapters(model, seed=16)
    head = model.base_model.model.lm_head
    expected_head = head.base_layer.weight + SCALING * head.lora_B["default"].weight @ head.lora_A["default"].weight
    unmerged = logits(model, ids)
    merged = model.merge_and_unload()
    torch.testing.assert_close(merged.lm_head.weight, expected_head, rtol=0, atol=1e-14)
    torch.testing.assert_close(logits(merged, ids), unmerged, rtol=0, atol=1e-10)


# ---------------------------------------------------------------------------------------------------------------------
# Training: gradient checkpointing and transformers.Trainer on a PEFT-wrapped MemoryFormer.
@pytest.mark.parametrize("kind", ["memory_layers", "tables"])
def test_gradient_checkpointing_gives_the_same_adapter_gradients(ids, kind):
    grads = []
    for checkpointing in (False, True):
        model = peft_model(kind)
        randomize_adapters(model, seed=18)  # B != 0, so that A gets a gradient too
        if checkpointing:
            checkpointing_enable(model)
        model.train()
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and all(g.abs().sum() > 0 for g in grads[0].values())
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_trainer_trains_a_peft_memoryformer(tmp_path):
    model = peft_model("memory_layers", include_lm_head=True, lm_head_mode="lora")
    before = lora_weights(model)
    generator = torch.Generator().manual_seed(17)
    rows = torch.randint(3, TINY["vocab_size"], (8, 12), generator=generator).tolist()
    dataset = [{"input_ids": row, "labels": row} for row in rows]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
    )
    result = Trainer(model=model, args=args, train_dataset=dataset).train()
    assert result.global_step == 3 and torch.isfinite(torch.tensor(result.training_loss))
    after = lora_weights(model)
    assert after.keys() == before.keys()
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert any("query_key_value.lora_B" in n for n in changed) and any("lm_head.lora_B" in n for n in changed)
