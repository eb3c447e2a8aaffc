"""The chunked LM head + cross-entropy (`memory_ops.linear_cross_entropy`) and its use by MemoryFormerForCausalLM.

The oracle is written here: full float64 logits and `F.cross_entropy` in float64 on labels shifted as transformers'
ForCausalLMLoss shifts them (pad with ignore_index, drop the first), mean over the counted tokens or sum divided by
`num_items_in_batch`; its gradients come from autograd.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import tiny_model
from modeling_memoryformer import MemoryFormerConfig
from modeling_memoryformer.memory_ops import LINEAR_CE_CHUNK_TOKENS, linear_cross_entropy


SAVED_0_1_0 = Path(__file__).parent / "data" / "saved-0.1.0"
B, T, D, V = 2, 25, 16, 37  # 50 positions, 48 of them with a label after the shift and the ignored ones below


def oracle(hidden, weight, bias, labels, ignore_index=-100, num_items_in_batch=None):
    """float64 loss and gradients (hidden, weight, bias) of ForCausalLMLoss(F.linear(hidden, weight, bias), labels)."""
    h, w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    b = None if bias is None else bias.detach().double().requires_grad_()
    logits = F.linear(h, w, b)
    shifted = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = F.cross_entropy(logits.reshape(-1, w.shape[0]), shifted.reshape(-1), ignore_index=ignore_index,
                           reduction=reduction)
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    inputs = [t for t in (h, w, b) if t is not None]
    grads = torch.autograd.grad(loss, inputs)
    return loss.detach(), grads


def problem(dtype=torch.float32, bias=True, seed=0, ignored=(3, 17, 30)):
    """hidden [B, T, D], weight [V, D], bias [V] (or None), labels [B, T] with a few positions ignored (-100)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g) * 0.7).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=g) * 0.3).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, V, (B, T), generator=g)
    labels.view(-1)[list(ignored)] = -100
    return hidden, weight, b, labels


def ours(hidden, weight, bias, labels, **kwargs):
    loss = linear_cross_entropy(hidden, weight, bias, labels, **kwargs)
    inputs = [t for t in (hidden, weight, bias) if t is not None]
    return loss.detach(), torch.autograd.grad(loss, inputs)


def assert_matches(got, expected, rtol, atol):
    (loss, grads), (ref_loss, ref_grads) = got, expected
    torch.testing.assert_close(loss.double(), ref_loss, rtol=rtol, atol=atol)
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r, rtol=rtol, atol=atol * r.abs().max().item())


