"""Sharded data parallelism (FSDP2) for MemoryFormer on any device, CPU included.

Hash tables dominate a MemoryFormer's memory (MF-tiny: 415 M of 467 M parameters), so sharding them is the way to
train presets that do not fit one machine's memory with AdamW state. `shard_model` applies PyTorch's `fully_shard`
(FSDP2) to every module listed in the model's `_no_split_modules` (the decoder layers) and then to the root, so each
rank holds 1/world_size of every table and all-gathers one layer's tables just before using them.

The Trainer path does not reach this on CPU: with accelerate 1.15, `TrainingArguments(fsdp=True, fsdp_config=
{"version": 2, ...}, use_cpu=True)` silently trains with plain DDP, and FSDP version 1 refuses to start ("There are
currently no available devices found, must be one of 'XPU', 'CUDA', ..."). On GPUs the Trainer's FSDP wraps the same
`_no_split_modules` classes. On CPU, call `shard_model` in your own loop under `torchrun` (gloo backend).
"""

from __future__ import annotations

from torch import nn


def shard_model(model: nn.Module, **fully_shard_kwargs) -> nn.Module:
    """Apply FSDP2 `fully_shard` to each `_no_split_modules` block of `model`, then to `model`; returns `model`.

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
    return model
