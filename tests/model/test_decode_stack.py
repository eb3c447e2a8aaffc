"""Every decoder layer of a decode step in one call of the fused kernel (decode_layer.decode_stack_step: the
decode_stack op, for transformers' DynamicCache) against the modules it replaces, which are the oracle: the same ops
in the same order, so every token, score, cached key and value and captured hidden state must be the same bits.
Where it cannot give the modules' values or would skip something a user attached (hooks, output capture, another
cache, a patched cache update, training, gradients, another attention or kernel), it must leave the step to the
per-layer path or the modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from transformers.cache_utils import DynamicLayer

import modeling_memoryformer.modeling_memoryformer as modeling
from modeling_memoryformer import decode_layer, memory_ops
from modeling_memoryformer.transformers_compat import cache_grows_by_cat

from conftest import require_kernel, tiny_model
from test_decode_layer import CONFIGS, NEW, PROMPT, filled_cache, generate, modules_only  # the same forms and oracle


@pytest.fixture(autouse=True)
def fused():
    require_kernel("fused")
    with memory_ops.use_kernel("fused"):
        yield


def counted(monkeypatch) -> dict[str, int]:
    """Counts the steps the stack ran and the decoder-layer calls the per-layer step ran (non-None returns)."""
    runs = {"stack": 0, "layer": 0}

    def counting(name, step):
        def run(*args, **kwargs):
            out = step(*args, **kwargs)
            runs[name] += out is not None
            return out
        return run

    monkeypatch.setattr(modeling, "decode_stack_step", counting("stack", decode_layer.decode_stack_step))
    monkeypatch.setattr(modeling, "decode_layer_step", counting("layer", decode_layer.decode_layer_step))
    return runs


def generates_the_modules_bits(model, monkeypatch, prompt=PROMPT, **kwargs) -> dict[str, int]:
    """`generate` as it runs now, then with the modules only (the oracle): asserts the same tokens and scores, bit
    for bit, and returns the counts of the first run. Leaves the modules-only path in place."""
    runs = counted(monkeypatch)
    fast = generate(model, prompt, **kwargs)
    modules_only(monkeypatch)
    slow = generate(model, prompt, **kwargs)
    assert torch.equal(fast[0], slow[0])
    assert torch.equal(fast[1], slow[1])
    return dict(runs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_generate_gives_the_modules_bits_on_every_config_form(monkeypatch, name, dtype):
    model = tiny_model(attn_implementation="sdpa", **CONFIGS[name]).to(dtype)
    runs = generates_the_modules_bits(model, monkeypatch)
    layers = model.config.num_hidden_layers
    # An attention-output Memory Layer (a module between the ops) and float64 (no decode attention) take the
    # per-layer step; everything else runs every decode step in one call.
    stacked = name != "attention_output_memory" and dtype != torch.float64
    assert runs == ({"stack": NEW - 1, "layer": 0} if stacked else {"stack": 0, "layer": (NEW - 1) * layers})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int8_tables_and_one_unpadded_sequence_give_the_modules_bits(monkeypatch, dtype):
    model = tiny_model(attn_implementation="sdpa").to(dtype)
    model.quantize_tables("int8")
    assert generates_the_modules_bits(model, monkeypatch) == {"stack": NEW - 1, "layer": 0}
    monkeypatch.undo()
    assert generates_the_modules_bits(model, monkeypatch, prompt=PROMPT[:1]) == {"stack": NEW - 1, "layer": 0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_step_writes_the_modules_keys_values_and_logits(monkeypatch, dtype):
    model = tiny_model(attn_implementation="sdpa").to(dtype)
    batch, length = 3, 9
    ids = torch.tensor([[7], [100], [12]])
    fast_cache, cache = filled_cache(model, batch, length, dtype), filled_cache(model, batch, length, dtype)
    runs = counted(monkeypatch)
    with torch.inference_mode():
        fast = model(ids, past_key_values=fast_cache).logits
    assert runs == {"stack": 1, "layer": 0}
    modules_only(monkeypatch)
    with torch.inference_mode():
        expected = model(ids, past_key_values=cache).logits
    assert torch.equal(fast, expected)
    for fast_layer, layer in zip(fast_cache.layers, cache.layers, strict=True):
        assert type(fast_layer) is DynamicLayer
        assert torch.equal(fast_layer.keys, layer.keys)  # the rotated keys of the new position, appended
        assert torch.equal(fast_layer.values, layer.values)
    assert fast_cache.get_seq_length() == length + 1


def test_the_running_release_grows_a_dynamic_cache_by_concatenation():
    """What the stack relies on, checked here against the release's own layer: an update appends along the
    positions and the layer's keys and values are the returned tensors."""
    assert cache_grows_by_cat()
    layer = DynamicLayer()
    first, new = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 1, 5)
    layer.update(first, first + 1)
    keys, values = layer.update(new, new + 1)
    assert torch.equal(keys, torch.cat([first, new], dim=-2)) and keys is layer.keys and values is layer.values


