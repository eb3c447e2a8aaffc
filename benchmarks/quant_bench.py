"""Quantized tables against float32: bytes, decode speed, one layer's forward, perplexity.

Sections (`--sections`, all by default):
- bytes: the state-dict bytes (what model.safetensors holds) of MF-tiny in float32, with bf16 tables (+ bf16 head),
  int8 tables, int8 tables + int8 head; and of its Pythia-70M twin.
- decode: tokens/s of `model.generate` (model_bench's decode workload: a 16-token prompt, 128 new tokens, greedy, KV
  cache, batch 1, float32 activations), timed round-robin across MF-tiny float32 [fused], int8 tables, int8 tables +
  int8 head, bf16 tables + bf16 head, the float32 Pythia-70M twin (random init, same shape as model_bench's), and
  that twin in PyTorch's dynamic int8 form (`quantize_dynamic`: every linear layer, the LM head included, int8), the
  like-for-like baseline of int8 MF-tiny.
- layer: one Memory Layer's forward on 2048 tokens under inference_mode, float32 tables [fused] and [torch] against
  int8 tables: a d 512 -> 512 layer (tau 8, 64 x 256 rows) and MF-tiny's Q/K/V (512 -> 1536) and Memory Block
  layer 2 (640 -> 512, tau 10, 64 x 1024 rows). Then the two CPU passes of int8 tables, each forced
  (`quantization.FORCE_INT8_PATH`), against float32 tables [fused]: an MF-tiny-like layer 512 -> d (64 tables x 256
  rows) for d in `--path-widths` (512 768) over `--path-tokens` (1 4 16 64 256 2048), with the pass
  `quantization.int8_cpu_path` picks for each token count.
- quality: trains the demo's MemoryFormer (d 256, 4 layers, 4 heads, tau 8, e 2) for `--train-steps` steps of 8 x 128
  tokens with the paper's recipe on the embedded CPython docs (or `--data` / `--tokenizer`), then the validation
  perplexity (held-out blocks, `blocks_perplexity`) of that model in float32, bf16 tables (+ bf16 head), int8 tables
  (+ int8 head).

Writes results.json and results.md to --out (default benchmarks/results/quant), with the CPU, its vector features
and the fused kernel's build (`common.environment()`); every timed cell records how many cores other processes used
meanwhile. Run from the repository root:

    .venv/bin/python -m benchmarks.quant_bench
    .venv/bin/python -m benchmarks.quant_bench --sections quality --data ../shared/data/tinyshakespeare.txt \\
        --tokenizer ../shared/data/pythia-tokenizer --out benchmarks/results/quant-shakespeare
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import sys
import tempfile

import torch

from .common import Contestant, cpu_flags, cpu_model, environment, make_progress, round_robin, summary, wait_for_quiet
from .model_bench import ModelSpec, build_model, workload_fn

SECTIONS = ("bytes", "decode", "layer", "quality")
# (label, table storage, LM head storage) of the MF-tiny variants
VARIANTS = [
    ("float32", None, None),
    ("bf16 tables + bf16 head", "bf16", "bf16"),
    ("int8 tables", "int8", None),
    ("int8 tables + int8 head", "int8", "int8"),
]
DEMO_SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, hash_bits=8, expand_bits=2)
PATH_TOKENS = (1, 4, 16, 64, 256, 2048)
PATH_WIDTHS = (512, 768)
LAYERS = [  # (label, in_features, out_features, hash_bits)
    ("d 512 -> 512, tau 8 (64 x 256 rows)", 512, 512, 8),
    ("MF-tiny Q/K/V 512 -> 1536, tau 8", 512, 1536, 8),
    ("MF-tiny block layer 2 640 -> 512, tau 10 (64 x 1024 rows)", 640, 512, 10),
]


def state_bytes(model: torch.nn.Module) -> int:
    """Bytes of the state dict: every parameter and persistent buffer once."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def quantized(model, tables: str | None, head: str | None):
    """A quantised deep copy of `model` (the float32 model itself when both are None)."""
    if tables is None and head is None:
        return model
    result = copy.deepcopy(model)
    result.quantize_tables(tables, lm_head=head)
    gc.collect()
    return result


