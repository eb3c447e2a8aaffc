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
"""

import dataclasses
import inspect

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


def check_keywords(forward, kwargs: dict, attention) -> None:
    """Refuse keywords that `forward` would swallow in its `**kwargs` without effect.

    attention: the attention function in use. The forwards pass their extra keywords on to it, as transformers'
    attention interface does: a function registered by the user (`AttentionInterface.register`) may read them, but
    transformers' own and the model's `eager_attention_forward` (pass None for it) ignore them. Cache-, mask-,
    position- and state-like keywords are refused whatever the backend: the model reads those itself.
    """
    unknown = [key for key in kwargs if key not in ACCEPTED_KEYWORDS]
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
