"""Nothing lost: `train` does not write over another run, `--resume latest` takes the newest
*complete* checkpoint (an interrupted write is skipped, and said so), resuming without optimizer or scheduler state
is an error unless asked for, `convert` never writes over its source, and the loaders refuse a checkpoint with
missing or unexpected tensors instead of filling them with random weights.

Everything is tiny and local (tmp_path): no network, no ../shared."""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM

from _training_data import synthetic_lm_data
from conftest import tiny_model
from modeling_memoryformer import cli
from modeling_memoryformer.training.checkpoints import (
    COMPLETE_MARKER,
    IncompleteCheckpointError,
    LoadingMismatchError,
    checkpoint_problems,
    latest_complete_checkpoint,
    load_pretrained_strict,
)
from modeling_memoryformer.training import outputs
from modeling_memoryformer.training.trainer import TrainingSettings, train


def run(capsys, *argv) -> str:
    """The command's one stderr line (progress bars aside), after checking the exit code is 2."""
    capsys.readouterr()
    assert cli.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip() and "it/s]" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def settings(out, **overrides) -> TrainingSettings:
    fields = dict(output_dir=str(out), max_steps=4, save_steps=2, save_total_limit=None, per_device_batch_size=4,
                  logging_steps=1, eval_steps=4, report_to="none", learning_rate=3e-3, progress=False,
                  save_final_model=False)
    return TrainingSettings(**{**fields, **overrides})


