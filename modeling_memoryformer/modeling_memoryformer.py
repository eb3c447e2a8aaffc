"""MemoryFormer (Ding et al., NeurIPS 2024) as a transformers model.

A decoder-only transformer, GPT-NeoX shaped, whose fully-connected layers are Memory Layers: hash-table
lookups (see `memory_ops.py`). Data flows top to bottom through this file:
norm -> Memory Layer -> rotary -> attention -> Memory Block -> decoder layer -> PreTrainedModel -> Model
-> ForCausalLM. The only `nn.Linear` in the model is the LM head.
"""

from collections.abc import Callable

import torch
from torch import nn

from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel, slice_logits_to_keep
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_memoryformer import MemoryFormerConfig
from .memory_ops import (
    HASH_SCORES,
    few_rows_linear,
    hash_codes,
    hash_scores,
    memory_lookup,
    memory_lookup_hashed,
    num_tables_for,
    table_rows,
)


class MemoryFormerRMSNorm(nn.Module):
    """RMSNorm (the authors' code's block norm): x / rms(x) * weight."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.promote_types(dtype, torch.float32))  # upcast half, keep float64
        hidden_states = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * hidden_states.to(dtype)


def block_norm(config) -> nn.Module:
    if config.norm_type == "rmsnorm":
        return MemoryFormerRMSNorm(config.hidden_size, eps=config.layer_norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class MemoryLayer(nn.Module):
    """A fully-connected layer replaced by K hash tables (paper eq. hash_proj).

    y = sum_k p(z_k) * T_k[h(z_k)] + b, where z_k are the K = in_features / hash_bits chunks of x.

    Args:
        in_features: d_in, a multiple of `hash_bits`.
        out_features: d_out, the width of every table row.
        hash_bits: tau; every table has 2**tau rows.
        bias: add a learnable bias b.
        score: "paper" or "l1" (see `memory_ops.hash_scores`).
        temperature: t > 0 in the score.

    Parameters: `tables` [K * 2**hash_bits, out_features] (table-major) and `bias` [out_features].
    Input [..., in_features] -> output [..., out_features].
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        hash_bits: int,
        bias: bool = True,
        score: str = "paper",
        temperature: float = 1.0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if not 1 <= hash_bits <= 16:
            raise ValueError(f"hash_bits must be in 1..16, got {hash_bits}.")
        if out_features <= 0:
            raise ValueError(f"out_features must be positive, got {out_features}.")
        if score not in HASH_SCORES:
            raise ValueError(f"score must be one of {HASH_SCORES}, got {score!r}.")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}.")
        self.in_features = in_features
        self.out_features = out_features
        self.hash_bits = hash_bits
        self.num_tables = num_tables_for(in_features, hash_bits)
        self.score = score
        self.temperature = float(temperature)
        factory = {"device": device, "dtype": dtype}
        self.tables = nn.Parameter(torch.empty(self.num_tables << hash_bits, out_features, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.tables, std=std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def _check_input(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"MemoryLayer expects inputs whose last dimension is in_features={self.in_features}, "
                f"got shape {tuple(x.shape)}."
            )

    def hash_codes(self, x: torch.Tensor) -> torch.Tensor:
        """Bucket h(z_k) of every table: [..., in_features] -> int64 [..., K] in [0, 2**hash_bits)."""
        self._check_input(x)
        return hash_codes(x, self.hash_bits)

    def hash(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hash x once: (rows, scores), each [..., K]; `rows` indexes `tables` directly.

        Pass the result as `hashed=` to this layer or to any Memory Layer of the same in_features, hash_bits,
        score and temperature, so several outputs share one hash of the same input.
        """
        self._check_input(x)
        rows = table_rows(hash_codes(x, self.hash_bits), self.hash_bits)
        return rows, hash_scores(x, self.hash_bits, self.score, self.temperature)

    def forward(self, x: torch.Tensor | None = None, hashed: tuple[torch.Tensor, torch.Tensor] | None = None):
        if hashed is None:
            if x is None:
                raise ValueError("MemoryLayer needs an input x or a precomputed `hashed=(rows, scores)`.")
            self._check_input(x)
            return memory_lookup(x, self.tables, self.bias, self.hash_bits, self.score, self.temperature)
        rows, scores = hashed
        if rows.shape[-1] != self.num_tables:
            raise ValueError(
                f"The hash has {rows.shape[-1]} tables per token but this layer has {self.num_tables}; share a "
                "hash only between Memory Layers of the same in_features and hash_bits."
            )
        return memory_lookup_hashed(rows, scores, self.tables, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, hash_bits={self.hash_bits}, "
            f"num_tables={self.num_tables}, bias={self.bias is not None}, score={self.score!r}, "
            f"temperature={self.temperature}"
        )


class MemoryFormerRotaryEmbedding(nn.Module):
    """GPT-NeoX rotary embedding (transformers' `GPTNeoXRotaryEmbedding`) on the first `partial_rotary_factor` of each
    head's dims: every `rope_type` of `ROPE_INIT_FUNCTIONS` (linear, dynamic, yarn, longrope, llama3, ...) with its
    `attention_scaling`; "dynamic" and "longrope" update `inv_freq` with the sequence length (`dynamic_rope_update`)."""

    inv_freq: torch.Tensor

    def __init__(self, config: MemoryFormerConfig, device=None):
        super().__init__()
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings

        self.config = config

        self.rope_type = self.config.rope_parameters["rope_type"]
        rope_init_fn: Callable = self.compute_default_rope_parameters
        if self.rope_type != "default":
            rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = rope_init_fn(self.config, device)

        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config, device=None, **kwargs) -> tuple[torch.Tensor, float]:
        base = config.rope_parameters["rope_theta"]
        partial_rotary_factor = config.rope_parameters.get("partial_rotary_factor", 1.0)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * partial_rotary_factor)

        attention_factor = 1.0  # Unused in this type of RoPE
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq.to(device), attention_factor

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)  # [batch, seq, rotary_dim]
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    """Rotate the first cos.shape[-1] dims of q and k ([batch, heads, seq, head_dim]); pass the rest through."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (rotate_half(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
):
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value)
    attn_output = attn_output.transpose(1, 2).contiguous()  # [batch, seq, heads, head_dim]
    return attn_output, attn_weights


class MemoryFormerAttention(nn.Module):
    """Multi-head causal attention whose Q, K and V come from one Memory Layer (paper eq. MF_forward).

    Q, K and V hash the same normalised input with the same tau, so the three tables are fused into one
    [K * 2**tau, 3 * hidden] table: one hash, one lookup. Output columns are [Q | K | V].
    No output projection unless `attention_output="memory"`.
    """

    def __init__(self, config: MemoryFormerConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        memory_layer = dict(
            hash_bits=config.hash_bits,
            bias=config.memory_bias,
            score=config.hash_score,
            temperature=config.hash_temperature,
        )
        self.query_key_value = MemoryLayer(config.hidden_size, 3 * config.hidden_size, **memory_layer)
        self.dense = (
            MemoryLayer(config.hidden_size, config.hidden_size, **memory_layer)
            if config.attention_output == "memory"
            else None
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        qkv = self.query_key_value(hidden_states)  # [batch, seq, 3 * hidden]
        query_states, key_states, value_states = (
            t.view(hidden_shape).transpose(1, 2) for t in qkv.chunk(3, dim=-1)
        )  # each [batch, heads, seq, head_dim]

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()  # [batch, seq, hidden]
        if self.dense is not None:
            attn_output = self.dense(attn_output)
        return attn_output, attn_weights


class MemoryBlock(nn.Module):
    """The feed-forward replacement: Memory Layer 1 (d -> (tau+e)K, tau bits) -> [GELU] -> LayerNorm ->
    Memory Layer 2 ((tau+e)K -> d, tau+e bits). The norm before layer 1 belongs to the decoder layer.

    The inner norm re-centres layer 1's output so that the signs hashed by layer 2 split evenly (paper 3.2).
    """

    def __init__(self, config: MemoryFormerConfig):
        super().__init__()
        memory_layer = dict(bias=config.memory_bias, score=config.hash_score, temperature=config.hash_temperature)
        self.layer1 = MemoryLayer(config.hidden_size, config.intermediate_size, config.hash_bits, **memory_layer)
        self.act = nn.GELU() if config.memory_block_activation == "gelu" else nn.Identity()
        self.norm = nn.LayerNorm(config.intermediate_size, eps=config.layer_norm_eps)
        self.layer2 = MemoryLayer(
            config.intermediate_size, config.hidden_size, config.hash_bits + config.expand_bits, **memory_layer
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.layer2(self.norm(self.act(self.layer1(hidden_states))))


class MemoryFormerDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: MemoryFormerConfig, layer_idx: int):
        super().__init__()
        self.use_parallel_residual = config.use_parallel_residual
        self.input_layernorm = block_norm(config)
        self.post_attention_layernorm = block_norm(config)
        self.attention = MemoryFormerAttention(config, layer_idx)
        self.memory_block = MemoryBlock(config)
        self.post_attention_dropout = nn.Dropout(config.hidden_dropout)
        self.post_memory_dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        attn_output, _ = self.attention(
            self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            past_key_values=past_key_values,
            **kwargs,
        )
        attn_output = self.post_attention_dropout(attn_output)
        if self.use_parallel_residual:  # y = x + Attn(N1(x)) + MB(N2(x))
            block_output = self.memory_block(self.post_attention_layernorm(hidden_states))
            return hidden_states + attn_output + self.post_memory_dropout(block_output)
        hidden_states = hidden_states + attn_output  # h = x + Attn(N1(x)); y = h + MB(N2(h))
        block_output = self.memory_block(self.post_attention_layernorm(hidden_states))
        return hidden_states + self.post_memory_dropout(block_output)


class MemoryFormerPreTrainedModel(PreTrainedModel):
    config_class = MemoryFormerConfig
    config: MemoryFormerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["MemoryFormerDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = True
    _supports_context_parallel = False  # not tested across ranks
    _can_compile_fullgraph = True  # tests/model/test_capabilities.py: static-cache generate compiled fullgraph == eager
    _can_record_outputs = {
        "hidden_states": MemoryFormerDecoderLayer,
        "attentions": MemoryFormerAttention,
    }

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, MemoryLayer):
            init.normal_(module.tables, mean=0.0, std=self.config.table_init_std)
            if module.bias is not None:
                init.zeros_(module.bias)

    def save_pretrained(self, save_directory, *args, **kwargs):
        # transformers writes an `auto_map` entry only for the class being saved; write all three so that AutoConfig,
        # AutoModel and AutoModelForCausalLM each load the folder with trust_remote_code=True.
        if self._auto_class is not None:
            module = type(self).__module__.split(".")[-1]
            config_class = type(self.config)
            self.config.auto_map = {
                **(getattr(self.config, "auto_map", None) or {}),
                "AutoConfig": f"{config_class.__module__.split('.')[-1]}.{config_class.__name__}",
                "AutoModel": f"{module}.MemoryFormerModel",
                "AutoModelForCausalLM": f"{module}.MemoryFormerForCausalLM",
            }
        return super().save_pretrained(save_directory, *args, **kwargs)


class MemoryFormerModel(MemoryFormerPreTrainedModel):
    def __init__(self, config: MemoryFormerConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.emb_dropout = nn.Dropout(config.hidden_dropout)
        self.layers = nn.ModuleList(
            [MemoryFormerDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = block_norm(config)
        self.rotary_emb = MemoryFormerRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds.")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)  # [batch, seq, hidden]
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[1] == 0:
            raise ValueError(
                f"The input holds no tokens to run: {'input_ids' if input_ids is not None else 'inputs_embeds'} has "
                f"shape {tuple((input_ids if input_ids is not None else inputs_embeds).shape)}; pass at least one token "
                "per sequence, as [batch, seq_len] ids or [batch, seq_len, hidden_size] embeddings."
            )
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
        )
        hidden_states = self.emb_dropout(inputs_embeds)
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                past_key_values=past_key_values,
                position_ids=position_ids,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=past_key_values)


class MemoryFormerLMHead(nn.Linear):
    """The LM head: an `nn.Linear` (same parameters, hooks, PEFT and quantisation as one) whose forward reads the
    weight with the fused few-row pass while decoding (`memory_ops.few_rows_linear`), where BLAS's GEMV is slow."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return few_rows_linear(hidden_states, self.weight, self.bias)


class MemoryFormerForCausalLM(MemoryFormerPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MemoryFormerConfig):
        super().__init__(config)
        self.model = MemoryFormerModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = MemoryFormerLMHead(config.hidden_size, config.vocab_size, bias=False)  # the only dense layer
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head = new_embeddings

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        r"""labels: [batch, seq] token ids (-100 = ignored); the loss is next-token cross-entropy (shifted inside)."""
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)  # [batch, kept positions, vocab]
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


__all__ = [
    "MemoryLayer",
    "MemoryBlock",
    "MemoryFormerPreTrainedModel",
    "MemoryFormerModel",
    "MemoryFormerForCausalLM",
]
