"""A decoder layer's decode step on the fused kernel (decode_layer.py: the decode_qkv and decode_block ops around the
cache update and the decode attention) against the modules it replaces, which are the oracle: the same ops in the
same order, so every token, every score and every cached key and value must be the same bits, on every config form
the ops take. Where the step cannot give the modules' values (hooks, training, gradients, another attention or
kernel), it must leave the call to the modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from transformers import DynamicCache

import modeling_memoryformer.modeling_memoryformer as modeling
from modeling_memoryformer import decode_layer, memory_ops

from conftest import require_kernel, tiny_model

PROMPT = torch.tensor([[5, 17, 99, 42, 8, 63, 120], [0, 0, 3, 9, 27, 81, 44]])  # the second left-padded
NEW = 6


@pytest.fixture(autouse=True)
def fused(monkeypatch):
    """The fused kernel, and the per-layer step on its own: the step of all layers in one call (decode_stack_step,
    tests/model/test_decode_stack.py) is off here, so that every decode step goes through decode_layer_step."""
    require_kernel("fused")
    monkeypatch.setattr(modeling, "decode_stack_step", lambda *args, **kwargs: None)
    with memory_ops.use_kernel("fused"):
        yield


def counted(monkeypatch) -> list[int]:
    """Counts the decoder-layer calls the fused step ran (its non-None returns)."""
    runs, step = [0], decode_layer.decode_layer_step

    def counting(*args, **kwargs):
        out = step(*args, **kwargs)
        runs[0] += out is not None
        return out

    monkeypatch.setattr(modeling, "decode_layer_step", counting)
    return runs


def modules_only(monkeypatch) -> None:
    for name in ("decode_layer_step", "decode_stack_step"):
        monkeypatch.setattr(modeling, name, lambda *args, **kwargs: None)


def generate(model, prompt=PROMPT, **kwargs):
    with torch.inference_mode():
        out = model.generate(prompt, attention_mask=(prompt != 0).long(), max_new_tokens=NEW, do_sample=False,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.scores)


def generates_the_modules_bits(model, monkeypatch, **kwargs) -> bool:
    """`generate` as it runs now, then with the modules only (the oracle): the same tokens and scores, bit for bit.
    Leaves the modules-only path in place."""
    fast = generate(model, **kwargs)
    modules_only(monkeypatch)
    return all(torch.equal(a, b) for a, b in zip(fast, generate(model, **kwargs)))


CONFIGS = {
    "default": {},
    "rmsnorm": dict(norm_type="rmsnorm"),
    "parallel_residual": dict(use_parallel_residual=True),
    "gelu_block": dict(memory_block_activation="gelu"),
    "attention_output_memory": dict(attention_output="memory"),
    "no_bias": dict(memory_bias=False),
    "l1_score_temperature": dict(hash_score="l1", hash_temperature=0.7),
    "partial_rotary_half": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": 0.5}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_generate_gives_the_modules_bits_on_every_config_form(monkeypatch, name, dtype):
    model = tiny_model(attn_implementation="sdpa", **CONFIGS[name]).to(dtype)
    runs = counted(monkeypatch)
    fast_tokens, fast_scores = generate(model)
    assert runs[0] == (NEW - 1) * model.config.num_hidden_layers  # every layer of every step after the prefill
    modules_only(monkeypatch)
    tokens, scores = generate(model)
    assert torch.equal(fast_tokens, tokens)
    assert torch.equal(fast_scores, scores)  # bit for bit: the same ops in the same order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int8_tables_give_the_modules_bits(monkeypatch, dtype):
    model = tiny_model(attn_implementation="sdpa").to(dtype)
    model.quantize_tables("int8")
    runs = counted(monkeypatch)
    assert generates_the_modules_bits(model, monkeypatch)
    assert runs[0] == (NEW - 1) * model.config.num_hidden_layers


def test_a_static_cache_gives_the_modules_bits(monkeypatch):
    model = tiny_model(attn_implementation="sdpa").to(torch.bfloat16)
    runs = counted(monkeypatch)
    assert generates_the_modules_bits(model, monkeypatch, cache_implementation="static")
    assert runs[0] == (NEW - 1) * model.config.num_hidden_layers


def layer_step(model, hidden, cache, positions):
    """One decoder layer (the first) on a decode step's hidden states over `cache`."""
    position_embeddings = model.model.rotary_emb(hidden, positions)
    with torch.inference_mode():
        return model.model.layers[0](hidden, attention_mask=None, position_embeddings=position_embeddings,
                                     past_key_values=cache, position_ids=positions)


