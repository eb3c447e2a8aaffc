"""Capabilities declared as they are.

The model classes' capability flags and what backs each one:
- `_supports_sdpa = True`: test_modeling.py::test_eager_equals_sdpa_float32 (and generation with sdpa).
- `supports_gradient_checkpointing = True`: test_modeling.py::test_gradient_checkpointing_gives_the_same_gradients.
- `_can_record_outputs`: test_modeling.py output_hidden_states / output_attentions tests, and the signature test
  here (transformers sees output_attentions through `**kwargs: Unpack[TransformersKwargs]`).
- `_supports_attention_backend = True`: a registered attention function and mask replace the model's (below).
- `_can_compile_fullgraph = True`: `generate` with a static cache compiled fullgraph gives eager's tokens (below).
- `_supports_flash_attn = False`, `_supports_flex_attn = False`: transformers refuses them (below).
- `_supports_context_parallel = False`: not tested on several ranks, so not declared.
"""

import inspect
import typing

import pytest
import torch
from transformers import AttentionInterface, CompileConfig
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from conftest import require_kernel, tiny_model
from modeling_memoryformer import compiled_decode_kwargs, configuration_memoryformer, memory_ops, modeling_memoryformer
from modeling_memoryformer.modeling_memoryformer import (
    MemoryFormerAttention,
    MemoryFormerDecoderLayer,
    MemoryFormerForCausalLM,
    MemoryFormerModel,
    MemoryFormerPreTrainedModel,
)

PROMPT = torch.tensor([[3, 14, 15, 92, 65, 35]])


@pytest.mark.parametrize("module", [modeling_memoryformer, configuration_memoryformer])
def test_model_files_keep_real_annotations(module):
    """No `from __future__ import annotations`: annotations are objects that transformers can inspect."""
    source = inspect.getsource(module)
    assert "from __future__ import annotations" not in source
    assert not hasattr(module, "annotations")


@pytest.mark.parametrize("cls", [MemoryFormerModel, MemoryFormerForCausalLM, MemoryFormerDecoderLayer, MemoryFormerAttention])
def test_forward_kwargs_are_unpack_transformers_kwargs(cls):
    """The check transformers makes on a forward: its `**kwargs` is annotated `Unpack[TransformersKwargs]` (an object,
    not a string), so output_attentions / output_hidden_states are accepted model inputs."""
    forward = inspect.unwrap(cls.forward)
    kwargs = inspect.signature(forward).parameters["kwargs"]
    assert kwargs.kind is inspect.Parameter.VAR_KEYWORD
    assert not isinstance(kwargs.annotation, str)
    assert typing.get_origin(kwargs.annotation) is Unpack
    assert typing.get_args(kwargs.annotation) == (TransformersKwargs,)
    assert {"output_attentions", "output_hidden_states"} <= TransformersKwargs.__optional_keys__
    typing.get_type_hints(forward)  # every annotation resolves at runtime
    # The same for the signature as transformers reads it (through the decorators).
    assert inspect.signature(cls.forward).parameters["kwargs"].annotation == Unpack[TransformersKwargs]


def test_generate_accepts_output_attentions_and_returns_them():
    """`generate` validates its kwargs against the forward's signature and TransformersKwargs."""
    model = tiny_model(attn_implementation="eager")
    out = model.generate(PROMPT, max_new_tokens=3, do_sample=False, output_attentions=True,
                         output_hidden_states=True, return_dict_in_generate=True)
    assert len(out.attentions) == 3 and len(out.attentions[0]) == model.config.num_hidden_layers
    assert out.attentions[0][0].shape[-1] == PROMPT.shape[1]
    assert len(out.hidden_states[0]) == model.config.num_hidden_layers + 1


def test_declared_flags():
    cls = MemoryFormerPreTrainedModel
    assert cls._supports_sdpa and cls._supports_attention_backend and cls._can_compile_fullgraph
    assert cls.supports_gradient_checkpointing
    assert not cls._supports_flash_attn and not cls._supports_flex_attn and not cls._supports_context_parallel
    assert not getattr(tiny_model(), "supports_context_parallel", False)  # the property exists from transformers 5.19


