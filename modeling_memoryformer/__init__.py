"""MemoryFormer for Hugging Face Transformers.

Importing the package registers MemoryFormer with AutoConfig, AutoModel and AutoModelForCausalLM.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_memoryformer import MemoryFormerConfig
from .memory_ops import hash_codes, hash_scores, memory_lookup, memory_lookup_reference
from .modeling_memoryformer import (
    MemoryBlock,
    MemoryFormerForCausalLM,
    MemoryFormerModel,
    MemoryFormerPreTrainedModel,
    MemoryLayer,
)

__version__ = "0.1.0"

AutoConfig.register(MemoryFormerConfig.model_type, MemoryFormerConfig, exist_ok=True)
AutoModel.register(MemoryFormerConfig, MemoryFormerModel, exist_ok=True)
AutoModelForCausalLM.register(MemoryFormerConfig, MemoryFormerForCausalLM, exist_ok=True)

# save_pretrained copies the model files next to the weights and writes `auto_map`, so that
# `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` works without this package.
MemoryFormerConfig.register_for_auto_class("AutoConfig")
MemoryFormerModel.register_for_auto_class("AutoModel")
MemoryFormerForCausalLM.register_for_auto_class("AutoModelForCausalLM")

# `model.push_to_hub(...)` uploads the generated MemoryFormer model card (architecture, FLOPs, usage) instead of
# transformers' generic one.
from .hub import write_model_card as _write_model_card  # noqa: E402

MemoryFormerPreTrainedModel.model_card_writer = _write_model_card

__all__ = [
    "MemoryFormerConfig",
    "MemoryFormerModel",
    "MemoryFormerForCausalLM",
    "MemoryFormerPreTrainedModel",
    "MemoryLayer",
    "MemoryBlock",
    "hash_codes",
    "hash_scores",
    "memory_lookup",
    "memory_lookup_reference",
]