def filled_cache(model, batch: int, length: int, dtype) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    heads, head_dim = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    generator = torch.Generator().manual_seed(1)
    for layer in range(model.config.num_hidden_layers):
        keys, values = (torch.randn(batch, heads, length, head_dim, generator=generator).to(dtype) for _ in range(2))
        cache.update(keys, values, layer)
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_layer_writes_the_modules_keys_and_values_and_output(monkeypatch, dtype):
    model = tiny_model(attn_implementation="sdpa").to(dtype)
    batch, length = 3, 9
    hidden = torch.randn(batch, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(2)).to(dtype)
    positions = torch.tensor([[length], [length], [length]])
    fast_cache, cache = filled_cache(model, batch, length, dtype), filled_cache(model, batch, length, dtype)
    runs = counted(monkeypatch)
    fast = layer_step(model, hidden, fast_cache, positions)
    assert runs[0] == 1
    modules_only(monkeypatch)
    expected = layer_step(model, hidden, cache, positions)
    assert torch.equal(fast, expected)
    assert torch.equal(fast_cache.layers[0].keys, cache.layers[0].keys)  # the rotated keys, in the cache
    assert torch.equal(fast_cache.layers[0].values, cache.layers[0].values)
    assert fast_cache.get_seq_length() == length + 1


