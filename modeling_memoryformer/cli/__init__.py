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
"""

from __future__ import annotations

import argparse
import importlib
import pickle
import sys
import time

from ..training import TABLE_OPTIMIZERS  # a tuple: the training package's __init__ imports nothing

# Nothing heavy is imported here: torch, transformers and the model load inside the command that runs, so that
# `memoryformer --help` and `memoryformer COMMAND --help` answer at once (tests/tools/test_cli_help.py checks it).

# configuration_memoryformer.PRESETS, repeated here because that module imports transformers (and torch);
# tests/tools/test_cli_help.py checks that the two agree.
PRESETS = ("tiny", "small", "base")


def _flops(args: argparse.Namespace) -> int:
    from ..configuration_memoryformer import MemoryFormerConfig
    from ..evaluation.flops import comparison_table, layer_memory_table

    configs = {name: MemoryFormerConfig.from_preset(name) for name in args.preset}
    bytes_per_value = {"fp16": 2, "bf16": 2, "fp32": 4}[args.dtype]
    print(comparison_table(configs, args.seq_len, bytes_per_value))
    for name, config in configs.items():
        print(f"\nMF-{name}: table memory per Memory Layer ({args.dtype})\n")
        print(layer_memory_table(config, bytes_per_value))
    return 0


def _generate(args: argparse.Namespace) -> int:
    """Build a preset, run a forward and a short greedy generation, print the FLOPs/memory comparison."""
    import torch

    from .. import MemoryFormerConfig, MemoryFormerForCausalLM
    from ..evaluation.flops import comparison_table, layer_memory_table
    from ..evaluation.kernel_report import run_facts, run_facts_line

    print(run_facts_line(run_facts()))  # loads (builds) the kernel first: not inside any timing below
    torch.manual_seed(args.seed)
    overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
    config = MemoryFormerConfig.from_preset(args.preset, **overrides)
    tokenizer = None
    if args.tokenizer:  # before the model is built: a wrong path fails at once, with the fix
        from ..training.data import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer, hint="Pass --tokenizer a tokenizer folder (with tokenizer.json) or "
                                   "a Hub id, or leave it out to prompt with random token ids.", pad_with_eos=False)
    print(f"Building MF-{args.preset} (random init): {config.num_hidden_layers} layers, d={config.hidden_size}, "
          f"heads={config.num_attention_heads}, tau={config.hash_bits}, K={config.num_tables}, e={config.expand_bits}")
    start = time.perf_counter()
    model = MemoryFormerForCausalLM(config).eval()
    n_params = sum(p.numel() for p in model.parameters())
    n_tables = sum(p.numel() for name, p in model.named_parameters() if name.endswith("tables"))
    print(f"  built in {time.perf_counter() - start:.1f} s: {n_params / 1e6:.1f} M parameters, "
          f"{n_tables / 1e6:.1f} M of them in hash tables")

    if tokenizer is not None:
        prompt = tokenizer(args.prompt, return_tensors="pt").input_ids
    else:
        prompt = torch.randint(0, config.vocab_size, (1, 16))
    with torch.inference_mode():
        start = time.perf_counter()
        logits = model(prompt).logits
        forward_s = time.perf_counter() - start
        start = time.perf_counter()
        generated = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
        generate_s = time.perf_counter() - start
    print(f"  forward of {prompt.shape[1]} tokens: logits {tuple(logits.shape)} in {forward_s * 1e3:.0f} ms")
    new_tokens = generated[0, prompt.shape[1]:]
    shown = tokenizer.decode(new_tokens) if tokenizer else new_tokens.tolist()
    print(f"  greedy generation of {args.new_tokens} tokens in {generate_s:.2f} s "
          f"({args.new_tokens / generate_s:.1f} tokens/s, untrained weights): {shown!r}")
    print("\nFLOPs and memory per block against the Pythia twin (paper Table 1 counting, fp16 tables):\n")
    print(comparison_table({args.preset: config}, args.seq_len))
    print()
    print(layer_memory_table(config))
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# The parser: every command's options with their defaults in --help. A command's options are added when that command
# is parsed or its help is printed, and comes from a module without torch (here, or a light settings module such as
# conversion.settings), so no `--help` imports torch.


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already states its default (or it has none)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.default is None or action.default is False
                or action.default is argparse.SUPPRESS or action.required):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class CommandParser(argparse.ArgumentParser):
    """The parser of one command; `add_arguments` (a callable or "module:function") adds its options on first use."""

    def __init__(self, *args, add_arguments=None, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self._add_arguments = add_arguments

    def add_command_arguments(self) -> CommandParser:
        if self._add_arguments is not None:
            add, self._add_arguments = self._add_arguments, None
            _resolve(add)(self)
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


def _resolve(target):
    """`target` itself, or the function "module:function" names (module relative to modeling_memoryformer), imported
    now."""
    if callable(target):
        return target
    module, function = target.split(":")
    return getattr(importlib.import_module(f"..{module}", __package__), function)


def _runner(target: str):
    def run(args: argparse.Namespace) -> int:
        return _resolve(target)(args)

    run.__qualname__ = run.__name__ = target.replace(":", ".")
    return run


def add_flops_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", nargs="+", choices=PRESETS, default=list(PRESETS), help="presets to compare")
    parser.add_argument("--seq-len", type=int, default=2048, help="sequence length s of the FLOPs counts")
    parser.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="fp16", help="table value type for memory")


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=PRESETS, default="tiny", help="model shape (random weights)")
    parser.add_argument("--layers", type=int, default=None, help="number of blocks (default: the preset's)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer path or Hub id (default: random token ids)")
    parser.add_argument("--prompt", default="The meaning of life is", help="prompt text (with --tokenizer)")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens to generate")
    parser.add_argument("--seq-len", type=int, default=2048, help="sequence length for the FLOPs table")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the weights and prompt")


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    from ..comparison.demo import DemoSettings  # a light module: no torch at import

    defaults = DemoSettings()
    parser.add_argument("--out", default=defaults.out, help="report folder")
    parser.add_argument("--data", default=None,
                        help="text file, folder of .txt files or Hub dataset id (default: embedded CPython docs)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer path or Hub id (default: byte-level BPE trained on the training text)")
    parser.add_argument("--eval-text", default=None,
                        help="a text file for an extra out-of-domain perplexity of both models, e.g. WikiText-2 "
                             "(default: none)")
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size, help="of the trained tokenizer")
    parser.add_argument("--preset", choices=PRESETS, default=None,
                        help="MemoryFormer preset instead of the demo shape below (default: the demo shape)")
    parser.add_argument("--hidden-size", type=int, default=defaults.hidden_size, help="width d")
    parser.add_argument("--layers", type=int, default=defaults.num_hidden_layers, help="number of blocks")
    parser.add_argument("--heads", type=int, default=defaults.num_attention_heads, help="attention heads")
    parser.add_argument("--hash-bits", type=int, default=defaults.hash_bits, help="tau")
    parser.add_argument("--expand-bits", type=int, default=defaults.expand_bits, help="e of the Memory Block")
    parser.add_argument("--block-size", type=int, default=defaults.block_size, help="tokens per training sequence")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="sequences per step")
    parser.add_argument("--max-steps", type=int, default=defaults.max_steps,
                        help="training steps, same for both models")
    parser.add_argument("--eval-points", type=int, default=defaults.eval_points,
                        help="validation evaluations along each model's run (the points of the loss curves)")
    parser.add_argument("--lr-multiplier", type=float, default=None,
                        help="MemoryFormer learning rate over the twin's (default: 3, the paper's rule)")
    parser.add_argument("--decode-tokens", type=int, default=defaults.decode_tokens,
                        help="tokens generated for the decode speed and the samples")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="random seed")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing report folder")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output folder: checkpoints, log.csv, the final model")
    parser.add_argument("--data", default=None,
                        help="text file, folder of .txt files, local dataset folder or Hub dataset id "
                             "(default: the embedded CPython documentation)")
    parser.add_argument("--text-column", default="text", help="text column of a dataset")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer path or Hub id (default: --model's own, else a byte-level BPE trained on the "
                             "training text)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="of the trained BPE tokenizer")
    parser.add_argument("--model", default=None,
                        help="a saved MemoryFormer (folder or Hub id) to continue training (default: a new model)")
    parser.add_argument("--preset", choices=PRESETS, default=None,
                        help="MemoryFormer preset (default: the shape of --hidden-size, --layers, ...)")
    parser.add_argument("--hidden-size", type=int, default=256, help="width d")
    parser.add_argument("--layers", type=int, default=4, help="number of blocks")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--hash-bits", type=int, default=8, help="tau")
    parser.add_argument("--expand-bits", type=int, default=2, help="e of the Memory Block")
    parser.add_argument("--block-size", type=int, default=128, help="tokens per training sequence")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step, per device (process)")
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--max-steps", type=int, default=1000, help="optimizer steps of the whole run")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the recipe's)")
    parser.add_argument("--lr-multiplier", type=float, default=None,
                        help="times the Pythia rate of this width (default: 3, the paper's rule)")
    parser.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (not on biases, norms)")
    parser.add_argument("--table-optimizer", choices=TABLE_OPTIMIZERS, default="adamw",
                        help="optimizer of the Memory Layer tables: adamw (like every parameter), rowwise_adagrad (4 "
                             "bytes of state per row) or adam_rowwise (a first moment and a row-wise second one), the "
                             "last two applied in the backward pass; one process, no --grad-accum")
    parser.add_argument("--warmup-ratio", type=float, default=0.01, help="fraction of the steps warming up")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    parser.add_argument("--eval-points", type=int, default=None,
                        help="validation evaluations over the run, evenly spaced, the last at --max-steps "
                             "(default: 10, at least 10 steps apart: one, at the end, for a run of 10 steps or fewer)")
    parser.add_argument("--eval-steps", type=int, default=None,
                        help="evaluate every N steps instead (default: from --eval-points)")
    parser.add_argument("--logging-steps", type=int, default=None,
                        help="log the training loss every N steps (default: about 50 logs per run)")
    parser.add_argument("--save-steps", type=int, default=None,
                        help="checkpoint every N steps, resumable (default: no checkpoints, only the final model)")
    parser.add_argument("--report-to", default="csv", help="csv, tensorboard, none, ... (comma-separated)")
    parser.add_argument("--resume", default=None,
                        help="checkpoint folder to resume from, or 'latest' for the newest complete one in --out "
                             "(default: a new run)")
    parser.add_argument("--resume-partial", action="store_true",
                        help="allow resuming from a checkpoint without optimizer/scheduler state (fresh ones)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier run in --out (its checkpoints are deleted, its model replaced)")
    parser.add_argument("--seed", type=int, default=0, help="random seed")


def add_bucket_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="trained MemoryFormer: a local folder or a Hub id")
    parser.add_argument("--data", default=None, help="text file, folder or Hub dataset (default: the embedded text)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer path or Hub id (default: the model's own)")
    parser.add_argument("--layers", nargs="+", default=None, help="Memory Layer names to count (default: all)")
    parser.add_argument("--block-size", type=int, default=128, help="tokens per block")
    parser.add_argument("--batch-size", type=int, default=8, help="blocks per forward")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="stop after at least this many tokens, whole blocks (default: all of --split)")
    parser.add_argument("--split", choices=("validation", "all"), default="validation",
                        help="count the validation blocks or every block")
    parser.add_argument("--out", default=None,
                        help="folder for bucket_stats.json and buckets.png (default: MODEL/buckets when --model is "
                             "a local folder; required for a Hub id)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


# evaluation.harness.PAPER_TASKS and integrations.hub.DEFAULT_COMMIT_MESSAGE, repeated for --help (those modules
# import torch); tests/tools/test_cli_help.py checks that they agree.
PAPER_TASKS = ("piqa", "winogrande", "wsc", "arc_easy", "arc_challenge", "logiqa")
DEFAULT_COMMIT_MESSAGE = "Upload MemoryFormer model and model card"


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model folder or Hub id (AutoModelForCausalLM)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder or Hub id (default: the model's)")
    parser.add_argument("--tasks", nargs="+", default=None,
                        help=f"harness tasks (default: the paper's {' '.join(PAPER_TASKS)}; none when only "
                             "--perplexity is given)")
    parser.add_argument("--num-fewshot", type=int, default=0, help="in-context examples (the paper: 0)")
    parser.add_argument("--limit", type=float, default=None,
                        help="documents per task (N), or a fraction (0 < F < 1); for quick checks only "
                             "(default: every document)")
    parser.add_argument("--include-path", default=None,
                        help="folder of local task YAMLs (offline data, see --export-tasks); overrides same names "
                             "(default: none)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per forward")
    parser.add_argument("--device", default="cpu", help="torch device")
    parser.add_argument("--perplexity", default=None, metavar="FILE",
                        help="text file for sliding-window perplexity (default: none)")
    parser.add_argument("--context-length", type=int, default=None,
                        help="perplexity window (default: the model's max_position_embeddings)")
    parser.add_argument("--stride", type=int, default=None, help="perplexity stride (default: context length // 2)")
    parser.add_argument("--out", default=None, metavar="JSON",
                        help="write the results to this file (default: print only)")
    parser.add_argument("--export-tasks", default=None, metavar="DIR",
                        help="instead of evaluating: save --tasks' data as jsonl + task YAMLs in DIR (needs the "
                             "Hub once), for --include-path DIR offline (default: evaluate)")


def add_push_arguments(parser: argparse.ArgumentParser) -> None:
    """The token comes from HF_TOKEN or `hf auth login`, the Hub from HF_ENDPOINT."""
    parser.add_argument("--model", required=True, metavar="DIR",
                        help="folder written by save_pretrained: config.json and model.safetensors")
    parser.add_argument("--repo-id", required=True, help="namespace/name on the Hub (a bare name goes to your account)")
    parser.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="tokenizer folder or Hub id (default: the tokenizer saved in --model, if there is one)")
    parser.add_argument("--provenance", default=None, metavar="TEXT",
                        help="how the weights were made: trained / converted from what, on what data (default: none)")
    parser.add_argument("--base-model", default=None, metavar="ID",
                        help="Hub id of the model it was converted from (default: none)")
    parser.add_argument("--dataset", dest="datasets", action="append", default=None, metavar="ID",
                        help="Hub id of a training dataset, repeatable (default: none)")
    parser.add_argument("--license", default="apache-2.0", help="license of the model card")
    parser.add_argument("--private", action="store_true",
                        help="create the repo private (an existing repo is unchanged)")
    parser.add_argument("--commit-message", default=DEFAULT_COMMIT_MESSAGE, help="message of the Hub commit")


# evaluation.kernel_report.DTYPES (its keys), repeated for --help like PRESETS; tests/tools/test_cli_help.py checks that
# they agree.
KERNEL_DTYPES = ("fp32", "bf16", "fp16", "fp64")


def add_kernels_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=PRESETS, default="tiny", help="model whose Memory Layers are planned")
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=None,
        help="token counts per call to plan for (default: 1 = decode, 2048 = prefill 1 x 2048, "
        "4096 = training 8 x 512)",
    )
    parser.add_argument("--dtype", choices=KERNEL_DTYPES, default="fp32", help="table value type (default fp32)")
    parser.add_argument(
        "--cache-sizes", nargs=3, metavar=("L1D", "L2", "L3"), default=None,
        help="plan as if the caches had these sizes (e.g. 48K 1M 32M) instead of the detected ones",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


# (command, help, its options: a function here or "module:function", its runner "module:function")
COMMANDS = (
    ("demo", "Train a MemoryFormer and its Pythia twin side by side on the same tokens and write a report.",
     add_demo_arguments, "comparison.demo:run_demo_cli"),
    ("train", "Train a MemoryFormer with transformers.Trainer and the paper's recipe.",
     add_train_arguments, "training.trainer:run_train"),
    ("buckets", "Bucket-hit histograms and uniformity of a model's hash tables (Fig. 4).",
     add_bucket_arguments, "evaluation.buckets:run_buckets"),
    ("convert", "Convert a Pythia (GPT-NeoX) checkpoint into a MemoryFormer.",
     "conversion.settings:add_convert_arguments", "conversion.convert:run_convert"),
    ("eval", "Zero-shot tasks with lm-evaluation-harness; perplexity on a text file.",
     add_eval_arguments, "evaluation.harness:run_eval"),
    ("push", "Push a saved model, its tokenizer and a generated model card to the Hub.",
     add_push_arguments, "integrations.hub:run_push"),
    ("generate", "Build a preset, run a forward and a generation, print FLOPs and memory.",
     add_generate_arguments, _generate),
    ("flops", "FLOPs per block and table memory against the Pythia twin (paper Table 1).",
     add_flops_arguments, _flops),
    ("kernels", "CPU features, cache sizes, the fused kernel's vector layer and its strategy per Memory Layer.",
     add_kernels_arguments, "evaluation.kernel_report:run_kernels"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memoryformer", description=__doc__, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    for name, help_text, add_arguments, run in COMMANDS:
        command = sub.add_parser(name, help=help_text, description=help_text, add_arguments=add_arguments)
        command.set_defaults(func=run if callable(run) else _runner(run))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "seq_len", 1) <= 0:
        print(f"error: --seq-len must be positive, got {args.seq_len}", file=sys.stderr)
        return 2
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

