"""`memoryformer serve`: a tiny MemoryFormer with a byte-level tokenizer behind the server on a loopback port, talked
to with the real `openai` client. The oracle is `model.generate` on the same model, token for token."""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.error
import urllib.request

import openai  # the serve extra, part of the dev extras: a missing one fails here, it does not skip
import pytest
import torch

from modeling_memoryformer import MemoryFormerConfig, MemoryFormerForCausalLM, cli
from modeling_memoryformer.serving.server import Server
from modeling_memoryformer.serving.settings import ServeSettings

pytestmark = pytest.mark.slow  # a server per module, and generation

TEXT = ["the quick brown fox jumps over the lazy dog", "memory layers replace dense layers with hash tables",
        "a bucket of rows for every chunk of the input"] * 20
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
MAX_BATCH = 4


def metaspace_tokenizer():
    """A 120-token BPE over characters (SentencePiece's metaspace): every token is whole text, so a stream decoded
    token by token equals the decode of all of them (a byte-level BPE would hold back an unfinished UTF-8 sequence)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"], show_progress=False)
    tokenizer.train_from_iterator(TEXT, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>", pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve") / "model"
    tokenizer = metaspace_tokenizer()
    torch.manual_seed(0)
    config = MemoryFormerConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                max_position_embeddings=128, hash_bits=4, expand_bits=2, table_init_std=0.5,
                                bos_token_id=None, eos_token_id=None, pad_token_id=0)
    model = MemoryFormerForCausalLM(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    server = Server(ServeSettings(model=str(folder), port=0, max_batch_size=MAX_BATCH)).start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
    yield server, client, model, tokenizer, str(folder)
    server.stop()


def greedy(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    ids = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.input_ids.shape[1]:], skip_special_tokens=True)


def batcher(server):
    (manager,) = server.state._batchers.values()
    return manager


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_completion_equals_generate(served, stream):
    server, client, model, tokenizer, name = served
    for prompt in ("the quick brown", "memory layers", "a"):
        response = client.completions.create(model=name, prompt=prompt, max_tokens=14, temperature=0, stream=stream)
        text = "".join(chunk.choices[0].text for chunk in response) if stream else response.choices[0].text
        assert text == greedy(model, tokenizer, prompt, 14), prompt
    if not stream:
        assert response.usage.completion_tokens == 14
        assert response.usage.prompt_tokens == len(tokenizer("a").input_ids)
        assert response.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_uses_the_tokenizer_chat_template(served, stream):
    server, client, model, tokenizer, name = served
    messages = [{"role": "user", "content": "the lazy dog"}]
    response = client.chat.completions.create(model=name, messages=messages, max_tokens=10, temperature=0,
                                              stream=stream)
    if stream:
        text = "".join(chunk.choices[0].delta.content or "" for chunk in response if chunk.choices)
    else:
        text = response.choices[0].message.content
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "user: the lazy dog\nassistant:"
    assert text == greedy(model, tokenizer, prompt, 10)


def test_models_and_health(served):
    server, client, model, tokenizer, name = served
    assert [m.id for m in client.models.list().data] == [name]
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=10) as response:
        assert json.load(response) == {"status": "ok", "model": name}


def test_sixteen_concurrent_streaming_clients_all_finish_in_bounded_batches(served):
    """16 clients at once with batches of at most MAX_BATCH: every one finishes with generate's tokens, and the batch
    never held more rows than allowed (the rest waited in the queue)."""
    server, client, model, tokenizer, name = served
    prompts = [f"the lazy dog {i}" for i in range(16)]

    def run(prompt):
        stream = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        return "".join(chunk.choices[0].text for chunk in stream)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(run, prompts))
    assert texts == [greedy(model, tokenizer, p, 12) for p in prompts]
    assert 2 <= batcher(server).peak_rows <= MAX_BATCH


def test_a_client_that_goes_away_frees_its_row(served):
    server, client, model, tokenizer, name = served
    manager = batcher(server)
    before = manager.dropped
    stream = client.completions.create(model=name, prompt="the quick", max_tokens=100, temperature=0, stream=True)
    for i, _chunk in enumerate(stream):
        if i == 2:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while manager.dropped == before and time.monotonic() < deadline:
        client.completions.create(model=name, prompt="a", max_tokens=2, temperature=0)  # steps the batch
    assert manager.dropped == before + 1
    deadline = time.monotonic() + 30
    while manager._rows and time.monotonic() < deadline:
        time.sleep(0.05)
    assert manager._rows == []


def test_a_non_streaming_client_that_goes_away_frees_its_row(served):
    """The model is slowed to 30 ms a forward, so 100 tokens take 3 s; the client gives up after 0.5 s. Its row must
    leave the batch then, not decode for nobody to the end."""
    server, client, model, tokenizer, name = served
    manager = batcher(server)
    before = manager.dropped
    original = manager.model.forward

    def slow_forward(*args, **kwargs):
        time.sleep(0.03)
        return original(*args, **kwargs)

    manager.model.forward = slow_forward
    try:
        impatient = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0,
                                  timeout=0.5)
        start = time.monotonic()
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(model=name, prompt="the quick", max_tokens=100, temperature=0)
        while manager.dropped == before and time.monotonic() < start + 5:
            time.sleep(0.02)
        assert manager.dropped == before + 1
        assert time.monotonic() - start < 2.0  # well before the 3 s its 100 tokens would have taken
    finally:
        del manager.model.forward  # the bound method again
    while manager._rows:
        time.sleep(0.05)


def test_sampling_gives_max_tokens_tokens(served):
    server, client, model, tokenizer, name = served
    response = client.completions.create(model=name, prompt="the", max_tokens=9, temperature=0.8, top_p=0.9)
    assert response.usage.completion_tokens == 9


def _post(server, path: str, data: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "Malformed request"),
    (b'"a string"', 400, "Malformed request"),
    (json.dumps({"prompt": ["a", "b"], "max_tokens": 3}).encode(), 400, "prompt must be a string"),
    (json.dumps({"prompt": "a", "max_tokens": 500}).encode(), 400, "at most 128 per request"),
    (json.dumps({"prompt": "a", "max_tokens": 3, "model": "someone/else"}).encode(), 400, "pinned"),
    (json.dumps({"prompt": "a", "max_tokens": 3, "colour": "red"}).encode(), 422, "Unexpected fields"),
    (json.dumps({"prompt": "", "max_tokens": 3}).encode(), 400, "prompt is empty"),
])
def test_bad_requests_get_openai_errors_and_the_server_lives_on(served, body, status, words):
    server, client, model, tokenizer, name = served
    code, payload = _post(server, "/v1/completions", body)
    assert code == status and set(payload) == {"error"}, payload
    assert words in payload["error"]["message"] and payload["error"]["type"] == "invalid_request_error"
    assert client.completions.create(model=name, prompt="the", max_tokens=3, temperature=0).usage.completion_tokens \
        == 3


def test_the_openai_client_raises_its_bad_request_error(served):
    server, client, model, tokenizer, name = served
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=name, prompt="a", max_tokens=1000)
    assert info.value.body["code"] == "context_length_exceeded"


def test_int8_tables_are_served_as_generate_runs_them(served):
    """--table-dtype int8: the server quantises the tables at load; its greedy tokens are those of the same model
    quantised in Python."""
    from modeling_memoryformer.evaluation.settings import StorageSettings

    _, _, model, tokenizer, name = served
    int8 = Server(ServeSettings(model=name, port=0), StorageSettings(table_dtype="int8")).start()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{int8.port}/v1", api_key="unused", max_retries=0)
        quantised = MemoryFormerForCausalLM.from_pretrained(name).quantize_tables("int8")
        text = client.completions.create(model=name, prompt="the quick", max_tokens=10, temperature=0).choices[0].text
        assert text == greedy(quantised, tokenizer, "the quick", 10)
        (loaded,) = [m.model for m in int8.state._model_manager.loaded_models.values()]
        assert loaded.config.table_dtype == "int8"
    finally:
        int8.stop()


def test_serve_options_are_checked(capsys):
    assert cli.main(["serve", "model", "--port", "70000"]) != 0
    assert "--port must be in 0..65535, got 70000" in capsys.readouterr().err
