"""Bucket statistics (paper Fig. 4), each checked against an independent oracle.

The counting oracle captures every Memory Layer's input with its own hooks and hashes it by the paper's integer() hash in
plain Python (h(z_k) = sum_i [z_k,i >= 0] 2^i), token by token. Entropies are checked against closed forms and a
float64 formula; the JSON and PNG outputs are read back.
"""

from __future__ import annotations

import json
import math
import sys
import types

import pytest
import torch
from torch import nn

from conftest import TINY, tiny_model
from modeling_memoryformer import MemoryLayer
from modeling_memoryformer.cli import parse_settings
from modeling_memoryformer.evaluation.buckets import (
    BucketStats,
    collect_bucket_stats,
    default_tables,
    memory_layers,
    plot_bucket_histograms,
    run_buckets,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def expected_layer_names(num_layers: int, dense: bool = False) -> list[str]:
    """The Memory Layers of a MemoryFormerForCausalLM, spelled out from the model's structure."""
    names = []
    for i in range(num_layers):
        names.append(f"model.layers.{i}.attention.query_key_value")
        if dense:
            names.append(f"model.layers.{i}.attention.dense")
        names += [f"model.layers.{i}.memory_block.layer1", f"model.layers.{i}.memory_block.layer2"]
    return names


def spec_code(chunk: list[float]) -> int:
    """The paper's integer(): element i carries bit 2**i and sets it when >= 0."""
    return sum(2**i for i, value in enumerate(chunk) if value >= 0)


def naive_counts(model, batches, names: list[str]) -> tuple[dict[str, list[list[int]]], int]:
    """Run the model with our own pre-hooks, hash every counted token's input in Python, count per table."""
    modules = dict(model.named_modules())
    captured: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    handles = [
        modules[name].register_forward_pre_hook(lambda m, args, name=name: captured[name].append(args[0].detach()))
        for name in names
    ]
    masks = []
    try:
        with torch.no_grad():
            for batch in batches:
                ids = batch["input_ids"] if isinstance(batch, dict) else batch
                mask = batch.get("attention_mask") if isinstance(batch, dict) else None
                model(input_ids=ids, attention_mask=mask)
                masks.append(torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool())
    finally:
        for handle in handles:
            handle.remove()
    counts, tokens = {}, sum(int(m.sum()) for m in masks)
    for name in names:
        tau = modules[name].hash_bits
        tables = modules[name].in_features // tau
        table_counts = [[0] * 2**tau for _ in range(tables)]
        for x, mask in zip(captured[name], masks):
            for b, t in mask.nonzero().tolist():
                row = x[b, t].tolist()
                for k in range(tables):
                    table_counts[k][spec_code(row[k * tau : (k + 1) * tau])] += 1
        counts[name] = table_counts
    return counts, tokens


def token_batches(seed: int = 0, shapes=((2, 11), (3, 7))) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, TINY["vocab_size"], shape, generator=g) for shape in shapes]


def hooks_on(model) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in memory_layers(model).values())


class GaussianInputs(nn.Module):
    """A hand-built model: one Memory Layer fed i.i.d. N(0, 1) inputs (zero-centred, as the paper's LayerNorm
    intends), one fresh vector per token position."""

    def __init__(self, in_features: int = 32, hash_bits: int = 8, seed: int = 0):
        super().__init__()
        self.layer = MemoryLayer(in_features, 4, hash_bits=hash_bits)
        self.generator = torch.Generator().manual_seed(seed)

    def forward(self, input_ids, attention_mask=None):
        x = torch.randn(*input_ids.shape, self.layer.in_features, generator=self.generator)
        return self.layer(x)


class SharedHash(nn.Module):
    """Calls its Memory Layer with a precomputed `hashed=` only, the way fused layers share one hash."""

    def __init__(self):
        super().__init__()
        self.layer = MemoryLayer(16, 4, hash_bits=4)
        self.embed = nn.Embedding(TINY["vocab_size"], 16)

    def forward(self, input_ids, attention_mask=None):
        return self.layer(hashed=self.layer.hash(self.embed(input_ids)))


