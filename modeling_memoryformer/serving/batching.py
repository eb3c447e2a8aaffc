"""Batched decoding for `memoryformer serve`: the generation manager transformers' serving handlers call, running
every request of one model in one decode batch.

transformers' continuous batching needs paged attention, which this model does not implement (its `generate_batch`
sizes a paged cache for a GPU and, on CPU, grew past 13 GB for a 2-layer d=64 model). This manager batches with the
model's ordinary `DynamicCache` instead:

- One worker thread per model owns the model. A request arrives in a queue; between decode steps the worker admits
  waiting requests while fewer than `max_batch_size` are running: it runs the request's prompt alone (a batch of
  one, exactly as `generate` does) and joins its cache to the batch's, left-padded to the longest row.
- Each decode step is one forward of all running rows (one token each, their own positions, the padding masked),
  then each row's next token by its own sampling settings; a row that ends (end-of-sequence token, max_tokens, a
  stop string, or its client gone) leaves the batch at once, and the columns no row needs any more are trimmed.
- Memory is bounded: at most `max_batch_size` rows of at most `max_request_tokens` tokens each hold a cache, and a
  request longer than that is refused before it runs. Waiting requests hold only their token ids.

A lone request runs the same forwards as `model.generate` (prompt, then one token at a time, no padding), so its
greedy tokens are `generate`'s. In a batch, a row's logits can differ from its lone run in the last bits (other
matrix shapes), as in any batched server.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
from dataclasses import dataclass, field

import torch
import transformers

# transformers' serving layer (the `[serving]` extra); this module is imported only by `memoryformer serve`.
from transformers.cli.serving.utils import BaseGenerateManager, DirectStreamer, _GenerationCancelled, _StreamError
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


class RequestTooLong(ValueError):
    """A request whose prompt plus max_tokens exceeds what the server holds per request."""


@dataclass
class _Request:
    input_ids: list[int]
    gen_config: object  # transformers.GenerationConfig
    on_token: object  # callable(int), from the worker thread; may raise _GenerationCancelled
    on_end: object  # callable(), from the worker thread
    on_error: object  # callable(Exception), from the worker thread
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Row:
    request: _Request
    processors: LogitsProcessorList
    sample: bool
    eos: set[int]
    stop_strings: list[str]
    tokens: list[int]  # prompt and generated so far
    generated: int = 0


class BatchedGenerateManager(BaseGenerateManager):
    """Runs the requests of one model in one decode batch (see the module docstring)."""

    def __init__(self, model, tokenizer, max_batch_size: int = 16, max_request_tokens: int | None = None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}.")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        limit = getattr(model.config, "max_position_embeddings", None)
        self.max_request_tokens = min(x for x in (max_request_tokens, limit) if x) if (max_request_tokens or limit) \
            else None
        self._pending: queue.Queue[_Request] = queue.Queue()
        self._stop = threading.Event()
        self._rows: list[_Row] = []
        self._cache = None  # DynamicCache of the running rows, [rows, heads, columns, head_dim] per layer
        self._mask = None  # int64 [rows, columns]: 1 where a row has a token
        self.peak_rows = 0  # the most rows decoded together so far
        self.dropped = 0  # rows that left because their client went away
        self._thread = threading.Thread(target=self._run, name="memoryformer-batcher", daemon=True)
        self._thread.start()

    # ---- the interface transformers' handlers call (on the event loop) ----

    def generate_streaming(self, model, processor, inputs, gen_config, request_id, **options):
        """`options`: what the running transformers release hands its streamer (a `response_parser` since 5.23,
        `tool_config` and `reasoning_config` before), passed on to its DirectStreamer; one it does not take is an
        error when set, never dropped."""
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        accepted = inspect.signature(DirectStreamer.__init__).parameters
        unknown = {name for name, value in options.items() if value is not None and name not in accepted}
        if unknown:
            raise ValueError(f"This server cannot honour {sorted(unknown)} with transformers "
                             f"{transformers.__version__}'s streamer; send the request without it.")
        streamer = DirectStreamer(getattr(processor, "tokenizer", processor)._tokenizer, loop, out,
                                  **{name: value for name, value in options.items() if name in accepted})
        ids = self._checked_ids(inputs, gen_config)
        streamer.put(torch.tensor(ids))  # the prompt, which the streamer skips

        def on_error(exc: Exception) -> None:
            loop.call_soon_threadsafe(out.put_nowait, _StreamError(str(exc)))

        request = _Request(ids, gen_config, lambda token: streamer.put(torch.tensor([token])), streamer.end, on_error,
                           streamer._cancelled)
        self._pending.put(request)
        return out, streamer

    async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        ids = self._checked_ids(inputs, gen_config)
        generated: list[int] = []

        def finish(result) -> None:
            if not done.done():
                (done.set_exception if isinstance(result, Exception) else done.set_result)(result)

        request = _Request(ids, gen_config, generated.append, lambda: loop.call_soon_threadsafe(finish, generated),
                           lambda exc: loop.call_soon_threadsafe(finish, exc))
        self._pending.put(request)
        try:
            tokens = await done
        except asyncio.CancelledError:  # the client went away: its row leaves the batch at the next step
            request.cancelled.set()
            raise
        text = processor.decode(tokens, skip_special_tokens=True)
        return text, len(ids), torch.tensor(tokens, dtype=torch.long)

    def stop(self) -> None:
        self._stop.set()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _checked_ids(self, inputs, gen_config) -> list[int]:
        ids = inputs["input_ids"]
        ids = ids[0].tolist() if isinstance(ids, torch.Tensor) else list(ids)
        if not ids:
            raise RequestTooLong("The prompt is empty: send at least one token of text.")
        wanted = len(ids) + (gen_config.max_new_tokens or 0)
        if self.max_request_tokens is not None and wanted > self.max_request_tokens:
            raise RequestTooLong(
                f"The prompt ({len(ids)} tokens) plus max_tokens ({gen_config.max_new_tokens}) is {wanted} tokens; "
                f"this server holds at most {self.max_request_tokens} per request. Shorten the prompt or lower "
                "max_tokens."
            )
        return ids

    # ---- the worker thread ----

    def _run(self) -> None:
        with torch.inference_mode():
            while not self._stop.is_set():
                try:
                    self._admit(block=not self._rows)
                    if self._rows:
                        self._decode_step()
                except Exception as exc:  # a failing step ends its rows with the error, never the worker
                    for row in self._rows:
                        row.request.on_error(exc)
                    self._rows, self._cache, self._mask = [], None, None

    def _admit(self, block: bool) -> None:
        while len(self._rows) < self.max_batch_size:
            try:
                request = self._pending.get(timeout=0.1) if block else self._pending.get_nowait()
            except queue.Empty:
                return
            block = False
            if request.cancelled.is_set():
                continue
            try:
                self._prefill(request)
            except _GenerationCancelled:
                continue
            except Exception as exc:
                request.on_error(exc)

    def _row_for(self, request: _Request) -> _Row:
        config = request.gen_config
        processors = LogitsProcessorList()
        if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
        sample = bool(config.do_sample)
        if sample:
            if config.temperature is not None and config.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(config.temperature))
            if config.top_k:
                processors.append(TopKLogitsWarper(config.top_k))
            if config.top_p is not None and config.top_p < 1.0:
                processors.append(TopPLogitsWarper(config.top_p))
        eos = config.eos_token_id
        eos = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        stops = config.stop_strings
        stops = [] if not stops else [stops] if isinstance(stops, str) else list(stops)
        return _Row(request, processors, sample, eos, stops, list(request.input_ids))

    def _next_token(self, row: _Row, logits: torch.Tensor) -> int:
        scores = row.processors(torch.tensor([row.tokens]), logits.float().unsqueeze(0))
        if row.sample:
            return int(torch.multinomial(torch.softmax(scores, -1), 1)[0, 0])
        return int(scores.argmax(-1)[0])

    def _emit(self, row: _Row, token: int) -> bool:
        """Hand the token to the request; whether the row goes on."""
        row.tokens.append(token)
        row.generated += 1
        row.request.on_token(token)  # raises _GenerationCancelled when the client is gone
        config = row.request.gen_config
        if token in row.eos or (config.max_new_tokens is not None and row.generated >= config.max_new_tokens):
            return False
        if row.stop_strings:
            tail = self.tokenizer.decode(row.tokens[-(row.generated if row.generated < 64 else 64):])
            if any(stop in tail for stop in row.stop_strings):
                return False
        return True

    def _prefill(self, request: _Request) -> None:
        from transformers import DynamicCache

        row = self._row_for(request)
        ids = torch.tensor([request.input_ids])
        cache = DynamicCache()
        out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, use_cache=True,
                         logits_to_keep=1)
        token = self._next_token(row, out.logits[0, -1])
        try:
            goes_on = self._emit(row, token)
        except _GenerationCancelled:
            raise
        if not goes_on:
            request.on_end()
            return
        self._join(row, out.past_key_values, ids.shape[1])

    @staticmethod
    def _layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in cache.layers]

    def _join(self, row: _Row, cache, length: int) -> None:
        from transformers import DynamicCache

        new_mask = torch.ones((1, length), dtype=torch.long)
        if not self._rows:
            self._rows, self._cache, self._mask = [row], cache, new_mask
            self.peak_rows = max(self.peak_rows, 1)
            return
        columns = max(self._mask.shape[1], length)

        def left_pad(t: torch.Tensor, to: int) -> torch.Tensor:
            return t if t.shape[-2] == to else torch.nn.functional.pad(t, (0, 0, to - t.shape[-2], 0))

        merged = []
        for (k, v), (nk, nv) in zip(self._layers(self._cache), self._layers(cache), strict=True):
            merged.append((torch.cat([left_pad(k, columns), left_pad(nk, columns)]),
                           torch.cat([left_pad(v, columns), left_pad(nv, columns)])))
        pad = torch.nn.functional.pad
        self._mask = torch.cat([pad(self._mask, (columns - self._mask.shape[1], 0)), pad(new_mask, (columns - length, 0))])
        self._cache = DynamicCache(merged)
        self._rows.append(row)
        self.peak_rows = max(self.peak_rows, len(self._rows))

    def _decode_step(self) -> None:
        from transformers import DynamicCache

        rows = self._rows
        last = torch.tensor([[row.tokens[-1]] for row in rows])
        positions = torch.tensor([[len(row.tokens) - 1] for row in rows])
        mask = torch.cat([self._mask, torch.ones((len(rows), 1), dtype=torch.long)], 1)
        out = self.model(input_ids=last, attention_mask=mask, position_ids=positions, past_key_values=self._cache,
                         use_cache=True, logits_to_keep=1)
        self._mask = mask
        keep = []
        for i, row in enumerate(rows):
            if row.request.cancelled.is_set():
                self.dropped += 1
                continue
            try:
                goes_on = self._emit(row, self._next_token(row, out.logits[i, -1]))
            except _GenerationCancelled:
                self.dropped += 1
                continue
            if goes_on:
                keep.append(i)
            else:
                row.request.on_end()
        if len(keep) == len(rows):
            self._cache = out.past_key_values
            return
        if not keep:
            self._rows, self._cache, self._mask = [], None, None
            return
        index = torch.tensor(keep)
        mask = self._mask[index]
        first = int((mask.sum(0) > 0).nonzero()[0])  # columns before it are padding in every remaining row
        self._mask = mask[:, first:]
        self._cache = DynamicCache([(k[index, :, first:], v[index, :, first:])
                                    for k, v in self._layers(out.past_key_values)])
        self._rows = [rows[i] for i in keep]
