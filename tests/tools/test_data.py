"""Causal-LM data (modeling_memoryformer/training/data.py) against independent oracles: the tokenizer called by hand
on the whole text, the character position of the held-out cut, the files and datasets the tests write themselves."""

from __future__ import annotations

import json
import os
import shutil

import datasets
import pytest
import torch
from pydoc_data.topics import topics
from tokenizers import Tokenizer, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from modeling_memoryformer.training.data import (
    EMBEDDED_DEFAULT,
    END_OF_TEXT,
    TokenBlocks,
    build_lm_data,
    embedded_default_documents,
    embedded_default_text,
    load_texts,
    load_tokenizer,
    pack_blocks,
    safe_pieces,
    split_documents,
    standard_library_files,
    text_blocks,
    token_stream,
    train_bpe_tokenizer,
)


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED_DATA = os.path.join(REPO_ROOT, os.pardir, "shared", "data")
PYTHIA_TOKENIZER = os.path.join(SHARED_DATA, "pythia-tokenizer")
TINY_SHAKESPEARE = os.path.join(SHARED_DATA, "tinyshakespeare.txt")
SAMPLES = [
    "def f(x):\n    return x + 1\n",
    "Hello , world ! It 's  two  spaces.\r\n\ttab",
    "héllo wörld, naïve café; Ελληνικά, русский, 日本語, emoji 🙂👍",
    "",
    " leading space and trailing newlines\n\n\n",
]


@pytest.fixture(scope="module")
def text() -> str:
    return embedded_default_text()


@pytest.fixture(scope="module")
def bpe(text):
    return train_bpe_tokenizer(text, vocab_size=4096)


