"""The HF model classes: outputs, loss, attention backends, options, init, save/load and the Auto classes.

The strongest oracle here is `naive_logits`: the whole MemoryFormer forward (paper section 2.4) written out in float64
from the model's parameters, with its own rotary embedding, causal softmax attention and norms; the Memory Layers
use `memory_lookup_reference`, itself checked against a per-token loop in test_memory_layer.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

from modeling_memoryformer import (
    MemoryBlock,
    MemoryFormerConfig,
    MemoryFormerForCausalLM,
    MemoryFormerModel,
    MemoryLayer,
)
from modeling_memoryformer.memory_ops import memory_lookup_reference

from conftest import TINY, checkpointing_enable, tiny_config, tiny_model


# ---------------------------------------------------------------------------------------------------------------------
# The float64 oracle: the paper's section 2.4, written out.
def _norm(module, h, kind):
    h = h.double()
    w = module.weight.double()
    if kind == "rmsnorm":
        return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + module.variance_epsilon) * w
    mean = h.mean(-1, keepdim=True)
    var = (h - mean).pow(2).mean(-1, keepdim=True)
    return (h - mean) / torch.sqrt(var + module.eps) * w + module.bias.double()


def _memory_layer(layer, h):
    bias = None if layer.bias is None else layer.bias.double()
    return memory_lookup_reference(h, layer.tables.double(), bias, layer.hash_bits, layer.score, layer.temperature)


def rotary_angles(positions, rotary_dim, theta, dtype=torch.float64):
    """pos * theta^(-2i/r) for i < r/2, computed in `dtype`."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=dtype) / rotary_dim)
    return positions.to(dtype)[:, None] * inv_freq[None, :]  # [s, r/2]


def _rope(t, positions, rotary_dim, theta):
    """GPT-NeoX rotary on the first rotary_dim dims: pairs (i, i + rotary_dim/2) rotate by pos * theta^(-2i/r).

    The angles, cos and sin are computed in float32 as transformers does for every model (and as the model under test
    does); `test_rotary_embedding_matches_float64_formula` checks that rounding against float64 separately.
    """
    half = rotary_dim // 2
    angle = rotary_angles(positions, rotary_dim, theta, torch.float32)
    cos, sin = angle.cos().double(), angle.sin().double()
    x1, x2 = t[..., :half], t[..., half:rotary_dim]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, t[..., rotary_dim:]], dim=-1)


def naive_logits(model: MemoryFormerForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    config = model.config
    d, heads = config.hidden_size, config.num_attention_heads
    head_dim = d // heads
    rotary_dim = int(head_dim * config.rope_parameters["partial_rotary_factor"])
    theta = config.rope_parameters["rope_theta"]
    batch, seq = input_ids.shape
    positions = torch.arange(seq)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()

    x = model.model.embed_tokens.weight.double()[input_ids]  # [b, s, d]
    for layer in model.model.layers:
        def attention(h, layer=layer):
            qkv = _memory_layer(layer.attention.query_key_value, h)  # [b, s, 3d]: [Q | K | V]
            q, k, v = (t.reshape(batch, seq, heads, head_dim).transpose(1, 2) for t in qkv.split(d, dim=-1))
            q, k = _rope(q, positions, rotary_dim, theta), _rope(k, positions, rotary_dim, theta)
            scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
            weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
            out = (weights @ v).transpose(1, 2).reshape(batch, seq, d)
            if config.attention_output == "memory":
                out = _memory_layer(layer.attention.dense, out)
            return out

        def memory_block(h, layer=layer):
            block = layer.memory_block
            inner = _memory_layer(block.layer1, h)
            if config.memory_block_activation == "gelu":
                inner = 0.5 * inner * (1 + torch.erf(inner / math.sqrt(2)))
            return _memory_layer(block.layer2, _norm(block.norm, inner, "layernorm"))

        if config.use_parallel_residual:
            x = x + attention(_norm(layer.input_layernorm, x, config.norm_type)) + memory_block(
                _norm(layer.post_attention_layernorm, x, config.norm_type)
            )
        else:
            x = x + attention(_norm(layer.input_layernorm, x, config.norm_type))
            x = x + memory_block(_norm(layer.post_attention_layernorm, x, config.norm_type))
    x = _norm(model.model.norm, x, config.norm_type)
    return x @ model.lm_head.weight.double().T


def test_rotary_embedding_matches_float64_formula(model):
    """cos/sin of the model's rotary embedding (float32, as transformers computes it) vs the float64 formula."""
    positions = torch.arange(100)[None]
    cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float64), positions)
    rotary_dim = int(16 * 0.25)
    assert cos.shape == sin.shape == (1, 100, rotary_dim)
    angle = rotary_angles(positions[0], rotary_dim, 10000.0)
    torch.testing.assert_close(cos[0], torch.cat([angle.cos()] * 2, -1), rtol=0, atol=2e-5)
    torch.testing.assert_close(sin[0], torch.cat([angle.sin()] * 2, -1), rtol=0, atol=2e-5)


