"""The Memory Layer operation: locality-sensitive hashing, bucket scores and the table lookup.

Paper equations (MemoryFormer, NeurIPS 2024, section 3.1), for an input x in R^{d_in} split into
K = d_in / tau contiguous chunks z_k of tau values each:

    h(z_k)  = sum_i [z_k,i >= 0] * 2^i                      (eq. integer(); sign(0) = +1)
    p(z_k)  = 1 / prod_i (1 + exp(-2 |z_k,i| / t))           (eq. hash_proj, the bucket probability)
    y       = sum_k p(z_k) * T_k[h(z_k)] + b                 (eq. hash_proj)

The K tables are stored as one parameter of shape [K * 2**tau, d_out], table-major, so that the row of
table k for code c is row k * 2**tau + c.

This module holds the plain formulation that every faster path is checked against
(`memory_lookup_reference`) and the production path (`memory_lookup`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import sys
import warnings

import torch
import torch.nn.functional as F


HASH_SCORES = ("paper", "l1")
KERNELS = ("auto", "fused", "torch")
_kernel_choice = os.environ.get("MEMORYFORMER_KERNEL", "auto")


def available_kernels() -> list[str]:
    """Implementations that can run here: "torch" always, "fused" when the compiled CPU kernel loads."""
    return ["fused", "torch"] if load_fused_kernels() else ["torch"]


def get_kernel() -> str:
    """The implementation Memory Layers use now: "fused" or "torch" (resolves "auto")."""
    choice = _kernel_choice
    if choice not in KERNELS:
        raise ValueError(f"MEMORYFORMER_KERNEL={choice!r} is not supported; choose one of {', '.join(KERNELS)}.")
    if choice == "auto":
        return "fused" if "fused" in available_kernels() else "torch"
    if choice not in available_kernels():
        raise RuntimeError(f"The {choice!r} Memory Layer kernel is not available here; use 'torch' or 'auto'.")
    return choice


def set_kernel(name: str) -> None:
    """Force an implementation for this process: "auto" (default; also MEMORYFORMER_KERNEL), "fused" or "torch"."""
    global _kernel_choice
    if name not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {name!r}.")
    _kernel_choice = name
    get_kernel()


@contextlib.contextmanager
def use_kernel(name: str):
    """Context manager form of `set_kernel`."""
    global _kernel_choice
    previous = _kernel_choice
    set_kernel(name)
    try:
        yield
    finally:
        _kernel_choice = previous


def release_gradient_memory() -> int:
    """Free the idle blocks of the fused kernel's table-gradient pool; return the bytes freed (0 without the kernel).

    Table gradients are as large as the tables, so the fused backward hands them out from a pool of huge-page
    blocks that are reused once their tensor is freed (e.g. by `optimizer.zero_grad(set_to_none=True)`): fresh
    memory would cost more in page faults than the kernel that fills it. Blocks stay with the process after training;
    call this to give them back. `MEMORYFORMER_GRAD_POOL_MB` caps the pool (default 16384; 0 turns it off).
    """
    if _fused_state is not True:
        return 0
    return int(torch.ops.memoryformer_cpu.release_gradient_pool())


def num_tables_for(in_features: int, hash_bits: int) -> int:
    """K = d_in / tau; raise a ValueError naming the fix when tau does not divide d_in."""
    if hash_bits < 1:
        raise ValueError(f"hash_bits must be >= 1, got {hash_bits}.")
    if in_features % hash_bits != 0:
        raise ValueError(
            f"in_features={in_features} is not divisible by hash_bits={hash_bits}: a Memory Layer splits its "
            f"input into chunks of hash_bits values. Choose in_features as a multiple of {hash_bits}."
        )
    return in_features // hash_bits


def _chunks(x: torch.Tensor, hash_bits: int) -> torch.Tensor:
    """[..., K * tau] -> [..., K, tau]."""
    num_tables_for(x.shape[-1], hash_bits)
    return x.unflatten(-1, (x.shape[-1] // hash_bits, hash_bits))


def hash_codes(x: torch.Tensor, hash_bits: int) -> torch.Tensor:
    """Hash codes h(z_k) of every chunk: [..., K * tau] -> int64 [..., K] with values in [0, 2**tau).

    Element i of a chunk carries bit 2**i, and an element >= 0 (an exact zero included) sets its bit.
    """
    z = _chunks(x, hash_bits)
    weights = torch.ones(hash_bits, dtype=torch.long, device=x.device) << torch.arange(hash_bits, device=x.device)
    return ((z >= 0).long() * weights).sum(-1)


def hash_scores(x: torch.Tensor, hash_bits: int, score: str = "paper", temperature: float = 1.0) -> torch.Tensor:
    """Weight of each retrieved row: [..., K * tau] -> [..., K], in the dtype of x.

    score="paper": p(z) = 1 / prod_i (1 + exp(-2|z_i|/t)), computed as exp(-sum_i softplus(-2|z_i|/t)).
    score="l1":    ||z||_1 * p(z), the authors' training code (unbounded, roughly scale-equivariant).
    Half-precision inputs are scored in float32 and the result cast back.
    """
    if score not in HASH_SCORES:
        raise ValueError(f"score must be one of {HASH_SCORES}, got {score!r}.")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    z = _chunks(x, hash_bits)
    compute_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    z_abs = z.to(compute_dtype).abs()
    log_p = -F.softplus(-2.0 * z_abs / temperature).sum(-1)
    p = log_p.exp()
    if score == "l1":
        p = p * z_abs.sum(-1)
    return p.to(x.dtype)


def table_rows(codes: torch.Tensor, hash_bits: int) -> torch.Tensor:
    """Flat row index into the [K * 2**tau, d_out] table parameter: k * 2**tau + h(z_k)."""
    num_tables = codes.shape[-1]
    offsets = torch.arange(num_tables, device=codes.device, dtype=codes.dtype) << hash_bits
    return codes + offsets


def _check_tables(x: torch.Tensor, tables: torch.Tensor, hash_bits: int) -> None:
    num_tables = num_tables_for(x.shape[-1], hash_bits)
    if tables.dim() != 2 or tables.shape[0] != num_tables << hash_bits:
        raise ValueError(
            f"tables must have shape [K * 2**hash_bits, out_features] = [{num_tables << hash_bits}, out_features] "
            f"for an input of {x.shape[-1]} features and hash_bits={hash_bits}; got {tuple(tables.shape)}."
        )


def memory_lookup_reference(
    x: torch.Tensor,
    tables: torch.Tensor,
    bias: torch.Tensor | None,
    hash_bits: int,
    score: str = "paper",
    temperature: float = 1.0,
) -> torch.Tensor:
    """The Memory Layer written straight from the equations; the oracle for every other path.

    x: [..., K * tau], tables: [K * 2**tau, d_out], bias: [d_out] or None -> [..., d_out].
    Gathers the K rows of every token explicitly ([..., K, d_out]) and sums them weighted by the scores.
    """
    _check_tables(x, tables, hash_bits)
    rows = tables[table_rows(hash_codes(x, hash_bits), hash_bits)]  # [..., K, d_out]
    scores = hash_scores(x, hash_bits, score, temperature).to(tables.dtype)  # [..., K]
    y = (scores.unsqueeze(-1) * rows).sum(-2)
    if bias is not None:
        y = y + bias
    return y


def memory_lookup_hashed(
    rows: torch.Tensor, scores: torch.Tensor, tables: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Gather-accumulate for precomputed hashes: rows, scores [..., K] -> [..., d_out].

    Lets several tables share one hash of the same input (see `MemoryLayer.hash`).
    """
    if not torch.compiler.is_compiling() and rows.numel():
        num_tables = rows.shape[-1]
        if tables.shape[0] % num_tables:
            raise ValueError(
                f"rows has {num_tables} columns (one per table) but the {tables.shape[0]} table rows do not split into "
                f"{num_tables} tables. Pass the rows returned by MemoryLayer.hash() of a layer with the same "
                "in_features and hash_bits."
            )
        per_table = tables.shape[0] // num_tables
        codes = rows - torch.arange(num_tables, device=rows.device) * per_table  # column k must hit table k
        if bool((codes < 0).any()) or bool((codes >= per_table).any()):
            raise ValueError(
                f"rows[..., k] must index table k (rows k * {per_table} .. k * {per_table} + {per_table - 1}); got "
                f"values in [{int(rows.min())}, {int(rows.max())}]. Pass the rows returned by MemoryLayer.hash() of a "
                "layer with the same in_features and hash_bits."
            )
    return _gather_accumulate(rows, scores, tables, bias)


