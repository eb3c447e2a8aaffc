"""Quality of the conversion on a real teacher.

On the teacher of `train_teacher.py` (Tiny Shakespeare, first 90% train / last 10% held out):
1. `convert_pythia` with calibrated tables and distillation within a CPU-time budget; its report holds the held-out
   perplexity of the teacher, a random-init MemoryFormer, random tables, data-free, calibrated and distilled;
2. the baseline: a MemoryFormer of the same config trained from scratch (cross-entropy) on the same training text for
   the same CPU-time budget;
3. conversion/results/: quality.json, quality.md, and the conversion's report and per-layer error plot.

    python conversion/experiments/train_teacher.py
    python conversion/experiments/run_quality.py --teacher conversion/teacher --work conversion/work
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import torch
from transformers import AutoTokenizer

from modeling_memoryformer import MemoryFormerConfig, MemoryFormerForCausalLM
from modeling_memoryformer.conversion.convert import ConvertSettings, convert_pythia, split_text
from modeling_memoryformer.conversion.distill import TrainingBudget, train_student
from modeling_memoryformer.evaluation.perplexity import blocks_perplexity
from modeling_memoryformer.training.data import text_blocks


HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # conversion/
SHARED = os.path.join(HERE, os.pardir, os.pardir, "shared", "data")
REPORT_FILES = ("conversion_report.json", "conversion_report.md", "layer_errors.png")


def train_from_scratch(converted: str, settings: ConvertSettings, cpu_minutes: float, lr: float) -> dict:
    """A MemoryFormer with the converted model's config, random init, trained with cross-entropy on the conversion's
    training text for `cpu_minutes` of CPU time; its held-out perplexity on the conversion's held-out sequences."""
    tokenizer = AutoTokenizer.from_pretrained(converted)
    train_text, held_out_text = split_text(settings)
    train_ids = text_blocks(train_text, tokenizer, settings.seq_len)
    held_out = text_blocks(held_out_text, tokenizer, settings.seq_len)[: settings.eval_tokens // settings.seq_len]
    torch.manual_seed(settings.seed)
    model = MemoryFormerForCausalLM(MemoryFormerConfig.from_pretrained(converted))
    budget = TrainingBudget(None, cpu_minutes, lr, settings.batch_size, weight_decay=0.1, seed=settings.seed)
    run = train_student(model, train_ids, budget, progress=settings.progress)
    return {"perplexity": blocks_perplexity(model, held_out, settings.batch_size), "learning_rate": lr, "training": run}


def summary_markdown(result: dict) -> str:
    stages = result["conversion"]["stages"]
    teacher = stages["teacher"]["perplexity"]
    rows = [(name, stage["perplexity"]) for name, stage in stages.items()]
    rows.append(("from scratch, same CPU budget", result["scratch"]["perplexity"]))
    lines = ["| model | held-out perplexity | / teacher |", "|---|---|---|"]
    lines += [f"| {name} | {value:.2f} | {value / teacher:.2f}x |" for name, value in rows]
    distilled, scratch = stages["distilled"]["training"], result["scratch"]["training"]
    lines += [
        "",
        f"Distillation: {distilled['steps']} steps in {distilled['cpu_seconds'] / 60:.1f} CPU-min; from scratch: "
        f"{scratch['steps']} steps in {scratch['cpu_seconds'] / 60:.1f} CPU-min. Commands: `{result['command']}`.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", default=os.path.join(HERE, "teacher"))
    parser.add_argument("--work", default=os.path.join(HERE, "work"), help="where the converted model is saved")
    parser.add_argument("--text", default=os.path.join(SHARED, "tinyshakespeare.txt"))
    parser.add_argument("--results", default=os.path.join(HERE, "results"))
    parser.add_argument("--cpu-minutes", type=float, default=10.0, help="distillation and from-scratch budget, each")
    parser.add_argument("--hash-bits", type=int, default=8)
    parser.add_argument("--calib-tokens", type=int, default=32768)
    parser.add_argument("--distill-lr", type=float, default=1e-4)
    parser.add_argument("--scratch-lr", type=float, default=3e-3, help="3x the dense rate, the paper's recipe")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--skip-scratch", action="store_true", help="only the conversion (no baseline)")
    args = parser.parse_args(argv)

    settings = ConvertSettings(
        source=args.teacher, out=os.path.join(args.work, "memoryformer-converted"), calib_text=args.text,
        hash_bits=args.hash_bits, calib_tokens=args.calib_tokens, eval_tokens=10**9, batch_size=args.batch_size,
        distill_cpu_minutes=args.cpu_minutes, distill_lr=args.distill_lr, overwrite=True,
    )
    start = time.perf_counter()
    report = convert_pythia(settings)
    result = {
        "command": "python conversion/experiments/run_quality.py "
                   + " ".join(argv if argv is not None else sys.argv[1:]),
        "conversion": {"stages": {name: {k: v for k, v in stage.items() if k != "fit"}
                                  for name, stage in report["stages"].items()}},
        "conversion_wall_seconds": time.perf_counter() - start,
    }
    if not args.skip_scratch:
        result["scratch"] = train_from_scratch(settings.out, settings, args.cpu_minutes, args.scratch_lr)
    os.makedirs(args.results, exist_ok=True)
    for name in REPORT_FILES:
        if os.path.isfile(os.path.join(settings.out, name)):
            shutil.copy(os.path.join(settings.out, name), args.results)
    with open(os.path.join(args.results, "quality.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    if "scratch" in result:
        markdown = summary_markdown(result)
        with open(os.path.join(args.results, "quality.md"), "w", encoding="utf-8") as f:
            f.write(markdown)
        print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
