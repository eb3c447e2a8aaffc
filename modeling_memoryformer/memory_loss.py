"""The LM head and its loss in one chunked pass. The head's logits over the vocabulary, their log-softmax and its
gradient are the largest tensors of a training step ([tokens, vocab] float32 each: 824 MB for 8 x 512 tokens of
MF-tiny's 50304-word vocabulary). `linear_cross_entropy` never makes them: it takes `chunk_tokens` tokens at a
time, computes their logits, their log-sum-exp and loss, and at once the gradient of those logits,
(softmax - onehot) / denominator, which it turns into the chunk's hidden-state gradient and adds into the
weight's (and bias's) gradient. The backward pass then only scales these stored gradients by the loss's incoming
gradient. Same semantics as transformers' `ForCausalLMLoss`.

Chunk size (LINEAR_CE_CHUNK_TOKENS, the default of the config's `loss_chunk_tokens`): every size from 512 to 2048
tokens is bound by the three matmuls, and 512 needs the least memory (docs/kernel.md, "Measurements behind the design
choices").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from .memory_kernels import cache_share_bytes

LINEAR_CE_CHUNK_TOKENS = 512


def _softmax_block_rows(vocab: int, itemsize: int) -> int:
    """Rows of a chunk's logits that the softmax steps take at a time: a quarter of the last-level cache (8 MB when
    the fused kernel does not report it), so that after the first read of a block its max, exp, sum and scaling run
    from cache instead of as five passes over the whole [chunk, V] block from memory (same values to the bit)."""
    return max(1, cache_share_bytes() // max(1, vocab * itemsize))


def _add_widened(total: torch.Tensor, part: torch.Tensor) -> None:
    """total += part for a 16-bit `part` and a float32 `total` of the same shape, by blocks of rows widened into a
    buffer of a quarter of the last-level cache. `total += part` widens through a fresh temporary the size of `part`
    (its page faults every time)."""
    rows = max(1, cache_share_bytes() // max(1, part.shape[1] * total.element_size()))
    buf = torch.empty((min(rows, part.shape[0]), part.shape[1]), dtype=total.dtype, device=total.device)
    for r0 in range(0, part.shape[0], rows):
        r1 = min(r0 + rows, part.shape[0])
        total[r0:r1].add_(buf[: r1 - r0].copy_(part[r0:r1]))


def _linear_cross_entropy_pass(hidden, weight, bias, labels, chunk_tokens, ignore_index, num_items_in_batch,
                               need_hidden, need_weight, need_bias):
    """The loss over hidden [N, d] with weight [V, d] (bias [V]) and labels [N] (already shifted), and, for the inputs
    asked for, its gradients: (loss, grad_hidden, grad_weight, grad_bias). grad_weight and grad_bias are in the
    accumulation dtype (float32, float64 for float64 inputs); the caller casts them. The matmuls run in the inputs'
    dtype; the logits are upcast to float32 per chunk, as `ForCausalLMLoss` does (`logits.float()`)."""
    n, width = hidden.shape
    vocab = weight.shape[0]
    acc_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    valid = labels != ignore_index
    targets = torch.where(valid, labels, 0).unsqueeze(1)
    denominator = valid.sum() if num_items_in_batch is None else num_items_in_batch
    if torch.is_tensor(denominator):
        denominator = denominator.to(hidden.device)
    scale = 1.0 / torch.as_tensor(denominator, dtype=acc_dtype, device=hidden.device)
    need_logit_grad = need_hidden or need_weight or need_bias

    # Buffers reused by every chunk (a fresh [chunk, V] allocation per chunk costs its page faults each time).
    rows = min(chunk_tokens, n)
    logits_buf = hidden.new_empty((rows, vocab), dtype=acc_dtype)
    narrow_buf = hidden.new_empty((rows, vocab)) if hidden.dtype != acc_dtype else None  # bf16/fp16 matmul results
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    grad_weight = hidden.new_empty((vocab, width), dtype=acc_dtype) if need_weight else None  # the first chunk sets it
    weight_buf = torch.empty_like(weight) if need_weight and weight.dtype != acc_dtype else None
    grad_bias = hidden.new_zeros((vocab,), dtype=acc_dtype) if need_bias else None
    loss_sum = hidden.new_zeros((), dtype=acc_dtype)
    weight_t = weight.t()
    block = _softmax_block_rows(vocab, logits_buf.element_size())
    if need_weight and n == 0:
        grad_weight.zero_()
    for start in range(0, n, chunk_tokens):
        end = min(start + chunk_tokens, n)
        h = hidden[start:end]
        logits = logits_buf[: end - start]
        product = logits if narrow_buf is None else narrow_buf[: end - start]
        if bias is None:
            torch.mm(h, weight_t, out=product)
        else:
            torch.addmm(bias, h, weight_t, out=product)
        if narrow_buf is not None:
            logits.copy_(product)  # logits.float()
        target, kept = targets[start:end], valid[start:end]
        target_logit = logits.gather(1, target).squeeze(1)
        log_sum_exp = torch.empty_like(target_logit)
        # Block by block of rows, in place (the chunk's logits are not needed any more): exp(logits - row max), then,
        # for the gradient, d loss / d logits = (softmax - onehot) * scale on the kept tokens, 0 on the ignored ones
        # (also when no token is kept and scale is inf).
        for r0 in range(0, end - start, block):
            rows_block = logits[r0 : r0 + block]
            row_max = rows_block.amax(1, keepdim=True)
            sum_exp = rows_block.sub_(row_max).exp_().sum(1)
            torch.add(sum_exp.log(), row_max.squeeze(1), out=log_sum_exp[r0 : r0 + block])
            if need_logit_grad:
                rows_block.mul_(torch.where(kept[r0 : r0 + block], scale / sum_exp, 0).unsqueeze(1))
        token_loss = log_sum_exp.sub_(target_logit)  # log-sum-exp - target logit
        loss_sum += torch.where(kept, token_loss, 0).sum()
        if not need_logit_grad:
            continue
        grad_logits = logits
        grad_logits.scatter_add_(1, target, torch.where(kept, -scale, 0).unsqueeze(1).to(acc_dtype))
        if need_bias:
            grad_bias += grad_logits.sum(0)
        if narrow_buf is not None:
            grad_logits = product.copy_(grad_logits)  # back to the inputs' dtype for the matmuls, as autograd would
        if need_hidden:
            torch.mm(grad_logits, weight, out=grad_hidden[start:end])
        if need_weight:
            if weight_buf is None:
                if start == 0:
                    torch.mm(grad_logits.t(), h, out=grad_weight)
                else:
                    grad_weight.addmm_(grad_logits.t(), h)
            else:  # bf16/fp16 products summed over the chunks in float32
                product_weight = torch.mm(grad_logits.t(), h, out=weight_buf)
                if start == 0:
                    grad_weight.copy_(product_weight)
                else:
                    _add_widened(grad_weight, product_weight)
    return loss_sum / denominator, grad_hidden, grad_weight, grad_bias


class _LinearCrossEntropy(torch.autograd.Function):
    """The chunked loss as an autograd node. The forward computes the gradients of the inputs that need one and hands
    them to the backward, which scales them by the loss's gradient (a scalar) and gives them away (so that autograd
    can keep them as `.grad` without a copy): one backward pass per forward, no double backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_tokens, ignore_index, num_items_in_batch):
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        loss, *grads = _linear_cross_entropy_pass(hidden, weight, bias, labels, chunk_tokens, ignore_index,
                                                  num_items_in_batch, need_hidden, need_weight, need_bias)
        ctx.grads = grads
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # Grad mode is on in a backward pass only under create_graph=True, i.e. when a second derivative is wanted:
        # refuse it here, where the message can say why (once_differentiable would only leave gradients without a
        # grad_fn, and a puzzling error later).
        if torch.is_grad_enabled():
            raise RuntimeError(
                "linear_cross_entropy does not support double backward (create_graph=True): its gradients are computed "
                "in the forward pass, not as a graph that could be differentiated again. Use the full-logits loss "
                "(loss_chunk_tokens=0 in the model config) for higher-order gradients."
            )
        if ctx.grads is None:
            raise RuntimeError(
                "linear_cross_entropy's gradients were computed in its forward pass and already handed to an earlier "
                "backward pass; it supports one backward pass per forward (no retain_graph=True reuse). Run the "
                "forward again, or use the full-logits loss (loss_chunk_tokens=0 in the model config)."
            )
        grad_hidden, grad_weight, grad_bias = ctx.grads
        ctx.grads = None
        if grad_loss.device.type != "cpu" or float(grad_loss) != 1.0:
            grads = [g.mul_(grad_loss.to(g.dtype)) if g is not None else None
                     for g in (grad_hidden, grad_weight, grad_bias)]
            grad_hidden, grad_weight, grad_bias = grads
        weight_dtype, bias_dtype = ctx.dtypes
        grad_weight = None if grad_weight is None else grad_weight.to(weight_dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias_dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         labels: torch.Tensor | None, *, chunk_tokens: int = LINEAR_CE_CHUNK_TOKENS,
                         ignore_index: int = -100, num_items_in_batch=None,
                         shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """`ForCausalLMLoss(F.linear(hidden, weight, bias), labels, ...)` without the [tokens, vocab] logits: the scalar
    next-token cross-entropy of hidden [..., d] under the head weight [V, d] (bias [V] or None).

    labels [...] (hidden's leading shape) are shifted inside, as ForCausalLMLoss does (position t predicts labels
    t + 1; the last position is ignored), unless `shift_labels` (already shifted) is given instead. Tokens whose label
    is `ignore_index` do not count. The loss is the mean over the counted tokens (nan when there is none, as
    `F.cross_entropy`), or their sum divided by `num_items_in_batch` when it is given (what the Trainer passes).

    Work goes `chunk_tokens` tokens at a time; when a gradient is recorded for hidden, weight or bias, each chunk's
    logit gradient is turned into the input gradients at once, and the backward only scales them. The matmuls run in
    the inputs' dtype (under autocast, in its dtype); logits, log-sum-exp and loss in float32 (float64 inputs stay
    float64). One backward pass per forward; no double backward.
    """
    if not (isinstance(chunk_tokens, int) and not isinstance(chunk_tokens, bool) and chunk_tokens > 0):
        raise ValueError(f"chunk_tokens must be a positive integer (tokens per chunk), got {chunk_tokens!r}. "
                         f"Use e.g. {LINEAR_CE_CHUNK_TOKENS}.")
    if shift_labels is None:
        if labels is None:
            raise ValueError("linear_cross_entropy needs labels (or shift_labels).")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if weight.dim() != 2 or hidden.shape[-1:] != weight.shape[1:]:
        raise ValueError(f"weight must be [vocab, d] with d = hidden's last dimension; got weight of shape "
                         f"{tuple(weight.shape)} for hidden of shape {tuple(hidden.shape)}.")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be a vector of vocab={weight.shape[0]} values or None, got shape "
                         f"{tuple(bias.shape)}.")
    if shift_labels.numel() * hidden.shape[-1] != hidden.numel():
        raise ValueError(f"labels must hold one token id per position of hidden {tuple(hidden.shape[:-1])}; got "
                         f"shape {tuple(shift_labels.shape)}.")
    hidden = hidden.reshape(-1, hidden.shape[-1])
    shift_labels = shift_labels.reshape(-1).to(device=hidden.device, dtype=torch.long)
    vocab = weight.shape[0]
    out_of_range = (shift_labels != ignore_index) & ((shift_labels < 0) | (shift_labels >= vocab))
    if bool(out_of_range.any()):
        bad = shift_labels[out_of_range][0].item()
        raise ValueError(f"labels hold token id {bad}, outside [0, vocab={vocab}) and not ignore_index="
                         f"{ignore_index}. Use token ids of the model's vocabulary, and {ignore_index} for positions "
                         "that should not count.")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):  # what autocast would do for F.linear: the matmuls in its dtype
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight, bias = (t.to(dtype) if t is not None and t.dtype in (torch.float32, torch.float16,
                                torch.bfloat16) else t for t in (hidden, weight, bias))
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError(f"hidden, weight and bias must share a dtype; got {hidden.dtype}, {weight.dtype} and "
                         f"{None if bias is None else bias.dtype}. Cast them to one dtype (or run under autocast).")
    tensors = (hidden, weight, bias)
    with torch.autocast(device_type, enabled=False):
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
            return _LinearCrossEntropy.apply(hidden, weight, bias, shift_labels, chunk_tokens, ignore_index,
                                             num_items_in_batch)
        loss, *_ = _linear_cross_entropy_pass(hidden, weight, bias, shift_labels, chunk_tokens, ignore_index,
                                              num_items_in_batch, False, False, False)
        return loss