def _gather_accumulate(
    rows: torch.Tensor, scores: torch.Tensor, tables: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    lead = rows.shape[:-1]
    if _use_fused(tables):
        num_tables = rows.shape[-1]
        y = torch.ops.memoryformer_cpu.lookup(
            rows.reshape(-1, num_tables).contiguous(),
            scores.reshape(-1, num_tables),
            tables.contiguous(),
            bias,
            tables.shape[0] // num_tables,
        )
        return y.reshape(*lead, tables.shape[-1])
    y = F.embedding_bag(
        rows.reshape(-1, rows.shape[-1]),
        tables,
        per_sample_weights=scores.reshape(-1, scores.shape[-1]).to(tables.dtype),
        mode="sum",
    )
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, tables.shape[-1])


def memory_lookup(
    x: torch.Tensor,
    tables: torch.Tensor,
    bias: torch.Tensor | None,
    hash_bits: int,
    score: str = "paper",
    temperature: float = 1.0,
) -> torch.Tensor:
    """The Memory Layer, production path: same maths as `memory_lookup_reference`, no [..., K, d_out] buffer.

    x: [..., K * tau], tables: [K * 2**tau, d_out], bias: [d_out] or None -> [..., d_out].
    """
    _check_tables(x, tables, hash_bits)
    if score not in HASH_SCORES:
        raise ValueError(f"score must be one of {HASH_SCORES}, got {score!r}.")
    if not temperature > 0:  # as hash_scores says it, before either path (the fused one does not score in Python)
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    if bias is not None and (bias.shape != tables.shape[-1:] or not bias.is_floating_point()):
        raise ValueError(
            f"bias must be a floating-point vector of out_features={tables.shape[-1]} values (one per table column); "
            f"got {bias.dtype} of shape {tuple(bias.shape)}. Pass a bias of shape [{tables.shape[-1]}], or None."
        )
    if x.device.type == "cpu" and _use_fused(tables):  # hashing and scoring in one C++ pass, then the lookup
        rows, scores = torch.ops.memoryformer_cpu.hash(
            x.reshape(-1, x.shape[-1]).contiguous(), hash_bits, score == "l1", float(temperature)
        )
        y = torch.ops.memoryformer_cpu.lookup(rows, scores, tables.contiguous(), bias, 1 << hash_bits)
        return y.view(*x.shape[:-1], tables.shape[-1])
    rows = table_rows(hash_codes(x, hash_bits), hash_bits)
    scores = hash_scores(x, hash_bits, score, temperature)
    return _gather_accumulate(rows, scores, tables, bias)


