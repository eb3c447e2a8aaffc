"""Ablations at the demo's scale, several seeds each: which parts of the recipe matter, and the paper's Tables 3-6.

Every variant is a MemoryFormer of the demo shape (d 256, 4 layers, 4 heads, tau 8, e 2) trained as the demo trains
it (400 steps x 8 x 128 tokens on the embedded default corpus: 0.12 epochs, no token seen twice), with one setting
changed against the base, which follows the paper's text (LayerNorm blocks, the paper's score, tables N(0, 0.02),
3x the twin's learning rate, weight decay 0.1 on the tables as in the authors' code). Seed s fixes the model's
initialisation and the order of the batches; every variant and the twin run under the same seeds, so differences are
paired. Groups (`--groups`; the default runs the first eight):

- twin       the Pythia-shaped dense twin: the MemoryFormer / twin perplexity ratio with its seed spread
- twin-lr    the twin at 2x and 3x its Pythia rate: whether a short run favours higher rates for the dense model too
- init       the authors' initialisation: small_init Q/K/V tables, N(0, 0.001) biases (`table_init="authors"`)
- decay      no weight decay on the tables (the paper does not say; the authors' code decays them)
- norm       RMSNorm block norms (the authors' code; LayerNorm inside the Memory Block either way)
- score      the authors' score ||z||_1 * p(z) (`hash_score="l1"`) against the paper's p(z)
- authors    the three of the authors' code at once: init, RMSNorm, l1 score
- lr         1x, 2x, 3x (base), 4x the twin's learning rate (paper Table 4: 3x is best)
- tau        tau = 4 against 8 (paper Table 3)
- expand     e = 0, 1, 2 (paper Table 5)
- gelu       GELU between the Memory Layers (paper Table 6)

A variant differs from its reference (the base; for the twin's learning rates, the twin) "beyond the seed spread"
when the ranges (min-max over seeds) of their validation perplexities do not overlap. Writes `results.json` (every run, written after each one, so an interrupted run keeps
what it measured and `--resume` goes on from it), `results.md` and `ablation.png` to --out. Run:

    .venv/bin/python experiments/ablation.py --out experiments/results/ablation-stdlib
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

BASE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, hash_bits=8, expand_bits=2)
AUTHORS = {"table_init": "authors", "norm_type": "rmsnorm", "hash_score": "l1"}

# (group, label, config overrides, lr multiplier, table weight decay); label "base" is the paper's recipe
VARIANTS = [
    ("twin", "Pythia twin", None, 1.0, True),
    ("twin-lr", "twin at 2x LR", None, 2.0, True),
    ("twin-lr", "twin at 3x LR", None, 3.0, True),
    ("init", "authors' init", {"table_init": "authors"}, 3.0, True),
    ("decay", "no decay on tables", {}, 3.0, False),
    ("norm", "RMSNorm blocks", {"norm_type": "rmsnorm"}, 3.0, True),
    ("score", "l1 score", {"hash_score": "l1"}, 3.0, True),
    ("authors", "authors' init + RMSNorm + l1", AUTHORS, 3.0, True),
    ("lr", "1x LR", {}, 1.0, True),
    ("lr", "2x LR", {}, 2.0, True),
    ("lr", "4x LR", {}, 4.0, True),
    ("tau", "tau=4", {"hash_bits": 4}, 3.0, True),
    ("expand", "e=0", {"expand_bits": 0}, 3.0, True),
    ("expand", "e=1", {"expand_bits": 1}, 3.0, True),
    ("gelu", "GELU", {"memory_block_activation": "gelu"}, 3.0, True),
]
DEFAULT_GROUPS = ["twin", "twin-lr", "init", "decay", "norm", "score", "authors", "lr"]
BASE_VARIANT = ("base", "base (paper)", {}, 3.0, True)


def run_one(data, variant: tuple, seed: int, args) -> dict:
    from transformers import set_seed

    from modeling_memoryformer import MemoryFormerForCausalLM
    from modeling_memoryformer.comparison.demo import final_training_loss, loss_curves
    from modeling_memoryformer.comparison.twin import pythia_twin
    from modeling_memoryformer.training.trainer import (
        TrainingSettings,
        config_for_tokenizer,
        default_learning_rate,
        train,
    )

    group, label, overrides, multiplier, table_decay = variant
    config = config_for_tokenizer(data.tokenizer, None, BASE, args.block_size, **(overrides or {}))
    set_seed(seed)
    model = pythia_twin(config) if overrides is None else MemoryFormerForCausalLM(config)
    lr = default_learning_rate(model, lr_multiplier=multiplier)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        result = train(model, data, TrainingSettings(
            output_dir=out, max_steps=args.max_steps, per_device_batch_size=args.batch_size, learning_rate=lr,
            eval_steps=args.max_steps, report_to="none", seed=seed, save_final_model=False,
            table_weight_decay=table_decay, progress=args.progress,
        ))
    curve = loss_curves(result.log_history, args.batch_size * args.block_size)
    return {
        "group": group, "label": label, "seed": seed, "overrides": overrides, "lr_multiplier": multiplier,
        "table_weight_decay": table_decay, "learning_rate": lr, "validation_loss": result.eval_loss,
        "validation_perplexity": result.perplexity, "final_training_loss": final_training_loss(curve),
        "parameters": sum(p.numel() for p in model.parameters()), "seconds": time.perf_counter() - start,
    }


def key(row: dict) -> str:
    return f"{row['label']}|{row['seed']}"


def reference_label(group: str) -> str:
    """What a variant is compared with: the twin for the twin's learning rates, the paper's recipe otherwise."""
    return "Pythia twin" if group == "twin-lr" else BASE_VARIANT[1]


def summarise(rows: list[dict]) -> list[dict]:
    """Per variant: perplexities over seeds, the paired difference to its reference (same seed; the base, or the
    twin for the twin's learning rates), whether the two ranges overlap, and the MemoryFormer / twin ratio."""
    by_label = {}
    for r in rows:
        by_label.setdefault(r["label"], {})[r["seed"]] = r["validation_perplexity"]
    out = []
    for label in dict.fromkeys(r["label"] for r in rows):
        runs = [r for r in rows if r["label"] == label]
        group = runs[0]["group"]
        ppl = [r["validation_perplexity"] for r in runs]
        entry = {
            "group": group, "label": label, "seeds": [r["seed"] for r in runs], "perplexities": ppl,
            "mean": statistics.fmean(ppl), "std": statistics.stdev(ppl) if len(ppl) > 1 else 0.0,
            "min": min(ppl), "max": max(ppl), "paired_difference": None,
            "train_minus_validation_loss": statistics.fmean(r["final_training_loss"] - r["validation_loss"]
                                                            for r in runs),
        }
        reference = by_label.get(reference_label(group), {})
        if label != BASE_VARIANT[1] and reference:
            paired = [r["validation_perplexity"] - reference[r["seed"]] for r in runs if r["seed"] in reference]
            entry["reference"] = reference_label(group)
            entry["paired_difference"] = statistics.fmean(paired) if paired else None
            entry["beyond_seed_spread"] = entry["max"] < min(reference.values()) or entry["min"] > max(reference.values())
        out.append(entry)
    base, twin = by_label.get(BASE_VARIANT[1], {}), by_label.get("Pythia twin", {})
    ratios = [base[s] / twin[s] for s in base if s in twin]
    for entry in out:
        if entry["label"] == BASE_VARIANT[1] and ratios:
            entry["ratio_to_twin"] = {"per_seed": ratios, "mean": statistics.fmean(ratios),
                                      "min": min(ratios), "max": max(ratios)}
    return out


def write_results(rows: list[dict], args, final: bool) -> list[dict]:
    os.makedirs(args.out, exist_ok=True)
    summary = summarise(rows)
    settings = {k: v for k, v in vars(args).items() if k != "progress"}
    with open(os.path.join(args.out, "results.json.tmp"), "w", encoding="utf-8") as f:
        json.dump({"settings": settings, "data": args.data_description, "complete": final, "runs": rows,
                   "variants": summary}, f, indent=2)
    os.replace(os.path.join(args.out, "results.json.tmp"), os.path.join(args.out, "results.json"))
    if not final:
        return summary
    lines = [f"Data: {args.data_description}; {args.max_steps} steps x {args.batch_size} x {args.block_size} tokens "
             f"per run, seeds {', '.join(map(str, args.seeds))}.", "",
             "| group | variant | val. perplexity, mean ± std | min - max | paired difference to its reference | "
             "beyond the seed spread |", "|---|---|---|---|---|---|"]
    for e in summary:
        diff = "" if e["paired_difference"] is None else f"{e['paired_difference']:+.2f} ({e['reference']})"
        beyond = {True: "yes", False: "no"}.get(e.get("beyond_seed_spread"), "")
        lines.append(f"| {e['group']} | {e['label']} | {e['mean']:.2f} ± {e['std']:.2f} | {e['min']:.2f} - "
                     f"{e['max']:.2f} | {diff} | {beyond} |")
    base = next((e for e in summary if "ratio_to_twin" in e), None)
    if base:
        r = base["ratio_to_twin"]
        lines += ["", f"MemoryFormer / twin validation perplexity: {r['mean']:.3f} (per seed "
                      f"{', '.join(f'{x:.3f}' for x in r['per_seed'])}; range {r['min']:.3f} - {r['max']:.3f})."]
    with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    plot(summary, os.path.join(args.out, "ablation.png"))
    print("\n".join(lines))
    return summary


def plot(summary: list[dict], path: str) -> None:
    """Bars of the mean validation perplexity per variant, grouped, with every seed as a dot and the base's range
    as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = next((e for e in summary if e["label"] == BASE_VARIANT[1]), None)
    groups = list(dict.fromkeys(e["group"] for e in summary if e["group"] != "base"))
    fig, axes = plt.subplots(1, max(1, len(groups)), figsize=(2.6 * max(1, len(groups)), 3.8), sharey=True,
                             squeeze=False)
    axes = axes[0]
    twin = next((e for e in summary if e["label"] == "Pythia twin"), None)
    for ax, group in zip(axes, groups):
        reference = twin if group == "twin-lr" else base
        sel = ([reference] if reference else []) + [e for e in summary if e["group"] == group]
        for i, e in enumerate(sel):
            color = "tab:gray" if e is base else ("tab:orange" if e["group"].startswith("twin") else "tab:blue")
            ax.bar(i, e["mean"], color=color, alpha=0.6)
            ax.plot([i] * len(e["perplexities"]), e["perplexities"], "k.", markersize=5)
        if reference:
            ax.axhspan(reference["min"], reference["max"], color=reference is base and "tab:gray" or "tab:orange",
                       alpha=0.2)
        ax.set_xticks(range(len(sel)), [e["label"] for e in sel], rotation=35, ha="right", fontsize=8)
        ax.set_title(group)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("validation perplexity")
    low = min(min(e["perplexities"]) for e in summary)
    high = max(max(e["perplexities"]) for e in summary)
    axes[0].set_ylim(low - 0.15 * (high - low) - 1, high + 0.1 * (high - low) + 1)
    title = fig.suptitle("MemoryFormer ablations (grey: the paper's recipe, its seed range shaded; dots: seeds)")
    # few groups make a figure narrower than its title: widen the figure to the title's measured width
    fig.canvas.draw()
    needed = title.get_window_extent().width / fig.dpi + 0.4  # inches, with a margin
    if needed > fig.get_figwidth():
        fig.set_figwidth(needed)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=None, help="text source (default: the embedded default corpus)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer path or id (default: trained byte-level BPE)")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--groups", nargs="+", default=DEFAULT_GROUPS,
                        choices=sorted({v[0] for v in VARIANTS}), help="variant groups (the base always runs)")
    parser.add_argument("--resume", action="store_true", help="keep the runs already in --out/results.json")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    parser.add_argument("--out", default="experiments/results/ablation")
    args = parser.parse_args(argv)

    from modeling_memoryformer.training.data import build_lm_data

    data = build_lm_data(args.data, args.tokenizer, block_size=args.block_size, vocab_size=args.vocab_size,
                         progress=args.progress)
    args.data_description = data.description
    epochs = args.max_steps * args.batch_size * args.block_size / data.num_train_tokens
    if epochs > 1:
        print(f"warning: {epochs:.2f} epochs: the runs see the data more than once", file=sys.stderr)
    rows = []
    results = os.path.join(args.out, "results.json")
    if args.resume and os.path.isfile(results):
        with open(results, encoding="utf-8") as f:
            rows = json.load(f)["runs"]
    done = {key(r) for r in rows}
    variants = [BASE_VARIANT] + [v for v in VARIANTS if v[0] in args.groups]
    jobs = [(v, s) for s in args.seeds for v in variants]  # seed-major: a partial run has every variant of a seed
    started = time.perf_counter()
    for i, (variant, seed) in enumerate(jobs):
        if f"{variant[1]}|{seed}" in done:
            continue
        print(f"[{i + 1}/{len(jobs)}] seed {seed}: {variant[1]} ({time.perf_counter() - started:.0f} s so far)",
              file=sys.stderr, flush=True)
        row = run_one(data, variant, seed, args)
        rows.append(row)
        print(f"    validation perplexity {row['validation_perplexity']:.2f} in {row['seconds']:.0f} s",
              file=sys.stderr, flush=True)
        write_results(rows, args, final=False)
    write_results(rows, args, final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
