"""Causal-LM training data: text -> tokens -> fixed-length blocks, with a held-out validation set.

    load_texts        documents from a source: the embedded default, a text file, a folder of .txt files, a
                      `datasets.Dataset` / `DatasetDict`, or anything `datasets.load_dataset` reads
    train_bpe_tokenizer / load_tokenizer
    token_stream      documents -> one stream of ids, eos between documents
    pack_blocks       stream -> LongTensor [S, block_size]; the tail that does not fill a block is dropped and counted
    build_lm_data     all of it: LMData(train, validation, tokenizer, ...)

Without a validation split in the source, the validation set is the last `validation_fraction` of the text (by
characters, documents in order). The text is split before tokenizing, so no block straddles the boundary and a
trained tokenizer never sees the held-out text.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm


if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast


EMBEDDED_DEFAULT = "embedded default (the Python standard library's source and pydoc_data documentation)"
# The embedded default's held-out files: the first files in the order of a hash of their paths that hold at least
# this share of the corpus's characters.
EMBEDDED_VALIDATION_SHARE = 0.02
# Folders of the standard library left out of the embedded default: test suites, installed packages, and
# pydoc_data (its topics, the documentation, are added as one document of text, not as Python source).
STDLIB_SKIPPED_FOLDERS = ("test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "pydoc_data")
END_OF_TEXT = "<|endoftext|>"
MIN_BPE_VOCAB = 300  # 256 byte symbols + <|endoftext|> + a few merges
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
DATASET_FILE_EXTENSIONS = (".json", ".jsonl", ".csv", ".tsv", ".parquet", ".arrow")
# One tokenizer call on a 50 MB text takes ~8 GB and a minute with no progress: texts are tokenized in pieces of
# CHUNK_CHARS characters, BATCH_CHARS per call (a batch call runs on all cores)
CHUNK_CHARS = 1 << 18
BATCH_CHARS = 1 << 22
CUT_WINDOW = 2000  # characters either side of a cut that must tokenize the same whole and in two pieces
CUT_TRIES = 64  # line starts tried per cut before tokenizing the rest of the document in one call


class TokenBlocks(torch.utils.data.Dataset):
    """Fixed-length token sequences as causal-LM examples: {"input_ids", "labels"} (labels = input ids; the model
    shifts them)."""

    def __init__(self, input_ids: torch.Tensor):
        self.input_ids = input_ids

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "labels": self.input_ids[index]}


@dataclass
class LMData:
    """Training and validation blocks [S, block_size] and the tokenizer that made them."""

    train: TokenBlocks
    validation: TokenBlocks
    tokenizer: PreTrainedTokenizerBase
    description: str
    block_size: int
    num_train_tokens: int
    num_validation_tokens: int
    dropped_tokens: int  # tail tokens of the training and validation streams that did not fill a block


# ---------------------------------------------------------------------------------------------------------------------
# Text sources


def embedded_default_text() -> str:
    """A small text every machine has: the Python documentation shipped with CPython (`pydoc_data.topics`, ~465 KB),
    its topics joined in sorted-name order with blank lines. Part of the embedded default corpus."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def standard_library_files(root: str | None = None) -> list[str]:
    """Paths, relative to `root` (default: this interpreter's standard library), of its `.py` files outside test
    suites, installed packages and pydoc_data (STDLIB_SKIPPED_FOLDERS), in sorted order."""
    import sysconfig

    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for folder, subfolders, files in os.walk(root):
        relative = os.path.relpath(folder, root)
        subfolders[:] = sorted(name for name in subfolders
                               if name not in STDLIB_SKIPPED_FOLDERS and not name.startswith("config-"))
        found += [os.path.normpath(os.path.join(relative, name)) for name in files if name.endswith(".py")]
    return sorted(found)


