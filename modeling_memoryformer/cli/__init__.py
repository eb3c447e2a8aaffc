"""The `memoryformer` command line.

    memoryformer demo       train a MemoryFormer and its Pythia twin side by side and report (the main job)
    memoryformer train      train a MemoryFormer on text (Trainer, the paper's recipe)
    memoryformer buckets    bucket-hit histograms of a trained model (paper Fig. 4)
    memoryformer convert    a Pythia (GPT-NeoX) checkpoint -> MemoryFormer (table init, calibration, distillation)
    memoryformer eval       lm-evaluation-harness on the paper's zero-shot tasks, sliding-window perplexity
    memoryformer push       upload a saved model with a generated model card to the Hub
    memoryformer generate   build a preset, run a forward and a generation, print FLOPs and memory
    memoryformer flops      FLOPs per block and table memory against the Pythia twin (paper Table 1)
    memoryformer kernels    CPU, caches and the fused kernel's strategy for every Memory Layer of a preset
    memoryformer serve      a model behind an OpenAI-compatible HTTP endpoint, on transformers' continuous batching
"""

from __future__ import annotations

import argparse
import importlib
import pickle
import sys

from .arguments import add_dataclass_arguments, settings_from

# Nothing heavy is imported here: torch, transformers and the model load inside the command that runs, so that
# `memoryformer --help` and `memoryformer COMMAND --help` answer at once (tests/tools/test_cli_help.py checks it).
# A command's options are the fields of its settings dataclasses (see `arguments`), each defined once in a light
# settings module of the tool that runs the command; this module only parses them and hands the settings objects
# to the command's function.

# (command, help, its settings classes as "module:Class" with the title of their group in --help, its function as
# "module:function"; the function takes one settings object per class, in this order)
COMMANDS = (
    ("demo", "Train a MemoryFormer and its Pythia twin side by side on the same tokens and write a report.",
     (("comparison.demo:DemoSettings", None),), "comparison.demo:run_demo_cli"),
    ("train", "Train a MemoryFormer with transformers.Trainer and the paper's recipe.",
     (("training.settings:TrainingSettings", "training (the paper's recipe)"),
      ("training.settings:DataSettings", "data"),
      ("training.settings:ModelShape", "shape of a new model"),
      ("training.settings:TrainCommandSettings", "start")),
     "training.trainer:run_train"),
    ("buckets", "Bucket-hit histograms and uniformity of a model's hash tables (Fig. 4).",
     (("evaluation.settings:BucketSettings", None),), "evaluation.buckets:run_buckets"),
    ("convert", "Convert a Pythia (GPT-NeoX) checkpoint into a MemoryFormer.",
     (("conversion.settings:ConvertSettings", None), ("evaluation.settings:StorageSettings", "storage of the result")),
     "conversion.convert:run_convert"),
    ("eval", "Zero-shot tasks with lm-evaluation-harness; perplexity on a text file.",
     (("evaluation.settings:EvalSettings", None), ("evaluation.settings:StorageSettings", "storage for inference")),
     "evaluation.harness:run_eval"),
    ("push", "Push a saved model, its tokenizer and a generated model card to the Hub.",
     (("integrations.settings:PushSettings", None),), "integrations.hub:run_push"),
    ("generate", "Build a preset, run a forward and a generation, print FLOPs and memory.",
     (("evaluation.settings:GenerateSettings", None),
      ("evaluation.settings:StorageSettings", "storage for inference")), "evaluation.generate:run_generate"),
    ("flops", "FLOPs per block and table memory against the Pythia twin (paper Table 1).",
     (("evaluation.settings:FlopsSettings", None),), "evaluation.flops:run_flops"),
    ("kernels", "CPU features, cache sizes, the fused kernel's vector layer and its strategy per Memory Layer.",
     (("evaluation.settings:KernelsSettings", None),), "evaluation.kernel_report:run_kernels"),
    ("serve", "Serve a model behind an OpenAI-compatible endpoint (/v1/completions, /v1/chat/completions).",
     (("serving.settings:ServeSettings", None), ("evaluation.settings:StorageSettings", "storage for inference")),
     "serving.server:run_serve"),
)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already states its default (or it has none)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.default is None or action.default is False
                or action.default is argparse.SUPPRESS or action.required):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def _resolve(target: str):
    """The object "module:name" names (module relative to modeling_memoryformer), imported now."""
    module, name = target.split(":")
    return getattr(importlib.import_module(f"..{module}", __package__), name)


class CommandParser(argparse.ArgumentParser):
    """The parser of one command; its options are made from its settings classes on first use (parsing or help), so
    that only the command asked for imports its settings module."""

    def __init__(self, *args, settings=(), **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self._pending = tuple(settings)
        self.settings_classes: tuple = ()

    def add_command_arguments(self) -> CommandParser:
        if self._pending:
            pending, self._pending = self._pending, ()
            classes = []
            for target, title in pending:
                cls = _resolve(target)
                add_dataclass_arguments(self, cls, title)
                classes.append(cls)
            self.settings_classes = tuple(classes)
        return self

    def parse_known_args(self, args=None, namespace=None):
        self.add_command_arguments()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self.add_command_arguments()
        return super().format_help()

    def format_usage(self) -> str:
        self.add_command_arguments()
        return super().format_usage()


def _command(parser: CommandParser, target: str):
    """The function a parsed command calls: its settings objects made from the namespace (their checks run here,
    before any work), then the command's function."""
    def run(args: argparse.Namespace) -> int:
        return _resolve(target)(*(settings_from(args, cls) for cls in parser.settings_classes))

    run.__qualname__ = run.__name__ = target.replace(":", ".")
    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memoryformer", description=__doc__, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    for name, help_text, settings, target in COMMANDS:
        command = sub.add_parser(name, help=help_text, description=help_text, settings=settings)
        command.set_defaults(func=_command(command, target))
    return parser


def parse_settings(argv: list[str]) -> tuple:
    """The settings objects of `memoryformer ARGV` (a command and its options), as the command would get them."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command = parser._subparsers._group_actions[0].choices[args.command]
    return tuple(settings_from(args, cls) for cls in command.settings_classes)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, pickle.UnpicklingError) as error:
        # bad input: the message names the problem and the fix; a traceback would only bury it. OSError covers a
        # path the command cannot read or write (FileNotFoundError, NotADirectoryError, PermissionError, ...).
        print(error_line(error), file=sys.stderr)
        return 2


def error_line(error: BaseException) -> str:
    """`error: <message>` on one line, whatever line breaks the message had."""
    message = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, OSError) and error.filename is not None and str(error.filename) not in message:
        message = f"{message}: {error.filename}"
    if isinstance(error, (NotADirectoryError, PermissionError)) and "Pass" not in message:
        message += ". Pass a path in a folder you can write to."
    return f"error: {message}"
