"""The Triton backend of the Memory Layer ops: `hash` (codes and scores of every chunk) and `lookup` (the weighted
gather of the table rows) as Triton kernels, for CUDA tensors, and for CPU tensors under Triton's interpreter
(`TRITON_INTERPRET=1`), where CI checks them against the float64 reference.

The kernels are registered for the ops of their own namespace, `torch.ops.memoryformer_triton` (the same schemas,
fakes and autograd as `torch.ops.memoryformer`, memory_op_library.define_ops), for the CUDA and CPU dispatch keys;
the other ops of that namespace (the backward ops, int8, the LM head rows, the optimizer steps) run their PyTorch
kernels until Triton ones exist. `memory_kernels.backend_for` picks this backend for CUDA tensors when triton is
installed, and for any tensor with MEMORYFORMER_KERNEL=triton.

Not measured on a GPU: no GPU is available where this project is built and tested (see docs/serving.md's sibling
docs/performance.md for what is measured where). Triton is an optional dependency: nothing here imports it until a
kernel is first used.
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


def triton_available() -> bool:
    """Whether triton imports here."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernels():
    """The Triton kernels, compiled on first use (triton imported here, not at module import)."""
    import triton
    import triton.language as tl

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

    return types.SimpleNamespace(hash=hash_kernel, lookup=lookup_kernel, triton=triton)


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


_registered = False


def triton_ops():
    """torch.ops.memoryformer_triton, defined and given its Triton kernels on first use."""
    global _registered
    if not _registered:
        define_ops(TRITON_NAMESPACE)
        for name, kernel in (("hash", hash), ("lookup", lookup)):
            for device in ("cuda", "cpu"):
                torch.library.register_kernel(f"{TRITON_NAMESPACE}::{name}", device, kernel)
        _registered = True
    return namespace_ops(TRITON_NAMESPACE)


class _TritonBackend:
    """The ops of torch.ops.memoryformer_triton with the interface of memory_backend_torch.TORCH_BACKEND."""

    name = "triton"

    def __getattr__(self, op_name: str):
        return getattr(triton_ops(), op_name)


TRITON_BACKEND = _TritonBackend()