def _inference(kernel: str | None = "fused"):
    from modeling_memoryformer.memory_ops import use_kernel

    def context():
        stack = contextlib.ExitStack()
        if kernel is not None:
            stack.enter_context(use_kernel(kernel))
        stack.enter_context(torch.inference_mode())
        return stack

    return context


def _timed(contestants: list[Contestant], args, desc: str, unit_per_call: float) -> list[dict]:
    wait_for_quiet(args.quiet_wait_s)
    bar = make_progress(len(contestants) * (args.warmup + args.repeats), desc)
    round_robin(contestants, repeats=args.repeats, warmup=args.warmup, min_sample_s=args.min_sample_s,
                tick=bar.update)
    bar.close()
    rows = []
    for c in contestants:
        row = {"name": c.name, "error": c.error, "other_cores": c.other_cores}
        if c.samples:
            row["seconds"] = summary(c.samples)
            row["per_second"] = unit_per_call / c.median
            row["best_per_second"] = unit_per_call / min(c.samples)  # the least disturbed sample, on a shared host
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# Sections


def bench_bytes(mf, twin) -> dict:
    rows = [{"name": "Pythia-70M twin (float32)", "bytes": state_bytes(twin)}]
    for label, tables, head in VARIANTS:
        model = quantized(mf, tables, head)
        rows.append({"name": f"MF-tiny, {label}", "bytes": state_bytes(model)})
        del model
        gc.collect()
    base = rows[1]["bytes"]
    for row in rows:
        row["vs_float32_mf"] = row["bytes"] / base
    return {"rows": rows}


INT8_TWIN = "Pythia-70M twin (dynamic int8 linears + int8 head)"


def dynamic_int8(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose every nn.Linear (the LM head too) is PyTorch's dynamic int8 Linear."""
    import warnings

    with warnings.catch_warnings():  # torch.ao's quantized tensors are deprecated (still PyTorch's int8 Linear)
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear},
                                                      dtype=torch.qint8).eval()


def bench_decode(mf, twin, args) -> dict:
    spec = ModelSpec(prompt_tokens=16, new_tokens=args.new_tokens)
    contestants, keep = [], []
    for label, tables, head in VARIANTS:
        model = quantized(mf, tables, head).eval()
        keep.append(model)
        fn, _ = workload_fn(model, "decode", spec)
        contestants.append(Contestant(f"MF-tiny, {label} [fused]", fn, context=_inference("fused")))
    fn, _ = workload_fn(twin.eval(), "decode", spec)
    contestants.append(Contestant("Pythia-70M twin (float32)", fn, context=_inference(None)))
    int8_twin = dynamic_int8(twin)
    keep.append(int8_twin)
    fn, _ = workload_fn(int8_twin, "decode", spec)
    contestants.append(Contestant(INT8_TWIN, fn, context=_inference(None)))
    rows = _timed(contestants, args, "decode", spec.new_tokens)
    del keep
    gc.collect()
    return {"new_tokens": spec.new_tokens, "prompt_tokens": spec.prompt_tokens, "rows": rows}


def bench_layer(args) -> dict:
    from modeling_memoryformer import MemoryLayer
    from modeling_memoryformer.memory_ops import available_kernels

    results = []
    for label, d_in, d_out, tau in LAYERS:
        torch.manual_seed(0)
        layer = MemoryLayer(d_in, d_out, hash_bits=tau).eval()
        int8 = copy.deepcopy(layer).quantize_tables_("int8")
        x = torch.randn(args.layer_tokens, d_in)
        contestants = [Contestant(f"float32 tables [{k}]", lambda m=layer, x=x: m(x), context=_inference(k))
                       for k in available_kernels()]
        contestants.append(Contestant("int8 tables", lambda m=int8, x=x: m(x), context=_inference("fused" if "fused" in
                                      available_kernels() else "torch")))
        rows = _timed(contestants, args, f"layer {label}", 1.0)
        float_bytes = layer.tables.numel() * 4
        int8_bytes = int8.tables_codes.shape[0] * (d_out + 8)
        results.append({"layer": label, "tokens": args.layer_tokens, "table_bytes": {"float32": float_bytes,
                        "int8": int8_bytes}, "rows": rows})
    return {"layers": results, "paths": bench_int8_paths(args)}


