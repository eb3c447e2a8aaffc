"""generate's loop for greedy search and sampling with direct decode calls (decode_loop.sample) against
transformers' own loop (GenerationMixin._sample), the oracle: the same tokens, streamed tokens, cache and processor
inputs, under greedy search and sampling, EOS, padding, processors, streamers and callbacks that change the model
between steps. Where the loop would skip something the standard one does (collected scores, a compiled step, another
cache), transformers' loop must run."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, GenerationMixin, LogitsProcessor, LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

import modeling_memoryformer.modeling_memoryformer as modeling
from modeling_memoryformer import decode_layer, decode_loop, memory_ops
from modeling_memoryformer.transformers_compat import CACHE_FIELD, generation_loop_known

from conftest import require_kernel, tiny_model
from test_decode_layer import modules_only

UNPADDED = torch.tensor([[5, 17, 99, 42, 8, 63, 120], [3, 9, 27, 81, 44, 2, 7]])
PADDED = torch.tensor([[5, 17, 99, 42, 8, 63, 120], [0, 0, 3, 9, 27, 81, 44]])
NEW = 8


@pytest.fixture(autouse=True)
def fused():
    require_kernel("fused")
    with memory_ops.use_kernel("fused"):
        yield


def standard_loop(monkeypatch) -> None:
    """transformers' loop from now on (the oracle)."""
    monkeypatch.setattr(modeling.MemoryFormerForCausalLM, "_sample", GenerationMixin._sample)


def counted(monkeypatch) -> dict[str, int]:
    """Counts the loops this package ran, the decode steps its session ran and the steps decode_stack_run ran."""
    runs = {"loop": 0, "session": 0, "stack": 0}
    applies, step, run = decode_loop._loop_applies, decode_loop._StackSession.step, decode_loop.decode_stack_run

    def counting_applies(*args):
        out = applies(*args)
        runs["loop"] += out
        return out

    def counting_step(*args):
        out = step(*args)
        runs["session"] += out is not None
        return out

    def counting_run(*args):
        out = run(*args)
        runs["stack"] += out is not None
        return out

    monkeypatch.setattr(decode_loop, "_loop_applies", counting_applies)
    monkeypatch.setattr(decode_loop._StackSession, "step", counting_step)
    monkeypatch.setattr(decode_loop, "decode_stack_run", counting_run)
    return runs


def generate(model, prompt, seed=0, **kwargs):
    kwargs.setdefault("max_new_tokens", NEW)
    kwargs.setdefault("do_sample", False)
    torch.manual_seed(seed)
    with torch.inference_mode():
        return model.generate(prompt, attention_mask=(prompt != 0).long(), pad_token_id=0, **kwargs)


def same_as_standard(model, monkeypatch, prompt, **kwargs) -> dict[str, int]:
    """generate with this package's loop, then with transformers' (modules only, no fused step): the same tokens.
    Returns the first run's counts."""
    runs = counted(monkeypatch)
    fast = generate(model, prompt, **kwargs)
    counts = dict(runs)
    monkeypatch.undo()
    standard_loop(monkeypatch)
    modules_only(monkeypatch)
    slow = generate(model, prompt, **kwargs)
    assert torch.equal(fast, slow), (fast, slow)
    return counts


def test_the_running_release_has_the_loop_it_mirrors():
    assert generation_loop_known()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
@pytest.mark.parametrize("config", [{}, dict(norm_type="rmsnorm"), dict(use_parallel_residual=True)],
                         ids=["layernorm", "rmsnorm", "parallel"])
def test_greedy_search_and_sampling_give_the_standard_tokens(monkeypatch, dtype, do_sample, config):
    model = tiny_model(attn_implementation="sdpa", **config).to(dtype)
    counts = same_as_standard(model, monkeypatch, UNPADDED, do_sample=do_sample)
    # the first decode step checks everything (decode_stack_run), the session runs the others
    assert counts == {"loop": 1, "session": NEW - 2, "stack": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_padded_batch_and_int8_tables_give_the_standard_tokens(monkeypatch, dtype):
    model = tiny_model(attn_implementation="sdpa").to(dtype)
    # padding: the mask goes with every step, through decode_stack_run's checks (no session)
    assert same_as_standard(model, monkeypatch, PADDED) == {"loop": 1, "session": 0, "stack": NEW - 1}
    monkeypatch.undo()
    model.quantize_tables("int8")
    assert same_as_standard(model, monkeypatch, UNPADDED) == {"loop": 1, "session": NEW - 2, "stack": 1}


def test_eos_pads_finished_sequences_and_stops_as_the_standard_loop(monkeypatch):
    model = tiny_model(attn_implementation="sdpa")
    free = generate(model, UNPADDED, max_new_tokens=12)
    eos = int(free[0, UNPADDED.shape[1] + 2])  # the first sequence ends at its third new token
    assert eos not in free[1, UNPADDED.shape[1]:].tolist()[:3]
    counts = same_as_standard(model, monkeypatch, UNPADDED, max_new_tokens=12, eos_token_id=eos)
    assert counts["loop"] == 1 and counts["session"] > 0
    out = generate(model, UNPADDED, max_new_tokens=12, eos_token_id=eos)
    assert out[0, UNPADDED.shape[1] + 3:].eq(0).all()  # padded after its EOS
    # both sequences ending: the loop stops before max_new_tokens, as transformers' does
    eos_both = [eos, int(free[1, UNPADDED.shape[1] + 1])]
    monkeypatch.undo()
    counts = same_as_standard(model, monkeypatch, UNPADDED, max_new_tokens=12, eos_token_id=eos_both)
    assert generate(model, UNPADDED, max_new_tokens=12, eos_token_id=eos_both).shape[1] < UNPADDED.shape[1] + 12



def test_an_eos_not_generated_calls_no_criterion_until_one_is(monkeypatch):
    """EOS ids (the default of a model with an eos_token_id) that no new token is: the loop decides the stopping
    criteria from the tokens (no call, no tensor op), and calls them at a step where a sequence's new token is one
    of them, and at the last, where the maximum length decides."""
    from transformers.generation.stopping_criteria import EosTokenCriteria

    model = tiny_model(attn_implementation="sdpa")
    free = generate(model, UNPADDED, max_new_tokens=12)
    new = free[:, UNPADDED.shape[1]:]
    calls = []
    original = EosTokenCriteria.__call__
    monkeypatch.setattr(EosTokenCriteria, "__call__", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    unused = next(t for t in range(model.config.vocab_size) if t not in free.tolist()[0] + free.tolist()[1])
    # called once: at the last step, where the maximum length decides
    assert torch.equal(generate(model, UNPADDED, max_new_tokens=12, eos_token_id=unused), free) and calls == [1]
    calls.clear()
    eos = int(new[1, 5])  # the second sequence's sixth new token, which the first does not generate before it
    out = generate(model, UNPADDED, max_new_tokens=12, eos_token_id=eos)
    steps = out[:, UNPADDED.shape[1]:].T.tolist()  # each step's new tokens (a finished sequence's padded)
    decided = {i for i, tokens in enumerate(steps) if eos in tokens} | {len(steps) - 1}  # an EOS, the last step
    assert len(calls) == len(decided) >= 2 and out.shape[1] == UNPADDED.shape[1] + 12
    monkeypatch.undo()
    standard_loop(monkeypatch)
    assert torch.equal(generate(model, UNPADDED, max_new_tokens=12, eos_token_id=eos), out)

def test_processors_and_warpers_see_the_same_inputs(monkeypatch):
    model = tiny_model(attn_implementation="sdpa")
    options = dict(do_sample=True, top_k=5, temperature=0.8, repetition_penalty=1.3, no_repeat_ngram_size=2,
                   min_new_tokens=4)
    assert same_as_standard(model, monkeypatch, UNPADDED, **options)["session"] == NEW - 2
    seen = {"fast": [], "slow": []}

    class Recorder(LogitsProcessor):  # a user's processor: the loop checks the model at every step
        def __init__(self, into):
            self.into = into

        def __call__(self, input_ids, scores):
            self.into.append((input_ids.clone(), scores.clone()))
            return scores

    monkeypatch.undo()
    runs = counted(monkeypatch)
    generate(model, UNPADDED, logits_processor=LogitsProcessorList([Recorder(seen["fast"])]))
    assert runs == {"loop": 1, "session": 0, "stack": NEW - 1}
    monkeypatch.undo()
    standard_loop(monkeypatch)
    generate(model, UNPADDED, logits_processor=LogitsProcessorList([Recorder(seen["slow"])]))
    assert len(seen["fast"]) == len(seen["slow"]) == NEW
    for (ids_a, scores_a), (ids_b, scores_b) in zip(seen["fast"], seen["slow"]):
        assert torch.equal(ids_a, ids_b) and torch.equal(scores_a, scores_b)


def test_a_callback_that_hooks_a_layer_between_steps_is_seen_from_the_next_step(monkeypatch):
    model = tiny_model(attn_implementation="sdpa")
    calls = []

    class HookAtStep(LogitsProcessor):
        def __init__(self):
            self.steps, self.handle = 0, None

        def __call__(self, input_ids, scores):
            self.steps += 1
            if self.steps == 3:
                def shift(module, args, output):
                    calls.append(1)
                    return output + 0.5
                self.handle = model.model.layers[0].register_forward_hook(shift)
            return scores

    def run():
        processor = HookAtStep()
        out = generate(model, UNPADDED, logits_processor=LogitsProcessorList([processor]))
        processor.handle.remove()
        return out

    fast = run()
    assert len(calls) == NEW - 3  # every step after the third ran the hooked layer
    calls.clear()
    standard_loop(monkeypatch)
    assert torch.equal(fast, run()) and len(calls) == NEW - 3


def test_streamers_get_the_same_tokens(monkeypatch):
    model = tiny_model(attn_implementation="sdpa")

    class Collect(BaseStreamer):
        def __init__(self):
            self.put_calls, self.ended = [], 0

        def put(self, value):
            self.put_calls.append(value.clone())

        def end(self):
            self.ended += 1

    fast, slow = Collect(), Collect()
    generate(model, UNPADDED[:1], streamer=fast)
    standard_loop(monkeypatch)
    generate(model, UNPADDED[:1], streamer=slow)
    assert fast.ended == slow.ended == 1 and len(fast.put_calls) == len(slow.put_calls) == NEW + 1
    assert all(torch.equal(a, b) for a, b in zip(fast.put_calls, slow.put_calls))


def test_a_cache_passed_in_holds_the_standard_keys_and_values_and_continues(monkeypatch):
    model = tiny_model(attn_implementation="sdpa")

    def run():
        cache = DynamicCache(config=model.config)
        first = generate(model, UNPADDED, **{CACHE_FIELD: cache})  # under the running release's name
        second = generate(model, first, max_new_tokens=4, **{CACHE_FIELD: cache})  # continues from the cache
        return second, cache

    fast, fast_cache = run()
    standard_loop(monkeypatch)
    modules_only(monkeypatch)
    slow, slow_cache = run()
    assert torch.equal(fast, slow)
    assert fast_cache.get_seq_length() == slow_cache.get_seq_length() == fast.shape[1] - 1
    for a, b in zip(fast_cache.layers, slow_cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    # the views the cache holds are the ones marked as growable in place (decode_layer._ROOM), and only those
    assert all(decode_layer._ROOM in vars(layer.keys) for layer in fast_cache.layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_session_past_its_buffers_room_moves_them_and_keeps_the_standard_cache(monkeypatch, dtype):
    """The kernel's session writes each step's keys and values into its buffers in place (csrc/cpu/decode_tokens.h,
    SessionKV), which have room for 64 positions past the first step's: here 79 steps of one session (positions
    101-179, the rotary table made for 202 at the first step) cross it, and the buffers move mid-session. Tokens and
    every layer's keys and values equal transformers' loop on the modules."""
    model = tiny_model(attn_implementation="sdpa").to(dtype)
    prompt = torch.randint(1, 128, (2, 100), generator=torch.Generator().manual_seed(3))

    def run():
        cache = DynamicCache(config=model.config)
        return generate(model, prompt, max_new_tokens=80, **{CACHE_FIELD: cache}), cache

    runs = counted(monkeypatch)
    fast, fast_cache = run()
    assert runs == {"loop": 1, "session": 78, "stack": 1}
    monkeypatch.undo()
    standard_loop(monkeypatch)
    modules_only(monkeypatch)
    slow, slow_cache = run()
    assert torch.equal(fast, slow)
    for a, b in zip(fast_cache.layers, slow_cache.layers):
        assert a.keys.shape[-2] == 179 and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_positions_past_the_rotary_table_reopen_the_session(monkeypatch):
    model = tiny_model(attn_implementation="sdpa")
    prompt = torch.randint(1, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    counts = same_as_standard(model, monkeypatch, prompt, max_new_tokens=50)
    # the prefill's table holds 64 positions: the step at position 64 makes it again on the checked path
    assert counts == {"loop": 1, "session": 50 - 3, "stack": 2}


def test_what_the_loop_would_skip_takes_transformers_loop(monkeypatch):
    model = tiny_model(attn_implementation="sdpa")
    runs = counted(monkeypatch)
    with torch.inference_mode():
        out = model.generate(UNPADDED, max_new_tokens=4, do_sample=False, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
    assert runs["loop"] == 0 and len(out.scores) == 4
    generate(model, UNPADDED, num_beams=2)  # beam search: its own loop
    assert runs["loop"] == 0


def test_a_subclass_forward_or_a_hook_on_the_model_is_called_every_step(monkeypatch):
    class Traced(modeling.MemoryFormerForCausalLM):
        calls = 0

        def forward(self, *args, **kwargs):
            type(self).calls += 1
            return super().forward(*args, **kwargs)

    base = tiny_model(attn_implementation="sdpa")
    traced = Traced(base.config).eval()
    traced.load_state_dict(base.state_dict())
    assert torch.equal(generate(traced, UNPADDED), generate(base, UNPADDED))
    assert Traced.calls == NEW  # the prefill and every decode step
    seen = []
    handle = base.register_forward_pre_hook(lambda module, args, kwargs: seen.append(1), with_kwargs=True)
    runs = counted(monkeypatch)
    generate(base, UNPADDED)
    handle.remove()
    assert len(seen) == NEW and runs["session"] == runs["stack"] == 0


def test_the_text_generation_pipeline_runs_on_the_loops_session(monkeypatch):
    from transformers import pipeline

    from test_generation import _word_level_tokenizer

    tokenizer = _word_level_tokenizer()
    model = tiny_model(attn_implementation="sdpa")
    text = "w5 w17 w99 w42 w8"
    runs = counted(monkeypatch)
    with memory_ops.use_kernel("fused"):
        fast = pipeline("text-generation", model=model, tokenizer=tokenizer)(text, max_new_tokens=NEW, do_sample=False)
    assert runs == {"loop": 1, "session": NEW - 2, "stack": 1}
    monkeypatch.undo()
    standard_loop(monkeypatch)
    modules_only(monkeypatch)
    slow = pipeline("text-generation", model=model, tokenizer=tokenizer)(text, max_new_tokens=NEW, do_sample=False)
    assert fast[0]["generated_text"] == slow[0]["generated_text"]


def test_sequences_at_different_positions_under_an_all_ones_mask(monkeypatch):
    """Position ids of one's own (the second sequence 5 positions on) with no padding: the session's steps read each
    sequence's rotary rows (the rows of one position serve only where every sequence is at it), as the standard loop."""
    model = tiny_model(attn_implementation="sdpa")
    positions = torch.arange(UNPADDED.shape[1]).repeat(2, 1) + torch.tensor([[0], [5]])
    counts = same_as_standard(model, monkeypatch, UNPADDED, position_ids=positions)
    assert counts == {"loop": 1, "session": NEW - 2, "stack": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_greedy_step_takes_its_logits_and_tokens_from_one_head_pass(monkeypatch, dtype):
    """Greedy search with nothing to process: every decode step on the direct path gets its logits and tokens from one
    pass of the LM head, and the tokens are the standard loop's: the first decode step (the checked path) from
    `MemoryFormerLMHead.logits_and_argmax`, the session's steps from the same pass at the end of their kernel call
    (decode_session_step), or from that method where the loop is told to call the head apart (`_FUSED_HEAD`). A hook
    on the head, a logits processor or sampling: the head's module call and a separate argmax, as before."""
    model = tiny_model(attn_implementation="sdpa").to(dtype)
    calls = []
    both = modeling.MemoryFormerLMHead.logits_and_argmax

    def counting(self, hidden):
        out = both(self, hidden)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(modeling.MemoryFormerLMHead, "logits_and_argmax", counting)
    counts = same_as_standard(model, monkeypatch, UNPADDED)
    assert calls == [True] and counts == {"loop": 1, "session": NEW - 2, "stack": 1}
    plain = generate(model, UNPADDED)  # (transformers' loop: same_as_standard leaves it in place)
    monkeypatch.undo()
    for fused_head, called in ((False, NEW - 1), (True, 1)):
        monkeypatch.setattr(decode_loop, "_FUSED_HEAD", fused_head)
        monkeypatch.setattr(modeling.MemoryFormerLMHead, "logits_and_argmax", counting)
        calls.clear()
        assert torch.equal(generate(model, UNPADDED), plain)
        assert calls == [True] * called
        monkeypatch.undo()
    monkeypatch.setattr(modeling.MemoryFormerLMHead, "logits_and_argmax", counting)
    calls.clear()
    seen = []
    handle = model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    assert torch.equal(generate(model, UNPADDED), plain)
    handle.remove()
    assert calls == [] and len(seen) == NEW  # the prefill's call and every decode step's

    class Shift(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores

    assert torch.equal(generate(model, UNPADDED, logits_processor=LogitsProcessorList([Shift()])), plain)
    generate(model, UNPADDED, do_sample=True)
    assert calls == []


def after_a_checked_step(model):
    """(cache, positions, prompt length) after UNPADDED's prefill and one decode step on the checked path
    (decode_stack_run), which a session starts from; under inference mode."""
    length = UNPADDED.shape[1]
    cache = model(UNPADDED, use_cache=True).past_key_values
    positions = torch.full((2, 1), length)
    assert decode_loop.decode_stack_run(model, torch.tensor([[5], [9]]), None, positions, cache, None, None, {})
    return cache, positions, length


@pytest.mark.parametrize("bad", [128, -1])
def test_a_token_outside_the_vocabulary_makes_the_session_decline_and_write_nothing(bad):
    """The session's step (the kernel's decode_session_step: the embedding, the layers and the final norm in one call)
    checks every token before it writes: one outside [0, vocabulary) returns None and leaves the keys and values as
    the last step left them, which the cache takes when the session closes; the module path then raises the model's
    error. The cache's layers take the session's keys and values at the close, not before."""
    model = tiny_model(attn_implementation="sdpa")  # vocabulary of 128
    with torch.inference_mode():
        cache, positions, length = after_a_checked_step(model)
        before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        session = decode_loop._StackSession(model, cache, 2, positions + 1, length + 1)
        assert session.ok
        assert session.step(torch.tensor([[5], [bad]]), positions + 1, length + 1) is None
        session.close()
        for layer, (keys, values) in zip(cache.layers, before):
            assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
        with pytest.raises(ValueError, match=f"token id {bad}, outside the vocabulary"):
            model(torch.tensor([[5], [bad]]), past_key_values=cache, position_ids=positions + 1)
        session = decode_loop._StackSession(model, cache, 2, positions + 1, length + 1)
        hidden = session.step(torch.tensor([[5], [127]]), positions + 1, length + 1)
        assert hidden.shape == (2, 1, model.config.hidden_size) and cache.get_seq_length() == length + 1
        session.close()
        assert cache.get_seq_length() == length + 2
        with pytest.raises(RuntimeError, match="no open decode session"):
            memory_ops.fused_ops().decode_session_close(session.session)


def test_a_session_dropped_without_its_close_ends_in_the_kernel():
    model = tiny_model(attn_implementation="sdpa")
    with torch.inference_mode():
        cache, positions, length = after_a_checked_step(model)
        session = decode_loop._StackSession(model, cache, 2, positions + 1, length + 1)
        number = session.session
        del session
        with pytest.raises(RuntimeError, match="no open decode session"):
            memory_ops.fused_ops().decode_session_close(number)


def test_a_layer_whose_views_were_replaced_during_a_session_keeps_them_at_the_close():
    """The cache's layers keep the session's starting views until it closes; a step that finds one replaced declines,
    and the close leaves the replacement in place while the other layers take the session's last views."""
    model = tiny_model(attn_implementation="sdpa")
    with torch.inference_mode():
        cache, positions, length = after_a_checked_step(model)
        session = decode_loop._StackSession(model, cache, 2, positions + 1, length + 1)
        assert session.step(torch.tensor([[5], [9]]), positions + 1, length + 1) is not None
        first = cache.layers[0]
        mine = (first.keys.clone(), first.values.clone())
        first.keys, first.values = mine
        assert session.step(torch.tensor([[5], [9]]), positions + 2, length + 2) is None
        session.close()
        assert first.keys is mine[0] and first.values is mine[1]
        assert all(layer.keys.shape[2] == length + 2 for layer in cache.layers[1:])