def embedded_default_documents(root: str | None = None,
                               validation_share: float = EMBEDDED_VALIDATION_SHARE) -> tuple[list[str], list[str], str]:
    """(training documents, validation documents, description) of the embedded default corpus: every `.py` file of
    the running Python's standard library outside its test suites (`standard_library_files`, one document each,
    about 10 MB on CPython 3.11) and the pydoc_data documentation (`embedded_default_text`, one document, training).
    The split is by file: files in the order of the CRC-32 of their relative paths are held out until they hold
    `validation_share` of the source's characters; the same Python gives the same split on every machine."""
    import sysconfig
    import tokenize
    import zlib

    root = root or sysconfig.get_paths()["stdlib"]
    names = standard_library_files(root)
    sources, unreadable = {}, 0
    for name in names:
        try:
            with tokenize.open(os.path.join(root, name)) as f:  # honours a file's coding declaration
                sources[name] = f.read()
        except (OSError, SyntaxError, UnicodeDecodeError):
            unreadable += 1
    total = sum(map(len, sources.values()))
    if total < 1_000_000:
        raise FileNotFoundError(
            f"the embedded default corpus needs the Python standard library's source, and {root!r} holds only "
            f"{len(sources)} readable .py files ({total / 1e6:.2f} MB): this Python ships without it. Pass --data a "
            "text file, a folder of .txt files or a dataset id instead."
        )
    held_out, held_chars = set(), 0
    for name in sorted(sources, key=lambda name: (zlib.crc32(name.encode("utf-8")), name)):
        if held_chars >= validation_share * total:
            break
        held_out.add(name)
        held_chars += len(sources[name])
    train = [sources[name] for name in sources if name not in held_out] + [embedded_default_text()]
    validation = [sources[name] for name in sources if name in held_out]
    version = ".".join(map(str, sys.version_info[:3]))
    description = (
        f"{EMBEDDED_DEFAULT}: Python {version}, {len(sources) - len(held_out)} .py files and the pydoc_data topics "
        f"for training ({sum(map(len, train)) / 1e6:.1f} MB), {len(held_out)} other files held out "
        f"({held_chars / 1e6:.2f} MB); test suites left out"
        + (f", {unreadable} unreadable files skipped" if unreadable else "")
    )
    return train, validation, description


def load_texts(data=None, split: str = "train", text_column: str = "text", validation_split: str | None = None):
    """(training documents, validation documents or None when the source has none, description) from `data`:

    None                      the embedded default (`embedded_default_documents`): the standard library's source
                              and documentation, with its own held-out files
    datasets.Dataset          one document per row of `text_column`
    datasets.DatasetDict      `split` for training, `validation_split` (default "validation" when present)
    a file                    one document (UTF-8 text)
    a folder of .txt files    one document per file, in name order (top level; no .jsonl/.csv/... beside them)
    anything else             `datasets.load_dataset(data)`: another local data folder, or a Hub dataset id
    Rows whose text is empty or None are skipped."""
    import datasets

    if data is None:
        return embedded_default_documents()
    if isinstance(data, datasets.Dataset):
        return _column(data, text_column, "the dataset"), None, f"datasets.Dataset ({data.num_rows} rows)"
    if isinstance(data, datasets.DatasetDict):
        return _from_dataset_dict(data, "the DatasetDict", split, text_column, validation_split)
    if not isinstance(data, (str, os.PathLike)):
        raise TypeError(f"data must be None, a path, a dataset id, a datasets.Dataset or DatasetDict, not {data!r}")
    path = os.fspath(data)
    if os.path.isfile(path):
        return [_read_text(path)], None, f"text file {path}"
    text_files = _text_files(path) if os.path.isdir(path) else []
    if text_files:
        documents = [_read_text(name) for name in text_files]
        return documents, None, f"{len(text_files)} .txt files in {path}"
    if not os.path.exists(path) and _looks_like_path(path):
        raise FileNotFoundError(f"data {path!r} does not exist. Pass a text file, a folder, or a dataset id.")
    try:
        loaded = datasets.load_dataset(path)
    except Exception as error:  # load_dataset raises many kinds (ConnectionError, DatasetNotFoundError, ValueError)
        raise ValueError(
            f"could not load data {path!r}: it is not a file or a folder of .txt files, and datasets.load_dataset "
            f"failed ({type(error).__name__}: {error}). Pass a text file, a folder, or a dataset id."
        ) from error
    return _from_dataset_dict(loaded, f"dataset {path}", split, text_column, validation_split)