@contextlib.contextmanager
def _int8_path(path: str | None):
    """Force quantization's int8 CPU pass ("fused" / "fbgemm") for the duration."""
    from modeling_memoryformer import quantization

    before = quantization.FORCE_INT8_PATH
    quantization.FORCE_INT8_PATH = path
    try:
        yield
    finally:
        quantization.FORCE_INT8_PATH = before


def bench_int8_paths(args) -> list[dict]:
    """int8 tables by each CPU pass, and float32 tables [fused], per token count: a 512 -> d layer, 64 x 256 rows."""
    from modeling_memoryformer import MemoryLayer
    from modeling_memoryformer.memory_ops import available_kernels
    from modeling_memoryformer.quantization import int8_cpu_path

    if "fused" not in available_kernels():
        return []
    results = []
    for d_out in args.path_widths:
        torch.manual_seed(0)
        layer = MemoryLayer(512, d_out, hash_bits=8).eval()
        int8 = copy.deepcopy(layer).quantize_tables_("int8")
        for tokens in args.path_tokens:
            x = torch.randn(tokens, 512)
            contestants = []
            for path in ("fused", "fbgemm"):
                def context(path=path):
                    stack = _inference("fused")()
                    stack.enter_context(_int8_path(path))
                    return stack

                contestants.append(Contestant(f"int8 {path}", lambda m=int8, x=x: m(x), context=context))
            contestants.append(Contestant("float32 fused", lambda m=layer, x=x: m(x), context=_inference("fused")))
            rows = _timed(contestants, args, f"int8 paths d {d_out}, {tokens} tokens", 1.0)
            results.append({"in_features": 512, "out_features": d_out, "tables": "64 x 256", "tokens": tokens,
                            "rule": int8_cpu_path(tokens), "rows": rows})
    return results


def bench_quality(args) -> dict:
    from transformers import set_seed

    from modeling_memoryformer import MemoryFormerForCausalLM
    from modeling_memoryformer.evaluation.perplexity import blocks_perplexity
    from modeling_memoryformer.training.data import build_lm_data
    from modeling_memoryformer.training.trainer import (
        TrainingSettings,
        config_for_tokenizer,
        default_learning_rate,
        train,
    )

    data = build_lm_data(args.data, args.tokenizer, block_size=128)
    config = config_for_tokenizer(data.tokenizer, None, DEMO_SHAPE, 128)
    set_seed(0)
    model = MemoryFormerForCausalLM(config)
    with tempfile.TemporaryDirectory() as out:
        settings = TrainingSettings(output_dir=out, max_steps=args.train_steps, per_device_batch_size=8,
                                    learning_rate=default_learning_rate(model), eval_points=1, report_to="none",
                                    seed=0, save_final_model=False)
        result = train(model, data, settings)
    model.eval()
    blocks = data.validation.input_ids  # [blocks, 128]
    rows = []
    for label, tables, head in VARIANTS:
        variant = quantized(model, tables, head).eval()
        with torch.inference_mode():
            ppl = blocks_perplexity(variant, blocks, batch_size=16)
        rows.append({"name": label, "perplexity": ppl})
        print(f"  {label}: perplexity {ppl:.4f}", file=sys.stderr, flush=True)
    base = rows[0]["perplexity"]
    for row in rows:
        row["vs_float32"] = row["perplexity"] / base
    return {"data": data.description, "train_steps": args.train_steps, "tokens_per_step": 8 * 128,
            "validation_tokens": int(blocks.numel()), "trainer_eval_perplexity": result.perplexity, "rows": rows}


