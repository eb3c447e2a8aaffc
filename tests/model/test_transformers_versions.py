"""The model unit under every transformers release it declares (modeling_memoryformer/transformers_compat.py).

transformers 5.24 renamed the KV cache from `past_key_values` to `cache`, in what `generate` passes and in what it
reads back; a model that takes only the old name swallows the new one in `**kwargs` and generates from an empty cache
at every step. Checked here against the running release's own GPT-NeoX and `generate`, and, for a saved folder, under
the other releases whose interpreters MEMORYFORMER_OTHER_PYTHONS lists (`make test` sets it: the declared floor and
the newest release, each in its own venv).
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from packaging.specifiers import SpecifierSet
from transformers import AttentionInterface, DynamicCache, GPTNeoXConfig, GPTNeoXForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from conftest import tiny_model
from test_remote_code import WITHOUT_THE_PACKAGE, load_without_the_package


PROMPT = torch.tensor([[5, 17, 90, 42, 8, 63, 12]])
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_this_transformers_release_is_in_the_declared_range():
    requirement = re.search(r'"transformers(>=[^"]+)"', PYPROJECT.read_text(encoding="utf-8")).group(1)
    assert transformers.__version__ in SpecifierSet(requirement), (transformers.__version__, requirement)


def test_the_output_names_the_cache_as_the_running_release_does():
    """Oracle: transformers' own GPT-NeoX of this release (`past_key_values` up to 5.23, `cache` from 5.24)."""
    neox = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1,
                                            num_attention_heads=4, intermediate_size=128)).eval()
    model = tiny_model()
    with torch.no_grad():
        assert set(model(PROMPT, use_cache=True).keys()) == set(neox(PROMPT, use_cache=True).keys())
        assert set(model.model(PROMPT, use_cache=True).keys()) == set(neox.gpt_neox(PROMPT, use_cache=True).keys())


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_the_cache_is_read_under_either_name(name):
    """One token after a cached prefill, with the cache passed under each name, equals the full forward."""
    model = tiny_model()
    full = torch.cat([PROMPT, torch.tensor([[33]])], dim=-1)
    with torch.no_grad():
        expected = model(full, use_cache=False).logits[:, -1]
        cache = DynamicCache(config=model.config)
        model(PROMPT, **{name: cache}, use_cache=True)
        assert cache.get_seq_length() == PROMPT.shape[1]
        step = model(full[:, -1:], **{name: cache}, use_cache=True).logits[:, -1]
    torch.testing.assert_close(step, expected, rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == full.shape[1]


def test_two_different_caches_are_refused():
    model = tiny_model()
    with pytest.raises(ValueError, match="two different KV caches"):
        model(PROMPT, cache=DynamicCache(config=model.config), past_key_values=DynamicCache(config=model.config))
    cache = DynamicCache(config=model.config)
    model(PROMPT, cache=cache, past_key_values=cache)  # the same object under both names is fine


def _deprecation_warnings(forward, **kwargs) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            forward(PROMPT, use_cache=True, **kwargs)
    return [str(w.message) for w in caught if "`past_key_values` is deprecated" in str(w.message)]


def test_the_old_cache_name_warns_where_the_running_release_deprecates_it():
    """Oracle: the running release's own GPT-NeoX warns for `past_key_values=` where it is deprecated (5.24: `cache`
    is the name) and not where it is the name (up to 5.23). The model and its base model warn alike, once per call
    (the causal LM hands the cache on under `cache`), and stay silent for `cache=`."""
    neox = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1,
                                            num_attention_heads=4, intermediate_size=128)).eval()
    deprecated = bool(_deprecation_warnings(neox, past_key_values=DynamicCache(config=neox.config)))
    assert deprecated == ("cache" in inspect.signature(neox.forward).parameters)
    model = tiny_model()
    for forward in (model, model.model):
        found = _deprecation_warnings(forward, past_key_values=DynamicCache(config=model.config))
        assert len(found) == deprecated, found
        assert _deprecation_warnings(forward, cache=DynamicCache(config=model.config)) == []


@pytest.mark.parametrize("name", ["cache_params", "kv_cache", "cache_position", "encoder_attention_mask",
                                  "token_type_ids", "past_states"])
def test_keywords_the_model_would_ignore_are_refused(name):
    """Before, any keyword vanished into **kwargs (and reached an attention function that ignored it)."""
    model = tiny_model()
    for forward in (model, model.model):
        with pytest.raises(TypeError, match=f"unexpected keyword argument.*'{name}'"):
            forward(PROMPT, **{name: torch.zeros(1, PROMPT.shape[1], dtype=torch.long)})


