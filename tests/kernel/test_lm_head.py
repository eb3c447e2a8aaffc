"""The LM head's few-row pass (`memory_ops.few_rows_linear`): the fused kernel's `linear_rows` while decoding, F.linear
everywhere else.

Oracle: the float64 product x W^T + b. The tests check where the fused pass runs (the profiler names the op) and where
it must not (more rows than the kernel takes, a gradient to record, float64, the PyTorch kernel), and that a model's
logits and generated tokens are the same either way.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from conftest import require_kernel
from modeling_memoryformer import MemoryFormerConfig, MemoryFormerForCausalLM, memory_ops
from modeling_memoryformer.modeling_memoryformer import MemoryFormerLMHead


@pytest.fixture(autouse=True)
def fused_kernel():
    require_kernel("fused")


def ran_fused(fn) -> tuple[torch.Tensor, bool]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, any(e.key == "memoryformer::linear_rows" for e in prof.key_averages())


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def oracle(x, w, b):
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


def test_the_python_limit_is_the_kernels():
    assert memory_ops._LINEAR_ROWS_MAX == torch.ops.memoryformer.linear_rows_max()


@pytest.mark.parametrize("shape", [(1, 512), (1, 1, 512), (2, 2, 512), (4, 512), (3, 1, 512)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_few_rows_take_the_fused_pass_and_equal_the_product(shape, with_bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(1003, 512, generator=g)
    b = torch.randn(1003, generator=g) if with_bias else None
    y, fused = ran_fused(lambda: memory_ops.few_rows_linear(x, w, b))
    assert fused
    assert y.shape == (*shape[:-1], 1003) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), oracle(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [40, 203, 250])
def test_every_block_shape_and_tail_equals_the_product(rows, dtype, width):
    """The pass takes one weight row at a time (1-2 rows of x, or a float32 weight: 4 chains of whole steps of 4
    vectors, then single vectors, then the tail), else 2 weight rows at a time (3-4 rows of bfloat16 x: whole vectors,
    then the tail), then the rows left one at a time, each thread its own range (2050 rows split over threads at an odd
    row). The widths leave every part on every target (8, 16 or 4 lanes): 40 is below one step of 4 vectors of 16,
    203 and 250 leave single vectors and a tail below one vector: every loop, remainder and tail against the float64
    product of the same values."""
    g = torch.Generator().manual_seed(rows * 1000 + width)
    x = torch.randn(rows, width, generator=g).to(dtype)
    w = torch.randn(2050, width, generator=g).to(dtype)
    b = torch.randn(2050, generator=g).to(dtype)
    for threads in (1, 2):
        with torch_threads(threads):
            y, fused = ran_fused(lambda: memory_ops.few_rows_linear(x, w, b))
        assert fused and y.dtype == dtype
        expected = oracle(x, w, b)
        scale = x.double().abs() @ w.double().abs().T + b.double().abs()
        rounding = 2**-8 if dtype == torch.bfloat16 else 0.0  # bfloat16 output: rounded once
        assert ((y.double() - expected).abs() <= rounding * expected.abs() + 1e-6 * scale).all()


@pytest.mark.parametrize("rows", [1, 3])
def test_bfloat16_heads_take_the_fused_pass_and_equal_the_product_of_the_bf16_values(rows):
    """bfloat16 x, weight and bias: the weight widened in registers, float32 sums, one rounding to bfloat16."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, 200, generator=g).bfloat16()
    w = torch.randn(1001, 200, generator=g).bfloat16()  # a width that leaves a tail below one vector
    b = torch.randn(1001, generator=g).bfloat16()
    y, fused = ran_fused(lambda: memory_ops.few_rows_linear(x, w, b))
    assert fused and y.dtype == torch.bfloat16
    expected = oracle(x, w, b)
    scale = x.double().abs() @ w.double().abs().T + b.double().abs()
    assert ((y.double() - expected).abs() <= 2**-8 * expected.abs() + 1e-6 * scale).all()  # one bf16 rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [40, 250, 768])