# ---------------------------------------------------------------------------------------------------------------------
# Report


def _measured_on(section: dict) -> list[str]:
    env = section["environment"]
    threads = (section.get("settings") or {}).get("threads")
    used = f", {threads} torch thread{'s' if threads != 1 else ''}" if threads else ""
    return [f"Measured on {section['cpu_model']} ({', '.join(section['cpu_flags'])}), {env.get('logical_cpus')} "
            f"logical CPUs{used}, torch {env.get('torch')}, {env.get('date')}: `{env.get('command')}`", ""]


def markdown(results: dict) -> str:
    lines = []
    if "bytes" in results:
        lines += _measured_on(results["bytes"])
        lines += ["| model | state-dict bytes | vs float32 MF-tiny |", "|---|---|---|"]
        lines += [f"| {r['name']} | {r['bytes'] / 1e6:,.1f} MB | {r['vs_float32_mf']:.3f}x |"
                  for r in results["bytes"]["rows"]]
        lines.append("")
    if "decode" in results:
        d = results["decode"]
        lines += _measured_on(d)
        twin = next((r for r in d["rows"] if r["name"] == "Pythia-70M twin (float32)" and "per_second" in r), None)
        twin8 = next((r for r in d["rows"] if r["name"] == INT8_TWIN and "per_second" in r), None)
        base = next((r for r in d["rows"] if r["name"].startswith("MF-tiny, float32") and "per_second" in r), None)
        refs = (base, twin, twin8)
        lines += [f"Decode ({d['prompt_tokens']}-token prompt, {d['new_tokens']} new tokens, batch 1):", "",
                  "| model | tokens/s (median) | vs float32 MF-tiny | vs twin | vs int8 twin | best sample, tokens/s | "
                  "best vs float32 MF-tiny | best vs twin | best vs int8 twin | other cores busy |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in d["rows"]:
            if "per_second" not in r:
                lines.append(f"| {r['name']} | failed: {r['error']} | | | | | | | | |")
                continue
            cells = [f"{r['per_second']:.1f}"]
            cells += [f"{r['per_second'] / ref['per_second']:.2f}x" if ref else "-" for ref in refs]
            cells.append(f"{r['best_per_second']:.1f}")
            cells += [f"{r['best_per_second'] / ref['best_per_second']:.2f}x" if ref else "-" for ref in refs]
            lines.append(f"| {r['name']} | " + " | ".join(cells) + f" | {r['other_cores'] or 0:.2f} |")
        lines.append("")
    if "layer" in results:
        lines += _measured_on(results["layer"])
        tokens = results["layer"]["layers"][0].get("tokens", 2048)
        lines += [f"Memory Layer forward, {tokens} tokens (ms, median):", "",
                  "| layer | " + " | ".join(r["name"] for r in results["layer"]["layers"][0]["rows"]) +
                  " | float32 [fused] time / int8 time | other cores busy |",
                  "|---|" + "---|" * (len(results["layer"]["layers"][0]["rows"]) + 2)]
        for layer in results["layer"]["layers"]:
            cells = [f"{r['seconds']['median'] * 1e3:.2f}" if "seconds" in r else "failed" for r in layer["rows"]]
            times = {r["name"]: r["seconds"]["median"] for r in layer["rows"] if "seconds" in r}
            ratio = "-"
            if "int8 tables" in times and "float32 tables [fused]" in times:
                ratio = f"{times['float32 tables [fused]'] / times['int8 tables']:.2f}x"
            busy = max(r["other_cores"] or 0 for r in layer["rows"])
            lines.append(f"| {layer['layer']} | " + " | ".join(cells) + f" | {ratio} | up to {busy:.2f} |")
        lines.append("")
        paths = results["layer"].get("paths") or []
        if paths:
            lines += ["int8 tables by each CPU pass against float32 tables [fused]: Memory Layer 512 -> d, 64 tables x "
                      "256 rows, forward (ms, median; best sample in brackets):", "",
                      "| d | tokens | int8, fused kernel | int8, FBGEMM | float32, fused kernel | FBGEMM time / fused "
                      "time | the rule picks | other cores busy |", "|---|---|---|---|---|---|---|---|"]
            for cell in paths:
                times = {r["name"]: r["seconds"] for r in cell["rows"] if "seconds" in r}
                cells = [f"{times[n]['median'] * 1e3:.4f} ({times[n]['min'] * 1e3:.4f})" if n in times else "failed"
                         for n in ("int8 fused", "int8 fbgemm", "float32 fused")]
                ratio = (f"{times['int8 fbgemm']['median'] / times['int8 fused']['median']:.2f}x"
                         if "int8 fused" in times and "int8 fbgemm" in times else "-")
                busy = max(r["other_cores"] or 0 for r in cell["rows"])
                lines.append(f"| {cell['out_features']} | {cell['tokens']} | " + " | ".join(cells) +
                             f" | {ratio} | {cell['rule']} | {busy:.2f} |")
            lines.append("")
    if "quality" in results:
        q = results["quality"]
        lines += _measured_on(q)
        lines += [f"Validation perplexity: the demo MemoryFormer (d 256, 4 layers) after {q['train_steps']} steps of "
                  f"{q['tokens_per_step']} tokens on {q['data']}; {q['validation_tokens']} held-out tokens:", "",
                  "| storage | perplexity | vs float32 |", "|---|---|---|"]
        lines += [f"| {r['name']} | {r['perplexity']:.3f} | {(r['vs_float32'] - 1) * 100:+.3f}% |" for r in q["rows"]]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--out", default="benchmarks/results/quant")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--min-sample-s", type=float, default=0.2, help="calls per timed sample last at least this")
    parser.add_argument("--new-tokens", type=int, default=128, help="decode: new tokens per generate call")
    parser.add_argument("--layer-tokens", type=int, default=2048)
    parser.add_argument("--path-tokens", type=int, nargs="+", default=list(PATH_TOKENS),
                        help="layer: token counts of the int8 pass comparison")
    parser.add_argument("--path-widths", type=int, nargs="+", default=list(PATH_WIDTHS),
                        help="layer: output widths d of the int8 pass comparison (512 -> d, 64 x 256 rows)")
    parser.add_argument("--train-steps", type=int, default=400, help="quality: steps of the demo model's training")
    parser.add_argument("--data", default=None, help="quality: text (default: the embedded CPython docs)")
    parser.add_argument("--tokenizer", default=None, help="quality: tokenizer (default: a byte-level BPE trained on it)")
    parser.add_argument("--quiet-wait-s", type=float, default=60.0, help="wait this long for other processes to calm")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's own, all cores); 1 gives steadier ratios on a busy host")
    args = parser.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)

    os.makedirs(args.out, exist_ok=True)
    results = {}
    path = os.path.join(args.out, "results.json")
    if os.path.exists(path):  # sections run apart (e.g. quality, then the timed ones) share one report
        with open(path, encoding="utf-8") as f:
            results = json.load(f)
    env = {"environment": environment(), "cpu_model": cpu_model(), "cpu_flags": cpu_flags(), "settings": vars(args)}

    def write():
        with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2, default=str)
        with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as f:
            f.write(markdown(results))

    if {"bytes", "decode"} & set(args.sections):
        spec = ModelSpec(presets=["tiny"])
        mf, twin = build_model("mf", "tiny", spec).eval(), build_model("twin", "tiny", spec).eval()
        if "bytes" in args.sections:
            results["bytes"] = {**bench_bytes(mf, twin), **env}
            write()
        if "decode" in args.sections:
            results["decode"] = {**bench_decode(mf, twin, args), **env}
            write()
        del mf, twin
        gc.collect()
    if "layer" in args.sections:
        results["layer"] = {**bench_layer(args), **env}
        write()
    if "quality" in args.sections:
        results["quality"] = {**bench_quality(args), **env}
        write()
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