# ---------------------------------------------------------------------------------------------------------------------
# 1. Which layers, and counting.
@pytest.mark.parametrize("attention_output", ["none", "memory"])
def test_memory_layers_names_every_memory_layer_of_the_model(attention_output):
    model = tiny_model(attention_output=attention_output)
    layers = memory_layers(model)
    assert list(layers) == expected_layer_names(TINY["num_hidden_layers"], dense=attention_output == "memory")
    modules = dict(model.named_modules())
    assert all(layers[name] is modules[name] for name in layers)


@pytest.mark.parametrize("attention_output", ["none", "memory"])
def test_counts_equal_a_naive_per_token_oracle(attention_output):
    model = tiny_model(attention_output=attention_output)
    batches = token_batches()
    stats = collect_bucket_stats(model, batches, progress=False)
    expected, tokens = naive_counts(model, batches, list(memory_layers(model)))
    assert stats.tokens == tokens == 2 * 11 + 3 * 7
    assert list(stats.counts) == list(expected)
    for name, counts in stats.counts.items():
        layer = memory_layers(model)[name]
        assert counts.dtype == torch.int64
        assert counts.shape == (layer.num_tables, 2**layer.hash_bits)
        assert counts.tolist() == expected[name], name


def test_every_table_counts_every_token_exactly_once():
    stats = collect_bucket_stats(tiny_model(), token_batches(), progress=False)
    for name, counts in stats.counts.items():
        assert counts.sum(-1).tolist() == [stats.tokens] * counts.shape[0], name


def test_dict_batches_and_tensor_batches_count_alike_and_accumulate():
    model = tiny_model()
    first, second = token_batches()
    together = collect_bucket_stats(model, [{"input_ids": first}, second], progress=False)
    alone = [collect_bucket_stats(model, [b], progress=False) for b in (first, second)]
    assert together.tokens == alone[0].tokens + alone[1].tokens
    for name in together.counts:
        assert torch.equal(together.counts[name], alone[0].counts[name] + alone[1].counts[name])


def test_padding_positions_are_not_counted():
    model = tiny_model()
    ids = token_batches(shapes=((3, 9),))[0]
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0  # right padding
    mask[2, :4] = 0  # left padding
    batches = [{"input_ids": ids, "attention_mask": mask, "labels": ids}]
    stats = collect_bucket_stats(model, batches, progress=False)
    expected, tokens = naive_counts(model, batches, list(memory_layers(model)))
    assert stats.tokens == tokens == 27 - 3 - 4
    for name, counts in stats.counts.items():
        assert counts.tolist() == expected[name], name
        assert counts.sum(-1).tolist() == [tokens] * counts.shape[0]


def test_a_shared_hash_is_counted_like_the_input_it_hashes():
    model = SharedHash()
    batches = token_batches()
    stats = collect_bucket_stats(model, batches, progress=False)
    with torch.no_grad():
        x = torch.cat([model.embed(b).reshape(-1, 16) for b in batches])
    expected = [[0] * 16 for _ in range(4)]
    for row in x.tolist():
        for k in range(4):
            expected[k][spec_code(row[4 * k : 4 * k + 4])] += 1
    assert stats.counts["layer"].tolist() == expected


def test_layers_argument_restricts_counting_to_the_chosen_layers():
    model = tiny_model()
    batches = token_batches()
    everything = collect_bucket_stats(model, batches, progress=False)
    chosen = ["model.layers.1.memory_block.layer2", "model.layers.0.attention.query_key_value"]
    some = collect_bucket_stats(model, batches, layers=chosen, progress=False)
    assert list(some.counts) == chosen
    assert some.tokens == everything.tokens
    for name in chosen:
        assert torch.equal(some.counts[name], everything.counts[name])


def test_an_unknown_layer_name_is_a_value_error_listing_the_valid_names():
    model = tiny_model()
    with pytest.raises(ValueError, match="model.layers.0.memory_block.layer1") as error:
        collect_bucket_stats(model, token_batches(), layers=["model.layers.0.mlp"], progress=False)
    assert "model.layers.0.mlp" in str(error.value)
    assert hooks_on(model) == 0


def test_no_counted_token_is_an_error():
    model = tiny_model()
    ids = token_batches(shapes=((2, 5),))[0]
    with pytest.raises(ValueError, match="No tokens"):
        collect_bucket_stats(model, [], progress=False)
    with pytest.raises(ValueError, match="No tokens"):
        collect_bucket_stats(model, [{"input_ids": ids, "attention_mask": torch.zeros_like(ids)}], progress=False)


