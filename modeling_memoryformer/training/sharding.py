"""FSDP2 in the Trainer: the sharding `TrainingSettings(fsdp=True)`, `memoryformer train --fsdp`,
`TrainingArguments(fsdp=True, fsdp_config=FSDP_CONFIG)` and `accelerate launch --use_fsdp` get, on CPU/gloo as on
GPUs (`integrations.distributed` tells the whole story and holds `shard_model` for a loop of your own).

accelerate 1.15 sets FSDP up on accelerators only: on CPU it silently falls back to DDP. `enable_fsdp_on_cpu`
(called by `MemoryFormerTrainer`) hands accelerate's own FSDP plugin to its state on CPU too, so the Trainer shards,
saves and resumes exactly as it does on GPUs. On gloo, `sum_reductions_on_gloo` makes FSDP2 reduce gradients with SUM
and divide them itself, never with gloo's AVG (reported to return the sum on some versions).
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


__all__ = ["FSDP_CONFIG", "enable_fsdp_on_cpu", "fsdp_training_arguments", "full_state_dict", "sum_reductions_on_gloo"]
