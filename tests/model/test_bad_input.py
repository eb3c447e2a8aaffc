"""Bad inputs to a Memory Layer get errors that name the problem."""

import pytest
import torch

from modeling_memoryformer import MemoryLayer


def test_hashed_rows_outside_the_tables_are_rejected():
    layer = MemoryLayer(16, 8, 4)  # 4 tables of 16 rows = 64 rows
    rows, scores = layer.hash(torch.randn(3, 16))
    with pytest.raises(ValueError, match=r"rows\[\.\.\., k\] must index table k"):
        layer(hashed=(rows + 64, scores))


def test_hashed_rows_of_the_wrong_table_are_rejected():
    """A row inside the parameter but in another column's table (e.g. columns swapped) is an error, not a lookup."""
    layer = MemoryLayer(16, 8, 4)
    rows, scores = layer.hash(torch.randn(3, 16))
    with pytest.raises(ValueError, match=r"must index table k \(rows k \* 16"):
        layer(hashed=(rows.flip(-1), scores))


def test_fused_ops_reject_rows_of_the_wrong_table_instead_of_reading_out_of_bounds():
    from conftest import require_kernel

    require_kernel("fused")  # a skip, or a failure under MEMORYFORMER_REQUIRE_FUSED=1
    ops = torch.ops.memoryformer
    tables = torch.randn(4 * 16, 32)
    rows = torch.tensor([[0, 16, 32, 48], [15, 31, 47, 63]])
    bad = rows.clone()
    bad[1, 2] = 70  # beyond the parameter
    scores = torch.ones(2, 4)
    from modeling_memoryformer.memory_kernels import lookup_strategies

    strategies = lookup_strategies()
    assert strategies, "the fused kernel lists no strategy"
    for op in (
        lambda r: ops.lookup(r, scores, tables, None, 16),
        *(lambda r, how=how: ops.lookup_strategy(r, scores, tables, None, 16, how) for how in strategies),
        lambda r: ops.lookup_backward(torch.ones(2, 32), r, scores, tables, 16, True, True),
    ):
        op(rows)  # valid rows work
        with pytest.raises(RuntimeError, match="must index table 2"):
            op(bad)


def test_input_of_the_wrong_width_is_rejected():
    layer = MemoryLayer(16, 8, 4)
    with pytest.raises(ValueError, match="in_features=16"):
        layer(torch.randn(3, 12))


def test_a_malformed_gradient_pool_setting_is_an_error(monkeypatch):
    from modeling_memoryformer import memory_backend_cpu

    monkeypatch.setenv("MEMORYFORMER_GRAD_POOL_MB", "16GB")
    with pytest.raises(ValueError, match="MEMORYFORMER_GRAD_POOL_MB='16GB' is not a whole number"):
        memory_backend_cpu._check_pool_setting()
    monkeypatch.setenv("MEMORYFORMER_GRAD_POOL_MB", "0")
    memory_backend_cpu._check_pool_setting()


@pytest.mark.parametrize("shape", [(1, 0), (2, 0), (0, 5), (0, 0)])
def test_an_input_without_tokens_is_a_clear_error(kernel, shape):
    """[batch, 0] ids, a batch of zero sequences [0, seq] (and the embeddings of them) raise a ValueError naming the
    input and its shape, on both kernels and through generate, instead of a reshape error from deep inside attention."""
    from conftest import tiny_model

    model = tiny_model()
    ids = torch.zeros(shape, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"input_ids has shape \({shape[0]}, {shape[1]}\); pass at least one sequence"):
        model(ids)
    with pytest.raises(ValueError, match=rf"inputs_embeds has shape \({shape[0]}, {shape[1]}, 64\)"):
        model(inputs_embeds=torch.zeros(*shape, 64))
    if shape[1]:  # generate itself refuses an empty prompt before the model runs
        with pytest.raises(ValueError, match="pass at least one sequence"):
            model.generate(ids, max_new_tokens=2, do_sample=False)
    batch = shape[0] or 1
    assert model(torch.ones(batch, 1, dtype=torch.long)).logits.shape == (batch, 1, 128)


