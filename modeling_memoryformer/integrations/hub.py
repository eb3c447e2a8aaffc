"""Share a MemoryFormer on the Hugging Face Hub.

`model_card` writes the README.md of a model repo: YAML metadata for the Hub, the architecture, the FLOPs and table
memory against the Pythia twin (`evaluation.flops`), provenance, and how to load the model with this package
installed or through `trust_remote_code=True`. `push_to_hub` saves the model (safetensors, the remote-code files and
`auto_map`), tokenizer, generation config and that card into a temporary folder and uploads it as ONE commit, so a
repo never holds half a model. `run_push` is the `memoryformer push` command (its options: `cli.add_push_arguments`).

The card is this module's work, not the model's: transformers' own `model.push_to_hub(...)` uploads transformers'
generic card, as it does for remote code loaded without this package.

The Hub is reached through huggingface_hub, which honours `HF_ENDPOINT` (a mirror or a local stand-in) and finds
the token in `HF_TOKEN` or the `hf auth login` store.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, ModelCardData
from huggingface_hub.errors import HfHubHTTPError, HFValidationError
from huggingface_hub.utils import validate_repo_id

from ..evaluation.flops import (
    PYTHIA_TWINS,
    layer_memory_table,
    per_block_flops,
    pythia_block_flops,
    pythia_block_weight_bytes,
    pythia_twin_name,
    table_memory,
)
from ..modeling_memoryformer import MemoryFormerForCausalLM, MemoryFormerModel
from ..training.outputs import write_errors_named
from .settings import DEFAULT_COMMIT_MESSAGE, PushSettings


PLACEHOLDER_REPO_ID = "your-namespace/your-memoryformer"  # shown in a card generated without a repo id
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_MODEL_CLASSES = {cls.__name__: cls for cls in (MemoryFormerForCausalLM, MemoryFormerModel)}

CITATION = """\
@inproceedings{ding2024memoryformer,
  title     = {MemoryFormer: Minimize Transformer Computation by Removing Fully-Connected Layers},
  author    = {Ding, Ning and Tang, Yehui and Qin, Haochen and Zhou, Zhenli and Xu, Chao and Li, Lin and Han, Kai
               and Liao, Heng and Wang, Yunhe},
  booktitle = {Advances in Neural Information Processing Systems},
  year      = {2024}
}"""


# ----------------------------------------------------------------------------------------------------------------------
# Model card
def model_card(
    model,
    *,
    tokenizer=None,
    provenance: str | dict | None = None,
    base_model: str | None = None,
    datasets: list[str] | None = None,
    metrics: dict | None = None,
    repo_id: str | None = None,
    license: str = "apache-2.0",
    tags: list[str] | None = None,
    seq_len: int = 2048,
) -> str:
    """The README.md of a MemoryFormer model repo.

    Args:
        model: a MemoryFormer (`MemoryFormerForCausalLM` or `MemoryFormerModel`, from this package or remote code).
        tokenizer: the tokenizer pushed with it, if any (its size is checked against the model's vocabulary).
        provenance: how the weights came to be: free text, or a dict rendered as a list (e.g. `{"trained on":
            "wikitext-103", "steps": 20000}`). None says that it was not stated.
        base_model: Hub id of the model it was converted or fine-tuned from (YAML `base_model`).
        datasets: Hub ids of the training data (YAML `datasets`).
        metrics: evaluation results, name -> value, shown as a table.
        repo_id: the repo the card describes; its code snippets load exactly this id.
        license: YAML `license` (the code's license by default).
        tags: extra Hub tags besides `memoryformer` and `custom_code`.
        seq_len: sequence length of the FLOPs comparison (the paper's Table 1 uses 2048).
    """
    config = _memoryformer_config(model)
    _check_card_arguments(model, tokenizer, provenance, base_model, datasets, metrics, repo_id, seq_len)
    repo_id = repo_id or PLACEHOLDER_REPO_ID
    is_lm = model.can_generate()
    metadata = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation" if is_lm else "feature-extraction",
        license=license,
        tags=["memoryformer", "custom_code", *(tags or [])],
        base_model=base_model,
        datasets=list(datasets) if datasets else None,
    )
    sections = [
        f"---\n{metadata.to_yaml()}\n---",
        f"# {repo_id.split('/')[-1]}",
        "A **MemoryFormer** (Ding et al., *MemoryFormer: Minimize Transformer Computation by Removing "
        "Fully-Connected Layers*, NeurIPS 2024): a decoder-only transformer whose fully-connected layers are "
        "*Memory Layers*. A Memory Layer splits its input into K chunks of tau values, hashes each chunk by the "
        "signs of its values into one of 2^tau rows of its own table, and sums the K retrieved rows weighted by a "
        "differentiable score: K x d_out multiply-adds per token instead of d_in x d_out, for 2^tau / tau times "
        "more parameters. Attention is unchanged; Q, K and V come from Memory Layers and the feed-forward network "
        "is a Memory Block of two Memory Layers.",
        "## Provenance\n\n" + _provenance_text(provenance, base_model, datasets),
        "## Architecture\n\n" + _architecture_table(model, config, tokenizer),
        "## Compute and memory against the Pythia twin\n\n" + _comparison_text(config, seq_len),
    ]
    if metrics:
        rows = "\n".join(f"| {name} | {value} |" for name, value in metrics.items())
        sections.append(f"## Evaluation\n\n| metric | value |\n|---|---|\n{rows}")
    sections += [
        "## How to use\n\n" + _usage_text(repo_id, is_lm, tokenizer is not None),
        "## Limitations\n\n"
        "- Hash codes are discontinuous: numerically different backends (bf16 vs fp32, another attention kernel) "
        "can flip a bit of a code and change an output. Compare runs in float32.\n"
        "- The hash tables are large by design: the model trades memory for compute (see the table above).\n"
        "- The fused CPU kernel is compiled at first use with the system C++ compiler and ninja; without them the "
        "model runs on the plain PyTorch path (same maths, slower).",
        f"## Citation\n\n```bibtex\n{CITATION}\n```",
    ]
    return "\n\n".join(sections) + "\n"


def write_model_card(model, folder: str | Path, repo_id: str | None, **card_kwargs) -> Path:
    """Write `model_card(...)` to `folder/README.md`, keeping the tags of a README.md already there (e.g. the card
    that transformers' `save_pretrained(..., push_to_hub=True)` or a user wrote)."""
    path = Path(folder, "README.md")
    if path.is_file():
        previous_tags = ModelCard.load(path).data.tags or []
        card_kwargs["tags"] = [*previous_tags, *(card_kwargs.get("tags") or [])]
    path.write_text(model_card(model, repo_id=repo_id, **card_kwargs), encoding="utf-8")
    return path


def _memoryformer_config(model):
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "memoryformer":
        raise TypeError(
            f"Expected a MemoryFormer model (config.model_type 'memoryformer'), got {type(model).__name__} with "
            f"model_type {getattr(config, 'model_type', None)!r}. Pass a MemoryFormerForCausalLM or MemoryFormerModel."
        )
    return config


def _check_card_arguments(model, tokenizer, provenance, base_model, datasets, metrics, repo_id, seq_len) -> None:
    if tokenizer is not None:
        if not hasattr(tokenizer, "save_pretrained"):
            raise TypeError(f"tokenizer must be a transformers tokenizer, got {type(tokenizer).__name__}.")
        if len(tokenizer) > model.config.vocab_size:
            raise ValueError(
                f"The tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {model.config.vocab_size}: "
                "ids beyond the embedding would crash. Push the tokenizer the model was trained with."
            )
    if provenance is not None and not isinstance(provenance, (str, dict)):
        raise TypeError(f"provenance must be a str, a dict or None, got {type(provenance).__name__}.")
    if base_model is not None and not isinstance(base_model, str):
        raise TypeError(f"base_model must be a Hub model id (str), got {type(base_model).__name__}.")
    if datasets is not None and (isinstance(datasets, str) or not all(isinstance(d, str) for d in datasets)):
        raise TypeError(f"datasets must be a list of Hub dataset ids, got {datasets!r}.")
    if metrics is not None and not isinstance(metrics, dict):
        raise TypeError(f"metrics must be a dict of name -> value, got {type(metrics).__name__}.")
    if repo_id is not None:
        check_repo_id(repo_id)
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}.")


def _provenance_text(provenance: str | dict | None, base_model: str | None, datasets: list[str] | None) -> str:
    if isinstance(provenance, dict):
        text = "\n".join(f"- **{key}**: {value}" for key, value in provenance.items())
    elif provenance:
        text = provenance.strip()
    else:
        text = "Not stated by the uploader: ask how these weights were obtained before relying on them."
    if base_model:
        text += f"\n\nBase model: [{base_model}](https://huggingface.co/{base_model})."
    if datasets:
        text += "\n\nData: " + ", ".join(f"[{d}](https://huggingface.co/datasets/{d})" for d in datasets) + "."
    return text


def _architecture_table(model, config, tokenizer) -> str:
    parameters = sum(p.numel() for p in model.parameters())
    table_parameters = sum(p.numel() for name, p in model.named_parameters() if name.endswith("tables"))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    tau, e = config.hash_bits, config.expand_bits
    residual = "parallel (Pythia)" if config.use_parallel_residual else "sequential pre-norm"
    rows = [
        ("class", type(model).__name__),
        ("layers", config.num_hidden_layers),
        ("hidden size d", config.hidden_size),
        ("attention heads", f"{config.num_attention_heads} (head dim {config.head_dim})"),
        ("hash bits tau", tau),
        ("tables per Memory Layer K = d / tau", config.num_tables),
        ("expanding bits e", f"{e} (Memory Block width {config.intermediate_size}, hashed with {tau + e} bits)"),
        ("hash score", f"{config.hash_score} (temperature {config.hash_temperature})"),
        ("norm, residual", f"{config.norm_type}, {residual}"),
        ("attention output", config.attention_output),
        ("Memory Block activation", config.memory_block_activation),
        ("vocabulary, context", f"{config.vocab_size}, {config.max_position_embeddings} positions"),
        ("parameters", f"{parameters:,}"),
        ("of which in hash tables", f"{table_parameters:,} ({100 * table_parameters / parameters:.1f}%)"),
        ("weights", f"{', '.join(dtypes)}, {weight_bytes:,} bytes"),
    ]
    if tokenizer is not None:
        rows.append(("tokenizer", f"{type(tokenizer).__name__}, {len(tokenizer)} tokens"))
    return "| | |\n|---|---|\n" + "\n".join(f"| {name} | {value} |" for name, value in rows)


def _comparison_text(config, seq_len: int) -> str:
    """Per-block FLOPs (paper Table 1 counting) and fp16 weight/table bytes beside the dense twin of the same shape."""
    mf, dense = per_block_flops(config, seq_len), pythia_block_flops(config, seq_len)
    tables, dense_bytes = table_memory(config)["block"], pythia_block_weight_bytes(config)
    layers = config.num_hidden_layers
    rows = [
        ("FLOPs w/o attention (paper formula 6Ksd)", dense["without_attention"], mf["without_attention"]),
        ("FLOPs w/o attention (exact sum, hashing included)", dense["without_attention"],
         mf["without_attention_exact"]),
        ("attention FLOPs (2 s^2 d)", dense["attention"], mf["attention"]),
        ("total FLOPs", dense["total"], mf["total"]),
        ("FC weights / hash tables per block, bytes", dense_bytes, tables),
        ("FC weights / hash tables, whole model, bytes", dense_bytes * layers, tables * layers),
    ]
    twin = pythia_twin_name(config)
    if (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) in PYTHIA_TWINS:
        against = f"its dense twin {twin}: the Pythia (GPT-NeoX) model of the same width, depth and heads"
        column = twin
    else:  # no Pythia model has this shape: the twin is described, not named
        against = (f"its dense twin: a GPT-NeoX (Pythia-style) model of the same width (d = {config.hidden_size}), "
                   f"depth ({config.num_hidden_layers} blocks) and heads ({config.num_attention_heads})")
        column = "dense twin"
    table = [f"| per block, s = {seq_len} | {column} | MemoryFormer | MemoryFormer / twin |", "|---|---|---|---|"]
    table += [f"| {label} | {twin_value:,} | {mf_value:,} | {mf_value / twin_value:.3g}x |"
              for label, twin_value, mf_value in rows]
    return (
        f"Counted as the paper counts them (Table 1: one multiply-add = one FLOP), per block at sequence length "
        f"{seq_len}, against {against}. "
        "Memory in float16 bytes, as the paper quotes it.\n\n"
        + "\n".join(table)
        + "\n\nHash tables per Memory Layer of one block (float16):\n\n"
        + layer_memory_table(config)
    )


def _usage_text(repo_id: str, is_lm: bool, has_tokenizer: bool) -> str:
    auto_class = "AutoModelForCausalLM" if is_lm else "AutoModel"
    tokenizer_source = f'"{repo_id}"' if has_tokenizer else '"<the tokenizer this model was trained with>"'
    text = [
        "With the `memoryformer-hf` package installed (it imports as `modeling_memoryformer` and registers the "
        "model with the Auto classes):",
        f'```python\nimport modeling_memoryformer  # noqa: F401\nfrom transformers import {auto_class}, AutoTokenizer\n\n'
        f'model = {auto_class}.from_pretrained("{repo_id}")\ntokenizer = AutoTokenizer.from_pretrained({tokenizer_source})\n```',
        "Without it, through the model code stored in this repository (`trust_remote_code=True` runs those Python "
        "files: read them first, and pin a commit with `revision=`):",
        f'```python\nfrom transformers import {auto_class}\n\n'
        f'model = {auto_class}.from_pretrained("{repo_id}", trust_remote_code=True)\n```',
    ]
    if not has_tokenizer:
        text.append("This repository has no tokenizer: use the one the model was trained with.")
    if is_lm:
        pipeline_tokenizer = "" if has_tokenizer else f", tokenizer={tokenizer_source}"
        text += [
            "Generation, with the package installed or through remote code:",
            f'```python\nfrom transformers import pipeline\n\n'
            f'generator = pipeline("text-generation", model="{repo_id}"{pipeline_tokenizer}, trust_remote_code=True)\n'
            f'print(generator("The meaning of life is", max_new_tokens=32, do_sample=False)[0]["generated_text"])\n```',
        ]
    return "\n\n".join(text)


# ----------------------------------------------------------------------------------------------------------------------
# Push
def check_repo_id(repo_id: str) -> None:
    """Raise a ValueError naming the problem if `repo_id` is not a valid Hub model id ("name" or "namespace/name")."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ValueError(
            f"{repo_id!r} is not a valid Hub repo id: {error} Use 'namespace/name' (or a bare 'name' for your own "
            "account) with letters, digits, '-', '_' and '.'."
        ) from None


def push_to_hub(
    model,
    repo_id: str,
    *,
    tokenizer=None,
    provenance: str | dict | None = None,
    private: bool = False,
    commit_message: str = DEFAULT_COMMIT_MESSAGE,
    token: str | None = None,
    endpoint: str | None = None,
    **card_kwargs: Any,
) -> str:
    """Upload `model` (safetensors, remote-code files, `auto_map`, generation config), `tokenizer` and the generated
    model card to the Hub repo `repo_id` in one commit, creating the repo if needed. Returns the commit URL.

    The card (`model_card`, which takes `card_kwargs`) shows the repo's final id: a bare name is created in the
    token's account. `private` applies only when the repo is created. `token` defaults to `HF_TOKEN` or the
    `hf auth login` store, `endpoint` to `HF_ENDPOINT` (else huggingface.co). Everything is checked before the
    repo is created; the single commit means a failed upload leaves no partial model in the repo.
    """
    check_repo_id(repo_id)
    card_kwargs.update(tokenizer=tokenizer, provenance=provenance)
    model_card(model, repo_id=repo_id, **card_kwargs)  # raises on bad input before anything is created
    api = HfApi(endpoint=endpoint, token=token)
    with tempfile.TemporaryDirectory(prefix="memoryformer-push-") as folder:
        with write_errors_named(folder, "Nothing was uploaded."):  # a full temporary disk: one line, not a traceback
            model.save_pretrained(folder)  # model.safetensors, config.json with auto_map, generation_config.json, code
            if tokenizer is not None:
                tokenizer.save_pretrained(folder)
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        write_model_card(model, folder, repo_id, **card_kwargs)
        # create_commit sends all files in one commit. upload_folder would not guarantee it: with hf_xet installed,
        # huggingface_hub 2.4 streams a folder in several commits once it holds many files or much inline content.
        operations = [
            CommitOperationAdd(path_in_repo=path.relative_to(folder).as_posix(), path_or_fileobj=str(path))
            for path in sorted(Path(folder).rglob("*"))
            if path.is_file()
        ]
        commit = api.create_commit(repo_id=repo_id, operations=operations, commit_message=commit_message)
    return commit.commit_url


# ----------------------------------------------------------------------------------------------------------------------
# `memoryformer push`
def run_push(settings: PushSettings) -> int:
    """Load the model folder (safetensors only) and push it with its card; print the commit URL. Exit code 2 for
    bad input, 1 if the Hub refuses the upload."""
    folder = Path(settings.model)
    try:
        check_repo_id(settings.repo_id)
        model_class = _saved_model_class(folder)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    model = model_class.from_pretrained(folder, use_safetensors=True, dtype="auto")
    tokenizer = None
    if settings.tokenizer or any((folder / name).is_file() for name in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer or folder)
    card = dict(tokenizer=tokenizer, provenance=settings.provenance, base_model=settings.base_model,
                datasets=settings.datasets, license=settings.license)  # what the card shows, pushed or previewed
    if settings.preview_card:
        return _preview_card(model, settings.repo_id, settings.preview_card, card)
    try:
        url = push_to_hub(
            model, settings.repo_id, private=settings.private, commit_message=settings.commit_message, **card,
        )
    except ValueError as error:  # e.g. a tokenizer larger than the model's vocabulary
        print(f"error: {error}", file=sys.stderr)
        return 2
    except HfHubHTTPError as error:
        print(f"error: the Hub refused the upload to {settings.repo_id!r}: {error}", file=sys.stderr)
        return 1
    print(url)
    return 0


def _preview_card(model, repo_id: str, preview_card: str, card_kwargs: dict) -> int:
    """Write the card `push` would upload to `preview_card` (complete or not at all) without the Hub: the repo id is
    shown as given (a bare name stays bare; the push would put it under the token's account)."""
    try:
        card = model_card(model, repo_id=repo_id, **card_kwargs)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    path = Path(preview_card)
    if path.is_dir():
        print(f"error: --preview-card {str(path)!r} is a folder; pass a file path such as card.md.", file=sys.stderr)
        return 2
    if not path.parent.is_dir():
        print(f"error: --preview-card {str(path)!r}: the folder {str(path.parent)!r} does not exist; create it or pass "
              "a path in an existing folder.", file=sys.stderr)
        return 2
    partial = path.with_name(path.name + ".partial")
    try:
        with write_errors_named(str(path), "No card was written."):
            partial.write_text(card, encoding="utf-8")
            partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    print(f"model card written to {path} (nothing uploaded)")
    return 0


def _saved_model_class(folder: Path) -> type:
    """The MemoryFormer class a save_pretrained folder holds; a ValueError naming what is missing otherwise."""
    fix = "Pass the folder written by `model.save_pretrained(...)` (config.json and model.safetensors)."
    if not folder.is_dir():
        raise ValueError(f"--model {folder}: no such folder. {fix}")
    if not (folder / "config.json").is_file():
        raise ValueError(f"--model {folder} has no config.json. {fix}")
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if config.get("model_type") != "memoryformer":
        raise ValueError(f"--model {folder} holds a {config.get('model_type')!r} model, not a MemoryFormer.")
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise ValueError(
            f"--model {folder} has no model.safetensors: weights are loaded only from safetensors. Load the model "
            "where it was made and re-save it with `save_pretrained` (which writes safetensors)."
        )
    architecture = (config.get("architectures") or ["MemoryFormerForCausalLM"])[0]
    if architecture not in _MODEL_CLASSES:
        raise ValueError(f"--model {folder}: unknown architecture {architecture!r}; expected one of "
                         f"{', '.join(_MODEL_CLASSES)}.")
    return _MODEL_CLASSES[architecture]
