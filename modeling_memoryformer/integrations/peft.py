"""PEFT (LoRA) for MemoryFormer: low-rank adapters on Memory Layers and on the LM head.

A Memory Layer has no weight matrix to put a LoRA update on, so there are two ways to adapt it:

(a) `MemoryLayerLoRA`, a dense low-rank path beside the lookup (`kind="memory_layers"`):
    y = MemoryLayer(x) + scaling * B(A(dropout(x))). It adapts what the layer computes from any input, but cannot be
    merged: the lookup sum_k p(z_k) T_k[h(z_k)] is not linear in x, so no change of the tables reproduces B A x.
    peft does not know Memory Layers; `register_memoryformer_lora` registers this class with a `LoraConfig`.
(b) LoRA on the `tables` parameter itself, through peft's own `ParamWrapper` (`kind="tables"`, `target_parameters`):
    T' = T + scaling * B A, with A [r, d_out] and B [K * 2**tau, r]. Every table row gets a low-rank correction; the
    layer stays a lookup, so `merge_and_unload` folds the update into the tables exactly. The price: every forward
    builds T' in full (as large as the tables, and kept for the backward), and B has K * 2**tau rows.

(c) The LM head, the model's only `nn.Linear`, takes ordinary LoRA or `modules_to_save` alongside either kind.

`memoryformer_lora_config` builds the `LoraConfig` of each combination. The custom-module registration of (a) is not
saved in adapter_config.json: load adapters with `load_memoryformer_adapter`, which registers it again.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal

import torch
from peft import LoraConfig, PeftConfig, PeftModel
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import check_target_module_exists
from torch import nn

from ..modeling_memoryformer import MemoryLayer


# Attribute names of the Memory Layers in MemoryFormer: attention Q/K/V (fused), the optional attention output
# (`attention_output="memory"`) and the two layers of the Memory Block.
MEMORY_LAYER_NAMES: tuple[str, ...] = ("query_key_value", "dense", "layer1", "layer2")

# What a MemoryLayerLoRA passes through to the Memory Layer it wraps, so code written for a MemoryLayer keeps working.
_MEMORY_LAYER_ATTRIBUTES = frozenset(
    {"hash_bits", "num_tables", "score", "temperature", "tables", "hash", "hash_codes"}
)

# Initialisations that do not read a dense base weight (PiSSA, OLoRA, LoftQ, ... factorise `weight`, which a Memory
# Layer does not have).
_SUPPORTED_INITS = (True, False, "gaussian")


class MemoryLayerLoRA(nn.Module, LoraLayer):
    """LoRA for a `MemoryLayer`: a dense low-rank path added to the lookup.

    y = MemoryLayer(x) + sum over active adapters of scaling * B(A(dropout(x))), with A: d_in -> r, B: r -> d_out and
    scaling = lora_alpha / r (lora_alpha / sqrt(r) with `use_rslora`). B starts at zero, so a new adapter leaves the
    model's output unchanged. Several adapters, `set_adapter`, `disable_adapter` and mixed-adapter batches
    (`adapter_names=`) behave as for peft's `lora.Linear`.

    Not mergeable: the lookup is not linear in x, so B A x has no equivalent in the tables, and `merge` raises (see
    `merge`). `hash_bits`, `num_tables`, `tables`, `hash()`, ... read through to the wrapped Memory Layer.

    peft builds this class itself for every module matched by `target_modules` once the `LoraConfig` went through
    `register_memoryformer_lora`.
    """

    def __init__(
        self,
        base_layer: nn.Module,
        adapter_name: str,
        config: LoraConfig,
        r: int = 0,
        lora_alpha: int = 1,
        parameter_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        if parameter_name is not None:
            # peft asks the registered class for targeted parameters too, before its own ParamWrapper.
            raise ValueError(
                f"The LoraConfig targets the Memory Layer parameter {parameter_name!r} through `target_parameters` "
                "but also has MemoryLayerLoRA registered, which would take that parameter over from peft's "
                "ParamWrapper. Put table LoRA in a config without the registration "
                '(memoryformer_lora_config(kind="tables")), for example as a second adapter.'
            )
        super().__init__()
        LoraLayer.__init__(self, base_layer, **kwargs)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in _MEMORY_LAYER_ATTRIBUTES:
            return getattr(self.get_base_layer(), name)
        return super().__getattr__(name)

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        return module.in_features, module.out_features

    def _get_base_layer_device_and_dtype(self, base_layer: nn.Module) -> tuple[torch.device, torch.dtype]:
        # peft reads `weight`; the adapter follows the tables (e.g. stays float64 on a float64 model).
        return base_layer.tables.device, base_layer.tables.dtype

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config: LoraConfig, **kwargs: Any) -> None:
        """Add the adapter `adapter_name`: A [r, in_features], B [out_features, r], dropout, scaling."""
        if config.init_lora_weights not in _SUPPORTED_INITS:
            raise ValueError(
                f"init_lora_weights={config.init_lora_weights!r} is not supported on a Memory Layer: it factorises a "
                f"dense weight, which a hash-table layer does not have. Use one of {_SUPPORTED_INITS}."
            )
        if config.use_dora:
            raise ValueError(
                "use_dora=True is not supported on a Memory Layer: DoRA rescales the columns of a dense weight, "
                "which a hash-table layer does not have. Set use_dora=False."
            )
        super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Always raises: a dense low-rank path cannot be folded into hash tables."""
        raise ValueError(
            "Cannot merge a MemoryLayerLoRA adapter into its Memory Layer: the adapter adds a dense path "
            "scaling * B(A(x)) beside the lookup y = sum_k p(z_k) T_k[h(z_k)], which is not linear in x, so no change "
            "of the hash tables reproduces B A x for every input. Keep the adapter unmerged (use the PeftModel as it "
            'is), or train a mergeable adapter on the tables instead: memoryformer_lora_config(kind="tables") '
            "puts LoRA on the `tables` parameters, and its merge_and_unload is exact."
        )

    def unmerge(self) -> None:
        """Nothing to undo: `merge` never succeeds, so no adapter is ever merged."""

    def forward(
        self,
        x: torch.Tensor | None = None,
        hashed: tuple[torch.Tensor, torch.Tensor] | None = None,
        *,
        adapter_names: list[str] | None = None,
    ) -> torch.Tensor:
        """[..., in_features] -> [..., out_features]; `hashed` as for `MemoryLayer.forward`, but x is still needed
        by the adapter path. `adapter_names` (one per batch row, "__base__" for none) mixes adapters in a batch."""
        requested = self.active_adapters if adapter_names is None else set(adapter_names)
        if self.disable_adapters or not any(name in self.lora_A for name in requested):
            return self.base_layer(x, hashed=hashed)
        if x is None:
            raise ValueError(
                "A Memory Layer with a LoRA adapter adds scaling * B(A(x)) to the lookup and needs the input x as well "
                "as a shared hash: call it as layer(x, hashed=hashed)."
            )
        if adapter_names is not None:
            self._check_forward_args(x, adapter_names=adapter_names)
            return self._mixed_batch_forward(x, hashed=hashed, adapter_names=adapter_names)
        result = self.base_layer(x, hashed=hashed)
        for name in self.active_adapters:
            if name in self.lora_A:
                result = result + self._adapter_output(x, name).to(result.dtype)
        return result

    def _adapter_output(self, x: torch.Tensor, adapter_name: str) -> torch.Tensor:
        lora_A, lora_B = self.lora_A[adapter_name], self.lora_B[adapter_name]
        x = self._cast_input_dtype(x, lora_A.weight.dtype)
        return lora_B(lora_A(self.lora_dropout[adapter_name](x))) * self.scaling[adapter_name]

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