VARIANTS = {
    "default": {},
    "parallel_residual": {"use_parallel_residual": True},
    "rmsnorm_gelu_memory_output": {"norm_type": "rmsnorm", "memory_block_activation": "gelu",
                                   "attention_output": "memory"},
    "l1_score_temperature_no_bias": {"hash_score": "l1", "hash_temperature": 0.5, "memory_bias": False},
    "tau8_e1_rotary_half": {"hash_bits": 8, "expand_bits": 1,
                            "rope_parameters": {"rope_theta": 100.0, "partial_rotary_factor": 0.5}},
}


@pytest.mark.parametrize("overrides", VARIANTS.values(), ids=VARIANTS.keys())
def test_model_matches_naive_float64_forward(kernel, overrides, input_ids):
    model = tiny_model(dtype=torch.float64, **overrides)
    if model.config.memory_bias:
        with torch.no_grad():  # non-zero biases, so that they are checked too
            for module in model.modules():
                if isinstance(module, MemoryLayer):
                    module.bias.normal_(std=0.1)
    logits = model(input_ids).logits
    assert logits.dtype == torch.float64
    torch.testing.assert_close(logits, naive_logits(model, input_ids), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("overrides", [VARIANTS["default"], VARIANTS["tau8_e1_rotary_half"]],
                         ids=["default", "rotary_half"])
def test_inference_rotates_q_and_k_in_place_with_the_same_result(kernel, overrides, input_ids):
    """Without autograd the rotary embedding is applied inside the Q/K/V layer's output (no new q and k tensors):
    the float64 oracle still holds, and the logits equal those of the copying path (autograd on) bit for bit."""
    model = tiny_model(dtype=torch.float64, **overrides)
    with torch.inference_mode():
        in_place = model(input_ids).logits
    torch.testing.assert_close(in_place, naive_logits(model, input_ids), rtol=1e-10, atol=1e-10)
    copied = model(input_ids).logits  # parameters require grad: q and k are new tensors
    assert copied.requires_grad and torch.equal(in_place, copied.detach())


def test_a_hook_on_the_qkv_layer_sees_its_output_unrotated(input_ids):
    """A forward hook that keeps the Q/K/V layer's output must find it as the layer returned it."""
    model = tiny_model()
    kept = []
    handle = model.model.layers[0].attention.query_key_value.register_forward_hook(
        lambda module, args, output: kept.append((output, output.clone())))
    with torch.no_grad():
        model(input_ids)
    handle.remove()
    output, snapshot = kept[0]
    assert torch.equal(output, snapshot)


def test_in_place_rotation_equals_apply_rotary_pos_emb():
    from modeling_memoryformer.modeling_memoryformer import apply_rotary_pos_emb, apply_rotary_pos_emb_

    qkv = torch.randn(2, 7, 3 * 4 * 16, dtype=torch.float64)
    q, k, _ = (t.view(2, 7, 4, 16).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    angle = torch.randn(2, 7, 3, dtype=torch.float64)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    expected = apply_rotary_pos_emb(q, k, cos, sin)
    q_pass, k_pass = q[..., 6:].clone(), k[..., 6:].clone()
    rotated = apply_rotary_pos_emb_(q, k, cos, sin)
    assert rotated[0] is q and rotated[1] is k  # views of qkv, rewritten in place
    assert torch.equal(q, expected[0]) and torch.equal(k, expected[1])
    assert torch.equal(q[..., 6:], q_pass) and torch.equal(k[..., 6:], k_pass)


# ---------------------------------------------------------------------------------------------------------------------
# Outputs and loss
def test_output_shapes(model, input_ids):
    out = model(input_ids)
    assert out.logits.shape == (2, 11, TINY["vocab_size"])
    assert out.past_key_values is not None and out.past_key_values.get_seq_length() == 11
    base = model.model(input_ids)
    assert base.last_hidden_state.shape == (2, 11, TINY["hidden_size"])
    assert model(input_ids, use_cache=False).past_key_values is None


def test_labels_give_the_shifted_cross_entropy(model, input_ids):
    labels = input_ids.clone()
    labels[0, 3] = -100
    labels[1, 7:] = -100
    out = model(input_ids, labels=labels)
    logits = out.logits.double()[:, :-1]  # position t predicts token t + 1
    targets = labels[:, 1:]
    valid = targets != -100
    log_norm = torch.logsumexp(logits, dim=-1)
    target_logit = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    expected = ((log_norm - target_logit) * valid).sum() / valid.sum()
    assert out.loss.shape == ()
    torch.testing.assert_close(out.loss.double(), expected, rtol=1e-5, atol=1e-6)


def test_logits_to_keep_1_equals_last_position(model, input_ids):
    full = model(input_ids).logits
    last = model(input_ids, logits_to_keep=1).logits
    assert last.shape == (2, 1, TINY["vocab_size"])
    # Same hidden state; only the LM-head matmul sees another shape, so allow float32 rounding.
    torch.testing.assert_close(last, full[:, -1:], rtol=1e-5, atol=1e-5)
    assert torch.equal(last.argmax(-1), full[:, -1:].argmax(-1))


def test_inputs_embeds_path_equals_input_ids_path(model, input_ids):
    embeds = model.get_input_embeddings()(input_ids)
    torch.testing.assert_close(model(inputs_embeds=embeds).logits, model(input_ids).logits, rtol=0, atol=0)
    with pytest.raises(ValueError):
        model(input_ids=input_ids, inputs_embeds=embeds)


def test_output_hidden_states_gives_num_layers_plus_one(model, input_ids):
    captured = []
    hooks = [layer.register_forward_hook(lambda m, i, o: captured.append(o)) for layer in model.model.layers]
    out = model(input_ids, output_hidden_states=True)
    for hook in hooks:
        hook.remove()
    hidden = out.hidden_states
    assert len(hidden) == TINY["num_hidden_layers"] + 1
    assert all(h.shape == (2, 11, TINY["hidden_size"]) for h in hidden)
    assert torch.equal(hidden[0], model.model.embed_tokens(input_ids))
    assert torch.equal(hidden[1], captured[0])  # output of the first block
    # The last entry is the final-normed state (the transformers convention, as GPT-NeoX / Llama).
    torch.testing.assert_close(hidden[-1], model.model.norm(captured[-1]), rtol=0, atol=0)


def test_output_attentions_eager_are_causal_probabilities(input_ids):
    model = tiny_model(attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    attentions = model(input_ids, output_attentions=True).attentions
    assert len(attentions) == TINY["num_hidden_layers"]
    seq = input_ids.shape[1]
    future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    for weights in attentions:
        assert weights.shape == (2, TINY["num_attention_heads"], seq, seq)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, TINY["num_attention_heads"], seq))
        assert torch.all(weights[..., future] == 0)
        assert torch.all(weights[..., ~future] > 0)
    # Not uniform: the weights depend on the tokens (otherwise the test could not see a wrong mask).
    assert attentions[0][..., -1, :].std() > 1e-3


def test_return_dict_false_gives_a_tuple(model, input_ids):
    as_tuple = model(input_ids, labels=input_ids, return_dict=False)
    as_output = model(input_ids, labels=input_ids)
    assert isinstance(as_tuple, tuple)
    assert torch.equal(as_tuple[0], as_output.loss)
    assert torch.equal(as_tuple[1], as_output.logits)
    base = model.model(input_ids, return_dict=False)
    assert isinstance(base, tuple) and torch.equal(base[0], model.model(input_ids).last_hidden_state)


def test_eager_equals_sdpa_float32(input_ids):
    model = tiny_model(attn_implementation="eager")
    eager = model(input_ids).logits
    model.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == "sdpa"
    sdpa = model(input_ids).logits
    torch.testing.assert_close(sdpa, eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(sdpa.argmax(-1), eager.argmax(-1))
    # A model built for sdpa from the start computes the same thing.
    built_sdpa = tiny_model(attn_implementation="sdpa")
    torch.testing.assert_close(built_sdpa(input_ids).logits, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_right_padding_does_not_change_the_real_tokens(attn_implementation, input_ids):
    model = tiny_model(attn_implementation=attn_implementation)
    mask = torch.ones_like(input_ids)
    mask[1, 8:] = 0
    batched = model(input_ids, attention_mask=mask).logits
    alone = model(input_ids[1:, :8]).logits
    torch.testing.assert_close(batched[1:, :8], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batched[:1], model(input_ids[:1]).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:.*(gradient|activation)_checkpointing.*:FutureWarning")
def test_gradient_checkpointing_gives_the_same_gradients(input_ids):
    def grads(checkpointing: bool):
        model = tiny_model().train()
        if checkpointing:
            checkpointing_enable(model)
            assert all(layer.gradient_checkpointing for layer in model.model.layers)
        calls = []
        block = model.model.layers[0].memory_block
        block.forward = lambda h, _forward=block.forward: calls.append(1) or _forward(h)
        loss = model(input_ids, labels=input_ids, use_cache=False).loss
        forwards = len(calls)
        loss.backward()
        recomputed = len(calls) - forwards
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, recomputed

    loss_plain, grads_plain, recomputed_plain = grads(False)
    loss_ckpt, grads_ckpt, recomputed_ckpt = grads(True)
    assert recomputed_plain == 0 and recomputed_ckpt == 1  # the block really was recomputed in backward
    torch.testing.assert_close(loss_ckpt, loss_plain, rtol=0, atol=0)
    assert grads_ckpt.keys() == grads_plain.keys()
    assert any(name.endswith("tables") for name in grads_plain)
    for name in grads_plain:
        torch.testing.assert_close(grads_ckpt[name], grads_plain[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
def test_training_step_reduces_the_loss(input_ids):
    model = tiny_model(table_init_std=0.02, initializer_range=0.02).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        loss = model(input_ids, labels=input_ids).loss
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[-1] < losses[0] - 0.05


@pytest.mark.parametrize("field", ["hidden_dropout", "attention_dropout"])
def test_dropout_fields_act_in_training_only(field, input_ids):
    model = tiny_model(attn_implementation="eager", **{field: 0.5})
    torch.testing.assert_close(model(input_ids).logits, model(input_ids).logits, rtol=0, atol=0)
    model.train()
    torch.manual_seed(1)
    first = model(input_ids).logits
    torch.manual_seed(2)
    second = model(input_ids).logits
    assert not torch.allclose(first, second)


# ---------------------------------------------------------------------------------------------------------------------
# Structure and options
def _linear_names(model):
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]


@pytest.mark.parametrize("attention_output", ["none", "memory"])
def test_only_dense_layer_is_the_lm_head(attention_output):
    model = tiny_model(attention_output=attention_output)
    assert _linear_names(model) == ["lm_head"]
    assert _linear_names(model.model) == []
    memory_layers = [m for m in model.modules() if isinstance(m, MemoryLayer)]
    per_block = 4 if attention_output == "memory" else 3  # fused QKV, [output], Memory Block layer 1 and 2
    assert len(memory_layers) == per_block * TINY["num_hidden_layers"]


def test_attention_output_memory_adds_a_d_to_d_memory_layer(input_ids):
    plain = tiny_model()
    model = tiny_model(attention_output="memory")
    assert plain.model.layers[0].attention.dense is None
    dense = model.model.layers[0].attention.dense
    assert isinstance(dense, MemoryLayer)
    assert (dense.in_features, dense.out_features, dense.hash_bits) == (64, 64, 4)
    assert dense.tables.shape == (16 * 2**4, 64)
    # It is used: changing its tables changes the output.
    before = model(input_ids).logits
    with torch.no_grad():
        dense.tables.mul_(2.0)
    assert not torch.allclose(model(input_ids).logits, before)


def test_memory_layer_shapes_follow_the_config():
    model = tiny_model(hash_bits=8, expand_bits=1, hash_score="l1", hash_temperature=0.5, memory_bias=False,
                       layer_norm_eps=1e-3)
    layer = model.model.layers[1]
    qkv = layer.attention.query_key_value
    assert (qkv.in_features, qkv.out_features, qkv.hash_bits, qkv.num_tables) == (64, 192, 8, 8)
    block = layer.memory_block
    assert isinstance(block, MemoryBlock)
    assert (block.layer1.in_features, block.layer1.out_features, block.layer1.hash_bits) == (64, 72, 8)
    assert (block.layer2.in_features, block.layer2.out_features, block.layer2.hash_bits) == (72, 64, 9)
    assert block.layer2.tables.shape == (8 * 2**9, 64)
    assert isinstance(block.norm, nn.LayerNorm) and block.norm.normalized_shape == (72,) and block.norm.eps == 1e-3
    for memory_layer in (qkv, block.layer1, block.layer2):
        assert memory_layer.score == "l1" and memory_layer.temperature == 0.5 and memory_layer.bias is None
    assert layer.input_layernorm.eps == 1e-3


def test_norm_type_rmsnorm_uses_an_rmsnorm(input_ids):
    model = tiny_model(norm_type="rmsnorm")
    norms = [model.model.layers[0].input_layernorm, model.model.layers[0].post_attention_layernorm, model.model.norm]
    for norm in norms:
        assert "RMSNorm" in type(norm).__name__
        assert not isinstance(norm, nn.LayerNorm)
        assert [name for name, _ in norm.named_parameters()] == ["weight"]
        with torch.no_grad():
            norm.weight.normal_()
        h = torch.randn(3, 5, 64) * 3 + 1
        expected = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
        torch.testing.assert_close(norm(h), expected)
    # In float64 it computes in float64 (no round trip through float32).
    norm = norms[0].double()
    h = torch.randn(4, 64, dtype=torch.float64) * 3 + 1
    expected = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    assert norm(h).dtype == torch.float64
    torch.testing.assert_close(norm(h), expected, rtol=1e-13, atol=1e-13)
    # The norm inside the Memory Block stays a LayerNorm (it re-centres what layer 2 hashes).
    assert isinstance(model.model.layers[0].memory_block.norm, nn.LayerNorm)
    assert all(isinstance(n, nn.LayerNorm) for n in (tiny_model().model.layers[0].input_layernorm,
                                                      tiny_model().model.norm))


@pytest.mark.parametrize(
    "overrides",
    [{"use_parallel_residual": True}, {"norm_type": "rmsnorm"}, {"memory_block_activation": "gelu"},
     {"hash_score": "l1"}, {"hash_temperature": 0.25}],
    ids=lambda o: next(iter(o)),
)
def test_option_changes_the_function_with_the_same_weights(overrides, input_ids):
    base = tiny_model()
    variant = tiny_model(**overrides)
    missing, unexpected = variant.load_state_dict(base.state_dict(), strict=False)
    assert missing == []
    assert all(k.endswith("layernorm.bias") or k == "model.norm.bias" for k in unexpected)  # RMSNorm has no bias
    reference, changed = base(input_ids).logits, variant(input_ids).logits
    assert torch.isfinite(changed).all()
    assert (changed - reference).abs().max() > 1e-3


@pytest.mark.parametrize("parallel", [False, True], ids=["sequential", "parallel"])
def test_decoder_layer_residual_formula(parallel, input_ids):
    """Recompute one decoder layer from its submodules: sequential h = x + A(N1 x); y = h + MB(N2 h);
    parallel y = x + A(N1 x) + MB(N2 x)."""
    model = tiny_model(use_parallel_residual=parallel)
    layer = model.model.layers[1]
    seen = {}

    def capture(module, args, kwargs, output):
        seen["x"], seen["kwargs"], seen["y"] = args[0], kwargs, output

    hook = layer.register_forward_hook(capture, with_kwargs=True)
    model(input_ids)
    hook.remove()
    x, kwargs = seen["x"], seen["kwargs"]

    def attention(h):
        return layer.attention(h, attention_mask=kwargs["attention_mask"],
                               position_embeddings=kwargs["position_embeddings"])[0]

    if parallel:
        expected = x + attention(layer.input_layernorm(x)) + layer.memory_block(layer.post_attention_layernorm(x))
    else:
        h = x + attention(layer.input_layernorm(x))
        expected = h + layer.memory_block(layer.post_attention_layernorm(h))
    torch.testing.assert_close(seen["y"], expected, rtol=1e-6, atol=1e-6)
    # The Memory Block itself: layer 2 (LayerNorm (layer 1 (h))).
    h = torch.randn(2, 3, 64)
    block = layer.memory_block
    torch.testing.assert_close(block(h), block.layer2(block.norm(block.layer1(h))), rtol=0, atol=0)


def test_no_split_modules_names_the_decoder_layer_class(model):
    names = MemoryFormerForCausalLM._no_split_modules
    assert names == ["MemoryFormerDecoderLayer"]
    assert {type(layer).__name__ for layer in model.model.layers} == set(names)


def test_word_embeddings_are_untied_by_default_and_can_be_tied(input_ids):
    model = tiny_model()
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    tied = tiny_model(tie_word_embeddings=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    torch.testing.assert_close(tied(input_ids).logits,
                               tied.model(input_ids).last_hidden_state @ tied.model.embed_tokens.weight.T)


# ---------------------------------------------------------------------------------------------------------------------
# Initialisation
def test_init_uses_table_init_std_and_initializer_range():
    torch.manual_seed(0)
    model = MemoryFormerForCausalLM(tiny_config(table_init_std=0.3, initializer_range=0.05, hidden_size=128,
                                                vocab_size=512))
    tables = torch.cat([m.tables.flatten() for m in model.modules() if isinstance(m, MemoryLayer)])
    assert abs(tables.mean().item()) < 0.01 and abs(tables.std().item() - 0.3) < 0.003
    for matrix in (model.model.embed_tokens.weight, model.lm_head.weight):
        assert abs(matrix.std().item() - 0.05) < 0.002
    for module in model.modules():
        if isinstance(module, MemoryLayer):
            assert torch.all(module.bias == 0)
        if isinstance(module, nn.LayerNorm):
            assert torch.all(module.weight == 1) and torch.all(module.bias == 0)


def _expected_inv_freq(config):
    rotary_dim = int(config.hidden_size // config.num_attention_heads * config.rope_parameters["partial_rotary_factor"])
    return 1.0 / config.rope_parameters["rope_theta"] ** (torch.arange(0, rotary_dim, 2).double() / rotary_dim)


def test_from_pretrained_meta_loading_restores_parameters_and_rotary_buffers(tmp_path, input_ids):
    model = tiny_model(rope_parameters={"rope_theta": 500.0, "partial_rotary_factor": 0.5})
    model.save_pretrained(tmp_path)
    loaded = MemoryFormerForCausalLM.from_pretrained(tmp_path).eval()
    rotary = loaded.model.rotary_emb
    expected = _expected_inv_freq(loaded.config).float()
    assert rotary.inv_freq.shape == (4,) and rotary.inv_freq.device.type == "cpu"
    torch.testing.assert_close(rotary.inv_freq, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(rotary.original_inv_freq, expected, rtol=1e-6, atol=0)
    original = dict(model.named_parameters())
    for name, parameter in loaded.named_parameters():
        assert parameter.device.type == "cpu", name
        assert torch.equal(parameter, original[name]), name
    assert torch.equal(loaded(input_ids).logits, model(input_ids).logits)


def _load_with_report(model_class, path):
    """`from_pretrained` with its loading info and the text of transformers' load report (logged as a warning)."""
    with CaptureLogger(logging.get_logger("transformers.modeling_utils")) as log:
        model, info = model_class.from_pretrained(path, output_loading_info=True)
    return model, info, log.out


def test_from_pretrained_initialises_and_reports_missing_tensors(tmp_path):
    """transformers' convention: a tensor the checkpoint lacks is initialised by `_init_weights` (a table N(0,
    table_init_std), a bias zeros), named in `missing_keys` and in transformers' load report; the rest is loaded."""
    model = tiny_model(table_init_std=0.25, hidden_size=128)
    model.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(path)
    removed = {"model.layers.0.memory_block.layer2.tables", "model.layers.1.attention.query_key_value.bias"}
    for key in removed:
        del state[key]
    save_file(state, path, metadata={"format": "pt"})
    loaded, info, report = _load_with_report(MemoryFormerForCausalLM, tmp_path)
    assert set(info["missing_keys"]) == removed and not info["unexpected_keys"]
    assert all(key in report for key in removed) and "MISSING" in report
    tables = loaded.get_parameter("model.layers.0.memory_block.layer2.tables")
    assert abs(tables.std().item() - 0.25) < 0.01 and abs(tables.mean().item()) < 0.01
    assert not torch.equal(tables, model.get_parameter("model.layers.0.memory_block.layer2.tables"))
    assert torch.all(loaded.get_parameter("model.layers.1.attention.query_key_value.bias") == 0)
    original = dict(model.named_parameters())
    for name, parameter in loaded.named_parameters():
        if name not in removed:
            assert torch.equal(parameter, original[name]), name


@pytest.mark.parametrize("tie", [False, True])
def test_a_base_model_checkpoint_loads_into_the_causal_lm_with_a_new_head(tmp_path, tie):
    """transformers' convention for a head-less (base-model) checkpoint: the base weights load, the LM head is
    initialised (N(0, initializer_range)) and reported missing, or tied to the loaded embeddings (not reported)."""
    base = tiny_model(tie_word_embeddings=tie).model
    base.save_pretrained(tmp_path)
    model, info, report = _load_with_report(MemoryFormerForCausalLM, tmp_path)
    for name, parameter in base.named_parameters():
        assert torch.equal(model.model.get_parameter(name), parameter), name
    head = model.lm_head.weight
    if tie:
        assert head is model.model.embed_tokens.weight and not info["missing_keys"]
    else:
        assert set(info["missing_keys"]) == {"lm_head.weight"} and "lm_head.weight" in report
        assert abs(head.std().item() - TINY["initializer_range"]) < 0.05 and abs(head.mean().item()) < 0.05


def test_tensors_the_model_has_no_place_for_are_reported(tmp_path):
    model = tiny_model()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["model.layers.0.attention.dense.tables"] = torch.zeros(4, 4)  # no such layer in this model
    model.save_pretrained(tmp_path)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded, info, report = _load_with_report(MemoryFormerForCausalLM, tmp_path)
    assert set(info["unexpected_keys"]) == {"model.layers.0.attention.dense.tables"} and not info["missing_keys"]
    assert "model.layers.0.attention.dense.tables" in report
    assert all(torch.equal(p, model.get_parameter(n)) for n, p in loaded.named_parameters())
    # The LM head of a causal-LM checkpoint is no foreign tensor for the head-less base model.
    model.save_pretrained(tmp_path)
    base = MemoryFormerModel.from_pretrained(tmp_path)
    assert torch.equal(base.embed_tokens.weight, model.model.embed_tokens.weight)


def test_mismatched_tables_reinitialised_on_request_use_table_init_std(tmp_path):
    """`ignore_mismatched_sizes=True` asks transformers to re-initialise tensors of another shape: tables get
    N(0, table_init_std) and zero biases, the rest is loaded."""
    model = tiny_model(table_init_std=0.25, hidden_size=128)
    model.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(path)
    mismatched = "model.layers.0.memory_block.layer2.tables"
    state[mismatched] = state[mismatched][:-1].clone()
    state["model.layers.0.memory_block.layer2.bias"] = torch.ones(3)
    save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match="size mismatch|ignore_mismatched_sizes"):
        MemoryFormerForCausalLM.from_pretrained(tmp_path)
    loaded = MemoryFormerForCausalLM.from_pretrained(tmp_path, ignore_mismatched_sizes=True)
    table = loaded.get_parameter(mismatched)
    assert torch.isfinite(table).all()
    assert abs(table.std().item() - 0.25) < 0.01 and abs(table.mean().item()) < 0.01
    assert not torch.equal(table, model.get_parameter(mismatched))
    assert torch.all(loaded.get_parameter("model.layers.0.memory_block.layer2.bias") == 0)
    assert torch.equal(loaded.get_parameter("model.layers.0.memory_block.layer1.tables"),
                       model.get_parameter("model.layers.0.memory_block.layer1.tables"))


# ---------------------------------------------------------------------------------------------------------------------
# Auto classes, save / load
def test_auto_classes_give_memoryformer_classes():
    config = AutoConfig.for_model("memoryformer", **TINY)
    assert type(config) is MemoryFormerConfig and config.hidden_size == 64
    assert type(AutoModel.from_config(config)) is MemoryFormerModel
    assert type(AutoModelForCausalLM.from_config(config)) is MemoryFormerForCausalLM


def test_save_pretrained_is_bit_exact_through_safetensors(tmp_path, input_ids):
    model = tiny_model(attention_output="memory")
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert not (tmp_path / "pytorch_model.bin").exists()
    saved = load_file(tmp_path / "model.safetensors")
    state = model.state_dict()
    assert set(saved) == set(state)
    for name, tensor in state.items():
        assert torch.equal(saved[name], tensor), name

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is MemoryFormerForCausalLM
    assert loaded.config.to_diff_dict() == model.config.to_diff_dict() | {"auto_map": loaded.config.auto_map}
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    assert torch.equal(loaded(input_ids).logits, model(input_ids).logits)


def test_auto_model_loads_the_base_model_from_a_causal_lm_folder(tmp_path, input_ids):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    base = AutoModel.from_pretrained(tmp_path).eval()
    assert type(base) is MemoryFormerModel
    assert torch.equal(base(input_ids).last_hidden_state, model.model(input_ids).last_hidden_state)
