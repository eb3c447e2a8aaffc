"""The options of `memoryformer serve`: `ServeSettings`, from whose fields the command line is made
(`cli.arguments`). A light module (standard library only), so that `--help` answers at once."""

from __future__ import annotations

from dataclasses import dataclass

from ..training.settings import option, required


@dataclass
class ServeSettings:
    """`memoryformer serve`: one model behind an OpenAI-compatible endpoint (/v1/completions, /v1/chat/completions,
    /v1/models, /health), requests decoded together by transformers' continuous batching (a paged KV cache)."""

    model: str = required("the model: a folder written by save_pretrained (with its tokenizer) or a Hub id",
                          metavar="MODEL", positional=True)
    host: str = option("127.0.0.1", "address to listen on (0.0.0.0: every interface)")
    port: int = option(8000, "port to listen on (0: any free port, printed at start)")
    dtype: str = option("float32", "dtype of the model's computation", choices=("float32", "bfloat16"))
    max_batch_size: int = option(
        16, "requests decoded together at most (the paged KV cache holds this many of --max-request-tokens); more "
        "wait in a queue holding only their token ids")
    max_request_tokens: int | None = option(
        None, "prompt plus max_tokens of one request at most (default: the model's max_position_embeddings); "
        "longer requests are refused with an error", metavar="N")
    max_batch_tokens: int = option(
        512, "tokens in one forward at most, prompt chunks and decode tokens together (longer prompts are prefilled "
        "in chunks)", metavar="N")
    threads: int | None = option(None, "torch threads (default: torch's choice, one per core)", metavar="N")

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}.")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}.")
        if self.max_batch_tokens < self.max_batch_size:
            raise ValueError(f"max_batch_tokens ({self.max_batch_tokens}) must be at least max_batch_size "
                             f"({self.max_batch_size}): a decode step takes one token of every running request.")
        if self.max_request_tokens is not None and self.max_request_tokens < 2:
            raise ValueError(f"max_request_tokens must be >= 2, got {self.max_request_tokens}.")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}.")
