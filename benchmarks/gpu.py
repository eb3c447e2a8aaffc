"""The GPU entry point, ready for a lent machine: one command runs the GPU tests and the GPU benchmark and writes the
results folder.

    python -m benchmarks.gpu                          # on a CUDA machine: tests, then benchmarks/results/gpu-<date>/
    python -m benchmarks.gpu --skip-tests --sections layer
    python -m benchmarks.gpu --device cpu --smoke     # the same code on CPU at toy sizes (what CI runs)

Tests: tests/kernel/test_triton_backend.py on the GPU (the Triton kernels against the float64 reference, unchanged
from their interpreter run in CI) and tests/kernel/test_op_library.py's PyTorch-kernel checks.
Benchmark sections, each against the dense model in the same dtype, medians of `--repeats` timed runs after warm-up,
CUDA events around each:
- layer: the Memory Layer (tau = 8, the Triton kernels) vs `nn.Linear`, d -> d for d in 512, 768, 1024, 8192 tokens,
  bf16 and fp16, forward and forward + backward.
- model: MF-tiny and MF-small vs their Pythia twins (random init), bf16: prefill 1 x 2048, a 128-token greedy decode,
  a training step of 8 x 512 tokens with fused AdamW, peak GPU memory of each. (The fused row-wise table update, which
  keeps no table-sized gradient, is checked by tests/tools/test_table_optimizer.py's Triton cases, which run on a GPU
  unchanged; it is not timed here yet.)
- decode: MF-tiny, -small and -base vs their Pythia-shaped twins (the CPU decode benchmark's shapes), bf16, batch 1
  and 4 (`--batches`): ms per step (a 72-token `generate` minus an 8-token one), eager and compiled (static cache,
  CUDA graphs; the first batch size, while `--budget-s` lasts), each step's bytes against the GPU's read bandwidth
  measured in the same run.
Targets it reports against: layer forward >= 2x `nn.Linear` in bf16 at d = 1024, 8192 tokens; MF-tiny
training step >= 1.3x its twin; no table-sized gradient with the fused table update.
First run on a GPU (an H100, 2026-11-27): benchmarks/results/2026-11-27-h100-gpu-first-run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

from .common import REPO_ROOT

TARGETS = {"layer_forward_bf16_d1024": 2.0, "mf_tiny_training_step": 1.3}


def _timer(device: str):
    import torch

    def timed(fn, repeats: int, warmup: int = 2) -> float:
        """Median milliseconds of `fn()` over `repeats` runs, after `warmup` untimed ones."""
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(repeats):
            if device == "cuda":
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                stop.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(stop))
            else:
                t0 = time.perf_counter()
                fn()
                samples.append(1000 * (time.perf_counter() - t0))
        return statistics.median(samples)

    return timed


def _peak_memory(device: str) -> int | None:
    import torch

    return int(torch.cuda.max_memory_allocated()) if device == "cuda" else None


def _reset_peak(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _layer_row(layer, linear, x, mode: str, timed, repeats: int) -> tuple[float, float]:
    import torch

    def run(module):
        if mode == "forward":
            with torch.no_grad():
                module(x)
        else:
            module(x).float().square().mean().backward()

    return timed(lambda: run(linear), repeats), timed(lambda: run(layer), repeats)


def layer_section(device: str, smoke: bool, repeats: int) -> list[dict]:
    import torch

    from modeling_memoryformer.memory_layer import MemoryLayer

    timed = _timer(device)
    widths, tokens = ((64,), 64) if smoke else ((512, 768, 1024), 8192)
    dtypes = (torch.float32,) if smoke else (torch.bfloat16, torch.float16)
    rows = []
    for dtype in dtypes:
        for d in widths:
            layer = MemoryLayer(d, d, 4 if smoke else 8).to(device, dtype)
            linear = torch.nn.Linear(d, d).to(device, dtype)
            x = torch.randn(tokens, d, device=device, dtype=dtype, requires_grad=True)
            for mode in ("forward", "forward+backward"):
                dense, ours = _layer_row(layer, linear, x, mode, timed, repeats)
                rows.append({"dtype": str(dtype).removeprefix("torch."), "d": d, "tokens": tokens, "mode": mode,
                             "linear_ms": round(dense, 4), "memory_layer_ms": round(ours, 4),
                             "ratio": round(dense / ours, 3)})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def _model_row(model, vocab: int, device: str, sizes: tuple[int, int, int, int], timed, repeats: int) -> dict:
    """Prefill, decode and training-step milliseconds of one model, with its peak GPU memory."""
    import torch

    prefill, decode, batch, block = sizes
    ids = torch.randint(0, vocab, (1, prefill), device=device)
    row = {}
    model.eval()
    with torch.no_grad():
        _reset_peak(device)
        row["prefill_ms"] = round(timed(lambda: model(ids), repeats), 3)
        row["decode_ms"] = round(timed(lambda: model.generate(ids[:, :16], max_new_tokens=decode,
                                                              min_new_tokens=decode, do_sample=False),
                                       max(1, repeats // 2)), 3)
        row["inference_peak_bytes"] = _peak_memory(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    batch_ids = torch.randint(0, vocab, (batch, block), device=device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(batch_ids, labels=batch_ids).loss.backward()
        optimizer.step()

    _reset_peak(device)
    row["training_step_ms"] = round(timed(step, max(1, repeats // 2), warmup=1), 3)
    row["training_peak_bytes"] = _peak_memory(device)
    return row


def model_section(device: str, smoke: bool, repeats: int) -> list[dict]:
    import torch

    from modeling_memoryformer import MemoryFormerConfig, MemoryFormerForCausalLM
    from modeling_memoryformer.comparison.twin import pythia_twin

    timed = _timer(device)
    dtype = torch.float32 if smoke else torch.bfloat16
    sizes = (32, 4, 2, 16) if smoke else (2048, 128, 8, 512)
    rows = []
    for preset in ("tiny",) if smoke else ("tiny", "small"):
        overrides = dict(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=256) if smoke else {}
        config = MemoryFormerConfig.from_preset(preset, **overrides)
        for name in ("memoryformer", "twin"):
            torch.manual_seed(0)
            model = (MemoryFormerForCausalLM(config) if name == "memoryformer" else pythia_twin(config))
            row = {"preset": preset, "model": name, "dtype": str(dtype).removeprefix("torch."),
                   **_model_row(model.to(device, dtype), config.vocab_size, device, sizes, timed, repeats)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _read_gbps(device: str, smoke: bool) -> float:
    """The device's read bandwidth: the best of 5 `torch.sum` over a buffer far beyond its caches (2 GB on a GPU)."""
    import torch

    buf = torch.ones((2**16 if smoke else 2**30), device=device, dtype=torch.bfloat16)
    timed = _timer(device)
    best = min(timed(lambda: buf.sum(), 1, warmup=1) for _ in range(5))
    return round(buf.numel() * buf.element_size() / (best / 1e3) / 1e9, 1)


