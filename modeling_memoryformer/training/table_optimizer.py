"""Table optimizers applied in the backward pass: train a MemoryFormer's tables with a few bytes of state per row.

A MemoryFormer's tables are most of its parameters (MF-tiny: 415M of 467M). Trained with AdamW, every table parameter
costs 16 bytes: the weight, its gradient and two moments. Recommendation systems met the same problem with embedding
tables and solved it with row-wise optimizer state, applied as soon as a table's gradient is complete (FBGEMM's
table-batched embeddings). The rules here, for a table row r with gradient g_r (D values) at step t, after AdamW's
decoupled weight decay w <- w - lr * wd * w (as `torch.optim.AdamW`, on every row, hit or not):

- ``rowwise_adagrad`` (FBGEMM's exact row-wise AdaGrad; one float of state per row):
      s_r <- s_r + mean_j g_rj^2;      w_r <- w_r - lr * g_r / (sqrt(s_r) + eps)
- ``adam_rowwise`` (Adam with a full first moment and a row-wise second moment: "partial row-wise Adam"):
      m <- b1 m + (1 - b1) g;   v_r <- b2 v_r + (1 - b2) mean_j g_rj^2;
      w <- w - lr * (m / (1 - b1^t)) / (sqrt(v_r / (1 - b2^t)) + eps)

A "row" of the row-wise rules is a row of one of the paper's tables. The attention's Q, K and V are three Memory
Layers in the paper, with three tables, and one fused table here (`MemoryLayer.row_segments` = 3: each row holds
the Q, K and V rows of one bucket side by side), so the row-wise rules keep one state per row *of each of Q, K and
V*: a [rows, 3] state, applied to the table viewed as [3 rows, width / 3]. One state for the three together (what a
row of the fused table would give) ended 3.8% (AdaGrad) and 8.1% (Adam) above AdamW's perplexity in the demo
setting, since Q, K and V gradients differ in scale; one per Q, K and V row ends at 1.012x (AdaGrad) and 0.947x
(Adam), and at 1.013x and 1.014x on Tiny Shakespeare.

State per table parameter: rowwise_adagrad 4 bytes per row (0.2% of a 512-wide table); adam_rowwise 4 bytes per value
plus 4 per row, half of AdamW's two moments. Two block-wise variants (a second moment or AdaGrad sum per 64 columns
of a row) were offered before: more state than the row-wise rules and 2.4% (Adam) and 3.8% (AdaGrad) above AdamW's
perplexity on Tiny Shakespeare, so they were removed.

How it runs (`TableAdamW`): one optimizer object holds every parameter. The dense ones (embeddings, head, norms,
biases) take AdamW in `step()` as usual. The tables are updated inside the backward pass, fused into the Memory
Layer's backward: the optimizer attaches an update to each table parameter (memory_table_updates.TABLE_UPDATE_ATTR), and the
lookup's backward computes the table gradient one group of whole tables at a time (`memory_table_updates.update_group_bytes`:
at least a quarter of the last-level cache and, for float32 tables, twice the layer's output gradient, at most half
of its tables), takes that group's score gradient from the not yet updated rows, and hands the group to the rule at
once. No tensor the size of the tables ever holds a gradient and `.grad` stays None; the rules are row-wise, so
updating the rows group by group equals one update of the whole table. A table whose gradient arrives
by another path (a `.grad` set by hand, or under torch.compile, which traces the plain lookup) is updated by a
post-accumulate-grad hook or in `step()`, by the same rule. The learning-rate schedule reaches the tables through
their parameter group, like any group; the table states sit in `optimizer.state`, so `state_dict()` (the Trainer's
optimizer.pt) holds them and a resumed run continues exactly.

Semantics that differ from AdamW on every parameter, by construction:
- Gradient clipping: the global norm is only known after the whole backward, when the tables are already updated.
  Clipping (`max_grad_norm`) therefore covers the dense parameters, by their own global norm; the table updates are
  not clipped. Every rule divides the gradient by a running root mean square of the row, so a large gradient cannot
  make a large step (at most lr / sqrt(1 - b2) per value for the Adam rules, lr for the first AdaGrad step).
- Gradient accumulation over micro-batches would apply an update per micro-batch: refused
  (`check_table_optimizer_setup`); use a larger batch instead.
- A table updated twice before `step()` (two backward passes, or one Memory Layer looked up twice per forward) is an
  error: each rule takes one gradient per step.
- Several processes (DDP): DDP's reducer would average a table's gradient only after the table had been updated
  with the rank's own gradient, so the tables are kept out of DDP (`exclude_tables_from_ddp`) and each group's
  gradient is averaged over the ranks before its update (an all-reduce with SUM, then a division: never gloo's AVG,
  see `training.sharding`). Every rank then applies the same update to the same rows, and the run equals one
  process at the same global batch, holding one group's gradient at a time, as in one process.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch import nn

from ..memory_table_updates import TABLE_UPDATE_ATTR
from . import TABLE_OPTIMIZERS
from .settings import check_table_optimizer_setup

TABLE_RULES = TABLE_OPTIMIZERS[1:]


def table_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable `tables` of every Memory Layer of `model` (found by class name, so remote-code and PEFT-wrapped
    models are covered too)."""
    return [tables for tables, _ in _tables_and_segments(model)]


