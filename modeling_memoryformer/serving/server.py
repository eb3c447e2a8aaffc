"""`memoryformer serve MODEL`: the model behind an OpenAI-compatible HTTP endpoint.

Built on transformers' serving code (the `[serving]` extra: FastAPI, uvicorn, openai's types): its model manager
(subclassed to load through the Auto classes, which know MemoryFormer once this package is imported), and its
request handlers for /v1/completions and /v1/chat/completions (streaming or not, the tokenizer's chat template).
What differs from `transformers serve`: generation goes through `batching.ContinuousBatchingGenerateManager`
(transformers' continuous batching with per-request decoding settings, memory bounded), request fields are checked
before they run (`check_request_fields`), /v1/models lists the model served, /health reports the batching workers,
and every error comes back in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the server
still running.

Any causal LM loads (a Pythia twin too), so that a MemoryFormer and its dense twin can be served and timed the same
way (benchmarks/serve_bench.py).
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations (Request, dict) as objects.
import contextlib
import os
import threading
import time

from .settings import ServeSettings

SERVING_EXTRA = "pip install 'memoryformer-hf[serve]' (fastapi, uvicorn, openai: transformers' serving extra)"


def check_serving_available() -> None:
    """An ImportError naming the fix when transformers' serving dependencies are missing."""
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise ImportError(f"memoryformer serve needs transformers' serving dependencies: {SERVING_EXTRA}.")


def _error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _model_manager_class():
    from transformers.cli.serving.model_manager import ModelManager

    class MemoryFormerModelManager(ModelManager):
        """transformers' model manager, loading through AutoModelForCausalLM (the Auto classes know MemoryFormer)
        on the CPU, in the dtype asked for, its tables and LM head stored as `storage` asks (int8 or bfloat16,
        evaluation.settings.StorageSettings); the model is loaded once at start and never unloaded."""

        storage = None

        def _load_model(self, model_id_and_revision, tqdm_class=None, progress_callback=None, gguf_file=None):
            import modeling_memoryformer  # noqa: F401 (registers the Auto classes)
            from transformers import AutoModelForCausalLM

            # "org/model@revision", or a local path as it is (transformers 5.24 keeps paths without "@main")
            if os.path.exists(model_id_and_revision):
                model_id, revision = model_id_and_revision, None
            else:
                model_id, _, revision = model_id_and_revision.rpartition("@") if "@" in model_id_and_revision \
                    else (model_id_and_revision, "", None)
                model_id = model_id or model_id_and_revision
            model = AutoModelForCausalLM.from_pretrained(model_id, revision=revision or None, dtype=self.dtype)
            if self.storage is not None and self.storage.requested:
                if not hasattr(model, "quantize_tables"):
                    raise ValueError(f"--table-dtype / --lm-head-dtype store a MemoryFormer's tables; {model_id} is a "
                                     f"{type(model).__name__}. Serve it without them.")
                self.storage.apply(model)
            return model.eval()

    return MemoryFormerModelManager


def _generation_state_class():
    from transformers.cli.serving.utils import GenerationState

    from .batching import ContinuousBatchingGenerateManager

    class BatchingGenerationState(GenerationState):
        """One `ContinuousBatchingGenerateManager` per model served, in place of transformers' sequential or
        continuous batching ones (whose requests share the first request's sampling settings)."""

        def __init__(self, model_manager, max_batch_size: int, max_request_tokens: int | None,
                     max_batch_tokens: int):
            super().__init__(continuous_batching=True)
            self._model_manager = model_manager
            self._sizes = (max_batch_size, max_request_tokens, max_batch_tokens)
            self._batchers: dict[str, ContinuousBatchingGenerateManager] = {}
            self._lock = threading.Lock()

        def use_continuous_batching(self, model, modality) -> bool:
            return True  # the handlers then tokenize to lists and leave the KV cache to the manager

        def get_manager(self, model_id: str, use_cb: bool = False):
            with self._lock:
                if model_id not in self._batchers:
                    model, _ = self._model_manager.load_model_and_processor(model_id)
                    self._batchers[model_id] = ContinuousBatchingGenerateManager(model, *self._sizes)
                return self._batchers[model_id]

        def shutdown(self) -> None:
            for batcher in self._batchers.values():
                batcher.stop()
            super().shutdown()

        def is_cb_alive(self) -> bool:
            return all(batcher.is_alive() for batcher in self._batchers.values())

    return BatchingGenerationState