def _build(kind: str, preset: str, device: str, smoke: bool):
    """MF-<preset> or its Pythia-shaped twin (the decode benchmark's configs), built in bf16 on `device`."""
    import torch
    from transformers import GPTNeoXForCausalLM

    from modeling_memoryformer import MemoryFormerConfig, MemoryFormerForCausalLM

    from .decode_bench import model_config

    config = model_config(kind, preset, "bf16")
    if smoke:
        tiny = dict(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=256)
        if kind == "mf":
            config = MemoryFormerConfig.from_preset(preset, attn_implementation="sdpa", **tiny)
        else:
            config = type(config)(**{**config.to_dict(), **tiny, "intermediate_size": 256})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32 if smoke else torch.bfloat16)
    try:
        torch.manual_seed(0)
        with torch.device(device):
            model = (MemoryFormerForCausalLM if kind == "mf" else GPTNeoXForCausalLM)(config)
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = None   # every call runs all its steps
    return model.eval()


def _decode_step_ms(model, prompt, kwargs: dict, device: str, repeats: int, steps: tuple[int, int]):
    """Milliseconds per decode step: the median over `repeats` of (a `steps[1]`-token `generate` - a `steps[0]`-token
    one) / their difference, so the prefill and `generate`'s setup cancel. The first (untimed) call is the longer one:
    where the step is compiled it compiles, and its static cache (long enough for both) is reused by the rest."""
    import torch

    def call(n):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        if out.shape[1] != prompt.shape[1] + n:
            raise RuntimeError(f"generate returned {out.shape[1] - prompt.shape[1]} tokens, expected {n}")
        return time.perf_counter() - t0, out

    short, long = steps
    _, out = call(long)
    samples = []
    for _ in range(repeats):
        a, _ = call(short)
        b, out = call(long)
        samples.append((b - a) / (long - short))
    return 1e3 * statistics.median(samples), out