def _from_dataset_dict(dataset_dict, name: str, split: str, text_column: str, validation_split: str | None):
    splits = ", ".join(dataset_dict)
    for wanted in (split, validation_split):
        if wanted is not None and wanted not in dataset_dict:
            raise ValueError(f"{name} has no split {wanted!r}; its splits are: {splits}. Choose one of them.")
    if validation_split is None and "validation" in dataset_dict and split != "validation":
        validation_split = "validation"
    train = _column(dataset_dict[split], text_column, f"{name}[{split!r}]")
    if validation_split is None:
        return train, None, f"{name} ({split})"
    validation = _column(dataset_dict[validation_split], text_column, f"{name}[{validation_split!r}]")
    return train, validation, f"{name} ({split}, {validation_split})"


def _column(dataset, text_column: str, name: str) -> list[str]:
    if text_column not in dataset.column_names:
        raise ValueError(
            f"{name} has no column {text_column!r}; its columns are: {', '.join(dataset.column_names)}. "
            "Pass the one holding the text with --text-column NAME."
        )
    return [text for text in dataset[text_column] if text]


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as error:
        raise ValueError(f"{path!r} is not UTF-8 text ({error}). Pass a UTF-8 text file.") from error


def _text_files(folder: str) -> list[str]:
    """The folder's top-level .txt files in name order, or [] when it also holds data files for load_dataset."""
    names = sorted(name for name in os.listdir(folder) if os.path.isfile(os.path.join(folder, name)))
    if any(name.lower().endswith(DATASET_FILE_EXTENSIONS) for name in names):
        return []
    return [os.path.join(folder, name) for name in names if name.lower().endswith(".txt")]


def _looks_like_path(name: str) -> bool:
    """True for strings that cannot be Hub ids ("name" or "owner/name"), so a typo is not sent to the Hub."""
    return (
        os.path.isabs(name)
        or name.startswith((".", "~"))
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
        or name.lower().endswith((".txt", *DATASET_FILE_EXTENSIONS))
    )


def split_documents(documents: list[str], validation_fraction: float) -> tuple[list[str], list[str]]:
    """(first part, last `validation_fraction` part) of the concatenated documents, by characters: the document
    holding the cut is split in two, documents before it train and documents after it are held out."""
    if not 0 < validation_fraction < 1:
        raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction!r}.")
    cut = int(sum(len(document) for document in documents) * (1 - validation_fraction))
    train, validation = [], []
    for document in documents:
        keep = min(max(cut, 0), len(document))  # characters of this document before the cut
        train += [document[:keep]] if keep else []
        validation += [document[keep:]] if keep < len(document) else []
        cut -= len(document)
    return train, validation


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizers


def train_bpe_tokenizer(text: str | list[str], vocab_size: int = 4096) -> PreTrainedTokenizerFast:
    """A byte-level BPE of `vocab_size` tokens (GPT-2 style: any text round-trips) trained on `text`, with
    "<|endoftext|>" as bos, eos and pad. Deterministic: the same text gives the same vocabulary and merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    _check_vocab_size(vocab_size)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([text] if isinstance(text, str) else text, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        clean_up_tokenization_spaces=False,  # "a , b" must decode to "a , b"
    )


def _check_vocab_size(vocab_size: int) -> None:
    if not isinstance(vocab_size, int) or vocab_size < MIN_BPE_VOCAB:
        raise ValueError(
            f"vocab_size={vocab_size!r} is too small for a byte-level BPE (256 byte symbols come first); "
            f"use --vocab-size {MIN_BPE_VOCAB} or more."
        )


TRAIN_TOKENIZER_HINT = "Pass a tokenizer folder or a Hub id, or leave --tokenizer out to train a BPE on the data."


def load_tokenizer(
    name_or_path: str | os.PathLike, *, hint: str = TRAIN_TOKENIZER_HINT, pad_with_eos: bool = True
) -> PreTrainedTokenizerBase:
    """`AutoTokenizer.from_pretrained` of a local folder or a Hub id, with errors that name the problem.

    A folder without tokenizer files is a ValueError (transformers would build an empty tokenizer from it), a path
    that does not exist a FileNotFoundError, anything transformers cannot load a ValueError; each message ends with
    `hint`, the fix in the caller's terms (train, eval and convert each pass their own). `pad_with_eos` sets
    pad = eos when the tokenizer has no pad token (batching needs one; the evaluation harness sets its own).
    """
    from transformers import AutoTokenizer

    name_or_path = os.fspath(name_or_path)
    if os.path.isdir(name_or_path) and not any(
        os.path.isfile(os.path.join(name_or_path, name)) for name in TOKENIZER_FILES
    ):  # transformers would build an empty tokenizer from such a folder
        raise ValueError(
            f"tokenizer folder {name_or_path!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)}). {hint}"
        )
    if not os.path.exists(name_or_path) and _looks_like_path(name_or_path):
        raise FileNotFoundError(f"tokenizer {name_or_path!r} does not exist. {hint}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(f"could not load a tokenizer from {name_or_path!r} ({error}). {hint}") from error
    if pad_with_eos and tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def refused_checkpoint_message(location: str, flag: str, error: BaseException) -> str:
    """One line for a `.bin` checkpoint that `torch.load(weights_only=True)` refuses (pickle.UnpicklingError): what
    it holds, and the fix (re-save as safetensors), instead of torch's multi-line advice to unpickle it anyway."""
    import re

    detail = re.search(r"WeightsUnpickler error: ([^\n]*?)(?: was not an allowed global|\.?\n|$)", str(error))
    found = f" ({detail.group(1).strip()})" if detail else ""
    return (
        f"{flag} {location!r}: its .bin checkpoint holds objects other than tensors{found}, which "
        "torch.load(weights_only=True) refuses to unpickle. Re-save it as safetensors (load it where you trust its "
        "source, then model.save_pretrained(folder)) and pass that folder."
    )


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizing and packing


def token_stream(
    documents: list[str], tokenizer, progress: bool = False, chunk_chars: int = CHUNK_CHARS, desc: str = "tokenizing"
) -> torch.Tensor:
    """LongTensor [N]: each document tokenized without special tokens, documents joined with the eos id. Long
    documents are tokenized in pieces of about `chunk_chars` characters (`safe_pieces`), BATCH_CHARS per call."""
    if len(documents) > 1 and tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token to separate documents; pass a tokenizer with one.")
    pieces = [(index, piece) for index, document in enumerate(documents)
              for piece in safe_pieces(document, tokenizer, chunk_chars)]
    stream, previous = [], 0
    with tqdm(total=sum(map(len, documents)), desc=desc, unit="char", unit_scale=True, disable=not progress) as bar:
        for batch in _batches(pieces, max(chunk_chars, BATCH_CHARS)):
            encoded = tokenizer([piece for _, piece in batch], add_special_tokens=False, verbose=False)["input_ids"]
            ids = []
            for (index, _), piece_ids in zip(batch, encoded):
                # one eos per document boundary crossed since the previous piece (empty documents count too)
                ids += [tokenizer.eos_token_id] * (index - previous) + piece_ids
                previous = index
            stream.append(torch.tensor(ids, dtype=torch.long))
            bar.update(sum(len(piece) for _, piece in batch))
    return torch.cat(stream) if stream else torch.zeros(0, dtype=torch.long)


def _batches(pieces: list, batch_chars: int):
    """Consecutive runs of (document index, text) pieces of at most `batch_chars` characters (or one piece)."""
    batch, size = [], 0
    for piece in pieces:
        if batch and size + len(piece[1]) > batch_chars:
            yield batch
            batch, size = [], 0
        batch.append(piece)
        size += len(piece[1])
    if batch:
        yield batch


def safe_pieces(text: str, tokenizer, chunk_chars: int = CHUNK_CHARS) -> list[str]:
    """`text` cut at line starts about every `chunk_chars` characters, only where tokenizing CUT_WINDOW characters
    either side of the cut in one call gives the same ids as the two sides separately. BPE never merges across the
    pre-tokenizer's splits, so the pieces' ids concatenated are the ids of `text`. A tokenizer that treats the start
    of a text specially (a prefix space) fails every check and gets the text whole."""
    pieces, start = [], 0
    while len(text) - start > chunk_chars:
        cut = _safe_cut(text, start + chunk_chars, tokenizer)
        if cut is None:
            break
        pieces.append(text[start:cut])
        start = cut
    return pieces + [text[start:]]


