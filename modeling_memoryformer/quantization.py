"""Hash tables and the LM head stored narrower than float32, for inference: int8 with a scale and an offset per row,
or bfloat16; every sum is accumulated in float32.

A MemoryFormer's tables are most of its bytes (paper Table 1: 138 MB of fp16 tables per MF-tiny block against 6.3 MB
of Pythia-70M weights): narrower rows are less memory, and less time where reads dominate (a layer's lookup over
tables far larger than the caches; above all, while decoding, the LM head, read whole for every token).

int8 tables use FBGEMM's 8-bit row-wise layout, the one `torch.ops.quantized.embedding_bag_byte_prepack` writes and
`torch.ops.quantized.embedding_bag_byte_rowwise_offsets` reads: each row of d values v is stored as d codes
q = round((v - min) / scale) in 0..255, then its float32 scale = (max - min) / 255 and offset = min, so that

    v ~ q * scale + offset                                               (row-wise affine dequantisation)

and a Memory Layer's output is y = sum_k p(z_k) * (q_k * scale_k + offset_k) + b (paper eq. hash_proj), summed in
float32. A layer keeps three tensors, `tables_codes` uint8 [R, d], `tables_scale` and `tables_offset` float32 [R]; on
the CPU they are views of one [R, d + 8] block in that layout, so the fused kernel's `int8_lookup` (few tokens) and
the PyTorch op (more; see `int8_cpu_path`) read them without a copy. On any other device, or while that block is not
assembled, the rows are dequantised by the formula above (the PyTorch path every device runs).

The int8 LM head is per-row symmetric: `weight_int8` int8 [V, d] and `weight_scale` float32 [V], W ~ q * scale. On the
CPU it runs PyTorch's dynamically quantised linear (`torch.ops.quantized.linear_dynamic`, FBGEMM: the activations are
quantised per call, the products summed in int32); elsewhere, `F.linear` on the dequantised weight.

Quantised parts are for inference: they have no gradient, a backward pass through them raises, and the model refuses
`train()`; `dequantize_tables()` gives float32 tables (with the rounding of the int8 values) to train again.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_memoryformer import canonical_storage_dtype
from .memory_kernels import _CPU_KEYS, dispatcher_watched, fused_ops, uses_fused
from .memory_ops import hashed_rows


INT8_ROW_BYTES = 8  # the float32 scale and offset after each row's codes


def training_refusal(what: str) -> str:
    """The error message of every refused training step."""
    return (
        f"This MemoryFormer holds {what} (inference only): int8 values have no gradients and no optimizer can update "
        "them. To train, load the float32 model, or call model.dequantize_tables() first (float32 tables and "
        "head holding the int8 values, rounding error included)."
    )


# ---------------------------------------------------------------------------------------------------------------------
# int8 tables: quantise, assemble, dequantise


def quantize_int8_rows(tables: torch.Tensor) -> torch.Tensor:
    """[R, d] floating tables -> uint8 [R, d + 8] in FBGEMM's row-wise layout (codes, float32 scale, float32 offset),
    on the tables' device. The rounding is PyTorch's own (`embedding_bag_byte_prepack`, a CPU op)."""
    packed = torch.ops.quantized.embedding_bag_byte_prepack(tables.detach().to("cpu", torch.float32).contiguous())
    return packed.to(tables.device)


def int8_views(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 [R, d], scale float32 [R], offset float32 [R]): views of a [R, d + 8] block, no copy."""
    d = packed.shape[1] - INT8_ROW_BYTES
    if d % 4:  # a float32 view needs 4-byte aligned rows
        raise ValueError(f"int8 tables need a row width that is a multiple of 4, got {d}.")
    codes = packed[:, :d]
    scale = packed[:, d : d + 4].view(torch.float32)[:, 0]
    offset = packed[:, d + 4 :].view(torch.float32)[:, 0]
    return codes, scale, offset


