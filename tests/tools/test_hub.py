"""Sharing on the Hub: the generated model card, `memoryformer push` against a local Hub stand-in with the real
huggingface_hub client, and the pushed repo loaded by remote code in a process that cannot import the package."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import huggingface_hub
import pytest
import torch
import yaml
from safetensors.torch import load as load_safetensors
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast

from modeling_memoryformer import MemoryFormerForCausalLM, MemoryFormerPreTrainedModel
from modeling_memoryformer.evaluation.flops import per_block_flops, table_memory
from modeling_memoryformer.cli import parse_settings
from modeling_memoryformer.integrations.hub import model_card, push_to_hub, run_push

from conftest import tiny_model
from hub_server import LocalHub


TOKEN = "hf_local_stand_in_token"
REPO_ID = "tester/mf-hub-roundtrip"
PROVENANCE = "Randomly initialised test model (seed 0); not trained."
PROMPT = "the quick brown fox"
SNIPPET_PROMPT = "The meaning of life is"  # the prompt of the card's pipeline snippet
TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "a memory layer hashes each chunk of its input into a bucket of a table",
    "the meaning of life is a question for the ages",
    "tables trade memory for compute",
]


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A 300-token byte-level BPE trained on a few lines: every string encodes, and decode(encode(s)) == s."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TEXT, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def hub_model() -> MemoryFormerForCausalLM:
    """A tiny model whose safetensors file is multi-MB (tau = 8: 8.8 MB, nearly all hash tables), with a generation
    config that the pipeline must pick up from the repo (12 greedy tokens)."""
    model = tiny_model(hash_bits=8, vocab_size=300)
    model.generation_config = GenerationConfig(do_sample=False, max_new_tokens=12, pad_token_id=0)
    return model


def hub_env(hub: LocalHub, home: Path) -> dict[str, str]:
    """Environment of a subprocess that talks to the stand-in: HF_ENDPOINT is read when huggingface_hub is imported."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "HF_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(home), HF_MODULES_CACHE=str(home / "modules"),
               HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1", PYTHONDONTWRITEBYTECODE="1")
    return env


def run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result


def push_args(*argv: str):
    """The PushSettings of `memoryformer push ARGV`."""
    (settings,) = parse_settings(["push", *argv])
    return settings


def front_matter(card: str) -> dict:
    match = re.match(r"^---\n(.*?)\n---\n", card, re.S)
    assert match, card[:200]
    return yaml.safe_load(match[1])