def test_two_rows_of_x_give_each_row_the_bits_it_gets_alone(dtype, width):
    """The row pass sums each output in the same chains for one row of x or two (a bfloat16 weight read in pairs of
    values, x split to match), so a row's logits do not depend on the other row in the batch."""
    g = torch.Generator().manual_seed(width)
    x = torch.randn(2, width, generator=g).to(dtype)
    w = torch.randn(1500, width, generator=g).to(dtype)
    b = torch.randn(1500, generator=g).to(dtype)
    for threads in (1, 2):
        with torch_threads(threads):
            both = torch.ops.memoryformer.linear_rows(x, w, b)
            for i in range(2):
                assert torch.equal(both[i], torch.ops.memoryformer.linear_rows(x[i:i + 1].contiguous(), w, b)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_row_pass_prefetch_trial_chooses_and_keeps_every_bit(dtype):
    """The row pass's software prefetches are chosen on the running machine, per kind of pass (the weight's dtype, and
    whether it is larger than the last-level cache): the first 8 passes of a kind alternate without and with them,
    timed, and the later ones take the faster; a fixed setting (0, 1) overrides the trials. Prefetches move no value:
    every pass, with or without them, gives the bits of the first, and the float64 product within the pass's
    rounding."""
    ops = torch.ops.memoryformer
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, 200, generator=g).to(dtype)
    w = torch.randn(3001, 200, generator=g).to(dtype)  # 1.2-2.4 MB of weight: beyond the 64 KB cache below
    within, beyond = (0, 1) if dtype == torch.bfloat16 else (2, 3)  # the kinds' places in the op's answer
    idle = [-1] + [-1, 0] * 4
    try:
        ops.set_cache_sizes(32 << 10, 32 << 10, 64 << 10)
        assert ops.linear_rows_prefetch(-1) == idle
        first, tokens = ops.linear_rows_argmax(x, w, None)
        expected = oracle(x, w, None)
        scale = x.double().abs() @ w.double().abs().T
        rounding = 2**-8 if dtype == torch.bfloat16 else 0.0
        assert ((first.double() - expected).abs() <= rounding * expected.abs() + 1e-6 * scale).all()
        for passes in range(2, 11):
            y, t = ops.linear_rows_argmax(x, w, None)
            assert torch.equal(y, first) and torch.equal(t, tokens)
            state = ops.linear_rows_prefetch(-2)
            assert state[2 + 2 * beyond] == min(passes, 8)  # timed passes: the first 8
            assert (state[1 + 2 * beyond] >= 0) == (passes >= 8)  # chosen after the 8th
            assert state[1 + 2 * within] == -1 and state[2 + 2 * within] == 0  # the other kind untouched
        assert state[1 + 2 * beyond] in (0, 1)
        ops.set_cache_sizes(32 << 10, 1 << 20, 32 << 20)  # a 32 MB cache holds this weight: a pass of the other kind
        assert torch.equal(ops.linear_rows(x, w, None), first)
        after = ops.linear_rows_prefetch(-2)
        assert after[2 + 2 * within] == 1  # the first timed pass of its own trial
        assert after[1 + 2 * beyond : 3 + 2 * beyond] == state[1 + 2 * beyond : 3 + 2 * beyond]
        for setting in (0, 1):
            assert ops.linear_rows_prefetch(setting)[0] == setting
            assert torch.equal(ops.linear_rows(x, w, None), first)
        with pytest.raises(RuntimeError, match="setting must be -2"):
            ops.linear_rows_prefetch(2)
    finally:
        ops.set_cache_sizes(0, 0, 0)
        ops.linear_rows_prefetch(-1)
    assert ops.linear_rows_prefetch(-2) == idle


def test_other_inputs_take_f_linear_with_its_exact_result():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 64, generator=g)
    many = torch.randn(1, memory_ops._LINEAR_ROWS_MAX + 1, 64, generator=g)
    y, fused = ran_fused(lambda: memory_ops.few_rows_linear(many, w))
    assert not fused and torch.equal(y, F.linear(many, w))
    x64, w64 = torch.randn(1, 64, dtype=torch.float64), w.double()
    y, fused = ran_fused(lambda: memory_ops.few_rows_linear(x64, w64))
    assert not fused and torch.equal(y, F.linear(x64, w64))
    x = torch.randn(1, 64, generator=g)
    with memory_ops.use_kernel("torch"):
        y, fused = ran_fused(lambda: memory_ops.few_rows_linear(x, w))
    assert not fused and torch.equal(y, F.linear(x, w))
    strided = torch.randn(64, 300, generator=g).t()  # a non-contiguous weight
    y, fused = ran_fused(lambda: memory_ops.few_rows_linear(x, strided))
    assert not fused and torch.equal(y, F.linear(x, strided))


def test_a_gradient_to_record_takes_f_linear_and_gets_its_gradients():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    x = torch.randn(1, 16, generator=g, requires_grad=True)
    y, fused = ran_fused(lambda: memory_ops.few_rows_linear(x, w))
    assert not fused and y.requires_grad
    y.sum().backward()
    torch.testing.assert_close(x.grad, w.detach().sum(0, keepdim=True))
    torch.testing.assert_close(w.grad, x.detach().expand(50, 16))
    with torch.no_grad():
        _, fused = ran_fused(lambda: memory_ops.few_rows_linear(x, w))
    assert fused


def tiny_model():
    config = MemoryFormerConfig(vocab_size=257, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                hash_bits=4, max_position_embeddings=64)
    torch.manual_seed(0)
    return MemoryFormerForCausalLM(config).eval()


def test_the_model_head_is_an_nn_linear_that_decodes_with_the_fused_pass():
    model = tiny_model()
    assert isinstance(model.lm_head, MemoryFormerLMHead) and isinstance(model.lm_head, torch.nn.Linear)
    ids = torch.randint(0, 257, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out, fused = ran_fused(lambda: model(ids, logits_to_keep=1))
        full = model(ids)  # 9 positions: F.linear
    assert fused
    hidden = model.model(ids).last_hidden_state[:, -1:].detach()
    torch.testing.assert_close(out.logits.double(), oracle(hidden, model.lm_head.weight.detach(), None),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logits, full.logits[:, -1:], rtol=1e-5, atol=1e-5)


def test_generate_gives_the_same_tokens_with_either_head_pass():
    model = tiny_model()
    ids = torch.randint(0, 257, (2, 5), generator=torch.Generator().manual_seed(4))
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    fused_tokens, fused = ran_fused(lambda: model.generate(ids, **kwargs))
    assert fused

    def plain_head(hidden_states):
        return F.linear(hidden_states, model.lm_head.weight)

    model.lm_head.forward = plain_head
    plain_tokens = model.generate(ids, **kwargs)
    assert torch.equal(fused_tokens, plain_tokens)
