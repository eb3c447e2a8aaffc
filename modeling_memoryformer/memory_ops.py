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
import functools
import hashlib
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import warnings

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode


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
    if choice == "torch":
        return "torch"  # never builds nor loads the fused kernel
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


def check_hash_parameters(hash_bits, score="paper", temperature=1.0, names=("hash_bits", "score", "temperature"),
                          width: int | None = None) -> None:
    """The one check of a Memory Layer's hashing parameters, for the config (with its field names as `names`), the
    layer and the ops: tau an integer in 1..16, a known score, a finite temperature > 0. `width`: the model width,
    to say how large the tables of a too-large tau would be."""
    bits_name, score_name, temperature_name = names
    if not isinstance(hash_bits, int) or isinstance(hash_bits, bool) or not 1 <= hash_bits <= 16:
        detail = ""
        if width and isinstance(hash_bits, int) and not isinstance(hash_bits, bool) and hash_bits > 16:
            table_bytes = (width // hash_bits or 1) * (2**hash_bits) * width * 4
            detail = f" With {bits_name}={hash_bits} one {width} -> {width} Memory Layer would need {table_bytes:,} " \
                     "bytes of float32 tables."
        raise ValueError(f"{bits_name} must be an integer in 1..16, got {hash_bits!r}.{detail} The paper uses 8 "
                         "(tables of 256 rows).")
    if not isinstance(score, str) or score not in HASH_SCORES:
        raise ValueError(f"{score_name}={score!r} is not supported; choose one of {', '.join(map(repr, HASH_SCORES))}.")
    if (not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not math.isfinite(temperature)
            or not temperature > 0):
        raise ValueError(f"{temperature_name} must be a finite number > 0, got {temperature!r}. The paper uses 1.0.")


def num_tables_for(in_features: int, hash_bits: int) -> int:
    """K = d_in / tau; raise a ValueError naming the fix when tau is not valid or does not divide d_in."""
    check_hash_parameters(hash_bits)
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
    check_hash_parameters(hash_bits, score, temperature)
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
    dtype = output_dtype(x.dtype, tables.dtype)
    rows = tables[table_rows(hash_codes(x, hash_bits), hash_bits)].to(dtype)  # [..., K, d_out]
    scores = hash_scores(x, hash_bits, score, temperature).to(dtype)  # [..., K]
    y = (scores.unsqueeze(-1) * rows).sum(-2)
    if bias is not None:
        y = y + bias
    return y


def output_dtype(input_dtype: torch.dtype, table_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a Memory Layer's output: the wider of its input's and its tables'. Tables kept in bfloat16 to halve
    their memory, in a model that computes in float32, give float32 outputs (the rows are summed in float32 either
    way); a model cast to bfloat16 as a whole stays bfloat16."""
    return torch.promote_types(input_dtype, table_dtype)


def memory_lookup_hashed(
    rows: torch.Tensor, scores: torch.Tensor, tables: torch.Tensor, bias: torch.Tensor | None, sparse: bool = False
) -> torch.Tensor:
    """Gather-accumulate for precomputed hashes: rows, scores [..., K] -> [..., d_out].

    Lets several tables share one hash of the same input (see `MemoryLayer.hash`). `sparse`: see `memory_lookup`.
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
    return _gather_accumulate(rows, scores, tables, bias, output_dtype(scores.dtype, tables.dtype), sparse)


# The ops' CPU kernels, called below their Python autograd registration: about 8 us less per call, most of a lookup
# of one token. For calls that record no gradient, and inside an autograd node of our own.
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _fused_call(op, *args):
    """`op(*args)` (a fused op on CPU tensors), straight to its CPU kernel when no gradient is recorded, nothing is
    being traced or profiled (the profiler names ops at the dispatcher's entry) and no Python dispatch mode
    (FakeTensorMode, FlopCounterMode, ...) would see the call."""
    if (torch.is_grad_enabled() or torch.compiler.is_compiling() or torch.autograd._profiler_enabled()
            or _get_current_dispatch_mode() is not None):
        return op(*args)
    return op.default.redispatch(_CPU_KEYS, *args)


def _gather_accumulate(
    rows: torch.Tensor, scores: torch.Tensor, tables: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
    sparse: bool = False,
) -> torch.Tensor:
    """sum_k scores[..., k] * tables[rows[..., k]] (+ bias) in `dtype`. Both paths accumulate in float32 (float64 for
    float64 tables); tables narrower than `dtype` give their sum in the tables' dtype, widened afterwards, and the
    bias is added in `dtype`. `sparse`: the tables' gradient is a sparse tensor of the rows hit (see
    `memory_lookup`)."""
    update = table_update_for(tables)
    if update is not None:
        return _LookupUpdatingTables.apply(rows, scores, tables, bias, dtype, update)
    lead = rows.shape[:-1]
    mixed = dtype != tables.dtype
    if sparse and tables.requires_grad and torch.is_grad_enabled():
        y = _sparse_gather(rows.reshape(-1, rows.shape[-1]), scores.reshape(-1, scores.shape[-1]), tables)
        if mixed:
            y = y.to(dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*lead, tables.shape[-1])
    if _use_fused(tables):
        num_tables = rows.shape[-1]
        y = _fused_call(
            torch.ops.memoryformer_cpu.lookup,
            rows.reshape(-1, num_tables).contiguous(),
            scores.reshape(-1, num_tables),
            tables.contiguous(),
            None if mixed else bias,
            tables.shape[0] // num_tables,
        )
    else:
        y = F.embedding_bag(
            rows.reshape(-1, rows.shape[-1]),
            tables,
            per_sample_weights=scores.reshape(-1, scores.shape[-1]).to(tables.dtype),
            mode="sum",
        )
        if not mixed and bias is not None:
            y = y + bias
    if mixed:
        y = y.to(dtype)
        if bias is not None:
            y = y + bias
    return y.reshape(*lead, tables.shape[-1])


# ---------------------------------------------------------------------------------------------------------------------
# Table updates in the backward pass: an optimizer (training.table_optimizer.TableAdamW) attaches to a `tables`
# parameter an object under TABLE_UPDATE_ATTR with
#   owner() -> the parameter it was made for (a weak reference: a copy of the model does not update the original's)
#   __call__(grad, start, stop, first) -> None: apply the optimizer's rule to rows [start, stop) of the parameter,
#       given their complete gradient for this backward pass (float32, or float64 for float64 tables); `first` is
#       True for the first group of rows of a backward pass (the optimizer counts its step there).
# The lookup's backward then computes the table gradient one group of whole tables at a time (at most
# `update_group_bytes()` of gradient) and hands each group to the update at once, before the next group's gradient
# exists: no tensor the size of the tables ever holds a gradient, and the parameter's `.grad` stays None. The score
# gradient of a group is taken before that group is updated, so the input gradient is the one of the forward's
# tables, as without the update.

TABLE_UPDATE_ATTR = "_memoryformer_table_update"
UPDATE_GROUP_BYTES = None  # None: derived from the machine's caches (`update_group_bytes`); tests set it small


def table_update_for(tables: torch.Tensor):
    """The update attached to `tables` when this lookup should apply it in its backward pass, else None: a gradient
    is being recorded for the tables, outside torch.compile (which traces the plain lookup and leaves the update to
    the optimizer's gradient hook)."""
    update = getattr(tables, TABLE_UPDATE_ATTR, None)
    if (
        update is None
        or not (torch.is_grad_enabled() and tables.requires_grad)
        or torch.compiler.is_compiling()
        or update.owner() is not tables
    ):
        return None
    return update


def cache_share_bytes() -> int:
    """A quarter of the last-level cache as the fused kernel reports it (at least 1 MB), else 8 MB: the working set a
    pass may keep in cache beside what else runs."""
    if _fused_state:
        l3 = int(torch.ops.memoryformer_cpu.machine_info()[2])
        if l3 > 0:
            return max(1 << 20, l3 // 4)
    return 8 << 20


def update_group_bytes(grad_bytes: int = 0, table_bytes: int | None = None) -> int:
    """Bytes of table gradient computed before its update, for a layer whose output gradient holds `grad_bytes` and
    whose tables `table_bytes`: at least `cache_share_bytes()` (a quarter of the last-level cache), at least twice the
    output gradient, and at most half of the tables. `UPDATE_GROUP_BYTES` overrides.

    Every group reads the whole output gradient again (each of its tokens looks up every table), so groups much
    smaller than that gradient spend more time re-reading it than on the tables: with MF-tiny's Q/K/V layer at
    8 x 512 tokens (a 25 MB output gradient, 96 MiB of tables), 13 groups of 8 MB took 50.8 ms per backward and
    update, 2 groups 31 ms (AMD EPYC, 2 threads). Twice the output gradient keeps those re-reads within one pass over
    the tables; half the tables keeps the promise that no tensor the size of a layer's tables holds its gradient (a
    group is never less than one table). The backward passes grad_bytes=0 for tables stored in another dtype than
    float32 (bfloat16): each of their groups is converted to float32 and updated through temporaries of its size,
    fresh memory from the OS beyond a few tens of MB, and MF-base's bfloat16 step with groups of twice its output
    gradient (about 100 MB) peaked 1.6 GB higher and ran 20% slower (108 million page faults in 3 steps).
    """
    if UPDATE_GROUP_BYTES is not None:
        return int(UPDATE_GROUP_BYTES)
    budget = max(cache_share_bytes(), 2 * grad_bytes)
    if table_bytes is not None:
        budget = min(budget, table_bytes // 2)
    return budget


def _group_gradient_torch(grad: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor, tables: torch.Tensor,
                          need_scores: bool, budget: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The PyTorch form of one group's backward: grad [N, D], rows [N, k] (into `tables` [k * P, D]), scores [N, k]
    -> (grad_scores [N, k] or None, grad_tables [k * P, D]), in float32 (float64 for float64 tables), a slice of
    tokens at a time so that the [tokens, k, D] products stay within `budget` bytes."""
    acc = _acc_dtype(tables.dtype)
    n, k = rows.shape
    width = tables.shape[1]
    values = tables.to(acc)
    grad = grad.to(acc)
    grad_tables = torch.zeros(tables.shape, dtype=acc, device=tables.device)
    grad_scores = torch.empty((n, k), dtype=acc, device=tables.device) if need_scores else None
    step = max(1, budget // max(1, k * width * torch.finfo(acc).bits // 8))
    for t0 in range(0, n, step):
        g = grad[t0 : t0 + step].unsqueeze(1)  # [t, 1, D]
        r = rows[t0 : t0 + step]
        grad_tables.index_add_(0, r.reshape(-1), (scores[t0 : t0 + step].to(acc).unsqueeze(-1) * g).reshape(-1, width))
        if need_scores:
            grad_scores[t0 : t0 + step] = (values[r] * g).sum(-1)
    return grad_scores, grad_tables


class _LookupUpdatingTables(torch.autograd.Function):
    """`_gather_accumulate` whose backward updates the tables in place, group by group, instead of returning their
    gradient (see TABLE_UPDATE_ATTR above). The tables are held by reference, not saved: they change in the backward
    by design, after each group's score gradient has been taken."""

    @staticmethod
    def forward(ctx, rows, scores, tables, bias, dtype, update):
        ctx.save_for_backward(rows, scores)
        ctx.tables, ctx.update = tables, update
        ctx.bias_dtype = None if bias is None else bias.dtype
        return _gather_accumulate(rows, scores, tables.detach(), bias, dtype)

    @staticmethod
    def backward(ctx, grad):
        rows, scores = ctx.saved_tensors
        tables, update = ctx.tables, ctx.update
        need_scores = ctx.needs_input_grad[1]
        num_tables, width = rows.shape[-1], tables.shape[1]
        per_table = tables.shape[0] // num_tables
        flat_rows = rows.reshape(-1, num_tables)
        flat_scores = scores.reshape(-1, num_tables)
        acc = _acc_dtype(tables.dtype)
        g = grad.reshape(-1, width)
        g_acc = g.to(acc).contiguous()
        row_bytes = width * torch.finfo(acc).bits // 8
        # Tables in another dtype than the accumulation (bfloat16) are converted and updated group by group through
        # temporaries of a group's size: their groups stay at the cache share (see update_group_bytes).
        grad_bytes = g_acc.numel() * g_acc.element_size() if tables.dtype == acc else 0
        budget = update_group_bytes(grad_bytes, tables.shape[0] * row_bytes)
        group = max(1, min(num_tables, budget // max(1, per_table * row_bytes)))
        fused = _use_fused(tables)
        grad_scores = torch.empty(flat_scores.shape, dtype=acc, device=grad.device) if need_scores else None
        with torch.no_grad():
            for k0 in range(0, num_tables, group):
                k1 = min(num_tables, k0 + group)
                start, stop = k0 * per_table, k1 * per_table
                local = (flat_rows[:, k0:k1] - start).contiguous()
                part = flat_scores[:, k0:k1].contiguous()
                values = tables.detach()[start:stop]
                if fused:
                    gs, gt = torch.ops.memoryformer_cpu.lookup_backward(
                        g_acc, local, part.to(acc), values.to(acc).contiguous(), per_table, True, need_scores)
                else:
                    gs, gt = _group_gradient_torch(g_acc, local, part, values, need_scores, budget)
                if need_scores:
                    grad_scores[:, k0:k1] = gs
                update(gt, start, stop, k0 == 0)
                del gt
        grad_bias = None
        if ctx.needs_input_grad[3]:
            grad_bias = g.sum(0).to(ctx.bias_dtype)
        if need_scores:
            grad_scores = grad_scores.to(scores.dtype).view(scores.shape)
        return None, grad_scores, None, grad_bias, None, None


class _SparseGather(torch.autograd.Function):
    """sum_k scores[n, k] * tables[rows[n, k]] (rows, scores [N, K] -> [N, D] in the tables' dtype) whose table
    gradient is sparse: the distinct rows hit, ascending, and their gradients (float32 sums, in the tables' dtype).

    A dense table gradient is a tensor the size of the tables (33.5 MB for a d=512 layer of 8-bit hashes), written in
    full, zeros included, by every backward: for a few tokens that write is nearly all of the backward's time. The
    sparse gradient holds at most N * K rows. Optimizers that take sparse gradients: `torch.optim.SparseAdam`,
    `torch.optim.Adagrad`, `torch.optim.SGD` (without weight decay); AdamW refuses them (as for
    `nn.Embedding(sparse=True)`). The fused CPU kernel's `lookup_backward_rows` computes it; elsewhere (another
    device, the torch kernel, float64 tables) PyTorch's `embedding_bag(sparse=True)` does."""

    @staticmethod
    def forward(ctx, rows, scores, tables):
        ctx.save_for_backward(rows, scores, tables)
        per_table = tables.shape[0] // rows.shape[1]
        return _fused_call(torch.ops.memoryformer_cpu.lookup, rows.contiguous(), scores, tables.contiguous(), None,
                           per_table)

    @staticmethod
    def backward(ctx, grad):
        rows, scores, tables = ctx.saved_tensors
        per_table = tables.shape[0] // rows.shape[1]
        need_scores = ctx.needs_input_grad[1]
        grad_scores, hit, values = torch.ops.memoryformer_cpu.lookup_backward_rows(
            grad.contiguous(), rows.contiguous(), scores, tables.contiguous(), per_table, need_scores
        )
        grad_tables = None
        if ctx.needs_input_grad[2]:
            grad_tables = torch.sparse_coo_tensor(hit.unsqueeze(0), values, tables.shape, is_coalesced=True,
                                                  check_invariants=False)  # ascending and distinct as made
        if need_scores:
            grad_scores = grad_scores.to(scores.dtype)
        return None, grad_scores if need_scores else None, grad_tables


class _SparseMemoryLookup(torch.autograd.Function):
    """The whole Memory Layer (hash, score, gather, bias) with a sparse table gradient, on the fused CPU kernel, as one
    autograd node: x [N, K * tau] -> [N, D] in the tables' dtype. For a few tokens the layer's time is mostly
    per-call overhead, and one node instead of three (hash, gather, bias) halves it."""

    @staticmethod
    def forward(ctx, x, tables, bias, hash_bits, l1, temperature):
        ops = torch.ops.memoryformer_cpu
        rows, scores = _fused_call(ops.hash, x, hash_bits, l1, temperature)
        per_table = tables.shape[0] // rows.shape[1]
        ctx.save_for_backward(x, rows, scores, tables)
        ctx.args = (hash_bits, l1, temperature)
        return _fused_call(ops.lookup, rows, scores, tables, bias, per_table)

    @staticmethod
    def backward(ctx, grad):
        ops = torch.ops.memoryformer_cpu
        x, rows, scores, tables = ctx.saved_tensors
        need_x, need_tables, need_bias = ctx.needs_input_grad[:3]
        grad = grad.contiguous()
        per_table = tables.shape[0] // rows.shape[1]
        grad_scores, hit, values = ops.lookup_backward_rows(grad, rows, scores, tables, per_table, need_x)
        grad_x = ops.hash_backward(grad_scores, x, *ctx.args) if need_x else None
        grad_tables = None
        if need_tables:
            grad_tables = torch.sparse_coo_tensor(hit.unsqueeze(0), values, tables.shape, is_coalesced=True,
                                                  check_invariants=False)  # ascending and distinct as made
        grad_bias = grad.sum(0) if need_bias else None
        return grad_x, grad_tables, grad_bias, None, None, None


def _sparse_gather(rows: torch.Tensor, scores: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[N, K] rows and scores -> [N, D] in the tables' dtype, with a sparse table gradient (`_SparseGather`)."""
    if _use_fused(tables) and tables.dtype != torch.float64 and not torch.compiler.is_compiling():
        return _SparseGather.apply(rows, scores, tables)
    return F.embedding_bag(rows, tables, per_sample_weights=scores.to(tables.dtype), mode="sum", sparse=True)


def memory_lookup(
    x: torch.Tensor,
    tables: torch.Tensor,
    bias: torch.Tensor | None,
    hash_bits: int,
    score: str = "paper",
    temperature: float = 1.0,
    sparse: bool = False,
) -> torch.Tensor:
    """The Memory Layer, production path: same maths as `memory_lookup_reference`, no [..., K, d_out] buffer.

    x: [..., K * tau], tables: [K * 2**tau, d_out], bias: [d_out] or None -> [..., d_out].
    sparse: the gradient of `tables` is a sparse COO tensor holding the rows hit and their gradients (coalesced), as
    `nn.Embedding(sparse=True)` gives, instead of a dense tensor the size of the tables (see `_SparseGather`).
    """
    check_hash_parameters(hash_bits, score, temperature)  # before either path (the fused one scores in C++)
    _check_tables(x, tables, hash_bits)
    if bias is not None and (bias.shape != tables.shape[-1:] or not bias.is_floating_point()):
        raise ValueError(
            f"bias must be a floating-point vector of out_features={tables.shape[-1]} values (one per table column); "
            f"got {bias.dtype} of shape {tuple(bias.shape)}. Pass a bias of shape [{tables.shape[-1]}], or None."
        )
    fused = _use_fused(tables)
    if (sparse and fused and x.dtype == tables.dtype and tables.dtype != torch.float64 and tables.requires_grad
            and torch.is_grad_enabled() and not torch.compiler.is_compiling() and table_update_for(tables) is None
            and (bias is None or bias.dtype == tables.dtype)):
        lead = x.shape[:-1]
        y = _SparseMemoryLookup.apply(x.reshape(-1, x.shape[-1]).contiguous(), tables.contiguous(), bias, hash_bits,
                                      score == "l1", float(temperature))
        return y.view(*lead, tables.shape[-1])
    rows, scores = hashed_rows(x, hash_bits, score, temperature, fused=fused)
    return _gather_accumulate(rows, scores, tables, bias, output_dtype(x.dtype, tables.dtype), sparse)


def hashed_rows(x: torch.Tensor, hash_bits: int, score: str = "paper", temperature: float = 1.0,
                fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat table row k * 2**tau + h(z_k) and the score p(z_k) of every chunk: x [..., K * tau] -> (int64
    [..., K], [..., K]). On the CPU with the fused kernel in use (`fused`, default: whether it is), hashing and
    scoring are one C++ pass; otherwise `hash_codes` and `hash_scores`."""
    if x.device.type == "cpu" and (_use_fused(x) if fused is None else fused):
        rows, scores = _fused_call(
            torch.ops.memoryformer_cpu.hash,
            x.reshape(-1, x.shape[-1]).contiguous(), hash_bits, score == "l1", float(temperature)
        )
        return rows.view(*x.shape[:-1], rows.shape[-1]), scores.view(*x.shape[:-1], scores.shape[-1])
    return table_rows(hash_codes(x, hash_bits), hash_bits), hash_scores(x, hash_bits, score, temperature)


_LINEAR_ROWS_MAX = 4  # kLinearMaxRows of the C++ kernel (its op linear_rows_max() says the same; a test checks)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; the fused kernel's few-row pass where it applies: at most `linear_rows_max()`
    rows (tokens) on the CPU, x, weight and bias all float32 or all bfloat16 (a bfloat16 weight is widened in
    registers and summed in float32, the output rounded once, as F.linear), with no gradient to record, i.e. the LM
    head while decoding.

    That pass reads each weight row once for all rows, over threads and with enough independent FMA chains to stream
    the weight at memory speed; BLAS's GEMV (what F.linear calls for one row) ran at about a third of that speed on
    the AMD EPYC measured (see benchmarks/). Same maths, float32 accumulation in another order.
    """
    rows = x.numel() // max(1, x.shape[-1])
    records_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    if (
        x.dtype in (torch.float32, torch.bfloat16)
        and weight.dtype == x.dtype
        and (bias is None or bias.dtype == x.dtype)
        and 1 <= rows <= _LINEAR_ROWS_MAX
        and x.shape[-1] == weight.shape[-1]
        and weight.is_contiguous()
        and not records_grad
        and _use_fused(weight)
    ):
        y = _fused_call(torch.ops.memoryformer_cpu.linear_rows, x.reshape(rows, x.shape[-1]).contiguous(), weight, bias)
        return y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


# ---------------------------------------------------------------------------------------------------------------------
# The fused CPU kernels (C++ in csrc/memoryformer_cpu.cpp, carried as the string CPP_SOURCE of memory_kernel_source.py),
# built with torch.utils.cpp_extension at first use and cached in the extension build root (TORCH_EXTENSIONS_DIR,
# default ~/.cache/torch_extensions/py<version>_cpu). Without a compiler the PyTorch path runs instead.
#
# Flags: -O3 -march=$MEMORYFORMER_KERNEL_MARCH (default native) -fopenmp. The extension name hashes the source, the
# torch version, the compiler (first line of `$CXX --version`), the flags and the CPU model. A failed compile is
# remembered: its compiler output goes to <build root>/<extension name>.failed.log, and later processes that would
# build the same name do not retry while that file exists (delete it to retry). MEMORYFORMER_REQUIRE_FUSED=1 makes a
# kernel that cannot be built an error instead of a fallback, and always retries a remembered failure.

OPS_NAMESPACE = "memoryformer_cpu"  # the default of the C++ macro MEMORYFORMER_OPS
_fused_state: bool | None = None  # None: not tried yet
_fused_error: str | None = None  # why it is not available, repeated under MEMORYFORMER_REQUIRE_FUSED=1


class KernelBuildError(RuntimeError):
    """The fused kernel could not be built. `first_error`: the compiler's first error line; `log_path`: the file holding
    the full compiler output (None when nothing was compiled, e.g. no compiler); `output`: that output."""

    def __init__(self, message: str, first_error: str = "", log_path: str | None = None, output: str = ""):
        super().__init__(message)
        self.first_error = first_error
        self.log_path = log_path
        self.output = output


def fused_required() -> bool:
    """Whether MEMORYFORMER_REQUIRE_FUSED is set (to anything but 0/false/no): then a fused kernel that cannot be built
    is an error instead of a fallback to the PyTorch path, and a remembered build failure is retried."""
    return os.environ.get("MEMORYFORMER_REQUIRE_FUSED", "").strip().lower() not in ("", "0", "false", "no")


def _use_fused(tables: torch.Tensor) -> bool:
    if tables.device.type != "cpu":
        return False
    if torch.compiler.is_compiling():  # no building or file checks while tracing: use what is already loaded
        return _fused_state is True and _kernel_choice in ("auto", "fused")
    return get_kernel() == "fused"


def load_fused_kernels() -> bool:
    """Build (first time) and load the fused CPU kernels; return whether they are usable.

    When they cannot be built, warns once (quoting the compiler's first error line and the log of its full output) and
    returns False, so that Memory Layers run the PyTorch path; with MEMORYFORMER_REQUIRE_FUSED=1 raises a RuntimeError
    instead, on every call.
    """
    global _fused_state, _fused_error
    if _fused_state is None:
        _check_pool_setting()
        march = _kernel_march()
        try:
            _build_and_register(march=march)
            _fused_state = True
        except Exception as exc:  # a compile error, a missing compiler or ninja: fall back, say so once
            _fused_state = False
            _fused_error = str(exc) if isinstance(exc, KernelBuildError) else (
                f"MemoryFormer's fused CPU kernel could not be built or loaded ({type(exc).__name__}: {exc})."
            )
            if fused_required():
                raise RuntimeError(f"{_fused_error} [MEMORYFORMER_REQUIRE_FUSED=1: no fallback]") from exc
            warnings.warn(
                f"{_fused_error} Memory Layers use the plain PyTorch path (correct, slower).",
                RuntimeWarning,
                stacklevel=3,
            )
    if _fused_state is False and fused_required():
        raise RuntimeError(f"{_fused_error} [MEMORYFORMER_REQUIRE_FUSED=1: no fallback]")
    return _fused_state


def _check_pool_setting() -> None:
    """MEMORYFORMER_GRAD_POOL_MB is read by the C++ kernel, which cannot report a typo: check it here."""
    value = os.environ.get("MEMORYFORMER_GRAD_POOL_MB")
    if value is not None and not value.strip().isdigit():
        raise ValueError(
            f"MEMORYFORMER_GRAD_POOL_MB={value!r} is not a whole number of megabytes; set it to e.g. 16384 (the "
            "default), or 0 to turn the table-gradient pool off."
        )


_MARCH_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


def _kernel_march() -> str:
    """MEMORYFORMER_KERNEL_MARCH (default "native"), checked: it goes into the ninja file unquoted."""
    march = os.environ.get("MEMORYFORMER_KERNEL_MARCH", "native")
    if not _MARCH_PATTERN.fullmatch(march):
        raise ValueError(
            f"MEMORYFORMER_KERNEL_MARCH={march!r} is not a -march value; use e.g. native (the default), x86-64-v3 or "
            "armv8.2-a."
        )
    return march


def _kernel_flags(march: str, namespace: str | None = None) -> list[str]:
    if not _MARCH_PATTERN.fullmatch(march):
        raise ValueError(f"{march!r} is not a -march value (e.g. native, x86-64-v3, armv8.2-a).")
    # -fno-trapping-math: the kernel never reads floating-point exception flags. Without it GCC vectorises a
    # compare-and-select (exp_nonpos's clamp) only through AVX-512's mask registers: on AVX2 and NEON the hash's loops
    # stayed scalar (4.2 ms instead of 0.69 ms for 2048 x 512 values, 2 threads, AVX2-only AMD EPYC Zen 3).
    # tests/kernel/test_kernel_builds.py checks that those loops vectorise for each target.
    flags = ["-O3", f"-march={march}", "-fopenmp", "-fno-trapping-math"]
    if namespace is not None:
        flags.append(f"-DMEMORYFORMER_OPS={namespace}")
    return flags


def _ops_loaded(namespace: str) -> bool:
    return hasattr(getattr(torch.ops, namespace), "lookup")


def _build_and_register(source: str | None = None, march: str | None = None) -> None:
    """Build and load the production kernel (ops in torch.ops.memoryformer_cpu), then register its autograd and fake
    implementations. `source` replaces CPP_SOURCE: the tests build broken sources through it."""
    if source is None:
        if _ops_loaded(OPS_NAMESPACE):
            return  # already loaded in this process (e.g. by another copy of this module)
        from .memory_kernel_source import CPP_SOURCE

        source = CPP_SOURCE
    flags = _kernel_flags(_kernel_march() if march is None else march)
    name = _extension_name(OPS_NAMESPACE, source, flags)
    _compile(name, source, flags, trust_remembered_failure=not fused_required(), announce=True)
    _register_autograd_and_fake()


def build_kernel_variant(march: str, load: bool = True) -> str:
    """Build the kernel source for `-march=<march>` with its ops in their own namespace and return that namespace.

    Flags: -O3 -march=<march> -fopenmp -DMEMORYFORMER_OPS=memoryformer_cpu_<march, non-alphanumerics as _>, under
    an extension name of its own (cached like the production kernel). With `load` (default) the library is loaded
    into this process, its ops under torch.ops.<namespace> (no autograd or fake registrations): check
    `cpu_can_run(march)` first, as code for a newer CPU may not even load. With load=False the source is only compiled
    to an object file (no link, nothing loaded, nothing cached). A remembered failure is always retried. Raises a
    KernelBuildError (a RuntimeError) quoting the compiler's first error line and the log of its full output.
    """
    from .memory_kernel_source import CPP_SOURCE

    namespace = f"{OPS_NAMESPACE}_{re.sub(r'[^0-9A-Za-z]+', '_', march).strip('_')}"
    flags = _kernel_flags(march, namespace)
    if "MEMORYFORMER_OPS" not in CPP_SOURCE:
        raise RuntimeError(
            "The kernel source does not take its op namespace from the MEMORYFORMER_OPS macro: a variant build would "
            f"register its ops as {OPS_NAMESPACE}, not {namespace}."
        )
    if not load:
        _check_compiles(_compiler(), flags, CPP_SOURCE, ["-c", "-o", os.devnull])
        return namespace
    if _ops_loaded(namespace):
        return namespace
    _compile(_extension_name(namespace, CPP_SOURCE, flags), CPP_SOURCE, flags, trust_remembered_failure=False)
    if not _ops_loaded(namespace):
        raise RuntimeError(f"The -march={march} build loaded but defines no torch.ops.{namespace}.lookup.")
    return namespace


def compile_kernel_syntax(compiler: str, flags: list[str], source: str | None = None) -> None:
    """Check that `compiler` accepts the kernel source with `flags` (e.g. a cross compiler: "aarch64-linux-gnu-g++",
    ["-march=armv8.2-a", "-fopenmp"]): `<compiler> -fsyntax-only -std=c++20 <flags> <torch includes> -x c++ -`, the
    source (with its #line directive) on stdin. -std=c++20 is what torch.utils.cpp_extension builds with.
    Raises a KernelBuildError quoting the first error line (its `output` holds all of it)."""
    if source is None:
        from .memory_kernel_source import CPP_SOURCE

        source = CPP_SOURCE
    _check_compiles(compiler, list(flags), source, ["-fsyntax-only"])


def _check_compiles(compiler: str, flags: list[str], source: str, mode: list[str]) -> None:
    from torch.utils.cpp_extension import include_paths

    command = [*shlex.split(compiler), *mode, "-std=c++20", "-fPIC", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    command += ["-DTORCH_EXTENSION_NAME=memoryformer_cpu_check", *flags]
    for include in include_paths("cpu"):
        command += ["-isystem", include]
    command += ["-x", "c++", "-"]
    try:
        result = subprocess.run(command, input=source, check=False, capture_output=True, text=True, errors="replace")
    except FileNotFoundError as exc:
        raise KernelBuildError(f"The compiler `{compiler}` was not found.") from exc
    if result.returncode != 0:
        output = result.stdout + result.stderr
        first = _first_error_line(output)
        message = f"`{compiler}` {' '.join(flags)} rejects the kernel source: {first}"
        raise KernelBuildError(message, first, None, output)


_X86_64_V2 = ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3")
_X86_64_V3 = _X86_64_V2 + ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "abm")  # abm: lzcnt
_X86_64_LEVELS = {
    "x86-64": (),
    "x86-64-v2": _X86_64_V2,
    "x86-64-v3": _X86_64_V3,
    "x86-64-v4": _X86_64_V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
}


def cpu_can_run(march: str) -> bool:
    """Whether this CPU runs code built with -march=<march>: "native"; x86-64 levels by the /proc/cpuinfo flags
    ("x86-64" on any x86_64, "x86-64-v2"/"-v3"/"-v4" when every flag of the level is listed); "armv8-a" on aarch64."""
    machine = platform.machine().lower()
    if march == "native":
        return True
    if march == "armv8-a":
        return machine in ("aarch64", "arm64")
    if march not in _X86_64_LEVELS:
        raise ValueError(f"cpu_can_run knows native, armv8-a and {', '.join(_X86_64_LEVELS)}; got {march!r}.")
    if machine not in ("x86_64", "amd64"):
        return False
    flags = _cpu_flags()
    return all(flag in flags or (flag == "abm" and "lzcnt" in flags) for flag in _X86_64_LEVELS[march])


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags") or line.startswith("Features"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _compiler() -> str:
    return os.environ.get("CXX", "c++")  # what torch.utils.cpp_extension compiles with


@functools.cache
def _compiler_identity(compiler: str) -> str:
    """First line of `<compiler> --version`; a KernelBuildError when there is no such compiler."""
    try:
        result = subprocess.run([*shlex.split(compiler), "--version"], check=False, capture_output=True, text=True,
                                timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(
            f"MemoryFormer's fused CPU kernel cannot be built: the C++ compiler `{compiler}` was not found or does not "
            f"run ({exc}). Install gcc/g++ (and `pip install ninja`) to enable it."
        ) from exc
    lines = (result.stdout or result.stderr).splitlines()
    return lines[0].strip() if lines else compiler


def _extension_name(prefix: str, source: str, flags: list[str]) -> str:
    """A name per source, flags, machine, compiler and torch installation: two venvs with the same torch version
    have their own build folders (each build.ninja names its venv's torch headers, so a shared folder would be
    rebuilt every time the other venv used it)."""
    torch_installation = os.path.realpath(os.path.dirname(torch.__file__))
    key = "\0".join(
        [source, torch.__version__, torch_installation, platform.machine(), _cpu_model(),
         _compiler_identity(_compiler()), *flags]
    )
    return f"{prefix}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _build_root() -> str:
    """The folder torch.utils.cpp_extension builds extensions in (each in a subfolder named after it)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:
        return root
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return os.path.join(get_default_build_root(), f"{python}_{accelerator}")


def failure_log_path(name: str) -> str:
    """Where the compiler output of a failed build of extension `name` is kept (its presence stops retries)."""
    return os.path.join(_build_root(), f"{name}.failed.log")


def _first_error_line(output: str) -> str:
    lines = [line.strip() for line in output.splitlines()]
    for line in lines:
        if "error:" in line:
            return line
    return next((line for line in reversed(lines) if line), "(no compiler output)")


def _compiler_output(exc: BaseException) -> str | None:
    """The compiler output of a failed load_inline build (in the CalledProcessError it raises from); None for other
    failures (e.g. loading the library)."""
    cause = exc.__cause__
    if isinstance(cause, subprocess.CalledProcessError):
        output = cause.output or b""
        return output.decode(errors="replace") if isinstance(output, bytes) else str(output)
    if isinstance(exc, RuntimeError) and str(exc).startswith("Error building extension"):
        return str(exc)
    return None


def _failure_message(first_error: str, log_path: str, flags: list[str], remembered: bool) -> str:
    what = (
        "failed to compile in an earlier run with the same source, compiler and flags (not retried)"
        if remembered
        else "failed to compile"
    )
    return (
        f"MemoryFormer's fused CPU kernel {what} [{_compiler()} {' '.join(flags)}]: {first_error} -- full compiler "
        f"output in {log_path}; delete that file to retry the build (MEMORYFORMER_REQUIRE_FUSED=1 always retries)."
    )


def _remembered_failure(log_path: str, flags: list[str]) -> KernelBuildError:
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            output = f.read()
    except OSError:
        output = ""
    first = _first_error_line(output)
    return KernelBuildError(_failure_message(first, log_path, flags, remembered=True), first, log_path, output)


def _compile(name: str, source: str, flags: list[str], trust_remembered_failure: bool, announce: bool = False) -> None:
    """load_inline(name, source, flags), remembering a failed compile in failure_log_path(name)."""
    from torch.utils.cpp_extension import load_inline

    if shutil.which("ninja") is None and not _ninja_in_venv():
        raise KernelBuildError(
            "MemoryFormer's fused CPU kernel cannot be built: `ninja` was not found on PATH. `pip install ninja` "
            "(and have gcc/g++) to enable it."
        )
    log_path = failure_log_path(name)
    if trust_remembered_failure and os.path.exists(log_path):
        raise _remembered_failure(log_path, flags)
    if announce:
        print("MemoryFormer: loading the fused CPU kernel (compiled once, then cached)...", file=sys.stderr, flush=True)
    try:
        # The source includes the ATen and torch/library.h headers it needs: no implicit <torch/extension.h> (nor the
        # Python headers behind it), which cuts about a third of the compile time.
        load_inline(
            name=name,
            cpp_sources=[source],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
            no_implicit_headers=True,
        )
    except Exception as exc:
        output = _compiler_output(exc)
        if output is None:
            if os.path.exists(log_path):  # another process's build of the same name failed while this one waited
                raise _remembered_failure(log_path, flags) from exc
            raise
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        with open(log_path, "w", encoding="utf-8") as f:
            f.write(f"# MemoryFormer fused kernel build {name}: {_compiler_identity(_compiler())}\n")
            f.write(f"# flags: {' '.join(flags)}; torch {torch.__version__}\n")
            f.write("# While this file exists, processes that would build the same extension do not retry.\n")
            f.write("# Delete it to retry.\n")
            f.write(output)
        first = _first_error_line(output)
        message = _failure_message(first, log_path, flags, remembered=False)
        raise KernelBuildError(message, first, log_path, output) from exc
    if os.path.exists(log_path):
        os.remove(log_path)  # an earlier failure of this exact build is gone


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

    @torch.library.register_fake("memoryformer_cpu::int8_lookup")
    def _int8_lookup_fake(rows, scores, packed, bias, rows_per_table):
        return packed.new_empty((rows.shape[0], packed.shape[1] - 8), dtype=torch.float32)

    @torch.library.register_fake("memoryformer_cpu::linear_rows")
    def _linear_rows_fake(x, weight, bias):
        return x.new_empty((x.shape[0], weight.shape[0]))

    @torch.library.register_fake("memoryformer_cpu::lookup_backward_rows")
    def _lookup_backward_rows_fake(grad_out, rows, scores, tables, rows_per_table, need_scores):
        hit = torch.library.get_ctx().new_dynamic_size()
        grad_scores = scores.new_empty(rows.shape, dtype=torch.float32) if need_scores else None
        return grad_scores, rows.new_empty((hit,)), tables.new_empty((hit, tables.shape[1]))

    @torch.library.register_fake("memoryformer_cpu::lookup_backward")
    def _lookup_backward_fake(grad_out, rows, scores, tables, rows_per_table, need_tables, need_scores):
        grad_scores = scores.new_empty(rows.shape, dtype=_acc_dtype(tables.dtype)) if need_scores else None
        return grad_scores, (torch.empty_like(tables) if need_tables else None)


# ---------------------------------------------------------------------------------------------------------------------
# The LM head and its loss in one chunked pass. The head's logits over the vocabulary, their log-softmax and its
# gradient are the largest tensors of a training step ([tokens, vocab] float32 each: 824 MB for 8 x 512 tokens of
# MF-tiny's 50304-word vocabulary). `linear_cross_entropy` never makes them: it takes `chunk_tokens` tokens at a
# time, computes their logits, their log-sum-exp and loss, and at once the gradient of those logits,
# (softmax - onehot) / denominator, which it turns into the chunk's hidden-state gradient and adds into the
# weight's (and bias's) gradient. The backward pass then only scales these stored gradients by the loss's incoming
# gradient. Same semantics as transformers' `ForCausalLMLoss`.
#
# Chunk size (LINEAR_CE_CHUNK_TOKENS, the default of the config's `loss_chunk_tokens`), measured on [4096, 512] x
# [50304, 512] float32, loss forward + backward, one thread, 2-vCPU AMD EPYC Zen 4 KVM guest (AVX-512, L2 1 MB/core,
# L3 32 MB), best of 2 runs, peak RSS above the inputs (gradients included): 256 tokens 7.41 s / 168 MB, 512 7.04 s /
# 218 MB, 1024 7.15 s / 316 MB, 2048 7.20 s / 513 MB, 4096 (one chunk) 7.42 s / 906 MB; the full-logits
# `F.cross_entropy(F.linear(h, W).float(), y)` 8.36 s / 2368 MB. The three matmuls alone take about 7.1 s, so every
# size from 512 to 2048 is matmul-bound (the spread is within the noise of a shared host); 512 needs the least memory.

LINEAR_CE_CHUNK_TOKENS = 512


def _softmax_block_rows(vocab: int, itemsize: int) -> int:
    """Rows of a chunk's logits that the softmax steps take at a time: a quarter of the last-level cache (8 MB when
    the fused kernel does not report it), so that after the first read of a block its max, exp, sum and scaling run
    from cache instead of as five passes over the whole [chunk, V] block from memory (41 rows of a 50304-token
    vocabulary with a 32 MB L3: 32 ms to 24 ms per 512-token chunk on the AMD EPYC, same values to the bit)."""
    return max(1, cache_share_bytes() // max(1, vocab * itemsize))


def _add_widened(total: torch.Tensor, part: torch.Tensor) -> None:
    """total += part for a 16-bit `part` and a float32 `total` of the same shape, by blocks of rows widened into a
    buffer of a quarter of the last-level cache. `total += part` widens through a fresh temporary the size of `part`
    (its page faults every time): 38.5 ms for the [50304, 512] weight gradient of a bf16 LM head against 8 ms here
    (AMD EPYC Zen 4, 2 threads)."""
    rows = max(1, cache_share_bytes() // max(1, part.shape[1] * total.element_size()))
    buf = torch.empty((min(rows, part.shape[0]), part.shape[1]), dtype=total.dtype, device=total.device)
    for r0 in range(0, part.shape[0], rows):
        r1 = min(r0 + rows, part.shape[0])
        total[r0:r1].add_(buf[: r1 - r0].copy_(part[r0:r1]))


def _linear_cross_entropy_pass(hidden, weight, bias, labels, chunk_tokens, ignore_index, num_items_in_batch,
                               need_hidden, need_weight, need_bias):
    """The loss over hidden [N, d] with weight [V, d] (bias [V]) and labels [N] (already shifted), and, for the inputs
    asked for, its gradients: (loss, grad_hidden, grad_weight, grad_bias). grad_weight and grad_bias are in the
    accumulation dtype (float32, float64 for float64 inputs); the caller casts them. The matmuls run in the inputs'
    dtype; the logits are upcast to float32 per chunk, as `ForCausalLMLoss` does (`logits.float()`)."""
    n, width = hidden.shape
    vocab = weight.shape[0]
    acc_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    valid = labels != ignore_index
    targets = torch.where(valid, labels, 0).unsqueeze(1)
    denominator = valid.sum() if num_items_in_batch is None else num_items_in_batch
    if torch.is_tensor(denominator):
        denominator = denominator.to(hidden.device)
    scale = 1.0 / torch.as_tensor(denominator, dtype=acc_dtype, device=hidden.device)
    need_logit_grad = need_hidden or need_weight or need_bias

    # Buffers reused by every chunk (a fresh [chunk, V] allocation per chunk costs its page faults each time).
    rows = min(chunk_tokens, n)
    logits_buf = hidden.new_empty((rows, vocab), dtype=acc_dtype)
    narrow_buf = hidden.new_empty((rows, vocab)) if hidden.dtype != acc_dtype else None  # bf16/fp16 matmul results
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    grad_weight = hidden.new_empty((vocab, width), dtype=acc_dtype) if need_weight else None  # the first chunk sets it
    weight_buf = torch.empty_like(weight) if need_weight and weight.dtype != acc_dtype else None
    grad_bias = hidden.new_zeros((vocab,), dtype=acc_dtype) if need_bias else None
    loss_sum = hidden.new_zeros((), dtype=acc_dtype)
    weight_t = weight.t()
    block = _softmax_block_rows(vocab, logits_buf.element_size())
    if need_weight and n == 0:
        grad_weight.zero_()
    for start in range(0, n, chunk_tokens):
        end = min(start + chunk_tokens, n)
        h = hidden[start:end]
        logits = logits_buf[: end - start]
        product = logits if narrow_buf is None else narrow_buf[: end - start]
        if bias is None:
            torch.mm(h, weight_t, out=product)
        else:
            torch.addmm(bias, h, weight_t, out=product)
        if narrow_buf is not None:
            logits.copy_(product)  # logits.float()
        target, kept = targets[start:end], valid[start:end]
        target_logit = logits.gather(1, target).squeeze(1)
        log_sum_exp = torch.empty_like(target_logit)
        # Block by block of rows, in place (the chunk's logits are not needed any more): exp(logits - row max), then,
        # for the gradient, d loss / d logits = (softmax - onehot) * scale on the kept tokens, 0 on the ignored ones
        # (also when no token is kept and scale is inf).
        for r0 in range(0, end - start, block):
            rows_block = logits[r0 : r0 + block]
            row_max = rows_block.amax(1, keepdim=True)
            sum_exp = rows_block.sub_(row_max).exp_().sum(1)
            torch.add(sum_exp.log(), row_max.squeeze(1), out=log_sum_exp[r0 : r0 + block])
            if need_logit_grad:
                rows_block.mul_(torch.where(kept[r0 : r0 + block], scale / sum_exp, 0).unsqueeze(1))
        token_loss = log_sum_exp.sub_(target_logit)  # log-sum-exp - target logit
        loss_sum += torch.where(kept, token_loss, 0).sum()
        if not need_logit_grad:
            continue
        grad_logits = logits
        grad_logits.scatter_add_(1, target, torch.where(kept, -scale, 0).unsqueeze(1).to(acc_dtype))
        if need_bias:
            grad_bias += grad_logits.sum(0)
        if narrow_buf is not None:
            grad_logits = product.copy_(grad_logits)  # back to the inputs' dtype for the matmuls, as autograd would
        if need_hidden:
            torch.mm(grad_logits, weight, out=grad_hidden[start:end])
        if need_weight:
            if weight_buf is None:
                if start == 0:
                    torch.mm(grad_logits.t(), h, out=grad_weight)
                else:
                    grad_weight.addmm_(grad_logits.t(), h)
            else:  # bf16/fp16 products summed over the chunks in float32
                product_weight = torch.mm(grad_logits.t(), h, out=weight_buf)
                if start == 0:
                    grad_weight.copy_(product_weight)
                else:
                    _add_widened(grad_weight, product_weight)
    return loss_sum / denominator, grad_hidden, grad_weight, grad_bias


class _LinearCrossEntropy(torch.autograd.Function):
    """The chunked loss as an autograd node. The forward computes the gradients of the inputs that need one and hands
    them to the backward, which scales them by the loss's gradient (a scalar) and gives them away (so that autograd
    can keep them as `.grad` without a copy): one backward pass per forward, no double backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_tokens, ignore_index, num_items_in_batch):
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        loss, *grads = _linear_cross_entropy_pass(hidden, weight, bias, labels, chunk_tokens, ignore_index,
                                                  num_items_in_batch, need_hidden, need_weight, need_bias)
        ctx.grads = grads
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # Grad mode is on in a backward pass only under create_graph=True, i.e. when a second derivative is wanted:
        # refuse it here, where the message can say why (once_differentiable would only leave gradients without a
        # grad_fn, and a puzzling error later).
        if torch.is_grad_enabled():
            raise RuntimeError(
                "linear_cross_entropy does not support double backward (create_graph=True): its gradients are computed "
                "in the forward pass, not as a graph that could be differentiated again. Use the full-logits loss "
                "(loss_chunk_tokens=0 in the model config) for higher-order gradients."
            )
        if ctx.grads is None:
            raise RuntimeError(
                "linear_cross_entropy's gradients were computed in its forward pass and already handed to an earlier "
                "backward pass; it supports one backward pass per forward (no retain_graph=True reuse). Run the "
                "forward again, or use the full-logits loss (loss_chunk_tokens=0 in the model config)."
            )
        grad_hidden, grad_weight, grad_bias = ctx.grads
        ctx.grads = None
        if grad_loss.device.type != "cpu" or float(grad_loss) != 1.0:
            grads = [g.mul_(grad_loss.to(g.dtype)) if g is not None else None
                     for g in (grad_hidden, grad_weight, grad_bias)]
            grad_hidden, grad_weight, grad_bias = grads
        weight_dtype, bias_dtype = ctx.dtypes
        grad_weight = None if grad_weight is None else grad_weight.to(weight_dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias_dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         labels: torch.Tensor | None, *, chunk_tokens: int = LINEAR_CE_CHUNK_TOKENS,
                         ignore_index: int = -100, num_items_in_batch=None,
                         shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """`ForCausalLMLoss(F.linear(hidden, weight, bias), labels, ...)` without the [tokens, vocab] logits: the scalar
    next-token cross-entropy of hidden [..., d] under the head weight [V, d] (bias [V] or None).

    labels [...] (hidden's leading shape) are shifted inside, as ForCausalLMLoss does (position t predicts labels
    t + 1; the last position is ignored), unless `shift_labels` (already shifted) is given instead. Tokens whose label
    is `ignore_index` do not count. The loss is the mean over the counted tokens (nan when there is none, as
    `F.cross_entropy`), or their sum divided by `num_items_in_batch` when it is given (what the Trainer passes).

    Work goes `chunk_tokens` tokens at a time; when a gradient is recorded for hidden, weight or bias, each chunk's
    logit gradient is turned into the input gradients at once, and the backward only scales them. The matmuls run in
    the inputs' dtype (under autocast, in its dtype); logits, log-sum-exp and loss in float32 (float64 inputs stay
    float64). One backward pass per forward; no double backward.
    """
    if not (isinstance(chunk_tokens, int) and not isinstance(chunk_tokens, bool) and chunk_tokens > 0):
        raise ValueError(f"chunk_tokens must be a positive integer (tokens per chunk), got {chunk_tokens!r}. "
                         f"Use e.g. {LINEAR_CE_CHUNK_TOKENS}.")
    if shift_labels is None:
        if labels is None:
            raise ValueError("linear_cross_entropy needs labels (or shift_labels).")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if weight.dim() != 2 or hidden.shape[-1:] != weight.shape[1:]:
        raise ValueError(f"weight must be [vocab, d] with d = hidden's last dimension; got weight of shape "
                         f"{tuple(weight.shape)} for hidden of shape {tuple(hidden.shape)}.")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be a vector of vocab={weight.shape[0]} values or None, got shape "
                         f"{tuple(bias.shape)}.")
    if shift_labels.numel() * hidden.shape[-1] != hidden.numel():
        raise ValueError(f"labels must hold one token id per position of hidden {tuple(hidden.shape[:-1])}; got "
                         f"shape {tuple(shift_labels.shape)}.")
    hidden = hidden.reshape(-1, hidden.shape[-1])
    shift_labels = shift_labels.reshape(-1).to(device=hidden.device, dtype=torch.long)
    vocab = weight.shape[0]
    out_of_range = (shift_labels != ignore_index) & ((shift_labels < 0) | (shift_labels >= vocab))
    if bool(out_of_range.any()):
        bad = shift_labels[out_of_range][0].item()
        raise ValueError(f"labels hold token id {bad}, outside [0, vocab={vocab}) and not ignore_index="
                         f"{ignore_index}. Use token ids of the model's vocabulary, and {ignore_index} for positions "
                         "that should not count.")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):  # what autocast would do for F.linear: the matmuls in its dtype
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight, bias = (t.to(dtype) if t is not None and t.dtype in (torch.float32, torch.float16,
                                torch.bfloat16) else t for t in (hidden, weight, bias))
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError(f"hidden, weight and bias must share a dtype; got {hidden.dtype}, {weight.dtype} and "
                         f"{None if bias is None else bias.dtype}. Cast them to one dtype (or run under autocast).")
    tensors = (hidden, weight, bias)
    with torch.autocast(device_type, enabled=False):
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
            return _LinearCrossEntropy.apply(hidden, weight, bias, shift_labels, chunk_tokens, ignore_index,
                                             num_items_in_batch)
        loss, *_ = _linear_cross_entropy_pass(hidden, weight, bias, shift_labels, chunk_tokens, ignore_index,
                                              num_items_in_batch, False, False, False)
        return loss
