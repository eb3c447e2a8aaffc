"""The Triton backend of the Memory Layer ops: `hash` (codes and scores of every chunk) and `lookup` (the weighted
gather of the table rows) as Triton kernels, for CUDA tensors, and for CPU tensors under Triton's interpreter
(`TRITON_INTERPRET=1`), where CI checks them against the float64 reference.

The backward too: `hash_backward` (the input gradient through the scores), and `lookup_backward` /
`lookup_backward_rows`, whose table gradient takes no atomics: the lookups are sorted by row (torch.sort) and one
program per (row hit, block of columns) sums its segment and writes the row once, however hot the row.

The kernels are registered for the ops of their own namespace, `torch.ops.memoryformer_triton` (the same schemas,
fakes and autograd as `torch.ops.memoryformer`, memory_op_library.define_ops), for the CUDA and CPU dispatch keys;
int8 tables are read with their codes dequantised in registers, and the row-wise table optimizers' steps (the fused
update of the CPU kernel) take one program per row. `linear_rows` (the LM head for a few tokens) runs its PyTorch
kernel. `memory_kernels.backend_for` picks this backend for CUDA tensors when triton is
installed, and for any tensor with MEMORYFORMER_KERNEL=triton.

Measured on GPUs lent for a few minutes (an H100 and an H200: benchmarks/results/*-gpu*; CI has no GPU and runs the
kernels under Triton's interpreter). Triton is an optional dependency: nothing here imports it until a kernel is first
used.
"""

from __future__ import annotations

import functools
import types

import torch

from .memory_backend_torch import TORCH_BACKEND
from .memory_math import HASH_SCORES, acc_dtype, check_hash_parameters
from .memory_op_library import define_ops, namespace_ops

TRITON_NAMESPACE = "memoryformer_triton"
SCORE_IDS = {name: i for i, name in enumerate(HASH_SCORES)}  # the score by name -> the kernels' constexpr