def _tables_and_segments(model: nn.Module) -> list[tuple[nn.Parameter, int]]:
    """(tables, row segments) of every Memory Layer with trainable tables: the segments are the paper's tables that
    one row holds side by side (`MemoryLayer.row_segments`: 3 for the fused Q/K/V layer, else 1)."""
    found = []
    for module in model.modules():
        if type(module).__name__ == "MemoryLayer":
            tables = getattr(module, "tables", None)
            if isinstance(tables, nn.Parameter) and tables.requires_grad:
                segments = int(getattr(module, "row_segments", 1))
                if segments < 1 or tables.shape[1] % segments:
                    raise ValueError(f"A Memory Layer's row_segments ({segments}) must divide its width "
                                     f"({tables.shape[1]}).")
                found.append((tables, segments))
    return found


def _fused_step_ops(weight: torch.Tensor, grad: torch.Tensor, *states: torch.Tensor):
    """The one-pass table updates when they apply (float32 tensors, contiguous, on the weight's device, and the fused
    CPU kernels or the Triton ones in use for it), else None: the PyTorch form below computes the same formulas in
    several passes over the table."""
    tensors = (weight, grad, *states)
    if not all(t.dtype == torch.float32 and t.device == weight.device and t.is_contiguous() for t in tensors):
        return None
    from ..memory_kernels import backend_for

    kernels = backend_for(weight)
    return kernels if kernels.name in ("fused", "triton") else None


def second_moment_shape(rows: int, segments: int = 1) -> tuple[int, ...]:
    """The shape of a table's second moment (or AdaGrad sum), the same for every rule: [rows], or [rows, segments]
    for a table whose rows hold `segments` of the paper's rows side by side."""
    return (rows, segments) if segments > 1 else (rows,)


