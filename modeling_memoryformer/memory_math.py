"""The Memory Layer's equations, written plainly: hashing, bucket scores, the table rows, and the reference lookup.

Paper equations (MemoryFormer, NeurIPS 2024, section 3.1), for an input x in R^{d_in} split into
K = d_in / tau contiguous chunks z_k of tau values each:

    h(z_k)  = sum_i [z_k,i >= 0] * 2^i                      (eq. integer(); sign(0) = +1)
    p(z_k)  = 1 / prod_i (1 + exp(-2 |z_k,i| / t))           (eq. hash_proj, the bucket probability)
    y       = sum_k p(z_k) * T_k[h(z_k)] + b                 (eq. hash_proj)

The K tables are stored as one parameter of shape [K * 2**tau, d_out], table-major, so that the row of
table k for code c is row k * 2**tau + c.

`memory_lookup_reference` is the oracle every faster path is checked against. The score functions are named in
HASH_SCORES, their one list: a new score adds its name there, its formula to `hash_scores` (and so to the PyTorch
kernels, memory_backend_torch.py), and its formula to the fused CPU kernel (csrc/cpu/), which refuses names it does
not implement.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


HASH_SCORES = ("paper", "l1")


def check_hash_parameters(hash_bits, score="paper", temperature=1.0, names=("hash_bits", "score", "temperature"),
                          width: int | None = None) -> None:
    """The one check of a Memory Layer's hashing parameters, for the config (with its field names as `names`), the
    layer and the ops: tau an integer in 1..16, a known score, a finite temperature > 0. `width`: the model width,
    to say how large the tables of a too-large tau would be."""
    bits_name, score_name, temperature_name = names
    if not isinstance(hash_bits, int) or isinstance(hash_bits, bool) or not 1 <= hash_bits <= 16:
        detail = ""
        if width and isinstance(hash_bits, int) and not isinstance(hash_bits, bool) and hash_bits > 16:
            table_bytes = (width // hash_bits or 1) * (2**hash_bits) * width * 4
            detail = f" With {bits_name}={hash_bits} one {width} -> {width} Memory Layer would need {table_bytes:,} " \
                     "bytes of float32 tables."
        raise ValueError(f"{bits_name} must be an integer in 1..16, got {hash_bits!r}.{detail} The paper uses 8 "
                         "(tables of 256 rows).")
    if not isinstance(score, str) or score not in HASH_SCORES:
        raise ValueError(f"{score_name}={score!r} is not supported; choose one of {', '.join(map(repr, HASH_SCORES))}.")
    if (not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not math.isfinite(temperature)
            or not temperature > 0):
        raise ValueError(f"{temperature_name} must be a finite number > 0, got {temperature!r}. The paper uses 1.0.")


def num_tables_for(in_features: int, hash_bits: int) -> int:
    """K = d_in / tau; raise a ValueError naming the fix when tau is not valid or does not divide d_in."""
    check_hash_parameters(hash_bits)
    if in_features % hash_bits != 0:
        raise ValueError(
            f"in_features={in_features} is not divisible by hash_bits={hash_bits}: a Memory Layer splits its "
            f"input into chunks of hash_bits values. Choose in_features as a multiple of {hash_bits}."
        )
    return in_features // hash_bits


def _chunks(x: torch.Tensor, hash_bits: int) -> torch.Tensor:
    """[..., K * tau] -> [..., K, tau]."""
    num_tables_for(x.shape[-1], hash_bits)
    return x.unflatten(-1, (x.shape[-1] // hash_bits, hash_bits))


def hash_codes(x: torch.Tensor, hash_bits: int) -> torch.Tensor:
    """Hash codes h(z_k) of every chunk: [..., K * tau] -> int64 [..., K] with values in [0, 2**tau).

    Element i of a chunk carries bit 2**i, and an element >= 0 (an exact zero included) sets its bit.
    """
    z = _chunks(x, hash_bits)
    weights = torch.ones(hash_bits, dtype=torch.long, device=x.device) << torch.arange(hash_bits, device=x.device)
    return ((z >= 0).long() * weights).sum(-1)


def hash_scores(x: torch.Tensor, hash_bits: int, score: str = "paper", temperature: float = 1.0) -> torch.Tensor:
    """Weight of each retrieved row: [..., K * tau] -> [..., K], in the dtype of x.

    score="paper": p(z) = 1 / prod_i (1 + exp(-2|z_i|/t)), computed as exp(-sum_i softplus(-2|z_i|/t)).
    score="l1":    ||z||_1 * p(z), the authors' training code (unbounded, roughly scale-equivariant).
    Half-precision inputs are scored in float32 and the result cast back.
    """
    check_hash_parameters(hash_bits, score, temperature)
    z = _chunks(x, hash_bits)
    compute_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    z_abs = z.to(compute_dtype).abs()
    log_p = -F.softplus(-2.0 * z_abs / temperature).sum(-1)
    p = log_p.exp()
    if score == "l1":
        p = p * z_abs.sum(-1)
    return p.to(x.dtype)


def table_rows(codes: torch.Tensor, hash_bits: int) -> torch.Tensor:
    """Flat row index into the [K * 2**tau, d_out] table parameter: k * 2**tau + h(z_k)."""
    num_tables = codes.shape[-1]
    offsets = torch.arange(num_tables, device=codes.device, dtype=codes.dtype) << hash_bits
    return codes + offsets


def check_tables(x: torch.Tensor, tables: torch.Tensor, hash_bits: int) -> None:
    num_tables = num_tables_for(x.shape[-1], hash_bits)
    if tables.dim() != 2 or tables.shape[0] != num_tables << hash_bits:
        raise ValueError(
            f"tables must have shape [K * 2**hash_bits, out_features] = [{num_tables << hash_bits}, out_features] "
            f"for an input of {x.shape[-1]} features and hash_bits={hash_bits}; got {tuple(tables.shape)}."
        )


def memory_lookup_reference(
    x: torch.Tensor,
    tables: torch.Tensor,
    bias: torch.Tensor | None,
    hash_bits: int,
    score: str = "paper",
    temperature: float = 1.0,
) -> torch.Tensor:
    """The Memory Layer written straight from the equations; the oracle for every other path.

    x: [..., K * tau], tables: [K * 2**tau, d_out], bias: [d_out] or None -> [..., d_out].
    Gathers the K rows of every token explicitly ([..., K, d_out]) and sums them weighted by the scores.
    """
    check_tables(x, tables, hash_bits)
    dtype = output_dtype(x.dtype, tables.dtype)
    rows = tables[table_rows(hash_codes(x, hash_bits), hash_bits)].to(dtype)  # [..., K, d_out]
    scores = hash_scores(x, hash_bits, score, temperature).to(dtype)  # [..., K]
    y = (scores.unsqueeze(-1) * rows).sum(-2)
    if bias is not None:
        y = y + bias
    return y


def output_dtype(input_dtype: torch.dtype, table_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a Memory Layer's output: the wider of its input's and its tables'. Tables kept in bfloat16 to halve
    their memory, in a model that computes in float32, give float32 outputs (the rows are summed in float32 either
    way); a model cast to bfloat16 as a whole stays bfloat16."""
    return torch.promote_types(input_dtype, table_dtype)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums are accumulated in: float64 for float64 data, float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32
