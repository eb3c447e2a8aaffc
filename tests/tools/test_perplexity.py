"""One perplexity implementation (`evaluation.perplexity`): fixed blocks (`blocks_perplexity`, what training,
conversion and the demo report) and a text by sliding windows (`perplexity`, `memoryformer eval`) share `windows_nll`.

Oracle: every scored token's probability recomputed from a separate forward of its own prefix, log-softmax in float64,
averaged by hand; no code of the module under test."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_model
from modeling_memoryformer.conversion import evaluate as conversion_evaluate
from modeling_memoryformer.evaluation import harness
from modeling_memoryformer.evaluation.perplexity import blocks_perplexity, perplexity, windows_nll


def prefix_nll(model, tokens: list[int], first: int = 1, context: int | None = None) -> list[float]:
    """-log p(tokens[t] | its preceding tokens, at most `context` of them) for t >= first, one forward per token."""
    out = []
    with torch.no_grad():
        for t in range(first, len(tokens)):
            start = 0 if context is None else max(0, t - context)
            logits = model(torch.tensor([tokens[start:t]])).logits[0, -1].double()
            out.append(-torch.log_softmax(logits, -1)[tokens[t]].item())
    return out


@pytest.mark.slow
def test_blocks_perplexity_is_exp_of_the_mean_token_nll_of_each_block_on_its_own():
    model = tiny_model()
    ids = torch.randint(0, model.config.vocab_size, (5, 9), generator=torch.Generator().manual_seed(0))
    nll = [v for block in ids.tolist() for v in prefix_nll(model, block)]
    expected = math.exp(sum(nll) / len(nll))
    for batch_size in (1, 2, 16):  # batches of blocks never change a block's score
        assert blocks_perplexity(model, ids, batch_size=batch_size) == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
def test_text_perplexity_scores_every_token_once_with_the_windows_context():
    class Tokenizer:  # whitespace-separated integers -> those ids
        def __call__(self, text, **kwargs):
            return {"input_ids": [int(w) for w in text.split()]}

    model = tiny_model()
    tokens = torch.randint(0, model.config.vocab_size, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    result = perplexity(model, Tokenizer(), " ".join(map(str, tokens)), context_length=8, stride=4, batch_size=3)
    # window starts 0, 4, 8, ...: token t (scored by the first window that reaches it) sees the tokens from that
    # window's start; the oracle rebuilds the same contexts by hand
    nll = []
    for t in range(1, len(tokens)):
        start = 0 if t < 8 else ((t - 8) // 4 + 1) * 4
        nll += prefix_nll(model, tokens[start:t + 1], first=t - start)
    assert result["tokens"] == len(tokens) - 1 and result["windows"] == 5
    assert result["ppl"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)


def test_one_implementation_under_every_name():
    assert not hasattr(conversion_evaluate, "perplexity")  # no second name for it
    assert harness.perplexity is perplexity
    assert blocks_perplexity.__module__ == perplexity.__module__ == windows_nll.__module__


def test_blocks_perplexity_restores_training_mode_and_rejects_bad_shapes():
    model = tiny_model().train()
    blocks_perplexity(model, torch.zeros(2, 4, dtype=torch.long))
    assert model.training
    for bad in (torch.zeros(4, dtype=torch.long), torch.zeros(3, 1, dtype=torch.long)):
        with pytest.raises(ValueError, match="input_ids must be"):
            blocks_perplexity(model, bad)