# ---------------------------------------------------------------------------------------------------------------------
# The op against the float64 oracle (float32: rtol 1e-5)
@pytest.mark.parametrize("chunk_tokens", [1, 7, 10, 64, 1000])  # divides 50 / does not / one chunk / larger than N
@pytest.mark.parametrize("bias", [True, False])
def test_loss_and_gradients_match_float64_oracle(chunk_tokens, bias):
    hidden, weight, b, labels = problem(bias=bias)
    assert_matches(ours(hidden, weight, b, labels, chunk_tokens=chunk_tokens),
                   oracle(hidden, weight, b, labels), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block_rows", [1, 3, 7])
@pytest.mark.parametrize("chunk_tokens", [7, 10, 64])
def test_softmax_by_blocks_of_rows_matches_the_oracle(block_rows, chunk_tokens, monkeypatch):
    """The softmax steps take a chunk's logits a few rows at a time (a quarter of the LLC of a real vocabulary; one block
    for this one unless forced): blocks that divide the chunk, that do not, and as large as it give the same loss and
    gradients, ignored positions included."""
    from modeling_memoryformer import memory_loss

    monkeypatch.setattr(memory_loss, "_softmax_block_rows", lambda vocab, itemsize: block_rows)
    hidden, weight, b, labels = problem(bias=True)
    assert_matches(ours(hidden, weight, b, labels, chunk_tokens=chunk_tokens),
                   oracle(hidden, weight, b, labels), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_items_in_batch", [40, torch.tensor(40), torch.tensor(7.0)])
@pytest.mark.parametrize("chunk_tokens", [7, 64])
def test_num_items_in_batch_divides_the_sum(num_items_in_batch, chunk_tokens):
    hidden, weight, b, labels = problem()
    got = ours(hidden, weight, b, labels, chunk_tokens=chunk_tokens, num_items_in_batch=num_items_in_batch)
    assert_matches(got, oracle(hidden, weight, b, labels, num_items_in_batch=num_items_in_batch), 1e-5, 1e-6)


def test_other_ignore_index_and_many_ignored_tokens():
    hidden, weight, b, labels = problem(ignored=range(0, 50, 2))
    labels = labels.masked_fill(labels == -100, 5)  # 5 is now the ignored id; -100 does not occur
    got = ours(hidden, weight, b, labels, chunk_tokens=7, ignore_index=5)
    assert_matches(got, oracle(hidden, weight, b, labels, ignore_index=5), 1e-5, 1e-6)


def test_shift_labels_are_used_as_given():
    hidden, weight, b, labels = problem()
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    got = ours(hidden, weight, b, None, chunk_tokens=7, shift_labels=shifted)
    assert_matches(got, oracle(hidden, weight, b, labels), 1e-5, 1e-6)


@pytest.mark.parametrize("num_items_in_batch", [None, torch.tensor(0)])
def test_all_tokens_ignored_gives_nan_and_zero_gradients_as_the_reference(num_items_in_batch):
    hidden, weight, b, labels = problem(ignored=range(50))
    loss, grads = ours(hidden, weight, b, labels, chunk_tokens=7, num_items_in_batch=num_items_in_batch)
    ref_loss, ref_grads = oracle(hidden, weight, b, labels, num_items_in_batch=num_items_in_batch)
    assert torch.isnan(ref_loss) and torch.isnan(loss)
    for g, r in zip(grads, ref_grads):
        assert torch.equal(r, torch.zeros_like(r)) and torch.equal(g, torch.zeros_like(g))


def test_only_the_inputs_that_need_a_gradient_get_one():
    hidden, weight, b, labels = problem()
    weight.requires_grad_(False)
    b.requires_grad_(False)
    loss = linear_cross_entropy(hidden, weight, b, labels, chunk_tokens=7)
    loss.backward()
    _, (ref_hidden, _, _) = oracle(hidden, weight, b, labels)
    torch.testing.assert_close(hidden.grad.double(), ref_hidden, rtol=1e-5, atol=1e-6 * ref_hidden.abs().max().item())
    assert weight.grad is None and b.grad is None


def test_backward_scales_by_the_incoming_gradient():
    hidden, weight, b, labels = problem()
    _, ref_grads = oracle(hidden, weight, b, labels)
    (linear_cross_entropy(hidden, weight, b, labels, chunk_tokens=7) * -2.5).backward()
    for g, r in zip((hidden.grad, weight.grad, b.grad), ref_grads):
        torch.testing.assert_close(g.double(), -2.5 * r, rtol=1e-5, atol=2.5e-6 * r.abs().max().item())


# ---------------------------------------------------------------------------------------------------------------------
# Low precision. bfloat16 keeps 8 significant bits (relative rounding 2**-9 = 0.2%; float16 11 bits): the logits are
# products (summed in float32) rounded once, the logit gradient is rounded before its two matmuls, and their results
# once more; a loss within 1% and gradients within 2% of their largest entry is what a few such roundings allow (the
# oracle gets the same rounded input values, in float64).
BF16_RTOL, BF16_ATOL = 2e-2, 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk_tokens", [7, 64])
def test_half_precision_inputs_match_the_oracle_within_their_rounding(chunk_tokens, dtype):
    hidden, weight, b, labels = problem(dtype=dtype)
    loss, grads = ours(hidden, weight, b, labels, chunk_tokens=chunk_tokens)
    assert loss.dtype == torch.float32  # the loss in float32, as ForCausalLMLoss's logits.float()
    assert [g.dtype for g in grads] == [dtype] * 3
    ref_loss, ref_grads = oracle(hidden, weight, b, labels)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-2, atol=0)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r, rtol=BF16_RTOL, atol=BF16_ATOL * r.abs().max().item())