def register_memoryformer_lora(config: LoraConfig) -> LoraConfig:
    """Let `config` put a `MemoryLayerLoRA` on every Memory Layer its `target_modules` name; returns `config`."""
    config._register_custom_module({MemoryLayer: MemoryLayerLoRA})
    return config


def memoryformer_lora_config(
    kind: Literal["memory_layers", "tables"],
    r: int = 8,
    alpha: int = 16,
    dropout: float = 0.0,
    include_lm_head: bool = False,
    lm_head_mode: Literal["lora", "modules_to_save"] = "modules_to_save",
    memory_layers: Sequence[str] = MEMORY_LAYER_NAMES,
    **lora_kwargs: Any,
) -> LoraConfig:
    """A causal-LM `LoraConfig` for MemoryFormer.

    Args:
        kind: "memory_layers": a dense low-rank path on each Memory Layer (`MemoryLayerLoRA`, registered here; not
            mergeable). "tables": LoRA on each Memory Layer's `tables` parameter (`target_parameters`; mergeable,
            no dropout).
        r: LoRA rank.
        alpha: lora_alpha; the update is scaled by alpha / r.
        dropout: dropout on the adapter input ("memory_layers" and a LoRA head only).
        include_lm_head: also adapt the LM head.
        lm_head_mode: "modules_to_save" trains and saves a full copy of the head; "lora" puts LoRA on it (peft then
            also saves the base head with the adapter unless `save_pretrained(..., save_embedding_layers=False)`).
        memory_layers: which Memory Layers to adapt, by attribute name (default: all of them).
        lora_kwargs: any other `LoraConfig` field (e.g. `use_rslora`, `init_lora_weights`, `task_type`).
    """
    if kind not in ("memory_layers", "tables"):
        raise ValueError(f'kind must be "memory_layers" or "tables", got {kind!r}.')
    if lm_head_mode not in ("lora", "modules_to_save"):
        raise ValueError(f'lm_head_mode must be "lora" or "modules_to_save", got {lm_head_mode!r}.')
    if isinstance(memory_layers, str) or not memory_layers:
        raise ValueError(f"memory_layers must be a non-empty list of Memory Layer names such as {MEMORY_LAYER_NAMES}.")
    if kind == "tables" and dropout:
        raise ValueError(
            f"dropout={dropout} is not possible with LoRA on the tables: the update changes the tables, not a path "
            'that x goes through. Use dropout=0.0, or kind="memory_layers" for adapter dropout.'
        )
    head = ["lm_head"] if include_lm_head and lm_head_mode == "lora" else []
    fields: dict[str, Any] = {
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "modules_to_save": ["lm_head"] if include_lm_head and lm_head_mode == "modules_to_save" else None,
    }
    if kind == "memory_layers":
        fields["target_modules"] = [*memory_layers, *head]
    else:
        fields["target_modules"] = head
        fields["target_parameters"] = [f"{name}.tables" for name in memory_layers]
    clashes = sorted(fields.keys() & lora_kwargs.keys())
    if clashes:
        raise ValueError(
            f"{clashes} are set by memoryformer_lora_config from kind, r, alpha, dropout, include_lm_head, "
            "lm_head_mode and memory_layers; pass those arguments instead, or build a LoraConfig yourself."
        )
    config = LoraConfig(**{"task_type": "CAUSAL_LM", **lora_kwargs, **fields})
    return register_memoryformer_lora(config) if kind == "memory_layers" else config


