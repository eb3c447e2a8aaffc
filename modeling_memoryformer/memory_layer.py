"""The Memory Layer: a fully-connected layer replaced by K hash tables (paper eq. hash_proj), as an nn.Module with
its tables stored in float, bfloat16 or int8 (quantization.py), its hash shareable between layers of the same input,
and dense or sparse table gradients. The maths and kernels are in memory_ops.py and the modules it names."""

from __future__ import annotations

import torch
from torch import nn

from .configuration_memoryformer import canonical_storage_dtype
from .huge_pages import place_int8_block
from .memory_ops import (
    check_hash_parameters,
    hash_codes,
    hash_scores,
    inference_lookup,
    memory_lookup,
    memory_lookup_hashed,
    num_tables_for,
    table_rows,
)
from .quantization import (
    INT8_ROW_BYTES,
    assemble_int8,
    dequantize_int8,
    int8_block,
    int8_inference_lookup,
    int8_lookup,
    int8_memory_lookup,
    int8_views,
    quantize_int8_rows,
    training_refusal,
)


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
        table_dtype: None (tables in `dtype`), "bfloat16", or "int8" (inference only, see quantization.py).
        sparse: the gradient of `tables` is a sparse tensor of the rows hit, as with `nn.Embedding(sparse=True)`
            (for few tokens per step; take an optimizer that accepts sparse gradients, e.g. `torch.optim.SparseAdam`).

    Parameters: `tables` [K * 2**hash_bits, out_features] (table-major) and `bias` [out_features]. With int8 tables,
    `tables` is None and the buffers `tables_codes` uint8 [K * 2**hash_bits, out_features], `tables_scale` and
    `tables_offset` float32 [K * 2**hash_bits] hold them (row r ~ codes[r] * scale[r] + offset[r]).
    Input [..., in_features] -> output [..., out_features].

    `row_segments`: how many of the paper's table rows one row holds side by side (3 for the attention's fused
    Q/K/V layer, whose row is the Q, K and V rows of one bucket; 1 otherwise). Nothing in the forward depends on it;
    the row-wise table optimizers keep one state per segment. `is_qkv`: this is that fused Q/K/V layer (its tables
    take small_init under `config.table_init="authors"`).
    """

    row_segments: int = 1
    is_qkv: bool = False

    def __init__(
        self,
        in_features: int,
        out_features: int,
        hash_bits: int,
        bias: bool = True,
        score: str = "paper",
        temperature: float = 1.0,
        table_dtype: str | None = None,
        sparse: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if not isinstance(sparse, bool):
            raise ValueError(f"sparse must be True or False, got {sparse!r}.")
        self.sparse = sparse
        check_hash_parameters(hash_bits, score, temperature)
        if out_features <= 0:
            raise ValueError(f"out_features must be positive, got {out_features}.")
        self.in_features = in_features
        self.out_features = out_features
        self.hash_bits = hash_bits
        self.num_tables = num_tables_for(in_features, hash_bits)
        self.score = score
        self.temperature = float(temperature)
        self.table_dtype = canonical_storage_dtype(table_dtype, "table_dtype")
        factory = {"device": device, "dtype": dtype}
        rows = self.num_tables << hash_bits
        if self.table_dtype == "int8":
            self._check_int8_width()
            self.register_parameter("tables", None)
            self._set_int8(torch.empty(rows, out_features + INT8_ROW_BYTES, dtype=torch.uint8, device=device))
        else:
            table_factory = {**factory, "dtype": torch.bfloat16} if self.table_dtype == "bfloat16" else factory
            self.tables = nn.Parameter(torch.empty(rows, out_features, **table_factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        if self.tables is not None:
            nn.init.normal_(self.tables, std=std)
        elif self.tables_codes.device.type != "meta":  # int8: the int8 rounding of an N(0, std) table
            rows = torch.empty(self.tables_codes.shape, device=self.tables_codes.device).normal_(std=std)
            self._set_int8(quantize_int8_rows(rows))
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    # ----------------------------------------------------------------------------------------------------------------
    # Table storage for inference: bfloat16 or int8 (see quantization.py)
    def _check_int8_width(self) -> None:
        if self.out_features % 4:
            raise ValueError(
                f"int8 tables store each row with its float32 scale and offset, which needs out_features to be a "
                f"multiple of 4; this layer has {self.out_features}. Use 'bfloat16' tables for it."
            )

    def _set_int8(self, packed: torch.Tensor) -> None:
        """Hold int8 tables as the three views of one [R, d + 8] block (FBGEMM's row-wise layout), the block on huge
        pages where that helps (huge_pages.py)."""
        packed = place_int8_block(packed)
        codes, scale, offset = int8_views(packed)
        for name, value in (("tables_codes", codes), ("tables_scale", scale), ("tables_offset", offset)):
            if name in self._buffers:
                self._buffers[name] = value
            else:
                self.register_buffer(name, value)
        self._int8_block = (codes, scale, offset, packed)

    def _int8_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(codes, scale, offset, the block they are views of or None). On the CPU, three separate tensors (as
        `from_pretrained` or `.to()` leave them) are first assembled into one block, once, so that the embedding bag
        reads them in place. The block is remembered with the three tensors it was made for: a cheap check per call."""
        codes, scale, offset = self.tables_codes, self.tables_scale, self.tables_offset
        known = getattr(self, "_int8_block", None)
        if known is not None and known[0] is codes and known[1] is scale and known[2] is offset:
            return codes, scale, offset, known[3]
        block = int8_block(codes, scale, offset) if codes.device.type == "cpu" else None
        if block is None and codes.device.type == "cpu" and not torch.compiler.is_compiling():
            self._set_int8(assemble_int8(codes, scale, offset))
            return self._int8_tables()
        self._int8_block = (codes, scale, offset, block)
        return codes, scale, offset, block

    @torch.no_grad()
    def quantize_tables_(self, dtype: str) -> MemoryLayer:
        """Store the tables as "bfloat16" or "int8" (row-wise scale and offset), in place; returns the layer."""
        dtype = canonical_storage_dtype(dtype, "dtype")
        if dtype is None:
            raise ValueError("quantize_tables_ needs 'int8' or 'bf16'; dequantize_tables_() restores float32 tables.")
        if dtype == self.table_dtype:
            return self
        if self.table_dtype == "int8":
            raise ValueError(
                f"These tables are int8 already; rounding them to {dtype} would round twice. Quantise the float32 "
                "model instead, or call dequantize_tables_() first."
            )
        if dtype == "int8":
            self._check_int8_width()
            packed = quantize_int8_rows(self.tables)
            del self.tables
            self.register_parameter("tables", None)
            self._set_int8(packed)
            self.eval()
        else:
            self.tables = nn.Parameter(self.tables.to(torch.bfloat16), requires_grad=self.tables.requires_grad)
        self.table_dtype = dtype
        return self

    @torch.no_grad()
    def dequantize_tables_(self, dtype: torch.dtype = torch.float32) -> MemoryLayer:
        """Tables back to a trainable `dtype` Parameter holding the stored values (int8: codes * scale + offset)."""
        if self.table_dtype == "int8":
            tables = dequantize_int8(self.tables_codes, self.tables_scale, self.tables_offset).to(dtype)
            for name in ("tables_codes", "tables_scale", "tables_offset"):
                del self._buffers[name]
            self._int8_block = None
            self.tables = nn.Parameter(tables)
        elif self.tables is not None:
            self.tables = nn.Parameter(self.tables.to(dtype))
        self.table_dtype = None
        return self

    def _apply(self, fn, recurse: bool = True):
        self._int8_block = None  # `.to()`, `.float()`...: forget the block, which may hold the old tensors alive
        return super()._apply(fn, recurse)

    def train(self, mode: bool = True):
        if mode and self.table_dtype == "int8":
            raise RuntimeError(training_refusal("int8 tables"))
        return super().train(mode)

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
            if self.table_dtype == "int8":
                codes, scale, offset, block = self._int8_tables()
                if (y := int8_inference_lookup(x, block, self.bias, self.hash_bits, self.score,
                                               self.temperature)) is not None:
                    return y  # generation: the same ops without the general path's checks
                return int8_memory_lookup(x, codes, scale, offset, self.bias, self.hash_bits, self.score,
                                          self.temperature, block)
            if (y := inference_lookup(x, self.tables, self.bias, self.hash_bits, self.score,
                                              self.temperature)) is not None:
                return y  # generation: the same ops without the general path's checks (see inference_lookup)
            return memory_lookup(x, self.tables, self.bias, self.hash_bits, self.score, self.temperature,
                                 self.sparse)
        rows, scores = hashed
        if rows.shape[-1] != self.num_tables:
            raise ValueError(
                f"The hash has {rows.shape[-1]} tables per token but this layer has {self.num_tables}; share a "
                "hash only between Memory Layers of the same in_features and hash_bits."
            )
        if self.table_dtype == "int8":
            codes, scale, offset, block = self._int8_tables()
            return int8_lookup(rows, scores, codes, scale, offset, self.bias, scores.dtype, block)
        return memory_lookup_hashed(rows, scores, self.tables, self.bias, self.sparse)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, hash_bits={self.hash_bits}, "
            f"num_tables={self.num_tables}, bias={self.bias is not None}, score={self.score!r}, "
            f"temperature={self.temperature}" + (f", table_dtype={self.table_dtype!r}" if self.table_dtype else "")
            + (", sparse=True" if self.sparse else "")
        )
