"""The `memoryformer` command: every subcommand is reachable, and `train` -> `buckets` works end to end on a text
file at a tiny scale."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from modeling_memoryformer import cli

SUBCOMMANDS = [name for name, *_ in cli.COMMANDS]  # the one list of commands
TINY_TRAIN = ["--vocab-size", "300", "--hidden-size", "32", "--layers", "1", "--heads", "2", "--hash-bits", "4",
              "--expand-bits", "1", "--block-size", "32", "--batch-size", "4"]


def test_every_subcommand_is_registered(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    listed = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in listed, name


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    text = root / "corpus.txt"
    text.write_text("\n".join(f"Line {i}: the quick brown fox jumps over the lazy dog {i % 7}." for i in range(400)))
    out = root / "run"
    code = cli.main(["train", "--out", str(out), "--data", str(text), "--vocab-size", "300", "--hidden-size", "32",
                     "--layers", "1", "--heads", "2", "--hash-bits", "4", "--expand-bits", "1", "--block-size", "32",
                     "--batch-size", "4", "--max-steps", "6", "--logging-steps", "2", "--save-steps", "3"])
    assert code == 0
    return root, text, out


@pytest.mark.slow
def test_train_command_saves_a_loadable_model_with_its_tokenizer_and_log(trained):
    _, text, out = trained
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.model_type == "memoryformer" and model.config.hidden_size == 32
    assert model.config.vocab_size == len(tokenizer)
    ids = torch.tensor([tokenizer("the quick brown fox")["input_ids"]])
    assert model(ids).logits.shape == (1, ids.shape[1], len(tokenizer))
    with open(out / "log.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows if r["loss"]] == [2, 4, 6]
    assert [int(r["step"]) for r in rows if r["eval_loss"]] == [6]  # a 6-step run evaluates once, at its end
    assert (out / "checkpoint-6").is_dir()


@pytest.mark.slow
def test_train_command_resumes_from_the_latest_checkpoint(trained, tmp_path):
    _, text, out = trained
    code = cli.main(["train", "--out", str(out), "--data", str(text), "--vocab-size", "300", "--hidden-size", "32",
                     "--layers", "1", "--heads", "2", "--hash-bits", "4", "--expand-bits", "1", "--block-size", "32",
                     "--batch-size", "4", "--max-steps", "8", "--logging-steps", "2", "--save-steps", "3",
                     "--resume", "latest"])
    assert code == 0
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 8


@pytest.mark.slow
def test_buckets_command_on_the_trained_model(trained, capsys):
    root, text, out = trained
    report = root / "buckets"
    code = cli.main(["buckets", "--model", str(out), "--data", str(text), "--block-size", "32", "--out", str(report)])
    assert code == 0
    stats = json.loads((report / "bucket_stats.json").read_text())
    assert stats["tokens"] > 0
    assert (report / "buckets.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_train_command_continues_a_saved_model_with_its_own_tokenizer(trained, tmp_path):
    _, text, out = trained
    code = cli.main(["train", "--model", str(out), "--out", str(tmp_path / "more"), "--data", str(text),
                     "--block-size", "32", "--batch-size", "4", "--max-steps", "2", "--report-to", "none"])
    assert code == 0
    before, after = (AutoModelForCausalLM.from_pretrained(p) for p in (out, tmp_path / "more"))
    assert after.config.to_dict()["vocab_size"] == before.config.vocab_size
    assert AutoTokenizer.from_pretrained(tmp_path / "more").get_vocab() == AutoTokenizer.from_pretrained(out).get_vocab()
    assert not torch.equal(before.lm_head.weight, after.lm_head.weight)  # the two steps trained it


def test_bad_input_is_one_clear_line_and_exit_code_2(tmp_path, capsys):
    assert cli.main(["train", "--out", str(tmp_path / "x"), "--data", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err
    assert cli.main(["train", "--out", str(tmp_path / "y"), "--max-steps", "0", "--hidden-size", "32", "--layers", "1",
                     "--heads", "2", "--hash-bits", "4", "--vocab-size", "300"]) == 2
    assert "error: --max-steps must be >= 1, got 0" in capsys.readouterr().err  # the flag, not the field


@pytest.mark.slow
def test_resuming_a_finished_run_trains_nothing_and_says_so(trained, tmp_path, capsys):
    _, text, _ = trained
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--data", str(text), *TINY_TRAIN, "--max-steps", "4", "--save-steps", "2"]
    assert cli.main(argv) == 0
    saved = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()

    assert cli.main([*argv, "--resume", "latest"]) == 0
    printed = capsys.readouterr().out
    assert "run already finished at step 4 of 4; nothing to train" in printed
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == saved  # nothing rewritten
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 4

    # killed after checkpoint-4 but before the final save: the final model is written from the checkpoint
    for name in ("model.safetensors", "config.json", "trainer_state.json"):
        (out / name).unlink()
    assert cli.main([*argv, "--resume", "latest"]) == 0
    assert "run already finished at step 4 of 4; nothing to train" in capsys.readouterr().out
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert (out / "model.safetensors").read_bytes() == saved["model.safetensors"]
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 4


@pytest.mark.slow
def test_train_states_its_evaluation_and_logging_schedule(trained, tmp_path, capsys):
    _, text, _ = trained
    argv = ["train", "--out", str(tmp_path / "run"), "--data", str(text), *TINY_TRAIN, "--max-steps", "3",
            "--eval-points", "3", "--report-to", "none"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "3 steps: evaluating every 1 step (3 evaluations), logging every 1" in printed
    assert "in 3 evaluations" in printed
    assert cli.main([*argv, "--overwrite", "--eval-steps", "2"]) == 2
    assert "pass one of them" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_runs_with_int8_tables_and_head_and_says_how_much_it_holds(capsys):
    """`generate --table-dtype int8 --lm-head-dtype int8` runs and reports the bytes it holds; the oracle counts them
    from the shapes: a byte per table or head value, a float32 scale and offset per table row, a float32 scale per
    head row, float32 for every other parameter."""
    from modeling_memoryformer import MemoryFormerConfig, MemoryFormerForCausalLM
    from modeling_memoryformer.evaluation.flops import memory_layers

    argv = ["generate", "--preset", "tiny", "--layers", "1", "--new-tokens", "2", "--seq-len", "16"]
    assert cli.main([*argv, "--table-dtype", "int8", "--lm-head-dtype", "int8"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "stored for inference" in line)
    assert "tables int8, LM head int8" in line
    megabytes = int(line.split("; ")[1].split(" MB")[0])
    config = MemoryFormerConfig.from_preset("tiny", num_hidden_layers=1)
    layers = memory_layers(config)
    tables = sum(layer.table_values + 8 * (layer.num_tables << layer.hash_bits) for layer in layers)
    head = config.vocab_size * (config.hidden_size + 4)
    others = sum(p.numel() for name, p in MemoryFormerForCausalLM(config).named_parameters()
                 if "tables" not in name and "lm_head" not in name)
    expected = (tables + head + 4 * others) / 1e6
    assert abs(megabytes - expected) <= 0.02 * expected, (megabytes, expected)
