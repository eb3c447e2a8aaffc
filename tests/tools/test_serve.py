"""`memoryformer serve`: a tiny MemoryFormer with a byte-level tokenizer behind the server on a loopback port, talked
to with the real `openai` client. The oracle is `model.generate` on the same model, token for token. The server runs
on transformers' continuous batching: `make test` runs this file under the floor, the default and the newest release."""

from __future__ import annotations

import concurrent.futures
import contextlib
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
MAX_BATCH_TOKENS = 16  # prompts longer than this are prefilled in chunks


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
    server = Server(ServeSettings(model=str(folder), port=0, max_batch_size=MAX_BATCH,
                                  max_batch_tokens=MAX_BATCH_TOKENS)).start()
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


def wait_until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def nothing_in_continuous_batching(manager) -> bool:
    """Whether transformers' managers hold no request any more (a cancelled one is dropped, its cache blocks freed,
    before their next forward)."""
    for engine in manager._engines.values():
        scheduler = engine.batch_processor.scheduler
        if scheduler.active_requests or scheduler.waiting_requests:
            return False
    return True


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
    assert 2 <= batcher(server).peak_running <= MAX_BATCH


def test_a_prompt_longer_than_a_forward_is_prefilled_in_chunks_and_continues_as_generate_does(served):
    server, client, model, tokenizer, name = served
    prompt = "xylophone quiz jam vex kiwi, the quick brown fox jumps over the lazy dog with hash tables"
    assert len(tokenizer(prompt).input_ids) > 2 * MAX_BATCH_TOKENS
    response = client.completions.create(model=name, prompt=prompt, max_tokens=10, temperature=0)
    assert response.choices[0].text == greedy(model, tokenizer, prompt, 10)


def test_the_paged_cache_is_sized_from_the_settings_not_from_the_machine(served):
    """MAX_BATCH requests of the model's 128 positions, in pages of PAGE_SIZE tokens: a few hundred KB, where
    transformers sizes a paged cache left unset from the machine's memory (past 13 GB on a CPU)."""
    from modeling_memoryformer.serving.batching import PAGE_SIZE

    server, client, model, tokenizer, name = served
    manager = batcher(server)
    assert manager.max_request_tokens == 128
    cache = manager._engines[False].batch_processor.cache
    assert MAX_BATCH * 128 <= cache.num_blocks * PAGE_SIZE <= 2 * MAX_BATCH * (128 + PAGE_SIZE)


@contextlib.contextmanager
def slowed(manager, seconds: float = 0.03):
    """The served model slowed to `seconds` a forward: 100 tokens take 3 s at least."""
    original = manager.model.forward

    def slow_forward(*args, **kwargs):
        time.sleep(seconds)
        return original(*args, **kwargs)

    manager.model.forward = slow_forward
    try:
        yield
    finally:
        del manager.model.forward  # the bound method again


def test_a_client_that_goes_away_frees_its_slot(served):
    """The stream of 100 tokens (3 s at least) is closed after 3 chunks: the request is cancelled in transformers'
    manager, which drops it (and frees its cache blocks) well before it would have ended, without another request to
    step the batch; its slot is free."""
    server, client, model, tokenizer, name = served
    manager = batcher(server)
    before = manager.dropped
    with slowed(manager):
        start = time.monotonic()
        stream = client.completions.create(model=name, prompt="the quick", max_tokens=100, temperature=0,
                                           stream=True)
        for i, _chunk in enumerate(stream):
            if i == 2:
                break
        stream.close()
        assert wait_until(lambda: manager.dropped == before + 1, timeout=5)
        assert manager.running == 0 and manager.waiting == 0
        assert wait_until(lambda: nothing_in_continuous_batching(manager), timeout=5)
        assert time.monotonic() - start < 2.0  # well before the 3 s its 100 tokens would have taken


