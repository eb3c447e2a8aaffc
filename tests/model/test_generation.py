"""Generation through transformers' GenerationMixin: KV cache, padding, sampling, beam search, pipeline.

Oracle: a loop of full forwards (no cache) with argmax, written here.
"""

from __future__ import annotations

import pytest
import torch

from conftest import TINY, tiny_model


NEW_TOKENS = 12


def greedy_by_full_forwards(model, prompt: torch.Tensor, new_tokens: int = NEW_TOKENS) -> torch.Tensor:
    ids = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(ids, use_cache=False).logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=-1)
    return ids


@pytest.fixture
def prompt():
    return torch.tensor([[5, 17, 99, 42, 8, 63, 120]])


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_greedy_with_cache_equals_without_cache_equals_full_forward_loop(kernel, attn_implementation, prompt):
    model = tiny_model(attn_implementation=attn_implementation)
    mask = torch.ones_like(prompt)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    with_cache = model.generate(prompt, use_cache=True, **kwargs)
    without_cache = model.generate(prompt, use_cache=False, **kwargs)
    expected = greedy_by_full_forwards(model, prompt)
    assert with_cache.shape == (1, prompt.shape[1] + NEW_TOKENS)
    assert with_cache.tolist() == expected.tolist()
    assert without_cache.tolist() == expected.tolist()
    assert len(set(expected[0, prompt.shape[1]:].tolist())) > 1  # not a degenerate constant continuation


def test_incremental_forward_with_cache_matches_full_forward(prompt):
    model = tiny_model()
    full = model(prompt, use_cache=False).logits
    prefix = model(prompt[:, :4], use_cache=True)
    cache = prefix.past_key_values
    assert cache.get_seq_length() == 4
    steps = [prefix.logits]
    for t in range(4, prompt.shape[1]):
        out = model(prompt[:, t : t + 1], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        steps.append(out.logits)
    assert cache.get_seq_length() == prompt.shape[1]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_left_padded_batch_continues_each_prompt_as_alone():
    model = tiny_model()
    pad = model.config.pad_token_id
    prompts = [[5, 17, 99, 42, 8, 63, 120, 77, 31], [64, 3, 90, 11], [7, 7, 100, 45, 22, 9]]
    width = max(map(len, prompts))
    batch = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    batched = model.generate(batch, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=pad)
    for row, p in enumerate(prompts):
        alone = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=pad)
        assert batched[row, width:].tolist() == alone[0, len(p):].tolist(), f"prompt {row}"
        assert batched[row, width:].tolist() == greedy_by_full_forwards(model, torch.tensor([p]))[0, len(p):].tolist()


def test_seeded_sampling_is_reproducible_and_respects_top_k(prompt):
    model = tiny_model()
    kwargs = dict(attention_mask=torch.ones_like(prompt), do_sample=True, top_k=5, temperature=0.8,
                  max_new_tokens=NEW_TOKENS)
    torch.manual_seed(123)
    first = model.generate(prompt, **kwargs)
    torch.manual_seed(123)
    second = model.generate(prompt, **kwargs)
    torch.manual_seed(321)
    other = model.generate(prompt, **kwargs)
    assert first.tolist() == second.tolist()
    assert first.tolist() != other.tolist()
    # Every sampled token is among the 5 most likely after its prefix.
    with torch.no_grad():
        logits = model(first[:, :-1], use_cache=False).logits[0]
    for t in range(prompt.shape[1], first.shape[1]):
        top5 = logits[t - 1].topk(5).indices.tolist()
        assert first[0, t].item() in top5, t


def test_beam_search_runs_and_returns_the_right_shape(prompt):
    model = tiny_model()
    mask = torch.ones_like(prompt)
    out = model.generate(prompt, attention_mask=mask, num_beams=3, num_return_sequences=3, max_new_tokens=6,
                         do_sample=False, output_scores=True, return_dict_in_generate=True)
    assert out.sequences.shape == (3, prompt.shape[1] + 6)
    assert torch.equal(out.sequences[:, : prompt.shape[1]], prompt.expand(3, -1))
    assert len({tuple(s) for s in out.sequences.tolist()}) == 3  # three different beams
    scores = out.sequences_scores.tolist()
    assert scores == sorted(scores, reverse=True)
    # The best beam's score is its summed log-probability over the generated tokens divided by their number
    # (length_penalty=1): recompute it.
    with torch.no_grad():
        log_probs = model(out.sequences[:1, :-1], use_cache=False).logits[0].log_softmax(-1)
    generated = out.sequences[0, prompt.shape[1]:]
    total = sum(log_probs[prompt.shape[1] - 1 + i, token].item() for i, token in enumerate(generated.tolist()))
    assert scores[0] == pytest.approx(total / len(generated), abs=1e-4)

    batch = model.generate(prompt.expand(2, -1), attention_mask=mask.expand(2, -1), num_beams=3, max_new_tokens=4)
    assert batch.shape == (2, prompt.shape[1] + 4)


