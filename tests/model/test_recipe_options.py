"""The two recipe options that set the paper's text against the authors' code: the table init
(`MemoryFormerConfig.table_init`) and weight decay on the tables (`TrainingSettings.table_weight_decay`,
`--no-table-weight-decay`)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import tiny_config
from modeling_memoryformer import MemoryFormerConfig, MemoryFormerForCausalLM
from modeling_memoryformer.training.data import LMData, TokenBlocks
from modeling_memoryformer.training.trainer import TrainingSettings, build_trainer

D = 64  # hidden size of the init tests: 2 layers of [256, 192] Q/K/V tables, ~98k values
TABLE_STD = 0.02
SMALL_INIT_STD = math.sqrt(2 / (5 * D))  # GPT-NeoX's small_init, which the authors' code gives the Q/K/V tables
AUTHORS_BIAS_STD = 0.001


def init_model(table_init: str, seed: int = 0, **overrides) -> MemoryFormerForCausalLM:
    torch.manual_seed(seed)
    config = tiny_config(hidden_size=D, vocab_size=64, table_init=table_init, table_init_std=TABLE_STD,
                         initializer_range=0.02, **overrides)
    return MemoryFormerForCausalLM(config)


def gathered(model, suffix: str, qkv: bool | None = None) -> torch.Tensor:
    """Every value of the parameters named `...suffix` (only the attention's Q/K/V layer's, or only the others'),
    flattened into one tensor."""
    parts = [p.detach().flatten() for name, p in model.named_parameters() if name.endswith(suffix)
             and (qkv is None or ("query_key_value" in name) == qkv)]
    assert parts, suffix
    return torch.cat(parts)


def assert_std_near(values: torch.Tensor, std: float) -> None:
    """The sample std of `values`, N(0, std) iid, within 5 sigma of `std`: s^2 / std^2 is chi^2_n / n, whose
    standard deviation is sqrt(2 / n), so s / std is 1 within 5 / sqrt(2 n)."""
    n = values.numel()
    ratio = values.double().pow(2).mean().sqrt().item() / std
    assert abs(ratio - 1) < 5 / math.sqrt(2 * n), (ratio, n)


# ---------------------------------------------------------------------------------------------------------------------
# table_init
def test_authors_init_gives_qkv_tables_small_init_and_biases_a_small_normal():
    model = init_model("authors", attention_output="memory")  # a d -> d attention layer that is not Q/K/V
    assert gathered(model, "tables", qkv=True).numel() == 2 * 256 * 3 * D
    assert_std_near(gathered(model, "tables", qkv=True), SMALL_INIT_STD)
    assert_std_near(gathered(model, "tables", qkv=False), TABLE_STD)
    assert_std_near(gathered(model, "attention.dense.tables"), TABLE_STD)
    biases = torch.cat([p.detach().flatten() for name, p in model.named_parameters()
                        if name.endswith(".bias") and "norm" not in name])
    assert biases.count_nonzero() == biases.numel()
    assert_std_near(biases, AUTHORS_BIAS_STD)


def test_paper_init_gives_every_table_the_same_std_and_zero_biases():
    model = init_model("paper", attention_output="memory")
    assert_std_near(gathered(model, "tables", qkv=True), TABLE_STD)
    assert_std_near(gathered(model, "tables", qkv=False), TABLE_STD)
    for name, p in model.named_parameters():
        if name.endswith(".bias") and "norm" not in name:
            assert not p.any(), name


def test_paper_is_the_default():
    assert MemoryFormerConfig().table_init == "paper"


def test_authors_init_of_int8_tables_uses_small_init_for_qkv():
    model = init_model("authors", table_dtype="int8").dequantize_tables()
    # the int8 rounding adds noise of about 1% of the std to each value: a variance 1e-4 of it, far inside the bound
    assert_std_near(gathered(model, "tables", qkv=True), SMALL_INIT_STD)
    assert_std_near(gathered(model, "tables", qkv=False), TABLE_STD)


def test_loading_an_authors_model_does_not_rerun_the_init(tmp_path):
    model = init_model("authors")
    model.save_pretrained(tmp_path)
    torch.manual_seed(123)  # an init run on load would draw other values
    loaded = MemoryFormerForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.table_init == "authors"
    expected = model.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_a_config_without_table_init_loads_as_paper(tmp_path):
    init_model("authors").config.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    assert data.pop("table_init") == "authors"
    path.write_text(json.dumps(data))
    assert MemoryFormerConfig.from_pretrained(tmp_path).table_init == "paper"
    assert MemoryFormerConfig.from_dict(data).table_init == "paper"


@pytest.mark.parametrize("value", ["gpt-neox", "Authors", None, 1])
def test_an_unknown_table_init_names_the_field_the_value_and_the_choices(value):
    with pytest.raises(ValueError, match=rf"^table_init={value!r} is not supported; choose one of 'paper', 'authors'"):
        tiny_config(table_init=value)


# ---------------------------------------------------------------------------------------------------------------------
# table_weight_decay
WEIGHT_DECAY = 0.1
LEARNING_RATE = 0.01


def random_lm_data(vocab_size: int = 64, block_size: int = 8) -> LMData:
    """A few random token blocks: the trainer needs data, these tests never train on it."""
    generator = torch.Generator().manual_seed(0)
    train, validation = (torch.randint(0, vocab_size, (n, block_size), generator=generator) for n in (4, 2))
    return LMData(train=TokenBlocks(train), validation=TokenBlocks(validation), tokenizer=None, description="random",
                  block_size=block_size, num_train_tokens=train.numel(), num_validation_tokens=validation.numel(),
                  dropped_tokens=0)


def trainer_for(tmp_path, table_optimizer: str, table_weight_decay: bool):
    torch.manual_seed(0)
    config = tiny_config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64,
                         table_init_std=TABLE_STD, initializer_range=0.02)
    model = MemoryFormerForCausalLM(config).train()
    settings = TrainingSettings(
        output_dir=str(tmp_path), max_steps=2, per_device_batch_size=2, report_to="none", progress=False,
        learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY, table_optimizer=table_optimizer,
        table_weight_decay=table_weight_decay, save_final_model=False)
    trainer = build_trainer(model, random_lm_data(), settings)
    return model, trainer


@pytest.fixture(params=[(rule, decay) for decay in (True, False) for rule in ("adamw", "rowwise_adagrad")],
                ids=lambda p: f"{p[0]}-{'decay' if p[1] else 'no-decay'}")
def optimized(tmp_path, request):
    """(model, its trainer's optimizer, table_weight_decay) for each table optimizer, with and without decay."""
    table_optimizer, table_weight_decay = request.param
    model, trainer = trainer_for(tmp_path, table_optimizer, table_weight_decay)
    return model, trainer.create_optimizer(), table_weight_decay


def test_table_weight_decay_puts_the_tables_in_the_decayed_group_or_not(optimized):
    model, optimizer, table_weight_decay = optimized
    decay_of = {id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}
    named = dict(model.named_parameters())
    tables = [name for name in named if name.endswith(".tables")]
    assert len(tables) == 3
    for name in tables:
        assert decay_of[id(named[name])] == (WEIGHT_DECAY if table_weight_decay else 0.0), name
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert decay_of[id(named[name])] == WEIGHT_DECAY, name
    for name in named:
        if name.endswith(".bias"):
            assert decay_of[id(named[name])] == 0.0, name


def test_a_step_with_zero_table_gradients_shrinks_the_tables_only_with_decay(optimized):
    model, optimizer, table_weight_decay = optimized
    tables = {name: p for name, p in model.named_parameters() if name.endswith(".tables")}
    before = {name: p.detach().clone() for name, p in tables.items()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    # AdamW and the row-wise AdaGrad move a zero gradient by 0 and decay w <- w * (1 - lr * wd) first
    factor = 1 - LEARNING_RATE * WEIGHT_DECAY if table_weight_decay else 1.0
    for name, p in tables.items():
        torch.testing.assert_close(p.detach(), before[name] * factor, rtol=1e-6, atol=0, msg=name)
