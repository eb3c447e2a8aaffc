"""Layer level: one MemoryLayer (every available kernel) vs the nn.Linear of the same shape.

For every dtype, width d (in = out = d, hash_bits 8, bias on both) and token count N:
- forward: `layer(x)` under torch.inference_mode, x: [N, d];
- fwd_bwd: `y = layer(x)`, loss = (y * g).sum() with a fixed random g, then torch.autograd.grad for the
  input, the weight (Linear) / tables (MemoryLayer) and the bias (no .grad accumulation, nothing retained).
  Each kernel runs twice there: with the dense table gradient (a tensor the size of the tables, the default) and as
  "<kernel>+sparse", the same layer with `sparse=True` (the gradient of the rows hit, a sparse tensor).
bfloat16: both layers hold bf16 parameters and get a bf16 input. int8 (forward only; both are inference forms): the
MemoryLayer's tables stored as int8 (`quantize_tables_("int8")`, a float32 scale and offset per row) against the
Linear in PyTorch's dynamic int8 form (`torch.ao.quantization.quantize_dynamic`: int8 weight, the input quantised per
call), both taking a float32 input; the same shapes and starting weights as float32.

The contestants of one (dtype, d, mode, N) cell are timed round-robin (`common.round_robin`); the
MemoryLayer kernels share one MemoryLayer instance (same tables), switched with `use_kernel`.
Ratio = median Linear time / median MemoryLayer time (> 1: MemoryLayer faster).
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from modeling_memoryformer import MemoryLayer
from modeling_memoryformer.memory_ops import available_kernels, use_kernel

from .common import (
    NOISY_CORES,
    Contestant,
    cpu_snapshot,
    environment,
    make_progress,
    memory_stream_gbps,
    other_cores_since,
    round_robin,
    summary,
    wait_for_quiet,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.float32}  # int8: the input's dtype
MODES = ("forward", "fwd_bwd")
LINEAR = "Linear"


def memory_name(kernel: str) -> str:
    return f"MemoryLayer[{kernel}]"


@dataclass
class LayerSpec:
    dims: list[int] = field(default_factory=lambda: [512, 768, 1024])
    tokens: list[int] = field(default_factory=lambda: [1, 16, 256, 2048, 8192])
    dtypes: list[str] = field(default_factory=lambda: ["fp32", "bf16", "int8"])
    modes: list[str] = field(default_factory=lambda: list(MODES))
    kernels: list[str] | None = None  # None: every available kernel
    sparse_grad: bool = True  # fwd_bwd cells also time each kernel with sparse table gradients ("<kernel>+sparse")
    hash_bits: int = 8
    repeats: int = 7
    warmup: int = 2
    min_sample_s: float = 0.05  # small cells loop the call so one timed sample lasts at least this long
    seed: int = 0
    noisy_retries: int = 2  # re-measure a cell when other processes used > NOISY_CORES cores meanwhile
    noisy_wait_s: float = 10.0
    quiet_wait_s: float = 60.0  # before each cell, wait up to this long for other processes to go quiet


def make_layers(dtype_name: str, d: int, hash_bits: int, seed: int) -> tuple[nn.Module, MemoryLayer]:
    """The dense layer and the Memory Layer of one (dtype, d) cell, from the same seed in every dtype."""
    torch.manual_seed(seed)
    dtype = DTYPES[dtype_name]
    linear = nn.Linear(d, d, bias=True, dtype=dtype)
    memory = MemoryLayer(d, d, hash_bits, bias=True, dtype=dtype)
    if dtype_name == "int8":
        import warnings

        with warnings.catch_warnings():  # torch.ao's quantized tensors are deprecated (still PyTorch's int8 Linear)
            warnings.simplefilter("ignore")
            linear = torch.ao.quantization.quantize_dynamic(nn.Sequential(linear), {nn.Linear}, dtype=torch.qint8)[0]
        memory.quantize_tables_("int8")
    return linear, memory


def _kernels(spec: LayerSpec) -> list[str]:
    available = available_kernels()
    wanted = spec.kernels or available
    # "torch" first: it is the reference every other kernel is compared with.
    return sorted((k for k in wanted if k in available), key=lambda k: (k != "torch", k))


def _forward_fn(layer: nn.Module, x: torch.Tensor):
    def fn():
        return layer(x)

    return fn


def _fwd_bwd_fn(layer: nn.Module, x: torch.Tensor, g: torch.Tensor):
    x = x.detach().clone().requires_grad_(True)
    weight = layer.weight if isinstance(layer, nn.Linear) else layer.tables
    wrt = [x, weight] + ([layer.bias] if layer.bias is not None else [])

    def fn():
        y = layer(x)
        return torch.autograd.grad((y * g).sum(), wrt)

    return fn


SPARSE = "+sparse"  # suffix of the sparse-gradient variant of a kernel


def sparse_twin(memory: MemoryLayer) -> MemoryLayer:
    """The same layer (same parameter objects) with sparse table gradients."""
    twin = copy.copy(memory)
    twin.sparse = True
    return twin


def _context(kernel: str | None, mode: str):
    def ctx():
        stack = contextlib.ExitStack()
        if kernel is not None:
            stack.enter_context(use_kernel(kernel.removesuffix(SPARSE)))
        if mode == "forward":
            stack.enter_context(torch.inference_mode())
        return stack

    return ctx


def run(spec: LayerSpec, log=print) -> dict:
    kernels = _kernels(spec)
    env = environment()
    cells = [(dt, d, mode, n) for dt in spec.dtypes for d in spec.dims for mode in spec.modes for n in spec.tokens
             if not (dt == "int8" and mode != "forward")]  # int8 layers do not train
    n_contestants = 1 + len(kernels)
    sparse_extra = len(kernels) if spec.sparse_grad else 0
    total = sum(n_contestants + (sparse_extra if mode == "fwd_bwd" else 0) for _, _, mode, _ in cells) * (
        max(1, spec.warmup) + spec.repeats)
    log(
        f"Layer level: {len(cells)} cells x {n_contestants} contestants (Linear, "
        f"{', '.join(memory_name(k) for k in kernels)}), warm-up {max(1, spec.warmup)}, repeats {spec.repeats}"
    )
    start_all = time.perf_counter()
    section_cpu = cpu_snapshot()
    bar = make_progress(total, "layer")
    rows: list[dict] = []
    ratios: list[dict] = []
    waited = 0.0
    layers: dict = {}
    try:
        for dtype_name, d, mode, n in cells:
            dtype = DTYPES[dtype_name]
            if (dtype_name, d) not in layers:
                layers.clear()  # keep one pair of layers alive at a time
                layers[(dtype_name, d)] = make_layers(dtype_name, d, spec.hash_bits, spec.seed)
            linear, memory = layers[(dtype_name, d)]
            gen = torch.Generator().manual_seed(spec.seed + n)
            x = torch.randn(n, d, generator=gen).to(dtype)
            g = torch.randn(n, d, generator=gen).to(dtype)
            bar.set_postfix_str(f"{mode} {dtype_name} d={d} N={n}")

            def make(layer, kernel, x=x, g=g, mode=mode):
                fn = _forward_fn(layer, x) if mode == "forward" else _fwd_bwd_fn(layer, x, g)
                name = LINEAR if kernel is None else memory_name(kernel)
                return Contestant(name=name, fn=fn, context=_context(kernel, mode), kernel=kernel)

            # A cell measured while other processes took CPU is measured again (after a pause), up to
            # `noisy_retries` times; the attempt with the least contention is kept.
            best = None
            sparse = spec.sparse_grad and mode == "fwd_bwd"
            for attempt in range(1 + spec.noisy_retries):
                if attempt:
                    bar.total += (n_contestants + (sparse_extra if sparse else 0)) * (max(1, spec.warmup) + spec.repeats)
                    bar.set_postfix_str(f"{mode} {dtype_name} d={d} N={n} (noisy, retry {attempt})")
                    time.sleep(spec.noisy_wait_s)
                waited += wait_for_quiet(spec.quiet_wait_s)
                stream = memory_stream_gbps()
                contestants = [make(linear, None)] + [make(memory, k) for k in kernels]
                if sparse:
                    contestants += [make(sparse_twin(memory), k + SPARSE) for k in kernels]
                round_robin(contestants, spec.repeats, spec.warmup, spec.min_sample_s, tick=bar.update)
                wall = sum(c.timed_wall_s for c in contestants)
                other = round(sum(c.other_cpu_s for c in contestants) / wall, 3) if wall > 0 else None
                if best is None or (other is not None and best[1] is not None and other < best[1]):
                    best = (contestants, other, attempt + 1, stream)
                if other is None or other <= NOISY_CORES:
                    break
            contestants, other, attempts, stream = best

            check = _check_against_torch(memory, x, kernels) if mode == "forward" else {}
            cell = {"mode": mode, "dtype": dtype_name, "d": d, "tokens": n}
            for c in contestants:
                row = dict(cell, contestant=c.name, kernel=c.kernel, inner_loops=c.inner)
                row["status"] = "ok" if c.samples else f"error: {c.error or 'no samples'}"
                if c.error and c.samples:
                    row["status"] = f"partial: {c.error}"
                row["ms"] = summary(c.samples, 1e3)
                row["other_cpu_cores"] = other
                row["host_stream_gbps"] = stream  # memory stream just before the cell (see common.memory_stream_gbps)
                row["attempts"] = attempts
                if c.kernel in check:
                    row["max_abs_diff_vs_torch"] = check[c.kernel]
                rows.append(row)
            dense = contestants[0]
            for c in contestants[1:]:
                if dense.samples and c.samples:
                    paired = [a / b for a, b in zip(dense.samples, c.samples)]
                    ratios.append(
                        dict(
                            cell,
                            kernel=c.kernel,
                            ratio=dense.median / c.median,
                            paired_ratio_median=statistics.median(paired),
                        )
                    )
    finally:
        bar.close()
    elapsed = time.perf_counter() - start_all
    add_forward_bounds(rows, spec.hash_bits)
    log(f"Layer level done in {elapsed:.0f} s")
    return {
        "meta": dict(env, elapsed_s=round(elapsed, 1), other_cpu_cores=other_cores_since(section_cpu),
                     waited_for_quiet_s=round(waited, 1)),
        "spec": asdict(spec) | {"kernels": kernels, "noisy_cores_threshold": NOISY_CORES},
        "rows": rows,
        "ratios": ratios,
    }


ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "int8": 1}


def forward_bound(d: int, tokens: int, dtype_name: str, hash_bits: int, stream_gbps: float,
                  mac_per_s: float | None) -> dict:
    """What bounds a Memory Layer forward (d -> d, K = d / tau tables of 2**tau rows) on this machine, and the time it
    allows: the bytes it must move at the measured memory stream, either every retrieved row (N * K rows: gathers) or
    each table once (one pass over all tables, when that is fewer bytes), plus the input and output; and its N * K * d
    multiply-adds at `mac_per_s` (the fastest rate the dense layer reached in the same run, in any dtype: the Memory
    Layer sums in float32 whatever its tables, and a CPU without bf16 instructions runs the bf16 GEMM far below its
    float32 rate; a lower bound of the machine's). The benchmark repeats one input, so the rows it gathers can sit in
    the caches after the first call: a distance under 1 means they came from there, not from memory. An int8 row is d codes + 8 bytes of scale and offset."""
    tables = d // hash_bits
    row = d * ELEMENT_BYTES[dtype_name] + (8 if dtype_name == "int8" else 0)
    act = 4 if dtype_name in ("fp32", "int8") else 2
    gathers = tokens * tables * row
    stream_all = tables * (1 << hash_bits) * row
    rows_bytes, how = (gathers, "gathers") if gathers <= stream_all else (stream_all, "table stream")
    moved = rows_bytes + 2 * tokens * d * act
    memory_s = moved / (stream_gbps * 1e9)
    macs = tokens * tables * d
    compute_s = macs / mac_per_s if mac_per_s else 0.0
    bound, what = (memory_s, how) if memory_s >= compute_s else (compute_s, "multiply-adds")
    return {"bound_ms": bound * 1e3, "bound": what, "bytes": moved, "macs": macs}


def add_forward_bounds(rows: list[dict], hash_bits: int) -> None:
    """Each MemoryLayer forward row gets its bound on this machine (`forward_bound`) and its distance to it
    (measured / bound: 1.0 is at the bound)."""
    mac_rate = 0.0
    for r in rows:  # the dense layer's best multiply-add rate, any dtype: d * d per token
        if r["mode"] == "forward" and r["contestant"] == LINEAR and r.get("ms") and r["ms"].get("median"):
            mac_rate = max(mac_rate, r["tokens"] * r["d"] * r["d"] / (r["ms"]["median"] / 1e3))
    for r in rows:
        if (r["mode"] != "forward" or r["contestant"] == LINEAR or not r.get("ms") or not r["ms"].get("median")
                or not r.get("host_stream_gbps")):
            continue
        bound = forward_bound(r["d"], r["tokens"], r["dtype"], hash_bits, r["host_stream_gbps"], mac_rate or None)
        r["bound"] = dict(bound, distance=r["ms"]["median"] / bound["bound_ms"], dense_mac_per_s=mac_rate or None)


def _check_against_torch(memory: MemoryLayer, x: torch.Tensor, kernels: list[str]) -> dict:
    """max |y_kernel - y_torch| (and max |y_torch| for scale) on the benchmark input, so that a fast but wrong
    kernel shows up in the results."""
    out = {}
    if "torch" not in kernels:
        return out
    with torch.inference_mode():
        with use_kernel("torch"):
            reference = memory(x).float()
        for k in kernels:
            if k == "torch":
                continue
            try:
                with use_kernel(k):
                    diff = float((memory(x).float() - reference).abs().max())
                out[k] = {"max_abs_diff": diff, "max_abs_torch_output": float(reference.abs().max())}
            except Exception as exc:
                out[k] = f"{type(exc).__name__}: {exc}"
    return out
