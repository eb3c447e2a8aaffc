"""The Memory Layer (paper section 2.3, eq. integer(), hash_proj, hash_backward).

Oracles: a per-token python loop written here straight from the paper's equations (float64), the closed-form scores, an
explicit softmax over all 2**tau buckets, and `memory_lookup_reference`, the package's own slow twin. Every
implementation ("torch" and, when it builds, "fused") is run through the `kernel` fixture.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from modeling_memoryformer import MemoryLayer
from modeling_memoryformer.memory_ops import hash_codes, hash_scores, memory_lookup, memory_lookup_reference


LEADING_SHAPES = [(1,), (7,), (33,), (2, 3, 5), (2, 1, 3, 4)]
# (in_features, out_features, hash_bits): tau = 1, 4, 8, 10; K = 6, 4, 8, 4.
LAYER_SHAPES = [(6, 3, 1), (16, 24, 4), (64, 16, 8), (40, 12, 10)]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# Worst-case error of one output value, relative to sum_k |score_k * row_k| + |bias|: a few units of rounding
# (about 4-8 machine epsilons; measured worst cases are about 2 epsilons).
RELATIVE_TOLERANCE = {torch.float64: 1e-14, torch.float32: 1e-6, torch.bfloat16: 2**-6, torch.float16: 2**-9}


# ---------------------------------------------------------------------------------------------------------------------
# The oracle of this file: the paper's section 2.3 as a per-token, per-table python loop in float64.
def naive_code(z: list[float]) -> int:
    """h(z) = sum_i [z_i >= 0] * 2**i; -0.0 >= 0 is True, so sign(0) = +1 for both zeros."""
    return sum(1 << i for i, v in enumerate(z) if v >= 0)


def naive_score(z: list[float], score: str = "paper", temperature: float = 1.0) -> float:
    """paper: 1 / prod_i (1 + exp(-2|z_i|/t)); l1: ||z||_1 times that."""
    p = 1.0
    for v in z:
        p /= 1.0 + math.exp(-2.0 * abs(v) / temperature)
    if score == "l1":
        p *= sum(abs(v) for v in z)
    return p


def naive_memory_layer(x, tables, bias, hash_bits, score="paper", temperature=1.0):
    """y = sum_k score(z_k) * T[k * 2**tau + h(z_k)] + b, token by token, table by table, in float64."""
    tau = hash_bits
    flat = x.detach().double().reshape(-1, x.shape[-1])
    rows = tables.detach().double()
    out = torch.zeros(flat.shape[0], rows.shape[1], dtype=torch.float64)
    for n, token in enumerate(flat.tolist()):
        for k in range(len(token) // tau):
            z = token[k * tau : (k + 1) * tau]
            out[n] += naive_score(z, score, temperature) * rows[k * 2**tau + naive_code(z)]
        if bias is not None:
            out[n] += bias.detach().double()
    return out.reshape(*x.shape[:-1], rows.shape[1])


def naive_abs_sum(x, tables, bias, hash_bits, score="paper", temperature=1.0):
    """sum_k |score_k * row_k| + |b|: the scale against which rounding errors are measured."""
    return naive_memory_layer(x, tables.abs(), None if bias is None else bias.abs(), hash_bits, score, temperature)


def away_from_zero(shape, generator, low=0.25, high=2.0, dtype=torch.float64):
    """Values with |v| in [low, high] and random signs: rounding can never flip a hash bit."""
    magnitude = torch.rand(shape, generator=generator, dtype=torch.float64) * (high - low) + low
    sign = torch.randint(0, 2, shape, generator=generator).double() * 2 - 1
    return (magnitude * sign).to(dtype)


def with_exact_zeros(x, generator):
    """Put some +0.0 and -0.0 into x (their bit is set: sign(0) = +1)."""
    x = x.clone()
    flat = x.view(-1)
    picks = torch.randperm(flat.numel(), generator=generator)[: max(2, flat.numel() // 10)]
    flat[picks[0::2]] = 0.0
    flat[picks[1::2]] = -0.0
    return x


def random_params(in_features, out_features, hash_bits, bias, generator, dtype=torch.float64):
    rows = (in_features // hash_bits) * 2**hash_bits
    tables = torch.randn(rows, out_features, generator=generator, dtype=torch.float64).to(dtype)
    b = torch.randn(out_features, generator=generator, dtype=torch.float64).to(dtype) if bias else None
    return tables, b


# ---------------------------------------------------------------------------------------------------------------------
# 1. Forward against the oracles.
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("layer_shape", LAYER_SHAPES, ids=lambda s: f"in{s[0]}_out{s[1]}_tau{s[2]}")
@pytest.mark.parametrize("lead", LEADING_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_memory_lookup_matches_naive_loop_and_reference_float64(kernel, lead, layer_shape, bias):
    in_features, out_features, tau = layer_shape
    g = torch.Generator().manual_seed(hash((lead, layer_shape, bias)) % 2**31)
    x = with_exact_zeros(torch.randn(*lead, in_features, generator=g, dtype=torch.float64), g)
    tables, b = random_params(in_features, out_features, tau, bias, g)

    expected = naive_memory_layer(x, tables, b, tau)
    reference = memory_lookup_reference(x, tables, b, tau)
    fast = memory_lookup(x, tables, b, tau)

    assert fast.shape == reference.shape == (*lead, out_features)
    assert fast.dtype == reference.dtype == torch.float64
    torch.testing.assert_close(reference, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fast, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("score", ["paper", "l1"])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_memory_lookup_matches_naive_loop_for_each_score_and_temperature(kernel, score, temperature):
    g = torch.Generator().manual_seed(7)
    x = with_exact_zeros(torch.randn(3, 7, 32, generator=g, dtype=torch.float64), g)
    tables, b = random_params(32, 10, 8, True, g)
    expected = naive_memory_layer(x, tables, b, 8, score, temperature)
    torch.testing.assert_close(memory_lookup_reference(x, tables, b, 8, score, temperature), expected)
    torch.testing.assert_close(memory_lookup(x, tables, b, 8, score, temperature), expected)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("layer_shape", LAYER_SHAPES, ids=lambda s: f"in{s[0]}_out{s[1]}_tau{s[2]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_memory_lookup_every_dtype_matches_float64(kernel, dtype, layer_shape, bias):
    """Low precision is compared with float64 maths on the same (rounded) inputs, within a few roundings."""
    in_features, out_features, tau = layer_shape
    g = torch.Generator().manual_seed(11)
    x = away_from_zero((2, 33, in_features), g, dtype=dtype)
    tables, b = random_params(in_features, out_features, tau, bias, g, dtype=dtype)
    expected = naive_memory_layer(x, tables, b, tau)
    scale = naive_abs_sum(x, tables, b, tau)
    tol = RELATIVE_TOLERANCE[dtype]

    for name, y in [
        ("memory_lookup", memory_lookup(x, tables, b, tau)),
        ("memory_lookup_reference", memory_lookup_reference(x, tables, b, tau)),
    ]:
        assert y.dtype == dtype, name
        assert y.shape == (2, 33, out_features), name
        error = (y.double() - expected).abs()
        worst = (error / scale).max().item()
        assert worst <= tol, f"{name} in {dtype}: error {worst:.3g} x scale > {tol:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("score", ["paper", "l1"])
def test_memory_layer_forward_equals_reference_with_its_parameters(kernel, dtype, score):
    torch.manual_seed(0)
    layer = MemoryLayer(48, 20, hash_bits=8, bias=True, score=score, temperature=0.7).to(dtype)
    with torch.no_grad():
        layer.bias.normal_()
    g = torch.Generator().manual_seed(5)
    x = away_from_zero((3, 5, 48), g, dtype=dtype)
    y = layer(x)
    expected = naive_memory_layer(x, layer.tables, layer.bias, 8, score, 0.7)
    assert y.dtype == dtype and y.shape == (3, 5, 20)
    if dtype in (torch.float32, torch.float64):
        torch.testing.assert_close(y, memory_lookup_reference(x, layer.tables, layer.bias, 8, score, 0.7))
    scale = naive_abs_sum(x, layer.tables, layer.bias, 8, score, 0.7)
    assert ((y.double() - expected).abs() / scale).max().item() <= RELATIVE_TOLERANCE[dtype]


def test_memory_layer_without_bias_has_no_bias_parameter(kernel):
    layer = MemoryLayer(16, 8, hash_bits=4, bias=False).double()
    assert layer.bias is None
    assert [name for name, _ in layer.named_parameters()] == ["tables"]
    assert layer.tables.shape == (4 * 16, 8)
    x = torch.randn(9, 16, dtype=torch.float64)
    torch.testing.assert_close(layer(x), naive_memory_layer(x, layer.tables, None, 4))


def test_memory_layer_rejects_inputs_it_cannot_hash():
    with pytest.raises(ValueError, match=r"in_features=10.*hash_bits=4"):
        MemoryLayer(10, 4, hash_bits=4)
    layer = MemoryLayer(16, 4, hash_bits=4)
    with pytest.raises(ValueError, match="in_features=16"):
        layer(torch.randn(2, 12))
    other = MemoryLayer(32, 4, hash_bits=4)
    with pytest.raises(ValueError, match="tables"):
        layer(hashed=other.hash(torch.randn(2, 32)))


# ---------------------------------------------------------------------------------------------------------------------
# 2. Hash codes: bit order, sign(0), range, flat row index.
def test_element_i_of_a_chunk_carries_bit_2_to_the_i():
    tau = 5
    for i in range(tau):
        z = -torch.ones(1, tau)
        z[0, i] = 0.3
        assert hash_codes(z, tau).tolist() == [[2**i]]


def test_exact_zero_and_negative_zero_set_their_bit():
    x = torch.tensor([[0.0, -1.0, -1.0, -1.0], [-0.0, -1.0, -1.0, -1.0], [-1.0, -1.0, -1.0, -0.0]])
    assert torch.signbit(x[1, 0])  # really a negative zero
    assert hash_codes(x, 4).flatten().tolist() == [1, 1, 8]
    assert hash_codes(torch.zeros(1, 8), 8).item() == 255
    assert hash_codes(-torch.zeros(1, 8), 8).item() == 255


def test_hash_codes_of_hand_computed_vectors():
    x = torch.tensor(
        [
            # chunk 0: + - + -  -> 1 + 4 = 5;   chunk 1: - - - +  -> 8
            [0.5, -2.0, 1e-30, -1e-30, -3.0, -0.1, -7.0, 2.0],
            # chunk 0: all +    -> 15;          chunk 1: all -    -> 0
            [1.0, 2.0, 3.0, 4.0, -1.0, -2.0, -3.0, -4.0],
            # chunk 0: - + + -  -> 2 + 4 = 6;   chunk 1: 0 0 - 0  -> 1 + 2 + 8 = 11
            [-1.0, 1.0, 1.0, -1.0, 0.0, -0.0, -5.0, 0.0],
        ]
    )
    assert hash_codes(x, 4).tolist() == [[5, 8], [15, 0], [6, 11]]
    assert hash_codes(x, 8).tolist() == [[5 + 8 * 16], [15], [6 + 11 * 16]]
    assert hash_codes(x, 2).tolist() == [[1, 1, 0, 2], [3, 3, 0, 0], [2, 1, 3, 2]]
    assert hash_codes(x, 1).tolist() == [[int(v >= 0) for v in row] for row in x.tolist()]


@pytest.mark.parametrize("tau", [1, 4, 8, 10, 16])
def test_hash_codes_lie_in_range_and_match_naive(tau):
    g = torch.Generator().manual_seed(tau)
    x = with_exact_zeros(torch.randn(3, 17, 4 * tau, generator=g), g)
    codes = hash_codes(x, tau)
    assert codes.dtype == torch.int64 and codes.shape == (3, 17, 4)
    assert codes.min() >= 0 and codes.max() < 2**tau
    flat = x.reshape(-1, 4 * tau).tolist()
    expected = [[naive_code(row[k * tau : (k + 1) * tau]) for k in range(4)] for row in flat]
    assert codes.reshape(-1, 4).tolist() == expected


def test_every_bucket_is_reachable():
    tau = 4
    signs = torch.tensor(list(itertools.product([-1.0, 1.0], repeat=tau)))  # all 16 sign patterns
    codes = hash_codes(signs, tau).flatten()
    assert sorted(codes.tolist()) == list(range(2**tau))


@pytest.mark.parametrize("tau", [1, 4, 8])
def test_flat_row_index_is_table_times_rows_plus_code(kernel, tau):
    layer = MemoryLayer(6 * tau, 5, hash_bits=tau)
    x = torch.randn(2, 3, 6 * tau)
    rows, scores = layer.hash(x)
    codes = layer.hash_codes(x)
    assert rows.shape == scores.shape == codes.shape == (2, 3, 6)
    assert torch.equal(codes, hash_codes(x, tau))
    assert torch.equal(rows, torch.arange(6) * 2**tau + codes)
    assert rows.max() < layer.tables.shape[0]


# ---------------------------------------------------------------------------------------------------------------------
# 3. Scores: closed form and the paper's softmax identity.
@pytest.mark.parametrize("temperature", [0.25, 1.0, 2.0, 10.0])
@pytest.mark.parametrize("score", ["paper", "l1"])
def test_hash_scores_match_closed_form(score, temperature):
    g = torch.Generator().manual_seed(3)
    x = with_exact_zeros(torch.randn(5, 4, 24, generator=g, dtype=torch.float64), g)
    tau = 8
    z = x.unflatten(-1, (3, tau))
    p = 1.0 / torch.prod(1.0 + torch.exp(-2.0 * z.abs() / temperature), dim=-1)
    expected = p * z.abs().sum(-1) if score == "l1" else p
    got = hash_scores(x, tau, score, temperature)
    assert got.shape == (5, 4, 3) and got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
    naive = [[naive_score(row[k * tau : (k + 1) * tau], score, temperature) for k in range(3)]
             for row in x.reshape(-1, 24).tolist()]
    torch.testing.assert_close(got.reshape(-1, 3), torch.tensor(naive, dtype=torch.float64), rtol=1e-12, atol=0)


def test_paper_score_of_zero_chunk_and_bounds():
    assert hash_scores(torch.zeros(1, 4, dtype=torch.float64), 4).item() == pytest.approx(0.5**4, rel=1e-15)
    x = torch.randn(100, 32, dtype=torch.float64)
    p = hash_scores(x, 8, "paper")
    assert (p > 0).all() and (p <= 1).all()
    # Large |z| -> the bucket is certain; small temperature sharpens toward 1 as well.
    assert hash_scores(torch.full((1, 8), 50.0, dtype=torch.float64), 8).item() == pytest.approx(1.0, abs=1e-12)
    assert hash_scores(x, 8, "paper", 0.01).min() > hash_scores(x, 8, "paper", 1.0).min()


@pytest.mark.parametrize("tau", [1, 2, 3, 5, 6])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 4.0])
def test_paper_score_is_softmax_probability_of_the_sign_bucket(tau, temperature):
    """p(z) = exp(<z, sign z>/t) / sum_{b in {-1,1}^tau} exp(<z, b>/t) (paper section 3.1)."""
    g = torch.Generator().manual_seed(tau)
    z = torch.randn(20, tau, generator=g, dtype=torch.float64)
    buckets = torch.tensor(list(itertools.product([-1.0, 1.0], repeat=tau)), dtype=torch.float64)  # [2**tau, tau]
    logits = z @ buckets.T / temperature  # [20, 2**tau]
    softmax = torch.softmax(logits, dim=-1)
    own_bucket = (buckets.unsqueeze(0) == torch.sign(z).unsqueeze(1)).all(-1)  # [20, 2**tau], one True per row
    assert (own_bucket.sum(-1) == 1).all()
    expected = softmax[own_bucket]
    torch.testing.assert_close(hash_scores(z, tau, "paper", temperature).flatten(), expected, rtol=1e-12, atol=0)
    # ... and the sign bucket is the most probable one: the hash picks the argmax of that softmax.
    assert torch.equal(softmax.argmax(-1), own_bucket.long().argmax(-1))


def test_half_precision_scores_match_float64_formula():
    g = torch.Generator().manual_seed(0)
    for dtype, tol in [(torch.bfloat16, 2**-7), (torch.float16, 2**-10)]:
        x = away_from_zero((50, 16), g, dtype=dtype)
        got = hash_scores(x, 8, "l1", 1.5)
        assert got.dtype == dtype
        z = x.double().unflatten(-1, (2, 8))
        expected = z.abs().sum(-1) / torch.prod(1.0 + torch.exp(-2.0 * z.abs() / 1.5), dim=-1)
        assert ((got.double() - expected).abs() / expected).max() <= tol


def test_invalid_score_or_temperature_is_rejected():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="cosine"):
        hash_scores(x, 4, "cosine")
    with pytest.raises(ValueError, match="temperature"):
        hash_scores(x, 4, "paper", 0.0)
    with pytest.raises(ValueError, match="score"):
        MemoryLayer(8, 4, hash_bits=4, score="cosine")
    with pytest.raises(ValueError, match="temperature"):
        MemoryLayer(8, 4, hash_bits=4, temperature=-1.0)


# ---------------------------------------------------------------------------------------------------------------------
# 4. Gradients (paper eq. hash_backward).
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("score", ["paper", "l1"])
def test_memory_lookup_gradcheck_float64(kernel, score, bias):
    g = torch.Generator().manual_seed(1)
    x = away_from_zero((2, 3, 16), g).requires_grad_()
    tables, b = random_params(16, 5, 4, bias, g)
    tables.requires_grad_()
    inputs = (x, tables) + ((b.requires_grad_(),) if bias else ())

    def f(x, tables, *b):
        return memory_lookup(x, tables, b[0] if b else None, 4, score, 0.8)

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("score", ["paper", "l1"])
def test_memory_layer_gradcheck_float64(kernel, score):
    torch.manual_seed(0)
    layer = MemoryLayer(16, 6, hash_bits=8, score=score, temperature=1.3).double()
    g = torch.Generator().manual_seed(2)
    x = away_from_zero((5, 16), g).requires_grad_()
    tables = layer.tables.detach().clone().requires_grad_()
    bias = torch.randn(6, dtype=torch.float64, generator=g).requires_grad_()

    def f(x, tables, bias):
        return torch.func.functional_call(layer, {"tables": tables, "bias": bias}, (x,))

    assert torch.autograd.gradcheck(f, (x, tables, bias), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("score", ["paper", "l1"])
def test_tables_gradient_is_score_times_output_gradient_on_retrieved_rows_only(kernel, score):
    tau, in_features, out_features = 4, 12, 7
    g = torch.Generator().manual_seed(4)
    layer = MemoryLayer(in_features, out_features, hash_bits=tau, score=score, temperature=0.9).double()
    x = away_from_zero((2, 6, in_features), g)
    upstream = torch.randn(2, 6, out_features, generator=g, dtype=torch.float64)  # dL/dy
    (layer(x) * upstream).sum().backward()

    expected = torch.zeros_like(layer.tables)
    retrieved = set()
    for token, grad_y in zip(x.reshape(-1, in_features).tolist(), upstream.reshape(-1, out_features)):
        for k in range(in_features // tau):
            z = token[k * tau : (k + 1) * tau]
            row = k * 2**tau + naive_code(z)
            expected[row] += naive_score(z, score, 0.9) * grad_y
            retrieved.add(row)
    untouched = sorted(set(range(layer.tables.shape[0])) - retrieved)
    assert len(untouched) > 0
    assert torch.all(layer.tables.grad[untouched] == 0)
    torch.testing.assert_close(layer.tables.grad, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.bias.grad, upstream.sum((0, 1)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("score", ["paper", "l1"])
def test_input_gradient_flows_through_the_score_only(kernel, score):
    """dL/dz_i = <T_k[h(z)], dL/dy> * dscore/dz_i; codes are piecewise constant and contribute nothing."""
    tau, t = 4, 0.6
    g = torch.Generator().manual_seed(8)
    layer = MemoryLayer(8, 5, hash_bits=tau, score=score, temperature=t).double()
    x = away_from_zero((4, 8), g).requires_grad_()
    upstream = torch.randn(4, 5, generator=g, dtype=torch.float64)
    (layer(x) * upstream).sum().backward()

    expected = torch.zeros(4, 8, dtype=torch.float64)
    for n, token in enumerate(x.detach().tolist()):
        for k in range(2):
            z = token[k * tau : (k + 1) * tau]
            row_dot_grad = float(layer.tables[k * 2**tau + naive_code(z)].detach() @ upstream[n])
            p = naive_score(z, "paper", t)
            l1 = sum(abs(v) for v in z)
            for i, v in enumerate(z):
                sign = math.copysign(1.0, v)
                dp = p * 2.0 * sign / t / (1.0 + math.exp(2.0 * abs(v) / t))  # p * sigmoid(-2|z_i|/t) * 2 sign / t
                dscore = dp if score == "paper" else sign * p + l1 * dp
                expected[n, k * tau + i] = row_dot_grad * dscore
    torch.testing.assert_close(x.grad, expected, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------------
# 5. One hash shared by several tables; the fused Q/K/V table.
def test_hashed_input_shared_by_two_layers_equals_separate_forwards(kernel):
    torch.manual_seed(0)
    a = MemoryLayer(32, 12, hash_bits=8).double()
    b = MemoryLayer(32, 20, hash_bits=8).double()
    x = torch.randn(3, 5, 32, dtype=torch.float64)
    hashed = a.hash(x)
    # Same maths; the direct path may hash with another kernel, so allow float64 rounding only.
    torch.testing.assert_close(a(hashed=hashed), a(x), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(b(hashed=hashed), b(x), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(b(hashed=hashed), naive_memory_layer(x, b.tables, b.bias, 8))


def test_hash_codes_method_returns_the_codes(kernel):
    layer = MemoryLayer(24, 4, hash_bits=8)
    x = torch.randn(7, 24)
    codes = layer.hash_codes(x)
    expected = [[naive_code(row[k * 8 : (k + 1) * 8]) for k in range(3)] for row in x.tolist()]
    assert codes.tolist() == expected


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_fused_qkv_table_equals_three_separate_layers(kernel, bias):
    d, tau = 32, 4
    torch.manual_seed(0)
    fused = MemoryLayer(d, 3 * d, hash_bits=tau, bias=bias).double()
    if bias:
        with torch.no_grad():
            fused.bias.normal_()
    parts = []
    for i in range(3):
        layer = MemoryLayer(d, d, hash_bits=tau, bias=bias).double()
        with torch.no_grad():
            layer.tables.copy_(fused.tables[:, i * d : (i + 1) * d])
            if bias:
                layer.bias.copy_(fused.bias[i * d : (i + 1) * d])
        parts.append(layer)
    x = torch.randn(2, 9, d, dtype=torch.float64)
    q, k, v = fused(x).chunk(3, dim=-1)
    torch.testing.assert_close(q, parts[0](x), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(k, parts[1](x), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(v, parts[2](x), rtol=1e-13, atol=1e-13)
