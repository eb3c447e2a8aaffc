"""The speed rows of `make demo`, measured apart from it: the demo's two models (its default shape, vocabulary 4096,
random init) timed by the same function the demo uses (`comparison.speed.measure_speed`: a training step of 8 x 128
tokens with AdamW and a 64-token greedy decode, both models alternated, medians), with more rounds and in a process
of its own. A quiet demo run's speed rows should agree with these within their spread.

    python -m benchmarks.demo_bench                      # writes benchmarks/results/demo/results.{json,md}
    python -m benchmarks.demo_bench --rounds 40 --out-dir /tmp/demo-bench
    python -m benchmarks.demo_bench --demo-folder memoryformer-demo   # the models a demo run trained, its inputs

With --demo-folder the models are the ones a `memoryformer demo` run saved (trained: their buckets are hit less evenly
than a random model's, which changes the Memory Layer's time), timed on the inputs the demo timed them on: the first
training batch and validation prompt of the data, tokenized with the demo's tokenizer (the embedded corpus unless
--data names another text).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

from .common import REPO_ROOT, environment

DEFAULT_OUT = os.path.join(REPO_ROOT, "benchmarks", "results", "demo")


@dataclass
class _Vocabulary:
    """What `config_for_tokenizer` reads of a tokenizer: the demo's trained BPE has 4096 tokens, <|endoftext|> = 0
    as bos, eos and pad."""

    size: int = 4096
    bos_token_id: int = 0
    eos_token_id: int = 0
    pad_token_id: int = 0

    def __len__(self) -> int:
        return self.size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30, help="alternated rounds (default 30)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=DEFAULT_OUT)
    parser.add_argument("--demo-folder", help="a `memoryformer demo` report folder: time its two trained models")
    parser.add_argument("--data", help="with --demo-folder: the text the demo trained on (default: the embedded corpus)")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    args = parser.parse_args(argv)

    import torch

    from modeling_memoryformer import MemoryFormerForCausalLM
    from modeling_memoryformer.comparison.demo import DemoSettings, memoryformer_config_for
    from modeling_memoryformer.comparison.speed import measure_speed
    from modeling_memoryformer.comparison.twin import pythia_twin

    env = environment()  # first: builds/loads the fused kernel before anything is timed
    settings = DemoSettings()
    if args.demo_folder:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from modeling_memoryformer.training.data import build_lm_data

        folders = {"MemoryFormer": "memoryformer", "Pythia twin": "pythia-twin"}
        models = {name: AutoModelForCausalLM.from_pretrained(os.path.join(args.demo_folder, folder))
                  for name, folder in folders.items()}
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(args.demo_folder, "memoryformer"))
        data = build_lm_data(args.data, tokenizer, block_size=settings.block_size, progress=args.progress)
        batch = data.train.input_ids[: settings.batch_size]
        prompt = data.validation.input_ids[:1, : settings.prompt_tokens]
    else:
        vocabulary = _Vocabulary(size=settings.vocab_size)
        config = memoryformer_config_for(settings, vocabulary)
        torch.manual_seed(args.seed)
        models = {"MemoryFormer": MemoryFormerForCausalLM(config), "Pythia twin": pythia_twin(config)}
        generator = torch.Generator().manual_seed(args.seed)
        batch = torch.randint(1, vocabulary.size, (settings.batch_size, settings.block_size), generator=generator)
        prompt = torch.randint(1, vocabulary.size, (1, settings.prompt_tokens), generator=generator)
    speed = measure_speed(models, batch, prompt, settings.decode_tokens, rounds=args.rounds, progress=args.progress)

    rows = {name: {w: speed["models"][name][w] for w in ("train", "decode")} for name in models}
    mf, twin = rows["MemoryFormer"], rows["Pythia twin"]
    load = speed["other_cores"]
    lines = [
        f"# The demo's speed rows, apart from the demo ({args.rounds} rounds, models alternated, medians)",
        "",
        f"Models: {'trained, from ' + args.demo_folder if args.demo_folder else 'the demo shape, random init, random tokens'}.",
        "",
        f"CPU: {env['cpu']}, {env['threads']} threads; other processes used "
        f"{'unknown' if load is None else f'{load:.2f}'} cores on average"
        f"{' (BUSY: not trustworthy)' if speed['busy'] else ''}; memory stream "
        f"{speed['memory_stream_gbps']['median']:.0f} GB/s (median per round).",
        "",
        "| | MemoryFormer | Pythia twin | MF / twin |",
        "|---|---|---|---|",
    ]
    for workload, label in (("train", f"training tokens/s ({settings.batch_size} x {settings.block_size}, AdamW)"),
                            ("decode", f"decode tokens/s ({settings.decode_tokens} greedy tokens, batch 1)")):
        a, b = mf[workload], twin[workload]
        lines.append(f"| {label} | {a['tokens_per_second']:,.0f} ({a['min']:,.0f}-{a['max']:,.0f}) | "
                     f"{b['tokens_per_second']:,.0f} ({b['min']:,.0f}-{b['max']:,.0f}) | "
                     f"{a['tokens_per_second'] / b['tokens_per_second']:.2f}x |")
    lines += ["", f"Medians, with the fastest and slowest round in brackets. {env['date']}, command: `{env['command']}`"]
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "results.json"), "w", encoding="utf-8") as f:
        json.dump({"meta": env, "rounds": args.rounds, "speed": speed}, f, indent=2)
    with open(os.path.join(args.out_dir, "results.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
