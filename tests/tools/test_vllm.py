"""vLLM serves a saved MemoryFormer through its Transformers backend (docs/serving.md, "vLLM"): a tiny model saved
here with its remote code, run in the vLLM venv that `scripts/vllm_venv.sh` builds, gives `model.generate`'s greedy
tokens token for token, through the offline `LLM` API and through `vllm serve` (4 concurrent clients of its
OpenAI-compatible /v1/completions).

The vLLM venv is named by MEMORYFORMER_VLLM_PYTHON (its interpreter; `make test` sets it). Without it every test here
skips and says how to build the venv; a variable that names no interpreter fails.

The model: head_dim 64 (vLLM's CPU attention refuses 16), hash tables initialised with std 0.5 so that greedy tokens
have clear argmax gaps (tests/conftest.py says why), float32 on both sides. Only loopback addresses are used: the
server listens on 127.0.0.1, and VLLM_HOST_IP keeps vLLM's own engine sockets there too.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from modeling_memoryformer import MemoryFormerConfig, MemoryFormerForCausalLM

pytestmark = pytest.mark.slow  # each test starts a vLLM engine in another venv: 30 s to 2 minutes on 2 cores

VLLM_PYTHON = os.environ.get("MEMORYFORMER_VLLM_PYTHON", "")
WORKER = Path(__file__).resolve().parent / "_vllm_worker.py"
OFFLINE_TIMEOUT = 300  # seconds for the whole offline run (35 to 60 s on 2 cores)
SERVER_START_TIMEOUT = 300  # seconds until /health answers (50 to 95 s)
REQUEST_TIMEOUT = 60
MAX_TOKENS = 16

TEXT = ["the quick brown fox jumps over the lazy dog", "memory layers replace dense layers with hash tables",
        "a bucket of rows for every chunk of the input"] * 20
# Prompts of different lengths (in tokens: from 1 to a dozen), as ids for the offline API, as text for the server.
TOKEN_PROMPTS = [[7], [5, 17, 42, 3], [11, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12]]
TEXT_PROMPTS = ["a", "the quick brown", "memory layers replace dense layers", "the lazy dog jumps over a bucket of rows"]

if not VLLM_PYTHON:
    pytest.skip("no vLLM venv: build it with `make vllm` (scripts/vllm_venv.sh .venv-vllm python3.11) and set "
                "MEMORYFORMER_VLLM_PYTHON=.venv-vllm/bin/python (`make test` does both)", allow_module_level=True)


def metaspace_tokenizer():
    """A 120-token BPE over characters (SentencePiece's metaspace), trained here: the tests need nothing outside
    the repository."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"], show_progress=False)
    tokenizer.train_from_iterator(TEXT, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>", pad_token="</s>")


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    python = Path(VLLM_PYTHON)
    if not (python.is_file() and os.access(python, os.X_OK)):
        pytest.fail(f"MEMORYFORMER_VLLM_PYTHON={VLLM_PYTHON} is not an interpreter: build the venv with "
                    "scripts/vllm_venv.sh (`make vllm`) or unset the variable")
    return python


def tiny_model() -> MemoryFormerForCausalLM:
    torch.manual_seed(0)
    config = MemoryFormerConfig(
        vocab_size=len(metaspace_tokenizer()), hidden_size=128, num_hidden_layers=2, num_attention_heads=2,  # head_dim 64
        max_position_embeddings=128, hash_bits=4, expand_bits=2, table_init_std=0.5, initializer_range=0.5,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    return MemoryFormerForCausalLM(config).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(folder, tokenizer, model): a tiny MemoryFormer saved with its remote code and a tokenizer."""
    folder = tmp_path_factory.mktemp("vllm") / "model"
    tokenizer, model = metaspace_tokenizer(), tiny_model()
    model.register_for_auto_class("AutoModelForCausalLM")  # auto_map + the model files: loads with trust_remote_code
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, tokenizer, model


@pytest.fixture(scope="module")
def saved_int8(tmp_path_factory):
    """(folder, model): the same model with int8 tables (docs/quantization.md), saved as such."""
    folder = tmp_path_factory.mktemp("vllm-int8") / "model"
    model = tiny_model().quantize_tables("int8")
    model.save_pretrained(folder)
    return folder, model


def generate_greedy(model, ids: list[int], max_new_tokens: int = MAX_TOKENS) -> list[int]:
    """The oracle: `model.generate`'s greedy tokens for one prompt alone, float32."""
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                             do_sample=False)
    return out[0, len(ids):].tolist()


def vllm_env(tmp: Path) -> dict[str, str]:
    """The environment of a vLLM process: offline, loopback only, no usage report, the Hub cache (where remote code is
    copied) in `tmp`. vLLM's own cache stays where it is: without the model facts it keeps there, every engine start
    inspects the model in one more interpreter (20 s). The KV cache is sized by an argument: vLLM's CPU default asks
    for 92% of the machine's RAM."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "HF_ENDPOINT")}
    env.update(
        VLLM_HOST_IP="127.0.0.1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp / "hf-home"), TOKENIZERS_PARALLELISM="false",
    )
    return env


def tail(text: str, limit: int = 6000) -> str:
    return text if len(text) <= limit else "...\n" + text[-limit:]


def test_offline_llm_gives_generate_greedy_tokens(saved, saved_int8, vllm_python, tmp_path):
    """The offline API, float32 tables and int8 tables (one engine each, in one vLLM process)."""
    (folder, _, model), (int8_folder, int8_model) = saved, saved_int8
    expected = [[generate_greedy(m, ids) for ids in TOKEN_PROMPTS] for m in (model, int8_model)]
    assert expected[0] != expected[1]  # int8 rounding moves some tokens: the second run checks something of its own
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"folders": [str(folder), str(int8_folder)], "prompts": TOKEN_PROMPTS,
                                "max_tokens": MAX_TOKENS}))
    try:
        result = subprocess.run([str(vllm_python), str(WORKER), str(spec)], env=vllm_env(tmp_path), cwd=tmp_path,
                                capture_output=True, text=True, timeout=OFFLINE_TIMEOUT, check=False)
    except subprocess.TimeoutExpired as timeout:
        pytest.fail(f"vLLM did not finish in {OFFLINE_TIMEOUT} s:\n{tail(str(timeout.stderr or ''))}")
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, f"vLLM failed (exit {result.returncode}):\n{tail(result.stderr)}"
    reports = json.loads(lines[-1].removeprefix("RESULT "))
    # vLLM ran the folder's own MemoryFormer code (remote code) inside its Transformers backend: Memory Layers as they
    # are, the embedding, the LayerNorms and the attention replaced by vLLM's (docs/serving.md says so).
    for report in reports:
        assert report["built"] == {
            "vllm_class": "TransformersForCausalLM",
            "model_class": "MemoryFormerModel",
            "model_module": report["built"]["model_module"],
            "qkv_class": "MemoryLayer",
            "memory_block_classes": ["MemoryLayer", "MemoryLayer"],
            "embedding_class": "vllm.model_executor.layers.vocab_parallel_embedding.VocabParallelEmbedding",
            "norm_classes": ["vllm.model_executor.layers.layernorm.LayerNorm"] * 3,
            "attention_implementation": "vllm",
            "vllm_attention_class": "Attention",
        }
        assert report["built"]["model_module"].startswith("transformers_modules."), report["built"]
    assert [report["tokens"] for report in reports] == expected


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post_json(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as response:
            return json.load(response)
    except urllib.error.HTTPError as error:
        raise AssertionError(f"{url}: HTTP {error.code}: {error.read().decode(errors='replace')}") from error


def wait_until_healthy(server: subprocess.Popen, base: str, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"vllm serve exited with status {server.returncode}:\n{tail(log.read_text(errors='replace'))}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    pytest.fail(f"vllm serve did not answer /health in {SERVER_START_TIMEOUT} s:\n"
                f"{tail(log.read_text(errors='replace'))}")


def stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (it was started in a session of its own, with its engine and worker
    processes), then SIGKILL if it has not exited within 30 s."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
            return
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.wait(timeout=30)


def test_vllm_serve_gives_generate_greedy_tokens_to_four_concurrent_clients(saved, vllm_python, tmp_path):
    """`vllm serve` in its default layout (API server, engine and worker processes) with the folder's tokenizer:
    4 text prompts sent at once (vLLM batches them into one forward) each get generate's greedy tokens."""
    folder, tokenizer, model = saved
    prompt_ids = [tokenizer(prompt).input_ids for prompt in TEXT_PROMPTS]
    expected = [generate_greedy(model, ids) for ids in prompt_ids]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "vllm-serve.log"
    command = [
        str(vllm_python.with_name("vllm")), "serve", str(folder), "--model-impl", "transformers",
        "--trust-remote-code", "--dtype", "float32", "--max-model-len", "128", "--enforce-eager",
        "--kv-cache-memory-bytes", "1G",
        "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
    ]
    with log.open("w") as output:
        server = subprocess.Popen(command, env=vllm_env(tmp_path), cwd=tmp_path, stdout=output,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_healthy(server, base, log)

        def complete(prompt: str) -> dict:
            body = {"model": str(folder), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            return post_json(f"{base}/v1/completions", body)["choices"][0]

        with concurrent.futures.ThreadPoolExecutor(len(TEXT_PROMPTS)) as pool:
            choices = list(pool.map(complete, TEXT_PROMPTS))
    finally:
        stop(server)
    assert [choice["prompt_token_ids"] for choice in choices] == prompt_ids
    assert [choice["token_ids"] for choice in choices] == expected
    assert all(choice["text"] for choice in choices)  # the text check below compares something
    for choice, ids, tokens in zip(choices, prompt_ids, expected):
        # vLLM detokenizes incrementally after the prompt: the completion is the decoded whole minus the prompt
        whole = tokenizer.decode(ids + tokens, skip_special_tokens=True)
        assert choice["text"] == whole[len(tokenizer.decode(ids, skip_special_tokens=True)):]
        assert choice["finish_reason"] == "length"
