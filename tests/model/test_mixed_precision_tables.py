"""Tables narrower than the computation: bfloat16 / float16 tables in a float32 Memory Layer.

Keeping the tables in bfloat16 halves the memory they take (they are most of a MemoryFormer) while the rest of the
model computes in float32. The output then has the input's dtype (`memory_ops.output_dtype`), the rows are summed in
float32, and gradients reach both the input and the tables. Oracle: the same equations in float64 on the tables'
exact values (a bfloat16 value is exactly representable in float64), written here as a per-token loop.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import require_kernel
from modeling_memoryformer import memory_ops
from modeling_memoryformer.memory_ops import memory_lookup, memory_lookup_hashed, memory_lookup_reference, output_dtype

HASH_BITS = 4


def oracle(x: torch.Tensor, tables: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Per token and table, float64: y = sum_k p(z_k) T_k[h(z_k)] + b, p(z) = 1 / prod_i (1 + exp(-2|z_i|))."""
    x64, t64 = x.double().reshape(-1, x.shape[-1]), tables.double()
    num_tables = x.shape[-1] // HASH_BITS
    out = torch.zeros(x64.shape[0], tables.shape[1], dtype=torch.float64)
    for n, k in itertools.product(range(x64.shape[0]), range(num_tables)):
        z = x64[n, k * HASH_BITS:(k + 1) * HASH_BITS]
        code = sum(1 << i for i in range(HASH_BITS) if z[i] >= 0)
        p = 1.0 / torch.prod(1.0 + torch.exp(-2.0 * z.abs()))
        out[n] += p * t64[(k << HASH_BITS) + code]
    if bias is not None:
        out += bias.double()
    return out.reshape(*x.shape[:-1], tables.shape[1])


def inputs(table_dtype, tokens=37, d_in=16, d_out=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, tokens, d_in, generator=g)
    x = x + 0.05 * torch.sign(x)  # away from zero: a hash bit must not flip between float32 and float64
    tables = torch.randn((d_in // HASH_BITS) << HASH_BITS, d_out, generator=g).to(table_dtype)
    bias = torch.randn(d_out, generator=g)
    return x, tables, bias


def test_output_dtype_is_the_wider_of_input_and_tables():
    assert output_dtype(torch.float32, torch.bfloat16) == torch.float32
    assert output_dtype(torch.float32, torch.float16) == torch.float32
    assert output_dtype(torch.bfloat16, torch.bfloat16) == torch.bfloat16  # a model cast as a whole stays narrow
    assert output_dtype(torch.float32, torch.float32) == torch.float32
    assert output_dtype(torch.float64, torch.float32) == torch.float64


@pytest.mark.parametrize("kernel", ["torch", "fused"])
@pytest.mark.parametrize("table_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 37, 700])  # the fused kernel's token-major, embedding_bag and packed ranges
def test_float32_layer_with_narrow_tables_matches_the_float64_oracle(kernel, table_dtype, tokens):
    require_kernel(kernel)
    x, tables, bias = inputs(table_dtype, tokens=tokens)
    expected = oracle(x, tables, bias)
    # the sum is rounded once to the tables' dtype before it is widened (half a unit there), and the PyTorch path's
    # embedding_bag takes the scores in the tables' dtype too (half a unit each): at most one unit (2**-8 for
    # bfloat16) of the same sum over absolute values, twice that as the bound
    unit = 2 * {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[table_dtype]
    scale = oracle(x, tables.abs(), None) + bias.double().abs()  # the same sum over absolute values
    with memory_ops.use_kernel(kernel):
        for y in (memory_lookup(x, tables, bias, HASH_BITS),
                  memory_lookup_hashed(*_hash(x), tables, bias),
                  memory_lookup_reference(x, tables, bias, HASH_BITS)):
            assert y.dtype == torch.float32 and y.shape == expected.shape
            err = (y.double() - expected).abs()
            assert bool((err <= unit * scale + 1e-5).all()), f"worst {(err / (unit * scale + 1e-5)).max():.3f}"


def _hash(x):
    rows = memory_ops.table_rows(memory_ops.hash_codes(x, HASH_BITS), HASH_BITS)
    return rows, memory_ops.hash_scores(x, HASH_BITS)


@pytest.mark.parametrize("kernel", ["torch", "fused"])
def test_gradients_reach_the_input_and_the_narrow_tables(kernel):
    """d/dx and d/dtables of sum(y * w) against the float64 oracle's, computed by autograd through the oracle."""
    require_kernel(kernel)
    x, tables, bias = inputs(torch.bfloat16, tokens=40)
    w = torch.randn(3, 40, tables.shape[1], generator=torch.Generator().manual_seed(1))
    x64 = x.double().requires_grad_()
    t64 = tables.double().requires_grad_()
    (oracle_torch(x64, t64, bias.double()) * w.double()).sum().backward()

    x32 = x.clone().requires_grad_()
    t16 = tables.clone().requires_grad_()
    with memory_ops.use_kernel(kernel):
        (memory_lookup(x32, t16, bias, HASH_BITS) * w).sum().backward()
    assert t16.grad.dtype == torch.bfloat16 and x32.grad.dtype == torch.float32
    # bfloat16 gradients (grad_y reaches the lookup in the tables' dtype): one unit of bfloat16 relative to the
    # same sum over absolute values, plus the rounding of grad_y itself
    assert torch.allclose(t16.grad.double(), t64.grad, rtol=2e-2, atol=2e-2 * t64.grad.abs().max().item())
    assert torch.allclose(x32.grad.double(), x64.grad, rtol=2e-2, atol=2e-2 * x64.grad.abs().max().item())


def oracle_torch(x, tables, bias):
    """The oracle with torch ops (differentiable): the reference formulation on float64 tensors."""
    return memory_lookup_reference(x, tables, bias, HASH_BITS)
