"""Initialise the tables of a converted MemoryFormer: data-free (from the dense weights alone) or calibrated (from the
dense layers' behaviour on real text). The formulas are in `tables`; this module says which input model and
which target each Memory Layer of a block gets.

Data-free input models (all coordinates independent; a LayerNorm's normalised value taken as N(0, 1)):

    attention.query_key_value  z = LN1(x):  z_i ~ N(beta1_i, gamma1_i^2)                    target  W_qkv z + b_qkv
    attention.dense            o = attention output, a convex mix of value vectors, modelled as one value
                               vector:  o_j ~ N((W_v beta1 + b_v)_j, sum_i W_v,ji^2 gamma1_i^2)   target  W_o o + b_o
    memory_block.layer1        z = LN2(.):  z_i ~ N(beta2_i, gamma2_i^2)                    target  W_1 z + b_1
    memory_block.layer2        n = LN(GELU(u)) with u_j ~ N((W_1 beta2 + b_1)_j, sum_i W_1,ji^2 gamma2_i^2) and the
                               norm's per-token mean / std at their expectations mu_g, sigma_g, so GELU(u) =
                               mu_g + sigma_g n:   target  W_2 GELU(u) + b_2 = (sigma_g W_2) n + (b_2 + mu_g W_2 1)

Calibrated: layer by layer in the order data flows (QKV, attention output, layer1, layer2 of block 0, then block 1...),
each Memory Layer is fitted on the inputs it really receives in the partially converted student (every earlier
Memory Layer already fitted), against the target "the teacher's dense layer applied to that same input" (for layer2:
W_2 GELU(u) + b_2 on the student's own u, since the student's layer2 sees LN(GELU(u))). Fitting on the student's own
activations means a layer's fit sees, and can compensate for, the distribution shift that earlier approximations
cause, instead of being fitted to inputs it will never receive.
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from modeling_memoryformer.transformers_compat import causal_mask

from .mapping import MEMORY_LAYER_NAMES, DenseLayer
from .tables import (
    CoordinateMoments,
    data_free_tables,
    fit_tables_ridge,
    gaussian_inputs,
    normal_nodes,
    normalised_gelu_inputs,
)


# ---------------------------------------------------------------------------------------------------------------------
# Data-free


@torch.no_grad()
def data_free_init(student: nn.Module, dense_blocks: list[dict[str, DenseLayer]], num_nodes: int = 2048) -> None:
    """Set every table (and Memory Layer bias) of `student` to the data-free least-squares solution.

    `student` must already hold the mapped norms (`copy_dense_weights`): the input models read their affine params.
    """
    config = student.config
    nodes = normal_nodes(num_nodes)
    temperature = config.hash_temperature
    for layer, dense in zip(tqdm(student.model.layers, desc="data-free tables", leave=False), dense_blocks):
        models = _data_free_input_models(layer, dense, nodes, config.layer_norm_eps)
        for name, (values, weight, bias) in models.items():
            memory_layer = layer.get_submodule(name)
            tables, new_bias = data_free_tables(
                CoordinateMoments.of(values, temperature), weight, bias, memory_layer.hash_bits
            )
            memory_layer.tables.copy_(tables)
            memory_layer.bias.copy_(new_bias)


def _data_free_input_models(
    layer: nn.Module, dense: dict[str, DenseLayer], nodes: torch.Tensor, eps: float
) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per Memory Layer of a block: (input values at the nodes [d_in, n], target weight [d_out, d_in], target bias)
    such that the dense output is `weight @ input + bias` (module docstring)."""
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    hidden = norm1.weight.shape[0]
    qkv, layer1, layer2 = dense["attention.query_key_value"], dense["memory_block.layer1"], dense["memory_block.layer2"]
    value_weight = qkv.weight[2 * hidden :].double()  # [Q | K | V] order after the permutation
    value_mean = value_weight @ norm1.bias.double() + qkv.bias[2 * hidden :].double()
    value_std = (value_weight.pow(2) @ norm1.weight.double().pow(2)).sqrt()
    u_weight = layer1.weight.double()
    u_mean = u_weight @ norm2.bias.double() + layer1.bias.double()
    u_std = (u_weight.pow(2) @ norm2.weight.double().pow(2)).sqrt()
    normalised, mu_g, sigma_g = normalised_gelu_inputs(u_mean, u_std, nodes, eps)
    w2, out = layer2.weight, dense["attention.dense"]
    return {
        "attention.query_key_value": (_ln_values(norm1, nodes), qkv.weight, qkv.bias),
        "attention.dense": (gaussian_inputs(value_mean, value_std, nodes), out.weight, out.bias),
        "memory_block.layer1": (_ln_values(norm2, nodes), layer1.weight, layer1.bias),
        "memory_block.layer2": (normalised, sigma_g * w2, layer2.bias + mu_g * w2.sum(1)),
    }


