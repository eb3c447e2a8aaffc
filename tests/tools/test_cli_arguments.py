"""Every command-line option is a field of a settings dataclass, defined once (cli.arguments makes the options), and
the settings a command gets are those its flags say: parsed values land in their fields, an option left out takes
the field's default, and a bad value is refused by the dataclass's own check with the flag named."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import typing

import pytest

from modeling_memoryformer import cli
from modeling_memoryformer.cli.arguments import cli_fields, flag_of, with_flags

ROOT = pathlib.Path(__file__).resolve().parents[2]


def commands() -> dict[str, cli.CommandParser]:
    parser = cli.build_parser()
    found = parser._subparsers._group_actions[0].choices
    return {name: command.add_command_arguments() for name, command in found.items()}


def required_argv(command: cli.CommandParser, tmp_path) -> list[str]:
    """Values for the required options of a command (paths in tmp_path)."""
    argv = []
    for cls in command.settings_classes:
        for field in cli_fields(cls):
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                flag = [] if field.metadata.get("positional") else [flag_of(field)]
                argv += [*flag, str(tmp_path / field.name)]
    return argv


@pytest.mark.parametrize("name", [name for name, *_ in cli.COMMANDS])
def test_every_option_is_a_settings_field_and_every_field_an_option(name):
    command = commands()[name]
    options = {action.dest for action in command._actions if action.dest != "help"}  # flags and positionals
    fields = {f.name for cls in command.settings_classes for f in cli_fields(cls)}
    assert command.settings_classes and options == fields


@pytest.mark.parametrize("name", [name for name, *_ in cli.COMMANDS])
def test_options_left_out_take_the_dataclass_defaults(name, tmp_path):
    command = commands()[name]
    argv = required_argv(command, tmp_path)
    parsed = cli.parse_settings([name, *argv])
    for cls, settings in zip(command.settings_classes, parsed):
        required = {f.name: getattr(settings, f.name) for f in cli_fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        assert settings == cls(**required)  # the oracle: the dataclass built directly, from Python


def _value_for(field: dataclasses.Field, hint, tmp_path):
    """A valid value other than the default for an option, and its command-line words."""
    inner = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    hint = inner[0] if typing.get_origin(hint) in (typing.Union, __import__("types").UnionType) else hint
    if typing.get_origin(hint) in (tuple, list):
        element_type = typing.get_args(hint)[0]
        element = field.metadata["choices"][0] if "choices" in field.metadata else element_type(7)
        count = field.metadata.get("nargs", 1)
        count = count if isinstance(count, int) else 1
        return typing.get_origin(hint)([element] * count), [str(element)] * count
    if hint is bool:
        return (not field.default), []
    if "choices" in field.metadata:
        choices = [c for c in field.metadata["choices"] if c != field.default]
        return choices[-1], [choices[-1]]
    if hint is int:
        value = (field.default or 1) + 1 if isinstance(field.default, int) else 3
        return value, [str(value)]
    if hint is float:
        value = 0.5 if field.default in (None, 0) or field.default >= 1 else field.default / 2
        return value, [repr(value)]
    return None, None


NEEDS_OTHER_OPTIONS = ("table_optimizer", "init", "distill_steps", "distill_cpu_minutes")


@pytest.mark.parametrize("name", ["train", "demo", "convert", "flops", "buckets", "eval", "kernels", "generate"])
def test_each_flag_sets_its_field(name, tmp_path):
    command = commands()[name]
    base = required_argv(command, tmp_path)
    for cls, index in zip(command.settings_classes, range(len(command.settings_classes))):
        hints = typing.get_type_hints(cls)
        for field in cli_fields(cls):
            if field.default is dataclasses.MISSING or field.name in NEEDS_OTHER_OPTIONS:
                continue  # required (set above), or a value whose check needs other options
            value, words = _value_for(field, hints[field.name], tmp_path)
            if words is None:
                continue
            settings = cli.parse_settings([name, *base, flag_of(field), *words])[index]
            assert getattr(settings, field.name) == value, (name, flag_of(field))


def test_a_bad_value_is_refused_by_its_dataclass_with_the_flag_named(tmp_path, capsys):
    from modeling_memoryformer.training.settings import TrainingSettings

    with pytest.raises(ValueError, match=r"^warmup_ratio must be in \[0, 1\), got 1.5"):
        TrainingSettings(output_dir=str(tmp_path / "run"), warmup_ratio=1.5)  # from Python: the field's name
    assert cli.main(["train", "--out", str(tmp_path / "run"), "--warmup-ratio", "1.5"]) == 2
    assert capsys.readouterr().err.strip() == "error: --warmup-ratio must be in [0, 1), got 1.5."
    assert not (tmp_path / "run").exists()


def test_with_flags_rewrites_field_names_only_where_they_are_names():
    from modeling_memoryformer.training.settings import TrainingSettings

    text = "max_steps must be >= 1; seed must be >= 0; the seed of the run; output_dir is a file; a max_steps_x"
    assert with_flags(text, TrainingSettings) == (
        "--max-steps must be >= 1; --seed must be >= 0; the seed of the run; --out is a file; a max_steps_x")


def test_only_the_cli_parses_arguments():
    """No tool module builds a parser: the commands' options all come from settings dataclasses through cli."""
    package = [*(ROOT / "modeling_memoryformer").rglob("*.py"), *(ROOT / "conversion").glob("*.py")]
    offenders = []
    for path in package:
        if "cli" in path.relative_to(ROOT).parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) else [])
            if "argparse" in names:
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_demo_and_train_share_the_data_and_shape_definitions():
    from modeling_memoryformer.comparison.demo import DemoSettings
    from modeling_memoryformer.training.settings import DataSettings, ModelShape

    assert issubclass(DemoSettings, DataSettings) and issubclass(DemoSettings, ModelShape)
    train, demo = commands()["train"], commands()["demo"]
    for field in [*cli_fields(DataSettings), *cli_fields(ModelShape)]:
        flag = flag_of(field)
        helps = {c: next(a.help for a in c._actions if flag in a.option_strings) for c in (train, demo)}
        assert helps[train] == helps[demo] == field.metadata["help"]
