"""MemoryFormer (Ding et al., NeurIPS 2024) as a transformers model.

A decoder-only transformer, GPT-NeoX shaped, whose fully-connected layers are Memory Layers: hash-table
lookups (memory_layer.py, on the ops of memory_ops.py). Data flows top to bottom through this file:
norm -> Memory Layer -> rotary -> attention -> Memory Block -> decoder layer -> PreTrainedModel -> Model
-> ForCausalLM. The only `nn.Linear` in the model is the LM head.
"""

import inspect
from collections.abc import Callable

import torch
from torch import nn

from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_memoryformer import MemoryFormerConfig
from .decode_loop import sample as lean_sample
from .decode_layer import (decode_layer_step, decode_layer_traced, decode_stack_run, decode_stack_step,
                           decode_stack_traced, decode_step_mask, rotary_table_rows)
from .huge_pages import place_on_huge_pages
from .memory_loss import uses_chunked_loss
from .memory_ops import decode_attention_forward, few_rows_linear, few_rows_linear_argmax, linear_cross_entropy
from .memory_layer import MemoryLayer
from .quantization import TableStorageMixin, Int8LMHead, bf16_linear
from .transformers_compat import (CACHE_FIELD, CACHE_NAMES, cache_argument, check_keywords, deprecated_cache_name,
                                  slice_logits_to_keep, update_kv_cache, with_cache)


class MemoryFormerRMSNorm(nn.Module):
    """RMSNorm (the authors' code's block norm): x / rms(x) * weight."""
    decode_norm = "rmsnorm"  # decode_layer.py's fused decode step computes it with these ops

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

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        rows = rotary_table_rows(self, x, position_ids)  # decode_layer.py: a decode step's positions from a table
        return self._compute(x, position_ids) if rows is None else rows

    @torch.no_grad()
    @dynamic_rope_update
    def _compute(self, x: torch.Tensor, position_ids: torch.Tensor):
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)  # [batch, seq, rotary_dim]
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
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


def apply_rotary_pos_emb_(q, k, cos, sin, unsqueeze_dim: int = 1):
    """`apply_rotary_pos_emb` in place: only the first cos.shape[-1] dims of q and k are rewritten, so the rest is
    not copied (for inference, where q and k are views of the Q/K/V layer's fresh output: at 2048 tokens the copy
    and the first-touch faults of two new [batch, heads, seq, head_dim] tensors per layer cost more than the
    rotation itself)."""
    for x in (q, k):
        rotate_in_place_(x, cos, sin, unsqueeze_dim)
    return q, k


def rotate_in_place_(x, cos, sin, unsqueeze_dim: int = 1):
    """The rotation of `apply_rotary_pos_emb` on the first cos.shape[-1] dims of x, in place, the same values
    element by element. The attention passes its Q and K heads as one [batch, seq, 2 * heads, head_dim] view of the
    Q/K/V output (unsqueeze_dim=2): one pass of the few ops instead of two, which counts in a decode step."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    x_rot = x[..., : cos.shape[-1]]
    x_rot.copy_((x_rot * cos) + (rotate_half(x_rot) * sin))
    return x


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
        self.num_heads, self.hidden_size = config.num_attention_heads, config.hidden_size  # a config read: 2 us
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        memory_layer = dict(
            hash_bits=config.hash_bits,
            sparse=config.sparse_table_gradients,
            bias=config.memory_bias,
            score=config.hash_score,
            temperature=config.hash_temperature,
            table_dtype=config.table_dtype,
        )
        self.query_key_value = MemoryLayer(config.hidden_size, 3 * config.hidden_size, **memory_layer)
        self.query_key_value.row_segments = 3  # the paper's three tables (Q, K, V), one row of each per bucket
        self.query_key_value.is_qkv = True
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
        hidden_shape = (*input_shape, self.num_heads, self.head_dim)  # explicit: a batch may be empty

        qkv = self.query_key_value(hidden_states)  # [batch, seq, 3 * hidden]
        cos, sin = position_embeddings
        rotate_in_place = not (qkv.requires_grad or self._qkv_observed()) and qkv.stride(-1) == 1
        if rotate_in_place:  # inference: rotate inside the fresh Q/K/V output, Q and K heads in one pass
            qk_shape = (*input_shape, 2 * self.num_heads, self.head_dim)
            rotate_in_place_(qkv[..., : 2 * self.hidden_size].view(qk_shape), cos, sin, unsqueeze_dim=2)
        # each [batch, heads, seq, head_dim]
        query_states, key_states, value_states = (t.view(hidden_shape).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        if not rotate_in_place:
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                    eager_attention_forward)
        key_states, value_states = update_kv_cache(
            past_key_values, key_states, value_states, self.layer_idx, attention_interface, kwargs
        )
        if attention_interface is ALL_ATTENTION_FUNCTIONS.get("sdpa"):  # a decode step on the fused kernel
            attention_interface = decode_attention_forward
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
        attn_output = attn_output.reshape(*input_shape, self.hidden_size).contiguous()  # [batch, seq, hidden]
        if self.dense is not None:
            attn_output = self.dense(attn_output)
        return attn_output, attn_weights

    def _qkv_observed(self) -> bool:
        """Whether a hook may hold on to the Q/K/V layer's output (which the in-place rotation would change)."""
        module = nn.modules.module
        return bool(self.query_key_value._forward_hooks or module._global_forward_hooks)