def _handler_classes():
    """transformers' completion and chat handlers, deciding greedy or sampled decoding the same way under every
    release: a request's `temperature` decides (0: greedy, above: sampled), a `top_p` alone samples, and a request
    naming neither decodes as the model's generation config says (as `generate` would); chat's
    `max_completion_tokens` (ignored by transformers 5.10's handler) wins over `max_tokens`."""
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler

    def build(handler_class, chat: bool):
        class Handler(handler_class):
            def _build_generation_config(self, body, model_generation_config, use_cb=False):
                config = super()._build_generation_config(body, model_generation_config, use_cb=use_cb)
                if chat and body.get("max_completion_tokens") is not None:
                    config.max_new_tokens = int(body["max_completion_tokens"])
                if body.get("temperature") is not None:
                    config.do_sample = float(body["temperature"]) > 0
                elif body.get("top_p") is not None and float(body["top_p"]) < 1:
                    config.do_sample = True
                return config

        Handler.__name__ = handler_class.__name__
        return Handler

    return build(CompletionHandler, chat=False), build(ChatCompletionHandler, chat=True)


def _invalid(name: str, message: str, code: str):
    from .batching import InvalidRequest

    return InvalidRequest(f"Invalid '{name}': {message}", name, code)


def _checked_number(body: dict, name: str, low=None, high=None, low_open: bool = False, integer: bool = False):
    """body[name] when it is absent (None) or a number in range; an InvalidRequest naming it otherwise, worded as
    OpenAI's API words it."""
    value = body.get(name)
    if value is None:
        return None
    kind = "integer" if integer else "decimal"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise _invalid(name, f"expected {'an integer' if integer else 'a number'}, but got {value!r} instead.",
                       "invalid_type")
    if low is not None and (value <= low if low_open else value < low):
        raise _invalid(name, f"{kind} below minimum value. Expected a value {'>' if low_open else '>='} {low}, but "
                             f"got {value} instead.", f"{kind}_below_min_value")
    if high is not None and value > high:
        raise _invalid(name, f"{kind} above maximum value. Expected a value <= {high}, but got {value} instead.",
                       f"{kind}_above_max_value")
    return value


def _unsupported(name: str, value, why: str):
    from .batching import UnsupportedRequest

    return UnsupportedRequest(f"Unsupported value for '{name}': {value!r}. {why}", name)


def check_request_fields(body: dict, chat: bool) -> None:
    """Refuse, before anything runs, a request field out of OpenAI's range (an InvalidRequest naming the field: a 400
    in OpenAI's error shape) or asking for what this server does not do (n > 1, log probabilities, penalties, a
    logit bias, echo, JSON output), instead of answering 200 with the field ignored."""
    for name in ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",):
        _checked_number(body, name, low=1, integer=True)
    _checked_number(body, "temperature", low=0, high=2)
    _checked_number(body, "top_p", low=0, high=1, low_open=True)
    _checked_number(body, "seed", integer=True)
    n = _checked_number(body, "n", low=1, integer=True)
    if n is not None and n != 1:
        raise _unsupported("n", n, "This server returns one choice per request: send n=1 (and several requests).")
    for name in ("frequency_penalty", "presence_penalty"):
        value = _checked_number(body, name, low=-2, high=2)
        if value:
            raise _unsupported(name, value, "transformers' continuous batching, which this server runs on, has no "
                                            "repetition penalties: send 0 or leave it out.")
    logit_bias = body.get("logit_bias")
    if logit_bias is not None and not isinstance(logit_bias, dict):
        raise _invalid("logit_bias", f"expected an object, but got {logit_bias!r} instead.", "invalid_type")
    if logit_bias:
        raise _unsupported("logit_bias", logit_bias, "This server applies no logit bias: leave it out.")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and all(
            isinstance(s, str) for s in stop))):
        raise _invalid("stop", f"expected a string or a list of strings, but got {stop!r} instead.", "invalid_type")
    if stop is not None and any(s == "" for s in ([stop] if isinstance(stop, str) else stop)):
        raise _invalid("stop", "a stop sequence cannot be empty.", "invalid_value")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise _invalid("stream", f"expected a boolean, but got {body['stream']!r} instead.", "invalid_type")
    if chat:
        if body.get("logprobs"):
            raise _unsupported("logprobs", body["logprobs"], "This server returns no log probabilities.")
        if body.get("top_logprobs") is not None:
            raise _unsupported("top_logprobs", body["top_logprobs"], "This server returns no log probabilities.")
        response_format = body.get("response_format")
        if response_format is not None and (not isinstance(response_format, dict)
                                            or response_format.get("type", "text") != "text"):
            raise _unsupported("response_format", response_format, "This server returns text only: leave it out "
                                                                   "or send {\"type\": \"text\"}.")
    else:
        best_of = _checked_number(body, "best_of", low=1, integer=True)
        if best_of is not None and best_of != 1:
            raise _unsupported("best_of", best_of, "This server decodes one sequence per request: send best_of=1.")
        if body.get("echo"):
            raise _unsupported("echo", body["echo"], "This server does not echo the prompt: send echo=false.")
        if body.get("logprobs") is not None:
            raise _unsupported("logprobs", body["logprobs"], "This server returns no log probabilities.")