def _ln_values(norm: nn.LayerNorm, nodes: torch.Tensor) -> torch.Tensor:
    return gaussian_inputs(norm.bias.detach(), norm.weight.detach().abs(), nodes)


# ---------------------------------------------------------------------------------------------------------------------
# Calibrated


class _Captured(Exception):
    """Raised by a hook once the input of the layer being fitted is captured: the rest of the block is not needed."""


@torch.no_grad()
def calibrate(
    student: nn.Module,
    dense_blocks: list[dict[str, DenseLayer]],
    input_ids: torch.Tensor,
    ridge: float = 0.1,
    max_sweeps: int = 20,
    tolerance: float = 1e-4,
    batch_size: int = 16,
    progress: bool = True,
) -> list[dict[str, dict]]:
    """Fit every Memory Layer of `student` by ridge least squares on calibration sequences `input_ids` [S, T], layer by
    layer on the student's own activations (module docstring). The current tables are the prior (start point and
    ridge centre), so run `data_free_init` first. Memory: the block inputs of all sequences (S T d floats) plus one
    layer's fit (N K hash entries and N d_out targets, N = S T).

    Returns per block, per Memory Layer: {"ridge_lambda", "sweeps", "relative_residual_prior",
    "relative_residual"} (residuals on the calibration tokens).
    """
    model = student.model
    batches = [model.embed_tokens(ids) for ids in input_ids.split(batch_size)]  # block inputs, [B, T, d] each
    report = []
    layers = tqdm(list(enumerate(model.layers)), desc="calibrating blocks", disable=not progress)
    for index, layer in layers:
        report.append({})
        for name in MEMORY_LAYER_NAMES:
            memory_layer = layer.get_submodule(name)
            rows, scores, targets = _collect(model, layer, name, dense_blocks[index][name], batches)
            fit = fit_tables_ridge(
                rows, scores, targets, memory_layer.tables.detach(), ridge, max_sweeps, tolerance,
                progress=progress, description=f"block {index} {name}",
            )
            memory_layer.tables.copy_(fit.tables)
            memory_layer.bias.copy_(fit.bias)
            report[-1][name] = {
                "ridge_lambda": fit.ridge_lambda,
                "sweeps": len(fit.relative_residuals) - 1,
                "relative_residual_prior": fit.relative_residuals[0],
                "relative_residual": fit.relative_residuals[-1],
            }
        batches = [layer(hidden, **_block_arguments(model, hidden)) for hidden in batches]
    return report


def _block_arguments(model: nn.Module, hidden: torch.Tensor) -> dict:
    """Causal mask and rotary embedding for a decoder layer run on its own, as `MemoryFormerModel.forward` builds them."""
    position_ids = torch.arange(hidden.shape[1], device=hidden.device)[None, :]
    mask = causal_mask(config=model.config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=position_ids)
    return {"attention_mask": mask, "position_embeddings": model.rotary_emb(hidden, position_ids=position_ids)}


def _collect(
    model: nn.Module, layer: nn.Module, name: str, dense: DenseLayer, batches: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the block on every batch up to the Memory Layer `name`; return its hash (rows, scores [N, K]) and the dense
    target [N, d_out] on the same input (for layer2 the dense layer reads the inner norm's input, GELU(u))."""
    memory_layer = layer.get_submodule(name)
    dense_input_module = layer.memory_block.norm if name == "memory_block.layer2" else memory_layer
    rows, scores, targets, dense_input = [], [], [], {}

    def take_dense_input(module, args):
        dense_input["x"] = args[0]

    def take_memory_input(module, args):
        x = args[0]
        hashed_rows, hashed_scores = memory_layer.hash(x)
        rows.append(hashed_rows.reshape(-1, hashed_rows.shape[-1]))
        scores.append(hashed_scores.reshape(-1, hashed_scores.shape[-1]))
        targets.append(dense(dense_input["x"]).reshape(-1, dense.weight.shape[0]))
        raise _Captured

    handles = [dense_input_module.register_forward_pre_hook(take_dense_input)]
    handles.append(memory_layer.register_forward_pre_hook(take_memory_input))
    try:
        for hidden in batches:
            try:
                layer(hidden, **_block_arguments(model, hidden))
            except _Captured:
                pass
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat(rows), torch.cat(scores), torch.cat(targets)


__all__ = ["calibrate", "data_free_init"]