class MemoryBlock(nn.Module):
    """The feed-forward replacement: Memory Layer 1 (d -> (tau+e)K, tau bits) -> [GELU] -> LayerNorm ->
    Memory Layer 2 ((tau+e)K -> d, tau+e bits). The norm before layer 1 belongs to the decoder layer.

    The inner norm re-centres layer 1's output so that the signs hashed by layer 2 split evenly (paper 3.2).
    """

    def __init__(self, config: MemoryFormerConfig):
        super().__init__()
        memory_layer = dict(
            sparse=config.sparse_table_gradients,
            bias=config.memory_bias,
            score=config.hash_score,
            temperature=config.hash_temperature,
            table_dtype=config.table_dtype,
        )
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
        out = (decode_layer_traced if torch.compiler.is_compiling() else decode_layer_step)(
            self, hidden_states, attention_mask, position_embeddings, past_key_values, kwargs)
        if out is not None:  # a decode step on the fused kernel (decode_layer.py): the same values
            return out
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


class CheckpointMismatchError(ValueError):
    """`from_pretrained` found tensors that cannot be this model's storage: int8 values without their scales, or int8
    storage in config.json over float tensors in the file (or the reverse)."""


# The int8 storage (quantization.py) of a Memory Layer's tables and of the LM head, by the float tensor it replaces.
INT8_PARTS = {"tables": ("tables_codes", "tables_scale", "tables_offset"), "weight": ("weight_int8", "weight_scale")}
_OPTION = {"tables": ("table_dtype", "tables", "quantize_tables"),  # the config option, the part, its quantiser
           "weight": ("lm_head_dtype", "LM head", "quantize_lm_head")}


def check_loaded_exactly(model: nn.Module, info: dict, source) -> None:
    """Raise where the checkpoint cannot fill what only this model has: int8 values without their scales (NaN or
    garbage logits), or tables / an LM head stored otherwise (int8 or float) than config.json says. The rest follows
    transformers' convention: a tensor the checkpoint lacks (the LM head of a base-model checkpoint, ...) is initialised
    by `_init_weights`, tied where the config ties it, and reported in `missing_keys` and transformers' load report; a
    tensor the model has no place for is reported in `unexpected_keys`."""
    missing, unexpected = set(info.get("missing_keys") or ()), set(info.get("unexpected_keys") or ())
    loaded, named, fixes = set(model.state_dict()) - missing, set(), []
    for prefix in {key.rpartition(".")[0] + "." for key in missing}:
        for float_name, parts in INT8_PARTS.items():
            option, what, quantize = _OPTION[float_name]
            absent = {prefix + p for p in parts if prefix + p in missing}
            if absent and any(prefix + p in loaded for p in parts):
                named |= absent
                fixes.append("int8 values are unusable without their scales: the file is damaged or incomplete.")
            elif absent and prefix + float_name in unexpected:
                named |= {*absent, prefix + float_name}
                fixes.append(f"config.json says {option}='int8' but the file holds float {what}: set {option} to "
                             f"null in config.json (and quantise after loading with model.{quantize}('int8') if you "
                             "want int8).")
            elif prefix + float_name in missing and (foreign := {prefix + p for p in parts} & unexpected):
                named |= {prefix + float_name, *foreign}
                fixes.append(f"the file holds int8 {what} but config.json does not say {option}='int8': set it there.")
    if not fixes:
        return

    def names(keys: list[str]) -> str:
        return ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")

    absent, foreign = sorted(named & missing), sorted(named & unexpected)
    parts = [f"{len(absent)} missing ({names(absent)})" if absent else "",
             f"{len(foreign)} it has no place for ({names(foreign)})" if foreign else ""]
    raise CheckpointMismatchError(f"The checkpoint at {source} does not match this {type(model).__name__}: tensors "
                                  f"{' and '.join(p for p in parts if p)}. {' '.join(sorted(set(fixes)))}")