async def _until_disconnected(request, handling):
    """Await `handling` (a handler's coroutine), cancelling it when the client goes away first: a non-streaming
    request then leaves the batch (its manager sees the cancellation) instead of decoding for nobody. A streaming
    request returns its response at once; its stream notices a disconnect itself."""
    import asyncio

    from fastapi.responses import JSONResponse

    task = asyncio.ensure_future(handling)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.1)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return JSONResponse(_error_body("The client closed the connection.", 499), status_code=499)


def build_app(settings: ServeSettings, storage=None):
    """The FastAPI app serving `settings.model` (loaded now, stored as `storage` asks), and its generation state."""
    check_serving_available()
    import logging

    logging.getLogger("transformers.cli.serving").setLevel(logging.ERROR)  # its per-request warnings
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    from .batching import InvalidRequest

    manager_class = _model_manager_class()
    manager_class.storage = storage
    manager = manager_class(device="cpu", dtype=settings.dtype, model_timeout=-1, force_model=settings.model)
    model_id = manager.process_model_name(settings.model)
    state = _generation_state_class()(manager, settings.max_batch_size, settings.max_request_tokens,
                                      settings.max_batch_tokens)
    state.get_manager(model_id)  # the batching worker starts with the server, not with the first request
    completion_class, chat_class = _handler_classes()
    chat = chat_class(model_manager=manager, generation_state=state)
    completion = completion_class(model_manager=manager, generation_state=state)
    created = int(time.time())

    app = FastAPI(title="MemoryFormer", docs_url=None, redoc_url=None)
    app.state.generation_state = state
    app.state.model_manager = manager

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return JSONResponse(_error_body(str(exc.detail), exc.status_code), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = f"Malformed request: {first.get('msg', 'the body is not valid JSON')}" + (
            f" (at {where})" if where else "") + ". Send a JSON object as in OpenAI's API."
        return JSONResponse(_error_body(message, 400, where), status_code=400)

    @app.exception_handler(InvalidRequest)
    async def invalid_request(request: Request, exc: InvalidRequest):
        return JSONResponse(_error_body(str(exc), 400, exc.param, exc.code), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        status = 400 if isinstance(exc, (ValueError, TypeError, KeyError)) else 500
        return JSONResponse(_error_body(f"{type(exc).__name__}: {exc}", status), status_code=status)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: dict):
        check_request_fields(body, chat=True)
        request_id = request.headers.get("x-request-id") or f"chatcmpl-{time.time_ns()}"
        return await _until_disconnected(request, chat.handle_request(body, request_id))

    @app.post("/v1/completions")
    async def completions(request: Request, body: dict):
        check_request_fields(body, chat=False)
        request_id = request.headers.get("x-request-id") or f"cmpl-{time.time_ns()}"
        return await _until_disconnected(request, completion.handle_request(body, request_id))

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": settings.model, "object": "model", "created": created,
                                            "owned_by": "memoryformer-hf"}]}

    @app.get("/health")
    def health():
        if not state.is_cb_alive():
            return JSONResponse({"status": "unhealthy", "reason": "the continuous batching worker stopped"},
                                status_code=503)
        return {"status": "ok", "model": settings.model}

    return app, state


class Server:
    """uvicorn running `build_app(settings)`; `start()` in a background thread (tests, benchmarks) or `run()`."""

    def __init__(self, settings: ServeSettings, storage=None):
        import uvicorn

        self.settings = settings
        self.app, self.state = build_app(settings, storage)
        self._server = uvicorn.Server(uvicorn.Config(self.app, host=settings.host, port=settings.port,
                                                     log_level="warning", lifespan="off"))
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The port listened on (the one the OS chose for port 0), once started."""
        for server in getattr(self._server, "servers", []) or []:
            for sock in server.sockets:
                return sock.getsockname()[1]
        return self.settings.port

    def start(self, timeout: float = 60.0) -> "Server":
        self._thread = threading.Thread(target=self._server.run, name="memoryformer-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"The server did not start on {self.settings.host}:{self.settings.port}.")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.state.shutdown()

    def run(self) -> None:
        self._server.run()
        self.state.shutdown()


def run_serve(settings: ServeSettings, storage=None) -> int:
    """`memoryformer serve`: load the model (stored as `storage` asks), then serve until interrupted."""
    import torch

    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    server = Server(settings, storage)
    print(f"serving {settings.model} on http://{settings.host}:{settings.port}/v1 (continuous batching, up to "
          f"{settings.max_batch_size} requests at once); Ctrl-C stops", flush=True)
    server.run()
    return 0
