"""Entry point: `python -m benchmarks.run` (what `make bench` runs).

    python -m benchmarks.run                      # everything: layer level + model level (tiny, small)
    python -m benchmarks.run --quick              # smoke run, < ~2 min, written to benchmarks/results/quick/
    python -m benchmarks.run --only layer         # layer level only (the model section of results.json is kept)
    python -m benchmarks.run --only model --presets tiny
    python -m benchmarks.run --repeats 5 --dtypes fp32 --kernels torch

Every available Memory Layer kernel (`modeling_memoryformer.memory_ops.available_kernels()`: "torch", and
"fused" once the compiled kernel loads) is a contestant automatically; --kernels narrows the set.
Results: results.json, results.md, layer_forward.png, layer_fwd_bwd.png, model.png in --out-dir. A run of one
section (--only) keeps the other section of an existing results.json there (use --fresh to drop it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from modeling_memoryformer.training import TABLE_OPTIMIZERS

from .common import REPO_ROOT, environment

DEFAULT_OUT = os.path.join(REPO_ROOT, "benchmarks", "results")
QUICK_OUT = os.path.join(DEFAULT_OUT, "quick")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description="MemoryFormer-HF benchmarks: MemoryLayer vs nn.Linear, MemoryFormer vs its Pythia twin.",
    )
    p.add_argument("--quick", action="store_true",
                   help="fast smoke run (tiny shapes, 1-layer models, 2 repeats); writes to benchmarks/results/quick/")
    p.add_argument("--only", choices=("layer", "model"), help="run one section only")
    p.add_argument("--out-dir", help=f"where to write the results (default {os.path.relpath(DEFAULT_OUT, REPO_ROOT)})")
    p.add_argument("--fresh", action="store_true", help="do not keep the other section of an existing results.json")
    p.add_argument("--repeats", type=int, help="timed repeats per contestant (default: layer 7, model 3; quick 2)")
    p.add_argument("--warmup", type=int, help="untimed warm-up calls per contestant (default: layer 2, model 1)")
    p.add_argument("--quiet-wait", type=float, dest="quiet_wait_s",
                   help="seconds to wait, before each cell, for other processes to stop using CPU "
                        "(default: layer 60, model 120; quick 0)")
    p.add_argument("--kernels", nargs="+", choices=("torch", "fused"),
                   help="Memory Layer kernels to race (default: every available one)")
    g = p.add_argument_group("layer level")
    g.add_argument("--dims", nargs="+", type=int, help="d (in = out) values (default 512 768 1024)")
    g.add_argument("--tokens", nargs="+", type=int, help="token counts N (default 1 16 256 2048 8192)")
    g.add_argument("--dtypes", nargs="+", choices=("fp32", "bf16", "int8"),
                   help="fp32, bf16 (parameters and input), int8 (int8 tables vs PyTorch's dynamic int8 Linear, forward "
                        "only; float32 input); default all three")
    g.add_argument("--modes", nargs="+", choices=("forward", "fwd_bwd"), help="default both")
    g.add_argument("--hash-bits", type=int, default=8)
    g.add_argument("--min-sample-ms", type=float, help="minimum duration of one timed sample (default 50; quick 5)")
    g.add_argument("--noisy-retries", type=int,
                   help="re-measure a cell while other processes took CPU, up to this many times (default 2; quick 0)")
    g = p.add_argument_group("model level")
    g.add_argument("--presets", nargs="+", choices=("tiny", "small", "base"), help="default tiny small")
    g.add_argument("--workloads", nargs="+", choices=("prefill", "decode", "train"), help="default all three")
    g.add_argument("--prefill-tokens", type=int, help="default 2048")
    g.add_argument("--prompt-tokens", type=int, help="default 16")
    g.add_argument("--new-tokens", type=int, help="decode: new tokens per generate call (default 128)")
    g.add_argument("--train-batch", type=int, help="default 8")
    g.add_argument("--train-seq", type=int, help="default 512")
    g.add_argument("--layers", type=int, help="override num_hidden_layers of both models (quick: 1)")
    g.add_argument("--no-rss", action="store_true", help="skip the peak-memory subprocesses")
    g.add_argument("--rss-workloads", nargs="+", choices=("prefill", "decode", "train"),
                   help="workloads whose peak memory is measured (default: all run; quick: prefill)")
    g.add_argument("--table-optimizer", choices=TABLE_OPTIMIZERS,
                   help="the MemoryFormer tables' optimizer in training (default adamw; see memoryformer train)")
    g.add_argument("--gradient-checkpointing", action="store_true", default=None,
                   help="training: recompute each decoder layer in the backward pass (both models)")
    g.add_argument("--table-dtype", choices=("bfloat16",),
                   help="store the MemoryFormer's tables in bfloat16 (default float32; see memoryformer train)")
    g.add_argument("--model-dtype", choices=("fp32", "bf16"),
                   help="both models' dtype (default fp32; bf16: every parameter of both models in bfloat16)")
    g.add_argument("--loss-chunk-tokens", type=int,
                   help="MemoryFormer's config.loss_chunk_tokens in training (default: the config's; 0 = full logits)")
    return p.parse_args(argv)


def _set(obj, **values):
    for key, value in values.items():
        if value is not None:
            setattr(obj, key, value)
    return obj


def layer_spec(args):
    from .layer_bench import LayerSpec

    spec = LayerSpec()
    if args.quick:
        _set(spec, dims=[512], tokens=[16, 256], repeats=2, warmup=1, min_sample_s=0.005, noisy_retries=0,
             quiet_wait_s=0)
    return _set(
        spec,
        dims=args.dims,
        tokens=args.tokens,
        dtypes=args.dtypes,
        modes=args.modes,
        kernels=args.kernels,
        hash_bits=args.hash_bits,
        repeats=args.repeats,
        warmup=args.warmup,
        min_sample_s=None if args.min_sample_ms is None else args.min_sample_ms / 1e3,
        noisy_retries=args.noisy_retries,
        quiet_wait_s=args.quiet_wait_s,
    )


def model_spec(args):
    from .model_bench import ModelSpec

    spec = ModelSpec()
    if args.quick:
        _set(spec, presets=["tiny"], layers=1, prefill_tokens=128, prompt_tokens=8, new_tokens=8, train_batch=2,
             train_seq=64, repeats=2, warmup=1, rss_train_steps=1, rss_workloads=["prefill"], quiet_wait_s=0)
    return _set(
        spec,
        presets=args.presets,
        workloads=args.workloads,
        kernels=args.kernels,
        prefill_tokens=args.prefill_tokens,
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        train_batch=args.train_batch,
        train_seq=args.train_seq,
        repeats=args.repeats,
        warmup=args.warmup,
        layers=args.layers,
        rss=False if args.no_rss else None,
        rss_workloads=args.rss_workloads,
        quiet_wait_s=args.quiet_wait_s,
        table_optimizer=args.table_optimizer,
        table_dtype=args.table_dtype,
        dtype=args.model_dtype,
        gradient_checkpointing=args.gradient_checkpointing,
        loss_chunk_tokens=args.loss_chunk_tokens,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    from . import report

    out_dir = os.path.abspath(args.out_dir or (QUICK_OUT if args.quick else DEFAULT_OUT))
    os.makedirs(out_dir, exist_ok=True)
    if out_dir == QUICK_OUT and not os.path.exists(os.path.join(out_dir, ".gitignore")):
        with open(os.path.join(out_dir, ".gitignore"), "w", encoding="utf-8") as f:
            f.write("# smoke-test output of `python -m benchmarks.run --quick`: not committed\n*\n")

    start = time.perf_counter()
    env = environment()  # also builds/loads the fused kernel, if any, before anything is timed
    print(f"MemoryFormer benchmarks: torch {env['torch']}, {env['threads']} threads, {env['cpu']}; "
          f"kernels available: {', '.join(env['kernels_available'])}", flush=True)

    sections = ("layer", "model") if args.only is None else (args.only,)
    previous = None if args.fresh else report.load(os.path.join(out_dir, "results.json"))
    results: dict = {"meta": env}
    if previous:
        for key in ("layer", "model"):
            if key not in sections and key in previous:
                results[key] = previous[key]
                print(f"Keeping the {key}-level results of {previous[key]['meta']['date']} from {out_dir}")

    if "layer" in sections:
        from . import layer_bench

        results["layer"] = layer_bench.run(layer_spec(args))
    if "model" in sections:
        from . import model_bench

        results["model"] = model_bench.run(model_spec(args))
    results["meta"]["elapsed_s"] = round(time.perf_counter() - start, 1)

    files = report.write_all(results, out_dir)
    print()
    print(report.markdown(results))
    print("Wrote:")
    for f in files:
        print(f"  {os.path.relpath(f, os.getcwd())}")
    print(f"Total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
