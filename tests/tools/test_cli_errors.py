"""Every CLI error is one `error: ...` line naming the problem and the fix, and exit code 2 (never a traceback).

Each command runs in-process through `cli.main`; the inputs are tiny files in tmp_path (no network, no ../shared)."""

from __future__ import annotations

import pytest
import torch
from transformers import GPTNeoXConfig

from modeling_memoryformer import cli


def run(capsys, *argv: str) -> str:
    """The command's one stderr line, after checking the exit code is 2."""
    assert cli.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def gpt_neox_config() -> GPTNeoXConfig:
    return GPTNeoXConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                         intermediate_size=128, max_position_embeddings=64)


class NotATensor:  # torch.load(weights_only=True) refuses to unpickle this
    pass


@pytest.fixture
def refused_bin(tmp_path):
    """A GPT-NeoX folder whose pytorch_model.bin holds a pickled object that weights_only loading refuses."""
    folder = tmp_path / "refused"
    gpt_neox_config().save_pretrained(folder)
    torch.save({"gpt_neox.embed_in.weight": torch.zeros(96, 32), "extra": NotATensor()}, folder / "pytorch_model.bin")
    return folder


def test_convert_hash_bits_0_names_the_flag_and_the_fix(tmp_path, capsys):
    source = tmp_path / "neox"
    gpt_neox_config().save_pretrained(source)  # check_settings reads only the config
    line = run(capsys, "convert", "--from", source, "--out", tmp_path / "out", "--hash-bits", "0")
    assert "--hash-bits" in line and "got 0" in line and "1..16" in line
    assert not (tmp_path / "out").exists()


def test_generate_with_a_missing_tokenizer_path(tmp_path, capsys):
    missing = tmp_path / "no_tokenizer_here"
    line = run(capsys, "generate", "--tokenizer", missing, "--layers", "1", "--new-tokens", "1")
    assert str(missing) in line and "does not exist" in line and "--tokenizer" in line


def test_train_out_under_a_regular_file(tmp_path, capsys):
    (tmp_path / "a_file").write_text("not a folder")
    line = run(capsys, "train", "--out", tmp_path / "a_file" / "sub", "--max-steps", "1")
    assert "--out" in line and "a_file" in line and "is a file, not a folder" in line


def test_train_out_that_is_a_regular_file(tmp_path, capsys):
    (tmp_path / "a_file").write_text("not a folder")
    line = run(capsys, "train", "--out", tmp_path / "a_file", "--max-steps", "1")
    assert "--out" in line and "is a file, not a folder" in line


def test_convert_of_a_bin_checkpoint_torch_refuses(refused_bin, tmp_path, capsys):
    line = run(capsys, "convert", "--from", refused_bin, "--out", tmp_path / "out")
    assert "--from" in line and "weights_only=True" in line and "NotATensor" in line and "safetensors" in line


def test_eval_of_a_bin_checkpoint_torch_refuses(refused_bin, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("some text to score\n")
    line = run(capsys, "eval", "--model", refused_bin, "--perplexity", text)
    assert "--model" in line and "weights_only=True" in line and "NotATensor" in line and "safetensors" in line


def test_main_turns_any_os_error_into_one_line(monkeypatch, tmp_path, capsys):
    """The safety net: a path error no command checked for is still one line and exit 2, with the fix."""
    def fails(args):
        raise NotADirectoryError(20, "Not a directory", str(tmp_path / "f" / "x"))

    parser = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda: _with_func(parser(), fails))
    line = run(capsys, "flops", "--preset", "tiny")
    assert "Not a directory" in line and str(tmp_path / "f" / "x") in line and "Pass a path" in line


def _with_func(parser, func):
    parser.set_defaults(func=func)
    for action in parser._subparsers._group_actions:
        for sub in action.choices.values():
            sub.set_defaults(func=func)
    return parser


def test_error_line_is_one_line_whatever_the_message():
    assert cli.error_line(ValueError("first\n\tsecond  line\n")) == "error: first second line"
