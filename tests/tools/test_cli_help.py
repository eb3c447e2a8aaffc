"""`memoryformer --help` and every command's --help answer at once: they import no torch, transformers or model code
(the command's own module loads when the command runs), and every option's help states its default."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import pytest

from modeling_memoryformer import cli

HEAVY = ("torch", "transformers", "huggingface_hub", "modeling_memoryformer.modeling_memoryformer")
COMMANDS = [name for name, *_ in cli.COMMANDS]  # the one list of commands: every one answers --help light

HELP_RUNNER = """
import sys
from modeling_memoryformer.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit_:
    code = exit_.code
heavy = [name for name in {heavy!r} if name in sys.modules]
print("@@" + repr((code, heavy)))
"""


def run_help(*argv: str) -> tuple[str, list[str]]:
    """stdout of `memoryformer ARGV` in a fresh interpreter, and the heavy modules it had imported by the end."""
    result = subprocess.run([sys.executable, "-c", HELP_RUNNER.format(heavy=HEAVY), *argv], check=False,
                            capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "120"})
    assert result.returncode == 0, result.stderr
    text, _, marker = result.stdout.rpartition("@@")
    code, heavy = eval(marker)
    assert code == 0, result.stderr
    return " ".join(text.split()), heavy


def test_top_level_help_imports_nothing_heavy_and_lists_every_command():
    text, heavy = run_help("--help")
    assert heavy == []
    for name, *_ in cli.COMMANDS:
        assert name in text, name


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help_imports_nothing_heavy(command):
    text, heavy = run_help(command, "--help")
    assert heavy == [], f"`memoryformer {command} --help` imported {heavy}"
    assert f"usage: memoryformer {command}" in text


WITHIN_ITS_HELP = r"(?:(?! --[a-z-]+ [A-Z_]+ ).)*?"  # any text before the next option (with its metavar)


def test_train_help_shows_the_defaults():
    text, _ = run_help("train", "--help")
    for option, default in (("--max-steps MAX_STEPS", "1000"), ("--block-size BLOCK_SIZE", "128"),
                            ("--vocab-size VOCAB_SIZE", "4096"), ("--weight-decay WEIGHT_DECAY", "0.1"),
                            ("--report-to REPORT_TO", "csv")):
        assert re.search(rf"{re.escape(option)} {WITHIN_ITS_HELP}\(default: {re.escape(default)}\)", text), option
    assert re.search(rf"--eval-points EVAL_POINTS {WITHIN_ITS_HELP}default: 10, at least 10 steps apart", text)
    assert re.search(rf"--logging-steps LOGGING_STEPS {WITHIN_ITS_HELP}default: about 50 logs per run", text)


def test_every_option_with_a_default_states_it():
    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert set(commands) == {name for name, *_ in cli.COMMANDS}
    for name, command in commands.items():
        command.add_command_arguments()
        formatter = command._get_formatter()
        for action in command._actions:
            if (not action.option_strings or action.required or action.help == argparse.SUPPRESS
                    or action.default in (None, False, argparse.SUPPRESS)):
                continue
            assert action.help, f"{name} {action.option_strings[0]} has no help (argparse then prints no default)"
            assert "default" in formatter._expand_help(action), f"{name} {action.option_strings[0]}"


def test_constants_repeated_for_help_agree_with_their_modules():
    from modeling_memoryformer.configuration_memoryformer import PRESETS
    from modeling_memoryformer.evaluation import settings as evaluation_settings
    from modeling_memoryformer.evaluation.kernel_report import DTYPES
    from modeling_memoryformer.training import settings as training_settings

    assert training_settings.PRESETS == PRESETS
    assert evaluation_settings.KERNEL_DTYPES == tuple(DTYPES)


def test_a_command_still_runs_after_lazy_parsing(capsys):
    assert cli.main(["flops", "--preset", "tiny", "--seq-len", "128"]) == 0
    assert "MF-tiny" in capsys.readouterr().out