def test_a_static_cache_or_a_patched_update_takes_the_per_layer_step(monkeypatch):
    model = tiny_model(attn_implementation="sdpa").to(torch.bfloat16)
    layers = model.config.num_hidden_layers
    runs = generates_the_modules_bits(model, monkeypatch, cache_implementation="static")
    assert runs == {"stack": 0, "layer": (NEW - 1) * layers}
    monkeypatch.undo()
    seen, update = [], DynamicLayer.update
    monkeypatch.setattr(DynamicLayer, "update", lambda self, *args, **kwargs: seen.append(1) or update(self, *args,
                                                                                                           **kwargs))
    runs = generates_the_modules_bits(model, monkeypatch)
    assert runs == {"stack": 0, "layer": (NEW - 1) * layers}
    assert len(seen) == 2 * NEW * layers  # both runs: the prefill and every decode step, every layer


def test_hooks_and_output_capture_make_it_step_aside(monkeypatch):
    """A hook on a decoder layer or on a submodule must see every step, and output capture must record every
    layer: the stack declines while they are there (the per-layer step or the modules run), and runs again once
    they are gone (transformers' capture hooks stay installed but record nothing)."""
    model = tiny_model(attn_implementation="sdpa")
    layers = model.config.num_hidden_layers
    seen = []
    handle = model.model.layers[1].register_forward_hook(lambda *args: seen.append(1))
    assert generates_the_modules_bits(model, monkeypatch) == {"stack": 0, "layer": (NEW - 1) * layers}
    assert len(seen) == 2 * NEW
    handle.remove()
    monkeypatch.undo()
    handle = model.model.layers[0].memory_block.layer1.register_forward_pre_hook(lambda *args: seen.append(2))
    assert generates_the_modules_bits(model, monkeypatch) == {"stack": 0, "layer": (NEW - 1) * (layers - 1)}
    assert seen.count(2) == 2 * NEW
    handle.remove()
    monkeypatch.undo()

    def captured():
        with torch.inference_mode():
            return model(PROMPT[:, -1:], past_key_values=filled_cache(model, 2, 3, torch.float32),
                         output_hidden_states=True)

    runs = counted(monkeypatch)
    fast = captured()
    assert runs["stack"] == 0
    modules_only(monkeypatch)
    slow = captured()
    assert len(fast.hidden_states) == layers + 1
    assert all(torch.equal(a, b) for a, b in zip(fast.hidden_states, slow.hidden_states))
    monkeypatch.undo()
    assert any(model.model.layers[0]._forward_hooks.values())  # transformers' capture hooks, inactive now
    assert generates_the_modules_bits(model, monkeypatch) == {"stack": NEW - 1, "layer": 0}


def test_it_steps_aside_for_training_gradients_and_other_kernels(monkeypatch):
    model = tiny_model(attn_implementation="sdpa")
    model.model.layers[1].post_attention_dropout.train()  # one module in training mode: the modules decide
    runs = generates_the_modules_bits(model, monkeypatch)
    assert runs["stack"] == 0
    monkeypatch.undo()
    model.eval()
    runs = counted(monkeypatch)
    with torch.enable_grad():
        model(PROMPT[:, -1:], past_key_values=filled_cache(model, 2, 3, torch.float32))
    with memory_ops.use_kernel("torch"):
        generate(model)
    generate(tiny_model(attn_implementation="eager"))
    assert runs == {"stack": 0, "layer": 0}


def test_the_plan_follows_replaced_tables_layers_and_dtypes(monkeypatch):
    """The stack's plan is derived once; replacing a table, a whole layer or the dtype afterwards must not leave it
    reading the old tensors."""
    model = tiny_model(attn_implementation="sdpa")
    before = generate(model)[1]
    assert model.model.__dict__.get("_decode_stack") is not None
    layer1 = model.model.layers[1].memory_block.layer1
    layer1.tables = nn.Parameter(-layer1.tables.detach())
    assert generates_the_modules_bits(model, monkeypatch) == {"stack": NEW - 1, "layer": 0}
    monkeypatch.undo()
    assert not torch.equal(generate(model)[1], before)
    model.model.layers[0] = tiny_model(seed=5, attn_implementation="sdpa").model.layers[0]
    assert generates_the_modules_bits(model, monkeypatch) == {"stack": NEW - 1, "layer": 0}
    monkeypatch.undo()
    model.to(torch.bfloat16)
    assert generates_the_modules_bits(model, monkeypatch) == {"stack": NEW - 1, "layer": 0}


