"""`memoryformer serve`: an OpenAI-compatible HTTP server for MemoryFormers, built on transformers' serving code
(FastAPI and uvicorn, the `[serving]` extra) and its continuous batching (a paged KV cache), through a generation
manager of its own (`batching`: per-request decoding settings, bounded memory, stop strings)."""
