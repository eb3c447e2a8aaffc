"""The Memory Layer, production path: `memory_lookup` (hash, score, gather in one call), `memory_lookup_hashed`
(the gather for precomputed hashes), `hashed_rows`, and `few_rows_linear` (the LM head while decoding).

Same maths as `memory_math.memory_lookup_reference` (the equations, and the oracle), without its [..., K, d_out]
buffer. Each call runs on the kernels `memory_kernels.backend_for` picks: the fused CPU kernels or the PyTorch ones.

The op layer, one job per module (all siblings in the model folder, so that remote code carries them):
    memory_math.py            the equations: hashing, scores, table rows, the float64-checked reference
    memory_op_library.py      the ops: schemas, fakes, autograd (torch.library)
    memory_backend_torch.py   the PyTorch kernels (every device; the ops' default)
    memory_backend_cpu.py     the fused CPU kernels: build, cache and load of csrc/cpu/
    memory_kernels.py         the kernel choice (MEMORYFORMER_KERNEL) and the kernel status
    memory_table_updates.py   table updates inside the backward pass (the fused table optimizers)
    memory_loss.py            the LM head and its loss in one chunked pass
This module also re-exports their public names, so `memory_ops.X` keeps working for every X it ever offered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .memory_backend_triton import FusedMemoryLookup
from .memory_backend_cpu import (  # noqa: F401 (re-exported)
    KernelBuildError,
    build_kernel_variant,
    compile_kernel_syntax,
    failure_log_path,
    fused_required,
    load_fused_kernels,
)
from .memory_kernels import (  # noqa: F401 (re-exported)
    _CPU_KEYS,
    KERNELS,
    KernelStatus,
    available_kernels,
    backend_for,
    dispatcher_watched,
    fused_call,
    fused_ops,
    get_kernel,
    kernel_status,
    lookup_strategies,
    release_gradient_memory,
    set_kernel,
    use_kernel,
    uses_fused,
)
from .memory_loss import LINEAR_CE_CHUNK_TOKENS, linear_cross_entropy  # noqa: F401 (re-exported)
from .memory_math import (  # noqa: F401 (re-exported)
    HASH_SCORES,
    check_hash_parameters,
    check_tables,
    hash_codes,
    hash_scores,
    memory_lookup_reference,
    num_tables_for,
    output_dtype,
    table_rows,
)
from .memory_table_updates import TABLE_UPDATE_ATTR, LookupUpdatingTables, table_update_for, update_group_bytes  # noqa: F401


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
        return LookupUpdatingTables.apply(rows, scores, tables, bias, dtype, update, _gather_accumulate)
    lead = rows.shape[:-1]
    mixed = dtype != tables.dtype
    if sparse and tables.requires_grad and torch.is_grad_enabled():
        y = _sparse_gather(rows.reshape(-1, rows.shape[-1]), scores.reshape(-1, scores.shape[-1]), tables)
        if mixed:
            y = y.to(dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*lead, tables.shape[-1])
    num_tables = rows.shape[-1]
    y = backend_for(tables).lookup(
        rows.reshape(-1, num_tables).contiguous(),
        scores.reshape(-1, num_tables),
        tables.contiguous(),
        None if mixed else bias,
        tables.shape[0] // num_tables,
    )
    if mixed:
        y = y.to(dtype)
        if bias is not None:
            y = y + bias
    return y.reshape(*lead, tables.shape[-1])


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
        return fused_call(fused_ops().lookup, rows.contiguous(), scores, tables.contiguous(), None, per_table)

    @staticmethod
    def backward(ctx, grad):
        rows, scores, tables = ctx.saved_tensors
        per_table = tables.shape[0] // rows.shape[1]
        need_scores = ctx.needs_input_grad[1]
        grad_scores, hit, values = fused_ops().lookup_backward_rows(
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
    def forward(ctx, x, tables, bias, hash_bits, score, temperature):
        ops = fused_ops()
        rows, scores = fused_call(ops.hash, x, hash_bits, score, temperature)
        per_table = tables.shape[0] // rows.shape[1]
        ctx.save_for_backward(x, rows, scores, tables)
        ctx.args = (hash_bits, score, temperature)
        return fused_call(ops.lookup, rows, scores, tables, bias, per_table)

    @staticmethod
    def backward(ctx, grad):
        ops = fused_ops()
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
    if uses_fused(tables) and tables.dtype != torch.float64 and not torch.compiler.is_compiling():
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
    check_tables(x, tables, hash_bits)
    if bias is not None and (bias.shape != tables.shape[-1:] or not bias.is_floating_point()):
        raise ValueError(
            f"bias must be a floating-point vector of out_features={tables.shape[-1]} values (one per table column); "
            f"got {bias.dtype} of shape {tuple(bias.shape)}. Pass a bias of shape [{tables.shape[-1]}], or None."
        )
    kernels = backend_for(tables)
    if (sparse and kernels.name == "fused" and x.dtype == tables.dtype and tables.dtype != torch.float64 and tables.requires_grad
            and torch.is_grad_enabled() and not torch.compiler.is_compiling() and table_update_for(tables) is None
            and (bias is None or bias.dtype == tables.dtype)):
        lead = x.shape[:-1]
        y = _SparseMemoryLookup.apply(x.reshape(-1, x.shape[-1]).contiguous(), tables.contiguous(), bias, hash_bits,
                                      score, float(temperature))
        return y.view(*lead, tables.shape[-1])
    if (kernels.name == "triton" and not sparse and x.dtype == tables.dtype != torch.float64
            and (bias is None or bias.dtype == tables.dtype) and table_update_for(tables) is None
            and not torch.compiler.is_compiling()):
        lead = x.shape[:-1]  # hash, score and gather in one Triton kernel
        y = FusedMemoryLookup.apply(x.reshape(-1, x.shape[-1]), tables, bias, hash_bits, score, float(temperature))
        return y.view(*lead, tables.shape[-1])
    rows, scores = hashed_rows(x, hash_bits, score, temperature, kernels=kernels)
    return _gather_accumulate(rows, scores, tables, bias, output_dtype(x.dtype, tables.dtype), sparse)


def inference_lookup(x: torch.Tensor, tables: torch.Tensor, bias: torch.Tensor | None, hash_bits: int, score: str,
                     temperature: float) -> torch.Tensor | None:
    """`memory_lookup` for a Memory Layer's own checked arguments when nothing is recorded (generation), straight to
    the fused kernel's hash and lookup ops: the same two ops on the same operands, without the checks and dispatch of
    the general path, which cost about twice the ops themselves for one token (70 of 100 us per layer on MF-tiny's
    Q/K/V layer, most of a decode step's time in a deep model). None where it does not apply (gradients, another
    kernel or device, mixed dtypes, a table update, tracing, profiling or a dispatch mode): the caller takes the
    general path, which gives the same values."""
    if (torch.is_grad_enabled() or x.dtype != tables.dtype or x.device.type != "cpu" or not tables.is_contiguous()
            or (bias is not None and bias.dtype != tables.dtype) or dispatcher_watched()
            or not uses_fused(tables) or table_update_for(tables) is not None):
        return None
    ops = fused_ops()
    lead = x.shape[:-1]
    rows, scores = ops.hash.default.redispatch(_CPU_KEYS, x.reshape(-1, x.shape[-1]).contiguous(), hash_bits, score,
                                               temperature)
    y = ops.lookup.default.redispatch(_CPU_KEYS, rows, scores, tables, bias, tables.shape[0] // rows.shape[1])
    return y.view(*lead, tables.shape[-1])


def hashed_rows(x: torch.Tensor, hash_bits: int, score: str = "paper", temperature: float = 1.0,
                kernels=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat table row k * 2**tau + h(z_k) and the score p(z_k) of every chunk: x [..., K * tau] -> (int64
    [..., K], [..., K] in float32, float64 for float64 x), by the `hash` op of `kernels` (default:
    `backend_for(x)`): one C++ pass with the fused kernel, `hash_codes` and `hash_scores` with the PyTorch one."""
    kernels = backend_for(x) if kernels is None else kernels
    rows, scores = kernels.hash(x.reshape(-1, x.shape[-1]).contiguous(), hash_bits, score, float(temperature))
    return rows.view(*x.shape[:-1], rows.shape[-1]), scores.view(*x.shape[:-1], scores.shape[-1])


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
    rows = _few_rows(x, weight, bias)
    if rows:
        y = fused_call(fused_ops().linear_rows, x.reshape(rows, x.shape[-1]).contiguous(), weight, bias)
        return y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def _few_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """The rows of x the fused few-row pass takes (see few_rows_linear), or 0 where it does not apply."""
    rows = x.numel() // max(1, x.shape[-1])
    records_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    applies = (
        x.dtype in (torch.float32, torch.bfloat16)
        and weight.dtype == x.dtype
        and (bias is None or bias.dtype == x.dtype)
        and 1 <= rows <= _LINEAR_ROWS_MAX
        and x.shape[-1] == weight.shape[-1]
        and weight.is_contiguous()
        and not records_grad
        and uses_fused(weight)
    )
    return rows if applies else 0


