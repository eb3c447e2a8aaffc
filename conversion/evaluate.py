"""How close a converted MemoryFormer is to its teacher: per-layer errors. (Held-out perplexity is
`evaluation.perplexity.blocks_perplexity`, the one implementation.)"""

from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from .mapping import MEMORY_LAYER_NAMES, DenseLayer


@torch.no_grad()
def layer_errors(
    student: nn.Module,
    dense_blocks: list[dict[str, DenseLayer]],
    input_ids: torch.Tensor,
    batch_size: int = 16,
    progress: bool = False,
) -> list[dict[str, float]]:
    """Relative L2 error ||y_memory - y_dense|| / ||y_dense|| of every Memory Layer, over all tokens of `input_ids`
    [S, T] run through `student`: each dense layer gets the same input its Memory Layer receives in the student (for
    layer2, the inner norm's input GELU(u)). Returns one {name: error} per block."""
    squared_error = torch.zeros(len(dense_blocks), len(MEMORY_LAYER_NAMES), dtype=torch.float64)
    squared_norm = torch.zeros_like(squared_error)
    handles = []
    for block, (layer, dense) in enumerate(zip(student.model.layers, dense_blocks)):
        inner_input = {}  # GELU(u), the input of the Memory Block's inner norm: what the dense layer2 reads
        handles.append(layer.memory_block.norm.register_forward_pre_hook(_remember_input(inner_input)))
        for column, name in enumerate(MEMORY_LAYER_NAMES):
            source = inner_input if name == "memory_block.layer2" else None

            def accumulate(module, args, output, at=(block, column), target=dense[name], source=source):
                expected = target(source["x"] if source is not None else args[0])
                squared_error[at] += (output - expected).double().pow(2).sum()
                squared_norm[at] += expected.double().pow(2).sum()

            handles.append(layer.get_submodule(name).register_forward_hook(accumulate))
    try:
        for ids in tqdm(input_ids.split(batch_size), desc="per-layer errors", disable=not progress, leave=False):
            student(ids)
    finally:
        for handle in handles:
            handle.remove()
    errors = (squared_error / squared_norm.clamp_min(1e-300)).sqrt()
    return [dict(zip(MEMORY_LAYER_NAMES, row.tolist())) for row in errors]


def _remember_input(store: dict):
    def hook(module, args):
        store["x"] = args[0]

    return hook


__all__ = ["layer_errors"]
