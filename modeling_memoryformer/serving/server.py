"""`memoryformer serve MODEL`: the model behind an OpenAI-compatible HTTP endpoint.

Built on transformers' serving code (the `[serving]` extra: FastAPI, uvicorn, openai's types): its model manager
(subclassed to load through the Auto classes, which know MemoryFormer once this package is imported), and its
request handlers for /v1/completions and /v1/chat/completions (streaming or not, the tokenizer's chat template).
What differs from `transformers serve`: generation goes through `batching.BatchedGenerateManager` (every request of
the model in one decode batch, memory bounded), /v1/models lists the model served, /health reports the batching
worker, and every error comes back in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the
server still running.

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

    from .batching import BatchedGenerateManager

    class BatchingGenerationState(GenerationState):
        """One `BatchedGenerateManager` per model served, in place of transformers' sequential or paged ones."""

        def __init__(self, model_manager, max_batch_size: int, max_request_tokens: int | None):
            super().__init__(continuous_batching=False)
            self._model_manager = model_manager
            self._max_batch_size = max_batch_size
            self._max_request_tokens = max_request_tokens
            self._batchers: dict[str, BatchedGenerateManager] = {}
            self._lock = threading.Lock()

        def use_continuous_batching(self, model, modality) -> bool:
            return False

        def get_manager(self, model_id: str, use_cb: bool = False):
            with self._lock:
                if model_id not in self._batchers:
                    model, processor = self._model_manager.load_model_and_processor(model_id)
                    self._batchers[model_id] = BatchedGenerateManager(
                        model, getattr(processor, "tokenizer", processor), self._max_batch_size,
                        self._max_request_tokens)
                return self._batchers[model_id]

        def shutdown(self) -> None:
            for batcher in self._batchers.values():
                batcher.stop()
            super().shutdown()

        def is_cb_alive(self) -> bool:
            return all(batcher.is_alive() for batcher in self._batchers.values())

    return BatchingGenerationState


async def _until_disconnected(request, handling):
    """Await `handling` (a handler's coroutine), cancelling it when the client goes away first: a non-streaming
    request's row then leaves the batch (its manager sees the cancellation) instead of decoding for nobody. A streaming
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
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler

    from .batching import RequestTooLong

    manager_class = _model_manager_class()
    manager_class.storage = storage
    manager = manager_class(device="cpu", dtype=settings.dtype, model_timeout=-1, force_model=settings.model)
    model_id = manager.process_model_name(settings.model)
    state = _generation_state_class()(manager, settings.max_batch_size, settings.max_request_tokens)
    state.get_manager(model_id)  # the batching worker starts with the server, not with the first request
    chat = ChatCompletionHandler(model_manager=manager, generation_state=state)
    completion = CompletionHandler(model_manager=manager, generation_state=state)
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

    @app.exception_handler(RequestTooLong)
    async def too_long(request: Request, exc: RequestTooLong):
        return JSONResponse(_error_body(str(exc), 400, "max_tokens", "context_length_exceeded"), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        status = 400 if isinstance(exc, (ValueError, TypeError, KeyError)) else 500
        return JSONResponse(_error_body(f"{type(exc).__name__}: {exc}", status), status_code=status)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: dict):
        request_id = request.headers.get("x-request-id") or f"chatcmpl-{time.time_ns()}"
        return await _until_disconnected(request, chat.handle_request(body, request_id))

    @app.post("/v1/completions")
    async def completions(request: Request, body: dict):
        request_id = request.headers.get("x-request-id") or f"cmpl-{time.time_ns()}"
        return await _until_disconnected(request, completion.handle_request(body, request_id))

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": settings.model, "object": "model", "created": created,
                                            "owned_by": "memoryformer-hf"}]}

    @app.get("/health")
    def health():
        if not state.is_cb_alive():
            return JSONResponse({"status": "unhealthy", "reason": "the batching worker stopped"}, status_code=503)
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
    print(f"serving {settings.model} on http://{settings.host}:{settings.port}/v1 (batches of up to "
          f"{settings.max_batch_size}); Ctrl-C stops", flush=True)
    server.run()
    return 0