def test_token_ids_outside_the_vocabulary_are_a_clear_error():
    """Before: torch's `IndexError: index out of range in self` from the embedding."""
    from conftest import tiny_model

    model = tiny_model()  # vocabulary of 128
    for bad, shown in ((128, 128), (-1, -1), (10_000, 10_000)):
        ids = torch.tensor([[5, 17, bad, 42]])
        with pytest.raises(ValueError, match=rf"input_ids holds token id {shown}, outside the vocabulary \[0, 128\)"):
            model(ids)
    assert model(torch.tensor([[0, 127]])).logits.shape == (1, 2, 128)  # both ends of the vocabulary are fine


def test_an_attention_mask_of_another_length_is_a_clear_error():
    """Before: accepted, and it changed the logits."""
    from transformers import DynamicCache

    from conftest import tiny_model

    model = tiny_model()
    ids = torch.tensor([[5, 17, 90, 42], [6, 8, 9, 10]])
    for mask in (torch.ones(2, 3, dtype=torch.long), torch.ones(2, 5, dtype=torch.long),
                 torch.ones(1, 4, dtype=torch.long)):
        with pytest.raises(ValueError, match=rf"attention_mask has shape \({mask.shape[0]}, {mask.shape[1]}\) but "
                                             r"the input is 2 x 4 tokens: it needs shape \(2, 4\)"):
            model(ids, attention_mask=mask)
    # With a cache, the mask covers the cached tokens too.
    cache = DynamicCache(config=model.config)
    model(ids, attention_mask=torch.ones(2, 4, dtype=torch.long), past_key_values=cache, use_cache=True)
    step = torch.tensor([[1], [2]])
    with pytest.raises(ValueError, match=r"after 4 cached ones: it needs shape \(2, 5\)"):
        model(step, attention_mask=torch.ones(2, 1, dtype=torch.long), past_key_values=cache, use_cache=True)
    model(step, attention_mask=torch.ones(2, 5, dtype=torch.long), past_key_values=cache, use_cache=True)


def test_a_rotary_width_of_zero_is_refused():
    """partial_rotary_factor=0.01 at head_dim 16 rotated int(0.16) = 0 dims: a model without position information."""
    from modeling_memoryformer import MemoryFormerConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    shape = dict(hidden_size=64, num_attention_heads=4, hash_bits=4)
    with pytest.raises(ValueError, match=r"rotates int\(16 \* 0.01\) = 0 of the 16 dims.*at least 1 / head_dim = 0.0625"):
        MemoryFormerConfig(**shape, rope_parameters={**rope, "partial_rotary_factor": 0.01})
    config = MemoryFormerConfig(**shape, rope_parameters={**rope, "partial_rotary_factor": 0.0625})  # 1 dim: fine
    assert config.rope_parameters["partial_rotary_factor"] == 0.0625


def test_another_architectures_folder_is_refused_by_name(tmp_path):
    """A GPT-NeoX folder loaded as a MemoryFormer used to load with 16 tensors at random (same width) or fail on
    intermediate_size divisibility (another width)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig

    from modeling_memoryformer import MemoryFormerConfig, MemoryFormerForCausalLM

    for width, intermediate in ((64, 96), (48, 128)):
        folder = tmp_path / f"neox{width}"
        GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=128, hidden_size=width, num_hidden_layers=1,
                                         num_attention_heads=4, intermediate_size=intermediate)).save_pretrained(folder)
        for load in (MemoryFormerForCausalLM.from_pretrained, MemoryFormerConfig.from_pretrained):
            with pytest.raises(ValueError, match=rf"{folder} holds a 'gpt_neox' model .* not a MemoryFormer.*"
                                                 rf"memoryformer convert --from {folder}"):
                load(folder)
    LlamaConfig(vocab_size=128, hidden_size=64, num_attention_heads=4).save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="holds a 'llama' model.*class of its architecture"):
        MemoryFormerConfig.from_pretrained(tmp_path / "llama")