def encode(tokenizer, text: str) -> list[int]:
    """The oracle: one tokenizer call on the whole text."""
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def oracle_blocks(tokenizer, text: str, block_size: int) -> torch.Tensor:
    """The text tokenized in one call, cut into [S, block_size] blocks, tail dropped."""
    ids = torch.tensor(encode(tokenizer, text), dtype=torch.long)
    return ids[: ids.numel() // block_size * block_size].view(-1, block_size)


def write(path, content: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write(content)
    return str(path)


# ---------------------------------------------------------------------------------------------------------------------
# The embedded default


def test_embedded_default_is_the_cpython_documentation(text):
    assert 300_000 < len(text) < 1_000_000  # ~465 KB in CPython 3.11
    assert "assert statement" in text
    assert text.startswith(topics[min(topics)])
    assert all(entry in text for entry in topics.values())


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizers


def test_bpe_round_trips_ascii_and_unicode_text(bpe):
    for sample in SAMPLES:
        assert bpe.decode(encode(bpe, sample)) == sample


def test_bpe_has_the_requested_vocabulary_and_end_of_text_as_bos_eos_pad(bpe):
    assert len(bpe) == 4096
    assert bpe.bos_token == bpe.eos_token == bpe.pad_token == END_OF_TEXT
    assert bpe.pad_token_id == bpe.eos_token_id


def test_bpe_training_is_deterministic(bpe, text):
    again = train_bpe_tokenizer(text, vocab_size=4096)
    assert again.backend_tokenizer.to_str() == bpe.backend_tokenizer.to_str()  # vocabulary and merges


def test_bpe_saves_and_loads(bpe, tmp_path):
    bpe.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.get_vocab() == bpe.get_vocab()
    assert (loaded.eos_token, loaded.pad_token) == (END_OF_TEXT, END_OF_TEXT)
    for sample in SAMPLES:
        assert encode(loaded, sample) == encode(bpe, sample)


def test_bpe_rejects_a_vocabulary_smaller_than_the_bytes():
    with pytest.raises(ValueError, match="--vocab-size 300"):
        train_bpe_tokenizer("some text", vocab_size=299)


def test_load_tokenizer_sets_pad_to_eos_when_missing(bpe, tmp_path):
    backend = Tokenizer.from_str(bpe.backend_tokenizer.to_str())
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=END_OF_TEXT).save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token == loaded.eos_token == END_OF_TEXT


def test_load_tokenizer_rejects_a_folder_without_tokenizer_files(tmp_path):
    write(tmp_path / "config.json", "{}")
    with pytest.raises(ValueError, match=f"{tmp_path}.*no tokenizer files"):
        load_tokenizer(str(tmp_path))


def test_load_tokenizer_rejects_a_missing_path(tmp_path):
    missing = str(tmp_path / "no-such-tokenizer")
    with pytest.raises(FileNotFoundError, match="no-such-tokenizer"):
        load_tokenizer(missing)


def test_every_command_loads_tokenizers_the_same_way_with_its_own_fix(tmp_path):
    """train (data), eval and convert share one loader: the same checks, each with the fix in its own terms."""
    from modeling_memoryformer.evaluation.harness import _load_tokenizer as eval_loader

    write(tmp_path / "config.json", "{}")
    with pytest.raises(ValueError, match="no tokenizer files.*train a BPE on the data"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="no tokenizer files.*the tokenizer the model was trained with"):
        eval_loader(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist.*the tokenizer the model was trained with"):
        eval_loader(str(tmp_path / "missing"))


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizing and packing


def test_long_text_in_pieces_tokenizes_like_the_whole_text(bpe, text):
    pieces = safe_pieces(text, bpe, chunk_chars=20_000)
    assert len(pieces) > 10 and "".join(pieces) == text
    assert token_stream([text], bpe, chunk_chars=20_000).tolist() == encode(bpe, text)


def test_tokenizer_with_a_prefix_space_gets_the_text_whole(bpe, text):
    backend = Tokenizer.from_str(bpe.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)  # each call's text starts with " "
    prefixed = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=END_OF_TEXT)
    cut = text.index("\n", 20_000) + 1
    assert encode(prefixed, text[:cut]) + encode(prefixed, text[cut:]) != encode(prefixed, text)  # naive cut breaks
    assert safe_pieces(text, prefixed, chunk_chars=20_000) == [text]
    assert token_stream([text], prefixed, chunk_chars=20_000).tolist() == encode(prefixed, text)


def test_documents_are_joined_with_the_eos_token(bpe):
    documents = ["first document", "second, with\nlines", "third"]
    expected = encode(bpe, documents[0]) + [bpe.eos_token_id] + encode(bpe, documents[1])
    expected += [bpe.eos_token_id] + encode(bpe, documents[2])
    assert token_stream(documents, bpe).tolist() == expected


def test_pack_blocks_cuts_consecutive_blocks_and_counts_the_dropped_tail():
    blocks, dropped = pack_blocks(torch.arange(11), 3)
    assert blocks.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert dropped == 2


def test_text_blocks_are_the_whole_text_tokenized_and_cut(bpe, text):
    assert torch.equal(text_blocks(text, bpe, 64), oracle_blocks(bpe, text, 64))


def test_token_blocks_are_causal_lm_examples():
    ids = torch.arange(12).view(3, 4)
    blocks = TokenBlocks(ids)
    assert len(blocks) == 3 and blocks.input_ids is ids
    assert blocks[1]["input_ids"].tolist() == blocks[1]["labels"].tolist() == [4, 5, 6, 7]


# ---------------------------------------------------------------------------------------------------------------------
# Train / validation split


def test_split_holds_out_the_last_fraction_of_the_characters():
    documents = ["a" * 50, "b" * 30, "c" * 20]
    assert split_documents(documents, 0.1) == (["a" * 50, "b" * 30, "c" * 10], ["c" * 10])
    assert split_documents(documents, 0.5) == (["a" * 50], ["b" * 30, "c" * 20])  # a cut on a document boundary


def test_split_rejects_a_fraction_outside_zero_one():
    for fraction in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="validation_fraction"):
            split_documents(["some text"], fraction)


