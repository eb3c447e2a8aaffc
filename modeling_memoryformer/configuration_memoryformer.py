"""MemoryFormer model configuration."""

import json
import math
import os

from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .memory_loss import LINEAR_CE_CHUNK_TOKENS
from .memory_math import check_hash_parameters
from .transformers_compat import CACHE_NAMES


PRESETS = ("tiny", "small", "base")
_NORM_TYPES = ("layernorm", "rmsnorm")
_ATTENTION_OUTPUTS = ("none", "memory")
_BLOCK_ACTIVATIONS = ("none", "gelu")
_TABLE_INITS = ("paper", "authors")
# Storage of the hash tables and of the LM head for inference (see quantization.py): None (the model's dtype,
# trainable), "bfloat16" or "int8" (a scale and an offset per row). "bf16" is read as "bfloat16".
QUANTIZED_DTYPES = ("bfloat16", "int8")
_DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "int8": "int8"}
# The fix for each positive-integer and positive-float field, appended to its error message.
_FIXES = {
    "vocab_size": "Use the tokenizer's vocabulary size (50304 for Pythia's padded GPT-NeoX vocabulary).",
    "hidden_size": "Use a positive multiple of hash_bits and num_attention_heads, e.g. 512 (MF-tiny).",
    "num_hidden_layers": "Use a positive number of blocks, e.g. 6 (MF-tiny).",
    "num_attention_heads": "Use a positive number of heads that divides hidden_size, e.g. 8 (MF-tiny).",
    "max_position_embeddings": "Use the longest sequence length the model is meant for, e.g. 2048.",
    "layer_norm_eps": "Use a small positive epsilon such as 1e-5 (the default).",
    "initializer_range": "Use a small positive std such as 0.02 (the default).",
    "table_init_std": "Use a small positive std such as 0.02 (the default).",
}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    """An int or float (not a bool, not a string): the fields below are numbers, whatever a JSON file held."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class MemoryFormerConfig(PreTrainedConfig):
    r"""Configuration of a MemoryFormer (Ding et al., NeurIPS 2024): a decoder-only transformer whose fully-connected
    layers are Memory Layers (hash-table lookups). Defaults are the MF-tiny preset (the shape of Pythia-70M).

    Args:
        vocab_size: vocabulary size (Pythia's padded GPT-NeoX vocabulary by default).
        hidden_size: model width d; must be divisible by `hash_bits` and by `num_attention_heads`.
        num_hidden_layers: number of blocks.
        num_attention_heads: attention heads.
        max_position_embeddings: longest sequence the rotary embedding is meant for.
        rope_parameters: `{"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}`: rotary
            embedding on the first quarter of each head's dims, GPT-NeoX style.
        hash_bits: tau, the bits of each hash code; a Memory Layer with d_in inputs has K = d_in / tau tables of
            2**tau rows.
        expand_bits: e; the first Memory Layer of the Memory Block outputs (tau + e) * K features, hashed by the
            second one with tau + e bits.
        intermediate_size: output width of the first Memory Layer of the Memory Block; default (tau + e) * K.
        hash_score: "paper" (p(z) = 1 / prod(1 + exp(-2|z|/t))) or "l1" (||z||_1 * p(z), the authors' code).
        hash_temperature: t > 0 in the score.
        memory_bias: whether Memory Layers add a bias.
        norm_type: "layernorm" (zero-centres the input of the hash, as the paper asks) or "rmsnorm", for the
            block norms and the final norm; the norm inside the Memory Block is always a LayerNorm.
        layer_norm_eps: epsilon of every norm.
        use_parallel_residual: False: h = x + Attn(N1(x)); y = h + MB(N2(h)) (authors' code). True:
            y = x + Attn(N1(x)) + MB(N2(x)) (Pythia).
        attention_output: "none" (no projection after attention, as the paper) or "memory" (a d -> d Memory
            Layer, needed to convert Pythia).
        memory_block_activation: "none" (paper) or "gelu" between the two Memory Layers of the Memory Block.
        initializer_range: std of the embedding and LM-head init.
        table_init_std: std of the hash-table init, N(0, table_init_std).
        table_init: "paper" (every table N(0, table_init_std), biases zero) or "authors" (the authors' code: the
            attention's Q/K/V tables N(0, sqrt(2 / (5 * hidden_size))), GPT-NeoX's small_init, the other tables
            N(0, table_init_std), Memory Layer biases N(0, 0.001)).
        table_dtype: storage of every Memory Layer's tables: None (the model's dtype, trainable), "bfloat16", or
            "int8" (a float32 scale and offset per row, inference only); rows are summed in float32. Set by
            `model.quantize_tables(...)` and saved with the model, so `from_pretrained` rebuilds the same storage.
        lm_head_dtype: storage of the LM head: None, "bfloat16" or "int8" (a float32 scale per row, inference only).
        sparse_table_gradients: the gradient of every Memory Layer's tables is a sparse tensor of the rows hit (as
            `nn.Embedding(sparse=True)`) instead of a dense tensor the size of the tables: for steps of few tokens
            (fine-tuning, small batches), whose backward is otherwise mostly the writing of that dense gradient. Take
            an optimizer that accepts sparse gradients for the tables (`torch.optim.SparseAdam`, `Adagrad`, or `SGD`
            without weight decay; not AdamW) and no gradient clipping over them. Default False.
        loss_chunk_tokens: tokens per chunk of the training loss (default 512). In training mode with labels and
            gradients, the LM head and the cross-entropy run as one chunked pass (`memory_ops.linear_cross_entropy`)
            that never holds the [tokens, vocab] logits or their gradient; the loss is the same. In training mode
            with labels the logits are not materialised (`outputs.logits` is None); set loss_chunk_tokens=0 to get
            them (the ordinary full-logits loss). Evaluation, generation and calls without labels always return
            logits.
    """

    model_type = "memoryformer"
    keys_to_ignore_at_inference = list(CACHE_NAMES)  # the KV cache's names from / up to transformers 5.24
    # Pipeline parallelism (vLLM's Transformers backend, `pipeline_parallel_size`): the base model's stages, as Llama's.
    # No `base_model_tp_plan`: tensor-parallel plans shard `nn.Linear` layers, which Memory Layers are not (vLLM gives
    # every rank whole Memory Layers; transformers' own plans would split `tables` along the wrong dimension).
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    def __init__(
        self,
        vocab_size: int = 50304,
        hidden_size: int = 512,
        num_hidden_layers: int = 6,
        num_attention_heads: int = 8,
        max_position_embeddings: int = 2048,
        rope_parameters: dict | None = None,
        hash_bits: int = 8,
        expand_bits: int = 2,
        intermediate_size: int | None = None,
        hash_score: str = "paper",
        hash_temperature: float = 1.0,
        memory_bias: bool = True,
        norm_type: str = "layernorm",
        layer_norm_eps: float = 1e-5,
        use_parallel_residual: bool = False,
        attention_output: str = "none",
        memory_block_activation: str = "none",
        attention_dropout: float = 0.0,
        hidden_dropout: float = 0.0,
        initializer_range: float = 0.02,
        table_init_std: float = 0.02,
        table_init: str = "paper",
        use_cache: bool = True,
        bos_token_id: int | None = 0,
        eos_token_id: int | list[int] | None = 0,
        pad_token_id: int | None = None,
        tie_word_embeddings: bool = False,
        table_dtype: str | None = None,
        lm_head_dtype: str | None = None,
        loss_chunk_tokens: int = LINEAR_CE_CHUNK_TOKENS,
        sparse_table_gradients: bool = False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.hash_bits = hash_bits
        self.expand_bits = expand_bits
        self.hash_score = hash_score
        self.hash_temperature = hash_temperature
        self.memory_bias = memory_bias
        self.norm_type = norm_type
        self.layer_norm_eps = layer_norm_eps
        self.use_parallel_residual = use_parallel_residual
        self.attention_output = attention_output
        self.memory_block_activation = memory_block_activation
        self.attention_dropout = attention_dropout
        self.hidden_dropout = hidden_dropout
        self.initializer_range = initializer_range
        self.table_init_std = table_init_std
        self.table_init = table_init
        self.use_cache = use_cache
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.tie_word_embeddings = tie_word_embeddings
        self.table_dtype = canonical_storage_dtype(table_dtype, "table_dtype")
        self.lm_head_dtype = canonical_storage_dtype(lm_head_dtype, "lm_head_dtype")
        self.loss_chunk_tokens = loss_chunk_tokens
        self.sparse_table_gradients = sparse_table_gradients
        self._check_hash_shapes()  # intermediate_size's default needs a valid hash_bits
        if intermediate_size is None:
            intermediate_size = (hash_bits + expand_bits) * (hidden_size // hash_bits)
        self.intermediate_size = intermediate_size
        # Rotary: the first 25% of each head's dims, base 10000, as Pythia. `super().__init__` standardizes it
        # (`convert_rope_params_to_dict`, as GPTNeoXConfig) and validates it (`validate_rope`, every rope_type).
        self.rope_parameters = dict(rope_parameters) if rope_parameters is not None else None
        super().__init__(**kwargs)
        self.validate_memoryformer()

    # ----------------------------------------------------------------------------------------------------------------
    # Derived sizes
    @property
    def num_tables(self) -> int:
        """K = hidden_size / hash_bits: tables per Memory Layer that reads the hidden state."""
        return self.hidden_size // self.hash_bits

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    # ----------------------------------------------------------------------------------------------------------------
    # Validation: every error names the field, the value and the fix.
    def _check_hash_shapes(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}. {_FIXES[name]}")
        tau = self.hash_bits
        check_hash_parameters(tau, self.hash_score, self.hash_temperature, width=self.hidden_size,
                              names=("hash_bits", "hash_score", "hash_temperature"))
        e = self.expand_bits
        if not isinstance(e, int) or isinstance(e, bool) or e < 0 or tau + e > 16:
            raise ValueError(
                f"expand_bits must be an integer >= 0 with hash_bits + expand_bits <= 16, got expand_bits={e!r} "
                f"(hash_bits={tau}). The paper uses 2."
            )
        if self.hidden_size % tau != 0:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by hash_bits={tau}: each Memory Layer splits its "
                f"input into K = hidden_size / hash_bits chunks. Pick a hidden_size that is a multiple of {tau} "
                f"or a hash_bits that divides {self.hidden_size}."
            )

    def validate_memoryformer(self) -> None:
        self._check_hash_shapes()
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}. "
                "Pick a number of heads that divides the hidden size."
            )
        m = self.intermediate_size
        inner_bits = self.hash_bits + self.expand_bits
        if not isinstance(m, int) or isinstance(m, bool) or m <= 0:
            raise ValueError(
                f"intermediate_size must be a positive integer, got {m!r}. Leave it unset (None) for the default "
                f"(hash_bits + expand_bits) * K = {inner_bits * self.num_tables}, or use a positive multiple of "
                f"{inner_bits}."
            )
        if m % inner_bits != 0:
            raise ValueError(
                f"intermediate_size={m} is not divisible by hash_bits + expand_bits = {inner_bits}: the second "
                f"Memory Layer of the Memory Block hashes it in chunks of {inner_bits} bits. Use a multiple of "
                f"{inner_bits}, e.g. the default (hash_bits + expand_bits) * K = {inner_bits * self.num_tables}."
            )
        for name in ("layer_norm_eps", "initializer_range", "table_init_std"):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value) or not value > 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}. {_FIXES[name]}")
        enums = {
            "norm_type": (self.norm_type, _NORM_TYPES),
            "attention_output": (self.attention_output, _ATTENTION_OUTPUTS),
            "memory_block_activation": (self.memory_block_activation, _BLOCK_ACTIVATIONS),
            "table_init": (self.table_init, _TABLE_INITS),
        }
        for name, (value, allowed) in enums.items():
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not supported; choose one of {', '.join(map(repr, allowed))}.")
        for name in ("attention_dropout", "hidden_dropout"):
            value = getattr(self, name)
            if not _is_real(value) or not 0 <= value < 1:  # NaN fails the comparison
                raise ValueError(
                    f"{name} must be a number in [0, 1), got {value!r}. Use 0.0 (the default, as Pythia) or a "
                    "probability below 1 such as 0.1."
                )
        for name in ("memory_bias", "use_parallel_residual", "use_cache", "tie_word_embeddings",
                     "sparse_table_gradients"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}. Pass a bool, not a string or number.")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            ids = value if isinstance(value, (list, tuple)) and name == "eos_token_id" else [value]
            if not all(i is None or (_is_int(i) and 0 <= i < self.vocab_size) for i in ids) or not ids:
                kind = "an integer token id, a list of them or None" if name == "eos_token_id" else (
                    "an integer token id or None")
                raise ValueError(
                    f"{name} must be {kind} in [0, vocab_size={self.vocab_size}), got {value!r}. Use the "
                    f"tokenizer's {name.removesuffix('_token_id')} token id, or None."
                )
        self._check_storage_dtypes()
        self._check_rope_parameters()
        if not _is_int(self.loss_chunk_tokens) or self.loss_chunk_tokens < 0:
            raise ValueError(
                f"loss_chunk_tokens must be an integer >= 0, got {self.loss_chunk_tokens!r}. Use a number of tokens per "
                f"chunk of the training loss such as {LINEAR_CE_CHUNK_TOKENS} (the default), or 0 for the full-logits "
                "loss."
            )

    def _check_storage_dtypes(self) -> None:
        for name in ("table_dtype", "lm_head_dtype"):
            canonical_storage_dtype(getattr(self, name), name)
        if self.table_dtype == "int8":
            widths = {"hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size}
            for name, width in widths.items():
                if width % 4:
                    raise ValueError(
                        f"table_dtype='int8' stores each table row with its float32 scale and offset, which needs rows "
                        f"of a multiple of 4 values; {name}={width} is not. Use table_dtype='bfloat16', or a {name} "
                        "that is a multiple of 4."
                    )
        if self.lm_head_dtype is not None and self.tie_word_embeddings:
            raise ValueError(
                f"lm_head_dtype={self.lm_head_dtype!r} needs an LM head of its own, but tie_word_embeddings=True shares "
                "it with the input embedding. Leave lm_head_dtype unset (None) for a tied model."
            )

    # ----------------------------------------------------------------------------------------------------------------
    # RoPE, as GPTNeoXConfig: `rope_parameters` = {"rope_type", "rope_theta", "partial_rotary_factor", + the keys of
    # the type}. transformers' `validate_rope` (run by `PreTrainedConfig.__init__`) checks the keys of each type.
    def convert_rope_params_to_dict(self, **kwargs):
        rope_scaling = kwargs.pop("rope_scaling", None)
        self.rope_parameters = rope_scaling or self.rope_parameters
        self.rope_parameters = dict(self.rope_parameters) if self.rope_parameters is not None else {}
        # Old-style keys (Pythia's config.json): rotary_emb_base / rotary_pct; rope_theta / partial_rotary_factor at
        # the top level are accepted too.
        theta = kwargs.pop("rope_theta", None)
        base = kwargs.pop("rotary_emb_base", None)
        pct = kwargs.pop("rotary_pct", None)
        factor = kwargs.pop("partial_rotary_factor", None)
        if theta is None:
            theta = base if base is not None else self.default_theta
        if factor is None:
            factor = pct if pct is not None else 0.25
        self.rope_parameters.setdefault("rope_theta", theta)
        self.rope_parameters.setdefault("partial_rotary_factor", factor)
        self.standardize_rope_params()
        return kwargs

    def _check_rope_parameters(self) -> None:
        """What `validate_rope` leaves to the model: a rope_type the model can build, a rotary width that fits the head
        (an odd or 1-dim width is rounded up to an even one, as GPT-NeoX does), a positive base."""
        rope = self.rope_parameters
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(
                f"rope_parameters['rope_type']={rope_type!r} is not supported; choose one of "
                f"{', '.join(map(repr, ['default', *ROPE_INIT_FUNCTIONS]))}."
            )
        factor = rope.get("partial_rotary_factor", 1.0)
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise ValueError(
                f"rope_parameters['partial_rotary_factor']={factor!r} must be a number in (0, 1]; Pythia uses 0.25."
            )
        head_dim = self.head_dim
        if int(head_dim * factor) < 1:  # the width MemoryFormerRotaryEmbedding takes: no rotary dims at all
            raise ValueError(
                f"rope_parameters['partial_rotary_factor']={factor!r} rotates int({head_dim} * {factor!r}) = 0 of the "
                f"{head_dim} dims of each head: the model would have no position information. Use at least "
                f"1 / head_dim = {1 / head_dim:g} (Pythia uses 0.25)."
            )
        theta = rope.get("rope_theta")
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
            raise ValueError(f"rope_parameters['rope_theta'] must be a number > 0, got {theta!r}.")

    # ----------------------------------------------------------------------------------------------------------------
    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        """transformers' reader of config.json, which refuses another architecture's config (transformers only logs a
        warning, then builds a MemoryFormer from it and loads whatever tensors share a name)."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        model_type = config_dict.get("model_type")
        if model_type is not None and model_type != cls.model_type:
            hint = (
                f"Convert it into a MemoryFormer with `memoryformer convert --from {pretrained_model_name_or_path} "
                "--out <folder>`, then load that folder."
                if model_type == "gpt_neox"
                else "Load it with the class of its architecture (e.g. transformers' AutoModel) instead."
            )
            raise ValueError(
                f"{pretrained_model_name_or_path} holds a {model_type!r} model (config.json's model_type), not a "
                f"MemoryFormer ('{cls.model_type}'). {hint}"
            )
        return config_dict, kwargs

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "MemoryFormerConfig":
        """The paper's presets: "tiny" (Pythia-70M shape), "small" (Pythia-160M), "base" (Pythia-410M).

        Keyword arguments override preset values, e.g. `from_preset("tiny", num_hidden_layers=2)`.
        """
        if name not in PRESETS:
            raise ValueError(f"Unknown preset {name!r}; choose one of {', '.join(PRESETS)}.")
        with open(_preset_path(name), encoding="utf-8") as f:
            values = json.load(f)
        values.update(overrides)
        return cls(**values)


def canonical_storage_dtype(value, name: str) -> str | None:
    """None, "bfloat16" or "int8" for what a user may write ("bf16", "bfloat16", "int8", "INT8", torch.bfloat16)."""
    if value is None:
        return None
    text = value if isinstance(value, str) else str(value).removeprefix("torch.")
    if text.lower() in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[text.lower()]
    raise ValueError(
        f"{name}={value!r} is not supported; choose 'int8' (a scale and an offset per row, about a quarter of the "
        "float32 bytes, inference only), 'bf16' (half), or None (the model's dtype)."
    )


def _preset_path(name: str) -> str:
    """The preset's config.json, shipped in the wheel as `modeling_memoryformer/presets/<name>/config.json`
    (source tree: `configuration/<name>/config.json`)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for folder in (os.path.join(here, "presets"), os.path.join(os.path.dirname(here), "configuration")):
        path = os.path.join(folder, name, "config.json")
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"The {name!r} preset's config.json is missing (looked in {here}/presets and ../configuration). "
        "Reinstall the package with `pip install .` so that the presets are shipped."
    )


__all__ = ["MemoryFormerConfig"]
