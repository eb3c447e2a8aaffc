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

import contextlib
import os

from torch import nn

# The `fsdp_config` of TrainingArguments for a MemoryFormer: FSDP2, one unit per decoder layer (by the model's
# `_no_split_modules`), parameters freed after each layer's forward, full (unsharded) state dicts in saved models so
# that `from_pretrained` reads them in one process.
FSDP_CONFIG = {
    "version": 2,
    "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    "reshard_after_forward": True,
    "state_dict_type": "FULL_STATE_DICT",
}


def fsdp_training_arguments() -> dict:
    """The TrainingArguments fields that turn FSDP2 on for a MemoryFormer (see `FSDP_CONFIG`)."""
    return {"fsdp": True, "fsdp_config": dict(FSDP_CONFIG)}


def enable_fsdp_on_cpu(trainer) -> bool:
    """Give accelerate the FSDP plugin it ignores on CPU; returns whether FSDP is on.

    The Trainer builds a FullyShardedDataParallelPlugin from `args.fsdp` / `fsdp_config` (accelerate builds one from
    `ACCELERATE_USE_FSDP` and the `FSDP_*` variables of `accelerate launch --use_fsdp`), but accelerate's state
    keeps `MULTI_CPU` on CPU and later wraps the model in DDP. Here the state becomes FSDP with that plugin, so
    `accelerator.prepare` shards the model with `fully_shard` and the Trainer saves and loads FSDP checkpoints."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if trainer.is_fsdp_enabled:
        return True
    state = trainer.accelerator.state
    plugin_args = trainer.args.fsdp_plugin_args
    from_env = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if state.distributed_type != DistributedType.MULTI_CPU or (plugin_args is None and not from_env):
        return False
    if plugin_args is None:  # from accelerate launch's FSDP_* variables; what they leave unset is FSDP_CONFIG's
        plugin_args = {"fsdp_version": int(os.environ.get("FSDP_VERSION", FSDP_CONFIG["version"]))}
        if "FSDP_AUTO_WRAP_POLICY" not in os.environ:
            plugin_args["auto_wrap_policy"] = FSDP_CONFIG["auto_wrap_policy"]
        if "FSDP_STATE_DICT_TYPE" not in os.environ:
            plugin_args["state_dict_type"] = FSDP_CONFIG["state_dict_type"]
    plugin = FullyShardedDataParallelPlugin(**plugin_args)
    if plugin.fsdp_version != 2:
        raise ValueError("FSDP on CPU needs FSDP2: set fsdp_config['version'] = 2 (or accelerate launch "
                         "--fsdp_version 2); FSDP1 does not run on CPU.")
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    # Both states: accelerate copies the process state (PartialState) into the accelerator state whenever an
    # AcceleratorState is made, as its optimizer wrapper and utilities do, which would turn FSDP back into MULTI_CPU.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    trainer.is_fsdp_enabled = True
    return True


@contextlib.contextmanager
def full_state_dict(trainer):
    """Within it, an FSDP trainer's `save_model` writes the whole model (safetensors, loadable by `from_pretrained`
    in one process) whatever state dict type its checkpoints use; the Trainer writes nothing otherwise."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None) if trainer.is_fsdp_enabled else None
    if plugin is None or "FULL_STATE_DICT" in str(plugin.state_dict_type):
        yield
        return
    before = plugin.state_dict_type
    plugin.set_state_dict_type("FULL_STATE_DICT")
    try:
        yield
    finally:
        plugin.set_state_dict_type(before)


def sum_reductions_on_gloo(model: nn.Module) -> int:
    """On a gloo process group, make every FSDP2 unit of `model` reduce gradients with SUM and divide them itself
    (never gloo's AVG, see the module docstring). Returns the number of units changed (0 elsewhere)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    if not dist.is_available() or not dist.is_initialized() or dist.get_backend() != "gloo":
        return 0
    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for unit in units:
        unit.set_force_sum_reduction_for_comms(True)
    return len(units)


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