def test_beam_search_reorders_the_cache_the_stack_reads(monkeypatch):
    """Beam search reorders the DynamicCache's layers between steps (new key and value tensors): the stack reads the
    layers each step, so its beams and scores are the modules'."""
    model = tiny_model(attn_implementation="sdpa").to(torch.bfloat16)
    assert generates_the_modules_bits(model, monkeypatch, num_beams=3) == {"stack": NEW - 1, "layer": 0}


def run_steps(model, cache, tokens: torch.Tensor) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """One forward per column of `tokens` ([batch, steps]) on `cache`: the logits of each step and, per step, the
    first layer's (keys data_ptr, buffer room) after it."""
    logits, buffers = [], []
    with torch.inference_mode():
        for step in range(tokens.shape[1]):
            logits.append(model(tokens[:, step:step + 1], past_key_values=cache).logits)
            keys = cache.layers[0].keys
            buffers.append((keys.data_ptr(), keys.stride(1) // keys.shape[-1]))
    return logits, buffers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_cache_grows_in_place_with_the_values_of_the_concatenation(monkeypatch, dtype):
    """The stack writes each new position into room left past the cached ones (a buffer reallocated every 64 or more
    steps instead of a copy per step): over 150 steps, crossing two reallocations, every step's logits and the final
    keys and values are the bits the modules' torch.cat gives, and a view of an earlier step keeps its values."""
    model = tiny_model(attn_implementation="sdpa").to(dtype)
    steps, length = 150, 9
    tokens = torch.randint(1, model.config.vocab_size, (2, steps), generator=torch.Generator().manual_seed(3))
    fast_cache, cache = filled_cache(model, 2, length, dtype), filled_cache(model, 2, length, dtype)
    held, held_values = None, None

    def hold(*args, **kwargs):  # the first layer's keys after step 20, as a user's reference to them
        nonlocal held, held_values
        out = decode_layer.decode_stack_step(*args, **kwargs)
        if held is None and fast_cache.get_seq_length() == length + 20:
            held, held_values = fast_cache.layers[0].keys, fast_cache.layers[0].keys.clone()
        return out

    monkeypatch.setattr(modeling, "decode_stack_step", hold)
    fast, buffers = run_steps(model, fast_cache, tokens)
    assert held is not None and torch.equal(held, held_values)  # 130 later positions written past its end
    moves = sum(a[0] != b[0] for a, b in zip(buffers, buffers[1:]))
    assert moves == 2 and all(room > length for _, room in buffers)  # copied at step 1, then in place but twice
    modules_only(monkeypatch)
    expected, _ = run_steps(model, cache, tokens)
    assert all(torch.equal(a, b) for a, b in zip(fast, expected, strict=True))
    for fast_layer, layer in zip(fast_cache.layers, cache.layers, strict=True):
        assert torch.equal(fast_layer.keys, layer.keys) and torch.equal(fast_layer.values, layer.values)


def crop(cache, length: int) -> None:
    """What `DynamicLayer.crop` does (its argument's sign convention differs between releases): views of the first
    `length` positions."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]


def test_two_caches_holding_the_same_tensors_never_write_each_others_positions(monkeypatch):
    """A second cache holding the very tensors of the first (a shallow copy of its layers), then each stepped with its
    own token: the first to grow its buffer takes the room, the other copies; both end with the bits the modules give
    from that shared state. So does a cache cropped back to an earlier length and grown again."""
    import copy

    model = tiny_model(attn_implementation="sdpa").to(torch.bfloat16)
    first = filled_cache(model, 1, 5, torch.bfloat16)
    prefix = torch.tensor([[3, 4, 5]])
    run_steps(model, first, prefix)  # the stack's buffers, with room
    snapshot = copy.deepcopy(first)  # independent buffers: the oracle's start
    second = copy.copy(first)
    second.layers = [copy.copy(layer) for layer in first.layers]
    assert second.layers[0].keys is first.layers[0].keys
    cropped = copy.copy(first)
    cropped.layers = [copy.copy(layer) for layer in first.layers]
    crop(cropped, 6)
    a, b, c = torch.tensor([[11]]), torch.tensor([[12]]), torch.tensor([[13]])
    fast = [run_steps(model, cache, token)[0][0] for cache, token in ((first, a), (second, b), (cropped, c))]
    modules_only(monkeypatch)
    starts = [copy.deepcopy(snapshot) for _ in range(3)]
    crop(starts[2], 6)
    expected = [run_steps(model, cache, token)[0][0] for cache, token in zip(starts, (a, b, c))]
    for got, want in zip(fast, expected, strict=True):
        assert torch.equal(got, want)
    for fast_cache, cache in zip((first, second, cropped), starts, strict=True):
        for fast_layer, layer in zip(fast_cache.layers, cache.layers, strict=True):
            assert torch.equal(fast_layer.keys, layer.keys) and torch.equal(fast_layer.values, layer.values)


def test_a_freed_caches_buffers_serve_the_next_cache_without_new_pages(monkeypatch):
    """The KV buffers a decode step makes go back to the kernel's pool when their cache is freed, and the next cache's
    step takes them: no page of them is faulted in again (the C library maps buffers over 128 KB afresh and unmaps
    them when freed). A buffer a user still holds a view of is not handed out: its values stay, and the steps on the
    reused buffers give the modules' bits."""
    import gc
    import resource

    model = tiny_model(attn_implementation="sdpa")
    batch, length = 8, 300
    heads, head_dim = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    room = length + 1 + max(64, (length + 1) // 4)
    pages = batch * heads * room * head_dim * 4 // 4096   # of each buffer: over 128 KB
    assert pages * 4096 > 128 << 10
    token = torch.randint(1, model.config.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(4))
    first = filled_cache(model, batch, length, torch.float32)
    run_steps(model, first, token)
    del first
    gc.collect()
    second = filled_cache(model, batch, length, torch.float32)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fast, _ = run_steps(model, second, token)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < pages // 2, f"{faults} page faults for buffers of {pages} pages each"
    held = second.layers[0].keys
    kept = held.clone()
    del second
    gc.collect()
    third = filled_cache(model, batch, length, torch.float32)
    run_steps(model, third, token)
    assert all(held.data_ptr() not in (layer.keys.data_ptr(), layer.values.data_ptr()) for layer in third.layers)
    assert torch.equal(held, kept)
    modules_only(monkeypatch)
    expected, _ = run_steps(model, filled_cache(model, batch, length, torch.float32), token)
    assert torch.equal(fast[0], expected[0])


def test_a_decode_step_runs_the_model_body_as_a_method_where_that_changes_nothing(monkeypatch):
    """MemoryFormerForCausalLM runs a stacked decode step's model body as a method (`decode_layer.decode_stack_run`), not through
    the model's module call and decorators; where anything could see the difference (a hook on the model, hidden
    states or attentions asked for, another keyword) the step calls the model as a module, with the same bits."""
    model = tiny_model(attn_implementation="sdpa")
    calls = []
    forward = modeling.MemoryFormerModel.forward

    def counting_forward(self, *args, **kwargs):
        calls.append(kwargs["input_ids"].shape if kwargs.get("input_ids") is not None else None)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(modeling.MemoryFormerModel, "forward", counting_forward)
    assert generates_the_modules_bits(model, monkeypatch) == {"stack": NEW - 1, "layer": 0}
    assert calls[0] == PROMPT.shape and len(calls) == 1 + NEW  # the prefill, then the oracle's NEW steps
    monkeypatch.undo()

    monkeypatch.setattr(modeling.MemoryFormerModel, "forward", counting_forward)
    calls.clear()
    seen = []
    handle = model.model.register_forward_hook(lambda *args: seen.append(1))
    runs = counted(monkeypatch)
    tokens = generate(model)
    assert len(seen) == NEW and len(calls) == NEW and runs["stack"] == NEW - 1  # module calls, still stacked
    handle.remove()
    calls.clear()
    assert torch.equal(generate(model)[0], tokens[0]) and len(calls) == 1

    cache = filled_cache(model, 2, 3, torch.float32)
    with torch.inference_mode():
        model.config.output_hidden_states = True
        try:
            out = model(PROMPT[:, -1:], past_key_values=cache)
        finally:
            model.config.output_hidden_states = False
        assert out.hidden_states is not None and len(out.hidden_states) == model.config.num_hidden_layers + 1
        out = model(PROMPT[:, -1:], past_key_values=filled_cache(model, 2, 3, torch.float32), output_attentions=False)
    assert calls[-2:] == [(2, 1), (2, 1)] and out.hidden_states is None
