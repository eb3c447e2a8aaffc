"""The attention of a decode step (one query position per sequence): the fused kernel's `decode_attention` op, its
PyTorch kernel, `memory_ops.decode_attention` (where it applies) and the model's use of it while generating.

Oracle: float64 scaled_dot_product_attention (PyTorch's math kernel), the key/value heads repeated for grouped heads;
for the model, the same model with scaled_dot_product_attention in every step and the model in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import require_kernel, tiny_model
from modeling_memoryformer import memory_ops
from modeling_memoryformer import modeling_memoryformer as modeling
from modeling_memoryformer.memory_backend_torch import decode_attention as torch_decode_attention

CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


@pytest.fixture(autouse=True)
def fused_kernel():
    require_kernel("fused")


def fused(q, k, v, mask, scaling):
    return torch.ops.memoryformer.decode_attention(q, k, v, mask, scaling)


def oracle(q, k, v, mask, scaling):
    group = q.shape[1] // k.shape[1]
    k64, v64 = (t.double().repeat_interleave(group, 1) for t in (k, v))
    m = mask if mask is None or mask.dtype == torch.bool else mask.double()
    out = F.scaled_dot_product_attention(q.double(), k64, v64, attn_mask=m, scale=scaling)
    if m is not None and m.dtype == torch.bool:  # a row with every key masked out: zeros (as the CPU kernels give)
        out = out.masked_fill(~m.any(-1, keepdim=True), 0.0)
    return out.transpose(1, 2)  # [B, 1, H, D]


def inputs(B, H, Hkv, T, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, n, D, generator=g).to(dtype) for h, n in ((H, 1), (Hkv, T), (Hkv, T)))


TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}
SHAPES = [(1, 8, 8, 40, 64), (4, 16, 4, 33, 80), (2, 3, 3, 1, 7), (3, 4, 2, 129, 37), (1, 2, 1, 600, 256)]


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive", "per_head"])
def test_the_op_and_its_pytorch_kernel_equal_float64_attention(dtype, shape, mask_kind):
    B, H, Hkv, T, D = shape
    q, k, v = inputs(*shape, dtype)
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(B, 1, 1, T, generator=g) > 0.3
    keep[..., -1] = True  # the newest key (the token itself) is always visible while decoding
    mask = {"none": None, "bool": keep,
            "additive": torch.where(keep, 0.0, float("-inf")).to(dtype),
            "per_head": torch.rand(B, H, 1, T, generator=g) > 0.5}[mask_kind]
    if mask_kind == "per_head":
        mask[..., 0] = True
    scaling = D**-0.5
    expected = oracle(q, k, v, mask, scaling)
    for out in (fused(q, k, v, mask, scaling), torch_decode_attention(q, k, v, mask, scaling)):
        assert out.shape == (B, 1, H, D) and out.dtype == dtype and out.is_contiguous()
        # each output is a convex combination of value rows: the error scales with their size, one rounding of it
        assert (out.double() - expected).abs().max() <= TOLERANCE[dtype] * v.double().abs().amax() * 2


def test_views_of_a_qkv_output_and_a_longer_cache_buffer_are_read_in_place():
    """Q from a fused [B, 1, 3 * hidden] output (strided heads), K and V the first T positions of a bigger buffer
    (a static cache): the same values as their contiguous copies."""
    B, H, D, T = 2, 4, 16, 9
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(B, 1, 3 * H * D, generator=g)
    q = qkv[..., : H * D].view(B, 1, H, D).transpose(1, 2)
    buffer = torch.randn(2, B, H, 32, D, generator=g)
    k, v = buffer[0, :, :, :T], buffer[1, :, :, :T]
    assert not q.is_contiguous() and not k.is_contiguous()
    out = fused(q, k, v, None, 0.25)
    assert torch.equal(out, fused(q.contiguous(), k.contiguous(), v.contiguous(), None, 0.25))
    torch.testing.assert_close(out.double(), oracle(q, k, v, None, 0.25), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("D", [32, 37, 64])  # whole vectors, a ragged tail, the presets' head size
def test_masked_keys_change_no_bit_so_a_static_cache_gives_the_dynamic_caches_values(D, dtype):
    # T = 11 keys: the last 3 are scored one by one here, in a block of 4 in the longer cache: the same bits either way
    B, H, T = 2, 4, 11
    q, k, v = inputs(B, H, H, T, D, dtype, seed=3)
    pad = torch.randn(B, H, 21, D).to(dtype)
    k_long, v_long = torch.cat([k, pad], 2), torch.cat([v, pad], 2)
    keep = torch.zeros(B, 1, 1, T + 21, dtype=torch.bool)
    keep[..., :T] = True
    assert torch.equal(fused(q, k_long, v_long, keep, 0.1), fused(q, k, v, None, 0.1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_heads_split_over_threads_give_the_one_thread_bits(dtype):
    # 12 heads x 64 over 50 keys (MF-small's decode step) is past the op's threading threshold: two threads take six
    # heads each; every head is summed by one thread in key order either way
    q, k, v = inputs(1, 12, 12, 50, 64, dtype, seed=4)
    keep = torch.rand(1, 1, 1, 50, generator=torch.Generator().manual_seed(5)) > 0.2
    keep[..., -1] = True
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused(q, k, v, keep, 0.125)
        torch.set_num_threads(2)
        two = fused(q, k, v, keep, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert (two.double() - oracle(q, k, v, keep, 0.125)).abs().max() <= TOLERANCE[dtype] * v.double().abs().amax() * 2


def test_a_row_with_every_key_masked_out_gives_zeros_as_sdpa():
    q, k, v = inputs(2, 2, 2, 5, 8, torch.float32, seed=4)
    keep = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    keep[1] = False
    out = fused(q, k, v, keep, 0.3)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=0.3).transpose(1, 2)
    assert torch.equal(out[1], expected[1])
    torch.testing.assert_close(out[0], expected[0])


@pytest.mark.parametrize(
    "case, call, message",
    [
        ("two query positions", lambda q, k, v: fused(torch.cat([q, q], 2), k, v, None, 1.0), "one query position"),
        ("float64", lambda q, k, v: fused(q.double(), k.double(), v.double(), None, 1.0), "float32, bfloat16"),
        ("mixed dtypes", lambda q, k, v: fused(q, k.bfloat16(), v, None, 1.0), "one dtype"),
        ("heads not a multiple", lambda q, k, v: fused(q[:, :3], k[:, :2], v[:, :2], None, 1.0), "multiple"),
        ("mask of another length", lambda q, k, v: fused(q, k, v, torch.ones(1, 1, 1, 4, dtype=torch.bool), 1.0),
         "broadcastable"),
        ("3-D key", lambda q, k, v: fused(q, k[0], v, None, 1.0), "4-D"),
        ("strided head_dim", lambda q, k, v: fused(q, k.transpose(2, 3), v.transpose(2, 3), None, 1.0),
         "contiguous"),
    ],
)
def test_bad_arguments_are_refused_by_name(case, call, message):
    q, k, v = inputs(1, 4, 4, 6, 6, torch.float32)
    with pytest.raises(RuntimeError, match=message):
        call(q, k, v)


def test_memory_ops_runs_it_only_where_it_applies():
    q, k, v = inputs(2, 4, 4, 6, 16, torch.float32)
    expected = oracle(q, k, v, None, 0.25)
    out = memory_ops.decode_attention(q, k, v, None, 0.25)
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)
    skipped = {
        "two query positions": (torch.cat([q, q], 2), k, v, None),
        "float64": (q.double(), k.double(), v.double(), None),
        "a mask of another float dtype": (q, k, v, torch.zeros(2, 1, 1, 6, dtype=torch.float64)),
        "a mask over more positions": (q, k, v, torch.ones(2, 1, 2, 6, dtype=torch.bool)),
        "a gradient to record": (q.requires_grad_(), k, v, None),
    }
    for case, args in skipped.items():
        assert memory_ops.decode_attention(*args, 0.25) is None, case
    q.requires_grad_(False)
    with memory_ops.use_kernel("torch"):
        assert memory_ops.decode_attention(q, k, v, None, 0.25) is None


def decode_logits(model, prompt, steps=6):
    """The logits of `steps` greedy decode steps after the prompt, with the cache."""
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        cache, ids, logits = out.past_key_values, out.logits[:, -1:].argmax(-1), []
        for _ in range(steps):
            out = model(ids, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
            ids = out.logits[:, -1:].argmax(-1)
    return torch.stack(logits, 1)


@pytest.fixture
def sdpa_only(monkeypatch):
    """The model as before this kernel: every attention step by scaled_dot_product_attention."""
    def use_sdpa():
        monkeypatch.setattr(memory_ops, "decode_attention", lambda *args: None)
    return use_sdpa


def ran_decode_attention(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    calls = {e.key: e.count for e in prof.key_averages()}
    return out, calls.get("memoryformer::decode_attention", 0)


def test_generate_runs_it_in_every_decode_step_and_float32_tokens_equal_sdpas(sdpa_only):
    model = tiny_model(attn_implementation="sdpa")
    prompt = torch.tensor([[5, 17, 99, 42, 8, 63, 120], [0, 0, 3, 9, 27, 81, 44]])
    mask = (prompt != 0).long()
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    fast, calls = ran_decode_attention(lambda: model.generate(prompt, **kwargs))
    assert calls == 7 * model.config.num_hidden_layers  # every step after the prefill, every layer
    fast_logits = decode_logits(model, prompt[:1])
    sdpa_only()
    slow, calls = ran_decode_attention(lambda: model.generate(prompt, **kwargs))
    assert calls == 0
    assert torch.equal(fast, slow)
    torch.testing.assert_close(fast_logits, decode_logits(model, prompt[:1]), rtol=1e-5, atol=1e-5)


def test_bfloat16_decode_steps_attend_closer_to_float64_than_sdpa(monkeypatch):
    """In bfloat16 the kernel keeps the probabilities in float32 (SDPA's CPU kernel rounds them to bfloat16 before the
    value sum). On the queries, keys and values of a bfloat16 model's own decode steps, its outputs are closer to
    float64 attention than SDPA's. (The whole model in bfloat16 against float64 is no oracle: a rounding flips hash
    bits, and the rows read change.)"""
    seen, kernel = [], memory_ops.decode_attention

    def recording(q, k, v, mask, scaling):
        if q.shape[2] == 1:  # the prefill's calls are declined (None) and go to SDPA
            seen.append((q.clone(), k.clone(), v.clone(), mask, scaling))
        return kernel(q, k, v, mask, scaling)

    monkeypatch.setattr(memory_ops, "decode_attention", recording)
    # the per-layer decode step calls it through memory_ops (the decode stack calls the op from C++, unseen here)
    monkeypatch.setattr(modeling, "decode_stack_step", lambda *args, **kwargs: None)
    model = tiny_model(attn_implementation="sdpa").to(torch.bfloat16)
    prompt = torch.tensor([[5, 17, 99, 42, 8, 63, 120, 7, 1, 30, 12, 64]])
    model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert len(seen) == 5 * model.config.num_hidden_layers
    fast_error = slow_error = 0.0
    for q, k, v, mask, scaling in seen:
        expected = oracle(q, k, v, mask, scaling)
        fast_error += (fused(q, k, v, mask, scaling).double() - expected).abs().sum()
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling).transpose(1, 2)
        slow_error += (sdpa.double() - expected).abs().sum()
    assert fast_error < slow_error


def test_other_models_take_it_as_an_attention_implementation():
    """`decode_attention_forward` in transformers' attention-function form, registered under a name of its own: a
    GPT-NeoX model generates the tokens it generates with "sdpa" (float32) and calls the kernel in its decode steps."""
    from transformers import AttentionInterface, GPTNeoXConfig, GPTNeoXForCausalLM

    AttentionInterface.register("memoryformer_decode", modeling.decode_attention_forward)
    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, attn_implementation="sdpa")
    model = GPTNeoXForCausalLM(config).eval()
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = model.generate(prompt, **kwargs)
    model.set_attn_implementation("memoryformer_decode")
    out, calls = ran_decode_attention(lambda: model.generate(prompt, **kwargs))
    assert calls == 5 * config.num_hidden_layers
    assert torch.equal(out, expected)