def trainable_model(seed: int = 0):
    return tiny_model(seed=seed, table_init_std=0.02, initializer_range=0.02).train()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished 4-step run with checkpoint-2 and checkpoint-4 (a fresh copy per test: `fresh_run`)."""
    out = tmp_path_factory.mktemp("nothing_lost") / "run"
    train(trainable_model(), synthetic_lm_data(), settings(out))
    return out


@pytest.fixture
def fresh_run(run_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    return out


def truncate(path, keep: float = 0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints are written with a completion marker, last


def test_every_checkpoint_is_marked_complete_after_all_its_files(run_dir):
    for step in (2, 4):
        folder = run_dir / f"checkpoint-{step}"
        marker = json.loads((folder / COMPLETE_MARKER).read_text())
        assert marker["global_step"] == step
        assert {"trainer_state.json", "optimizer.pt", "scheduler.pt", "model.safetensors"} <= set(marker["files"])
        assert checkpoint_problems(str(folder)) == []


# ---------------------------------------------------------------------------------------------------------------------
# --resume latest takes the newest complete checkpoint


def interrupted_checkpoint_6(out):
    """What kill -9 leaves while checkpoint-6 is written: the weights half written, nothing else yet."""
    folder = out / "checkpoint-6"
    folder.mkdir()
    shutil.copy(out / "checkpoint-4" / "config.json", folder / "config.json")
    shutil.copy(out / "checkpoint-4" / "model.safetensors", folder / "model.safetensors")
    truncate(folder / "model.safetensors")
    return folder


@pytest.mark.parametrize("damage", ["half_written_weights", "truncated_optimizer", "no_marker", "torn_state"])
def test_latest_skips_an_interrupted_checkpoint_and_says_why(fresh_run, damage):
    if damage == "half_written_weights":
        skipped_folder, reason = interrupted_checkpoint_6(fresh_run), "model.safetensors is truncated"
    else:
        skipped_folder = fresh_run / "checkpoint-4"
        if damage == "truncated_optimizer":  # an old marker cannot vouch for a damaged file
            truncate(skipped_folder / "optimizer.pt")
            reason = "optimizer.pt is truncated"
        elif damage == "no_marker":  # killed after trainer_state.json, before the marker
            (skipped_folder / COMPLETE_MARKER).unlink()
            reason = f"{COMPLETE_MARKER} is missing"
        else:
            (skipped_folder / COMPLETE_MARKER).unlink()
            truncate(skipped_folder / "trainer_state.json")
            reason = "trainer_state.json is truncated"
    folder, skipped = latest_complete_checkpoint(str(fresh_run))
    expected = fresh_run / ("checkpoint-4" if damage == "half_written_weights" else "checkpoint-2")
    assert folder == str(expected)
    assert [path for path, _ in skipped] == [str(skipped_folder)]
    assert any(reason in problem for problem in skipped[0][1]), skipped


@pytest.mark.slow
def test_resume_latest_continues_from_the_newest_complete_checkpoint(fresh_run, capsys):
    broken = interrupted_checkpoint_6(fresh_run)
    result = train(trainable_model(seed=5), synthetic_lm_data(),
                   settings(fresh_run, max_steps=6, resume_from_checkpoint=True))
    err = capsys.readouterr().err
    assert f"skipping incomplete checkpoint {broken}" in err and "model.safetensors is truncated" in err
    assert f"resuming from {fresh_run / 'checkpoint-4'}" in err
    assert result.steps == 6
    saved = json.loads((fresh_run / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
    losses = [(e["step"], e["loss"]) for e in result.log_history if "loss" in e]
    # steps 1-4 come from checkpoint-4 (a fresh run from the seed-5 model would give other losses); 5-6 are new
    assert losses[:4] == [(e["step"], e["loss"]) for e in saved if "loss" in e]
    assert [step for step, _ in losses] == [1, 2, 3, 4, 5, 6]
    assert checkpoint_problems(str(broken)) == []  # rewritten in full, marker last


def test_resume_latest_with_only_incomplete_checkpoints_is_an_error(fresh_run):
    for step in (2, 4):
        (fresh_run / f"checkpoint-{step}" / COMPLETE_MARKER).unlink()
        truncate(fresh_run / f"checkpoint-{step}" / "scheduler.pt")
    with pytest.raises(IncompleteCheckpointError, match="No complete checkpoint.*scheduler.pt"):
        train(trainable_model(), synthetic_lm_data(), settings(fresh_run, max_steps=6, resume_from_checkpoint=True))


# ---------------------------------------------------------------------------------------------------------------------
# No silent fresh optimizer


@pytest.mark.parametrize("missing", ["optimizer.pt", "scheduler.pt"])
def test_resume_without_optimizer_or_scheduler_state_names_the_file(fresh_run, missing, capsys):
    checkpoint = fresh_run / "checkpoint-4"
    (checkpoint / missing).unlink()
    with pytest.raises(IncompleteCheckpointError, match=f"{missing} is missing.*--resume-partial"):
        train(trainable_model(), synthetic_lm_data(),
              settings(fresh_run, max_steps=6, resume_from_checkpoint=str(checkpoint)))
    # latest skips it too (it is not complete)
    assert latest_complete_checkpoint(str(fresh_run))[0] == str(fresh_run / "checkpoint-2")
    # the CLI: one error line naming the file, before any data is read
    line = run(capsys, "train", "--out", fresh_run, "--resume", checkpoint, "--max-steps", "6")
    assert missing in line and "--resume-partial" in line


def test_partial_resume_is_allowed_when_asked_for(fresh_run):
    checkpoint = fresh_run / "checkpoint-4"
    (checkpoint / "optimizer.pt").unlink()
    (checkpoint / "scheduler.pt").unlink()
    result = train(trainable_model(), synthetic_lm_data(),
                   settings(fresh_run, max_steps=6, resume_from_checkpoint=str(checkpoint), resume_partial=True))
    assert result.steps == 6


# ---------------------------------------------------------------------------------------------------------------------
# train --out does not write over another run


@pytest.mark.parametrize("earlier", ["model", "checkpoints"])
def test_train_refuses_an_out_holding_another_run(fresh_run, earlier, capsys):
    if earlier == "checkpoints":
        (fresh_run / "config.json").unlink(missing_ok=True)
        before = sorted(os.listdir(fresh_run))
    else:
        shutil.rmtree(fresh_run / "checkpoint-2")
        shutil.rmtree(fresh_run / "checkpoint-4")
        tiny_model().save_pretrained(fresh_run)
        before = sorted(os.listdir(fresh_run))
    line = run(capsys, "train", "--out", fresh_run, "--max-steps", "2")
    assert "earlier run" in line and "--overwrite" in line and "--resume" in line
    assert sorted(os.listdir(fresh_run)) == before


def test_train_accepts_an_empty_or_unrelated_out(tmp_path, capsys):
    from modeling_memoryformer.training.checkpoints import check_train_output

    (tmp_path / "notes.txt").write_text("mine")
    check_train_output(str(tmp_path), None, False)
    check_train_output(str(tmp_path / "new"), None, False)


def test_train_overwrite_replaces_the_earlier_run(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoint-99").mkdir(parents=True)
    (out / "config.json").write_text("{}")
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"Line {i}: the quick brown fox jumps over the lazy dog {i % 7}." for i in range(200)))
    code = cli.main(["train", "--out", str(out), "--data", str(text), "--vocab-size", "300", "--hidden-size", "32",
                     "--layers", "1", "--heads", "2", "--hash-bits", "4", "--expand-bits", "1", "--block-size", "32",
                     "--batch-size", "4", "--max-steps", "2", "--save-steps", "2", "--overwrite"])
    assert code == 0
    assert not (out / "checkpoint-99").exists() and (out / "checkpoint-2" / COMPLETE_MARKER).exists()
    assert AutoModelForCausalLM.from_pretrained(out).config.hidden_size == 32


# ---------------------------------------------------------------------------------------------------------------------
# convert never writes over its source


def teacher_folder(path):
    GPTNeoXConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
                  max_position_embeddings=64).save_pretrained(path)
    return path


@pytest.mark.parametrize("where", ["same", "inside", "contains", "symlink", "symlinked_parent"])
def test_convert_refuses_an_out_that_is_contains_or_lies_inside_the_source(tmp_path, capsys, where):
    source = teacher_folder(tmp_path / "pythia")
    out = {"same": source, "inside": source / "converted", "contains": tmp_path, "symlink": tmp_path / "link",
           "symlinked_parent": tmp_path / "parent_link" / "converted"}[where]
    if where == "symlink":
        os.symlink(source, out)
    if where == "symlinked_parent":
        os.symlink(source, tmp_path / "parent_link")
    line = run(capsys, "convert", "--from", source, "--out", out, "--overwrite")
    assert "--from" in line and "source" in line
    assert (source / "config.json").is_file()


# ---------------------------------------------------------------------------------------------------------------------
# Loaders refuse missing or unexpected tensors


def damage_weights(folder, drop: str | None = None, add: str | None = None):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    if drop:
        del tensors[drop]
    if add:
        tensors[add] = torch.zeros(3)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture
def saved_model(tmp_path):
    folder = tmp_path / "model"
    tiny_model().save_pretrained(folder)
    return folder


def test_strict_loading_accepts_tied_and_untied_models(tmp_path):
    for tie in (True, False):
        tiny_model(tie_word_embeddings=tie).save_pretrained(tmp_path / str(tie))
        model = load_pretrained_strict(AutoModelForCausalLM, tmp_path / str(tie))
        assert model.config.tie_word_embeddings == tie


def test_strict_loading_names_missing_and_unexpected_tensors(saved_model):
    dropped = "model.layers.0.attention.query_key_value.tables"
    damage_weights(saved_model, drop=dropped, add="model.stray")
    with pytest.raises(LoadingMismatchError, match=rf"--model .*1 tensor\(s\) missing: {dropped}; 1 tensor\(s\) "
                                                   r"unexpected: model.stray"):
        load_pretrained_strict(AutoModelForCausalLM, saved_model)


@pytest.mark.parametrize("command", ["eval", "train"])
def test_cli_refuses_a_model_with_a_missing_tensor(saved_model, tmp_path, capsys, command):
    dropped = "model.layers.1.attention.query_key_value.tables"
    damage_weights(saved_model, drop=dropped)
    text = tmp_path / "text.txt"
    text.write_text("some text " * 50)
    if command == "eval":
        line = run(capsys, "eval", "--model", saved_model, "--perplexity", text)
    else:
        line = run(capsys, "train", "--model", saved_model, "--out", tmp_path / "out", "--data", text)
    assert dropped in line and "missing" in line


def test_convert_refuses_a_source_with_a_missing_tensor(tmp_path, capsys):
    source = tmp_path / "pythia"
    torch.manual_seed(0)
    GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=64)).save_pretrained(source)
    dropped = "gpt_neox.layers.0.mlp.dense_h_to_4h.weight"
    damage_weights(source, drop=dropped)
    line = run(capsys, "convert", "--from", source, "--out", tmp_path / "out", "--hash-bits", "4")
    assert dropped in line and "missing" in line
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------------------
# A failed write or replace keeps the earlier output (a real fault: the command runs in a child process whose file
# size limit, RLIMIT_FSIZE, makes a write past it fail with EFBIG "File too large", as a full disk fails it)


def run_limited(args: list, limit_bytes: int | None, cwd) -> subprocess.CompletedProcess:
    def limit():
        if limit_bytes is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))  # Python ignores SIGXFSZ itself

    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "modeling_memoryformer.cli", *map(str, args)], cwd=cwd, env=env,
                          preexec_fn=limit, capture_output=True, text=True, timeout=600, check=False)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.replace("\r", "\n").splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def snapshot(folder) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(parent) -> list[str]:
    return sorted(p.name for p in parent.rglob("*") if p.name.endswith((".incomplete", ".old")))


@pytest.mark.slow
def test_convert_overwrite_on_a_full_disk_keeps_the_earlier_output_and_says_so_in_one_line(tmp_path):
    source = tmp_path / "pythia"
    torch.manual_seed(0)
    GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=64)).save_pretrained(source)
    out = tmp_path / "converted"
    convert = ["convert", "--from", source, "--out", out, "--hash-bits", "4", "--overwrite", "--no-progress"]
    first = run_limited(convert, None, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    earlier = snapshot(out)
    weights = len(earlier["model.safetensors"])
    line = one_error_line(run_limited([*convert, "--hash-bits", "2"], weights // 2, tmp_path))
    assert str(out) in line and "File too large" in line and "left as it was" in line
    assert snapshot(out) == earlier
    assert leftovers(tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize("fails_at", ["checkpoint", "final model"])
def test_train_overwrite_on_a_full_disk_keeps_the_earlier_model_and_says_so_in_one_line(tmp_path, fails_at):
    out = tmp_path / "run"
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"Line {i}: the quick brown fox jumps over the lazy dog {i % 7}." for i in range(200)))
    train_args = ["train", "--out", out, "--data", text, "--vocab-size", "300", "--hidden-size", "32", "--layers", "1",
                  "--heads", "2", "--hash-bits", "4", "--expand-bits", "1", "--block-size", "32", "--batch-size", "4",
                  "--max-steps", "2", "--overwrite", "--no-progress"]
    save_steps = ["--save-steps", "2" if fails_at == "checkpoint" else "1000"]
    first = run_limited([*train_args, *save_steps], None, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    earlier = {name: (out / name).read_bytes() for name in ("model.safetensors", "config.json")}
    limit = len(earlier["model.safetensors"]) // 2  # the corpus and tokenizer files are far smaller
    line = one_error_line(run_limited([*train_args, *save_steps, "--seed", "7"], limit, tmp_path))
    assert "File too large" in line
    assert (str(out / "checkpoint-2") if fails_at == "checkpoint" else str(out)) in line
    assert {name: (out / name).read_bytes() for name in earlier} == earlier  # the earlier final model is intact
    assert AutoModelForCausalLM.from_pretrained(out).config.hidden_size == 32
    assert leftovers(out) == []


def test_a_failed_final_rename_keeps_the_earlier_folder(tmp_path, monkeypatch):
    """The case of the issue: the old folder used to be deleted before the rename, and the new one on its failure."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"earlier")
    real_replace = os.replace

    def failing_replace(src, dst):
        if str(src).endswith(".incomplete"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(outputs.os, "replace", failing_replace)
    with pytest.raises(outputs.OutputWriteError, match=f"{out}.*No space left on device.*left as it was"):
        with outputs.staged_folder(str(out)) as staging:
            (Path(staging) / "model.safetensors").write_bytes(b"new")
    assert (out / "model.safetensors").read_bytes() == b"earlier"
    assert leftovers(tmp_path) == []


def test_a_failed_file_swap_puts_every_earlier_file_back(tmp_path, monkeypatch):
    folder = tmp_path / "run"
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "checkpoint-2.txt"):
        (folder / name).write_text(f"earlier {name}")
    real_replace, calls = os.replace, []

    def replace_failing_on_the_second_new_file(src, dst):
        if ".incomplete" in str(src):
            calls.append(src)
            if len(calls) == 2:
                raise OSError(errno.EIO, "Input/output error")
        return real_replace(src, dst)

    monkeypatch.setattr(outputs.os, "replace", replace_failing_on_the_second_new_file)
    with pytest.raises(outputs.OutputWriteError, match="Input/output error.*left as they were"):
        with outputs.staged_files(str(folder)) as staging:
            for name in ("config.json", "model.safetensors", "tokenizer.json"):
                (Path(staging) / name).write_text(f"new {name}")
    assert snapshot(folder) == {name: f"earlier {name}".encode()
                                for name in ("checkpoint-2.txt", "config.json", "model.safetensors")}
    assert leftovers(tmp_path) == []
    monkeypatch.setattr(outputs.os, "replace", real_replace)
    with outputs.staged_files(str(folder)) as staging:  # and when nothing fails, the new files replace the old
        (Path(staging) / "config.json").write_text("new")
    assert (folder / "config.json").read_text() == "new" and (folder / "checkpoint-2.txt").exists()
    assert leftovers(tmp_path) == []