# ---------------------------------------------------------------------------------------------------------------------
# The fused CPU kernels (C++ in memory_kernel_source.py), built with torch.utils.cpp_extension at first use and cached
# in TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions). Without a compiler the PyTorch path runs instead.

_fused_state: bool | None = None  # None: not tried yet


def _use_fused(tables: torch.Tensor) -> bool:
    if tables.device.type != "cpu":
        return False
    if torch.compiler.is_compiling():  # no building or file checks while tracing: use what is already loaded
        return _fused_state is True and _kernel_choice in ("auto", "fused")
    return get_kernel() == "fused"


def load_fused_kernels() -> bool:
    """Build (first time) and load the fused CPU kernels; return whether they are usable. Warns once on failure."""
    global _fused_state
    if _fused_state is None:
        _check_pool_setting()
        try:
            _build_and_register()
            _fused_state = True
        except Exception as exc:  # a missing compiler, headers or ninja: fall back, say so once
            _fused_state = False
            warnings.warn(
                f"MemoryFormer's fused CPU kernel could not be built ({type(exc).__name__}: {exc}); Memory Layers "
                "use the plain PyTorch path (correct, slower). Install gcc/g++ and `pip install ninja` to enable it.",
                RuntimeWarning,
                stacklevel=3,
            )
    return _fused_state


