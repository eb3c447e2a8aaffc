"""Nothing lost: checks that keep a run, a checkpoint or a source model from being overwritten, taken for complete
when it is not, or loaded with some of its tensors silently re-initialised.

- `load_pretrained_strict`: `from_pretrained` that refuses a checkpoint with missing, unexpected or mismatched
  tensors (naming them) instead of initialising the missing ones at random with a warning.
- `checkpoint_problems` / `latest_complete_checkpoint`: a Trainer checkpoint is complete only when the completion
  marker (written after every other file, see `trainer.MemoryFormerTrainer`) is there and every file the Trainer
  wrote is present and intact (JSON parses, safetensors and torch archives are not truncated).
- `check_train_output`: `memoryformer train` does not write over another run unless asked to.
"""

from __future__ import annotations

import glob
import json
import os
import re
import struct
import zipfile

COMPLETE_MARKER = "checkpoint_complete.json"
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
               "pytorch_model.bin.index.json", "trainer_state.json")
OPTIMIZER_FILE = "optimizer.pt"
FSDP_OPTIMIZER_FILE = "optimizer.bin"
SCHEDULER_FILE = "scheduler.pt"


class IncompleteCheckpointError(ValueError):
    """A checkpoint lacks a file needed to resume, or one of its files is damaged."""


class OutputExistsError(ValueError, FileExistsError):
    """The output folder exists (or holds an earlier run) and replacing it was not asked for."""


class LoadingMismatchError(ValueError):
    """A checkpoint's tensors do not match the model: some are missing, unexpected or of another shape."""


# ---------------------------------------------------------------------------------------------------------------------
# Strict loading


def load_pretrained_strict(model_class, path, flag: str = "--model", **kwargs):
    """`model_class.from_pretrained(path, **kwargs)`, refusing a checkpoint whose tensors do not match the model
    exactly (tied weights, e.g. lm_head with tie_word_embeddings, are not reported missing by transformers)."""
    from transformers.utils import logging

    from ..modeling_memoryformer import CheckpointMismatchError

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # no LOAD REPORT warning: a mismatch is the error below, naming the tensors
    try:
        model, info = model_class.from_pretrained(path, output_loading_info=True, **kwargs)
    except CheckpointMismatchError as error:  # a MemoryFormer's own refusal, which names the tensors
        raise LoadingMismatchError(f"{flag} {os.fspath(path)!r}: {error}") from None
    finally:
        logging.set_verbosity(verbosity)
    check_loading_info(info, path, flag)
    return model


def check_loading_info(info: dict, path, flag: str = "--model") -> None:
    problems = []
    for key, what in (("missing_keys", "missing"), ("unexpected_keys", "unexpected"),
                      ("mismatched_keys", "of the wrong shape")):
        names = sorted(str(k if isinstance(k, str) else k[0]) for k in info.get(key) or ())
        if names:
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            problems.append(f"{len(names)} tensor(s) {what}: {shown}")
    if info.get("error_msgs"):
        problems.append("; ".join(str(m) for m in info["error_msgs"]))
    if problems:
        raise LoadingMismatchError(
            f"{flag} {os.fspath(path)!r} does not match the model: {'; '.join(problems)}. The checkpoint is damaged "
            "or belongs to another architecture; refusing to fill the gaps with random weights. Pass a complete "
            "checkpoint written by save_pretrained."
        )


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoint completeness


def write_complete_marker(folder: str, step: int) -> None:
    """Written last, atomically (temporary file, then rename)."""
    temporary = os.path.join(folder, f".{COMPLETE_MARKER}.tmp")
    with open(temporary, "w") as f:
        json.dump({"global_step": step, "files": sorted(os.listdir(folder))}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, os.path.join(folder, COMPLETE_MARKER))


def remove_complete_marker(folder: str) -> None:
    try:
        os.remove(os.path.join(folder, COMPLETE_MARKER))
    except FileNotFoundError:
        pass


def _safetensors_problem(path: str) -> str | None:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            header_size = struct.unpack("<Q", f.read(8))[0]
            if header_size > size - 8:
                return "is truncated"
            header = json.loads(f.read(header_size))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + header_size + end > size:
            return "is truncated"
    except (OSError, struct.error, ValueError, KeyError, TypeError):
        return "is damaged (not a readable safetensors file)"
    return None


def _torch_archive_problem(path: str) -> str | None:
    """torch.save writes a zip archive: a truncated file has no central directory, a damaged one fails its CRC."""
    try:
        with zipfile.ZipFile(path) as archive:
            if archive.testzip() is not None:
                return "is damaged (CRC mismatch)"
    except (OSError, zipfile.BadZipFile, EOFError):
        return "is truncated or damaged (not a complete torch archive)"
    return None


