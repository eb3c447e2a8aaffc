"""`generate`'s decoding loop for greedy search and sampling, lean where every step's layers run as one fused call.

`GenerationMixin._sample` spends, per token, about 0.4 ms of Python around the model on top of the model's call
(`prepare_inputs_for_generation` rebuilding the step's inputs from `model_kwargs`, `_update_model_kwargs_for_generation`
growing them again, the module call with its decorators and output dataclass, the full position ids concatenated):
against a MF-tiny step of 4-5 ms on 2 CPU cores, of which the bytes the step must read take about 2.3. `sample` runs
the same loop with each decode step's model call made directly: the step's inputs are what those two hooks would give
(the last token, the next position per sequence, the attention mask grown by a column of ones), the model body is
`decode_layer.decode_stack_run` (every layer in one `decode_stack` call) and the LM head, exactly the calls the
forward makes for that step, so the tokens, the cache and every logits processor's inputs are those of the standard
loop (tests/model/test_decode_loop.py compares them under greedy search and sampling, with processors, EOS, padding
and a streamer). Where the stack declines a step (a hook, a replaced module, another attention implementation...),
that step is the module call with those inputs. While only transformers' own processors, stopping criteria and
streamers run between steps (they read token ids and scores, nothing of the model), `_StackSession` skips the
re-derivation of what the last checked step read and runs each step as one call of the fused kernel (the embedding,
every layer, the final norm and, for greedy search, the LM head's pass with its argmax), the maximum-length and EOS
stopping criteria are decided from the step's length and new tokens (called only where one of them decides), and
`input_ids` grows by the new tokens in one cat where something reads it; a callback of another class makes every step
check again. Greedy tokens come from the LM head's pass (`linear_rows_argmax`) or `memory_ops.argmax_rows`
(torch.argmax's index, faster; from the logits themselves where no processor needs their float32 copy).

Taken only where nothing of the standard loop is skipped that could show: on the CPU, no `return_dict_in_generate`
(scores, logits, attentions, hidden states to collect), no `synced_gpus`, no assistant, no compiled step, a plain
`DynamicCache`, only the keywords `generate` itself prepares for a decoder-only model (attention mask, position ids,
logits_to_keep, the cache, use_cache), a forward that is this model's own with no hook on the model, and a running
transformers release whose loop is the one this mirrors (`transformers_compat.generation_loop_known`). Elsewhere
`GenerationMixin._sample` runs, unchanged.
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from operator import attrgetter, is_

import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.generation import GenerationMixin
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .decode_layer import _CPU_KEYS, _ROOM, DynamicLayer, decode_stack_run, fused_ops, unhooked
from .memory_ops import _few_rows, argmax_rows
from .transformers_compat import CACHE_NAMES, generation_loop_known

_FUSED_HEAD = True  # sessions end each step with the LM head's pass where they may (False: the head called apart,
# for timing the two apart)
_LOOP_KEYWORDS = frozenset({"attention_mask", "position_ids", "logits_to_keep", "use_cache", *CACHE_NAMES})
_KEYS, _VALUES = attrgetter("keys"), attrgetter("values")


def _loop_applies(model, input_ids, generation_config, synced_gpus: bool, model_kwargs: dict) -> bool:
    cache = next((model_kwargs[name] for name in CACHE_NAMES if model_kwargs.get(name) is not None), None)
    mask, positions = model_kwargs.get("attention_mask"), model_kwargs.get("position_ids")
    return (generation_loop_known() and not synced_gpus and not generation_config.return_dict_in_generate
            and not getattr(generation_config, "is_assistant", False) and model_kwargs.keys() <= _LOOP_KEYWORDS
            and model_kwargs.get("use_cache") is True and type(cache) is DynamicCache
            and type(model_kwargs.get("logits_to_keep", 1)) is int  # a decode step has one position to keep
            and isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.device.type == "cpu"
            and isinstance(positions, torch.Tensor) and positions.shape == input_ids.shape
            and (mask is None or (isinstance(mask, torch.Tensor) and mask.dim() == 2
                                  and mask.shape[0] == input_ids.shape[0]))
            and not torch.compiler.is_compiling() and not model._valid_auto_compile_criteria(model_kwargs,
                                                                                              generation_config))


def _transformers_own(*callbacks) -> bool:
    """Whether every callback is an object of a transformers class (its logits processors, stopping criteria and
    streamers), which reads the token ids and scores it is given and nothing of the model."""
    return all(type(c).__module__.startswith("transformers.") for c in callbacks)


def _drop_session(session: int) -> None:
    """Ends a kernel session whose `_StackSession` was collected without `close` (its keys and values dropped)."""
    try:
        fused_ops().decode_session_close(session)
    except RuntimeError:
        pass


class _StackSession:
    """What a decode step that ran every layer in one `decode_stack` call (`decode_stack_run`, with all its checks)
    read, for the next steps of the same loop while only transformers' own callbacks run between them: those change
    nothing of the model, so the checks' answer stands and each step is the same calls on the same operands, without
    the 0.2-0.5 ms of Python that derive them again (the plan's check over every submodule and parameter, the module
    calls of the embedding, dropout, rotary embedding and final norm). The fused kernel holds the operands and the KV
    views for the session (decode_session_open / _step / _close, csrc/cpu/decode_tokens.h): a step passes its tokens
    alone, and each call grows the views the last one returned, in place. The cache's layers keep the views the
    session started from until it closes, when they take the last ones (and the `_ROOM` marks move to those): the
    callbacks that run between the steps read nothing of the cache, and a step that finds its layers' views replaced
    declines. Where every sequence is at the same position (`same`: no padding), a step reads the rotary rows of
    `top` from the kernel's copy of the table, and the loop need not advance the positions tensor while the session
    runs. Given the LM head (greedy search with nothing to process the logits, a `MemoryFormerLMHead` whose few-row
    pass takes the step, after a fused final norm), each step ends with the head's pass and its argmax in the same
    call and returns (logits [batch, 1, vocabulary], picks [batch, 1]); else the hidden states [batch, 1, hidden]."""

    def __init__(self, lm, cache, batch: int, positions: torch.Tensor, top: int, head: nn.Module | None = None):
        self.ok = False
        model = lm.model
        embed, dropout, rotary, norm = (model._modules.get(name) for name in
                                        ("embed_tokens", "emb_dropout", "rotary_emb", "norm"))
        plan, table = model.__dict__.get("_decode_stack"), rotary.__dict__.get("_rope_table")
        if (plan is None or not plan.ok or table is None or type(embed) is not nn.Embedding or embed.max_norm is not None
                or type(dropout) is not nn.Dropout or dropout.training or not unhooked(model, embed, dropout, rotary, norm)
                or batch > 64 or len(cache.layers) != plan.stack[-1]
                or any(type(layer) is not DynamicLayer for layer in cache.layers)):
            return
        inv_freq = rotary.inv_freq
        if table[0] != (inv_freq.data_ptr(), inv_freq._version, inv_freq.dtype, rotary.attention_scaling,
                        embed.weight.dtype) or table[1].dtype is not embed.weight.dtype:
            return  # the table of another dtype or inv_freq: the module path makes it again
        self.cache, self.layers = cache, cache.layers
        self.keys, self.values = tuple(map(_KEYS, self.layers)), tuple(map(_VALUES, self.layers))
        self.norm, self.cos, self.sin = norm, table[1], table[2]
        tensors, floats, ints, heads, scaling, _head_dim, _count = plan.stack
        # the final norm in the same call where it is nn.LayerNorm over the hidden size (its forward's F.layer_norm)
        self.fused_norm = type(norm) is nn.LayerNorm and tuple(norm.normalized_shape) == (embed.weight.shape[1],)
        final = (True, norm.weight, norm.bias, norm.eps) if self.fused_norm else (False, None, None, 0.0)
        self.head = head if self.fused_norm else None
        ops = fused_ops()
        self.session = ops.decode_session_open(embed.weight, self.keys, self.values, self.cos, self.sin, heads, scaling,
                                               tensors, floats, ints, *final, *((head.weight, head.bias) if self.head
                                                                                 else (None, None)))
        self.dropped = weakref.finalize(self, _drop_session, self.session)
        self.run = ops.decode_session_step.default.redispatch
        self.same = bool(positions.eq(top).all())
        self.ok = True

    def step(self, ids: torch.Tensor, positions: torch.Tensor, top: int, head: nn.Module | None = None):
        """The last hidden states (after the final norm) of the next decode step, or for a session with the LM head
        (`head`, the one it was opened with) its (logits, picks); None where the session does not cover the step (a
        position past the rotary table, a token outside the vocabulary, a cache changed, the session's head not
        given)."""
        layers = self.layers
        if (top >= self.cos.shape[0] or self.cache.layers is not layers
                or (self.head is not None and head is not self.head)
                or not all(map(is_, map(_KEYS, layers), self.keys)) or not all(map(is_, map(_VALUES, layers), self.values))):
            return None
        if self.same:  # every sequence at `top` (positions may lag behind: the loop does not advance them)
            out, picks = self.run(_CPU_KEYS, self.session, ids, top)  # row `top` of the kernel's rotary tables
        else:
            rows = positions.view(-1)
            shape = (ids.shape[0], 1, self.cos.shape[-1])
            out, picks = self.run(_CPU_KEYS, self.session, ids, -1, self.cos.index_select(0, rows).view(shape),
                                  self.sin.index_select(0, rows).view(shape))
        if out.dim() != 2:
            return None  # a token outside the vocabulary: nothing written, the module path raises its error
        out = out.view(ids.shape[0], 1, -1)
        if self.head is not None:
            return out, picks.view(ids.shape[0], 1)
        return out if self.fused_norm else type(self.norm).forward(self.norm, out)

    def close(self) -> None:
        """Ends the kernel's session: the cache's layers take the views its last step returned (a layer whose views
        someone replaced meanwhile keeps theirs), and the `_ROOM` marks move to them from the views the session
        started from (the latest views of their buffers, whoever holds them now)."""
        if self.ok:
            self.ok = False
            self.dropped.detach()
            keys, values = fused_ops().decode_session_close(self.session)
            for view in self.keys + self.values:
                vars(view).pop(_ROOM, None)
            for layer, start_key, start_value, key, value in zip(self.layers, self.keys, self.values, keys, values):
                if layer.keys is start_key and layer.values is start_value:
                    layer.keys, layer.values = key, value
                    vars(key)[_ROOM] = vars(value)[_ROOM] = True


def _eos_ids(stopping_criteria) -> frozenset | None:
    """The token ids of every `EosTokenCriteria` in the list, read once for a loop in which only transformers' own
    callbacks run (nothing changes them between steps), or None where another kind of criterion is in it."""
    ids = set()
    for c in stopping_criteria:
        if type(c) is EosTokenCriteria:
            ids.update(torch.as_tensor(c.eos_token_id).view(-1).tolist())
        elif type(c) is not MaxLengthCriteria:
            return None
    return frozenset(ids)


def _criteria_undecided(stopping_criteria, length: int, eos_ids: frozenset | None, next_tokens) -> bool:
    """Whether every stopping criterion says False at this length without a word: a `MaxLengthCriteria` below its
    length, an `EosTokenCriteria` (its ids in `eos_ids`, else it is called) where no sequence's new token is one of
    them (each checks the last token of every sequence). Then the list's answer is all False, without its calls'
    small tensor ops (about 0.2 ms a step on 2 cores right after the LM head)."""
    eos = False
    for c in stopping_criteria:
        if type(c) is MaxLengthCriteria:
            if not (length < c.max_length
                    and (c.max_position_embeddings is None or length <= c.max_position_embeddings)):
                return False
        elif type(c) is EosTokenCriteria and eos_ids is not None:
            eos = True
        else:
            return False
    return not eos or eos_ids.isdisjoint(next_tokens.tolist())


def _grown(input_ids: torch.Tensor, columns: list) -> tuple[torch.Tensor, list]:
    """(input_ids with the columns appended, an empty list): torch.cat([input_ids, next_tokens[:, None]], dim=-1) of
    each step in turn, in one cat."""
    return (torch.cat([input_ids, *columns], dim=-1) if columns else input_ids), []


def sample(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus: bool = False,
           streamer=None, **model_kwargs):
    """`GenerationMixin._sample` (the loop of greedy search and multinomial sampling), its decode steps made as
    direct calls where that gives the same result (see the module's docstring); else `GenerationMixin._sample`."""
    if not _loop_applies(self, input_ids, generation_config, synced_gpus, model_kwargs):
        return GenerationMixin._sample(self, input_ids, logits_processor, stopping_criteria, generation_config,
                                       synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)
    pad_token_id = generation_config._pad_token_tensor
    has_eos_stopping_criteria = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
    unfinished_sequences = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    all_unfinished = True  # what unfinished_sequences holds, while it is all ones
    if pad_token_id is not None:
        pad_token_id = pad_token_id.to(input_ids.device)
    outputs = self._prefill(input_ids, generation_config, model_kwargs, is_first_iteration=True)
    model_kwargs = self._update_model_kwargs_for_generation(outputs, model_kwargs, is_encoder_decoder=False)
    logits = outputs.logits[:, -1]
    del outputs
    cache_name = next(name for name in CACHE_NAMES if model_kwargs.get(name) is not None)
    cache, mask = model_kwargs[cache_name], model_kwargs.get("attention_mask")
    positions = model_kwargs["position_ids"][:, -1:]  # as prepare_inputs_for_generation slices them for the step
    top = int(positions.max())
    ones = mask is None or bool(mask.all())  # the mask grows by ones: it stays all ones if it is now
    keep = model_kwargs.get("logits_to_keep", 1)
    # the class's forward is the one this loop's direct calls stand for (a subclass may have its own)
    owner = next(cls for cls in type(self).__mro__ if cls.__dict__.get("_sample") is sample)
    own_forward = type(self).forward is owner.__dict__.get("forward")
    quiet = _transformers_own(logits_processor, *logits_processor, stopping_criteria, *stopping_criteria,
                              *([streamer] if streamer is not None else []))
    eos_ids = _eos_ids(stopping_criteria) if quiet else None  # a callback of one's own might change them
    session = None
    pending = 0  # columns of ones the mask has yet to grow by
    lag = 0  # steps the positions have yet to advance by
    next_tokens = None  # the last step's picks, which the next decode step reads
    column = None  # next_tokens as a column [batch, 1], where the LM head's pass gave them so
    grown = []  # the columns input_ids has yet to grow by: one cat where something reads it (a cat per step took
    # 30-50 us of a MF-small step on 2 Zen 4 cores, its code evicted by the LM head's stream)
    picked = None  # a step's greedy picks [batch, 1], found with its logits in one pass of the LM head
    greedy = not generation_config.do_sample and not len(logits_processor)
    from .modeling_memoryformer import MemoryFormerLMHead  # (this module is imported by that one)
    optimized = getattr(self, "_optimize_model_for_decode", nullcontext)
    try:
        with optimized():
            while True:
                if logits is None:  # a decode step: the last tokens (input_ids[:, -1:]) at the next positions
                    step = next_tokens.view(-1, 1) if column is None else column
                    direct = own_forward and unhooked(self)  # else the module call, with its hooks
                    head = self.lm_head  # its pass gives the picks where nothing processes the logits
                    fused_head = greedy and type(head) is MemoryFormerLMHead and unhooked(head)
                    hidden = None
                    if session is not None and direct:
                        hidden = session.step(step, positions, top, head if fused_head and _FUSED_HEAD else None)
                        if type(hidden) is tuple:  # the head ran in the step: (logits, picks)
                            logits, picked = hidden
                            hidden = logits
                    if session is not None and hidden is None:
                        session.close()
                        session = None
                    if hidden is None and pending:  # the paths below read the mask: its columns of ones now
                        mask = torch.cat([mask, mask.new_ones((mask.shape[0], pending))], dim=-1)
                        pending = 0
                    if hidden is None and lag:  # and the positions
                        positions, lag = positions + lag, 0
                    if hidden is None and direct:
                        run = decode_stack_run(self, step, mask, positions, cache, None, None, {})
                        if run is not None:
                            hidden = run[0]
                            if quiet and ones:
                                with_head = fused_head and _FUSED_HEAD and _few_rows(hidden, head.weight, head.bias)
                                session = _StackSession(self, cache, step.shape[0], positions, top,
                                                        head if with_head else None)
                                session = session if session.ok else None
                    if hidden is not None and picked is None and fused_head:
                        both = head.logits_and_argmax(hidden)  # the logits and their argmax in one pass
                        if both is not None:  # [batch, 1, vocab] and [batch, 1], unsliced: greedy search without
                            logits, picked = both  # processors reads the picks alone (a view: a few us here)
                    if hidden is not None:
                        if picked is None:
                            logits = head(hidden)[:, -1]  # [batch, 1, hidden]: logits_to_keep changes nothing
                    else:
                        outputs = self(input_ids=step, attention_mask=mask, position_ids=positions, use_cache=True,
                                       logits_to_keep=keep, return_dict=True, **{cache_name: cache})
                        logits = outputs.logits[:, -1]
                        del outputs
                    if mask is not None:  # grows by a column of ones, added where a step reads it (the session's
                        pending += 1      # steps do not: it is all ones)
                    top, lag = top + 1, lag + 1  # the positions advance by one, where a step reads them
                    if session is None or not session.same:
                        positions, lag = positions + lag, 0
                if generation_config.do_sample or len(logits_processor):
                    next_token_logits = logits.to(copy=True, dtype=torch.float32, device=input_ids.device)
                    input_ids, grown = _grown(input_ids, grown)
                    next_token_scores = logits_processor(input_ids, next_token_logits)
                    if generation_config.do_sample:
                        probs = nn.functional.softmax(next_token_scores, dim=-1)
                        next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
                    else:
                        next_tokens = argmax_rows(next_token_scores)  # torch.argmax(..., dim=-1), faster
                else:  # greedy, nothing to process: the argmax of the logits is that of their float32 copy
                    next_tokens = argmax_rows(logits) if picked is None else picked.view(-1)
                column = picked
                logits = picked = None
                if has_eos_stopping_criteria and not all_unfinished:  # else the same tokens
                    next_tokens = next_tokens * unfinished_sequences + pad_token_id * (1 - unfinished_sequences)
                    column = None
                grown.append(next_tokens[:, None] if column is None else column)
                if not _criteria_undecided(stopping_criteria, input_ids.shape[1] + len(grown), eos_ids, next_tokens):
                    input_ids, grown = _grown(input_ids, grown)
                    unfinished_sequences = unfinished_sequences & ~stopping_criteria(input_ids, None)
                    all_unfinished = bool(unfinished_sequences.all())
                if streamer is not None:
                    streamer.put(next_tokens.cpu())
                if not all_unfinished and unfinished_sequences.max() == 0:
                    break
    finally:
        if session is not None:
            session.close()
    if streamer is not None:
        streamer.end()
    return _grown(input_ids, grown)[0]
