"""The dense baseline of a MemoryFormer: a Pythia-shaped `GPTNeoXForCausalLM` of the same width, depth and heads.

The paper compares each MemoryFormer with the Pythia model of the same shape (MF-tiny with Pythia-70M, ...). The
twin keeps what Pythia does (parallel residual, GELU MLP of 4d, an attention output projection, rotary embedding
on a quarter of each head) and takes from the MemoryFormer what both must share to be compared on the same data:
vocabulary, special tokens, rotary settings, context length and norm epsilon.
"""

from __future__ import annotations

from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from ..configuration_memoryformer import MemoryFormerConfig


def pythia_twin_config(config: MemoryFormerConfig, **overrides) -> GPTNeoXConfig:
    """The `GPTNeoXConfig` of the Pythia-shaped dense twin of `config`; keyword arguments override any field."""
    rope = config.rope_parameters
    fields = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        intermediate_size=4 * config.hidden_size,
        hidden_act="gelu",
        rotary_pct=rope.get("partial_rotary_factor", 0.25),
        rotary_emb_base=rope.get("rope_theta", 10000.0),
        max_position_embeddings=config.max_position_embeddings,
        layer_norm_eps=config.layer_norm_eps,
        use_parallel_residual=True,
        tie_word_embeddings=False,
        initializer_range=config.initializer_range,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    fields.update(overrides)
    return GPTNeoXConfig(**fields)


def pythia_twin(config: MemoryFormerConfig, **overrides) -> GPTNeoXForCausalLM:
    """A randomly initialised Pythia-shaped twin of `config` (see `pythia_twin_config`)."""
    return GPTNeoXForCausalLM(pythia_twin_config(config, **overrides))