def assemble_int8(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The [R, d + 8] block of `int8_views` from three separate tensors (e.g. as loaded from a checkpoint)."""
    rows, d = codes.shape
    packed = torch.empty(rows, d + INT8_ROW_BYTES, dtype=torch.uint8, device=codes.device)
    packed_codes, packed_scale, packed_offset = int8_views(packed)
    packed_codes.copy_(codes)
    packed_scale.copy_(scale)
    packed_offset.copy_(offset)
    return packed


def int8_block(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor | None:
    """The [R, d + 8] uint8 block the three tensors are views of, or None when they are not (separate tensors, another
    dtype for the scales, another device...)."""
    if codes.dtype != torch.uint8 or scale.dtype != torch.float32 or offset.dtype != torch.float32:
        return None
    rows, d = codes.shape
    width = d + INT8_ROW_BYTES
    storage = codes.untyped_storage()
    if (
        codes.stride() != (width, 1)
        or scale.stride() != (width // 4,)
        or offset.stride() != (width // 4,)
        or scale.untyped_storage().data_ptr() != storage.data_ptr()
        or offset.untyped_storage().data_ptr() != storage.data_ptr()
        or scale.data_ptr() != codes.data_ptr() + d
        or offset.data_ptr() != codes.data_ptr() + d + 4
    ):
        return None
    block = torch.empty(0, dtype=torch.uint8, device=codes.device)
    return block.set_(storage, codes.storage_offset(), (rows, width), (width, 1))


def dequantize_int8(
    codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """q * scale + offset in float32: the whole table, or the rows `rows` ([..., ] -> [..., d])."""
    if rows is not None:
        codes, scale, offset = codes[rows], scale[rows], offset[rows]
    return codes.to(torch.float32) * scale.to(torch.float32).unsqueeze(-1) + offset.to(torch.float32).unsqueeze(-1)


# ---------------------------------------------------------------------------------------------------------------------
# int8 tables: the lookup


class _NoGradient(torch.autograd.Function):
    """Identity forward; a backward pass raises `message` (quantised tables and heads cannot be trained)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, message: str, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.message = message
        return y.view_as(y)  # y arrives detached: the graph starts here

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(ctx.message)


def refuse_backward(y: torch.Tensor, inputs: tuple[torch.Tensor | None, ...], what: str) -> torch.Tensor:
    """y, made to raise a clear error in backward when autograd records it (any of `inputs` requires grad)."""
    recorded = [t for t in inputs if t is not None and t.requires_grad]
    if torch.is_grad_enabled() and recorded:  # the inputs make the output require grad, whatever path computed y
        return _NoGradient.apply(y.detach(), training_refusal(what), *recorded)
    return y


# Which CPU pass reads an assembled int8 block: the fused kernel's `int8_lookup` (token-major: per token, its K rows'
# codes converted to float in registers, weighted by score * scale, the offsets summed once per token) or PyTorch's
# 8-bit row-wise embedding bag (FBGEMM's JIT-generated kernel). A single token's lookup is K row reads, which the fused
# pass issues at once with no per-call setup; with more tokens both passes are compute-bound and FBGEMM's kernel spends
# fewer instructions per code. The crossover measured lies between 4 and 16 tokens and was not tied to the tables'
# size, so the rule is a token count: decoding takes the fused pass, prefill and batches FBGEMM's (docs/kernel.md,
# "Measurements behind the design choices").
INT8_FUSED_MAX_TOKENS = 4
INT8_PATHS = ("fused", "fbgemm")
FORCE_INT8_PATH: str | None = None  # "fused" or "fbgemm" forces one path where both can run (benchmarks, tests)


def int8_cpu_path(tokens: int) -> str:
    """The pass for `tokens` lookups of K rows on an assembled CPU block with the fused kernel in use: "fused" up to
    INT8_FUSED_MAX_TOKENS tokens, "fbgemm" beyond (see the figures above); FORCE_INT8_PATH overrides."""
    if FORCE_INT8_PATH is not None:
        if FORCE_INT8_PATH not in INT8_PATHS:
            raise ValueError(f"FORCE_INT8_PATH must be one of {INT8_PATHS} or None, got {FORCE_INT8_PATH!r}.")
        return FORCE_INT8_PATH
    return "fused" if tokens <= INT8_FUSED_MAX_TOKENS else "fbgemm"


def int8_lookup(
    rows: torch.Tensor,
    scores: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    block: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_k scores[..., k] * (codes * scale + offset)[rows[..., k]] (+ bias), summed in float32, returned in `dtype`.

    rows, scores: [..., K] (rows[..., k] index table k of the [R, d] table) -> [..., d]. On the CPU with the tables
    assembled (`block`, found by `int8_block` when not given), a pass that reads the codes and dequantises in
    registers: the fused kernel's `int8_lookup` for few tokens when that kernel is in use, else PyTorch's 8-bit
    row-wise embedding bag (FBGEMM; see `int8_cpu_path`); otherwise the rows are dequantised in PyTorch: the K rows of
    every token, or the whole table when that is smaller.
    """
    lead, num_tables = rows.shape[:-1], rows.shape[-1]
    flat_rows = rows.reshape(-1, num_tables)
    weights = scores.reshape(-1, num_tables).to(torch.float32)
    if block is None and codes.device.type == "cpu":
        block = int8_block(codes, scale, offset)
    fused = block is not None and uses_fused(block) and int8_cpu_path(flat_rows.shape[0]) == "fused"
    if fused:  # the bias is added in the kernel
        y = fused_ops().int8_lookup(
            flat_rows.contiguous(), weights.detach(), block, None if bias is None else bias.detach(),
            codes.shape[0] // num_tables,
        )
    elif block is not None:
        y = torch.ops.quantized.embedding_bag_byte_rowwise_offsets(
            block,
            flat_rows,  # [tokens, K]: one bag of K rows per token
            None,
            False,
            0,  # mode: sum
            False,
            weights.detach(),
            None,
            False,
        )
    elif flat_rows.numel() < codes.shape[0]:  # fewer rows to read than the table holds: dequantise just those
        y = (weights.unsqueeze(-1) * dequantize_int8(codes, scale, offset, flat_rows)).sum(-2)
    else:
        y = F.embedding_bag(flat_rows, dequantize_int8(codes, scale, offset), per_sample_weights=weights, mode="sum")
    if bias is not None and not fused:
        y = y.add_(bias) if block is not None else y + bias.to(torch.float32)
    y = refuse_backward(y.to(dtype), (scores, bias), "int8 tables")
    return y.reshape(*lead, codes.shape[1])


def int8_inference_lookup(x: torch.Tensor, block: torch.Tensor | None, bias: torch.Tensor | None, hash_bits: int,
                          score: str, temperature: float) -> torch.Tensor | None:
    """`int8_memory_lookup` for a Memory Layer's own checked arguments when nothing is recorded (generation): the fused
    kernel's hash and int8_lookup ops called directly, as `memory_ops.inference_lookup` does for float tables; the
    same ops on the same operands. None where it does not apply (the caller takes the general path)."""
    tokens = x.numel() // max(1, x.shape[-1])
    if (block is None or torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype == torch.float64
            or int8_cpu_path(tokens) != "fused" or dispatcher_watched() or not uses_fused(block)):
        return None
    ops = fused_ops()
    rows, scores = ops.hash.default.redispatch(_CPU_KEYS, x.reshape(tokens, x.shape[-1]).contiguous(), hash_bits,
                                               score, temperature)
    y = ops.int8_lookup(rows, scores.to(torch.float32), block, bias, block.shape[0] // rows.shape[1])  # as int8_lookup
    return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)


def int8_memory_lookup(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    bias: torch.Tensor | None,
    hash_bits: int,
    score: str = "paper",
    temperature: float = 1.0,
    block: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Memory Layer on int8 tables: x [..., K * tau] -> [..., d] in x's dtype (`memory_ops.memory_lookup` with
    the rows dequantised). Hashing and scoring as the float path: the fused kernel's pass on the CPU when it is in
    use, the PyTorch formulation otherwise."""
    rows, scores = hashed_rows(x, hash_bits, score, temperature)
    return int8_lookup(rows, scores, codes, scale, offset, bias, x.dtype, block)


# ---------------------------------------------------------------------------------------------------------------------
# The LM head


class Int8LMHead(nn.Module):
    """An LM head [V, d] stored as int8 with a float32 scale per row (symmetric: W ~ weight_int8 * weight_scale), for
    inference. CPU: PyTorch's dynamically quantised linear (FBGEMM, prepacked once per process and kept beside the int8
    weight); other devices: `F.linear` on the dequantised weight. Output in the input's dtype."""

    def __init__(self, in_features: int, out_features: int, device=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self._prepacked = None  # (the int8 tensor it was packed from, FBGEMM's packed weight)

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> Int8LMHead:
        """Quantise a [V, d] weight: scale = max |row| / 127, q = round(w / scale) in -127..127."""
        head = cls(weight.shape[1], weight.shape[0], device=weight.device)
        w = weight.detach().to(torch.float32)
        scale = w.abs().amax(dim=1) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: any scale, codes 0
        head.weight_int8.copy_(torch.round(w / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8))
        head.weight_scale.copy_(scale)
        return head

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight_int8.to(torch.float32) * self.weight_scale.to(torch.float32).unsqueeze(1)

    def _fbgemm_weight(self):
        """FBGEMM's prepacked weight for `linear_dynamic`, rebuilt when the int8 tensor changed; None when the op is not
        there. The quantised tensor it is made from is created by an API PyTorch marks deprecated (its warning is
        silenced here); without it the head dequantises."""
        if self._prepacked is not None and self._prepacked[0] is self.weight_int8:
            return self._prepacked[1]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                quantized = torch._make_per_channel_quantized_tensor(
                    self.weight_int8, self.weight_scale.to(torch.float64),
                    torch.zeros(self.out_features, dtype=torch.long), 0,
                )
                packed = torch.ops.quantized.linear_prepack(quantized, None)
        except (AttributeError, RuntimeError):
            packed = None
        self._prepacked = (self.weight_int8, packed)
        return packed

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        packed = None
        if hidden_states.device.type == "cpu" and self.weight_int8.device.type == "cpu":
            packed = self._fbgemm_weight()
        if packed is not None:
            x = hidden_states.to(torch.float32)
            y = torch.ops.quantized.linear_dynamic(x.detach().reshape(-1, self.in_features).contiguous(), packed, True)
            y = y.view(*hidden_states.shape[:-1], self.out_features)
        else:
            y = F.linear(hidden_states.to(torch.float32), self.dequantized_weight())
        return refuse_backward(y.to(hidden_states.dtype), (hidden_states,), "an int8 LM head")

    def train(self, mode: bool = True):
        if mode:
            raise RuntimeError(training_refusal("an int8 LM head"))
        return super().train(mode)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype=int8 (row-wise symmetric)"


def bf16_linear(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A bfloat16 weight applied to an input of any dtype: the input rounded to bfloat16, the products summed in float32
    by the backend's bfloat16 GEMM, the result returned in the input's dtype."""
    y = F.linear(hidden_states.to(torch.bfloat16), weight, None if bias is None else bias.to(torch.bfloat16))
    return y.to(hidden_states.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# The model's API for stored dtypes


class TableStorageMixin:
    """`quantize_tables`, `quantize_lm_head` and `dequantize_tables` of MemoryFormerPreTrainedModel, and its refusal
    to train int8 parts. The model class names its Memory Layer and LM head classes in `_memory_layer_class` and
    `_lm_head_class`."""

    _memory_layer_class: type
    _lm_head_class: type

    @torch.no_grad()
    def quantize_tables(self, dtype: str, lm_head: str | None = None):
        """Store every Memory Layer's tables as `dtype`, in place, and record it in the config (`table_dtype`) so that
        `save_pretrained` / `from_pretrained` keep it; returns the model.

        dtype: "int8" (codes with a float32 scale and offset per row, about a quarter of the float32 bytes; inference
            only: the model refuses `train()` and backward passes) or "bf16" (half; the tables stay trainable).
        lm_head: also store the LM head as "int8" (a float32 scale per row, inference only) or "bf16"; None leaves it.
        Rows are summed in float32 and the model's outputs keep their dtype.
        """
        dtype = canonical_storage_dtype(dtype, "dtype")
        if dtype is None:
            raise ValueError(
                "quantize_tables needs dtype='int8' or 'bf16'; use model.quantize_lm_head(...) to quantise only the "
                "LM head, and model.dequantize_tables() to go back to float32."
            )
        layers = [m for m in self.modules() if isinstance(m, self._memory_layer_class)]
        if dtype != "int8" and any(layer.table_dtype == "int8" for layer in layers):
            raise ValueError(
                f"The tables are int8 already; storing them as {dtype} would round them twice. Quantise the float32 "
                "model instead, or call model.dequantize_tables() first."
            )
        for layer in layers:  # one layer at a time: the float32 copy of only one is alive at once
            layer.quantize_tables_(dtype)
        self.config.table_dtype = dtype
        if lm_head is not None:
            self.quantize_lm_head(lm_head)
        if self._inference_only_parts():
            self.eval()
        return self

    @torch.no_grad()
    def quantize_lm_head(self, dtype: str):
        """Store the LM head as "int8" (per-row symmetric, float32 scales; inference only) or "bf16"; returns the
        model. Recorded in the config (`lm_head_dtype`)."""
        dtype = canonical_storage_dtype(dtype, "lm_head")
        head = self.get_output_embeddings() if hasattr(self, "lm_head") else None
        if dtype is None or head is None:
            raise ValueError(
                "quantize_lm_head needs 'int8' or 'bf16' and a model with an LM head (MemoryFormerForCausalLM); "
                f"got {dtype!r} for a {type(self).__name__}."
            )
        if self.config.tie_word_embeddings:
            raise ValueError(
                "This model ties its LM head to the input embedding (tie_word_embeddings=True): the head has no weight "
                "of its own to quantise. Quantise only the tables (lm_head=None)."
            )
        if dtype == self.config.lm_head_dtype:
            return self
        if isinstance(head, Int8LMHead):
            raise ValueError(
                f"The LM head is int8 already; storing it as {dtype} would round it twice. Quantise the float32 model "
                "instead, or call model.dequantize_tables() first."
            )
        if type(head) is not self._lm_head_class:
            raise ValueError(
                f"The LM head is a {type(head).__name__}, not this model's MemoryFormerLMHead (e.g. wrapped by PEFT): "
                "merge or unload the adapter first."
            )
        if dtype == "int8":
            self.lm_head = Int8LMHead.from_weight(head.weight)
            self.lm_head.eval()
        else:
            head.weight = nn.Parameter(head.weight.to(torch.bfloat16), requires_grad=head.weight.requires_grad)
        self.config.lm_head_dtype = dtype
        return self

    @torch.no_grad()
    def dequantize_tables(self, dtype: torch.dtype = torch.float32):
        """Undo `quantize_tables` / `quantize_lm_head`: tables and LM head back to trainable `dtype` parameters holding
        the stored values (int8: codes * scale + offset, rounding error included); returns the model."""
        for layer in self.modules():
            if isinstance(layer, self._memory_layer_class):
                layer.dequantize_tables_(dtype)
        self.config.table_dtype = None
        head = getattr(self, "lm_head", None)
        if isinstance(head, Int8LMHead):
            self.lm_head = self._lm_head_class(head.in_features, head.out_features, bias=False,
                                              device=head.weight_int8.device, dtype=dtype)
            self.lm_head.weight.copy_(head.dequantized_weight())
        elif isinstance(head, self._lm_head_class) and head.weight.dtype != dtype:
            head.weight = nn.Parameter(head.weight.to(dtype))
        self.config.lm_head_dtype = None
        return self

    def _inference_only_parts(self) -> str | None:
        """What stops this model from training ("int8 tables", "an int8 LM head"), or None."""
        parts = []
        if any(isinstance(m, self._memory_layer_class) and m.table_dtype == "int8" for m in self.modules()):
            parts.append("int8 tables")
        if any(isinstance(m, Int8LMHead) for m in self.modules()):
            parts.append("an int8 LM head")
        return " and ".join(parts) or None

    def train(self, mode: bool = True):
        if mode and (parts := self._inference_only_parts()):
            raise RuntimeError(training_refusal(parts))  # before any submodule changes its mode
        return super().train(mode)