@functools.cache
def triton_available() -> bool:
    """Whether triton imports here (tried once per process)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernels():
    """The Triton kernels, compiled on first use (triton imported here, not at module import)."""
    # In a try block: transformers' remote-code loader lists a model file's imports, except those inside try blocks,
    # and refuses to load a model whose listed imports are missing; triton is optional.
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:
        raise ImportError("The Triton backend of the Memory Layer needs triton: pip install triton.") from exc

    @triton.jit
    def hash_kernel(x_ptr, rows_ptr, scores_ptr, num_tables, temperature, TAU: tl.constexpr,
                    TAU_P2: tl.constexpr, SCORE: tl.constexpr):
        # One program per (token, table): the chunk's tau values -> its row k * 2**tau + code and its score.
        n = tl.program_id(0)
        k = tl.program_id(1)
        i = tl.arange(0, TAU_P2)
        valid = i < TAU
        z = tl.load(x_ptr + n * num_tables * TAU + k * TAU + i, mask=valid, other=0.0).to(tl.float32)
        bits = tl.where(valid & (z >= 0), 1 << i, 0)
        code = tl.sum(bits, axis=0)
        a = tl.abs(z)
        # p = 1 / prod_i (1 + exp(-2|z_i| / t)),
        # as exp(-sum_i log(1 + exp(-2|z_i|/t))), each term in (0, log 2]
        terms = tl.where(valid, tl.log(1.0 + tl.exp(-2.0 * a / temperature)), 0.0)
        p = tl.exp(-tl.sum(terms, axis=0))
        if SCORE == 1:  # "l1": ||z||_1 * p
            p = p * tl.sum(tl.where(valid, a, 0.0), axis=0)
        tl.store(rows_ptr + n * num_tables + k, (k * (1 << TAU) + code).to(tl.int64))
        tl.store(scores_ptr + n * num_tables + k, p)

    @triton.jit
    def lookup_kernel(rows_ptr, scores_ptr, tables_ptr, bias_ptr, out_ptr, num_tables, width,
                      HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        # One program per (token, block of columns): sum_k scores[n, k] * tables[rows[n, k], cols] in float32.
        n = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < width
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in range(num_tables):
            row = tl.load(rows_ptr + n * num_tables + k)
            score = tl.load(scores_ptr + n * num_tables + k).to(tl.float32)
            values = tl.load(tables_ptr + row * width + cols, mask=inside, other=0.0).to(tl.float32)
            acc += score * values
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + n * width + cols, acc.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def hash_backward_kernel(grad_scores_ptr, x_ptr, grad_x_ptr, num_tables, temperature, TAU: tl.constexpr,
                             TAU_P2: tl.constexpr, SCORE: tl.constexpr):
        # One program per (token, table): with u_i = -2|z_i|/t, dp/dz_i = p * sigmoid(u_i) * 2 sign(z_i) / t; the l1
        # score s = p * ||z||_1 adds p * sign(z_i).
        n = tl.program_id(0)
        k = tl.program_id(1)
        i = tl.arange(0, TAU_P2)
        valid = i < TAU
        offsets = n * num_tables * TAU + k * TAU + i
        z = tl.load(x_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
        a = tl.abs(z)
        e = tl.exp(-2.0 * a / temperature)
        p = tl.exp(-tl.sum(tl.where(valid, tl.log(1.0 + e), 0.0), axis=0))
        sign = tl.where(z > 0, 1.0, tl.where(z < 0, -1.0, 0.0))
        grad_z = p * (e / (1.0 + e)) * (2.0 / temperature) * sign
        if SCORE == 1:
            grad_z = grad_z * tl.sum(tl.where(valid, a, 0.0), axis=0) + p * sign
        g = tl.load(grad_scores_ptr + n * num_tables + k).to(tl.float32)
        tl.store(grad_x_ptr + offsets, (g * grad_z).to(grad_x_ptr.dtype.element_ty), mask=valid)

    @triton.jit
    def grad_scores_kernel(grad_ptr, rows_ptr, tables_ptr, grad_scores_ptr, num_tables, width, BLOCK: tl.constexpr):
        # One program per (token, table): <grad_out[n], tables[rows[n, k]]>, over blocks of columns.
        n = tl.program_id(0)
        k = tl.program_id(1)
        row = tl.load(rows_ptr + n * num_tables + k)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for c0 in range(0, width, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            inside = cols < width
            g = tl.load(grad_ptr + n * width + cols, mask=inside, other=0.0).to(tl.float32)
            t = tl.load(tables_ptr + row * width + cols, mask=inside, other=0.0).to(tl.float32)
            acc += g * t
        tl.store(grad_scores_ptr + n * num_tables + k, tl.sum(acc, axis=0))

    @triton.jit
    def row_gradients_kernel(grad_ptr, scores_ptr, order_ptr, starts_ptr, out_ptr, num_tables, width,
                             BLOCK: tl.constexpr):
        # One program per (row hit, block of columns): the lookups sorted by row, this row's segment
        # order[starts[r]:starts[r + 1]] summed as scores * grad_out rows, written once: no atomics on hot rows.
        r = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < width
        start = tl.load(starts_ptr + r)
        stop = tl.load(starts_ptr + r + 1)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in range(start, stop):
            lookup = tl.load(order_ptr + j)
            n = lookup // num_tables
            score = tl.load(scores_ptr + lookup).to(tl.float32)
            acc += score * tl.load(grad_ptr + n * width + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + r * width + cols, acc.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def int8_lookup_kernel(rows_ptr, scores_ptr, codes_ptr, scale_ptr, offset_ptr, bias_ptr, out_ptr, num_tables,
                           width, row_bytes, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        # One program per (token, block of columns): the int8 codes dequantised in registers, summed in float32.
        n = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < width
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in range(num_tables):
            row = tl.load(rows_ptr + n * num_tables + k)
            score = tl.load(scores_ptr + n * num_tables + k).to(tl.float32)
            q = tl.load(codes_ptr + row * row_bytes + cols, mask=inside, other=0).to(tl.float32)
            acc += score * (q * tl.load(scale_ptr + row) + tl.load(offset_ptr + row))
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + n * width + cols, acc, mask=inside)

    @triton.jit
    def rowwise_step_kernel(weight_ptr, grad_ptr, sum_ptr, avg_ptr, width, lr, eps, decay, beta1, beta2, lr1, bias2,
                            ADAM: tl.constexpr, BLOCK: tl.constexpr):
        # One program per table row: its mean squared gradient, the row-wise state, then the row's update (the
        # formulas of the fused CPU kernel's rowwise_adagrad_step / adam_rowwise_step).
        r = tl.program_id(0)
        square = tl.zeros((BLOCK,), dtype=tl.float32)
        for c0 in range(0, width, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            g = tl.load(grad_ptr + r * width + cols, mask=cols < width, other=0.0)
            square += g * g
        mean_square = tl.sum(square, axis=0) / width
        if ADAM:
            v = beta2 * tl.load(sum_ptr + r) + (1.0 - beta2) * mean_square
            tl.store(sum_ptr + r, v)
            scale = lr1 / (tl.sqrt(v / bias2) + eps)
        else:
            s = tl.load(sum_ptr + r) + mean_square
            tl.store(sum_ptr + r, s)
            scale = lr / (tl.sqrt(s) + eps)
        for c0 in range(0, width, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            inside = cols < width
            g = tl.load(grad_ptr + r * width + cols, mask=inside, other=0.0)
            w = tl.load(weight_ptr + r * width + cols, mask=inside, other=0.0)
            if ADAM:
                m = beta1 * tl.load(avg_ptr + r * width + cols, mask=inside, other=0.0) + (1.0 - beta1) * g
                tl.store(avg_ptr + r * width + cols, m, mask=inside)
                w = w * decay - scale * m
            else:
                w = w * decay - scale * g
            tl.store(weight_ptr + r * width + cols, w, mask=inside)

    @triton.jit
    def fused_forward_kernel(x_ptr, tables_ptr, bias_ptr, out_ptr, rows_ptr, scores_ptr, num_tables, width,
                             temperature, TAU: tl.constexpr, TAU_P2: tl.constexpr, SCORE: tl.constexpr,
                             HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        # The whole Memory Layer in one kernel, one program per (token, block of columns): for each table, the
        # chunk's code and score (as hash_kernel), then its row's columns weighted into a float32 sum. The programs
        # of the first column block also write the rows and scores the backward needs.
        n = tl.program_id(0)
        block = tl.program_id(1)
        cols = block * BLOCK + tl.arange(0, BLOCK)
        inside = cols < width
        i = tl.arange(0, TAU_P2)
        valid = i < TAU
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in range(num_tables):
            z = tl.load(x_ptr + n * num_tables * TAU + k * TAU + i, mask=valid, other=0.0).to(tl.float32)
            code = tl.sum(tl.where(valid & (z >= 0), 1 << i, 0), axis=0)
            a = tl.abs(z)
            p = tl.exp(-tl.sum(tl.where(valid, tl.log(1.0 + tl.exp(-2.0 * a / temperature)), 0.0), axis=0))
            if SCORE == 1:
                p = p * tl.sum(tl.where(valid, a, 0.0), axis=0)
            row = (k * (1 << TAU) + code).to(tl.int64)
            if block == 0:
                tl.store(rows_ptr + n * num_tables + k, row)
                tl.store(scores_ptr + n * num_tables + k, p)
            acc += p * tl.load(tables_ptr + row * width + cols, mask=inside, other=0.0).to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + n * width + cols, acc.to(out_ptr.dtype.element_ty), mask=inside)

    return types.SimpleNamespace(fused_forward=fused_forward_kernel, hash=hash_kernel, lookup=lookup_kernel,
                                 hash_backward=hash_backward_kernel,
                                 grad_scores=grad_scores_kernel, row_gradients=row_gradients_kernel,
                                 int8_lookup=int8_lookup_kernel, rowwise_step=rowwise_step_kernel, triton=triton)


def hash(x: torch.Tensor, hash_bits: int, score: str, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The `hash` op on Triton: x [N, K * tau] -> (rows int64 [N, K], scores [N, K] float32; float64 x takes the
    PyTorch kernel, as Triton's interpreter has no float64 exp)."""
    check_hash_parameters(hash_bits, score, temperature)
    if x.dtype == torch.float64:
        return TORCH_BACKEND.hash(x, hash_bits, score, temperature)
    if x.dim() != 2 or x.shape[1] % hash_bits:
        raise ValueError(f"x must be [tokens, K * hash_bits] with hash_bits={hash_bits}; got {tuple(x.shape)}.")
    x = x.contiguous()
    n, k = x.shape[0], x.shape[1] // hash_bits
    rows = torch.empty((n, k), dtype=torch.long, device=x.device)
    scores = torch.empty((n, k), dtype=acc_dtype(x.dtype), device=x.device)
    if n and k:
        kernels = _kernels()
        kernels.hash[(n, k)](x, rows, scores, k, float(temperature), TAU=hash_bits,
                             TAU_P2=kernels.triton.next_power_of_2(hash_bits), SCORE=SCORE_IDS[score])
    return rows, scores