def _targets_memory_layers(model: nn.Module, config: PeftConfig) -> bool:
    """Whether `config.target_modules` names a Memory Layer of `model` (then it needs `MemoryLayerLoRA`)."""
    if not isinstance(config, LoraConfig) or not config.target_modules:
        return False
    return any(
        isinstance(module, MemoryLayer) and check_target_module_exists(config, name)
        for name, module in model.named_modules()
    )


def load_memoryformer_adapter(
    model: nn.Module,
    adapter_path: str | os.PathLike,
    adapter_name: str = "default",
    is_trainable: bool = False,
    **kwargs: Any,
) -> PeftModel:
    """Load a saved adapter onto a MemoryFormer, registering `MemoryLayerLoRA` again when the adapter needs it.

    `model` is a base model (returns a new PeftModel, as `PeftModel.from_pretrained`) or a PeftModel, which gets the
    adapter as an extra one named `adapter_name` (activate it with `set_adapter`). `kwargs` go to peft's loader.
    Adapters are read from adapter_model.safetensors (peft falls back to torch.load(weights_only=True)).
    """
    config = PeftConfig.from_pretrained(adapter_path)
    base_model = model.get_base_model() if isinstance(model, PeftModel) else model
    if _targets_memory_layers(base_model, config):
        register_memoryformer_lora(config)
    if not isinstance(model, PeftModel):
        return PeftModel.from_pretrained(
            model, adapter_path, adapter_name=adapter_name, is_trainable=is_trainable, config=config, **kwargs
        )
    # load_adapter would read the config from disk again, without the registration: add the adapter first.
    config.inference_mode = not is_trainable
    model.add_adapter(adapter_name, config)
    model.load_adapter(adapter_path, adapter_name, is_trainable=is_trainable, **kwargs)
    if is_trainable:
        model.set_requires_grad(adapter_name)
    return model


__all__ = [
    "MEMORY_LAYER_NAMES",
    "MemoryLayerLoRA",
    "register_memoryformer_lora",
    "memoryformer_lora_config",
    "load_memoryformer_adapter",
]
