"""Table updates in the backward pass, so that no tensor the size of the tables ever holds their gradient.

An optimizer (training.table_optimizer.TableAdamW) attaches to a `tables` parameter an object under TABLE_UPDATE_ATTR
with
  owner() -> the parameter it was made for (a weak reference: a copy of the model does not update the original's)
  __call__(grad, start, stop, first) -> None: apply the optimizer's rule to rows [start, stop) of the parameter,
      given their complete gradient for this backward pass (float32, or float64 for float64 tables); `first` is
      True for the first group of rows of a backward pass (the optimizer counts its step there).
The lookup's backward then computes the table gradient one group of whole tables at a time (at most
`update_group_bytes()` of gradient) and hands each group to the update at once, before the next group's gradient
exists: the parameter's `.grad` stays None. The score gradient of a group is taken before that group is updated, so
the input gradient is the one of the forward's tables, as without the update.
"""

from __future__ import annotations

import torch

from .memory_kernels import backend_for, cache_share_bytes
from .memory_math import acc_dtype

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


def update_group_bytes(grad_bytes: int = 0, table_bytes: int | None = None) -> int:
    """Bytes of table gradient computed before its update, for a layer whose output gradient holds `grad_bytes` and
    whose tables `table_bytes`: at least `cache_share_bytes()` (a quarter of the last-level cache), at least twice the
    output gradient, and at most half of the tables. `UPDATE_GROUP_BYTES` overrides.

    Every group reads the whole output gradient again (each of its tokens looks up every table), so groups much
    smaller than that gradient spend more time re-reading it than on the tables; twice the output gradient keeps
    those re-reads within one pass over the tables, and half the tables keeps the promise that no tensor the size of a
    layer's tables holds its gradient (a group is never less than one table). The backward passes grad_bytes=0 for
    tables stored in another dtype than float32 (bfloat16): their groups are converted to float32 through temporaries
    of a group's size, and large temporaries are fresh memory from the OS (docs/kernel.md, "Measurements behind the
    design choices").
    """
    if UPDATE_GROUP_BYTES is not None:
        return int(UPDATE_GROUP_BYTES)
    budget = max(cache_share_bytes(), 2 * grad_bytes)
    if table_bytes is not None:
        budget = min(budget, table_bytes // 2)
    return budget


class LookupUpdatingTables(torch.autograd.Function):
    """A lookup whose backward updates the tables in place, group by group, instead of returning their gradient (see
    the module docstring). `gather(rows, scores, tables, bias, dtype)` computes the forward (memory_ops'
    gather-accumulate). The tables are held by reference, not saved: they change in the backward by design, after
    each group's score gradient has been taken."""

    @staticmethod
    def forward(ctx, rows, scores, tables, bias, dtype, update, gather):
        ctx.save_for_backward(rows, scores)
        ctx.tables, ctx.update = tables, update
        ctx.bias_dtype = None if bias is None else bias.dtype
        return gather(rows, scores, tables.detach(), bias, dtype)

    @staticmethod
    def backward(ctx, grad):
        rows, scores = ctx.saved_tensors
        tables, update = ctx.tables, ctx.update
        need_scores = ctx.needs_input_grad[1]
        num_tables, width = rows.shape[-1], tables.shape[1]
        per_table = tables.shape[0] // num_tables
        flat_rows = rows.reshape(-1, num_tables)
        flat_scores = scores.reshape(-1, num_tables)
        acc = acc_dtype(tables.dtype)
        g = grad.reshape(-1, width)
        g_acc = g.to(acc).contiguous()
        row_bytes = width * torch.finfo(acc).bits // 8
        # Tables in another dtype than the accumulation (bfloat16) are converted and updated group by group through
        # temporaries of a group's size: their groups stay at the cache share (see update_group_bytes).
        grad_bytes = g_acc.numel() * g_acc.element_size() if tables.dtype == acc else 0
        budget = update_group_bytes(grad_bytes, tables.shape[0] * row_bytes)
        group = max(1, min(num_tables, budget // max(1, per_table * row_bytes)))
        kernels = backend_for(tables)
        grad_scores = torch.empty(flat_scores.shape, dtype=acc, device=grad.device) if need_scores else None
        with torch.no_grad():
            for k0 in range(0, num_tables, group):
                k1 = min(num_tables, k0 + group)
                start, stop = k0 * per_table, k1 * per_table
                local = (flat_rows[:, k0:k1] - start).contiguous()
                part = flat_scores[:, k0:k1].contiguous()
                values = tables.detach()[start:stop]
                gs, gt = kernels.lookup_backward(
                    g_acc, local, part.to(acc), values.to(acc).contiguous(), per_table, True, need_scores)
                if need_scores:
                    grad_scores[:, k0:k1] = gs
                update(gt, start, stop, k0 == 0)
                del gt
        grad_bias = None
        if ctx.needs_input_grad[3]:
            grad_bias = g.sum(0).to(ctx.bias_dtype)
        if need_scores:
            grad_scores = grad_scores.to(scores.dtype).view(scores.shape)
        return None, grad_scores, None, grad_bias, None, None, None
