"""Continuous batching (`model.generate_batch`, transformers' paged KV cache and batched prefill) under the running
release: it calls the model with a paged cache (`cache=`) and the keywords of its `PagedAttentionArgs`, and either the
attention function (up to 5.23) or the model (from 5.24) writes the new keys and values into the cache
(transformers_compat.update_kv_cache). `make test` runs this file under the floor, the default and the newest release.

Oracle: `model.generate`'s greedy tokens, prompt by prompt; and the running release's own Llama through the same
`generate_batch` call (its GPT-NeoX fails it under 5.24: it writes the paged cache without the call's keywords), which shows the call itself is what transformers' in-tree models take.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from modeling_memoryformer.transformers_compat import PAGED_KEYWORDS, _attention_updates_paged_cache

from conftest import tiny_model

# Prompts of different lengths, more than one batch holds: requests join and leave the running batch.
PROMPTS = [[5, 17, 90, 42, 8, 63, 12], [64, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [7, 7, 100, 9]]
NEW_TOKENS = 8


def cb_config(**options) -> ContinuousBatchingConfig:
    """A small paged cache (left unset, transformers sizes it from the machine's memory). The page size is `page_size`
    from 5.23 and `block_size` before; `max_requests_per_batch` is absent from older releases."""
    fields = ContinuousBatchingConfig.__dataclass_fields__
    wanted = dict(num_blocks=32, page_size=16, block_size=16, max_batch_tokens=32, max_requests_per_batch=2, **options)
    return ContinuousBatchingConfig(**{key: value for key, value in wanted.items() if key in fields})


def generation_config() -> GenerationConfig:
    return GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)


def generate_each(model) -> list[list[int]]:
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), generation_config=generation_config())[0, len(p):].tolist()
                for p in PROMPTS]


def generate_batch(model) -> list[list[int]]:
    outputs = model.generate_batch(inputs=PROMPTS, generation_config=generation_config(),
                                   continuous_batching_config=cb_config(), progress_bar=False)
    assert len(outputs) == len(PROMPTS), f"requests failed: {sorted(outputs)}"
    by_prompt = {tuple(out.prompt_ids): out.generated_tokens for out in outputs.values()}
    return [by_prompt[tuple(p)] for p in PROMPTS]


def test_the_reference_in_tree_model_takes_the_same_call():
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=128, pad_token_id=0)).eval()
    assert generate_batch(llama) == generate_each(llama)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager", "paged|eager"])
def test_generate_batch_equals_generate_token_for_token(attn_implementation):
    model = tiny_model(attn_implementation="eager" if attn_implementation == "paged|eager" else attn_implementation)
    expected = generate_each(model)
    assert len({tuple(tokens) for tokens in expected}) == len(PROMPTS)  # the prompts continue differently
    if attn_implementation == "paged|eager":  # transformers' own paged eager function, set by the user
        model.set_attn_implementation("paged|eager")
    assert generate_batch(model) == expected


def test_generate_batch_with_memory_attention_output_and_int8_tables():
    """The model's options that change the layers (an output Memory Layer, int8 tables) go through the same path."""
    model = tiny_model(attention_output="memory", attn_implementation="sdpa")
    model.quantize_tables("int8")
    assert generate_batch(model) == generate_each(model)


def test_the_paged_keywords_are_read_from_the_running_release():
    assert {"read_index", "write_index", "logits_indices", "cache"} <= PAGED_KEYWORDS


def test_who_writes_the_paged_cache_is_read_from_the_attention_function():
    """A function that writes a paged cache it is handed (as transformers' sdpa did up to 5.23) and one that does not
    (the model's own eager function) are told apart by calling them."""
    from modeling_memoryformer.modeling_memoryformer import eager_attention_forward

    def writes(module, query, key, value, attention_mask, cache=None, **kwargs):
        key, value = cache.update(key, value, module.layer_idx, kwargs=kwargs)
        return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)

    assert _attention_updates_paged_cache(writes) is True
    assert _attention_updates_paged_cache(eager_attention_forward) is False


@pytest.mark.parametrize("name", ["read_index", "write_index", "block_table", "logits_indices"])
def test_paged_keywords_without_a_paged_cache_are_still_refused(name):
    """Accepted only in a continuous-batching call: elsewhere the model would ignore them."""
    model = tiny_model()
    with pytest.raises(TypeError, match=f"unexpected keyword argument.*'{name}'"):
        model(torch.tensor([PROMPTS[0]]), **{name: [torch.zeros(1, dtype=torch.long)]})