def _json_problem(path: str) -> str | None:
    try:
        with open(path) as f:
            json.load(f)
    except (OSError, ValueError):
        return "is truncated or damaged (not valid JSON)"
    return None


def checkpoint_problems(folder: str, require_marker: bool = True, partial: bool = False) -> list[str]:
    """Why `folder` is not a complete Trainer checkpoint ([] when it is). With `partial`, a missing optimizer or
    scheduler state is not a problem (the model weights and trainer_state.json still must be there and intact)."""
    problems = []

    def check(name, problem):
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            problems.append(f"{name} is missing")
        else:
            found = problem(path)
            if found:
                problems.append(f"{name} {found}")

    if require_marker and not os.path.exists(os.path.join(folder, COMPLETE_MARKER)):
        problems.append(f"{COMPLETE_MARKER} is missing (its write was interrupted, or an older version wrote it)")
    check("trainer_state.json", _json_problem)
    check("config.json", _json_problem)
    if os.path.exists(os.path.join(folder, "model.safetensors.index.json")):
        check("model.safetensors.index.json", _json_problem)
        if not problems:
            with open(os.path.join(folder, "model.safetensors.index.json")) as f:
                shards = sorted(set(json.load(f).get("weight_map", {}).values()))
            for shard in shards:
                check(shard, _safetensors_problem)
    elif os.path.exists(os.path.join(folder, "pytorch_model.bin")):
        check("pytorch_model.bin", _torch_archive_problem)
    else:
        check("model.safetensors", _safetensors_problem)
    # an FSDP run (full state dicts) writes its optimizer state as accelerate's optimizer.bin
    optimizer = FSDP_OPTIMIZER_FILE if not os.path.exists(os.path.join(folder, OPTIMIZER_FILE)) and os.path.exists(
        os.path.join(folder, FSDP_OPTIMIZER_FILE)) else OPTIMIZER_FILE
    for name in (optimizer, SCHEDULER_FILE):
        if partial and not os.path.exists(os.path.join(folder, name)):
            continue
        check(name, _torch_archive_problem)
    rng = sorted(glob.glob(os.path.join(folder, "rng_state*.pth")))
    if not rng and not partial:
        problems.append("rng_state.pth is missing")
    for path in rng:
        check(os.path.basename(path), _torch_archive_problem)
    return problems


def checkpoint_folders(output_dir: str) -> list[str]:
    """checkpoint-N folders of `output_dir`, newest (highest N) first."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(output_dir)
             if (m := CHECKPOINT.match(name)) and os.path.isdir(os.path.join(output_dir, name))]
    return [os.path.join(output_dir, name) for _, name in sorted(found, reverse=True)]


def latest_complete_checkpoint(output_dir: str) -> tuple[str | None, list[tuple[str, list[str]]]]:
    """The newest complete checkpoint of `output_dir` (or None) and the newer ones skipped, each with its reasons."""
    skipped = []
    for folder in checkpoint_folders(output_dir):
        problems = checkpoint_problems(folder)
        if not problems:
            return folder, skipped
        skipped.append((folder, problems))
    return None, skipped


# ---------------------------------------------------------------------------------------------------------------------
# Output folders


def previous_run_files(out: str) -> list[str]:
    """The files and checkpoint folders of an earlier run in `out` (model files, trainer state, checkpoint-*)."""
    if not os.path.isdir(out):
        return []
    names = sorted(os.listdir(out))
    return [n for n in names if n in MODEL_FILES or (CHECKPOINT.match(n) and os.path.isdir(os.path.join(out, n)))]


def check_train_output(out: str, resume, overwrite: bool) -> None:
    """`memoryformer train --out` must not hold another run unless the run is resumed or replacing it was asked."""
    if resume or overwrite:
        return
    found = previous_run_files(out)
    if found:
        shown = ", ".join(found[:6]) + (", ..." if len(found) > 6 else "")
        raise OutputExistsError(
            f"--out {out!r} holds an earlier run ({shown}). Choose a new folder, pass --resume latest to continue "
            "it, or --overwrite to replace it."
        )


__all__ = [
    "COMPLETE_MARKER",
    "IncompleteCheckpointError",
    "LoadingMismatchError",
    "OutputExistsError",
    "check_loading_info",
    "check_train_output",
    "checkpoint_problems",
    "latest_complete_checkpoint",
    "load_pretrained_strict",
]
