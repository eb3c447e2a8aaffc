"""Sharded data parallelism (FSDP2) for MemoryFormer on any device, CPU included.

Hash tables dominate a MemoryFormer's memory (MF-tiny: 415 M of 467 M parameters), so sharding them is the way to
train models whose weights, gradients and AdamW state do not fit one process. PyTorch's `fully_shard` (FSDP2) is
applied to every decoder layer (the model's `_no_split_modules`) and then to the root: each rank holds 1/world_size
of every table (its rows split across ranks), all-gathers one layer's tables just before using them, and
reduce-scatters their gradients.

Three ways in, one engine (PyTorch's):

- `memoryformer train --fsdp` (under `torchrun` or `accelerate launch`), or `TrainingSettings(fsdp=True)`;
- `transformers.TrainingArguments(fsdp=True, fsdp_config=FSDP_CONFIG)` (or `accelerate launch --use_fsdp
  --fsdp_version 2`) with `MemoryFormerTrainer`. accelerate 1.15 sets FSDP up on accelerators only: on CPU it
  silently falls back to DDP. `enable_fsdp_on_cpu` (called by `MemoryFormerTrainer`) hands the same FSDP plugin to
  accelerate on CPU, so the Trainer shards, saves and resumes exactly as it does on GPUs;
- `shard_model(model)` in a hand-written loop.

The gloo pitfall: FSDP2 reduce-scatters float32 gradients with `ReduceOp.AVG`, and gloo's AVG has been reported to
return the sum on some versions (https://github.com/pytorch/pytorch/issues/162338), which would silently double
every gradient on 2 ranks. `sum_reductions_on_gloo` makes FSDP2 reduce with SUM and divide by the world size itself
on gloo, whatever the version; `gloo_avg_is_mean` probes the installed backend (the tests run it).
"""

from __future__ import annotations

from torch import nn

# The Trainer's side of FSDP2 lives with the trainer; it is re-exported here, where users look for it.
from ..training.sharding import (
    FSDP_CONFIG,
    enable_fsdp_on_cpu,
    fsdp_training_arguments,
    full_state_dict,
    sum_reductions_on_gloo,
)


def gloo_avg_is_mean(group=None) -> bool:
    """Whether `ReduceOp.AVG` gives the mean on this process group for the collectives FSDP2 and DDP use
    (all_reduce, and FSDP2's reduce-scatter), probed with known values: rank r contributes r + 1 everywhere."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    expected = (world + 1) / 2
    values = torch.full((3 * world,), float(rank + 1))
    dist.all_reduce(values, op=dist.ReduceOp.AVG, group=group)
    shard = torch.empty(3)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None)  # what FSDP2 calls, where it exists
    if reduce_scatter is None:
        reduce_scatter = dist.reduce_scatter_tensor
    reduce_scatter(shard, torch.full((3 * world,), float(rank + 1)), op=dist.ReduceOp.AVG, group=group)
    return bool(torch.allclose(values, torch.tensor(expected)) and torch.allclose(shard, torch.tensor(expected)))


def shard_model(model: nn.Module, **fully_shard_kwargs) -> nn.Module:
    """Apply FSDP2 `fully_shard` to each `_no_split_modules` block of `model`, then to `model`; returns `model`
    (on gloo with SUM reductions, see `sum_reductions_on_gloo`).

    Needs an initialised process group (`torch.distributed.init_process_group`, e.g. under torchrun).
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "shard_model needs an initialised torch.distributed process group: launch with `torchrun "
            "--nproc_per_node N script.py` and call torch.distributed.init_process_group('gloo') (CPU) first."
        )
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    if not block_names:
        raise ValueError(f"{type(model).__name__} declares no `_no_split_modules` to shard by.")
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise ValueError(f"No module of class {sorted(block_names)} found in {type(model).__name__}.")
    for block in blocks:
        fully_shard(block, **fully_shard_kwargs)
    fully_shard(model, **fully_shard_kwargs)
    sum_reductions_on_gloo(model)
    return model


__all__ = [
    "FSDP_CONFIG",
    "enable_fsdp_on_cpu",
    "fsdp_training_arguments",
    "full_state_dict",
    "gloo_avg_is_mean",
    "shard_model",
    "sum_reductions_on_gloo",
]