# ---------------------------------------------------------------------------------------------------------------------
# 2. Hooks and model state are left as found.
def test_hooks_are_removed_and_eval_mode_restored_after_collection():
    model = tiny_model().train()
    collect_bucket_stats(model, token_batches(), progress=False)
    assert hooks_on(model) == 0
    assert model.training


def test_hooks_are_removed_when_the_model_raises():
    model = tiny_model()

    def explode(module, args, output):
        raise RuntimeError("boom inside the model")

    failing = model.model.layers[1].memory_block.register_forward_hook(explode)
    try:
        with pytest.raises(RuntimeError, match="boom inside the model"):
            collect_bucket_stats(model, token_batches(), progress=False)
    finally:
        failing.remove()
    assert hooks_on(model) == 0
    assert len(model.model.layers[1].memory_block._forward_hooks) == 0


# ---------------------------------------------------------------------------------------------------------------------
# 3. Entropy and summary.
def test_normalised_entropy_is_one_for_uniform_counts():
    stats = BucketStats(counts={"a": torch.full((3, 16), 5, dtype=torch.int64)}, tokens=80)
    assert stats.normalised_entropy() == pytest.approx({"a[0]": 1.0, "a[1]": 1.0, "a[2]": 1.0}, abs=1e-12)


def test_normalised_entropy_is_zero_for_a_single_bucket():
    counts = torch.zeros(2, 256, dtype=torch.int64)
    counts[0, 17] = counts[1, 0] = 40
    stats = BucketStats(counts={"a": counts}, tokens=40)
    assert stats.normalised_entropy() == {"a[0]": 0.0, "a[1]": 0.0}


def test_normalised_entropy_matches_a_float64_formula_on_random_counts():
    g = torch.Generator().manual_seed(0)
    counts = {"a": torch.randint(0, 50, (4, 8), generator=g), "b": torch.randint(0, 9, (2, 64), generator=g)}
    counts["b"][:, :10] = 0  # empty buckets contribute 0 log 0 = 0
    stats = BucketStats(counts=counts, tokens=0)
    entropies = stats.normalised_entropy()
    assert len(entropies) == 4 + 2
    for name, table in counts.items():
        for k, row in enumerate(table.tolist()):
            total = sum(row)
            h = -sum(c / total * math.log(c / total) for c in row if c)
            assert entropies[f"{name}[{k}]"] == pytest.approx(h / math.log(len(row)), rel=1e-12)


def test_summary_reports_entropy_hit_ratios_and_empty_buckets_per_layer():
    counts = torch.tensor([[2, 0, 1, 1], [1, 1, 1, 1]])
    stats = BucketStats(counts={"a": counts}, tokens=4)
    summary = stats.summary()["a"]
    h0 = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)) / math.log(4)
    assert summary["tables"] == 2 and summary["hash_bits"] == 2 and summary["buckets"] == 4
    assert summary["mean_entropy"] == pytest.approx((h0 + 1.0) / 2)
    assert summary["min_entropy"] == pytest.approx(h0)
    assert summary["max_hit_ratio"] == pytest.approx(2.0)  # 2 of 4 tokens in one of 4 buckets
    assert summary["min_hit_ratio"] == 0.0
    assert summary["empty_buckets"] == 1 and summary["empty_fraction"] == pytest.approx(1 / 8)


def test_uniform_entropy_reference_is_what_uniform_draws_show_on_that_many_tokens():
    # Plug-in entropy of N uniform draws over B buckets is biased low; the summary's reference must predict it.
    g = torch.Generator().manual_seed(0)
    tokens, buckets = 2000, 256
    draws = torch.multinomial(torch.ones(buckets), tokens * 200, replacement=True, generator=g).view(200, tokens)
    counts = torch.stack([torch.bincount(row, minlength=buckets) for row in draws])
    stats = BucketStats(counts={"a": counts}, tokens=tokens)
    simulated = stats.summary()["a"]["mean_entropy"]
    assert simulated < 0.99
    assert stats.summary()["a"]["uniform_entropy"] == pytest.approx(simulated, abs=1e-3)