def few_rows_linear_argmax(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """(few_rows_linear(x, weight, bias), argmax_rows of it over the last dimension) in one pass of the fused kernel
    (`linear_rows_argmax`: each thread's argmax of the outputs it just stored), where few_rows_linear takes that
    kernel's few-row pass (x [..., D] of at most `linear_rows_max()` rows); else None, and the caller runs the two. A
    greedy decode step's logits and tokens: the separate argmax after the LM head ran with its code and data evicted
    by the head's stream (150-160 us on MF-small's 50K vocabulary on 2 Zen 1 cores, 40-50 us warm)."""
    rows = _few_rows(x, weight, bias)
    op = getattr(fused_ops(), "linear_rows_argmax", None) if rows else None  # absent where an older copy came first
    if op is None or weight.shape[0] == 0:
        return None
    y, tokens = fused_call(op, x.reshape(rows, x.shape[-1]).contiguous(), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0]), tokens.view(x.shape[:-1])


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`torch.argmax(x, dim=-1)` for logits [N, V]: the fused kernel's `argmax_rows` where it applies (CPU, float32,
    bfloat16 or float16, contiguous, V >= 1, the op defined in this process), the same index (the first largest
    value, a NaN the largest) in about a sixth of the time on a 50K vocabulary, and without a float32 copy of
    bfloat16 logits; else torch.argmax."""
    if (x.dim() == 2 and x.dtype in _DECODE_ATTENTION_DTYPES and x.shape[1] > 0 and x.is_contiguous()
            and uses_fused(x)):
        op = getattr(fused_ops(), "argmax_rows", None)  # absent where an older copy of the ops came first
        if op is not None:
            return fused_call(op, x)
    return torch.argmax(x, dim=-1)


_DECODE_ATTENTION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float) -> torch.Tensor | None:
    """Attention of one query position per sequence (a decode step) by the fused kernel's `decode_attention`: query
    [batch, heads, 1, head_dim], key and value [batch, kv_heads, positions, head_dim] (views with a contiguous last
    dimension, as a KV cache gives them), the mask None, bool or additive in the query's dtype, broadcastable to
    [batch, heads, 1, positions] -> [batch, 1, heads, head_dim], what transformers' attention functions return.

    Sums in float32, in key order; PyTorch's CPU scaled_dot_product_attention spends 60-80 us on one decode step of
    8 heads over 40 keys in bfloat16 on an AVX2 CPU (its blocked kernel's setup and bfloat16 GEMMs), this kernel about
    12 us. None where it does not apply (more than one query position, a gradient to record, another device, dtype or
    mask form, another kernel choice): the caller then takes scaled_dot_product_attention, the same function to
    rounding."""
    if (query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.shape[2] != 1 or key.shape[-2] == 0
            or query.device.type != "cpu" or query.dtype not in _DECODE_ATTENTION_DTYPES
            or key.dtype != query.dtype or value.dtype != query.dtype or key.shape[1] == 0
            or query.shape[1] % key.shape[1] or key.shape != value.shape or key.shape[-1] != query.shape[-1]
            or key.shape[0] != query.shape[0]
            or any(t.stride(-1) != 1 for t in (query, key, value))
            or (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad))
            or not uses_fused(query)):
        return None
    if not decode_mask_fits(attention_mask, query.shape[0], query.shape[1], key.shape[-2], query.dtype):
        return None
    return fused_call(fused_ops().decode_attention, query, key, value, attention_mask, float(scaling))


def decode_mask_fits(mask: torch.Tensor | None, batch: int, heads: int, positions: int, dtype: torch.dtype) -> bool:
    """Whether the fused `decode_attention` takes `mask` for one query position of `batch` sequences and `heads` heads
    over `positions` keys: none, or a CPU mask, bool or additive in `dtype`, broadcastable to [batch, heads, 1,
    positions]."""
    return mask is None or (mask.dim() == 4 and mask.shape[2] == 1 and mask.shape[3] == positions
                            and mask.shape[0] in (1, batch) and mask.shape[1] in (1, heads)
                            and mask.dtype in (torch.bool, dtype) and mask.device.type == "cpu")


_NOT_FOR_DECODE_ATTENTION = ("softcap", "position_bias", "cache", "sliding_window", "s_aux")


def decode_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
):
    """transformers' "sdpa" attention, with one query position per sequence (a decode step) on the fused CPU kernel
    (`memory_ops.decode_attention`: float32 sums, several times faster than scaled_dot_product_attention there in
    bfloat16). Everything else, and any keyword that kernel does not take, goes to the registered "sdpa" function.
    MemoryFormer's attention calls it where "sdpa" is the implementation; for another model (a benchmark's dense
    twin), `AttentionInterface.register("memoryformer_decode", decode_attention_forward)` then
    `model.set_attn_implementation("memoryformer_decode")`."""
    if dropout == 0.0 and all(kwargs.get(name) is None for name in _NOT_FOR_DECODE_ATTENTION):
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        if (out := decode_attention(query, key, value, attention_mask, scale)) is not None:
            return out, None
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS["sdpa"](
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )
