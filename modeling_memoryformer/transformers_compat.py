"""Every difference between the transformers releases the model supports, in one place.

The model unit travels with every saved model (remote code) and runs under whatever transformers the downloader has
installed, for years. So nothing here compares version numbers: each difference is read once, at import, from the
running release's own interfaces.

- The KV cache's name. Up to 5.23 `generate` hands the cache to the model as `past_key_values` and reads it back from
  the output's `past_key_values`; from 5.24 both are `cache` (the old name deprecated). The forwards accept either
  name (`cache_argument`), return the cache under the running release's field name (`CACHE_FIELD`), and call
  `create_causal_mask` with the keyword it takes (`causal_mask`).
- `slice_logits_to_keep`, in `modeling_utils` from 5.22: the same function here before that.
- Keywords: what a forward does not understand is an error naming it (`check_keywords`), never a silent no-op: when
  the next release renames an argument again, generation fails loudly instead of recomputing from an empty cache.
  (Other keywords reach a user-registered attention function, as transformers' attention interface promises.)
- Continuous batching (`generate_batch`, `transformers serve --continuous-batching`) calls the model with a paged KV
  cache (`PagedAttentionCache`, as `cache=`) and the keywords of the running release's `PagedAttentionArgs`
  (`read_index`, `write_index`, `block_table`, ...), which are accepted in such a call (`PAGED_KEYWORDS`). Who writes
  the new keys and values into the paged cache moved: up to 5.23 the attention function does (it takes the cache in
  its keywords), from 5.24 the model does (`cache.update(..., kwargs=kwargs)`). `update_kv_cache` asks the attention
  function in use, once, which it does (`_attention_updates_paged_cache`).
- Compiled decoding: `generate` compiles the decode step by itself over a static KV cache on GPUs only; on the CPU
  it does when the `CompileConfig` carries the private flag `_compile_all_devices` (present from the oldest supported
  release to the newest). `compiled_decode_kwargs` sets it, and is the one place that names it.
- `generate`'s loop for greedy search and sampling (`GenerationMixin._sample`) is mirrored with direct decode calls
  (`decode_loop.sample`) where the running release's loop has the interface it was written against, 5.10 to 5.24
  (`generation_loop_known`: the signatures of `_sample`, `_prefill`, `_update_model_kwargs_for_generation` and the
  auto-compile check); under another the standard loop runs.
- The decode stack (`decode_layer.decode_stack_step`) grows a `DynamicCache`'s layers itself: `cache_grows_by_cat`
  checks once, on the running release's `DynamicLayer`, that an update is `torch.cat([keys, new], dim=-2)` stored in
  `keys` and `values` and nothing else. It skips the decoder layers' calls, so it runs only while transformers' output
  capture records nothing (`outputs_captured`, read from `capture_outputs`' collector; a release without one: never).
"""

import dataclasses
import functools
import inspect

import torch
from transformers import modeling_utils
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.utils import TransformersKwargs


# The field the running release's outputs hold the KV cache in, and both names a cache goes by (from 5.24 / up to 5.23).
CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(BaseModelOutputWithPast)} else "past_key_values"
CACHE_NAMES = ("cache", "past_key_values")
_MASK_CACHE_KEYWORD = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"

# Keywords any transformers model receives besides its named arguments: attention and loss options
# (`TransformersKwargs`, as `generate` checks them), the output switches the forward decorators read, and the loss
# options of `ForCausalLMLoss`.
_TRANSFORMERS_KEYWORDS = frozenset(getattr(TransformersKwargs, "__optional_keys__", TransformersKwargs.__annotations__))
ACCEPTED_KEYWORDS = _TRANSFORMERS_KEYWORDS | {
    "output_attentions", "output_hidden_states", "return_dict", "is_causal", "debug_io", "debug_io_dir",
    "prune_layers", "num_items_in_batch", "ignore_index", "shift_labels",
}


# Continuous batching: its paged cache class and the keywords its model calls carry (absent from a release without it).
try:
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
except ImportError:  # pragma: no cover - every supported release has it; a future one may move it
    PagedAttentionCache = None
try:
    from transformers.generation.continuous_batching.input_outputs import PagedAttentionArgs

    PAGED_KEYWORDS = frozenset(getattr(PagedAttentionArgs, "__optional_keys__", ()) | PagedAttentionArgs.__annotations__.keys())
except ImportError:  # pragma: no cover
    PAGED_KEYWORDS = frozenset()


def is_paged_cache(cache) -> bool:
    """Whether `cache` is continuous batching's paged KV cache (not a `Cache`: it is written through the keywords of
    the call, `read_index` / `write_index` / `block_table`)."""
    return PagedAttentionCache is not None and isinstance(cache, PagedAttentionCache)


class _CacheUpdated(Exception):
    pass


@functools.cache
def _attention_updates_paged_cache(attention) -> bool:
    """Whether the attention function `attention` writes a paged cache handed to it as `cache=` (transformers up to
    5.23) rather than expecting the model to have done it (from 5.24). Read from the function itself: it is called once
    on a tiny input with a paged cache whose `update` stops the call."""
    if PagedAttentionCache is None:
        return False

    class Probe(PagedAttentionCache):
        def __init__(self):  # no storage: only `update` is called
            pass

        def update(self, *args, **kwargs):
            raise _CacheUpdated

    module = torch.nn.Module()
    module.layer_idx, module.is_causal = 0, False
    q = torch.zeros(1, 1, 1, 8)
    index = [torch.zeros(1, dtype=torch.long)]
    try:
        attention(module, q, q, q, None, scaling=1.0, dropout=0.0, cache=Probe(), read_index=index, write_index=index,
                  cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=1, max_length_k=1)
    except _CacheUpdated:
        return True
    except Exception:  # an attention function that needs the real varlen inputs: it was not going to write the cache
        return False
    return False


def update_kv_cache(cache, key, value, layer_idx: int, attention, kwargs: dict):
    """The keys and values attention reads after this layer's new ones are in `cache` (None: no cache). For a paged
    cache, either writes it the way the running release's model does, or hands it on in `kwargs` (updated in place) to
    the attention function `attention` that writes it."""
    if cache is None:
        return key, value
    if not is_paged_cache(cache):
        return cache.update(key, value, layer_idx)
    if _attention_updates_paged_cache(attention):
        kwargs["cache"] = cache
        return key, value
    return cache.update(key, value, layer_idx, kwargs=kwargs)


try:  # the layer class of a DynamicCache (5.x); a release without it: the per-layer decode step
    from transformers.cache_utils import DynamicLayer
except ImportError:  # pragma: no cover
    DynamicLayer = None


def _replaced(before: dict, after: dict) -> set:
    """The attributes a call set to other objects or added, from an object's `vars` before and after it."""
    return {name for name in before if before[name] is not after.get(name)} | (after.keys() - before.keys())


@functools.cache
def cache_grows_by_cat() -> bool:
    """Whether the running release's `DynamicLayer.update` stores `torch.cat([keys, new], dim=-2)` (and the same for
    the values) as the layer's `keys` and `values`, returns them, and changes nothing else: tried once on a layer."""
    try:
        layer = DynamicLayer()
        first, new = torch.arange(8.0).view(1, 1, 2, 4), torch.arange(8.0, 12.0).view(1, 1, 1, 4)
        layer.update(first, -first)
        before = dict(vars(layer))
        keys, values = layer.update(new, -new)
        after = dict(vars(layer))
    except Exception:  # another interface: the model's own per-layer calls
        return False
    grown = torch.cat([first, new], dim=-2)
    return (keys is after.get("keys") and values is after.get("values")
            and _replaced(before, after) == {"keys", "values"}
            and torch.equal(keys, grown) and torch.equal(values, -grown))


try:  # the layer class of a StaticCache (5.x); a release without it: the per-layer compiled step
    from transformers.cache_utils import StaticLayer
except ImportError:  # pragma: no cover
    StaticLayer = None


@functools.cache
def static_cache_writes_at_length() -> bool:
    """Whether the running release's `StaticLayer.update` writes the new keys and values at positions
    `cumulative_length + arange(n)` of its buffers, advances `cumulative_length` (one int64) by n, returns the buffers
    and changes nothing else: tried once on a layer (what `decode_stack_static` does in its place)."""
    try:
        layer = StaticLayer(max_cache_len=4)
        first, new = torch.arange(4.0).view(1, 1, 1, 4), torch.arange(4.0, 8.0).view(1, 1, 1, 4)
        layer.update(first, -first)
        before = dict(vars(layer))
        length, keys_buffer = layer.cumulative_length, layer.keys
        keys, values = layer.update(new, -new)
        after = dict(vars(layer))
    except Exception:  # another interface: the model's own per-layer calls
        return False
    written = torch.cat([first, new, torch.zeros(1, 1, 2, 4)], dim=-2)
    return (keys is keys_buffer and values is after.get("values") and not _replaced(before, after)
            and isinstance(length, torch.Tensor) and after.get("cumulative_length") is length
            and length.numel() == 1 and length.dtype == torch.long and int(length) == 2 and torch.equal(keys, written)
            and torch.equal(values, -written))


try:
    from transformers.utils.output_capturing import _active_collector as _OUTPUT_COLLECTOR
except ImportError:
    _OUTPUT_COLLECTOR = None


def outputs_captured() -> bool:
    """Whether transformers' output capture (the `capture_outputs` decorator) records something in this forward, so
    that its hooks on the decoder layers and attentions must run (True where the running release has no collector)."""
    return _OUTPUT_COLLECTOR is None or bool(_OUTPUT_COLLECTOR.get())


_LOOP_SIGNATURES = {
    "_sample": ["self", "input_ids", "logits_processor", "stopping_criteria", "generation_config", "synced_gpus",
                "streamer", "model_kwargs"],
    "_prefill": ["self", "input_ids", "generation_config", "model_kwargs", "is_first_iteration"],
    "_update_model_kwargs_for_generation": ["self", "outputs", "model_kwargs", "is_encoder_decoder", "num_new_tokens"],
    "_valid_auto_compile_criteria": ["self", "model_kwargs", "generation_config"],
}


@functools.cache
def generation_loop_known() -> bool:
    """Whether the running release's `GenerationMixin` has the loop interface `decode_loop.sample` mirrors."""
    from transformers.generation import GenerationMixin

    try:
        return all(list(inspect.signature(getattr(GenerationMixin, name)).parameters) == parameters
                   for name, parameters in _LOOP_SIGNATURES.items())
    except (AttributeError, TypeError, ValueError):
        return False


def cache_argument(past_key_values, cache):
    """The KV cache a forward was given under either name (None if neither); both at once must be the same object."""
    if cache is None:
        return past_key_values
    if past_key_values is not None and past_key_values is not cache:
        raise ValueError(
            "Got two different KV caches, as `cache` and as `past_key_values` (transformers 5.24 renamed "
            "`past_key_values` to `cache`): pass one of them."
        )
    return cache


def causal_mask(*, cache, **kwargs):
    """`create_causal_mask` with the cache under the keyword the running release takes."""
    return create_causal_mask(**{_MASK_CACHE_KEYWORD: cache}, **kwargs)


def with_cache(output_class, cache, **fields):
    """An instance of a transformers output class with the cache under the running release's field name."""
    return output_class(**{CACHE_FIELD: cache}, **fields)


# Keywords whose names say they change the result: never passed on to an attention backend unread.
_RESULT_WORDS = ("cache", "past", "key_value", "mask", "position", "state")


def check_keywords(forward, kwargs: dict, attention, cache=None) -> None:
    """Refuse keywords that `forward` would swallow in its `**kwargs` without effect.

    cache: the KV cache of the call; with continuous batching's paged cache, the keywords of the running release's
    `PagedAttentionArgs` are accepted too (they reach the attention function and the cache update).

    attention: the attention function in use. The forwards pass their extra keywords on to it, as transformers'
    attention interface does: a function registered by the user (`AttentionInterface.register`) may read them, but
    transformers' own and the model's `eager_attention_forward` (pass None for it) ignore them. Cache-, mask-,
    position- and state-like keywords are refused whatever the backend: the model reads those itself.
    """
    accepted = ACCEPTED_KEYWORDS | PAGED_KEYWORDS if is_paged_cache(cache) else ACCEPTED_KEYWORDS
    unknown = [key for key in kwargs if key not in accepted]
    if not unknown:
        return
    module = getattr(attention, "__module__", None) or ""
    user_backend = attention is not None and module.split(".")[0] != "transformers"
    refused = sorted(key for key in unknown if not user_backend or any(word in key for word in _RESULT_WORDS))
    if refused:
        named = [name for name, p in inspect.signature(forward).parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
        raise TypeError(
            f"{forward.__qualname__}() got unexpected keyword argument(s) {', '.join(map(repr, refused))}, which the "
            f"model would ignore. It takes {', '.join(n for n in named if n != 'self')}, transformers' common options "
            f"({', '.join(sorted(ACCEPTED_KEYWORDS))}), and, with an attention function registered through "
            "transformers' AttentionInterface, the keywords that function reads."
        )


def _slice_logits_to_keep(hidden_states, logits_to_keep):
    """Keep the last `logits_to_keep` positions (an int; 0 keeps all) or the positions a 1-D index tensor names."""
    slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return hidden_states[:, slice_indices, :]


slice_logits_to_keep = getattr(modeling_utils, "slice_logits_to_keep", _slice_logits_to_keep)


# The old cache name, deprecated where `cache` is the current one (from 5.24): transformers' own `deprecate_kwarg`, as
# its in-tree models use it (`@deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")`), so `past_key_values=`
# warns with transformers' message and arrives as `cache`. Both names at once are left to `cache_argument` (the same
# object is fine, two caches are an error). Where `past_key_values` is the current name (up to 5.23) the forwards are
# left as they are: nothing to warn about.
from functools import wraps as _wraps

from transformers.utils.deprecation import deprecate_kwarg as _deprecate_kwarg


def deprecated_cache_name(forward):
    """Decorator for the model forwards: `past_key_values=` warns that it is deprecated in favour of `cache=` when the
    running release names the cache `cache` (CACHE_FIELD), and is the forward itself otherwise."""
    if CACHE_FIELD != "cache":
        return forward
    # warn_if_greater_or_equal_version: the model keeps taking the old name, so it keeps saying it is deprecated
    renamed = _deprecate_kwarg("past_key_values", "5.40.0", new_name="cache", warn_if_greater_or_equal_version=True)(
        forward
    )

    @_wraps(forward)
    def wrapper(*args, **kwargs):
        return forward(*args, **kwargs) if "cache" in kwargs else renamed(*args, **kwargs)

    return wrapper


def compiled_decode_kwargs(device: str | torch.device = "cpu", fullgraph: bool = True) -> dict:
    """`generate` keywords that run the decode step compiled by torch.compile over a static KV cache, on any device:

        model.generate(ids, max_new_tokens=64, **compiled_decode_kwargs())
        pipeline("text-generation", model=model, tokenizer=tok)(text, **compiled_decode_kwargs())

    The same greedy tokens as the eager decode (tests/model/test_generation.py). The first call compiles (about 30 s
    for MF-tiny, minutes for MF-base on 2 CPU cores); later calls with the same batch size and cache length reuse it.
    On the CPU the compiled step runs every decoder layer in one fused-kernel call over the static cache
    (`decode_stack_static`, `decode_layer.decode_stack_traced`), the rest in Inductor's C++ loops; CUDA graphs
    ("reduce-overhead", transformers' default) are kept on GPUs only. On the CPU the eager `generate` (the same
    stack over a dynamic cache, with no guards to check and no wrapper per step) stays the faster of the two
    (docs/performance.md)."""
    from transformers.generation.configuration_utils import CompileConfig

    on_gpu = torch.device(device).type == "cuda"
    config = CompileConfig(fullgraph=fullgraph, mode="reduce-overhead" if on_gpu else "default")
    config._compile_all_devices = True  # generate's own test: compile on the CPU too
    return {"cache_implementation": "static", "compile_config": config}