class MemoryFormerLMHead(nn.Linear):
    """The LM head: an `nn.Linear` (same parameters, hooks, PEFT and quantisation as one) whose forward reads the
    weight with the fused few-row pass while decoding (`memory_ops.few_rows_linear`), where BLAS's GEMV is slow.
    A bfloat16 weight (`lm_head_dtype="bfloat16"`) in a wider model runs bfloat16 products summed in float32."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.bfloat16 and hidden_states.dtype != torch.bfloat16:
            return bf16_linear(hidden_states, self.weight, self.bias)
        return few_rows_linear(hidden_states, self.weight, self.bias)

    def logits_and_argmax(self, hidden_states: torch.Tensor):
        """(forward(hidden_states), its argmax over the vocabulary) in one pass (few_rows_linear_argmax), or None
        (where the forward does not take the few-row pass: another dtype, too many rows, a gradient to record)."""
        return few_rows_linear_argmax(hidden_states, self.weight, self.bias)


def build_lm_head(config: MemoryFormerConfig) -> nn.Module:
    """The LM head in the storage `config.lm_head_dtype` asks for: float (the model's dtype), bfloat16 or int8."""
    if config.lm_head_dtype == "int8":
        return Int8LMHead(config.hidden_size, config.vocab_size)
    dtype = torch.bfloat16 if config.lm_head_dtype == "bfloat16" else None
    return MemoryFormerLMHead(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)


class MemoryFormerPreTrainedModel(TableStorageMixin, PreTrainedModel):
    config_class = MemoryFormerConfig
    config: MemoryFormerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["MemoryFormerDecoderLayer"]
    _skip_keys_device_placement = list(CACHE_NAMES)
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
    _memory_layer_class = MemoryLayer  # for TableStorageMixin (quantization.py)
    _lm_head_class = MemoryFormerLMHead

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' `from_pretrained` (a missing tensor is initialised and reported, as transformers does),
        refusing int8 values without their scales and a table / LM head storage other than config.json's
        (`check_loaded_exactly`). `output_loading_info=True` still returns the loading report. Large CPU weights
        are then moved onto huge pages (huge_pages.py; MEMORYFORMER_HUGE_PAGES=0 leaves them)."""
        wants_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs)
        check_loaded_exactly(model, info, pretrained_model_name_or_path)
        place_on_huge_pages(model)
        return (model, info) if wants_info else model

    def _attention_function(self) -> Callable | None:
        """The attention function the layers call, or None for this file's `eager_attention_forward`."""
        function = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        return None if function is eager_attention_forward else function

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Memory Layers by `config.table_init`: "paper", tables N(0, table_init_std) and zero biases; "authors" (their
        code), the Q/K/V tables N(0, sqrt(2 / (5 d))) (small_init), the others N(0, table_init_std), biases
        N(0, 0.001). The `init` functions skip tensors already loaded by `from_pretrained`."""
        super()._init_weights(module)
        if isinstance(module, MemoryLayer):
            authors = self.config.table_init == "authors"
            std = self.config.table_init_std
            if authors and module.is_qkv:
                std = (2 / (5 * self.config.hidden_size)) ** 0.5
            if module.tables is not None:
                init.normal_(module.tables, mean=0.0, std=std)
            elif not getattr(module.tables_codes, "_is_hf_initialized", False):  # int8 tables not loaded
                module.reset_parameters(std=std)
            if module.bias is not None and authors:
                init.normal_(module.bias, mean=0.0, std=0.001)
            elif module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, Int8LMHead) and module.weight_int8.device.type != "meta" and not getattr(
            module.weight_int8, "_is_hf_initialized", False
        ):  # an int8 head missing from the checkpoint: the int8 rounding of an N(0, initializer_range) head
            weight = torch.empty(module.weight_int8.shape, device=module.weight_int8.device)
            fresh = Int8LMHead.from_weight(weight.normal_(std=self.config.initializer_range))
            module.weight_int8.copy_(fresh.weight_int8), module.weight_scale.copy_(fresh.weight_scale)

    def save_pretrained(self, save_directory, *args, **kwargs):
        # A model sharded by FSDP2 has a class made at run time in torch's module (FSDPMemoryFormerForCausalLM): it is
        # saved as the MemoryFormer class it extends, so that the remote code and auto_map name these files.
        cls = type(self)
        plain = next(c for c in cls.__mro__ if c.__module__ == __name__)
        if plain is not cls:
            self.__class__ = plain
            try:
                return self.save_pretrained(save_directory, *args, **kwargs)
            finally:
                self.__class__ = cls
        # int8 tables are views of one block per layer (quantization.py): the checkpoint gets their separate copies.
        if kwargs.get("state_dict") is None and not args and self.config.table_dtype == "int8":
            state_dict = self.state_dict()
            kwargs["state_dict"] = {name: t if t.is_contiguous() else t.contiguous() for name, t in state_dict.items()}
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

    # Input checks that read tensor values: skipped while torch.compile traces (they would break the graph).
    def _check_ids(self, input_ids: torch.Tensor) -> None:
        vocab = getattr(self.embed_tokens, "num_embeddings", self.config.vocab_size)
        if torch.compiler.is_compiling() or input_ids.numel() == 0 or input_ids.is_floating_point():
            return
        if input_ids.numel() <= 64 and input_ids.device.type == "cpu":  # a decode step's ids: 2 us instead of 45
            ids = input_ids.reshape(-1).tolist()
            low, high = min(ids), max(ids)
        else:
            low, high = (int(v) for v in torch.aminmax(input_ids))
        if low < 0 or high >= vocab:
            raise ValueError(
                f"input_ids holds token id {low if low < 0 else high}, outside the vocabulary [0, {vocab}) of this "
                "model. Use the tokenizer the model was trained with, or resize the embeddings "
                "(model.resize_token_embeddings) after adding tokens."
            )

    @staticmethod
    def _check_attention_mask(attention_mask, inputs_embeds: torch.Tensor, cache: Cache | None) -> None:
        """A 2-D attention_mask covers the cached tokens and the new ones: [batch, past + seq_len]."""
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 or torch.compiler.is_compiling():
            return
        batch, seq_len = inputs_embeds.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        if tuple(attention_mask.shape) != (batch, past + seq_len):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)} but the input is {batch} x {seq_len} tokens"
                + (f" after {past} cached ones" if past else "")
                + f": it needs shape ({batch}, {past + seq_len}), one entry per token (1 = attend, 0 = padding), the "
                "cached tokens first. Pass the mask the tokenizer returned with these ids."
            )

    @deprecated_cache_name
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
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        r"""past_key_values / cache: the KV cache, under either name (transformers 5.24 renamed `past_key_values` to
        `cache`); the output holds it under the running release's name."""
        past_key_values = cache_argument(past_key_values, cache)
        check_keywords(MemoryFormerModel.forward, kwargs, self._attention_function(), past_key_values)
        hidden_states, past_key_values = self._run(input_ids, attention_mask, position_ids, past_key_values,
                                                   inputs_embeds, use_cache, kwargs)
        return with_cache(BaseModelOutputWithPast, past_key_values, last_hidden_state=hidden_states)

    def _run(self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache, kwargs: dict,
             stack_only: bool = False):
        """The forward's body: (the last hidden states, the cache). With `stack_only`, None (and nothing run that
        changes a thing) unless `decode_stack` ran every layer (`decode_layer.decode_stack_run`)."""
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds.")
        if inputs_embeds is None:
            self._check_ids(input_ids)
            inputs_embeds = self.embed_tokens(input_ids)  # [batch, seq, hidden]
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[0] == 0 or inputs_embeds.shape[1] == 0:
            raise ValueError(
                f"The input holds no tokens to run: {'input_ids' if input_ids is not None else 'inputs_embeds'} has "
                f"shape {tuple((input_ids if input_ids is not None else inputs_embeds).shape)}; pass at least one "
                "sequence of at least one token, as [batch, seq_len] ids or [batch, seq_len, hidden_size] embeddings."
            )
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        self._check_attention_mask(attention_mask, inputs_embeds, past_key_values)
        if position_ids is None:
            past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        mask = decode_step_mask(self, attention_mask, inputs_embeds, past_key_values, position_ids, stack_only)
        hidden_states = self.emb_dropout(inputs_embeds)
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        stacked = (decode_stack_traced if torch.compiler.is_compiling() else decode_stack_step)(
            self, hidden_states, mask, position_embeddings, past_key_values, kwargs)
        if stacked is None and stack_only:
            return None
        for decoder_layer in self.layers if stacked is None else ():  # else every layer ran in one call
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=mask,
                position_embeddings=position_embeddings,
                past_key_values=past_key_values,
                position_ids=position_ids,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states if stacked is None else stacked)
        return hidden_states, past_key_values