@pytest.mark.parametrize("implementation", ["flex_attention", "flash_attention_2"])
def test_unsupported_attention_implementations_are_refused(implementation):
    with pytest.raises((ValueError, ImportError)):
        tiny_model(attn_implementation=implementation)


def test_registered_attention_backend_is_used():
    """`_supports_attention_backend`: an attention function and a mask registered with transformers' interfaces are
    called by every layer, receive the module and the kwargs, and give what sdpa gives."""
    calls = []

    def recording_attention(module, query, key, value, attention_mask, **kwargs):
        calls.append((module.layer_idx, kwargs.get("mf_marker")))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("mf_recording", recording_attention)
    AttentionMaskInterface.register("mf_recording", sdpa_mask)
    model = tiny_model(attn_implementation="sdpa")
    expected = model(PROMPT).logits
    model.set_attn_implementation("mf_recording")
    assert model.config._attn_implementation == "mf_recording"
    got = model(PROMPT, mf_marker="seen").logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert calls == [(i, "seen") for i in range(model.config.num_hidden_layers)]
    # logits_to_keep as a tensor of positions (what serving backends pass)
    kept = model(PROMPT, logits_to_keep=torch.tensor([1, 4])).logits
    torch.testing.assert_close(kept, expected[:, [1, 4]], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["fused", "torch"])
def test_static_cache_generate_compiled_fullgraph_matches_eager(kernel):
    """`_can_compile_fullgraph`: greedy tokens with a StaticCache, (a) compiled automatically by `generate` with a
    fullgraph CompileConfig (aot_eager, and Inductor through `compiled_decode_kwargs`), (b) with `model.forward`
    compiled fullgraph, equal eager's (DynamicCache) tokens in float32."""
    require_kernel(kernel)
    torch._dynamo.reset()
    model = tiny_model()
    with memory_ops.use_kernel(kernel):
        eager = model.generate(PROMPT, max_new_tokens=6, do_sample=False)
        static = model.generate(PROMPT, max_new_tokens=6, do_sample=False, cache_implementation="static",
                                disable_compile=True)
        config = CompileConfig(fullgraph=True, backend="aot_eager")
        config._compile_all_devices = True  # transformers compiles automatically on GPUs only unless asked
        auto = model.generate(PROMPT, max_new_tokens=6, do_sample=False, cache_implementation="static",
                              compile_config=config)
        assert hasattr(model, "_compiled_call")  # generate did compile the decoding step
        torch._dynamo.reset()
        inductor = model.generate(PROMPT, max_new_tokens=6, do_sample=False, **compiled_decode_kwargs())
        model.forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
        compiled = model.generate(PROMPT, max_new_tokens=6, do_sample=False, cache_implementation="static",
                                  disable_compile=True)
    torch._dynamo.reset()
    assert torch.equal(static, eager)
    assert torch.equal(auto, eager)
    assert torch.equal(inductor, eager)  # the documented fast path (Inductor's C++ on the CPU), float32
    assert torch.equal(compiled, eager)


class _Passthrough(torch.nn.Module):
    """What a pipeline stage puts where a module lives on another stage (vLLM's PPMissingLayer): the input as is."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def test_the_pipeline_plan_splits_the_model_into_stages_that_chain_to_the_whole():
    """`base_model_pp_plan` (read by vLLM's pipeline parallelism) names the base model's stages; two stages that each
    run half the layers, the first without the final norm and the second from the first's hidden states, give the
    whole forward's hidden states bit for bit."""
    from conftest import tiny_model

    model = tiny_model(num_hidden_layers=4).model
    plan = model.config.base_model_pp_plan
    assert model._pp_plan == plan and all(hasattr(model, name) for name in plan)
    ids = torch.tensor([[5, 17, 90, 42, 8, 63, 12]])
    with torch.no_grad():
        whole = model(ids).last_hidden_state
        layers, norm = model.layers, model.norm
        model.layers = torch.nn.ModuleList([*layers[:2], _Passthrough(), _Passthrough()])
        model.norm = _Passthrough()
        first = model(ids).last_hidden_state
        model.layers, model.norm = torch.nn.ModuleList([_Passthrough(), _Passthrough(), *layers[2:]]), norm
        second = model(inputs_embeds=first).last_hidden_state
    assert torch.equal(second, whole) and not torch.equal(first, whole)