def test_a_registered_attention_function_receives_its_keywords_but_never_a_cache_like_one():
    seen = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        seen.append(kwargs.get("window"))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("mf_versions_recording", recording)
    model = tiny_model(attn_implementation="sdpa")
    model.set_attn_implementation("mf_versions_recording")
    model(PROMPT, window=4)
    assert seen == [4] * model.config.num_hidden_layers
    with pytest.raises(TypeError, match="'kv_cache'"):
        model(PROMPT, kv_cache=DynamicCache(config=model.config))


def test_generation_fails_loudly_if_a_release_renames_the_cache_again():
    """What 5.24 did to models that only knew `past_key_values`, replayed with a future name: an error, not wrong
    tokens."""
    model = tiny_model()
    prepare = model.prepare_inputs_for_generation

    def renaming(*args, **kwargs):
        inputs = prepare(*args, **kwargs)
        for name in ("cache", "past_key_values"):
            if name in inputs:
                inputs["kv_cache"] = inputs.pop(name)
        return inputs

    model.prepare_inputs_for_generation = renaming
    with pytest.raises(TypeError, match="'kv_cache'"):
        model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=3, do_sample=False)


def test_greedy_generation_with_the_cache_equals_without_on_this_release():
    model = tiny_model()
    prompts = torch.tensor([[0, 0, 5, 17, 90, 42, 8], [64, 3, 90, 11, 7, 7, 100]])  # left padding in the first
    mask = (prompts != 0).long()
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(prompts, use_cache=True, **kwargs)
        uncached = model.generate(prompts, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)


# A saved folder, loaded through remote code by another interpreter (maybe another transformers release).
GENERATE_CHILD = WITHOUT_THE_PACKAGE + textwrap.dedent(
    '''
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    folder, inputs_path, outputs_path = sys.argv[1:4]
    inputs = torch.load(inputs_path)
    lm = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    options = dict(attention_mask=inputs["attention_mask"], max_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        outputs = {"cached": lm.generate(inputs["input_ids"], use_cache=True, **options),
                   "uncached": lm.generate(inputs["input_ids"], use_cache=False, **options)}
    torch.save(outputs, outputs_path)
    print("REPORT " + json.dumps({
        "transformers": transformers.__version__,
        "lm_class": f"{type(lm).__module__}.{type(lm).__name__}",
        "package_imported": any(name.split(".")[0] == "modeling_memoryformer" for name in sys.modules),
    }))
    '''
)


def other_pythons() -> list[str]:
    """The interpreters of MEMORYFORMER_OTHER_PYTHONS (os.pathsep-separated); each must exist."""
    listed = [os.path.abspath(p) for p in os.environ.get("MEMORYFORMER_OTHER_PYTHONS", "").split(os.pathsep) if p]
    missing = [p for p in listed if not os.path.isfile(p)]
    assert not missing, f"MEMORYFORMER_OTHER_PYTHONS names interpreters that do not exist: {missing}"
    return listed


@pytest.mark.slow
def test_a_saved_folder_generates_the_same_tokens_through_remote_code_under_every_release(tmp_path):
    """Saved by the package under this release; loaded by remote code without the package under this release and
    under each of MEMORYFORMER_OTHER_PYTHONS: greedy tokens with the cache == without == the package's."""
    model = tiny_model(attention_output="memory")
    folder = tmp_path / "saved"
    model.save_pretrained(folder)
    prompts = torch.tensor([[0, 0, 5, 17, 90, 42, 8], [64, 3, 90, 11, 7, 7, 100]])
    inputs = {"input_ids": prompts, "attention_mask": (prompts != 0).long()}
    with torch.no_grad():
        expected = model.generate(prompts, attention_mask=inputs["attention_mask"], max_new_tokens=10,
                                  do_sample=False, pad_token_id=0)
    releases = {}
    for i, python in enumerate([sys.executable, *other_pythons()]):
        work = tmp_path / f"run{i}"
        work.mkdir()
        report, outputs = load_without_the_package(folder, inputs, work, python=python, child=GENERATE_CHILD)
        assert report["lm_class"].startswith("transformers_modules."), report
        for kind in ("cached", "uncached"):
            assert torch.equal(outputs[kind], expected), (report["transformers"], kind)
        releases[python] = report["transformers"]
    assert releases[sys.executable] == transformers.__version__
    print("remote-code generation checked under transformers", sorted(set(releases.values())))