def _as_segment_rows(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """For a state of [rows, segments]: every tensor viewed as rows of one segment ([R, W] as [R * S, W / S], [R, S]
    as [R * S]), so that the row-wise formulas (and the fused one-pass update) apply as they are. Views for the
    tensors that are updated in place; other tensors unchanged."""
    state = tensors[-1]
    if state.dim() == 1:
        return tensors
    segments = state.shape[1]
    return tuple(t.reshape(-1) if t is state else t.view(t.shape[0] * segments, t.shape[1] // segments)
                 for t in tensors)


def _check_row_state(weight: torch.Tensor, grad: torch.Tensor, state: torch.Tensor, name: str) -> None:
    if weight.dim() != 2 or grad.shape != weight.shape:
        raise ValueError(f"weight and grad must be [rows, width] of the same shape, got {tuple(weight.shape)} and "
                         f"{tuple(grad.shape)}.")
    if state.shape != weight.shape[:1]:
        raise ValueError(f"{name} must hold one value per row, shape ({weight.shape[0]},), got {tuple(state.shape)}; "
                         "a table whose rows hold several of the paper's rows is updated as rows of one segment "
                         "(see _as_segment_rows).")


def rowwise_adagrad_update(weight: torch.Tensor, grad: torch.Tensor, state_sum: torch.Tensor, lr: float, eps: float,
                           weight_decay: float) -> None:
    """One row-wise AdaGrad step in place (see the module docstring): weight and grad [R, D], state_sum [R] float32.
    The arithmetic is in float32 (float64 for float64 weights); the weight is written back in its own dtype. float32
    tables take the fused kernel's one-pass update when it is in use (`memory_ops.use_kernel("torch")` avoids it)."""
    _check_row_state(weight, grad, state_sum, "state_sum")
    ops = _fused_step_ops(weight, grad, state_sum)
    if ops is not None:
        ops.rowwise_adagrad_step(weight, grad, state_sum, lr, eps, weight_decay)
        return
    acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
    w = weight.to(acc)
    g = grad.to(acc)
    if weight_decay:
        w.mul_(1.0 - lr * weight_decay)
    state_sum.add_(g.square().mean(dim=1).to(state_sum.dtype))
    w.addcdiv_(g, (state_sum.to(acc).sqrt() + eps).unsqueeze(1), value=-lr)
    _store(weight, w)


def adam_rowwise_update(weight: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                        step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """One step of Adam with a row-wise second moment, in place: exp_avg [R, D] and exp_avg_sq [R] in float32, `step`
    the number of this step (1 for the first)."""
    _check_row_state(weight, grad, exp_avg_sq, "exp_avg_sq")
    if exp_avg.shape != weight.shape:
        raise ValueError(f"exp_avg must have the weight's shape {tuple(weight.shape)}, got {tuple(exp_avg.shape)}.")
    ops = _fused_step_ops(weight, grad, exp_avg, exp_avg_sq)
    if ops is not None:
        ops.adam_rowwise_step(weight, grad, exp_avg, exp_avg_sq, step, lr, betas[0], betas[1], eps, weight_decay)
        return
    acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
    beta1, beta2 = betas
    w = weight.to(acc)
    g = grad.to(acc)
    if weight_decay:
        w.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(g.to(exp_avg.dtype), 1.0 - beta1)
    exp_avg_sq.mul_(beta2).add_(g.square().mean(dim=1).to(exp_avg_sq.dtype), alpha=1.0 - beta2)
    bias1 = 1.0 - beta1**step
    bias2 = 1.0 - beta2**step
    denom = (exp_avg_sq.to(acc) / bias2).sqrt_().add_(eps).unsqueeze(1)
    w.addcdiv_(exp_avg.to(acc), denom, value=-lr / bias1)
    _store(weight, w)


def stochastic_round_to_bf16(value: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """`value` (float32) rounded to bfloat16 stochastically: up or down to the two neighbouring bf16 values with
    probabilities that make the expectation equal to `value`, so that updates far smaller than a bf16 step still move
    the weight on average. Adds a uniform 16-bit integer to the float32 bit pattern and truncates (the sign is a
    separate bit, so this rounds the magnitude). Values bf16 holds exactly are unchanged; inf and NaN are kept (round
    to nearest). Draws from `generator` (default: torch's global generator, which Trainer checkpoints save)."""
    if value.dtype != torch.float32:
        raise ValueError(f"stochastic_round_to_bf16 takes float32 values, got {value.dtype}.")
    bits = value.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
    rounded = ((bits + noise) & -65536).view(torch.float32)  # -65536 = 0xFFFF0000: keep sign, exponent, 7 bits
    rounded = torch.where(torch.isfinite(value) & torch.isfinite(rounded), rounded, value)
    return rounded.to(torch.bfloat16)  # exact: the low 16 bits are zero


def _store(weight: torch.Tensor, value: torch.Tensor) -> None:
    """The updated float32 (or float64) value back into the weight: bf16 weights by stochastic rounding (an update
    smaller than half a bf16 step would otherwise vanish), other dtypes by a plain copy."""
    if weight.dtype == torch.bfloat16 and value.dtype == torch.float32:
        weight.copy_(stochastic_round_to_bf16(value))
    elif value.data_ptr() != weight.data_ptr():
        weight.copy_(value)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def average_over_ranks(grad: torch.Tensor) -> None:
    """In place: the mean of `grad` over the processes (SUM all-reduce, then a division; nothing on one process)."""
    world = _world_size()
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        grad.div_(world)


def exclude_tables_from_ddp(model: nn.Module) -> list[str]:
    """Keep the Memory Layer tables out of DistributedDataParallel (which reads `_ddp_params_and_buffers_to_ignore`
    when it wraps `model`): `TableAdamW` reduces them itself, in its hooks. The tables are broadcast from rank 0
    once here, since DDP no longer does it for them. Returns their names."""
    ids = {id(p) for p in table_parameters(model)}
    names = [name for name, p in model.named_parameters() if id(p) in ids]
    if _world_size() > 1:
        import torch.distributed as dist

        from torch.nn.parallel import DistributedDataParallel

        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, sorted({*getattr(model, "_ddp_params_and_buffers_to_ignore", ()), *names}))
        with torch.no_grad():
            for p in table_parameters(model):
                dist.broadcast(p.data, src=0)
    return names


class TableAdamW(torch.optim.AdamW):
    """AdamW for the dense parameters and a row-wise rule for the Memory Layer tables, applied in the backward pass.

    Args:
        params: parameter groups as for AdamW; the groups whose ``"table_rule"`` is set ("rowwise_adagrad" or
            "adam_rowwise") hold tables. `table_param_groups` builds them from a model.
        lr, betas, eps, weight_decay: as for AdamW; they apply to the table rules too (betas[0] is unused by
            rowwise_adagrad).
        **adamw_kwargs: passed to AdamW (e.g. ``fused=True``).

    Each table parameter gets a post-accumulate-grad hook that updates it and sets its ``.grad`` to None; `step()`
    then runs AdamW on the parameters that still have a gradient (the dense ones). Call `remove_hooks()` before
    training the same model with another optimizer.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 **adamw_kwargs):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **adamw_kwargs)
        self._hooks = []
        self._fused: list[nn.Parameter] = []
        self._updated: set[int] = set()  # tables updated since the last step(): a second update would be an error
        seen = set()
        for group in self.param_groups:
            rule = group.setdefault("table_rule", None)
            if rule is None:
                continue
            if rule not in TABLE_RULES:
                raise ValueError(f"table_rule must be one of {TABLE_RULES}, got {rule!r}.")
            for p in group["params"]:
                if id(p) in seen:
                    continue
                seen.add(id(p))
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(group)))
                setattr(p, TABLE_UPDATE_ATTR, _FusedUpdate(self, p, group))
                self._fused.append(p)

    def _make_hook(self, group: dict):
        def hook(param: torch.Tensor) -> None:
            if param.grad is None:
                return
            with torch.no_grad():
                self.update_table(param, param.grad, group)
            param.grad = None

        return hook

    @torch.no_grad()
    def update_table(self, param: torch.Tensor, grad: torch.Tensor, group: dict) -> None:
        """Apply `group`'s table rule to `param` with `grad` (2-D [rows, width]) and advance its state."""
        if grad.is_sparse:
            raise ValueError("The table optimizers take dense table gradients.")
        self.begin_table_step(param, group)
        self.update_rows(param, grad, 0, param.shape[0], group)

    @torch.no_grad()
    def begin_table_step(self, param: torch.Tensor, group: dict) -> None:
        """Count a step of `param`'s rule (creating its state at the first), before any of its rows is updated. A
        table updated twice between two `step()` calls (two backward passes, or a lookup of the same tables twice
        in one forward) is an error: the rules take one gradient per step."""
        if param.dim() != 2:
            raise ValueError(f"A table parameter must be 2-D [rows, width], got shape {tuple(param.shape)}.")
        if id(param) in self._updated:
            raise RuntimeError(
                "A table was updated twice before optimizer.step(): the table optimizers apply one gradient per table "
                "and step, in the backward pass. Call optimizer.step() after each backward, use one forward per "
                "backward (no gradient accumulation), and look each Memory Layer up once per forward; or train "
                "with --table-optimizer adamw."
            )
        self._updated.add(id(param))
        state = self.state[param]
        rows = param.shape[0]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            rule = group["table_rule"]
            shape = second_moment_shape(rows, _segments_of(param, group))
            if rule.startswith("adam_"):
                state["exp_avg"] = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
                state["exp_avg_sq"] = torch.zeros(shape, dtype=torch.float32, device=param.device)
            else:
                state["sum"] = torch.zeros(shape, dtype=torch.float32, device=param.device)
        state["step"] += 1

    @torch.no_grad()
    def update_rows(self, param: torch.Tensor, grad: torch.Tensor, start: int, stop: int, group: dict) -> None:
        """Apply `group`'s rule to rows [start, stop) of `param`, whose gradient over the processes is `grad`
        ([stop - start, width], this process's share: averaged over the ranks here), at the step counted by
        `begin_table_step`. Row-wise rules need nothing from other rows, so any split of the rows gives the same
        result as one update of the whole table."""
        average_over_ranks(grad)
        state = self.state[param]
        lr, eps, weight_decay = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
        weight = param[start:stop]
        if "sum" in state:  # rowwise_adagrad
            rowwise_adagrad_update(*_as_segment_rows(weight, grad.contiguous(), state["sum"][start:stop]),
                                   lr, eps, weight_decay)
        else:
            weight, grad, exp_avg, exp_avg_sq = _as_segment_rows(
                weight, grad.contiguous(), state["exp_avg"][start:stop], state["exp_avg_sq"][start:stop])
            adam_rowwise_update(weight, grad, exp_avg, exp_avg_sq, int(state["step"].item()), lr,
                                tuple(group["betas"]), eps, weight_decay)

    @torch.no_grad()
    def step(self, closure=None):
        """AdamW on the parameters that still hold a gradient. A table whose gradient is still there (its hook did not
        run, e.g. the gradient was set by hand) is updated by its rule here."""
        for group in self.param_groups:
            if group["table_rule"] is not None:
                for p in group["params"]:
                    if p.grad is not None:
                        self.update_table(p, p.grad, group)
                        p.grad = None
        self._updated.clear()
        return super().step(closure)

    def load_state_dict(self, state_dict: dict) -> None:
        # Optimizer.load_state_dict casts every state tensor to its parameter's dtype (bf16 for bf16 tables); the table
        # states are float32, so they are taken again from the saved values, uncast.
        super().load_state_dict(state_dict)
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups):
            if group["table_rule"] is None:
                continue
            for index, p in zip(saved_group["params"], group["params"]):
                for key, value in state_dict["state"].get(index, {}).items():
                    if torch.is_tensor(value):
                        self.state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True)

    def remove_hooks(self) -> None:
        """Detach this optimizer from its tables: their gradients are plain `.grad` again."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for p in self._fused:
            if getattr(getattr(p, TABLE_UPDATE_ATTR, None), "optimizer", None) is self:
                delattr(p, TABLE_UPDATE_ATTR)
        self._fused.clear()


def _segments_of(param: torch.Tensor, group: dict) -> int:
    """The row segments of `param` recorded in its group by `table_param_groups` (1 where none are recorded)."""
    segments = group.get("row_segments")
    if not segments:
        return 1
    index = next(i for i, p in enumerate(group["params"]) if p is param)
    return int(segments[index])


class _FusedUpdate:
    """What `TableAdamW` attaches to a table parameter (under memory_ops.TABLE_UPDATE_ATTR) so that the Memory Layer's
    backward applies the rule to each group of rows as soon as their gradient exists: no table gradient is ever
    whole. Holds the parameter weakly, so a copy of the model (which copies this attribute) does not update it."""

    def __init__(self, optimizer: TableAdamW, param: nn.Parameter, group: dict):
        self.optimizer = optimizer
        self.owner = weakref.ref(param)
        self.group = group

    def __call__(self, grad: torch.Tensor, start: int, stop: int, first: bool) -> None:
        param = self.owner()
        if first:
            self.optimizer.begin_table_step(param, self.group)
        self.optimizer.update_rows(param, grad, start, stop, self.group)


def table_param_groups(model: nn.Module, rule: str, weight_decay: float,
                       no_decay_names: Iterable[str] = ()) -> list[dict]:
    """Parameter groups for `TableAdamW`: the tables (weight decay, `rule`), the other decayed parameters and the
    parameters in `no_decay_names` (no decay). Frozen parameters are left out."""
    if rule not in TABLE_RULES:
        raise ValueError(f"rule must be one of {TABLE_RULES}, got {rule!r}.")
    no_decay = set(no_decay_names)
    table_segments = {id(p): segments for p, segments in _tables_and_segments(model)}
    tables, segments, decay, plain = [], [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) in table_segments:
            tables.append(p)
            segments.append(table_segments[id(p)])
        elif name in no_decay:
            plain.append(p)
        else:
            decay.append(p)
    groups = [{"params": tables, "weight_decay": weight_decay, "table_rule": rule, "row_segments": segments},
              {"params": decay, "weight_decay": weight_decay},
              {"params": plain, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the optimizer's state tensors."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values()
               if torch.is_tensor(v))


def describe(rule: str) -> str:
    return {
        "adamw": "AdamW on every parameter (tables included): 8 bytes of moments per table value",
        "rowwise_adagrad": "row-wise AdaGrad on the tables, in the backward pass: 4 bytes of state per table row "
        "(per row of each of Q, K and V)",
        "adam_rowwise": "Adam with a row-wise second moment on the tables, in the backward pass: 4 bytes per value "
        "(a second moment per row of each of Q, K and V)",
    }[rule]


__all__ = ["TABLE_OPTIMIZERS", "TableAdamW", "adam_rowwise_update", "check_table_optimizer_setup", "describe",
           "optimizer_state_bytes", "rowwise_adagrad_update", "stochastic_round_to_bf16", "table_param_groups",
           "table_parameters"]