def test_a_non_streaming_client_that_goes_away_frees_its_slot(served):
    """The client gives up after 0.5 s on 100 tokens (3 s at least). Its request must leave the batch then, in this
    server and in transformers' manager, not decode for nobody to the end."""
    server, client, model, tokenizer, name = served
    manager = batcher(server)
    before = manager.dropped
    with slowed(manager):
        impatient = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0,
                                  timeout=0.5)
        start = time.monotonic()
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(model=name, prompt="the quick", max_tokens=100, temperature=0)
        assert wait_until(lambda: manager.dropped == before + 1, timeout=5)
        assert manager.running == 0
        assert wait_until(lambda: nothing_in_continuous_batching(manager), timeout=5)
        assert time.monotonic() - start < 2.0  # well before the 3 s its 100 tokens would have taken


def test_sampling_gives_max_tokens_tokens(served):
    server, client, model, tokenizer, name = served
    response = client.completions.create(model=name, prompt="the", max_tokens=9, temperature=0.8, top_p=0.9)
    assert response.usage.completion_tokens == 9


def test_each_request_samples_with_its_own_settings_beside_greedy_ones(served):
    """Sampled and greedy requests at once. top_p near 0 keeps only the most likely token, so such a sampled request
    is greedy; at temperature 2 three samples of 20 tokens are not all the greedy text; the greedy requests running
    beside them are still `generate`'s."""
    server, client, model, tokenizer, name = served
    prompt = "the quick"
    expected = greedy(model, tokenizer, prompt, 20)

    def run(settings):
        return client.completions.create(model=name, prompt=prompt, max_tokens=20, **settings).choices[0].text

    settings = [{"temperature": 0}, {"temperature": 1.0, "top_p": 1e-6}, {"temperature": 2.0}, {"temperature": 2.0},
                {"temperature": 2.0}, {"temperature": 0}]
    with concurrent.futures.ThreadPoolExecutor(len(settings)) as pool:
        texts = list(pool.map(run, settings))
    assert texts[0] == texts[1] == texts[5] == expected
    assert any(text != expected for text in texts[2:5])


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_end_the_text_before_them(served, stream):
    """OpenAI's `stop`: the text ends just before the first stop string (which transformers' continuous batching does
    not know: the server watches the decoded text and cancels the request there)."""
    server, client, model, tokenizer, name = served
    prompt = "the quick"
    full = greedy(model, tokenizer, prompt, 30)
    stop = full[10:13]
    assert stop not in full[:12]
    response = client.completions.create(model=name, prompt=prompt, max_tokens=30, temperature=0, stop=[stop, "@@"],
                                         stream=stream)
    if stream:
        chunks = list(response)
        text = "".join(chunk.choices[0].text for chunk in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        text, finish = response.choices[0].text, response.choices[0].finish_reason
    assert text == full[:full.index(stop)]
    assert finish == "stop"
    assert wait_until(lambda: batcher(server).running == 0)


@pytest.mark.parametrize("pieces, stops, sent", [
    (["ab", "cd", "ef"], ["cde"], ["ab", "", ""]),  # "cd" is held back, then "cde" is whole
    (["ab", "c", "x"], ["cde"], ["ab", "", "cx"]),  # "c" was not a stop after all
    (["hello", " wor", "ld"], ["xyz"], ["hello", " wor", "ld"]),
    (["a<", "/s", ">b"], ["</s>", "s>"], ["a", "", ""]),  # the earliest stop wins
])
def test_stop_text_holds_back_what_may_start_a_stop_string(pieces, stops, sent):
    from modeling_memoryformer.serving.batching import _StopText

    text = _StopText(stops)
    assert [text.feed(piece) for piece in pieces] == sent
    whole = "".join(pieces)
    assert text.hit == any(stop in whole for stop in stops)


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


# Fields out of OpenAI's range, or asking for what this server does not do: a 400 naming the field, before anything
# runs (max_tokens 0 or -5 used to give one token with 200 OK). Ranges as OpenAI's API states them (vLLM's for top_p:
# above 0); n, best_of, log probabilities, echo, penalties and a logit bias are not supported here.
COMPLETION_FIELDS = [
    ("max_tokens", 0, "integer_below_min_value"), ("max_tokens", -5, "integer_below_min_value"),
    ("max_tokens", 2.5, "invalid_type"), ("max_tokens", "5", "invalid_type"),
    ("temperature", -0.5, "decimal_below_min_value"), ("temperature", 2.5, "decimal_above_max_value"),
    ("temperature", "hot", "invalid_type"), ("top_p", 0, "decimal_below_min_value"),
    ("top_p", 1.5, "decimal_above_max_value"), ("n", 0, "integer_below_min_value"), ("n", 2, "unsupported_value"),
    ("best_of", 3, "unsupported_value"), ("logprobs", 2, "unsupported_value"), ("echo", True, "unsupported_value"),
    ("frequency_penalty", 0.5, "unsupported_value"), ("frequency_penalty", -3, "decimal_below_min_value"),
    ("presence_penalty", 0.5, "unsupported_value"), ("presence_penalty", 2.5, "decimal_above_max_value"),
    ("logit_bias", {"5": 10}, "unsupported_value"), ("seed", 1.5, "invalid_type"), ("stop", "", "invalid_value"),
    ("stop", [1, 2], "invalid_type"), ("stream", "yes", "invalid_type"),
]
CHAT_FIELDS = [
    ("max_completion_tokens", 0, "integer_below_min_value"), ("max_tokens", -1, "integer_below_min_value"),
    ("logprobs", True, "unsupported_value"), ("top_logprobs", 2, "unsupported_value"), ("n", 3, "unsupported_value"),
    ("response_format", {"type": "json_object"}, "unsupported_value"), ("temperature", 3, "decimal_above_max_value"),
]


@pytest.mark.parametrize("chat, field, value, code", [(False, *case) for case in COMPLETION_FIELDS]
                         + [(True, *case) for case in CHAT_FIELDS])
def test_out_of_range_fields_are_refused_naming_the_field(served, chat, field, value, code):
    server, client, model, tokenizer, name = served
    body = {"messages": [{"role": "user", "content": "the"}]} if chat else {"prompt": "the"}
    body = {**body, "max_tokens": 3, field: value}
    status, payload = _post(server, "/v1/chat/completions" if chat else "/v1/completions", json.dumps(body).encode())
    assert status == 400, payload
    assert payload["error"]["param"] == field and payload["error"]["code"] == code, payload
    assert f"'{field}'" in payload["error"]["message"] and payload["error"]["type"] == "invalid_request_error"
    assert batcher(server).running == 0


@pytest.mark.parametrize("chat, fields", [
    (False, {"temperature": 0, "top_p": 1, "n": 1, "best_of": 1, "echo": False, "frequency_penalty": 0,
             "presence_penalty": 0, "logit_bias": {}, "seed": 3, "stop": [], "max_tokens": 1}),
    (False, {"temperature": 2, "top_p": 0.5}),
    (True, {"temperature": 0, "max_completion_tokens": 2, "logprobs": False, "n": 1,
            "response_format": {"type": "text"}}),
])
def test_fields_at_the_edges_of_their_range_are_served(served, chat, fields):
    server, client, model, tokenizer, name = served
    body = {"messages": [{"role": "user", "content": "the"}]} if chat else {"prompt": "the"}
    status, payload = _post(server, "/v1/chat/completions" if chat else "/v1/completions",
                            json.dumps({"max_tokens": 3, **body, **fields}).encode())
    assert status == 200, payload
    wanted = fields.get("max_completion_tokens", fields.get("max_tokens", 3))
    assert payload["usage"]["completion_tokens"] == wanted


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
    assert cli.main(["serve", "model", "--max-batch-tokens", "8"]) != 0
    assert "--max-batch-tokens (8) must be at least --max-batch-size (16)" in capsys.readouterr().err


def test_the_continuous_batching_config_takes_the_running_release_fields():
    """Every size is given explicitly, in the fields the running release has (page_size from 5.23, block_size
    before; max_requests_per_batch where it exists)."""
    import dataclasses

    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from modeling_memoryformer.serving.batching import PAGE_SIZE, continuous_batching_config

    config = continuous_batching_config(max_batch_size=8, max_request_tokens=1000, max_batch_tokens=256)
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    assert getattr(config, "page_size" if "page_size" in fields else "block_size") == PAGE_SIZE
    assert config.num_blocks == 8 * (-(-1000 // PAGE_SIZE) + 1) and config.max_batch_tokens == 256
    if "max_requests_per_batch" in fields:
        assert config.max_requests_per_batch == 8