def table_rows(card: str, header_start: str) -> dict[str, list[str]]:
    """The rows of the markdown table whose header row starts with `header_start`: first cell -> other cells."""
    lines = card.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def python_blocks(card: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", card, re.S)


# ----------------------------------------------------------------------------------------------------------------------
# The card
def test_card_front_matter_has_the_hub_metadata():
    card = model_card(tiny_model(), base_model="EleutherAI/pythia-70m", datasets=["wikitext"], repo_id=REPO_ID)
    meta = front_matter(card)
    assert meta["library_name"] == "transformers"
    assert meta["pipeline_tag"] == "text-generation"
    assert meta["tags"][:2] == ["memoryformer", "custom_code"]
    assert meta["license"] == "apache-2.0"
    assert meta["base_model"] == "EleutherAI/pythia-70m"
    assert meta["datasets"] == ["wikitext"]


def test_card_front_matter_omits_base_model_and_datasets_when_not_given():
    meta = front_matter(model_card(tiny_model()))
    assert "base_model" not in meta and "datasets" not in meta


def test_card_architecture_counts_parameters_and_table_parameters():
    model = hub_model()
    c = model.config
    rows = table_rows(model_card(model), "| | |")
    assert rows["layers"] == [str(c.num_hidden_layers)]
    assert rows["hidden size d"] == [str(c.hidden_size)]
    assert rows["hash bits tau"] == ["8"]
    assert rows["tables per Memory Layer K = d / tau"] == [str(c.hidden_size // 8)]
    assert rows["expanding bits e"][0].startswith("2 ")
    # Tables per block: Q, K, V (K * 2^tau rows of d), Memory Layer 1 (K * 2^tau rows of m) and Memory Layer 2
    # (m / (tau + e) tables of 2^(tau + e) rows of d).
    k, d, m = c.hidden_size // 8, c.hidden_size, c.intermediate_size
    tables = c.num_hidden_layers * (k * 2**8 * 3 * d + k * 2**8 * m + m // 10 * 2**10 * d)
    assert rows["of which in hash tables"][0].startswith(f"{tables:,} (")
    assert rows["parameters"] == [f"{sum(t.numel() for t in model.state_dict().values()):,}"]


def test_card_flops_and_memory_match_the_paper_formulas_and_flops_py():
    model = hub_model()
    c, s = model.config, 512
    rows = table_rows(model_card(model, seq_len=s), "| per block, s = 512 |")
    d, k = c.hidden_size, c.num_tables
    mf = per_block_flops(c, s)
    expected = {  # label -> (twin, MemoryFormer): the paper's formulas, and flops.py for the exact sum
        "FLOPs w/o attention (paper formula 6Ksd)": (12 * s * d * d, 6 * k * s * d),
        "FLOPs w/o attention (exact sum, hashing included)": (12 * s * d * d, mf["without_attention_exact"]),
        "attention FLOPs (2 s^2 d)": (2 * s * s * d, 2 * s * s * d),
        "total FLOPs": (2 * s * s * d + 12 * s * d * d, 2 * s * s * d + 6 * k * s * d),
        "FC weights / hash tables per block, bytes": (12 * d * d * 2, table_memory(c)["block"]),
    }
    for label, (twin_value, mf_value) in expected.items():
        assert rows[label][:2] == [f"{twin_value:,}", f"{mf_value:,}"], label
    whole = rows["FC weights / hash tables, whole model, bytes"]
    assert whole[1] == f"{c.num_hidden_layers * table_memory(c)['block']:,}"


def test_card_renders_provenance_text_and_dict():
    assert PROVENANCE in model_card(tiny_model(), provenance=PROVENANCE)
    card = model_card(tiny_model(), provenance={"converted from": "EleutherAI/pythia-70m", "steps": 300})
    assert "- **converted from**: EleutherAI/pythia-70m\n- **steps**: 300" in card
    assert "Not stated by the uploader" in model_card(tiny_model())


def test_card_snippets_load_the_real_repo_id():
    card = model_card(tiny_model(), tokenizer=None, repo_id=REPO_ID)
    assert f'AutoModelForCausalLM.from_pretrained("{REPO_ID}", trust_remote_code=True)' in card
    assert f'pipeline("text-generation", model="{REPO_ID}", tokenizer=' in card  # no tokenizer in the repo
    assert "This repository has no tokenizer" in card


def test_card_rejects_a_tokenizer_larger_than_the_vocabulary():
    with pytest.raises(ValueError, match="300 tokens but the model's vocab_size is 128"):
        model_card(tiny_model(), tokenizer=byte_level_tokenizer())


def test_card_rejects_a_model_that_is_not_a_memoryformer():
    with pytest.raises(TypeError, match="Expected a MemoryFormer model"):
        model_card(torch.nn.Linear(2, 2))


# ----------------------------------------------------------------------------------------------------------------------
# Push and load back through the stand-in
@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with LocalHub(tmp_path_factory.mktemp("hub_storage"), token=TOKEN) as hub:
        yield hub


@pytest.fixture(scope="module")
def pushed(hub, tmp_path_factory):
    """`memoryformer push` of a saved model + tokenizer, run in a subprocess whose HF_ENDPOINT is the stand-in."""
    work = tmp_path_factory.mktemp("push")
    model, tokenizer = hub_model(), byte_level_tokenizer()
    model.save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")
    env = {**hub_env(hub, work / "hf_home"), "HF_TOKEN": TOKEN}
    code = "import sys\nfrom modeling_memoryformer.cli import main\nsys.exit(main(['push', *sys.argv[1:]]))"
    result = run([sys.executable, "-c", code, "--model", str(work / "model"), "--repo-id", REPO_ID,
                  "--provenance", PROVENANCE], env, work)
    return {"model": model, "tokenizer": tokenizer, "folder": work / "model", "stdout": result.stdout}


@pytest.mark.slow
def test_push_uploads_everything_in_one_commit(pushed, hub):
    repo = hub.repos[REPO_ID]
    assert len(repo.commits) == 1
    assert hub.requests.count(("POST", f"/api/models/{REPO_ID}/commit/main")) == 1
    local_files = {p.name for p in pushed["folder"].iterdir()}
    assert set(repo.head.files) == local_files | {"README.md"}
    for name in ("model.safetensors", "generation_config.json", "tokenizer.json", "modeling_memoryformer.py",
                 "configuration_memoryformer.py", "memory_ops.py"):
        assert name in repo.head.files, name
    assert pushed["stdout"].strip().splitlines()[-1] == f"{hub.url}/{REPO_ID}/commit/{repo.head.oid}"


@pytest.mark.slow
def test_pushed_weights_and_config_are_the_model(pushed, hub):
    weights = load_safetensors(hub.read_file(REPO_ID, "model.safetensors"))
    state = pushed["model"].state_dict()
    assert len(hub.read_file(REPO_ID, "model.safetensors")) > 8_000_000  # the multi-MB file took the inline path
    assert weights.keys() == state.keys()
    assert all(torch.equal(weights[name], state[name]) for name in state)
    config = json.loads(hub.read_file(REPO_ID, "config.json"))
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_memoryformer.MemoryFormerForCausalLM"
    generation = json.loads(hub.read_file(REPO_ID, "generation_config.json"))
    assert (generation["max_new_tokens"], generation["do_sample"]) == (12, False)


@pytest.mark.slow
def test_pushed_readme_is_the_card_for_the_repo(pushed, hub):
    readme = hub.read_file(REPO_ID, "README.md").decode()
    assert readme == model_card(pushed["model"], tokenizer=pushed["tokenizer"], provenance=PROVENANCE,
                                repo_id=REPO_ID)


# The start of a child script that cannot import the package: everything comes from the repo on the stand-in.
WITHOUT_THE_PACKAGE = textwrap.dedent(
    '''
    import contextlib, io, json, re, sys


    class BlockPackage:
        def find_spec(self, name, path=None, target=None):
            if name == "modeling_memoryformer" or name.startswith("modeling_memoryformer."):
                raise ImportError(f"{name} is blocked: this process must use the repo's code")
            return None


    sys.meta_path.insert(0, BlockPackage())
    try:
        import modeling_memoryformer  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("modeling_memoryformer is importable: the remote-code test would prove nothing")
    '''
)

CHILD = WITHOUT_THE_PACKAGE + textwrap.dedent(
    '''
    import torch
    import transformers
    from huggingface_hub import hf_hub_download
    from packaging.version import Version
    from transformers import AutoModelForCausalLM, pipeline

    repo_id, inputs_path, outputs_path, prompt = sys.argv[1:5]
    lm = AutoModelForCausalLM.from_pretrained(repo_id, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = lm(torch.load(inputs_path)).logits
    generator = pipeline("text-generation", model=repo_id, trust_remote_code=True)
    # The repo's generation config decides length and greediness. Before transformers 5.16 the text-generation
    # pipeline let its own defaults (256 sampled tokens) override any model's generation config (GPT-NeoX's too):
    # there, the same settings are passed explicitly.
    older = Version(transformers.__version__) < Version("5.16")
    text = generator(prompt, **(dict(do_sample=False, max_new_tokens=12) if older else {}))[0]["generated_text"]

    # The card's own remote-code snippets, run as a user would copy them.
    card = open(hf_hub_download(repo_id, "README.md")).read()
    snippets = [b for b in re.findall(r"```python\\n(.*?)```", card, re.S) if "import modeling_memoryformer" not in b]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for snippet in snippets:
            exec(snippet, {})
    torch.save(logits, outputs_path)
    print("REPORT " + json.dumps({
        "lm_class": f"{type(lm).__module__}.{type(lm).__name__}",
        "pipeline_model_class": f"{type(generator.model).__module__}.{type(generator.model).__name__}",
        "text": text,
        "snippet_output": printed.getvalue(),
        "package_imported": any(name.split(".")[0] == "modeling_memoryformer" for name in sys.modules),
    }))
    '''
)


def greedy_text(model, tokenizer, prompt: str, **generate_kwargs) -> str:
    """What the text-generation pipeline should print: the prompt and the decoded greedy continuation."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **generate_kwargs)
    return prompt + tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.slow
def test_remote_code_from_the_hub_reproduces_logits_and_greedy_text(pushed, hub, tmp_path):
    model, tokenizer = pushed["model"], pushed["tokenizer"]
    input_ids = torch.tensor([[5, 17, 99, 42, 8, 63, 120, 250], [64, 3, 90, 11, 7, 7, 100, 299]])
    torch.save(input_ids, tmp_path / "inputs.pt")
    (tmp_path / "child.py").write_text(CHILD)
    requests_before = len(hub.requests)
    result = run([sys.executable, "child.py", REPO_ID, str(tmp_path / "inputs.pt"), str(tmp_path / "logits.pt"),
                  PROMPT], hub_env(hub, tmp_path / "hf_home"), tmp_path)
    report = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("REPORT "))[7:])

    assert report["package_imported"] is False
    for key in ("lm_class", "pipeline_model_class"):
        assert report[key].startswith("transformers_modules.") and report[key].endswith("MemoryFormerForCausalLM")
    downloads = {path.rsplit("/", 1)[-1] for method, path in hub.requests[requests_before:] if method == "GET"}
    assert {"model.safetensors", "config.json", "modeling_memoryformer.py", "tokenizer.json"} <= downloads
    with torch.no_grad():
        assert torch.equal(torch.load(tmp_path / "logits.pt"), model(input_ids).logits)
    expected = greedy_text(model, tokenizer, PROMPT)  # model.generation_config: 12 greedy tokens
    assert len(tokenizer(expected).input_ids) > len(tokenizer(PROMPT).input_ids)
    assert report["text"] == expected
    assert report["snippet_output"] == greedy_text(model, tokenizer, SNIPPET_PROMPT, max_new_tokens=32,
                                                   do_sample=False) + "\n"



QUANTIZED_CHILD = WITHOUT_THE_PACKAGE + textwrap.dedent(
    '''
    import torch
    from transformers import AutoModelForCausalLM

    repo_id, inputs_path, outputs_path = sys.argv[1:4]
    lm = AutoModelForCausalLM.from_pretrained(repo_id, trust_remote_code=True).eval()
    with torch.no_grad():
        torch.save(lm(torch.load(inputs_path)).logits, outputs_path)
    print("REPORT " + json.dumps({
        "table_dtype": lm.config.table_dtype, "lm_head_dtype": lm.config.lm_head_dtype,
        "lm_class": f"{type(lm).__module__}.{type(lm).__name__}",
        "package_imported": any(name.split(".")[0] == "modeling_memoryformer" for name in sys.modules),
    }))
    '''
)


@pytest.mark.slow
def test_a_quantized_model_round_trips_through_the_hub_with_remote_code(quiet_hub, tmp_path):
    """int8 tables and head pushed by `push_to_hub`: safetensors holding the codes, scales and offsets as tensors,
    and a process without the package rebuilds the same int8 model from the repo id (logits bit for bit)."""
    model = hub_model().quantize_tables("int8", lm_head="int8")
    repo_id = "tester/mf-int8"
    push_to_hub(model, repo_id, token=TOKEN, endpoint=quiet_hub.url)
    files = set(quiet_hub.repos[repo_id].head.files)
    assert {"model.safetensors", "quantization.py", "config.json"} <= files
    assert not any(name.endswith((".bin", ".pt", ".pkl")) for name in files)
    weights = load_safetensors(quiet_hub.read_file(repo_id, "model.safetensors"))
    state = model.state_dict()
    assert weights.keys() == state.keys()
    assert all(torch.equal(weights[name], state[name]) for name in state)
    codes = [name for name in weights if name.endswith(".tables_codes")]
    assert codes and all(weights[name].dtype == torch.uint8 for name in codes)
    assert not any(name.endswith(".tables") for name in weights)

    input_ids = torch.tensor([[5, 17, 99, 42, 8, 63, 120, 250], [64, 3, 90, 11, 7, 7, 100, 299]])
    torch.save(input_ids, tmp_path / "inputs.pt")
    (tmp_path / "child.py").write_text(QUANTIZED_CHILD)
    result = run([sys.executable, "child.py", repo_id, str(tmp_path / "inputs.pt"), str(tmp_path / "logits.pt")],
                 hub_env(quiet_hub, tmp_path / "hf_home"), tmp_path)
    report = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("REPORT "))[7:])
    assert report["package_imported"] is False and report["lm_class"].startswith("transformers_modules.")
    assert (report["table_dtype"], report["lm_head_dtype"]) == ("int8", "int8")
    with torch.no_grad():
        assert torch.equal(torch.load(tmp_path / "logits.pt"), model(input_ids).logits)

def test_the_model_file_writes_no_card():
    """The card is the Hub integration's work: the model unit has no hook into transformers' upload."""
    assert not hasattr(MemoryFormerPreTrainedModel, "model_card_writer")
    assert "_upload_modified_files" not in vars(MemoryFormerPreTrainedModel)


def test_push_to_hub_cards_the_given_tags(quiet_hub, tmp_path):
    model = tiny_model()
    repo_id = "tester/mf-tags"
    push_to_hub(model, repo_id, tags=["my-tag"], token=TOKEN, endpoint=quiet_hub.url)
    readme = quiet_hub.read_file(repo_id, "README.md").decode()
    assert readme == model_card(model, repo_id=repo_id, tags=["my-tag"])


@pytest.mark.slow
def test_model_push_to_hub_method_uploads_with_the_transformers_card(pushed, hub, tmp_path):
    repo_id = "tester/mf-method-push"
    code = ("import sys\nimport modeling_memoryformer\nfrom transformers import AutoModelForCausalLM\n"
            "model = AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
            "print(model.push_to_hub(sys.argv[2], tags=['my-tag']).commit_url)")
    env = {**hub_env(hub, tmp_path / "hf_home"), "HF_TOKEN": TOKEN}
    run([sys.executable, "-c", code, str(pushed["folder"]), repo_id], env, tmp_path)
    assert len(hub.repos[repo_id].commits) == 1
    readme = hub.read_file(repo_id, "README.md").decode()
    assert "my-tag" in readme and readme != model_card(pushed["model"], repo_id=repo_id, tags=["my-tag"])
    assert {"model.safetensors", "config.json", "modeling_memoryformer.py"} <= set(hub.repos[repo_id].head.files)


# ----------------------------------------------------------------------------------------------------------------------
# Bad input: a clear error, and nothing reaches the Hub
@pytest.fixture
def quiet_hub(hub, monkeypatch):
    """The stand-in as default endpoint of this process too, so that a regression can never reach the real Hub."""
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
    return hub


def test_run_push_rejects_a_missing_folder(quiet_hub, tmp_path, capsys):
    requests_before = len(quiet_hub.requests)
    assert run_push(push_args("--model", str(tmp_path / "nowhere"), "--repo-id", "tester/nothing")) == 2
    error = capsys.readouterr().err
    assert "nowhere: no such folder" in error and "save_pretrained" in error
    assert len(quiet_hub.requests) == requests_before


def test_run_push_rejects_a_folder_without_safetensors(quiet_hub, tmp_path, capsys):
    folder = tmp_path / "pickled"
    tiny_model().config.save_pretrained(folder)
    (folder / "pytorch_model.bin").write_bytes(b"not loaded")
    assert run_push(push_args("--model", str(folder), "--repo-id", "tester/nothing")) == 2
    assert "has no model.safetensors: weights are loaded only from safetensors" in capsys.readouterr().err
    assert "tester/nothing" not in quiet_hub.repos


@pytest.mark.parametrize("repo_id", ["has spaces/model", "too/many/parts", "-leading-dash", "double--dash"])
def test_push_to_hub_rejects_a_bad_repo_id(quiet_hub, repo_id):
    requests_before = len(quiet_hub.requests)
    with pytest.raises(ValueError, match=rf"{re.escape(repr(repo_id))} is not a valid Hub repo id"):
        push_to_hub(tiny_model(), repo_id, endpoint=quiet_hub.url, token=TOKEN)
    assert len(quiet_hub.requests) == requests_before


def test_push_to_hub_with_a_wrong_token_creates_nothing(quiet_hub):
    with pytest.raises(huggingface_hub.errors.HfHubHTTPError, match="401"):
        push_to_hub(tiny_model(), "tester/refused", endpoint=quiet_hub.url, token="hf_wrong")
    assert "tester/refused" not in quiet_hub.repos


# ----------------------------------------------------------------------------------------------------------------------
# Repo creation
def test_push_to_hub_private_creates_a_repo_hidden_from_anonymous_readers(quiet_hub):
    url = push_to_hub(tiny_model(), "tester/private-mf", private=True, endpoint=quiet_hub.url, token=TOKEN)
    repo = quiet_hub.repos["tester/private-mf"]
    assert repo.private and url == f"{quiet_hub.url}/tester/private-mf/commit/{repo.head.oid}"
    with pytest.raises(huggingface_hub.errors.RepositoryNotFoundError):
        huggingface_hub.HfApi(endpoint=quiet_hub.url, token=False).model_info("tester/private-mf")
    assert huggingface_hub.HfApi(endpoint=quiet_hub.url, token=TOKEN).model_info("tester/private-mf").sha == repo.head.oid


def test_push_to_hub_of_a_bare_name_cards_the_namespaced_repo_id(quiet_hub):
    push_to_hub(tiny_model(), "bare-mf", endpoint=quiet_hub.url, token=TOKEN)
    readme = quiet_hub.read_file("local-user/bare-mf", "README.md").decode()
    assert 'from_pretrained("local-user/bare-mf", trust_remote_code=True)' in readme


@pytest.mark.parametrize("preset,expected", [
    ("tiny", "against its dense twin pythia-70m: the Pythia (GPT-NeoX) model of the same width, depth and heads."),
    (None, "against its dense twin: a GPT-NeoX (Pythia-style) model of the same width (d = 64), depth (2 blocks) "
           "and heads (4)."),
])
def test_card_names_the_dense_twin_once(preset, expected):
    from modeling_memoryformer import MemoryFormerConfig
    from modeling_memoryformer.integrations.hub import _comparison_text

    config = MemoryFormerConfig.from_preset(preset) if preset else tiny_model().config
    text = " ".join(_comparison_text(config, 512).split())
    assert expected in text
    assert "twin GPT-NeoX twin" not in text and "twin pythia-70m: a GPT-NeoX" not in text


def test_preview_card_writes_the_card_offline_and_uploads_nothing(tmp_path, monkeypatch, capsys):
    from modeling_memoryformer.integrations import hub as hub_module

    model, tokenizer = hub_model(), byte_level_tokenizer()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    monkeypatch.setattr(hub_module, "HfApi", None)  # any use of the Hub client fails the test
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    card_path = tmp_path / "card.md"
    settings = push_args("--model", str(tmp_path / "model"), "--repo-id", "you/mf-demo", "--provenance", "a test",
                         "--preview-card", str(card_path))
    assert hub_module.run_push(settings) == 0
    assert "nothing uploaded" in capsys.readouterr().out
    loaded = MemoryFormerForCausalLM.from_pretrained(tmp_path / "model")
    expected = hub_module.model_card(loaded, repo_id="you/mf-demo", tokenizer=tokenizer, provenance="a test")
    assert card_path.read_text(encoding="utf-8") == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["card.md", "model"]  # no partial file left

    missing = push_args("--model", str(tmp_path / "model"), "--repo-id", "you/mf-demo",
                        "--preview-card", str(tmp_path / "no-such-folder" / "card.md"))
    assert hub_module.run_push(missing) == 2
    assert "does not exist" in capsys.readouterr().err
