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
import pickle
import sys
import time

from .configuration_memoryformer import PRESETS, MemoryFormerConfig


def _flops(args: argparse.Namespace) -> int:
    from .flops import comparison_table, layer_memory_table

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

    from . import MemoryFormerForCausalLM
    from .flops import comparison_table, layer_memory_table
    from .kernel_report import run_facts, run_facts_line

    print(run_facts_line(run_facts()))  # loads (builds) the kernel first: not inside any timing below
    torch.manual_seed(args.seed)
    overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
    config = MemoryFormerConfig.from_preset(args.preset, **overrides)
    tokenizer = None
    if args.tokenizer:  # before the model is built: a wrong path fails at once, with the fix
        from .data import load_tokenizer

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
    print(f"\nFLOPs and memory per block against the Pythia twin (paper Table 1 counting, fp16 tables):\n")
    print(comparison_table({args.preset: config}, args.seq_len))
    print()
    print(layer_memory_table(config))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memoryformer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    flops = sub.add_parser("flops", help="FLOPs per block and table memory against the Pythia twin (paper Table 1).")
    flops.add_argument("--preset", nargs="+", choices=PRESETS, default=list(PRESETS))
    flops.add_argument("--seq-len", type=int, default=2048)
    flops.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="fp16", help="table value type for memory")
    flops.set_defaults(func=_flops)

    generate = sub.add_parser("generate", help="Build a preset, run a forward and a generation, print FLOPs and memory.")
    generate.add_argument("--preset", choices=PRESETS, default="tiny")
    generate.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    generate.add_argument("--tokenizer", default=None, help="tokenizer path or Hub id (default: random token ids)")
    generate.add_argument("--prompt", default="The meaning of life is")
    generate.add_argument("--new-tokens", type=int, default=16)
    generate.add_argument("--seq-len", type=int, default=2048, help="sequence length for the FLOPs table")
    generate.add_argument("--seed", type=int, default=0)
    generate.set_defaults(func=_generate)

    from . import buckets, conversion, demo, evaluation, hub, kernel_report, training

    tools = (  # (command, help, module that defines its arguments, its runner)
        ("demo", "Train a MemoryFormer and its Pythia twin side by side on the same tokens and write a report.",
         demo.add_demo_arguments, demo.run_demo_cli),
        ("train", "Train a MemoryFormer with transformers.Trainer and the paper's recipe.",
         training.add_train_arguments, training.run_train),
        ("buckets", "Bucket-hit histograms and uniformity of a model's hash tables (Fig. 4).",
         buckets.add_bucket_arguments, buckets.run_buckets),
        ("convert", "Convert a Pythia (GPT-NeoX) checkpoint into a MemoryFormer.",
         conversion.add_convert_arguments, conversion.run_convert),
        ("eval", "Zero-shot tasks with lm-evaluation-harness; perplexity on a text file.",
         evaluation.add_eval_arguments, evaluation.run_eval),
        ("push", "Push a saved model, its tokenizer and a generated model card to the Hub.",
         hub.add_push_arguments, hub.run_push),
        ("kernels", "CPU features, cache sizes, the fused kernel's vector layer and its strategy per Memory Layer.",
         kernel_report.add_kernels_arguments, kernel_report.run_kernels),
    )
    for name, help_text, add_arguments, run in tools:
        command = sub.add_parser(name, help=help_text)
        add_arguments(command)
        command.set_defaults(func=run)
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


if __name__ == "__main__":
    sys.exit(main())