def _check_pool_setting() -> None:
    """MEMORYFORMER_GRAD_POOL_MB is read by the C++ kernel, which cannot report a typo: check it here."""
    value = os.environ.get("MEMORYFORMER_GRAD_POOL_MB")
    if value is not None and not value.strip().isdigit():
        raise ValueError(
            f"MEMORYFORMER_GRAD_POOL_MB={value!r} is not a whole number of megabytes; set it to e.g. 16384 (the "
            "default), or 0 to turn the table-gradient pool off."
        )


def _build_and_register() -> None:
    from torch.utils.cpp_extension import load_inline

    from .memory_kernel_source import CPP_SOURCE

    if hasattr(torch.ops, "memoryformer_cpu") and hasattr(torch.ops.memoryformer_cpu, "lookup"):
        return  # already loaded in this process (e.g. by another copy of this module)
    for tool in ("c++", "ninja"):
        if shutil.which(tool) is None and not (tool == "ninja" and _ninja_in_venv()):
            raise RuntimeError(f"`{tool}` was not found on PATH")
    flags = ["-O3", "-march=native", "-fopenmp"]
    key = "|".join([CPP_SOURCE, torch.__version__, platform.machine(), _cpu_model(), *flags])
    name = "memoryformer_cpu_" + hashlib.sha256(key.encode()).hexdigest()[:12]
    print("MemoryFormer: loading the fused CPU kernel (compiled once, then cached)...", file=sys.stderr, flush=True)
    load_inline(
        name=name,
        cpp_sources=[CPP_SOURCE],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )
    _register_autograd_and_fake()


def _ninja_in_venv() -> bool:
    if os.path.exists(os.path.join(os.path.dirname(sys.executable), "ninja")):
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        return True
    return False


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _register_autograd_and_fake() -> None:
    ops = torch.ops.memoryformer_cpu

    def hash_setup(ctx, inputs, output):
        x, hash_bits, l1, temperature = inputs
        ctx.save_for_backward(x)
        ctx.args = (hash_bits, l1, temperature)

    def hash_backward(ctx, grad_rows, grad_scores):
        (x,) = ctx.saved_tensors
        if grad_scores is None or not ctx.needs_input_grad[0]:
            return None, None, None, None
        return ops.hash_backward(grad_scores.contiguous(), x, *ctx.args), None, None, None

    def lookup_setup(ctx, inputs, output):
        rows, scores, tables, bias, rows_per_table = inputs
        ctx.save_for_backward(rows, scores, tables)
        ctx.rows_per_table = rows_per_table

    def lookup_backward(ctx, grad):
        rows, scores, tables = ctx.saved_tensors
        _, need_scores, need_tables, need_bias, _ = ctx.needs_input_grad
        grad_scores, grad_tables = ops.lookup_backward(
            grad.contiguous(), rows, scores, tables, ctx.rows_per_table, need_tables, need_scores
        )
        grad_bias = grad.sum(0) if need_bias else None
        if grad_scores is not None and need_scores:
            grad_scores = grad_scores.to(scores.dtype)
        return None, grad_scores if need_scores else None, grad_tables if need_tables else None, grad_bias, None

    torch.library.register_autograd("memoryformer_cpu::hash", hash_backward, setup_context=hash_setup)
    torch.library.register_autograd("memoryformer_cpu::lookup", lookup_backward, setup_context=lookup_setup)

    @torch.library.register_fake("memoryformer_cpu::hash")
    def _hash_fake(x, hash_bits, l1, temperature):
        shape = (x.shape[0], x.shape[1] // hash_bits)
        return x.new_empty(shape, dtype=torch.long), x.new_empty(shape, dtype=_acc_dtype(x.dtype))

    @torch.library.register_fake("memoryformer_cpu::hash_backward")
    def _hash_backward_fake(grad_scores, x, hash_bits, l1, temperature):
        return torch.empty_like(x)

    @torch.library.register_fake("memoryformer_cpu::lookup")
    def _lookup_fake(rows, scores, tables, bias, rows_per_table):
        return tables.new_empty((rows.shape[0], tables.shape[1]))

    @torch.library.register_fake("memoryformer_cpu::lookup_backward")
    def _lookup_backward_fake(grad_out, rows, scores, tables, rows_per_table, need_tables, need_scores):
        grad_scores = scores.new_empty(rows.shape, dtype=_acc_dtype(tables.dtype)) if need_scores else None
        return grad_scores, (torch.empty_like(tables) if need_tables else None)