class MemoryFormerForCausalLM(MemoryFormerPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _sample = lean_sample  # generate's greedy / sampling loop, its decode steps as direct calls (decode_loop.py)

    def __init__(self, config: MemoryFormerConfig):
        super().__init__(config)
        self.model = MemoryFormerModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = build_lm_head(config)  # the only dense layer
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head = new_embeddings

    @deprecated_cache_name
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
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        r"""labels: [batch, seq] token ids (-100 = ignored); the loss is next-token cross-entropy (shifted inside).

        In training mode with labels (and gradients recorded) the LM head and the loss run as one chunked pass of
        `config.loss_chunk_tokens` tokens (`memory_ops.linear_cross_entropy`, same loss and gradients), so the logits
        are not materialised: `logits` is None. Set `config.loss_chunk_tokens = 0` to get them. A head with hooks,
        PEFT or accelerate wrappers, a quantised or narrower-than-model head, `logits_to_keep`, or a custom
        `loss_function` keep the full-logits path.

        past_key_values / cache: the KV cache, under either name (see `MemoryFormerModel.forward`)."""
        past_key_values = cache_argument(past_key_values, cache)
        check_keywords(MemoryFormerForCausalLM.forward, kwargs, self._attention_function(), past_key_values)
        run = decode_stack_run(self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, labels,
                               kwargs)  # decode_layer.py: a stacked decode step's model body, as a method
        if run is None:
            outputs: BaseModelOutputWithPast = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=past_key_values,  # the name that is current (or still taken) under every release
                inputs_embeds=inputs_embeds,
                use_cache=use_cache,
                **kwargs,
            )
            last_hidden_state, cache_out = outputs.last_hidden_state, getattr(outputs, CACHE_FIELD)
            all_hidden_states, attentions = outputs.hidden_states, outputs.attentions
        else:
            (last_hidden_state, cache_out), all_hidden_states, attentions = run, None, None
        hidden_states = slice_logits_to_keep(last_hidden_state, logits_to_keep)
        logits = loss = None
        if uses_chunked_loss(self, MemoryFormerLMHead, labels, logits_to_keep, hidden_states):
            loss = linear_cross_entropy(
                hidden_states, self.lm_head.weight, self.lm_head.bias, labels,
                chunk_tokens=self.config.loss_chunk_tokens,
                ignore_index=kwargs.get("ignore_index", -100),
                num_items_in_batch=kwargs.get("num_items_in_batch"),
                shift_labels=kwargs.get("shift_labels"),
            )
        else:
            logits = self.lm_head(hidden_states)  # [batch, kept positions, vocab]
            if labels is not None:
                loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return with_cache(
            CausalLMOutputWithPast,
            cache_out,
            loss=loss,
            logits=logits,
            hidden_states=all_hidden_states,
            attentions=attentions,
        )


# The forwards' signatures, read once: generate's `prepare_inputs_for_generation` asks for the model's on every step
# (for a class registered for the auto classes, as this one is), and inspect.signature unwraps the decorators each
# time (40 us; 9 with the signature stored, which inspect returns as it is).
for _forward in (MemoryFormerModel.forward, MemoryFormerForCausalLM.forward):
    _forward.__signature__ = inspect.signature(_forward)
del _forward

__all__ = [
    "CheckpointMismatchError",
    "MemoryLayer",
    "MemoryBlock",
    "MemoryFormerPreTrainedModel",
    "MemoryFormerModel",
    "MemoryFormerForCausalLM",
]