def _word_level_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, **{f"w{i}": i for i in range(3, TINY["vocab_size"])}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[PAD]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", bos_token="[BOS]", eos_token="[EOS]")


def test_text_generation_pipeline_with_a_tiny_tokenizer():
    from transformers import pipeline

    tokenizer = _word_level_tokenizer()
    model = tiny_model()
    text = "w5 w17 w99 w42 w8"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids.tolist() == [[5, 17, 99, 42, 8]]
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    expected = tokenizer.convert_ids_to_tokens(greedy_by_full_forwards(model, ids, 6)[0, 5:])
    new_text = generator(text, max_new_tokens=6, do_sample=False, return_full_text=False)[0]["generated_text"]
    assert new_text.split() == expected
    full_text = generator(text, max_new_tokens=6, do_sample=False)[0]["generated_text"]
    assert full_text.startswith(text) and full_text.endswith(new_text)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("table_dtype", [None, "bfloat16", "int8"],
                         ids=["model-dtype tables", "bfloat16 tables", "int8 tables"])
def test_decode_fast_path_gives_the_general_paths_logits_and_tokens(dtype, table_dtype, monkeypatch):
    """Generation takes `memory_ops.inference_lookup` (int8 tables: `quantization.int8_inference_lookup`: the fused
    hash and lookup ops without the general path's checks) and rotates Q and K in one in-place pass: the same ops on the same operands, so the logits are the same
    bits and greedy decoding the same tokens as with the general path, in float32 and bfloat16. Oracle: the general
    path itself (`inference_lookup` answering None), and for the rotation the out-of-place `apply_rotary_pos_emb`,
    which a forward hook on the Q/K/V layer selects. The decoder layers' fused decode steps (which run these layers'
    ops inside C++ calls, tests/model/test_decode_layer.py and test_decode_stack.py) are turned off, so that every
    step runs the modules."""
    from conftest import require_kernel
    from modeling_memoryformer import memory_layer, modeling_memoryformer

    require_kernel("fused")
    for step in ("decode_layer_step", "decode_stack_step"):
        monkeypatch.setattr(modeling_memoryformer, step, lambda *args, **kwargs: None)
    model = tiny_model(dtype=dtype, table_dtype=table_dtype)
    prompt = torch.tensor([[5, 17, 99, 42, 8, 63, 120], [3, 1, 4, 1, 5, 9, 2]])
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS, do_sample=False,
                  output_scores=True, return_dict_in_generate=True)
    fast_calls = []
    name = "int8_inference_lookup" if table_dtype == "int8" else "inference_lookup"
    fast = getattr(memory_layer, name)

    def counted(*args):
        y = fast(*args)
        fast_calls.append(y is not None)
        return y

    monkeypatch.setattr(memory_layer, name, counted)
    with torch.inference_mode():
        quick = model.generate(prompt, **kwargs)
    # every Memory Layer call took it (int8: every decode step's; the 14-token prefill takes FBGEMM's embedding bag)
    layers = len(fast_calls) // NEW_TOKENS if table_dtype == "int8" else 0  # calls per forward; 12 forwards
    assert fast_calls and all(fast_calls[layers:]) and not any(fast_calls[:layers])
    monkeypatch.setattr(memory_layer, name, lambda *args: None)
    hooks = [layer.attention.query_key_value.register_forward_hook(lambda *a: None) for layer in model.model.layers]
    with torch.inference_mode():
        general = model.generate(prompt, **kwargs)
    for hook in hooks:
        hook.remove()
    assert torch.equal(quick.sequences, general.sequences)
    for a, b in zip(quick.scores, general.scores):
        assert torch.equal(a, b)
    assert len(set(quick.sequences[0, prompt.shape[1]:].tolist())) > 1
