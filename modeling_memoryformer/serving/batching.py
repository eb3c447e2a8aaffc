"""Continuous batching for `memoryformer serve`: the generation manager transformers' serving handlers call, on top of
transformers' own continuous batching (`model.init_continuous_batching`: a paged KV cache, prompts prefilled together
and in chunks, requests joining and leaving the running batch between forwards).

What this manager adds to transformers' `CBGenerateManager` (transformers/cli/serving/utils.py), which shares one
generation config (the first request's sampling settings) between all requests and sizes its cache from the memory of
the machine:

- Per-request decoding. A greedy request runs on a greedy continuous-batching manager (argmax, exactly `generate`'s
  choice); a sampling request on a second one (created at the first sampling request), whose temperature, top-k and
  top-p processors take each request's own values (`per_request_processors`). Two managers rather than one because a
  manager either samples or takes the argmax for all of its requests.
- Bounded memory. At most `max_batch_size` requests are running (sent to a manager) at once; more wait here holding
  only their token ids. A request longer than `max_request_tokens` (prompt plus max_tokens) is refused before it
  runs. Each manager's paged cache holds `max_batch_size` requests of `max_request_tokens` tokens (`num_blocks`),
  and a forward takes at most `max_batch_tokens` tokens (prompt chunks and decode tokens together): both passed
  explicitly, read from the running release's `ContinuousBatchingConfig` fields.
- Clients that go away: the request is cancelled in its manager (its cache blocks freed before the next forward) and
  its slot goes to the next waiting request.
- Stop strings, which continuous batching does not know: the text is watched as it is decoded; at a stop string the
  request is cancelled and its text ends before the stop (OpenAI's `stop`). Settings continuous batching cannot honour
  (a repetition penalty, ...) are refused with an error naming them, never dropped.

Everything here runs on the server's event loop: the managers deliver their outputs there (`register_result_handler`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

import torch
import transformers

# transformers' serving layer (the `[serving]` extra); this module is imported only by `memoryformer serve`.
from transformers.cli.serving.utils import BaseGenerateManager, CBStreamer, _StreamError
from transformers.generation.configuration_utils import ContinuousBatchingConfig

# Tokens per page of the paged cache: a request holds ceil(tokens / PAGE_SIZE) pages of every layer.
PAGE_SIZE = 64


class InvalidRequest(ValueError):
    """A request the server refuses (HTTP 400 in OpenAI's error shape): `param` names the request field at fault,
    `code` says why, as OpenAI's codes do."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class RequestTooLong(InvalidRequest):
    """A request whose prompt plus max_tokens exceeds what the server holds per request."""

    def __init__(self, message: str, param: str | None = "max_tokens"):
        super().__init__(message, param, "context_length_exceeded")


class UnsupportedRequest(InvalidRequest):
    """A request asking for something this server cannot do."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message, param, "unsupported_value")


def continuous_batching_config(max_batch_size: int, max_request_tokens: int, max_batch_tokens: int,
                               **options) -> ContinuousBatchingConfig:
    """transformers' `ContinuousBatchingConfig` for `max_batch_size` requests of at most `max_request_tokens` tokens,
    every size given (left unset, the paged cache is sized from the machine's memory: past 13 GB on a CPU). The
    fields are the running release's: the page size is `page_size` (5.23) or `block_size` (5.10);
    `max_requests_per_batch`, `safety_margin` (held back new prompts below a fifth of free blocks in 5.10) and
    `auto_switch_to_flash` exist in some releases only, and are set where they do."""
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    page_field = "page_size" if "page_size" in fields else "block_size"
    pages_per_request = math.ceil(max_request_tokens / PAGE_SIZE) + 1  # + 1: the page a new token may open
    wanted = {page_field: PAGE_SIZE, "num_blocks": max_batch_size * pages_per_request,
              "max_batch_tokens": max_batch_tokens, "use_async_batching": False, "use_cuda_graph": False}
    optional = {"max_requests_per_batch": max_batch_size, "safety_margin": 0.0, "auto_switch_to_flash": False}
    wanted.update({name: value for name, value in optional.items() if name in fields})
    wanted.update(options)
    return ContinuousBatchingConfig(**wanted)


class _StopText:
    """Text as it is decoded, up to the first of `stops`: `feed` returns what can be sent now, holding back a tail
    that may be the start of a stop string; `hit` once one is complete."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.held = ""
        self.hit = False

    def feed(self, text: str) -> str:
        text = self.held + text
        found = [i for i in (text.find(stop) for stop in self.stops) if i >= 0]
        if found:
            self.hit, self.held = True, ""
            return text[:min(found)]
        keep = max((n for stop in self.stops for n in range(1, min(len(stop), len(text) + 1))
                    if text.endswith(stop[:n])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        text, self.held = self.held, ""
        return text


class _StopFilterQueue:
    """The asyncio.Queue transformers' CBStreamer writes to, passing plain text through `_StopText` (typed items,
    reasoning text or tool calls, pass as they are) and calling `on_stop` when a stop string is complete."""

    def __init__(self, queue: asyncio.Queue, stops: _StopText, on_stop):
        self.queue, self.stops, self.on_stop = queue, stops, on_stop

    def put_nowait(self, item) -> None:
        if self.stops.hit:
            return
        if type(item) is str:
            text = self.stops.feed(item)
            if text:
                self.queue.put_nowait(text)
            if self.stops.hit:
                self.on_stop()
            return
        held = self.stops.flush()
        if held:
            self.queue.put_nowait(held)
        self.queue.put_nowait(item)


@dataclass(eq=False)
class _Job:
    """One request: its token ids and decoding settings, and what to do with its tokens."""

    request_id: str
    input_ids: list[int]
    max_new_tokens: int
    eos_token_id: object
    sample: bool
    sampling: dict  # temperature, top_k, top_p: the per-request processors' keywords
    on_output: object = None  # callable(GenerationOutput) -> bool (False: a stop string ended the request)
    on_end: object = None  # callable(error message or None)
    state: str = "waiting"  # waiting, running, done
    cancelled_by_client: bool = False
    tokens: list[int] = field(default_factory=list)


class _Stream:
    """What a handler holds of a streaming request: its token count and a way to cancel it."""

    def __init__(self, manager: ContinuousBatchingGenerateManager, job: _Job):
        self._manager, self._job = manager, job

    @property
    def total_tokens(self) -> int:
        return len(self._job.tokens)

    def cancel(self) -> None:
        self._manager.cancel(self._job, by_client=True)


class ContinuousBatchingGenerateManager(BaseGenerateManager):
    """Runs the requests of one model through transformers' continuous batching (see the module docstring)."""

    def __init__(self, model, max_batch_size: int = 16, max_request_tokens: int | None = None,
                 max_batch_tokens: int = 512):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}.")
        if not hasattr(model, "init_continuous_batching"):
            raise ValueError(f"{type(model).__name__} has no init_continuous_batching: transformers' continuous "
                             "batching cannot run it.")
        self.model = model
        self.max_batch_size = max_batch_size
        limit = getattr(model.config, "max_position_embeddings", None)
        limits = [x for x in (max_request_tokens, limit) if x]
        if not limits:
            raise ValueError("The model has no max_position_embeddings: give max_request_tokens.")
        self.max_request_tokens = min(limits)
        self.vocab_size = model.config.get_text_config().vocab_size
        self.cb_config = continuous_batching_config(max_batch_size, self.max_request_tokens, max_batch_tokens)
        self._engines: dict[bool, object] = {}  # sample -> transformers' ContinuousBatchingManager
        self._waiting: deque[_Job] = deque()
        self._running: dict[str, _Job] = {}
        self._ids = itertools.count()
        self._stopping = False
        self.peak_running = 0  # the most requests running together so far
        self.dropped = 0  # requests cancelled because their client went away
        self._engine(sample=False)  # the greedy manager starts with the server

    # ---- transformers' continuous batching managers ----

    def _engine(self, sample: bool):
        if sample not in self._engines:
            from transformers import GenerationConfig

            if sample:  # placeholders that make the processors exist; every request passes its own values
                config = GenerationConfig(do_sample=True, temperature=0.5, top_k=2, top_p=0.5, eos_token_id=-1)
                options = {"per_request_processors": True}
            else:
                config = GenerationConfig(do_sample=False, eos_token_id=-1)
                options = {}
            cb_config = dataclasses.replace(self.cb_config, **options)
            engine = self.model.init_continuous_batching(generation_config=config, continuous_batching_config=cb_config)
            with torch.inference_mode():  # the generation loop runs under the caller's inference mode (5.24)
                engine.start()
            self._engines[sample] = engine
        return self._engines[sample]

    @staticmethod
    def _fatal_error(engine):
        status = getattr(engine, "background_thread_status", None)  # 5.23; the manager itself before
        return getattr(status if status is not None else engine, "fatal_error", None)

    def is_alive(self) -> bool:
        return all(engine.is_running() and self._fatal_error(engine) is None for engine in self._engines.values())

    def stop(self) -> None:
        """Cancel what runs, forget what waits, stop the managers (the server is shutting down: no handler is left to
        hear of it)."""
        self._stopping = True
        for job in list(self._running.values()):
            self._release(job, cancel=True)
            job.state = "done"
        for job in self._waiting:
            job.state = "done"
        self._waiting.clear()
        for engine in self._engines.values():
            engine.stop(block=True, timeout=5)
        self._engines.clear()

    # ---- the interface transformers' handlers call (on the event loop) ----

    def generate_streaming(self, model, processor, inputs, gen_config, request_id, **options):
        """`options`: what the running release's handler hands its streamer (`response_parser` since 5.23,
        `tool_config` and `reasoning_config` before), passed on to its CBStreamer; one it does not take is an error
        when set, never dropped."""
        accepted = inspect.signature(CBStreamer.__init__).parameters
        unknown = {name for name, value in options.items() if value is not None and name not in accepted}
        if unknown:
            raise ValueError(f"This server cannot honour {sorted(unknown)} with transformers "
                             f"{transformers.__version__}'s streamer; send the request without it.")
        job = self._job(inputs, gen_config, request_id)
        queue: asyncio.Queue = asyncio.Queue()
        stops = _StopText(self._stop_strings(gen_config))
        target = _StopFilterQueue(queue, stops, lambda: self.cancel(job)) if stops.stops else queue
        streamer = CBStreamer(self._engine(job.sample), job.request_id,
                              getattr(processor, "tokenizer", processor)._tokenizer, asyncio.get_running_loop(),
                              target, **{name: value for name, value in options.items() if name in accepted})

        def on_output(output) -> None:
            streamer.put(output)

        def on_end(error: str | None) -> None:
            if error is not None:
                queue.put_nowait(_StreamError(error))
            if stops.hit:  # the stream ends at the stop string, the rest of the held text with it
                queue.put_nowait(None)
            else:
                streamer.end()

        job.on_output, job.on_end = on_output, on_end
        self._submit(job)
        return queue, _Stream(self, job)

    async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
        from tokenizers.decoders import DecodeStream

        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        job = self._job(inputs, gen_config, request_id)
        stops = _StopText(self._stop_strings(gen_config))
        pieces: list[str] = []
        decoder = DecodeStream([], skip_special_tokens=True) if stops.stops else None
        rust_tokenizer = getattr(processor, "tokenizer", processor)._tokenizer

        def on_output(output) -> None:
            if decoder is None:
                return
            for token in output.generated_tokens[len(pieces):]:
                text = decoder.step(rust_tokenizer, token)
                pieces.append(stops.feed(text) if text else "")
                if stops.hit:
                    self.cancel(job)
                    return

        def on_end(error: str | None) -> None:
            if done.done():
                return
            if error is not None:
                done.set_exception(RuntimeError(f"Generation failed: {error}"))
            elif decoder is None:
                done.set_result(processor.decode(job.tokens, skip_special_tokens=True))
            else:
                done.set_result("".join(pieces) + ("" if stops.hit else stops.flush()))

        job.on_output, job.on_end = on_output, on_end
        self._submit(job)
        try:
            text = await done
        except asyncio.CancelledError:  # the client went away: its request leaves the batch now
            self.cancel(job, by_client=True)
            raise
        return text, len(job.input_ids), list(job.tokens)

    def cancel(self, job: _Job, by_client: bool = False) -> None:
        """End `job` now: cancelled in its manager if running, forgotten if waiting."""
        if job.state == "done":
            return
        job.cancelled_by_client = by_client
        if by_client:
            self.dropped += 1
        self._finish(job, None, cancel=True)

    # ---- checks ----

    def _job(self, inputs, gen_config, request_id: str) -> _Job:
        ids = inputs["input_ids"]
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        if ids and isinstance(ids[0], list):  # a batch of one
            (ids,) = ids
        if not ids:
            raise InvalidRequest("The prompt is empty: send at least one token of text.", "prompt", "invalid_value")
        max_new_tokens = gen_config.max_new_tokens
        if max_new_tokens is None or max_new_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {max_new_tokens}.", "max_tokens",
                                 "integer_below_min_value")
        wanted = len(ids) + max_new_tokens
        if wanted > self.max_request_tokens:
            raise RequestTooLong(
                f"The prompt ({len(ids)} tokens) plus max_tokens ({max_new_tokens}) is {wanted} tokens; this server "
                f"holds at most {self.max_request_tokens} per request. Shorten the prompt or lower max_tokens.")
        self._check_supported(gen_config)
        sample = bool(gen_config.do_sample)
        sampling = {}
        if sample:
            temperature = 1.0 if gen_config.temperature is None else float(gen_config.temperature)
            top_p = 1.0 if gen_config.top_p is None else float(gen_config.top_p)
            top_k = int(gen_config.top_k) if gen_config.top_k else self.vocab_size
            if temperature <= 0:
                raise InvalidRequest(f"temperature must be > 0 to sample, got {temperature}.", "temperature",
                                     "invalid_value")
            if not 0 < top_p <= 1:
                raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}.", "top_p", "invalid_value")
            sampling = {"temperature": temperature, "top_k": min(max(top_k, 1), self.vocab_size), "top_p": top_p}
        eos = gen_config.eos_token_id
        return _Job(f"{request_id}#{next(self._ids)}", ids, max_new_tokens, -1 if eos is None else eos, sample,
                    sampling)

    # Generation settings continuous batching cannot honour (its logits processors are temperature, top-k and top-p
    # only), with the neutral value each must have; the request field that sets it, where there is one.
    _UNSUPPORTED = {
        "repetition_penalty": (1.0, "frequency_penalty"), "sequence_bias": (None, "logit_bias"),
        "num_beams": (1, None), "num_return_sequences": (1, "n"), "no_repeat_ngram_size": (0, None),
        "bad_words_ids": (None, None), "min_new_tokens": (None, None), "min_length": (0, None),
        "min_p": (None, None), "typical_p": (1.0, None), "epsilon_cutoff": (0.0, None), "eta_cutoff": (0.0, None),
        "suppress_tokens": (None, None), "begin_suppress_tokens": (None, None), "forced_bos_token_id": (None, None),
        "forced_eos_token_id": (None, None), "exponential_decay_length_penalty": (None, None),
    }

    def _check_supported(self, gen_config) -> None:
        for name, (neutral, param) in self._UNSUPPORTED.items():
            value = getattr(gen_config, name, None)
            if value is not None and value != neutral and not (name in ("min_length", "no_repeat_ngram_size")
                                                                and not value):
                where = f"the request's {param}" if param else "the model's generation config"
                raise UnsupportedRequest(
                    f"{name}={value!r} ({where}) is not supported: transformers' continuous batching, which this "
                    f"server runs on, applies only temperature, top_k and top_p. Send the request without it.",
                    param)

    @staticmethod
    def _stop_strings(gen_config) -> list[str]:
        stops = gen_config.stop_strings
        stops = [] if not stops else [stops] if isinstance(stops, str) else list(stops)
        if not all(isinstance(stop, str) and stop for stop in stops):
            raise InvalidRequest(f"stop must be a non-empty string or a list of them, got {stops!r}.", "stop",
                                 "invalid_value")
        return stops

    # ---- admission: at most max_batch_size running ----

    def _submit(self, job: _Job) -> None:
        for engine in self._engines.values():
            error = self._fatal_error(engine)
            if error is not None:
                raise RuntimeError(f"The continuous batching worker stopped ({error}); restart the server.")
        self._waiting.append(job)
        self._admit()

    def _admit(self) -> None:
        while not self._stopping and self._waiting and len(self._running) < self.max_batch_size:
            job = self._waiting.popleft()
            try:
                self._start(job)
            except Exception as exc:  # a request that cannot start ends with its error; the others go on
                self._finish(job, f"{type(exc).__name__}: {exc}")

    def _start(self, job: _Job) -> None:
        engine = self._engine(job.sample)
        job.state = "running"
        self._running[job.request_id] = job
        self.peak_running = max(self.peak_running, len(self._running))
        engine.register_result_handler(job.request_id, lambda output: self._on_output(job, output))
        added = engine.add_request(job.input_ids, request_id=job.request_id, max_new_tokens=job.max_new_tokens,
                                   streaming=True, eos_token_id=job.eos_token_id, **job.sampling)
        if added is None:
            raise RuntimeError("The continuous batching manager is not accepting requests (shutting down).")

    def _on_output(self, job: _Job, output) -> None:
        if job.state != "running":
            return
        job.tokens.extend(output.generated_tokens[len(job.tokens):])
        if output.error is not None:
            self._finish(job, str(output.error))
            return
        job.on_output(output)
        if job.state == "running" and output.is_finished():
            self._finish(job, None)

    def _finish(self, job: _Job, error: str | None, cancel: bool = False) -> None:
        """`job` is over: its slot goes to the next waiting request, its handler hears of its end."""
        if job.state == "done":
            return
        if job.state == "running":
            self._release(job, cancel)
        elif job in self._waiting:
            self._waiting.remove(job)
        job.state = "done"
        if not job.cancelled_by_client:
            job.on_end(error)
        self._admit()

    def _release(self, job: _Job, cancel: bool) -> None:
        """`job` leaves the running requests: cancelled in its manager (its cache blocks freed before the next
        forward) when it had not finished there, and its output handler dropped (none is called after a cancel)."""
        del self._running[job.request_id]
        engine = self._engines.get(job.sample)
        if engine is None:
            return
        if cancel:
            engine.cancel_request(job.request_id)
        router = getattr(engine, "output_router", None)
        if router is not None:
            with router._lock:
                router.result_handlers.pop(job.request_id, None)

    @property
    def running(self) -> int:
        """Requests running now (sent to a continuous batching manager, holding its cache)."""
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)
