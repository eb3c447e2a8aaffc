"""Quality of the table optimizers: the same MemoryFormer trained with AdamW on every parameter and with each table
rule (`--table-optimizer`), on the same tokens.

Every run is the demo's MemoryFormer (d 256, 4 layers, 4 heads, tau 8, e 2; or `--preset`) with the same data,
tokenizer, seed, steps, batch and learning-rate schedule (the paper's recipe: 3x the Pythia rate of the width, warmup
then cosine); only the optimizer of the tables changes. The validation loss is measured at `--eval-points` points
along each run, so the curves compare the rules at equal steps, not only at the end.

Writes `results.json`, `results.md` (the table) and `loss_curves.png` (validation loss against training tokens, one
curve per optimizer) to --out. Run:

    .venv/bin/python experiments/table_optimizers.py --out experiments/results/table-optimizers-pydoc
    .venv/bin/python experiments/table_optimizers.py --data ../shared/data/tinyshakespeare.txt \\
        --tokenizer ../shared/data/pythia-tokenizer --out experiments/results/table-optimizers-shakespeare
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

from transformers import set_seed

from modeling_memoryformer import MemoryFormerForCausalLM
from modeling_memoryformer.comparison.demo import loss_curves, plot_loss_curves
from modeling_memoryformer.training import TABLE_OPTIMIZERS
from modeling_memoryformer.training.data import build_lm_data
from modeling_memoryformer.training.trainer import (
    TrainingSettings,
    config_for_tokenizer,
    default_learning_rate,
    tokens_per_step,
    train,
    training_arguments,
)

DEMO_SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, hash_bits=8, expand_bits=2)


def parse_variant(text: str) -> tuple[str, float, str | None]:
    """"rule", "rule:multiplier" (the table rule's learning rate over the run's), either followed by "@bfloat16"
    (tables stored in bfloat16) -> (rule, multiplier, table dtype or None)."""
    text, _, table_dtype = text.partition("@")
    if table_dtype not in ("", "bfloat16"):
        raise argparse.ArgumentTypeError(f"the table dtype after '@' must be bfloat16, got {table_dtype!r}")
    name, _, multiplier = text.partition(":")
    if name not in TABLE_OPTIMIZERS:
        raise argparse.ArgumentTypeError(f"{name!r} is not one of {', '.join(TABLE_OPTIMIZERS)}")
    return name, float(multiplier) if multiplier else 1.0, table_dtype or None


def run_variant(data, variant: str, args) -> dict:
    table_optimizer, table_lr_multiplier, table_dtype = parse_variant(variant)
    config = config_for_tokenizer(data.tokenizer, args.preset, DEMO_SHAPE, args.block_size)
    config.table_dtype = table_dtype
    set_seed(args.seed)
    model = MemoryFormerForCausalLM(config)
    lr = default_learning_rate(model, lr_multiplier=args.lr_multiplier)
    with tempfile.TemporaryDirectory() as out:
        settings = TrainingSettings(
            output_dir=out, max_steps=args.max_steps, per_device_batch_size=args.batch_size, learning_rate=lr,
            eval_points=args.eval_points, report_to="none", seed=args.seed, table_optimizer=table_optimizer,
            table_lr_multiplier=table_lr_multiplier, max_grad_norm=args.max_grad_norm, save_final_model=False,
        )
        per_step = tokens_per_step(training_arguments(settings, model), args.block_size)
        result = train(model, data, settings)
    curves = loss_curves(result.log_history, per_step)
    return {
        "table_optimizer": variant, "learning_rate": lr, "table_learning_rate": lr * table_lr_multiplier,
        "steps": result.steps,
        "validation_loss": result.eval_loss, "validation_perplexity": result.perplexity,
        "train_tokens_per_second": result.train_tokens_per_second, "curves": curves,
    }


def write_results(rows: list[dict], description: str, args) -> None:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump({"settings": vars(args), "data": description, "rows": rows}, f, indent=2)
    base = next((r for r in rows if r["table_optimizer"] == "adamw"), None)
    lines = [f"Data: {description}; {args.max_steps} steps x {args.batch_size} x {args.block_size} tokens, "
             f"seed {args.seed}, gradient clipping at {args.max_grad_norm:g}.", "",
             "| table optimizer | learning rate (tables) | validation loss | validation perplexity | vs AdamW | "
             "training tokens/s |", "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['validation_perplexity'] / base['validation_perplexity']:.3f}x" if base else "-"
        tables = r.get("table_learning_rate", r["learning_rate"])
        lines.append(f"| {r['table_optimizer']} | {r['learning_rate']:g} ({tables:g}) | {r['validation_loss']:.4f} | "
                     f"{r['validation_perplexity']:.2f} | {ratio} | {r['train_tokens_per_second']:.0f} |")
    with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    curves = {r["table_optimizer"]: {"train": [], "eval": r["curves"]["eval"]} for r in rows}
    source = os.path.basename(args.data) if args.data else "embedded CPython docs"
    plot_loss_curves(curves, os.path.join(args.out, "loss_curves.png"),
                     f"MemoryFormer (d 256, 4 layers): validation loss by table optimizer, {source}")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=None, help="text source (default: the embedded CPython docs)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer path or id (default: trained byte-level BPE)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="of the trained BPE tokenizer")
    parser.add_argument("--preset", default=None, help="a MemoryFormer preset instead of the demo shape")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-steps", type=int, default=400, help="the demo's 400 by default")
    parser.add_argument("--eval-points", type=int, default=8)
    parser.add_argument("--lr-multiplier", type=float, default=None, help="default: 3, the paper's rule")
    parser.add_argument("--optimizers", nargs="+", default=list(TABLE_OPTIMIZERS),
                        help="table optimizers, each 'rule' or 'rule:multiplier' (its learning rate over the run's, "
                        "e.g. rowwise_adagrad:3), either with '@bfloat16' for tables stored in bfloat16")
    parser.add_argument("--max-grad-norm", type=float, default=1.0,
                        help="gradient clipping (the recipe's 1.0; it covers the dense parameters only under a table "
                        "rule; a huge value such as 1e9 turns it off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="experiments/results/table-optimizers")
    args = parser.parse_args(argv)
    for variant in args.optimizers:
        try:
            parse_variant(variant)
        except (argparse.ArgumentTypeError, ValueError) as error:
            parser.error(f"--optimizers {variant}: {error}")

    data = build_lm_data(args.data, args.tokenizer, block_size=args.block_size, vocab_size=args.vocab_size)
    # one-time costs (first touch of the tables, the kernel's first calls) in a short run of its own, so that the
    # tokens/s of the first variant are comparable to the others'
    run_variant(data, args.optimizers[0], argparse.Namespace(**{**vars(args), "max_steps": 2, "eval_points": 1}))
    rows = []
    for i, name in enumerate(args.optimizers):
        print(f"[{i + 1}/{len(args.optimizers)}] tables: {name}", file=sys.stderr, flush=True)
        row = run_variant(data, name, args)
        if not math.isfinite(row["validation_loss"]):
            print(f"  {name}: the validation loss is not finite ({row['validation_loss']})", file=sys.stderr)
        rows.append(row)
        write_results(rows, data.description, args)  # after every run: an interrupted experiment keeps what it measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
