"""Command-line options made from settings dataclasses, in the manner of transformers' `HfArgumentParser`.

A command's options are the fields of its settings dataclasses: the flag is the field name with dashes
(`max_steps` -> `--max-steps`) unless the field's metadata names another (`{"flag": "--batch-size"}`), the type comes
from the annotation (`int`, `float`, `str`, `X | None`, `tuple[X, ...]` / `list[X]` for several values), the default
from the field, and the help from `metadata["help"]`. A bool field is a switch: `--name` when it defaults to False,
`--no-name` (or `metadata["flag"]`) when it defaults to True. `metadata["choices"]`, `["nargs"]`, `["metavar"]` and
`["action"]` ("append") pass through to argparse; `metadata["cli"] = False` keeps a field off the command line.

The settings classes are defined once, in light modules of the tools (no torch at import, so that `--help` answers at
once; `training.settings.option` declares a field), and checked once, in their `__post_init__`; this module only
turns parsed values into those objects. It uses nothing but the standard library (transformers' own parser would
import torch).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing


def flag_of(field: dataclasses.Field) -> str:
    """The command-line flag of a settings field."""
    if "flag" in field.metadata:
        return field.metadata["flag"]
    name = field.name.replace("_", "-")
    if field.default is True:  # a switch that is on by default turns off
        return f"--no-{name}"
    return f"--{name}"


def _unwrap_optional(annotation):
    """(the type inside `X | None` / `Optional[X]`, or the annotation itself); several types -> str."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return inner[0] if len(inner) == 1 else str
    return annotation


def cli_fields(cls) -> list[dataclasses.Field]:
    """The fields of a settings dataclass that are command-line options, in definition order."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True) and f.init]


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls, title: str | None = None) -> None:
    """Add one option per command-line field of the dataclass `cls` to `parser` (in an argument group when `title`
    is given). The option's dest is the field name."""
    hints = typing.get_type_hints(cls)
    target = parser.add_argument_group(title) if title else parser
    for field in cli_fields(cls):
        meta = field.metadata
        kwargs: dict = {"dest": field.name, "help": meta.get("help")}
        annotation = _unwrap_optional(hints[field.name])
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default, kwargs["required"] = None, True
        if annotation is bool:
            kwargs["action"] = "store_false" if default is True else "store_true"
        else:
            if typing.get_origin(annotation) in (tuple, list):
                annotation = typing.get_args(annotation)[0]
                kwargs["nargs"] = "+"
                if isinstance(default, tuple):
                    default = list(default)
            kwargs["type"] = annotation if annotation in (int, float) else str
            for key in ("choices", "nargs", "metavar", "action"):
                if key in meta:
                    kwargs[key] = meta[key]
            if kwargs.get("action") == "append":
                kwargs.pop("nargs", None)
            if "metavar" not in kwargs and "choices" not in kwargs:  # named after the flag, not the field
                kwargs["metavar"] = flag_of(field).lstrip("-").replace("-", "_").upper()
        if not kwargs.get("required"):
            kwargs["default"] = default
        if meta.get("positional"):  # `memoryformer serve MODEL`: named by its place, not a flag
            kwargs.pop("dest")
            kwargs.pop("required", None)
            kwargs["metavar"] = meta.get("metavar", field.name.upper())
            target.add_argument(field.name, **kwargs)
            continue
        target.add_argument(flag_of(field), **kwargs)


def settings_from(namespace: argparse.Namespace, cls):
    """An instance of `cls` from the parsed options (command-line fields) and the field defaults (the others).
    A ValueError of its checks comes back with the field names it mentions replaced by their flags."""
    values = {}
    hints = typing.get_type_hints(cls)
    for field in cli_fields(cls):
        value = getattr(namespace, field.name)
        hint = _unwrap_optional(hints[field.name])
        if typing.get_origin(hint) is tuple and isinstance(value, list):
            value = tuple(value)
        values[field.name] = value
    try:
        return cls(**values)
    except ValueError as error:
        message = with_flags(str(error), cls)
        if message == str(error):
            raise
        raise type(error)(message) from error


def with_flags(message: str, cls) -> str:
    """`message` with the names of `cls`'s command-line fields written as their flags: a multi-word name
    (`max_steps`) wherever it stands as a word, a one-word name (`seed`) where it is followed by `=` or ` must`."""
    for field in sorted(cli_fields(cls), key=lambda f: -len(f.name)):
        flag = flag_of(field)
        if "_" in field.name:
            pattern = rf"(?<![\w-]){re.escape(field.name)}(?![\w-])"
        else:
            pattern = rf"(?<![\w-]){re.escape(field.name)}(?=(=| must))"
        message = re.sub(pattern, flag, message)
    return message
