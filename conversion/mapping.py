"""GPT-NeoX (Pythia) -> MemoryFormer: the architecture mapping.

What carries over unchanged: token embeddings (`embed_in` -> `model.embed_tokens`), the LM head (`embed_out`, named
`lm_head` by transformers), every LayerNorm (`input_layernorm`, `post_attention_layernorm`, `final_layer_norm` ->
`model.norm`), the residual layout (`use_parallel_residual`), the rotary settings and the norm epsilon.

What becomes a Memory Layer (each keeps its dense layer's bias as the starting point of its own bias):

    attention.query_key_value  -> attention.query_key_value   (rows permuted, see `qkv_permutation`)
    attention.dense            -> attention.dense             (config attention_output="memory")
    mlp.dense_h_to_4h          -> memory_block.layer1         (GELU kept: memory_block_activation="gelu")
    mlp.dense_4h_to_h          -> memory_block.layer2         (expand_bits=0: it hashes its 4d input with tau bits)

The Memory Block has a LayerNorm between GELU and layer2 that Pythia's MLP has not; it is set to the identity affine
map (weight 1, bias 0) and the tables of layer2 absorb the normalisation (see `tables`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..configuration_memoryformer import MemoryFormerConfig
from .settings import ConversionError


SUPPORTED_ACTIVATIONS = ("gelu",)  # nn.GELU() (exact erf form) is what the Memory Block applies




# ---------------------------------------------------------------------------------------------------------------------
# Configuration


def memoryformer_config_from_gpt_neox(
    source,
    hash_bits: int = 8,
    hash_temperature: float = 1.0,
    hash_score: str = "paper",
) -> MemoryFormerConfig:
    """The MemoryFormerConfig of the converted model, or a `ConversionError` naming what cannot be converted.

    `source` is a `GPTNeoXConfig` (or any config: a different model_type is rejected here, before anything is
    loaded or written).
    """
    model_type = getattr(source, "model_type", None)
    if model_type != "gpt_neox":
        raise ConversionError(
            f"The source is a {model_type!r} model; only GPT-NeoX checkpoints (model_type 'gpt_neox', the Pythia "
            "family) can be converted. Point --from at a GPTNeoXForCausalLM folder or Hub id."
        )
    if source.hidden_act not in SUPPORTED_ACTIVATIONS:
        raise ConversionError(
            f"hidden_act={source.hidden_act!r} is not supported: the Memory Block applies the exact GELU "
            f"(nn.GELU()), so the source MLP must use one of {SUPPORTED_ACTIVATIONS} (all Pythia models do)."
        )
    rope = dict(source.rope_parameters or {})
    if rope.get("rope_type", "default") != "default":
        raise ConversionError(
            f"rope_parameters['rope_type']={rope.get('rope_type')!r} is not supported: MemoryFormer implements only "
            "the default GPT-NeoX rotary embedding. Convert a checkpoint without RoPE scaling."
        )
    try:
        return MemoryFormerConfig(
            vocab_size=source.vocab_size,
            hidden_size=source.hidden_size,
            num_hidden_layers=source.num_hidden_layers,
            num_attention_heads=source.num_attention_heads,
            max_position_embeddings=source.max_position_embeddings,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": float(rope.get("rope_theta", 10000.0)),
                "partial_rotary_factor": float(rope.get("partial_rotary_factor", 1.0)),
            },
            hash_bits=hash_bits,
            expand_bits=0,  # layer2 hashes the intermediate_size features with tau bits
            intermediate_size=source.intermediate_size,
            hash_score=hash_score,
            hash_temperature=hash_temperature,
            memory_bias=True,
            norm_type="layernorm",
            layer_norm_eps=source.layer_norm_eps,
            use_parallel_residual=source.use_parallel_residual,
            attention_output="memory",
            memory_block_activation="gelu",
            attention_dropout=float(source.attention_dropout),
            hidden_dropout=float(source.hidden_dropout),
            initializer_range=source.initializer_range,
            tie_word_embeddings=bool(source.tie_word_embeddings),
            bos_token_id=source.bos_token_id,
            eos_token_id=source.eos_token_id,
            pad_token_id=source.pad_token_id,
        )
    except ValueError as error:  # MemoryFormerConfig checks the values and names the field
        if "hash_bits" in str(error):  # the one value of the MemoryFormer's that is the user's choice, not the source's
            raise ConversionError(
                f"--hash-bits {hash_bits!r} cannot convert this source: {error} Pick a --hash-bits that divides both "
                f"hidden_size={source.hidden_size} and intermediate_size={source.intermediate_size}; the paper uses 8."
            ) from error
        raise ConversionError(f"The source configuration cannot be represented as a MemoryFormer: {error}") from error


# ---------------------------------------------------------------------------------------------------------------------
# Weights


def qkv_permutation(num_heads: int, head_dim: int) -> torch.Tensor:
    """Row order that turns GPT-NeoX's fused QKV output into MemoryFormer's.

    GPT-NeoX views its 3d outputs as [heads, 3, head_dim] (per head: q, k, v); MemoryFormer's fused Memory Layer
    outputs [3, heads, head_dim] ([Q | K | V]). Returns `perm` [3d] with `memoryformer_row[i] = gpt_neox_row[perm[i]]`.
    """
    return torch.arange(3 * num_heads * head_dim).view(num_heads, 3, head_dim).transpose(0, 1).reshape(-1)


@dataclass
class DenseLayer:
    """A dense layer of the teacher that a Memory Layer replaces: y = x W^T + b, W [d_out, d_in], b [d_out]."""

    weight: torch.Tensor
    bias: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight.to(x.dtype), self.bias.to(x.dtype))


MEMORY_LAYER_NAMES = ("attention.query_key_value", "attention.dense", "memory_block.layer1", "memory_block.layer2")


def dense_layers(teacher: nn.Module) -> list[dict[str, DenseLayer]]:
    """Per block, the teacher's dense layers keyed by the name of the Memory Layer that replaces them (QKV rows already
    in MemoryFormer order)."""
    config = teacher.config
    perm = qkv_permutation(config.num_attention_heads, config.hidden_size // config.num_attention_heads)
    blocks = []
    for layer in teacher.gpt_neox.layers:
        qkv = layer.attention.query_key_value
        blocks.append(
            {
                "attention.query_key_value": DenseLayer(qkv.weight.detach()[perm], _bias(qkv)[perm]),
                "attention.dense": DenseLayer(layer.attention.dense.weight.detach(), _bias(layer.attention.dense)),
                "memory_block.layer1": DenseLayer(layer.mlp.dense_h_to_4h.weight.detach(), _bias(layer.mlp.dense_h_to_4h)),
                "memory_block.layer2": DenseLayer(layer.mlp.dense_4h_to_h.weight.detach(), _bias(layer.mlp.dense_4h_to_h)),
            }
        )
    return blocks


def _bias(linear: nn.Linear) -> torch.Tensor:
    """The layer's bias, or zeros when it has none (GPT-NeoX with attention_bias=False)."""
    if linear.bias is None:
        return torch.zeros(linear.out_features, dtype=linear.weight.dtype, device=linear.weight.device)
    return linear.bias.detach()