def _safe_cut(text: str, position: int, tokenizer) -> int | None:
    """The first line start after `position` (of CUT_TRIES) where the text may be cut, or None."""

    def ids(part: str) -> list[int]:
        return tokenizer(part, add_special_tokens=False, verbose=False)["input_ids"]

    for _ in range(CUT_TRIES):
        cut = text.find("\n", position) + 1
        if cut <= 0 or cut >= len(text):
            return None
        left, right = text[max(cut - CUT_WINDOW, 0): cut], text[cut: cut + CUT_WINDOW]
        if ids(left + right) == ids(left) + ids(right):
            return cut
        position = cut
    return None


def pack_blocks(ids: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
    """(LongTensor [S, block_size] of consecutive non-overlapping blocks of the stream `ids` [N], number of tail
    tokens dropped because they did not fill a block)."""
    usable = ids.numel() // block_size * block_size
    return ids[:usable].view(-1, block_size), ids.numel() - usable


def text_blocks(text: str, tokenizer, seq_len: int) -> torch.Tensor:
    """Tokenise `text` and cut it into consecutive non-overlapping sequences: LongTensor [S, seq_len] (the tail that
    does not fill a sequence is dropped)."""
    return pack_blocks(token_stream([text], tokenizer), seq_len)[0]


# ---------------------------------------------------------------------------------------------------------------------
# Everything together


def build_lm_data(
    data=None,
    tokenizer=None,
    block_size: int = 128,
    vocab_size: int = 4096,
    validation_fraction: float = 0.1,
    text_column: str = "text",
    split: str = "train",
    validation_split: str | None = None,
    progress: bool = True,
) -> LMData:
    """Training and validation blocks from `data` (see `load_texts`). `tokenizer`: a tokenizer, a folder or Hub id,
    or None to train a byte-level BPE of `vocab_size` tokens on the training text. Without a validation split in
    the source the last `validation_fraction` of the text is held out."""
    if not isinstance(block_size, int) or block_size < 2:
        raise ValueError(f"block_size must be an integer >= 2, got {block_size!r}; pass --block-size 2 or more.")
    if tokenizer is None:
        _check_vocab_size(vocab_size)  # before reading any text
    train_documents, validation_documents, description = load_texts(data, split, text_column, validation_split)
    if validation_documents is None:
        train_documents, validation_documents = split_documents(train_documents, validation_fraction)
        description += f", last {validation_fraction:.0%} held out"
    if tokenizer is None:
        tokenizer = train_bpe_tokenizer(train_documents, vocab_size)
        description += f", byte-level BPE {len(tokenizer)}"
    elif isinstance(tokenizer, (str, os.PathLike)):
        description += f", tokenizer {os.fspath(tokenizer)}"
        tokenizer = load_tokenizer(tokenizer)
    else:
        description += f", tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__}"

    blocks, dropped = {}, 0
    for name, documents in (("training", train_documents), ("validation", validation_documents)):
        ids = token_stream(documents, tokenizer, progress, desc=f"tokenizing {name} text")
        if ids.numel() < block_size:
            raise ValueError(
                f"the {name} text has {ids.numel()} tokens, fewer than block_size={block_size}; use a smaller "
                "--block-size or more text."
            )
        blocks[name], tail = pack_blocks(ids, block_size)
        dropped += tail
    return LMData(
        train=TokenBlocks(blocks["training"]),
        validation=TokenBlocks(blocks["validation"]),
        tokenizer=tokenizer,
        description=description,
        block_size=block_size,
        num_train_tokens=blocks["training"].numel(),
        num_validation_tokens=blocks["validation"].numel(),
        dropped_tokens=dropped,
    )


__all__ = [
    "LMData",
    "TokenBlocks",
    "build_lm_data",
    "embedded_default_documents",
    "embedded_default_text",
    "load_texts",
    "load_tokenizer",
    "pack_blocks",
    "safe_pieces",
    "split_documents",
    "standard_library_files",
    "text_blocks",
    "token_stream",
    "train_bpe_tokenizer",
]