def test_the_rotation_is_the_reference_formula_in_float64():
    """An independent oracle for the ops' one piece of own arithmetic: the rotary embedding of Q and K, as
    apply_rotary_pos_emb writes it, on a float64 layer (no rounding between the products and the sum)."""
    model = tiny_model().to(torch.float64)
    layer = model.model.layers[0]
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 1, model.config.hidden_size, dtype=torch.float64, generator=generator)
    positions = torch.tensor([[4], [11]])
    cos, sin = model.model.rotary_emb(hidden, positions)
    plan = decode_layer._plan(layer, torch.float64, 2)
    with torch.inference_mode():
        qkv = memory_ops.fused_ops().decode_qkv(hidden.view(2, -1), *plan.qkv, cos, sin, 4)
        plain = layer.attention.query_key_value(layer.input_layernorm(hidden))  # not rotated
    heads = model.config.num_attention_heads
    q, k, v = (t.view(2, 1, heads, -1).transpose(1, 2) for t in plain.chunk(3, dim=-1))
    q_ref, k_ref = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k, got_v = (t.view(2, 1, heads, -1).transpose(1, 2) for t in qkv.view(2, 1, -1).chunk(3, dim=-1))
    torch.testing.assert_close(got_q, q_ref, rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(got_k, k_ref, rtol=1e-15, atol=1e-15)
    assert torch.equal(got_v, v)


def run_with(model, monkeypatch) -> int:
    runs = counted(monkeypatch)
    generate(model)
    return runs[0]


def test_it_steps_aside_where_it_would_skip_something(monkeypatch):
    """Hooks on a submodule must run, a gradient must be recorded, eager attention must compute its weights: the
    modules run those steps (the fast path returns None), and the hooks see every decode step."""
    model = tiny_model(attn_implementation="sdpa")
    seen = []
    handle = model.model.layers[1].memory_block.layer1.register_forward_hook(lambda *args: seen.append(1))
    assert run_with(model, monkeypatch) == (NEW - 1) * (model.config.num_hidden_layers - 1)  # layer 1 declines
    assert len(seen) == NEW  # the prefill and every decode step
    handle.remove()
    assert run_with(model, monkeypatch) == (NEW - 1) * model.config.num_hidden_layers  # the plan sees it gone
    qkv = model.model.layers[0].attention.query_key_value
    qkv.forward = lambda x, forward=qkv.forward: seen.append(2) or forward(x)  # as accelerate's hooks replace it
    assert run_with(model, monkeypatch) == (NEW - 1) * (model.config.num_hidden_layers - 1)
    assert seen.count(2) == NEW
    del qkv.forward
    eager = tiny_model(attn_implementation="eager")
    assert run_with(eager, monkeypatch) == 0
    with memory_ops.use_kernel("torch"):
        assert run_with(model, monkeypatch) == 0
    runs = counted(monkeypatch)
    with torch.enable_grad():
        model(PROMPT[:, -1:], past_key_values=filled_cache(model, 2, 3, torch.float32))
    assert runs[0] == 0
    model.train()
    with torch.no_grad():
        model(PROMPT[:, -1:], past_key_values=filled_cache(model, 2, 3, torch.float32))
    assert runs[0] == 0


def test_output_capture_still_gets_every_hidden_state(monkeypatch):
    """transformers' output capture hooks the decoder layers (which run either way) and the attention (whose weights
    the "sdpa" path never returns): the fast path keeps running, and the captured states are the modules'."""
    model = tiny_model(attn_implementation="sdpa")
    step = PROMPT[:, -1:]

    def captured():
        with torch.inference_mode():
            return model(step, past_key_values=filled_cache(model, 2, 3, torch.float32), output_hidden_states=True,
                         output_attentions=True)

    runs = counted(monkeypatch)
    fast = captured()
    assert runs[0] == model.config.num_hidden_layers
    modules_only(monkeypatch)
    slow = captured()
    assert len(fast.hidden_states) == model.config.num_hidden_layers + 1
    assert all(torch.equal(a, b) for a, b in zip(fast.hidden_states, slow.hidden_states))


def test_the_plan_follows_replaced_parameters_and_dtypes(monkeypatch):
    """A plan is derived once per layer; quantising the tables or casting the model afterwards must not leave it
    reading the old tensors."""
    model = tiny_model(attn_implementation="sdpa")
    generate(model)
    assert all(layer.__dict__.get("_decode_plan") is not None for layer in model.model.layers)
    for change in (lambda m: m.to(torch.bfloat16), lambda m: m.quantize_tables("int8")):
        change(model)
        assert generates_the_modules_bits(model, monkeypatch)
        monkeypatch.undo()
        monkeypatch.setattr(modeling, "decode_stack_step", lambda *args, **kwargs: None)  # as `fused` sets it


def test_a_replaced_submodule_is_run_as_a_module(monkeypatch):
    model = tiny_model(attn_implementation="sdpa")
    generate(model)

    class Doubling(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return 2 * self.inner(x)

    replaced = tiny_model(attn_implementation="sdpa")
    replaced.model.layers[0].attention = Doubling(replaced.model.layers[0].attention)  # no config, no heads
    with pytest.raises(TypeError):  # the module path's own error (Doubling takes one argument): the step declined
        generate(replaced)
    model.model.layers[0].memory_block.layer2 = Doubling(model.model.layers[0].memory_block.layer2)
    derived, plan = [], decode_layer._plan
    monkeypatch.setattr(decode_layer, "_plan", lambda *args: derived.append(1) or plan(*args))
    assert run_with(model, monkeypatch) == (NEW - 1) * (model.config.num_hidden_layers - 1)
    assert len(derived) == 1  # the declined layer's plan is kept: a state check per step, not a derivation
    assert generates_the_modules_bits(model, monkeypatch)


def test_a_deep_copy_of_the_model_gets_plans_of_its_own(monkeypatch):
    """copy.deepcopy (an EMA or teacher copy) carries the plans; each must check and read the copy's modules."""
    import copy

    model = tiny_model(attn_implementation="sdpa")
    generate(model)
    twin = copy.deepcopy(model)
    seen = []
    qkv = twin.model.layers[0].attention.query_key_value
    qkv.forward = lambda x, forward=qkv.forward: seen.append(1) or forward(x)  # on the copy only
    with torch.no_grad():
        for table in (twin.model.layers[1].memory_block.layer1.tables,):
            table.mul_(-1)  # the copy's tables differ from the original's
    assert run_with(twin, monkeypatch) == (NEW - 1) * (twin.model.config.num_hidden_layers - 1)
    assert len(seen) == NEW
    assert generates_the_modules_bits(twin, monkeypatch)
    assert not torch.equal(generate(twin)[1], generate(model)[1])


def test_rotary_tables_of_another_dtype_are_left_to_the_modules(monkeypatch):
    model = tiny_model(attn_implementation="sdpa").to(torch.bfloat16)
    hidden = torch.randn(2, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(4)).bfloat16()
    positions = torch.tensor([[3], [3]])
    cos, sin = (t.float() for t in model.model.rotary_emb(hidden, positions))  # float32 for a bf16 layer
    runs = counted(monkeypatch)

    def step(cache):
        with torch.inference_mode():
            return model.model.layers[0](hidden, attention_mask=None, position_embeddings=(cos, sin),
                                         past_key_values=cache, position_ids=positions)

    fast = step(filled_cache(model, 2, 3, torch.bfloat16))
    assert runs[0] == 0
    modules_only(monkeypatch)
    assert torch.equal(fast, step(filled_cache(model, 2, 3, torch.bfloat16)))



@pytest.mark.parametrize("table_dtype", [None, "int8"])
def test_continuous_batching_steps_give_the_modules_bits(monkeypatch, table_dtype):
    """generate_batch (transformers' continuous batching: a paged cache, the tokens of every running request as one
    sequence dimension, its paged attention function): each call the step runs is checked against the modules on the
    same inputs (which write the same keys and values to the same cache slots again), bit for bit, and the requests'
    tokens are the modules' too."""
    from test_continuous_batching import PROMPTS as REQUESTS, generate_batch

    model = tiny_model(attn_implementation="sdpa")
    if table_dtype:
        model.quantize_tables(table_dtype)
    step, checked, nested = decode_layer.decode_layer_step, [], [False]

    def checking(layer, hidden, mask, position_embeddings, cache, kwargs):
        if nested[0]:
            return None
        out = step(layer, hidden, mask, position_embeddings, cache, dict(kwargs))
        if out is not None:
            nested[0] = True
            expected = layer(hidden, attention_mask=mask, position_embeddings=position_embeddings,
                             past_key_values=cache, **kwargs)
            nested[0] = False
            checked.append((hidden.shape[1], torch.equal(out, expected)))
        return out

    monkeypatch.setattr(modeling, "decode_layer_step", checking)
    fast = generate_batch(model)
    assert checked and all(same for _, same in checked)
    steps = {tokens for tokens, _ in checked}
    requests = len(REQUESTS)  # a decode step has at most one token of each
    assert min(steps) <= requests
    if table_dtype is None:  # and steps with a prompt's tokens (int8 lookups of more than a few tokens take FBGEMM)
        assert max(steps) > requests
    modules_only(monkeypatch)
    assert generate_batch(model) == fast


def compiled_generate(model, graphs: list, hook=None, **kwargs):
    """`generate` over a static cache with `model.forward` compiled fullgraph by Dynamo; each graph it captures runs
    as traced (no Inductor: the same ops as the eager step) and is recorded in `graphs` as its calls' targets. With
    `hook`, it is called after a first `generate` and the result is a second one's."""
    def recording(gm, inputs):
        graphs.append([node.target for node in gm.graph.nodes if node.op == "call_function"])
        return gm.forward

    torch._dynamo.reset()
    forward = model.forward
    model.forward = torch.compile(forward, fullgraph=True, backend=recording)
    try:
        out = generate(model, cache_implementation="static", disable_compile=True, **kwargs)
        if hook is not None:  # a change between two calls of the same compiled forward
            hook()
            out = generate(model, cache_implementation="static", disable_compile=True, **kwargs)
        return out
    finally:
        model.forward = forward
        torch._dynamo.reset()


def fused_calls(graph: list) -> dict:
    """How often a graph calls each of the ops (as an overload packet or its default overload)."""
    names = list(map(str, graph))
    return {name: names.count(f"memoryformer.{name}") + names.count(f"memoryformer.{name}.default")
            for name in ("decode_stack_static", "decode_qkv", "decode_block", "hash", "lookup")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_compiled_decode_step_runs_the_fused_ops_as_graph_nodes(monkeypatch, dtype):
    """Under torch.compile (transformers' compiled step over a static cache) the decode step's graph holds one
    decode_stack_static (decode_stack_traced), or where that is off each layer's decode_qkv and decode_block
    (decode_layer_traced), instead of the Memory Layers' hashes and lookups; each gives the tokens and scores of the
    modules over the same cache, bit for bit. The prefill's graph runs the modules."""
    model = tiny_model(attn_implementation="sdpa").to(dtype)
    layers, graphs = model.config.num_hidden_layers, []
    stacked = compiled_generate(model, graphs)
    prefill, decode = map(fused_calls, graphs)  # one graph per sequence length (7, then 1)
    assert prefill == dict(decode_stack_static=0, decode_qkv=0, decode_block=0, hash=3 * layers, lookup=3 * layers)
    assert decode == dict(decode_stack_static=1, decode_qkv=0, decode_block=0, hash=0, lookup=0)
    monkeypatch.setattr(modeling, "decode_stack_traced", lambda *args, **kwargs: None)
    graphs.clear()
    per_layer = compiled_generate(model, graphs)
    assert fused_calls(graphs[1]) == dict(decode_stack_static=0, decode_qkv=layers, decode_block=layers, hash=0,
                                          lookup=0)
    modules_only(monkeypatch)
    monkeypatch.setattr(modeling, "decode_layer_traced", lambda *args, **kwargs: None)
    graphs.clear()
    modules = compiled_generate(model, graphs)
    assert fused_calls(graphs[1]) == dict(decode_stack_static=0, decode_qkv=0, decode_block=0, hash=3 * layers,
                                          lookup=3 * layers)
    assert all(torch.equal(a, b) for a, b in zip(stacked, modules))
    assert all(torch.equal(a, b) for a, b in zip(per_layer, modules))
    assert all(torch.equal(a, b) for a, b in zip(stacked, generate(model, cache_implementation="static")))


def test_a_compiled_decode_step_leaves_a_hooked_layer_to_the_modules(monkeypatch):
    """A hook on a submodule (which the fused ops would skip) keeps that layer's modules in the graph, and the hook
    sees every step; the tokens are still the modules'. (A hook added after compiling is not seen, by this path or by
    the modules: torch's `skip_nnmodule_hook_guards`, on by default, leaves hooks unguarded.)"""
    model = tiny_model(attn_implementation="sdpa")
    layers, graphs, seen = model.config.num_hidden_layers, [], []
    model.model.layers[1].memory_block.layer1.register_forward_hook(lambda *args: seen.append(1))
    fast = compiled_generate(model, graphs)
    assert fused_calls(graphs[1]) == dict(decode_stack_static=0, decode_qkv=layers - 1, decode_block=layers - 1,
                                          hash=3, lookup=3)  # the stack steps aside; the other layers still fuse
    assert len(seen) == NEW  # the prefill and every decode step
    modules_only(monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(fast, generate(model, cache_implementation="static")))


def test_a_compiled_decode_step_follows_a_cast_model():
    """Dynamo's guards on the operands decode_stack_traced read (the tensors' dtypes) compile the step again after a
    cast, so the fused op never reads the old tensors: the tokens after `.to(bfloat16)` are the bfloat16 eager ones."""
    model = tiny_model(attn_implementation="sdpa")
    graphs = []

    def cast_model():
        model.to(torch.bfloat16)
        vars(model).pop("_cache", None)  # transformers 5.10's generate keeps its StaticCache here, dtype unchecked

    cast = compiled_generate(model, graphs, hook=cast_model)
    assert len(graphs) == 4  # prefill and decode step, before and after the cast
    assert fused_calls(graphs[3])["decode_stack_static"] == 1
    assert all(torch.equal(a, b) for a, b in zip(cast, generate(model, cache_implementation="static")))


def test_the_static_stack_relies_on_the_release_s_static_layer_and_refuses_a_full_buffer(monkeypatch):
    """What decode_stack_static does in StaticLayer.update's place, checked against the release's own layer (the trial
    says False for an update that writes elsewhere); and a buffer with no position left is refused with the fix."""
    from transformers.cache_utils import StaticLayer

    from modeling_memoryformer import transformers_compat

    assert transformers_compat.static_cache_writes_at_length()
    update = StaticLayer.update

    def shifted(self, key_states, value_states, *args, **kwargs):  # one position further than the release's
        self.cumulative_length.add_(1)
        return update(self, key_states, value_states, *args, **kwargs)

    transformers_compat.static_cache_writes_at_length.cache_clear()
    monkeypatch.setattr(StaticLayer, "update", shifted)
    try:
        assert not transformers_compat.static_cache_writes_at_length()
    finally:
        transformers_compat.static_cache_writes_at_length.cache_clear()
    model = tiny_model(attn_implementation="sdpa")
    plan = decode_layer._Plan(torch.float32)
    tensors, floats, ints, heads, scaling, head_dim, count = decode_layer._stack_operands(plan, model.model)
    x = torch.randn(1, model.config.hidden_size)
    cos, sin = model.model.rotary_emb(x[None], torch.tensor([[3]]))
    keys = [torch.zeros(1, heads, 4, head_dim) for _ in range(count)]
    values = [torch.zeros(1, heads, 4, head_dim) for _ in range(count)]
    lengths = [torch.tensor(3) for _ in range(count)]
    torch.ops.memoryformer.decode_stack_static(x, keys, values, lengths, None, cos, sin, heads, scaling, tensors,
                                               floats, ints)
    assert all(int(n) == 4 for n in lengths) and all(k[:, :, 3].abs().sum() > 0 for k in keys)
    assert all(not k[:, :, :3].any() for k in keys)  # only the position at the length is written
    lengths[0] = torch.tensor(2)  # the first layer has room, the others not: nothing may be written
    before = [k.clone() for k in keys]
    with pytest.raises(RuntimeError, match="layer 1 has 4 of its 4 positions written: no room.*max_cache_len"):
        torch.ops.memoryformer.decode_stack_static(x, keys, values, lengths, None, cos, sin, heads, scaling, tensors,
                                                   floats, ints)
    assert all(torch.equal(a, b) for a, b in zip(keys, before)) and int(lengths[0]) == 2
