"""Outputs that replace earlier ones without losing them.

Every command that writes a result (convert, demo, train's final model and checkpoints, push's staging folder) writes
it in full beside the old one and swaps it in only when it is complete; the swap is renames within one folder, which
need no disk space. A failed write or swap leaves the old output as it was, removes the unfinished new one, and ends
with an `OutputWriteError` naming the path and the cause (an OSError: the command line prints it as one line).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile


class OutputWriteError(OSError):
    """Writing an output failed (disk full, file too large, no permission, ...); nothing earlier was lost."""


def write_failure(error: BaseException, path: str, kept: str) -> OutputWriteError | None:
    """The OutputWriteError for `error` raised while writing `path`, or None if `error` is not a failed write.

    Writers report a full disk differently: an OSError (errno 28, or 27 "File too large" past a file size limit),
    safetensors' SafetensorError ("File too large (os error 27)"), torch.save's RuntimeError from its zip writer
    ("[enforce fail at inline_container.cc:...] ... unexpected pos"). `kept` says what was kept.
    """
    message = " ".join(str(error).split())
    if isinstance(error, OutputWriteError):
        return None
    if isinstance(error, OSError):
        cause = error.strerror or message or type(error).__name__
    elif type(error).__name__ == "SafetensorError" or (
        isinstance(error, RuntimeError) and ("inline_container" in message or "file write failed" in message)
    ):
        cause = f"{type(error).__name__}: {message[:200]}"
    else:
        return None
    return OutputWriteError(
        f"Could not write {path}: {cause}. The disk may be full or the file larger than allowed; free space (or "
        f"write elsewhere) and run again. {kept}"
    )


@contextlib.contextmanager
def staged_folder(out: str):
    """Yield a temporary sibling folder of `out` to write into; once the block ends, it replaces `out` (see
    `replace_folder`). On any failure it is deleted and `out` is left as it was."""
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", suffix=".incomplete", dir=parent)
    kept = f"{out} was left as it was." if os.path.exists(out) else f"Nothing was written to {out}."
    try:
        with write_errors_named(out, kept):
            yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replace_folder(staging, out)


def replace_folder(new: str, out: str) -> None:
    """Put the complete folder `new` at `out`. An existing `out` is renamed aside first and deleted only once `new` is
    in place; if the move fails, it is renamed back and `new` is deleted."""
    old = None
    try:
        if os.path.lexists(out):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", suffix=".old", dir=os.path.dirname(out))
            os.rmdir(old)  # a free name next to `out`, on the same file system
            os.replace(out, old)
        os.replace(new, out)
    except OSError as error:
        if old is not None and os.path.lexists(old) and not os.path.lexists(out):
            os.replace(old, out)
        shutil.rmtree(new, ignore_errors=True)
        kept = f"{out} was left as it was." if old is not None else f"Nothing was written to {out}."
        raise OutputWriteError(
            f"Could not move the new output into {out}: {error.strerror or error}. {kept}"
        ) from error
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_files(folder: str, name: str = ".final-model", main_process: bool = True):
    """Yield `folder/<name>.incomplete` to write files into; once the block ends they replace the files of the same
    names in `folder` (the others stay). The old files are moved aside first and deleted only when every new one is
    in place; a failure puts them back. Other processes of a distributed run (main_process=False) get the same path
    and leave the files to the main one."""
    staging = os.path.join(os.path.abspath(folder), f"{name}.incomplete")
    if not main_process:
        yield staging
        return
    shutil.rmtree(staging, ignore_errors=True)  # left by a run killed while writing
    os.makedirs(staging)
    try:
        with write_errors_named(folder, f"The files in {folder} were left as they were."):
            yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replace_files(staging, folder)


def replace_files(new: str, folder: str) -> None:
    """Move every entry of the folder `new` into `folder`, replacing entries of the same names, all or nothing."""
    names = sorted(os.listdir(new))
    aside = tempfile.mkdtemp(prefix=".replaced.", suffix=".old", dir=folder)
    moved_aside, moved_in = [], []
    try:
        for name in names:
            if os.path.lexists(os.path.join(folder, name)):
                os.replace(os.path.join(folder, name), os.path.join(aside, name))
                moved_aside.append(name)
        for name in names:
            os.replace(os.path.join(new, name), os.path.join(folder, name))
            moved_in.append(name)
    except OSError as error:
        for name in moved_in:
            os.replace(os.path.join(folder, name), os.path.join(new, name))
        for name in moved_aside:
            os.replace(os.path.join(aside, name), os.path.join(folder, name))
        shutil.rmtree(new, ignore_errors=True)
        shutil.rmtree(aside, ignore_errors=True)
        raise OutputWriteError(
            f"Could not move the new files into {folder}: {error.strerror or error}. The files in {folder} were left "
            "as they were."
        ) from error
    shutil.rmtree(aside, ignore_errors=True)
    os.rmdir(new)


@contextlib.contextmanager
def write_errors_named(path: str, kept: str):
    """Turn a failed write inside the block into an OutputWriteError naming `path` (the staged writes above, and
    outputs written in place, such as a Trainer checkpoint, whose own protocol keeps the earlier ones)."""
    try:
        yield
    except BaseException as error:
        if (failure := write_failure(error, path, kept)) is None:
            raise
        raise failure from error
