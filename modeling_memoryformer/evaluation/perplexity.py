"""Perplexity: one implementation for a text (`perplexity`, sliding windows) and for fixed blocks of token ids
(`blocks_perplexity`, each block on its own).

`perplexity` is the sliding-window evaluation of the transformers documentation ("Perplexity of fixed-length
models"): windows of `context_length` tokens start every `stride` tokens, and each window scores only the tokens no
earlier window scored, so every token after the first is scored exactly once, with at least
`context_length - stride` tokens of context (all of its predecessors while it sits in the first window).

`blocks_perplexity` scores sequences that were cut beforehand (the held-out blocks of training or conversion data):
each block is a window of its own whose tokens after the first are scored, with no context carried over. Both run
`windows_nll` (no gradient, the model in eval mode, logits only where a token is scored, float32 at least for the
softmax).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

DEFAULT_CONTEXT_LENGTH = 1024  # when the model's config states no maximum length


def perplexity(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    text_or_path: str | os.PathLike,
    *,
    context_length: int | None = None,
    stride: int | None = None,
    batch_size: int = 1,
) -> dict[str, Any]:
    """Perplexity of `model` on a text, by overlapping windows (the transformers docs' method; module docstring).

    Args:
        model: a causal LM returning `.logits` [batch, seq, vocab]; evaluated in place, with no gradient.
        tokenizer: turns the text into ids (no special tokens are added).
        text_or_path: the text itself (a `str`) or a file to read it from (a `pathlib.Path` / `os.PathLike`).
        context_length: tokens per window (default: the model's `max_position_embeddings`, else 1024).
        stride: tokens between window starts, at most `context_length - 1` so that every scored token keeps at least
            one token of context (default `context_length // 2`).
        batch_size: windows per forward.

    Returns:
        {"nll_sum": summed negative log-likelihood (nats), "tokens": tokens scored (all but the first),
        "ppl": exp(nll_sum / tokens), "context_length", "stride", "windows"}.
    """
    if isinstance(text_or_path, os.PathLike):
        path = Path(text_or_path)
        if not path.is_file():
            raise FileNotFoundError(f"no text file at {str(path)!r} to compute the perplexity of")
        text = path.read_text(encoding="utf-8")
    elif isinstance(text_or_path, str):
        text = text_or_path
    else:
        raise TypeError(f"text_or_path must be the text (str) or a file path (pathlib.Path), got {type(text_or_path)}")
    max_positions = getattr(model.config, "max_position_embeddings", None)
    context_length = context_length if context_length is not None else (max_positions or DEFAULT_CONTEXT_LENGTH)
    if not isinstance(context_length, int) or context_length < 2:
        raise ValueError(f"context_length must be an integer >= 2 (one token of context, one to score), "
                         f"got {context_length!r}")
    if max_positions is not None and context_length > max_positions:
        raise ValueError(f"context_length={context_length} exceeds the model's max_position_embeddings="
                         f"{max_positions}; pass context_length <= {max_positions}")
    stride = stride if stride is not None else context_length // 2
    if not isinstance(stride, int) or not 1 <= stride < context_length:
        raise ValueError(f"stride must be an integer in [1, context_length - 1] = [1, {context_length - 1}] so that "
                         f"every token after the first is scored with context, got {stride!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")

    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    if len(ids) < 2:
        raise ValueError(f"the text has {len(ids)} token(s); perplexity needs at least 2 (one to score)")
    ids = torch.tensor(ids, dtype=torch.long)
    windows = sliding_windows(len(ids), context_length, stride)
    was_training = model.training
    model.eval()
    try:
        nll_sum = windows_nll(model, ids, windows, batch_size)
    finally:
        model.train(was_training)
    tokens = len(ids) - 1
    return {"nll_sum": nll_sum, "tokens": tokens, "ppl": math.exp(nll_sum / tokens),
            "context_length": context_length, "stride": stride, "windows": len(windows)}


def windows_nll(model: nn.Module, ids: torch.Tensor, windows: list[tuple[int, int, int]], batch_size: int,
                progress: bool = True) -> float:
    """Summed negative log-likelihood of the new tokens of every window, `batch_size` windows per forward."""
    device = next(model.parameters()).device
    nll_sum = 0.0
    total = sum(end - first for _, end, first in windows)
    with torch.inference_mode(), tqdm(total=total, desc="perplexity", unit="tok", disable=not progress) as bar:
        for batch in same_length_batches(windows, batch_size):
            inputs = torch.stack([ids[begin:end] for begin, end, _ in batch]).to(device)  # [batch, window]
            scored = [end - first for _, end, first in batch]
            # Only the positions predicting scored tokens need logits: the last max(scored) + 1, minus the last one.
            logits = model(input_ids=inputs, use_cache=False, logits_to_keep=max(scored) + 1).logits
            predictions = torch.cat([row_logits[-count - 1:-1] for row_logits, count in zip(logits, scored)])
            targets = torch.cat([ids[first:end] for _, end, first in batch]).to(device)
            # at least float32 for the softmax (bf16/fp16 logits), never less than the model's own precision
            predictions = predictions.to(torch.promote_types(predictions.dtype, torch.float32))
            nll_sum += F.cross_entropy(predictions, targets, reduction="sum").item()
            bar.update(sum(scored))
    return nll_sum


def sliding_windows(num_tokens: int, context_length: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored) of each window: ids[begin:end] is the input, ids[first:end] its new tokens."""
    windows = []
    scored_until = 1  # the first token has no context and is never scored
    for begin in range(0, num_tokens, stride):
        end = min(begin + context_length, num_tokens)
        windows.append((begin, end, scored_until))
        scored_until = end
        if end == num_tokens:
            break
    return windows


def same_length_batches(windows: list[tuple[int, int, int]], batch_size: int):
    """Consecutive windows of equal length in groups of at most `batch_size` (no padding: only the last is short)."""
    batch: list[tuple[int, int, int]] = []
    for window in windows:
        if batch and (len(batch) == batch_size or window[1] - window[0] != batch[0][1] - batch[0][0]):
            yield batch
            batch = []
        batch.append(window)
    if batch:
        yield batch


def blocks_perplexity(model: nn.Module, input_ids: torch.Tensor, batch_size: int = 16, progress: bool = False) -> float:
    """exp(mean next-token cross-entropy) over the sequences `input_ids` [S, T] (T >= 2), each scored on its own: every
    token after a sequence's first, with the sequence's earlier tokens as its only context."""
    if input_ids.dim() != 2 or input_ids.shape[1] < 2 or input_ids.shape[0] < 1:
        raise ValueError(f"input_ids must be [sequences, tokens] with at least one sequence of 2 or more tokens, got "
                         f"shape {tuple(input_ids.shape)}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    num_blocks, length = input_ids.shape
    windows = [(b * length, (b + 1) * length, b * length + 1) for b in range(num_blocks)]
    was_training = model.training
    model.eval()
    try:
        nll_sum = windows_nll(model, input_ids.reshape(-1), windows, batch_size, progress)
    finally:
        model.train(was_training)
    return math.exp(nll_sum / (num_blocks * (length - 1)))