def test_autocast_runs_the_matmuls_in_bfloat16_on_float32_inputs():
    hidden, weight, b, labels = problem()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = ours(hidden, weight, b, labels, chunk_tokens=7)
    assert loss.dtype == torch.float32 and [g.dtype for g in grads] == [torch.float32] * 3
    rounded = [t.detach().bfloat16() for t in (hidden, weight, b)]  # what autocast gives the matmuls
    ref_loss, ref_grads = oracle(*rounded, labels)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-2, atol=0)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r, rtol=BF16_RTOL, atol=BF16_ATOL * r.abs().max().item())
    # Not what plain float32 would give: the bf16 path was taken.
    assert not torch.allclose(loss.double(), oracle(hidden, weight, b, labels)[0], rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------------------------------
# Without a gradient: the loss only, one matmul per chunk.
class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", ["no_grad", "nothing_requires_grad"])
def test_no_grad_path_computes_the_loss_only(case):
    hidden, weight, b, labels = problem()
    if case == "nothing_requires_grad":
        hidden, weight, b = (t.detach() for t in (hidden, weight, b))
    with torch.no_grad() if case == "no_grad" else torch.enable_grad(), CountMatmuls() as counter:
        loss = linear_cross_entropy(hidden, weight, b, labels, chunk_tokens=7)
    assert counter.calls == 8  # ceil(50 / 7) chunks, one matmul each: no gradient matmuls
    assert not loss.requires_grad and loss.grad_fn is None
    torch.testing.assert_close(loss.double(), oracle(hidden, weight, b, labels)[0], rtol=1e-5, atol=1e-6)


def test_with_gradients_three_matmuls_per_chunk():
    hidden, weight, b, labels = problem()
    with CountMatmuls() as counter:
        linear_cross_entropy(hidden, weight, b, labels, chunk_tokens=7)
    assert counter.calls == 3 * 8


# ---------------------------------------------------------------------------------------------------------------------
# What it refuses
def test_double_backward_raises():
    hidden, weight, b, labels = problem()
    loss = linear_cross_entropy(hidden, weight, b, labels, chunk_tokens=7)
    with pytest.raises(RuntimeError, match=r"does not support double backward \(create_graph=True\).*loss_chunk_tokens=0"):
        torch.autograd.grad(loss, hidden, create_graph=True)


def test_a_second_backward_through_the_same_forward_raises_clearly():
    hidden, weight, b, labels = problem()
    loss = linear_cross_entropy(hidden, weight, b, labels, chunk_tokens=7)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward pass per forward.*loss_chunk_tokens=0"):
        loss.backward()


@pytest.mark.parametrize("chunk_tokens", [0, -3, 2.0, True, None])
def test_bad_chunk_tokens_raise(chunk_tokens):
    hidden, weight, b, labels = problem()
    with pytest.raises(ValueError, match="chunk_tokens must be a positive integer"):
        linear_cross_entropy(hidden, weight, b, labels, chunk_tokens=chunk_tokens)


@pytest.mark.parametrize("bad", [V, -1])
def test_labels_outside_the_vocabulary_raise(bad):
    hidden, weight, b, labels = problem()
    labels[0, 5] = bad
    with pytest.raises(ValueError, match=rf"token id {bad}, outside \[0, vocab={V}\)"):
        linear_cross_entropy(hidden, weight, b, labels, chunk_tokens=7)


def test_mismatched_dtypes_raise():
    hidden, weight, b, labels = problem()
    with pytest.raises(ValueError, match="must share a dtype"):
        linear_cross_entropy(hidden.bfloat16(), weight, b, labels, chunk_tokens=7)


# ---------------------------------------------------------------------------------------------------------------------
# The model: a training step with the chunked loss equals one with full logits
def step(model, input_ids, labels, **kwargs):
    """One forward + backward; (outputs, {parameter name: gradient})."""
    model.zero_grad(set_to_none=True)
    outputs = model(input_ids=input_ids, labels=labels, **kwargs)
    outputs.loss.backward()
    return outputs, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def model_and_batch(**overrides):
    model = tiny_model(loss_chunk_tokens=16, **overrides).train()
    g = torch.Generator().manual_seed(7)
    input_ids = torch.randint(3, 128, (3, 21), generator=g)
    labels = input_ids.clone()
    labels[0, :4] = -100
    labels[2, 10:] = -100
    return model, input_ids, labels


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("loss_kwargs", [{}, {"num_items_in_batch": torch.tensor(37)}])
def test_training_step_matches_the_full_logits_loss(tie, loss_kwargs):
    model, input_ids, labels = model_and_batch(tie_word_embeddings=tie)
    chunked, chunked_grads = step(model, input_ids, labels, **loss_kwargs)
    assert chunked.logits is None  # not materialised
    assert chunked.loss.grad_fn is not None and "LinearCrossEntropy" in type(chunked.loss.grad_fn).__name__
    model.config.loss_chunk_tokens = 0
    full, full_grads = step(model, input_ids, labels, **loss_kwargs)
    assert full.logits is not None and full.logits.shape == (3, 21, 128)
    torch.testing.assert_close(chunked.loss, full.loss, rtol=1e-5, atol=0)
    assert chunked_grads.keys() == full_grads.keys()
    assert "lm_head.weight" in chunked_grads or tie
    for name, grad in full_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-5, atol=1e-6 * grad.abs().max().item(),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_bfloat16_model_takes_the_chunked_path_and_stays_close():
    model, input_ids, labels = model_and_batch()
    model = model.to(torch.bfloat16)
    chunked, _ = step(model, input_ids, labels)
    assert chunked.logits is None and chunked.loss.dtype == torch.float32
    model.config.loss_chunk_tokens = 0
    full, _ = step(model, input_ids, labels)
    torch.testing.assert_close(chunked.loss, full.loss, rtol=1e-2, atol=0)


def test_eval_mode_and_no_labels_and_no_grad_return_logits():
    model, input_ids, labels = model_and_batch()
    with torch.no_grad():
        in_train_no_grad = model(input_ids=input_ids, labels=labels)
    assert in_train_no_grad.logits is not None
    assert model(input_ids=input_ids).logits is not None  # no labels
    model.eval()
    evaluated = model(input_ids=input_ids, labels=labels)
    assert evaluated.logits is not None and evaluated.logits.shape == (3, 21, 128)
    torch.testing.assert_close(evaluated.loss, in_train_no_grad.loss, rtol=1e-6, atol=0)


def _forward_hook(model):
    model.lm_head.register_forward_hook(lambda module, args, output: None)


def _pre_hook(model):
    model.lm_head.register_forward_pre_hook(lambda module, args: None)


def _accelerate_hook(model):
    model.lm_head._hf_hook = object()


def _custom_loss(model):
    model.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.float().logsumexp(-1).mean()


@pytest.mark.parametrize("attach", [_forward_hook, _pre_hook, _accelerate_hook, _custom_loss])
def test_fallback_conditions_take_the_full_logits_path(attach):
    model, input_ids, labels = model_and_batch()
    attach(model)
    outputs = model(input_ids=input_ids, labels=labels)
    assert outputs.logits is not None and outputs.logits.shape == (3, 21, 128)
    assert "LinearCrossEntropy" not in type(outputs.loss.grad_fn).__name__


def test_logits_to_keep_and_a_bfloat16_head_in_a_float32_model_take_the_full_logits_path():
    model, input_ids, labels = model_and_batch()
    kept = model(input_ids=input_ids, labels=labels[:, -1:], logits_to_keep=1)
    assert kept.logits.shape == (3, 1, 128)
    narrow_head = model.quantize_lm_head("bf16")
    assert narrow_head.lm_head.weight.dtype == torch.bfloat16 and narrow_head.training
    assert narrow_head(input_ids=input_ids, labels=labels).logits is not None


# ---------------------------------------------------------------------------------------------------------------------
# The config field
@pytest.mark.parametrize("value", [-1, 1.5, "16", True, None])
def test_bad_loss_chunk_tokens_raise_naming_the_field(value):
    with pytest.raises(ValueError, match=r"loss_chunk_tokens must be an integer >= 0, got .*0 for the full-logits"):
        tiny_model(loss_chunk_tokens=value)


def test_loss_chunk_tokens_default_round_trip_and_old_folders(tmp_path):
    assert MemoryFormerConfig().loss_chunk_tokens == LINEAR_CE_CHUNK_TOKENS
    assert MemoryFormerConfig.from_pretrained(SAVED_0_1_0).loss_chunk_tokens == LINEAR_CE_CHUNK_TOKENS
    config = copy.deepcopy(tiny_model(loss_chunk_tokens=0).config)
    config.save_pretrained(tmp_path)
    assert MemoryFormerConfig.from_pretrained(tmp_path).loss_chunk_tokens == 0
