"""`memoryformer serve`: an OpenAI-compatible HTTP server for MemoryFormers, built on transformers' serving code
(FastAPI and uvicorn, the `[serving]` extra) with a batching generation manager of its own (`batching`)."""