def test_zero_centred_gaussian_inputs_hit_buckets_near_uniformly():
    # Paper Fig. 4: with zero-centred inputs every sign pattern is equally likely, so all 2**tau buckets fill evenly.
    model = GaussianInputs(in_features=32, hash_bits=8)
    stats = collect_bucket_stats(model, [torch.zeros(100, 100, dtype=torch.long)] * 3, progress=False)
    entropies = stats.normalised_entropy()
    assert stats.tokens == 30_000 and len(entropies) == 4
    assert min(entropies.values()) > 0.99
    assert stats.summary()["layer"]["empty_buckets"] == 0


def test_shifted_gaussian_inputs_are_far_from_uniform():
    # The converse: inputs not zero-centred pile into the all-ones bucket, which the statistic must show.
    model = GaussianInputs(in_features=32, hash_bits=8)
    shifted = lambda m, args: (args[0] + 2.0,)  # noqa: E731
    handle = model.layer.register_forward_pre_hook(shifted)  # registered first, so counting sees the shifted input
    stats = collect_bucket_stats(model, [torch.zeros(50, 100, dtype=torch.long)], progress=False)
    handle.remove()
    assert max(stats.normalised_entropy().values()) < 0.6
    assert stats.counts["layer"].argmax(-1).tolist() == [255] * 4


# ---------------------------------------------------------------------------------------------------------------------
# 4. Outputs: JSON and PNG.
def test_json_round_trip_keeps_counts_tokens_and_writes_entropies(tmp_path):
    stats = collect_bucket_stats(tiny_model(), token_batches(), progress=False)
    path = tmp_path / "sub" / "bucket_stats.json"
    stats.to_json(str(path))
    loaded = BucketStats.from_json(str(path))
    assert loaded.tokens == stats.tokens
    assert list(loaded.counts) == list(stats.counts)
    assert all(torch.equal(loaded.counts[n], stats.counts[n]) for n in stats.counts)
    payload = json.loads(path.read_text())
    assert payload["normalised_entropy"] == pytest.approx(stats.normalised_entropy())
    assert set(payload["summary"]) == set(stats.counts)


def test_histograms_are_written_as_a_readable_png(tmp_path):
    import matplotlib.image

    stats = collect_bucket_stats(tiny_model(), token_batches(), progress=False)
    path = str(tmp_path / "buckets.png")
    assert plot_bucket_histograms(stats, path, title="Fig. 4") == path
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100

    chosen = ["model.layers.1.memory_block.layer2[15]"]
    assert plot_bucket_histograms(stats, str(tmp_path / "one.png"), tables=chosen) == str(tmp_path / "one.png")
    assert matplotlib.image.imread(str(tmp_path / "one.png")).shape[1] < image.shape[1]  # one panel, not three


@pytest.mark.parametrize("table", ["model.layers.0.mlp[0]", "model.layers.0.memory_block.layer1[16]", "layer1"])
def test_plotting_an_unknown_table_is_a_value_error(tmp_path, table):
    stats = collect_bucket_stats(tiny_model(), token_batches(), progress=False)
    with pytest.raises(ValueError, match="table"):
        plot_bucket_histograms(stats, str(tmp_path / "x.png"), tables=[table])


@pytest.mark.parametrize("num_layers, dense", [(2, False), (4, True), (1, False)])
def test_default_panels_are_table_zero_of_each_kind_in_the_first_and_last_block(num_layers, dense):
    names = expected_layer_names(num_layers, dense)
    stats = BucketStats(counts={n: torch.ones(2, 4, dtype=torch.int64) for n in names}, tokens=4)
    tables = default_tables(stats)
    assert 1 <= len(tables) <= 6
    assert all(t.endswith("[0]") for t in tables)
    blocks = {int(t.split(".")[2]) for t in tables}
    assert blocks == {0, num_layers - 1}
    if not dense:  # 3 kinds x (first, last) fit in 6 panels: every kind of both ends
        assert tables == [f"{n}[0]" for n in names if int(n.split(".")[2]) in (0, num_layers - 1)]


