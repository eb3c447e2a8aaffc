"""Large CPU weights on transparent huge pages, so that a decode step's scattered table rows cost no page walks.

A decode step reads K rows of every Memory Layer's tables: rows scattered over GBs, each on a page of its own. With
4 KB pages every row visit misses the TLB, and the page walk itself misses the caches once the page tables outgrow
them (13 GB of MF-base tables have 26 MB of page-table entries; in a virtual machine each walk is a nested one). On
2 MB pages the same tables take 6,600 entries. Linux gives anonymous memory huge pages only where the program asks
(`madvise(MADV_HUGEPAGE)`) when transparent huge pages are in `madvise` mode, the default of most distributions;
PyTorch's CPU allocator asks only under `THP_MEM_ALLOC_ENABLE=1`, for every allocation of the process.

`place_on_huge_pages(model)` moves a module's large parameters and buffers (the tables, the LM head, the embedding;
int8 table blocks) into memory advised for huge pages, one tensor at a time (a copy, then the parameter's `.data`
points at it: the same `Parameter` objects, so ties, optimizers and hooks are unaffected). `MemoryFormerPreTrainedModel`
calls it at the end of `from_pretrained`, and a Memory Layer places the int8 block it builds or assembles. It does
nothing where it cannot help: not Linux, transparent huge pages `never` or `always` (big allocations get huge pages
already), `MEMORYFORMER_HUGE_PAGES=0`, tensors on other devices, views of a larger storage, tensors already placed.
Cost: about 0.2 s per GB (the pages are faulted in by the kernel, `MADV_POPULATE_WRITE`, before the copy).
Measured on the 2-vCPU Zen 3 guest of docs/performance.md: cold-row lookups of MF-base's Q/K/V shape 110 -> 80 us
(bfloat16) and 132 -> 97 us (int8); see docs/performance.md for whole decode steps.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import sys
import weakref

import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = HUGE_PAGE   # smaller tensors are left where they are (norms, biases, the tiny configs of tests)
_MADV_POPULATE_WRITE = 23   # Linux 5.14+; not in Python's mmap module
_placed: dict[int, int] = {}   # start -> end of the memory this module placed tensors in (removed when it is freed)


@functools.cache
def thp_mode() -> str | None:
    """The transparent huge page mode (`always`, `madvise` or `never`), or None where the system does not say."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def enabled() -> bool:
    """Whether placing tensors can help here: Linux, huge pages in `madvise` mode, not turned off."""
    return (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
            and os.environ.get("MEMORYFORMER_HUGE_PAGES", "1") != "0" and thp_mode() == "madvise")


def is_placed(tensor: torch.Tensor) -> bool:
    """Whether the tensor's memory is memory this module advised for huge pages."""
    ptr = tensor.data_ptr()
    return any(start <= ptr < end for start, end in _placed.items())


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of zeros in memory advised for huge pages (2 MB-aligned, faulted in by the kernel).

    The memory is a private anonymous mapping owned by the returned tensor: it is unmapped when the tensor and every
    view of it are gone. A normal tensor to its users (autograd, saving, `.to`)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:   # refused (a sandbox's filter, a kernel without THP): still valid memory, on 4 KB pages
        pass
    with torch.inference_mode(False), torch.no_grad():
        base = torch.frombuffer(mapping, dtype=torch.uint8)
        offset = (-base.data_ptr()) % HUGE_PAGE   # the tensor starts on a huge page; the slack is never touched
        try:   # the kernel faults the huge pages in: 5x faster than the first touches of a copy
            whole = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
            mapping.madvise(_MADV_POPULATE_WRITE, offset, min(whole, len(mapping) - offset))
        except (OSError, ValueError):
            pass
        out = base[offset:offset + nbytes].view(dtype).view(shape)
    start = base.data_ptr()
    _placed[start] = start + len(mapping)
    weakref.finalize(mapping, _placed.pop, start, None)   # the storage holds the mapping until its last view goes
    return out


def huge_page_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of `tensor` in memory advised for huge pages (`huge_page_empty`)."""
    if tensor.device.type != "cpu":
        raise ValueError(f"huge_page_copy: the tensor must be on the CPU, got {tensor.device} (move it first)")
    out = huge_page_empty(tuple(tensor.shape), tensor.dtype)
    with torch.inference_mode(False), torch.no_grad():
        out.copy_(tensor)
    return out


def place_int8_block(packed: torch.Tensor) -> torch.Tensor:
    """An int8 table block ([R, d + 8] uint8, whole and contiguous) on huge pages where that helps, else itself."""
    return huge_page_copy(packed) if enabled() and _movable(packed, MIN_BYTES) else packed


def _movable(tensor: torch.Tensor, min_bytes: int) -> bool:
    if type(tensor) is not torch.Tensor and type(tensor) is not torch.nn.Parameter:
        return False   # DTensor, quantized wrappers, tensor subclasses: theirs to place
    if tensor.device.type != "cpu" or tensor.is_sparse or tensor.is_quantized or not tensor.is_contiguous():
        return False
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes < min_bytes or tensor.storage_offset() != 0 or tensor.untyped_storage().nbytes() != nbytes:
        return False   # a view of a larger storage: moving it would cut it off from the rest
    return not is_placed(tensor)


def place_on_huge_pages(module: torch.nn.Module, min_bytes: int | None = None, force: bool = False) -> int:
    """Move the module's CPU parameters and buffers of at least `min_bytes` (default MIN_BYTES) onto huge pages;
    returns the bytes moved.

    Does nothing unless `enabled()` (or `force`: tests, and systems whose mode is not reported). Tensors that share
    one storage (tied weights as separate tensors) keep sharing it."""
    if not (force or enabled()):
        return 0
    min_bytes = MIN_BYTES if min_bytes is None else min_bytes
    for m in module.modules():   # int8 tables loaded as three tensors: assembled into their block (placed) first
        if getattr(m, "table_dtype", None) == "int8" and hasattr(m, "_int8_tables") and m.tables_codes.is_cpu:
            m._int8_tables()
    moved, done = 0, {}   # id of a tensor moved -> (its old data pointer, dtype, shape, its new data)
    for m in module.modules():
        for tensor in list(m._parameters.values()) + list(m._buffers.values()):
            if tensor is None or id(tensor) in done:
                continue
            shared = next((new for ptr, dtype, shape, new in done.values()
                           if ptr == tensor.data_ptr() and dtype == tensor.dtype and shape == tensor.shape), None)
            if shared is None and not _movable(tensor, min_bytes):
                continue
            new = shared if shared is not None else huge_page_copy(tensor.detach())
            done[id(tensor)] = (tensor.data_ptr(), tensor.dtype, tensor.shape, new)
            with torch.inference_mode(False), torch.no_grad():
                tensor.data = new
            moved += 0 if shared is not None else new.numel() * new.element_size()
    return moved