def uses_chunked_loss(model, head_class, labels, logits_to_keep, hidden_states: torch.Tensor) -> bool:
    """Whether a causal LM's `forward` (`model`) computes the loss with `linear_cross_entropy` instead of full logits:
    training with labels and gradients, `config.loss_chunk_tokens` > 0, every position kept, the default causal-LM
    loss, and a plain `head_class` (MemoryFormerLMHead) whose float weight (a plain Parameter, not a DTensor) has the
    hidden states' dtype and which nothing is attached to (module hooks, accelerate's `_hf_hook`; PEFT replaces the
    head's class). Everything else (e.g. a bfloat16 head in a float32 model, int8, torch.compile) keeps the
    full-logits path."""
    if not (
        labels is not None
        and model.training
        and torch.is_grad_enabled()
        and model.config.loss_chunk_tokens > 0
        and isinstance(logits_to_keep, int)
        and logits_to_keep == 0
        and not torch.compiler.is_compiling()
        and model.loss_function is ForCausalLMLoss
    ):
        return False
    head = model.lm_head
    if type(head) is not head_class or getattr(head, "_hf_hook", None) is not None:
        return False
    module = nn.modules.module
    hooks = (head._forward_hooks, head._forward_pre_hooks, head._backward_hooks, head._backward_pre_hooks,
             module._global_forward_hooks, module._global_forward_pre_hooks, module._global_backward_hooks,
             module._global_backward_pre_hooks)
    if any(hooks):  # someone watches or changes the head's input or output: let them see it run
        return False
    weight, bias = head.weight, head.bias
    return (
        type(weight) is nn.Parameter  # a DTensor (FSDP2, tensor parallel) or other subclass keeps the old path
        and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and weight.dtype == hidden_states.dtype
        and (bias is None or (type(bias) is nn.Parameter and bias.dtype == weight.dtype))
    )