def decode_section(device: str, smoke: bool, repeats: int, budget_s: float | None,
                   batches: tuple[int, ...] = (1, 4)) -> list[dict]:
    """Decode at batch 1 and 4 in bf16, MF-tiny/-small/-base against their Pythia-shaped twins, eager `generate`
    (dynamic cache) and compiled (`compiled_decode_kwargs`: static cache, CUDA graphs), each step's bytes
    (decode_bench.step_bytes) against the device's read bandwidth measured in the same run. Every eager cell first,
    then the compiled ones at the first batch size while `budget_s` lasts (a compile of MF-base takes minutes)."""
    import torch

    from modeling_memoryformer import compiled_decode_kwargs

    from .decode_bench import step_bytes

    started = time.perf_counter()
    presets = ("tiny",) if smoke else ("tiny", "small", "base")
    steps, prompt_len = ((4, 132), 8) if smoke else ((8, 72), 16)
    gbps = _read_gbps(device, smoke)
    print(json.dumps({"read_gbps": gbps}), flush=True)
    models = {(kind, preset): _build(kind, preset, device, smoke) for preset in presets for kind in ("mf", "twin")}
    gen = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(0, 255, (b, prompt_len), generator=gen).to(device) for b in batches}
    eager_tokens, rows = {}, []
    cells = [("eager", b, key) for b in batches for key in models]
    cells += [("compiled", batches[0], key) for key in models]
    for path, batch, (kind, preset) in cells:
        row = {"preset": preset, "model": kind, "path": path, "batch": batch}
        if path == "compiled" and budget_s is not None and time.perf_counter() - started > budget_s:
            row["skipped"] = f"past the {budget_s:.0f} s budget"
        else:
            kwargs = compiled_decode_kwargs(device) if path == "compiled" else {}
            try:
                with torch.inference_mode():
                    ms, out = _decode_step_ms(models[kind, preset], prompts[batch], kwargs, device,
                                              max(1, repeats), steps)
                if ms <= 0:  # the longer call was not the slower: noise larger than the steps between them
                    raise RuntimeError(f"no step time: the {steps[1]}-token calls took no longer than the "
                                       f"{steps[0]}-token ones (a busy machine, or steps too short to time)")
                context = prompt_len + sum(steps) / 2
                nbytes = step_bytes(models[kind, preset], batch, context)["total"]
                row.update(step_ms=float(f"{ms:.4g}"), tokens_per_s=round(1e3 * batch / ms, 1), step_mb=round(nbytes / 1e6, 1),
                           share_of_read_bound=round(nbytes / (ms / 1e3) / 1e9 / gbps, 4))
                if path == "eager":
                    eager_tokens[batch, kind, preset] = out
                else:
                    row["same_tokens_as_eager"] = bool(torch.equal(out, eager_tokens[batch, kind, preset]))
            except Exception as error:  # one cell's failure is a result, not the end of the run
                row["error"] = f"{type(error).__name__}: {str(error)[:400]}"
        row["elapsed_s"] = round(time.perf_counter() - started, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def run_tests(device: str) -> dict:
    command = [sys.executable, "-m", "pytest", "-q", "tests/kernel/test_triton_backend.py",
               "tests/kernel/test_op_library.py::test_opcheck_pytorch_kernels"]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    summary = (result.stdout.strip().splitlines() or [""])[-1]
    print(f"tests: {summary}", flush=True)
    return {"command": " ".join(command), "returncode": result.returncode, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--sections", nargs="+", default=["layer", "model"], choices=["layer", "model", "decode"])
    parser.add_argument("--budget-s", type=float, default=None, help="decode: no compiled cell starts after this")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4],
                        help="decode: batch sizes (compiled: the first)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="toy sizes (the CI run of this script on CPU)")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--out-dir", default=None, help="default: benchmarks/results/gpu-<date>")
    args = parser.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device here; this entry point is for a machine with a GPU (`--device cpu --smoke` "
              "runs the same code on CPU at toy sizes).", file=sys.stderr)
        return 2
    out_dir = args.out_dir or os.path.join(REPO_ROOT, "benchmarks", "results",
                                           f"gpu-{datetime.date.today().isoformat()}")
    facts = {"device": args.device, "torch": torch.__version__, "date": datetime.datetime.now(datetime.UTC)
             .replace(microsecond=0).isoformat(), "command": " ".join(sys.argv), "smoke": args.smoke,
             "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None}
    result = {"facts": facts, "targets": TARGETS}
    if not args.skip_tests:
        result["tests"] = run_tests(args.device)
    if "layer" in args.sections:
        result["layer"] = layer_section(args.device, args.smoke, args.repeats)
    if "model" in args.sections:
        result["model"] = model_section(args.device, args.smoke, args.repeats)
    if "decode" in args.sections:
        result["decode"] = decode_section(args.device, args.smoke, args.repeats, args.budget_s,
                                          tuple(args.batches))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {os.path.join(out_dir, 'results.json')}")
    return 0 if result.get("tests", {}).get("returncode", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