# ---------------------------------------------------------------------------------------------------------------------
# 5. The `memoryformer buckets` command, on a saved tiny model and stand-in data blocks.
@pytest.fixture
def fake_data(monkeypatch):
    """Replace `modeling_memoryformer.training.data` (its tests are its own) by blocks of random ids; record the
    call."""
    calls = []

    def build_lm_data(data=None, tokenizer=None, block_size=128, **kwargs):
        calls.append({"data": data, "tokenizer": tokenizer, "block_size": block_size})
        g = torch.Generator().manual_seed(0)
        blocks = [torch.randint(0, TINY["vocab_size"], (block_size,), generator=g) for _ in range(9)]
        as_items = [{"input_ids": b, "labels": b.clone()} for b in blocks]
        return types.SimpleNamespace(train=as_items[:6], validation=as_items[6:], tokenizer=[None] * 100)

    module = types.ModuleType("modeling_memoryformer.training.data")
    module.build_lm_data = build_lm_data
    monkeypatch.setitem(sys.modules, "modeling_memoryformer.training.data", module)
    return calls


def parse(argv: list[str]):
    """The BucketSettings of `memoryformer buckets ARGV` (its checks run here, as in the command)."""
    (settings,) = parse_settings(["buckets", *argv])
    return settings


def test_the_command_counts_validation_blocks_and_writes_json_and_png(tmp_path, fake_data, capsys):
    model_dir, out = tmp_path / "model", tmp_path / "out"
    tiny_model().save_pretrained(str(model_dir))
    argv = ["--model", str(model_dir), "--data", "corpus.txt", "--block-size", "16", "--batch-size", "2",
            "--out", str(out), "--no-progress"]
    assert run_buckets(parse(argv)) == 0
    assert fake_data == [{"data": "corpus.txt", "tokenizer": str(model_dir), "block_size": 16}]
    stats = BucketStats.from_json(str(out / "bucket_stats.json"))
    assert stats.tokens == 3 * 16
    assert list(stats.counts) == expected_layer_names(TINY["num_hidden_layers"])
    assert (out / "buckets.png").read_bytes()[:8] == PNG_MAGIC
    printed = capsys.readouterr().out
    assert "model.layers.1.memory_block.layer2" in printed and "mean" in printed


def test_the_command_honours_split_max_tokens_and_layers(tmp_path, fake_data):
    model_dir, out = tmp_path / "model", tmp_path / "out"
    tiny_model().save_pretrained(str(model_dir))
    layer = "model.layers.0.memory_block.layer1"
    argv = ["--model", str(model_dir), "--block-size", "8", "--split", "all", "--max-tokens", "50",
            "--layers", layer, "--tokenizer", "tok", "--out", str(out), "--no-progress"]
    assert run_buckets(parse(argv)) == 0
    assert fake_data[0]["tokenizer"] == "tok" and fake_data[0]["data"] is None
    stats = BucketStats.from_json(str(out / "bucket_stats.json"))
    assert stats.tokens == 7 * 8  # 50 tokens rounded up to whole blocks of 8, over train + validation (9 blocks)
    assert list(stats.counts) == [layer]


@pytest.mark.parametrize("flag", ["--batch-size", "--max-tokens"])
def test_the_command_rejects_non_positive_sizes(tmp_path, fake_data, capsys, flag):
    from modeling_memoryformer import cli

    argv = ["buckets", "--model", str(tmp_path), flag, "0", "--out", str(tmp_path / "out")]
    assert cli.main(argv) == 2
    assert f"error: {flag} must be >= 1" in capsys.readouterr().err
    assert fake_data == [] and not (tmp_path / "out").exists()  # refused before any data is read


def test_the_command_writes_next_to_a_local_model_by_default(tmp_path, fake_data, capsys):
    model_dir = tmp_path / "run"
    tiny_model().save_pretrained(str(model_dir))
    assert run_buckets(parse(["--model", str(model_dir), "--block-size", "16", "--no-progress"])) == 0
    assert BucketStats.from_json(str(model_dir / "buckets" / "bucket_stats.json")).tokens == 3 * 16
    assert (model_dir / "buckets" / "buckets.png").read_bytes()[:8] == PNG_MAGIC
    assert str(model_dir / "buckets" / "bucket_stats.json") in capsys.readouterr().out


def test_a_hub_model_without_out_is_one_clear_error(tmp_path, fake_data, capsys, monkeypatch):
    from modeling_memoryformer import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["buckets", "--model", "someone/memoryformer-tiny"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: --model 'someone/memoryformer-tiny' is not a local folder") and "--out" in line
    assert "\n" not in line and list(tmp_path.iterdir()) == []  # nothing written in the current folder
