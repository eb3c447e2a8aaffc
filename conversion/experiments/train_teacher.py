"""Train the Pythia-shaped teacher of the conversion experiment.

A GPT-NeoX with Pythia's layout (parallel residual, GELU MLP of 4d, rotary on a quarter of each head, untied head) at
hidden 256, 4 layers, 4 heads, with the Pythia tokenizer, trained on the first 90% of Tiny Shakespeare within a CPU-time
budget (default 15 CPU-minutes, all threads counted); the last 10% is held out. The number of optimizer steps that fits
the budget is measured by a short probe, so the cosine schedule ends when the budget does.

    python conversion/experiments/train_teacher.py --out conversion/teacher      # then: run_quality.py beside it

Writes the model (safetensors) and the tokenizer to --out (outside git) and a summary to
conversion/results/teacher.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from modeling_memoryformer.conversion.convert import ConversionError, staged_folder
from modeling_memoryformer.conversion.distill import TrainingBudget, train_student
from modeling_memoryformer.evaluation.perplexity import blocks_perplexity
from modeling_memoryformer.training.data import load_tokenizer, text_blocks


HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # conversion/
SHARED = os.path.join(HERE, os.pardir, os.pardir, "shared", "data")


def teacher_config(tokenizer, args: argparse.Namespace) -> GPTNeoXConfig:
    return GPTNeoXConfig(
        vocab_size=50304,  # Pythia's padded vocabulary
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden_size,
        hidden_act="gelu",
        rotary_pct=0.25,
        rotary_emb_base=10000,
        max_position_embeddings=2048,
        use_parallel_residual=True,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def held_out_split(text: str, fraction: float = 0.1) -> tuple[str, str]:
    """First (1 - fraction) of the characters for training, the rest held out."""
    cut = int(len(text) * (1 - fraction))
    return text[:cut], text[cut:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(HERE, "teacher"))
    parser.add_argument("--text", default=os.path.join(SHARED, "tinyshakespeare.txt"))
    parser.add_argument("--tokenizer", default=os.path.join(SHARED, "pythia-tokenizer"))
    parser.add_argument("--cpu-minutes", type=float, default=15.0)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3, help="Pythia-70M's peak learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--summary", default=os.path.join(HERE, "results", "teacher.json"))
    args = parser.parse_args(argv)
    if not os.path.exists(args.text):
        print(f"error: {args.text} does not exist (pass --text with a plain-text file, e.g. Tiny Shakespeare).",
              file=sys.stderr)
        return 2
    try:  # a local folder or a Hub id (e.g. EleutherAI/pythia-70m)
        tokenizer = load_tokenizer(args.tokenizer, hint="Pass --tokenizer with a tokenizer folder or a Hub id.",
                                   pad_with_eos=False)
    except (OSError, ValueError) as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    with open(args.text, encoding="utf-8") as f:
        train_text, held_out_text = held_out_split(f.read())
    train_ids = text_blocks(train_text, tokenizer, args.seq_len)
    held_out_ids = text_blocks(held_out_text, tokenizer, args.seq_len)
    torch.manual_seed(args.seed)
    model = GPTNeoXForCausalLM(teacher_config(tokenizer, args))
    budget = TrainingBudget(None, args.cpu_minutes, args.lr, args.batch_size, weight_decay=0.1, seed=args.seed)
    try:
        with staged_folder(args.out, args.overwrite) as staging:
            run = train_student(model, train_ids, budget)  # the Trainer shuffles
            held_out = blocks_perplexity(model, held_out_ids, batch_size=32, progress=True)
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            summary = {
                "command": "python conversion/experiments/train_teacher.py "
                           + " ".join(argv if argv is not None else sys.argv[1:]),
                "config": {"hidden_size": args.hidden_size, "layers": args.layers, "heads": args.heads,
                           "seq_len": args.seq_len, "batch_size": args.batch_size, "lr": args.lr},
                "train_tokens": int(train_ids.numel()),
                "held_out_tokens": int(held_out_ids.numel()),
                "epochs": run["steps"] * args.batch_size / train_ids.shape[0],
                "held_out_perplexity": held_out,
                "held_out_loss": math.log(held_out),
                "training": run,
            }
            with open(os.path.join(staging, "teacher_report.json"), "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=2)
    except ConversionError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(args.summary), exist_ok=True)
    with open(args.summary, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    print(f"teacher: {run['steps']} steps, {run['cpu_seconds'] / 60:.1f} CPU-min, held-out perplexity {held_out:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
