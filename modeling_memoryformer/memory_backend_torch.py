"""The PyTorch kernels of the Memory Layer ops: the default implementation of every op of memory_op_library.py.

They run on any device, and are what the "torch" kernel choice calls directly (then autograd differentiates them as
ordinary PyTorch code). Each function has the contract of its op's schema: the same arguments, outputs of the same
shapes and dtypes as the fused CPU kernel's (csrc/cpu/) and as the op's fake; the tests hold both to the float64
reference of memory_math.py and run `torch.library.opcheck` on the ops.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from .memory_math import acc_dtype, check_hash_parameters, hash_codes, hash_scores, table_rows

# Bytes of [tokens, K, D] products the backward below makes at a time.
BACKWARD_SLICE_BYTES = 64 << 20


def hash(x: torch.Tensor, hash_bits: int, score: str, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, K * tau] -> (rows int64 [N, K] = k * 2**tau + h(z_k), scores [N, K] in float32, float64 for float64 x)."""
    check_hash_parameters(hash_bits, score, temperature)
    rows = table_rows(hash_codes(x, hash_bits), hash_bits)
    return rows, hash_scores(x.to(acc_dtype(x.dtype)), hash_bits, score, temperature)


def hash_backward(grad_scores: torch.Tensor, x: torch.Tensor, hash_bits: int, score: str,
                  temperature: float) -> torch.Tensor:
    """The input gradient through the scores (the codes are piecewise constant): grad_scores [N, K] -> [N, K * tau]
    in x's dtype. With u_i = -2|z_i|/t, p = exp(-sum_i softplus(u_i)) has dp/dz_i = p * sigmoid(u_i) * 2 sign(z_i) / t;
    the l1 score s = p * ||z||_1 adds p * sign(z_i). Written out, not through autograd: an op's kernel runs below
    autograd."""
    check_hash_parameters(hash_bits, score, temperature)
    acc = acc_dtype(x.dtype)
    z = x.to(acc).unflatten(-1, (x.shape[-1] // hash_bits, hash_bits))  # [N, K, tau]
    u = -2.0 * z.abs() / temperature
    p = (-F.softplus(u).sum(-1)).exp().unsqueeze(-1)  # [N, K, 1]
    sign = z.sign()
    grad_z = p * torch.sigmoid(u) * (2.0 / temperature) * sign
    if score == "l1":
        grad_z = grad_z * z.abs().sum(-1, keepdim=True) + p * sign
    return (grad_scores.to(acc).unsqueeze(-1) * grad_z).flatten(-2).to(x.dtype)


def lookup(rows: torch.Tensor, scores: torch.Tensor, tables: torch.Tensor, bias: torch.Tensor | None,
           rows_per_table: int) -> torch.Tensor:
    """sum_k scores[:, k] * tables[rows[:, k]] (+ bias): [N, K] rows and scores -> [N, D] in the tables' dtype."""
    y = F.embedding_bag(rows, tables, per_sample_weights=scores.to(tables.dtype), mode="sum")
    return y if bias is None else y + bias


def gradient_slices(grad: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor, tables: torch.Tensor,
                    need_tables: bool, need_scores: bool,
                    budget: int = BACKWARD_SLICE_BYTES) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The lookup's backward: grad [N, D], rows [N, K] (into `tables` [R, D]), scores [N, K] -> (grad_scores [N, K],
    grad_tables [R, D]), both in the accumulation dtype (float32, float64 for float64 tables), a slice of tokens at a
    time so that the [tokens, K, D] products stay within `budget` bytes."""
    acc = acc_dtype(tables.dtype)
    n, k = rows.shape
    width = tables.shape[1]
    values = tables.to(acc) if need_scores else None
    grad = grad.to(acc)
    grad_tables = torch.zeros(tables.shape, dtype=acc, device=tables.device) if need_tables else None
    grad_scores = torch.empty((n, k), dtype=acc, device=tables.device) if need_scores else None
    step = max(1, budget // max(1, k * width * torch.finfo(acc).bits // 8))
    for t0 in range(0, n, step):
        g = grad[t0 : t0 + step].unsqueeze(1)  # [t, 1, D]
        r = rows[t0 : t0 + step]
        if need_tables:
            grad_tables.index_add_(0, r.reshape(-1),
                                   (scores[t0 : t0 + step].to(acc).unsqueeze(-1) * g).reshape(-1, width))
        if need_scores:
            grad_scores[t0 : t0 + step] = (values[r] * g).sum(-1)
    return grad_scores, grad_tables


def lookup_backward(grad_out: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor, tables: torch.Tensor,
                    rows_per_table: int, need_tables: bool,
                    need_scores: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(grad_scores [N, K] in the accumulation dtype, grad_tables [R, D] in the tables' dtype); None where not asked."""
    grad_scores, grad_tables = gradient_slices(grad_out, rows, scores, tables, need_tables, need_scores)
    return grad_scores, None if grad_tables is None else grad_tables.to(tables.dtype)


def lookup_backward_rows(grad_out: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor, tables: torch.Tensor,
                         rows_per_table: int,
                         need_scores: bool) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The table gradient as the rows hit only: (grad_scores float32 [N, K] or None, the distinct rows hit ascending
    [U], their gradients [U, D] in the tables' dtype)."""
    hit, inverse = torch.unique(rows.reshape(-1), sorted=True, return_inverse=True)
    acc = acc_dtype(tables.dtype)
    products = (scores.to(acc).unsqueeze(-1) * grad_out.to(acc).unsqueeze(1)).reshape(-1, tables.shape[1])
    values = torch.zeros((hit.numel(), tables.shape[1]), dtype=acc, device=tables.device)
    values.index_add_(0, inverse, products)
    grad_scores = None
    if need_scores:
        grad_scores = (tables[rows].to(acc) * grad_out.to(acc).unsqueeze(1)).sum(-1).to(torch.float32)
    return grad_scores, hit, values.to(tables.dtype)


def int8_lookup(rows: torch.Tensor, scores: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                rows_per_table: int) -> torch.Tensor:
    """The lookup on int8 tables in FBGEMM's row-wise layout (uint8 [R, D + 8]: D codes, then a float32 scale and a
    float32 offset per row): the rows hit are dequantised (q * scale + offset), then summed in float32."""
    width = packed.shape[1] - 8
    hit = packed[rows.reshape(-1)]  # [N * K, D + 8]
    scale = hit[:, width : width + 4].contiguous().view(torch.float32)
    offset = hit[:, width + 4 :].contiguous().view(torch.float32)
    values = (hit[:, :width].to(torch.float32) * scale + offset).view(*rows.shape, width)
    y = (scores.to(torch.float32).unsqueeze(-1) * values).sum(-2)
    return y if bias is None else y + bias.to(torch.float32)


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear for a few rows, accumulated in float32 and rounded once to x's dtype."""
    acc = acc_dtype(x.dtype)
    y = F.linear(x.to(acc), weight.to(acc), None if bias is None else bias.to(acc))
    return y.to(x.dtype)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax over each row of x [N, V]."""
    return torch.argmax(x, dim=-1)


def linear_rows_argmax(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """(linear_rows(x, weight, bias), its argmax over each row)."""
    y = linear_rows(x, weight, bias)
    return y, argmax_rows(y)


def decode_layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                      eps: float, path: str = "auto") -> torch.Tensor:
    """The decode ops' layer norm over the last dimension: torch.layer_norm's values (nn.LayerNorm's). `path` chooses
    between the fused CPU kernel's two ways to them; here there is one."""
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float) -> torch.Tensor:
    """Attention of one query position per sequence: q [B, H, 1, D], k and v [B, Hkv, T, D], mask None, bool (true:
    attend) or additive, broadcastable to [B, H, 1, T] -> [B, 1, H, D] in q's dtype, summed in float32 (float64 for
    float64); a row whose keys are all masked out gives zeros (as scaled_dot_product_attention)."""
    acc = acc_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    kf = k.to(acc).repeat_interleave(group, 1)
    vf = v.to(acc).repeat_interleave(group, 1)
    scores = (q.to(acc) @ kf.transpose(-1, -2)) * scaling  # [B, H, 1, T]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.to(acc)
    top = scores.amax(-1, keepdim=True)
    weights = (scores - top.masked_fill(top == float("-inf"), 0)).exp()
    total = weights.sum(-1, keepdim=True)
    out = (weights @ vf) / total.masked_fill(total == 0, 1)
    return out.transpose(1, 2).to(q.dtype).contiguous()


def _row_mean_square(grad: torch.Tensor) -> torch.Tensor:
    return grad.square().mean(1) if grad.shape[1] else grad.new_zeros(grad.shape[0])


def rowwise_adagrad_step(weight: torch.Tensor, grad: torch.Tensor, state_sum: torch.Tensor, lr: float, eps: float,
                         weight_decay: float) -> None:
    """In place: s_r += mean_j g_rj^2; w_r = w_r (1 - lr wd) - lr g_r / (sqrt(s_r) + eps)."""
    state_sum.add_(_row_mean_square(grad))
    weight.mul_(1.0 - lr * weight_decay).sub_(lr * grad / (state_sum.sqrt() + eps).unsqueeze(1))


def adam_rowwise_step(weight: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                      step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """In place: m = b1 m + (1 - b1) g; v_r = b2 v_r + (1 - b2) mean_j g_rj^2;
    w = w (1 - lr wd) - (lr / (1 - b1^t)) m / (sqrt(v_r / (1 - b2^t)) + eps)."""
    exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).add_(_row_mean_square(grad), alpha=1.0 - beta2)
    denominator = (exp_avg_sq / (1.0 - beta2**step)).sqrt().add_(eps).unsqueeze(1)
    weight.mul_(1.0 - lr * weight_decay).sub_(lr / (1.0 - beta1**step) * exp_avg / denominator)


# The kernels by op name, as one object with the interface of memory_kernels' fused backend ("name" is its kernel
# choice). memory_op_library registers each as its op's default; memory_kernels calls them for the "torch" choice.
TORCH_BACKEND = types.SimpleNamespace(
    name="torch",
    **{kernel.__name__: kernel for kernel in (hash, hash_backward, lookup, lookup_backward, lookup_backward_rows,
                                              int8_lookup, linear_rows, argmax_rows, linear_rows_argmax, decode_attention,
                                              decode_layer_norm,
                                              rowwise_adagrad_step, adam_rowwise_step)},
)