def test_text_file_trains_on_the_first_90_percent_and_validates_on_the_last_10(bpe, text, tmp_path):
    source = text[:60_000]
    data = build_lm_data(write(tmp_path / "source.txt", source), bpe, block_size=32, progress=False)
    cut = int(len(source) * 0.9)
    train_ids, validation_ids = torch.tensor(encode(bpe, source[:cut])), torch.tensor(encode(bpe, source[cut:]))
    train_blocks = train_ids.numel() // 32
    validation_blocks = validation_ids.numel() // 32
    assert torch.equal(data.train.input_ids, train_ids[: train_blocks * 32].view(-1, 32))
    assert torch.equal(data.validation.input_ids, validation_ids[: validation_blocks * 32].view(-1, 32))
    assert data.num_train_tokens == len(data.train) * 32 == train_blocks * 32
    assert data.num_validation_tokens == validation_blocks * 32
    assert data.dropped_tokens == train_ids.numel() % 32 + validation_ids.numel() % 32
    assert source[:cut].startswith(bpe.decode(data.train.input_ids.flatten()))  # no held-out text in training
    assert source[cut:].startswith(bpe.decode(data.validation.input_ids.flatten()))


def test_default_tokenizer_is_trained_on_the_training_text_only(text, tmp_path):
    source = text[:60_000]
    data = build_lm_data(write(tmp_path / "source.txt", source), block_size=32, vocab_size=500, progress=False)
    oracle = train_bpe_tokenizer([source[: int(len(source) * 0.9)]], vocab_size=500)
    assert data.tokenizer.backend_tokenizer.to_str() == oracle.backend_tokenizer.to_str()
    assert data.description.endswith("last 10% held out, byte-level BPE 500")


@pytest.mark.slow
def test_default_data_is_the_standard_library_split_by_file_and_large_enough_to_see_once():
    import sysconfig
    import tokenize

    from modeling_memoryformer.comparison.demo import DemoSettings

    data = build_lm_data(block_size=128, progress=False)
    assert data.description.startswith(EMBEDDED_DEFAULT) and data.description.endswith("byte-level BPE 4096")
    assert len(data.tokenizer) == 4096
    assert data.train.input_ids.shape[1] == data.validation.input_ids.shape[1] == 128
    # the demo's default run sees every training token at most once
    demo = DemoSettings()
    assert demo.max_steps * demo.batch_size * demo.block_size <= data.num_train_tokens
    # the split is by file: the held-out texts are whole files of the standard library, none of them in training
    train, validation, _ = embedded_default_documents()
    root = sysconfig.get_paths()["stdlib"]
    files = {}
    for name in standard_library_files(root):
        with tokenize.open(os.path.join(root, name)) as f:
            files[name] = f.read()
    held_out = [name for name, source in files.items() if source in validation]
    assert len(held_out) == len(validation) > 0
    assert not set(validation) & set(train)
    assert embedded_default_text() in train
    share = sum(map(len, validation)) / sum(len(files[name]) for name in files)
    assert 0.02 <= share < 0.1


