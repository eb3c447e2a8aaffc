"""Small-scale ablations in the direction of the paper's Tables 3-6.

Every variant is a MemoryFormer of the demo shape trained on the same tokens (same data, tokenizer, seed, steps,
batch); one setting changes at a time against the base (tau = 8, e = 2, 3x LR, no GELU, "paper" score):

- tau in {4, 8}                          (paper Table 3: lower perplexity as tau grows, table memory grows fast;
                                          d = 256 has no other practical divisor: tau = 16 needs 2**16-row tables)
- learning-rate multiplier in {1, 2, 3, 4} (Table 4: 3x the dense model's LR is best)
- expanding bits e in {0, 1, 2}           (Table 5: more bits, lower perplexity)
- GELU between the Memory Layers          (Table 6: no change)
- hash_score "paper" vs "l1"              (the paper's equation vs the authors' code)

Writes `results.json`, `results.md` (table) and `ablation.png` to --out. Run:

    .venv/bin/python experiments/ablation.py --out experiments/results/ablation-pydoc
    .venv/bin/python experiments/ablation.py --data ../shared/data/tinyshakespeare.txt \\
        --tokenizer ../shared/data/pythia-tokenizer --out experiments/results/ablation-shakespeare
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from transformers import set_seed

from modeling_memoryformer import MemoryFormerForCausalLM
from modeling_memoryformer.training.data import build_lm_data
from modeling_memoryformer.evaluation.flops import per_block_flops, table_memory
from modeling_memoryformer.training.trainer import TrainingSettings, config_for_tokenizer, default_learning_rate, train

BASE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, hash_bits=8, expand_bits=2)

# (group, label, config overrides, lr multiplier)
VARIANTS = [
    ("tau", "tau=4", {"hash_bits": 4}, 3.0),
    ("tau", "tau=8 (base)", {}, 3.0),
    ("lr", "1x LR", {}, 1.0),
    ("lr", "2x LR", {}, 2.0),
    ("lr", "3x LR (base)", {}, 3.0),
    ("lr", "4x LR", {}, 4.0),
    ("expand", "e=0", {"expand_bits": 0}, 3.0),
    ("expand", "e=1", {"expand_bits": 1}, 3.0),
    ("expand", "e=2 (base)", {}, 3.0),
    ("gelu", "no GELU (base)", {}, 3.0),
    ("gelu", "GELU", {"memory_block_activation": "gelu"}, 3.0),
    ("score", "paper score (base)", {}, 3.0),
    ("score", "l1 score", {"hash_score": "l1"}, 3.0),
]


def run_variant(data, label: str, overrides: dict, multiplier: float, args, cache: dict) -> dict:
    key = json.dumps([overrides, multiplier], sort_keys=True)
    if key in cache:  # the base variant appears in every group: train it once
        return dict(cache[key], label=label)
    config = config_for_tokenizer(data.tokenizer, None, {**BASE, **overrides}, args.block_size)
    set_seed(args.seed)
    model = MemoryFormerForCausalLM(config)
    lr = default_learning_rate(model, lr_multiplier=multiplier)
    with tempfile.TemporaryDirectory() as out:
        result = train(model, data, TrainingSettings(
            output_dir=out, max_steps=args.max_steps, per_device_batch_size=args.batch_size, learning_rate=lr,
            logging_steps=max(1, args.max_steps // 10), eval_steps=args.max_steps, report_to="none", seed=args.seed,
            save_final_model=False,
        ))
    row = {
        "label": label, "overrides": overrides, "lr_multiplier": multiplier, "learning_rate": lr,
        "validation_loss": result.eval_loss, "validation_perplexity": result.perplexity,
        "train_tokens_per_second": result.train_tokens_per_second,
        "table_mb_per_block_fp16": table_memory(config)["block"] / 1e6,
        "flops_per_block_without_attention": per_block_flops(config, args.block_size)["without_attention_exact"],
    }
    cache[key] = row
    return row


def write_results(rows: list[dict], args) -> None:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump({"settings": vars(args), "rows": rows}, f, indent=2)
    lines = ["| group | variant | LR | val. perplexity | table MB / block (fp16) | train tokens/s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['group']} | {r['label']} | {r['learning_rate']:g} | {r['validation_perplexity']:.2f} | "
                     f"{r['table_mb_per_block_fp16']:.1f} | {r['train_tokens_per_second']:.0f} |")
    with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    plot(rows, os.path.join(args.out, "ablation.png"))
    print("\n".join(lines))


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(r["group"] for r in rows))
    fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups), 3.6), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, group in zip(axes, groups):
        sel = [r for r in rows if r["group"] == group]
        ax.bar(range(len(sel)), [r["validation_perplexity"] for r in sel], color="tab:blue")
        ax.set_xticks(range(len(sel)), [r["label"].replace(" (base)", "*") for r in sel], rotation=30, ha="right")
        ax.set_title(group)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("validation perplexity")
    title = fig.suptitle("MemoryFormer ablations (* = base: tau 8, e 2, 3x LR, no GELU, paper score)")
    # one or two groups make a figure narrower than its title: widen the figure to the title's measured width
    fig.canvas.draw()
    needed = title.get_window_extent().width / fig.dpi + 0.4  # inches, with a margin
    if needed > fig.get_figwidth():
        fig.set_figwidth(needed)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=None, help="text source (default: the embedded CPython docs)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer path or id (default: trained byte-level BPE)")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--groups", nargs="+", default=None, help="subset of: tau lr expand gelu score")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="experiments/results/ablation")
    args = parser.parse_args(argv)

    data = build_lm_data(args.data, args.tokenizer, block_size=args.block_size, vocab_size=args.vocab_size)
    cache: dict = {}
    rows = []
    variants = [v for v in VARIANTS if args.groups is None or v[0] in args.groups]
    for i, (group, label, overrides, multiplier) in enumerate(variants):
        print(f"[{i + 1}/{len(variants)}] {group}: {label}", file=sys.stderr, flush=True)
        rows.append(dict(run_variant(data, label, overrides, multiplier, args, cache), group=group))
    write_results(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