@torch.no_grad()
def copy_dense_weights(teacher: nn.Module, student: nn.Module) -> None:
    """Copy what carries over unchanged (embeddings, LM head, norms) and set every Memory Layer's bias to its dense
    layer's bias. The Memory Block's inner LayerNorm becomes the identity affine map. Tables are left as they are."""
    source, target = teacher.gpt_neox, student.model
    target.embed_tokens.weight.copy_(source.embed_in.weight)
    student.lm_head.weight.copy_(teacher.get_output_embeddings().weight)  # `embed_out` before transformers 5.23
    _copy_norm(source.final_layer_norm, target.norm)
    for dense, layer_in, layer_out in zip(dense_layers(teacher), source.layers, target.layers):
        _copy_norm(layer_in.input_layernorm, layer_out.input_layernorm)
        _copy_norm(layer_in.post_attention_layernorm, layer_out.post_attention_layernorm)
        layer_out.memory_block.norm.weight.fill_(1.0)
        layer_out.memory_block.norm.bias.zero_()
        for name, dense_layer in dense.items():
            layer_out.get_submodule(name).bias.copy_(dense_layer.bias)


def _copy_norm(source: nn.LayerNorm, target: nn.LayerNorm) -> None:
    target.weight.copy_(source.weight)
    target.bias.copy_(source.bias)


__all__ = [
    "ConversionError",
    "DenseLayer",
    "MEMORY_LAYER_NAMES",
    "copy_dense_weights",
    "dense_layers",
    "memoryformer_config_from_gpt_neox",
    "qkv_permutation",
]