def lookup(rows: torch.Tensor, scores: torch.Tensor, tables: torch.Tensor, bias: torch.Tensor | None,
           rows_per_table: int) -> torch.Tensor:
    """The `lookup` op on Triton: [N, K] rows and scores -> [N, D] in the tables' dtype, summed in float32 (float64
    tables take the PyTorch kernel)."""
    if tables.dtype == torch.float64:
        return TORCH_BACKEND.lookup(rows, scores, tables, bias, rows_per_table)
    rows, scores, tables = rows.contiguous(), scores.contiguous(), tables.contiguous()
    n, k = rows.shape
    width = tables.shape[1]
    out = torch.empty((n, width), dtype=tables.dtype, device=tables.device)
    if n and width:
        block = min(128, _kernels().triton.next_power_of_2(width))
        _kernels().lookup[(n, (width + block - 1) // block)](
            rows, scores, tables, bias if bias is not None else tables, out, k, width,
            HAS_BIAS=bias is not None, BLOCK=block)
    return out


def hash_backward(grad_scores: torch.Tensor, x: torch.Tensor, hash_bits: int, score: str,
                  temperature: float) -> torch.Tensor:
    """The `hash_backward` op on Triton: grad_scores [N, K] -> grad_x [N, K * tau] in x's dtype."""
    check_hash_parameters(hash_bits, score, temperature)
    if x.dtype == torch.float64:
        return TORCH_BACKEND.hash_backward(grad_scores, x, hash_bits, score, temperature)
    x, grad_scores = x.contiguous(), grad_scores.contiguous()
    n, k = x.shape[0], x.shape[1] // hash_bits
    grad_x = torch.empty_like(x)
    if n and k:
        kernels = _kernels()
        kernels.hash_backward[(n, k)](grad_scores, x, grad_x, k, float(temperature), TAU=hash_bits,
                                      TAU_P2=kernels.triton.next_power_of_2(hash_bits), SCORE=SCORE_IDS[score])
    return grad_x


def _block(width: int) -> int:
    return min(128, _kernels().triton.next_power_of_2(max(1, width)))


def _grad_scores(grad: torch.Tensor, rows: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    n, k = rows.shape
    out = torch.empty((n, k), dtype=torch.float32, device=tables.device)
    if n and k:
        _kernels().grad_scores[(n, k)](grad, rows, tables, out, k, tables.shape[1], BLOCK=_block(tables.shape[1]))
    return out


def _row_gradients(grad: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the distinct rows hit, ascending [U], their gradients [U, D] in `dtype`): the lookups sorted by row
    (torch.sort), each row's segment summed by one program per column block."""
    flat = rows.reshape(-1)
    sorted_rows, order = torch.sort(flat, stable=True)
    hit, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
    starts = torch.zeros(hit.numel() + 1, dtype=torch.long, device=rows.device)
    torch.cumsum(counts, 0, out=starts[1:])
    width = grad.shape[1]
    values = torch.empty((hit.numel(), width), dtype=dtype, device=grad.device)
    if hit.numel() and width:
        block = _block(width)
        _kernels().row_gradients[(hit.numel(), (width + block - 1) // block)](
            grad, scores.contiguous(), order, starts, values, rows.shape[1], width, BLOCK=block)
    return hit, values


def lookup_backward(grad_out: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor, tables: torch.Tensor,
                    rows_per_table: int, need_tables: bool,
                    need_scores: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The `lookup_backward` op on Triton: (grad_scores [N, K] float32, grad_tables [R, D] in the tables' dtype; rows
    nobody hit are zeros), None where not asked. float64 tables take the PyTorch kernel."""
    if tables.dtype == torch.float64:
        return TORCH_BACKEND.lookup_backward(grad_out, rows, scores, tables, rows_per_table, need_tables,
                                             need_scores)
    grad_out, rows, tables = grad_out.contiguous(), rows.contiguous(), tables.contiguous()
    grad_scores = _grad_scores(grad_out, rows, tables) if need_scores else None
    grad_tables = None
    if need_tables:
        hit, values = _row_gradients(grad_out, rows, scores, tables.dtype)
        grad_tables = torch.zeros_like(tables).index_copy_(0, hit, values)
    return grad_scores, grad_tables


def lookup_backward_rows(grad_out: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor, tables: torch.Tensor,
                         rows_per_table: int,
                         need_scores: bool) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The `lookup_backward_rows` op on Triton: the table gradient as the rows hit only (sparse)."""
    if tables.dtype == torch.float64:
        return TORCH_BACKEND.lookup_backward_rows(grad_out, rows, scores, tables, rows_per_table, need_scores)
    grad_out, rows, tables = grad_out.contiguous(), rows.contiguous(), tables.contiguous()
    grad_scores = _grad_scores(grad_out, rows, tables) if need_scores else None
    hit, values = _row_gradients(grad_out, rows, scores, tables.dtype)
    return grad_scores, hit, values


def int8_lookup(rows: torch.Tensor, scores: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                rows_per_table: int) -> torch.Tensor:
    """The `int8_lookup` op on Triton: int8 tables in FBGEMM's row-wise layout (uint8 [R, D + 8]: the codes, a float32
    scale and a float32 offset per row) read and dequantised in registers -> [N, D] float32."""
    width = packed.shape[1] - 8
    scale = packed[:, width : width + 4].contiguous().view(torch.float32).reshape(-1)
    offset = packed[:, width + 4 :].contiguous().view(torch.float32).reshape(-1)
    rows, scores, packed = rows.contiguous(), scores.contiguous(), packed.contiguous()
    n, k = rows.shape
    out = torch.empty((n, width), dtype=torch.float32, device=packed.device)
    if n and width:
        block = _block(width)
        _kernels().int8_lookup[(n, (width + block - 1) // block)](
            rows, scores, packed, scale, offset, bias if bias is not None else scale, out, k, width, width + 8,
            HAS_BIAS=bias is not None, BLOCK=block)
    return out


def _check_step(weight: torch.Tensor, grad: torch.Tensor, *states: torch.Tensor) -> None:
    for t in (weight, grad, *states):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError("The Triton row-wise table steps take contiguous float32 weight, gradient and states; "
                             f"got {t.dtype}{'' if t.is_contiguous() else ' (not contiguous)'}.")


def rowwise_adagrad_step(weight: torch.Tensor, grad: torch.Tensor, state_sum: torch.Tensor, lr: float, eps: float,
                         weight_decay: float) -> None:
    """In place, one program per row: s_r += mean_j g_rj^2; w_r = w_r (1 - lr wd) - lr g_r / (sqrt(s_r) + eps)."""
    _check_step(weight, grad, state_sum)
    if weight.shape[0] and weight.shape[1]:
        _kernels().rowwise_step[(weight.shape[0],)](weight, grad, state_sum, state_sum, weight.shape[1], lr, eps,
                                                   1.0 - lr * weight_decay, 0.0, 0.0, 0.0, 1.0, ADAM=False,
                                                   BLOCK=_block(weight.shape[1]))


def adam_rowwise_step(weight: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                      step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """In place, one program per row: m = b1 m + (1 - b1) g; v_r = b2 v_r + (1 - b2) mean_j g_rj^2;
    w = w (1 - lr wd) - (lr / (1 - b1^t)) m / (sqrt(v_r / (1 - b2^t)) + eps)."""
    _check_step(weight, grad, exp_avg, exp_avg_sq)
    if weight.shape[0] and weight.shape[1]:
        _kernels().rowwise_step[(weight.shape[0],)](
            weight, grad, exp_avg_sq, exp_avg, weight.shape[1], lr, eps, 1.0 - lr * weight_decay, beta1, beta2,
            lr / (1.0 - beta1**step), 1.0 - beta2**step, ADAM=True, BLOCK=_block(weight.shape[1]))


def fused_forward(x: torch.Tensor, tables: torch.Tensor, bias: torch.Tensor | None, hash_bits: int, score: str,
                  temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hash, score and gather in one Triton kernel: x [N, K * tau], tables [K * 2**tau, D] (x and bias in the
    tables' dtype) -> (y [N, D] in the tables' dtype, rows [N, K], scores [N, K] float32)."""
    x, tables = x.contiguous(), tables.contiguous()
    n, k = x.shape[0], x.shape[1] // hash_bits
    width = tables.shape[1]
    y = torch.empty((n, width), dtype=tables.dtype, device=tables.device)
    rows = torch.empty((n, k), dtype=torch.long, device=x.device)
    scores = torch.empty((n, k), dtype=torch.float32, device=x.device)
    if n and k and width:
        kernels = _kernels()
        block = _block(width)
        kernels.fused_forward[(n, (width + block - 1) // block)](
            x, tables, bias if bias is not None else tables, y, rows, scores, k, width, float(temperature),
            TAU=hash_bits, TAU_P2=kernels.triton.next_power_of_2(hash_bits), SCORE=SCORE_IDS[score],
            HAS_BIAS=bias is not None, BLOCK=block)
    return y, rows, scores


class FusedMemoryLookup(torch.autograd.Function):
    """The Memory Layer as one autograd node on Triton: `fused_forward`, and a backward through the Triton ops
    (`lookup_backward`: the table and score gradients without atomics; `hash_backward`: the input gradient)."""

    @staticmethod
    def forward(ctx, x, tables, bias, hash_bits, score, temperature):
        y, rows, scores = fused_forward(x, tables, bias, hash_bits, score, temperature)
        ctx.save_for_backward(x, rows, scores, tables)
        ctx.args = (hash_bits, score, float(temperature))
        return y

    @staticmethod
    def backward(ctx, grad):
        x, rows, scores, tables = ctx.saved_tensors
        need_x, need_tables, need_bias = ctx.needs_input_grad[:3]
        ops = triton_ops()
        grad = grad.contiguous()
        grad_scores, grad_tables = ops.lookup_backward(grad, rows, scores, tables, tables.shape[0] // rows.shape[1],
                                                       need_tables, need_x)
        grad_x = ops.hash_backward(grad_scores, x, *ctx.args) if need_x else None
        grad_bias = grad.sum(0) if need_bias else None
        return grad_x, grad_tables if need_tables else None, grad_bias, None, None, None


TRITON_KERNELS = {"hash": hash, "hash_backward": hash_backward, "lookup": lookup, "lookup_backward": lookup_backward,
                  "lookup_backward_rows": lookup_backward_rows, "int8_lookup": int8_lookup,
                  "rowwise_adagrad_step": rowwise_adagrad_step, "adam_rowwise_step": adam_rowwise_step}


def _define_triton_ops() -> None:
    """Define torch.ops.memoryformer_triton and give it the Triton kernels (Python functions: triton itself is
    imported when a kernel first runs). Done at import, as the "memoryformer" namespace is: a definition made while
    torch.compile traces a model (its first Memory Layer call on a GPU inside `generate`'s compiled decode step) is
    something Dynamo cannot trace. Where another copy of this module defined them first (a saved model's remote code
    beside the installed package), its kernels stay: registering them again would warn at every such import."""
    if not define_ops(TRITON_NAMESPACE):   # defined before: define_ops checked their schemas
        return
    for name, kernel in TRITON_KERNELS.items():
        for device in ("cuda", "cpu"):
            torch.library.register_kernel(f"{TRITON_NAMESPACE}::{name}", device, kernel)


_define_triton_ops()


def triton_ops():
    """torch.ops.memoryformer_triton, the ops with their Triton kernels."""
    return namespace_ops(TRITON_NAMESPACE)


class _TritonBackend:
    """The ops of torch.ops.memoryformer_triton with the interface of memory_backend_torch.TORCH_BACKEND."""

    name = "triton"

    def __getattr__(self, op_name: str):
        return getattr(triton_ops(), op_name)


TRITON_BACKEND = _TritonBackend()