def test_standard_library_files_leave_out_test_suites_and_packages(tmp_path):
    for name in ("a.py", "b.txt", "pkg/__init__.py", "pkg/mod.py", "pkg/tests/test_mod.py", "test/test_a.py",
                 "idlelib/idle_test/t.py", "site-packages/x/y.py", "pydoc_data/topics.py",
                 "config-3.11-x86_64-linux-gnu/python-config.py", "__pycache__/a.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        write(tmp_path / name, "x = 1\n")
    assert standard_library_files(str(tmp_path)) == ["a.py", "pkg/__init__.py", "pkg/mod.py"]


def test_a_python_without_its_library_source_is_an_error_naming_data(tmp_path):
    write(tmp_path / "a.py", "x = 1\n")
    with pytest.raises(FileNotFoundError, match="--data"):
        embedded_default_documents(str(tmp_path))


def test_embedded_default_split_holds_out_whole_files_by_path_hash(tmp_path):
    import zlib

    sources = {f"m{i}.py": f"# module {i}\n" + "x = 1\n" * (2000 + 137 * i) for i in range(60)}
    for name, source in sources.items():
        write(tmp_path / name, source)
    train, validation, description = embedded_default_documents(str(tmp_path), validation_share=0.1)
    total = sum(map(len, sources.values()))
    order = sorted(sources, key=lambda name: zlib.crc32(name.encode()))
    held, chars = [], 0
    for name in order:  # the oracle: the shortest prefix of the hash order holding 10% of the characters
        if chars >= 0.1 * total:
            break
        held.append(name)
        chars += len(sources[name])
    assert sorted(validation) == sorted(sources[name] for name in held)
    assert sorted(train[:-1]) == sorted(sources[name] for name in sources if name not in held)
    assert f"{len(held)} other files held out" in description


# ---------------------------------------------------------------------------------------------------------------------
# Sources


def test_text_file_is_one_document(tmp_path):
    path = write(tmp_path / "notes.md", "line one\nline two\n")
    assert load_texts(path) == (["line one\nline two\n"], None, f"text file {path}")


def test_folder_of_txt_files_is_one_document_per_file_in_name_order(tmp_path):
    write(tmp_path / "b.txt", "second")
    write(tmp_path / "a.txt", "first")
    write(tmp_path / "README.md", "not a document")
    documents, validation, description = load_texts(str(tmp_path))
    assert (documents, validation) == (["first", "second"], None)
    assert str(tmp_path) in description


def test_dataset_rows_are_documents():
    dataset = datasets.Dataset.from_dict({"text": ["one", "", None, "two"], "id": [1, 2, 3, 4]})
    assert load_texts(dataset)[:2] == (["one", "two"], None)


def test_dataset_dict_validation_split_is_the_validation_set(bpe, text):
    train_documents, validation_documents = [text[:30_000], text[30_000:40_000]], [text[40_000:45_000]]
    source = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": train_documents}),
        "validation": datasets.Dataset.from_dict({"text": validation_documents}),
    })
    data = build_lm_data(source, bpe, block_size=32, progress=False)
    train_ids = encode(bpe, train_documents[0]) + [bpe.eos_token_id] + encode(bpe, train_documents[1])
    validation_ids = encode(bpe, validation_documents[0])
    assert data.train.input_ids.flatten().tolist() == train_ids[: len(train_ids) // 32 * 32]
    assert data.validation.input_ids.flatten().tolist() == validation_ids[: len(validation_ids) // 32 * 32]
    assert "held out" not in data.description


def test_dataset_dict_without_validation_split_holds_out_the_last_fraction():
    source = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a" * 90, "b" * 10]})})
    assert load_texts(source)[:2] == (["a" * 90, "b" * 10], None)


@pytest.fixture
def offline_datasets_cache(tmp_path, monkeypatch):
    """load_dataset writes its Arrow cache under tmp_path and never asks the Hub."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def write_jsonl(path, rows: list[dict]) -> None:
    write(path, "".join(json.dumps(row) + "\n" for row in rows))


def test_local_jsonl_folder_loads_through_load_dataset(tmp_path, offline_datasets_cache):
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"content": "alpha", "n": 1}, {"content": "beta", "n": 2}])
    write_jsonl(folder / "validation.jsonl", [{"content": "gamma", "n": 3}])
    train, validation, description = load_texts(str(folder), text_column="content")
    assert (train, validation) == (["alpha", "beta"], ["gamma"])
    assert description == f"dataset {folder} (train, validation)"


def test_local_jsonl_folder_without_validation_has_none(tmp_path, offline_datasets_cache):
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"text": "alpha"}, {"text": "beta"}])
    assert load_texts(str(folder))[:2] == (["alpha", "beta"], None)


# ---------------------------------------------------------------------------------------------------------------------
# Errors


def test_missing_text_file_names_the_path(tmp_path):
    missing = str(tmp_path / "missing.txt")
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        build_lm_data(missing, progress=False)


def test_missing_text_column_lists_the_columns():
    dataset = datasets.Dataset.from_dict({"content": ["x"], "id": [1]})
    with pytest.raises(ValueError, match="no column 'text'.*content, id.*--text-column"):
        load_texts(dataset)


def test_missing_split_lists_the_splits():
    source = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["x"]})})
    with pytest.raises(ValueError, match="no split 'test'.*train"):
        load_texts(source, validation_split="test")


def test_too_little_training_text_names_block_size(bpe, tmp_path):
    path = write(tmp_path / "short.txt", "Only a few words of text here.")
    with pytest.raises(ValueError, match="training text has .* fewer than block_size=128.*--block-size"):
        build_lm_data(path, bpe, block_size=128, progress=False)


def test_too_little_validation_text_names_block_size(bpe, text, tmp_path):
    path = write(tmp_path / "source.txt", text[:20_000])
    with pytest.raises(ValueError, match="validation text has .* fewer than block_size=512"):
        build_lm_data(path, bpe, block_size=512, validation_fraction=0.05, progress=False)


def test_block_size_below_two_is_rejected(bpe):
    for block_size in (0, 1, 2.5):
        with pytest.raises(ValueError, match="block_size"):
            build_lm_data(None, bpe, block_size=block_size, progress=False)


def test_too_small_vocab_size_is_rejected_before_reading_text(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=100"):
        build_lm_data(str(tmp_path / "missing.txt"), vocab_size=100, progress=False)


# ---------------------------------------------------------------------------------------------------------------------
# The Pythia tokenizer and Tiny Shakespeare (../shared/data; skipped when absent)


@pytest.fixture(scope="module")
def pythia_folder() -> str:
    if not os.path.isfile(os.path.join(PYTHIA_TOKENIZER, "tokenizer.json")):
        pytest.skip(f"the Pythia tokenizer is not in {PYTHIA_TOKENIZER}")
    return PYTHIA_TOKENIZER


def test_pythia_tokenizer_has_a_pad_token_and_gets_eos_as_pad_without_one(pythia_folder, tmp_path):
    assert load_tokenizer(pythia_folder).pad_token is not None  # its own "<|padding|>" is kept
    shutil.copy(os.path.join(pythia_folder, "tokenizer.json"), tmp_path)
    with open(os.path.join(pythia_folder, "tokenizer_config.json")) as f:
        config = {key: value for key, value in json.load(f).items() if key != "pad_token"}
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # GPTNeoXTokenizer would default pad to "<|padding|>"
    write(tmp_path / "tokenizer_config.json", json.dumps(config))
    tokenizer = load_tokenizer(str(tmp_path))
    assert tokenizer.eos_token == END_OF_TEXT
    assert tokenizer.pad_token == tokenizer.eos_token and tokenizer.pad_token_id == tokenizer.eos_token_id


def test_tiny_shakespeare_with_pythia_first_90_percent_trains_last_10_validates(pythia_folder):
    if not os.path.isfile(TINY_SHAKESPEARE):
        pytest.skip(f"Tiny Shakespeare is not at {TINY_SHAKESPEARE}")
    data = build_lm_data(TINY_SHAKESPEARE, pythia_folder, block_size=128, progress=False)
    with open(TINY_SHAKESPEARE, encoding="utf-8") as f:
        source = f.read()
    cut = int(len(source) * 0.9)
    assert torch.equal(data.train.input_ids, oracle_blocks(data.tokenizer, source[:cut], 128))
    assert torch.equal(data.validation.input_ids, oracle_blocks(data.tokenizer, source[cut:], 128))
    assert len(data.train) > 2000 and len(data.validation) > 200
    assert data.description == f"text file {TINY_SHAKESPEARE}, last 10% held out, tokenizer {pythia_folder}"
