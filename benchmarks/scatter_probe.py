"""The machine's rate for scattered row reads, measured over a model's own tables: the bound of a decode step's gathers.

A decode step reads K random rows of every Memory Layer's tables. Those rows come from DRAM in spans of a few KB at
unrelated addresses, so their speed is set by how many reads the cores keep in flight and how long each takes (the
memory latency, which on a shared cloud host moves from minute to minute), not by the streaming bandwidth that
`torch.dot` measures. This probe reads the rows decode steps read, from the same tables in the same order (layer by
layer, one random row of each table per sequence: `step_starts`), whole rows dealt to the threads in turn, with a
plain loop of its own (benchmarks/csrc/scatter_read.c: XOR of the words, every line prefetched some rows ahead, the
best of SETTINGS), so it says how fast this machine serves such reads in this minute, independent of the kernel it
bounds. (The kernel splits one token's row over the threads by columns, narrower reads, which it still ran faster than
a split-row probe on the Xeon of benchmarks/results/2026-11-30-xeon-amx; `row_starts` and `scattered_read_gbps` read
uniformly random rows, split or whole, for such comparisons.)

    rate = step_read_gbps(tables_of_one_width, [K] * layers, batch=1, threads=2)
    latency = read_latency_ns(all_tables)   # ns per dependent read at random row starts, one thread

The latency is what the prefetches hide: a core keeps a few dozen lines in flight, so rows arrive at about (lines in
flight x 64 B / latency) per core, and on a virtual machine the latency grows with the footprint the rows come from
(address translation: 62 ns over 64 MB to 819 ns over 12 GB on the Xeon of benchmarks/results/2026-11-30-xeon-amx).

The C file is compiled on first use with the system's C compiler (`CC`, else `cc`; -O3, the running CPU's vectors,
OpenMP) into ~/.cache/memoryformer-bench, keyed by the source, the flags and the CPU.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess

import torch

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "scatter_read.c")
# (spans prefetched ahead into L1, spans ahead into L2): the best is the machine's rate. On the Xeon of
# benchmarks/results/2026-11-30-xeon-amx (8 GB buffer, 2 threads) 16/48 was the best or within 10% of it for
# 512-3072-byte spans, and every setting with prefetches read 512-byte spans faster than none (3.7-6.4 against 3.4
# GB/s).
SETTINGS = ((4, 12), (8, 24), (16, 48), (32, 96))
MIN_PROBE_BYTES = 8 << 20   # a probe reads at least this much (more random rows than a small model's step)
LATENCY_READS = 20_000   # dependent reads per latency pass: 4-20 ms at 200-1000 ns


def _cpu_key() -> str:
    try:
        from modeling_memoryformer.cpu_facts import cpu_features, cpu_model

        return cpu_model() + " " + " ".join(cpu_features())
    except Exception:  # a key only: any stable string will do
        return platform.processor()


def _flags() -> list[str]:
    native = "-mcpu=native" if platform.machine().lower() in ("aarch64", "arm64") else "-march=native"
    return ["-O3", native, "-fopenmp", "-shared", "-fPIC"]


@functools.cache
def library() -> ctypes.CDLL:
    """The compiled probe (built once per source, flags and CPU)."""
    with open(SOURCE, "rb") as f:
        source = f.read()
    flags = _flags()
    key = hashlib.sha256(source + " ".join(flags).encode() + _cpu_key().encode()).hexdigest()[:16]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "memoryformer-bench")
    path = os.path.join(cache, f"scatter_read_{key}.so")
    if not os.path.exists(path):
        os.makedirs(cache, exist_ok=True)
        compiler = os.environ.get("CC", "cc")
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            proc = subprocess.run([compiler, *flags, SOURCE, "-o", tmp], capture_output=True, text=True,
                                  check=False)
        except FileNotFoundError as exc:
            raise RuntimeError(f"the scattered-read probe needs a C compiler: {compiler} was not found (set CC to "
                               "one with OpenMP, e.g. gcc)") from exc
        if proc.returncode != 0:
            raise RuntimeError(f"building the scattered-read probe with `{compiler} {' '.join(flags)}` failed (set CC "
                               f"to a C compiler with OpenMP):\n{proc.stderr[-2000:]}")
        os.replace(tmp, path)
    lib = ctypes.CDLL(path)
    lib.scatter_read.restype = ctypes.c_double
    lib.scatter_read.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.chase_read.restype = ctypes.c_double
    lib.chase_read.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p]
    lib.flush_lines.restype = ctypes.c_double
    lib.flush_lines.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    return lib


def flush_caches(tensor: torch.Tensor, threads: int | None = None) -> float:
    """Evict every cache line of `tensor`'s bytes from every cache level (scatter_read.c's `flush_lines`: x86
    `clflush`, aarch64 `dc civac`), so that the next read of it comes from DRAM; returns the seconds it took. A read
    probe over a buffer that fits the L3 a cloud guest shares (480 MB reported on the Xeon of benchmarks/results/
    2026-11-30-xeon-amx) reads partly from it when run back to back: 38-48 GB/s there against 29-33 from DRAM. Raises
    on a CPU other than x86 and aarch64, whose flush instruction the probe does not know."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("flush_caches takes a contiguous CPU tensor")
    seconds = library().flush_lines(tensor.data_ptr(), tensor.numel() * tensor.element_size(),
                                    threads or torch.get_num_threads())
    if seconds < 0:
        raise RuntimeError(f"flush_caches has no cache flush for this CPU ({platform.machine()}); it knows x86 and "
                           "aarch64")
    return seconds


def scatter_read(tensors: list[torch.Tensor], starts: torch.Tensor, span: int, ahead: int = 0,
                 far: int = 0) -> tuple[float, list[int]]:
    """Run the probe: starts int64 [threads, count, 2] of (tensor index, byte offset); every span `span` bytes (a
    multiple of 8, inside its tensor). Returns (wall seconds, each thread's XOR of the 8-byte words it read)."""
    if span <= 0 or span % 8:
        raise ValueError(f"span must be a positive multiple of 8 bytes, got {span}")
    if starts.dtype != torch.int64 or starts.dim() != 3 or starts.shape[2] != 2 or starts.shape[0] < 1:
        raise ValueError(f"starts must be int64 [threads, count, 2], got {starts.dtype} {tuple(starts.shape)}")
    bases = _bases(tensors, starts, span)
    starts = starts.contiguous()
    threads, count = starts.shape[0], starts.shape[1]
    sums = (ctypes.c_uint64 * threads)()
    seconds = library().scatter_read(bases, starts.data_ptr(), threads, count, span, ahead, far, sums)
    return seconds, list(sums)


def _bases(tensors: list[torch.Tensor], starts: torch.Tensor, span: int):
    """The tensors' addresses for the C loops, once every start [..., 2] names one of them and an 8-byte aligned
    offset whose span fits in it."""
    sizes = torch.tensor([t.numel() * t.element_size() for t in tensors])
    index, offset = starts[..., 0], starts[..., 1]
    if starts.numel() and (index.min() < 0 or index.max() >= len(tensors) or offset.min() < 0 or (offset % 8).any()
                           or (offset + span > sizes[index]).any()):
        raise ValueError("every start must name a tensor of the list and an 8-byte aligned offset whose span fits it")
    if any(not t.is_contiguous() or t.device.type != "cpu" for t in tensors):
        raise ValueError("the probe reads contiguous CPU tensors")
    return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])


def chase_read(tensors: list[torch.Tensor], starts: torch.Tensor) -> tuple[float, int]:
    """One thread reads the 8-byte word at each start (int64 [count, 2] of (tensor index, byte offset)) in turn, each
    read's address depending on the word before it (scatter_read.c): (wall seconds, the XOR of the words)."""
    if starts.dtype != torch.int64 or starts.dim() != 2 or starts.shape[1] != 2 or starts.shape[0] < 1:
        raise ValueError(f"starts must be int64 [count, 2], got {starts.dtype} {tuple(starts.shape)}")
    bases = _bases(tensors, starts, 8)
    starts = starts.contiguous()
    checksum = ctypes.c_uint64()
    seconds = library().chase_read(bases, starts.data_ptr(), starts.shape[0], 0, ctypes.byref(checksum))
    return seconds, checksum.value


def random_row_starts(tensors: list[torch.Tensor], reads: int, generator: torch.Generator) -> torch.Tensor:
    """int64 [reads, 2]: the first byte of `reads` random rows, uniform over every row of `tensors` (2-D, any widths)."""
    if not tensors or any(t.dim() != 2 or t.shape[0] < 1 for t in tensors):
        raise ValueError(f"the tensors must be 2-D with rows, got {[tuple(t.shape) for t in tensors]}")
    row_bytes = torch.tensor([t.shape[1] * t.element_size() for t in tensors])
    index, row = _random_rows(tensors, reads, generator)
    return torch.stack([index, row * row_bytes[index]], dim=1)


def _random_rows(tensors: list[torch.Tensor], rows: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(tensor index, row) of `rows` rows drawn uniformly over every row of `tensors`."""
    counts = torch.tensor([t.shape[0] for t in tensors])
    flat = torch.randint(0, int(counts.sum()), (rows,), generator=generator)
    index = torch.searchsorted(counts.cumsum(0), flat, right=True)
    return index, flat - (counts.cumsum(0) - counts)[index]


def read_latency_ns(tensors: list[torch.Tensor], reads: int = LATENCY_READS, passes: int = 3, seed: int = 0) -> float:
    """Nanoseconds per dependent read at random row starts of `tensors` (`chase_read`): the median of `passes`, each
    over fresh rows (uniform over all of them, `random_row_starts`)."""
    generator = torch.Generator().manual_seed(seed)
    times = [chase_read(tensors, random_row_starts(tensors, reads, generator))[0] / reads for _ in range(passes)]
    return sorted(times)[len(times) // 2] * 1e9


def row_starts(tensors: list[torch.Tensor], rows: int, split: int, threads: int,
               generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """(starts, span) for `rows` random rows of `tensors` (2-D, one row width), uniform over all their rows. split > 1:
    every thread reads its 1/split of each row's columns (threads == split); else the rows are dealt out to the
    threads whole."""
    row_bytes = {t.shape[1] * t.element_size() for t in tensors}
    if len(row_bytes) != 1 or any(t.dim() != 2 for t in tensors):
        raise ValueError(f"the tensors must be 2-D with one row width, got {[tuple(t.shape) for t in tensors]}")
    row_bytes = row_bytes.pop()
    index, row = _random_rows(tensors, rows, generator)
    offset = row * row_bytes
    if split > 1:
        if threads != split:
            raise ValueError(f"a row split over {split} threads needs {split} threads, got {threads}")
        span = row_bytes // split // 8 * 8
        starts = torch.stack([torch.stack([index, offset + t * span], dim=1) for t in range(split)])
        return starts, span
    per = rows // threads
    if per == 0:
        raise ValueError(f"{rows} rows cannot be dealt out to {threads} threads")
    starts = torch.stack([index[: per * threads], offset[: per * threads]], dim=1).view(threads, per, 2)
    return starts, row_bytes // 8 * 8


def step_starts(tensors: list[torch.Tensor], tables: list[int], batch: int, threads: int,
                min_bytes: int, generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """(starts, span) for the rows decode steps read, in their order: per tensor (a Memory Layer's tables [K * P, D],
    K = tables[i]) in turn, per sequence of the batch, one random row of each of its K tables in table order; steps
    repeated with fresh rows up to `min_bytes`; the rows dealt to the threads in turn (row j to thread j % threads), so
    the threads read the same layer's tables at the same time, as the lookup kernel's threads do."""
    row_bytes = {t.shape[1] * t.element_size() for t in tensors}
    if len(row_bytes) != 1 or len(tables) != len(tensors) or any(
            t.dim() != 2 or k < 1 or t.shape[0] % k for t, k in zip(tensors, tables)):
        raise ValueError("the tensors must be 2-D [K * rows per table, D] with one row width, and `tables` their K")
    row_bytes = row_bytes.pop()
    step = batch * sum(tables) * row_bytes
    steps = max(1, -(-min_bytes // step))
    parts = []
    for _ in range(steps):
        for i, (t, k) in enumerate(zip(tensors, tables)):
            per = t.shape[0] // k
            rows = torch.arange(k) * per + torch.randint(0, per, (batch, k), generator=generator)
            parts.append(torch.stack([torch.full((batch * k,), i), rows.reshape(-1) * row_bytes], dim=1))
    entries = torch.cat(parts)
    count = entries.shape[0] // threads
    if count == 0:
        raise ValueError(f"{entries.shape[0]} rows cannot be dealt out to {threads} threads")
    starts = entries[: count * threads].view(count, threads, 2).transpose(0, 1).contiguous()
    return starts, row_bytes // 8 * 8


def best_gbps(tensors: list[torch.Tensor], draw, settings=SETTINGS) -> float:
    """GB/s of the best setting: for each (ahead, far) of `settings`, fresh starts from `draw()` -> (starts, span) (rows
    read by one setting are not in the caches for the next), read by `scatter_read`."""
    best = 0.0
    for ahead, far in settings:
        starts, span = draw()
        seconds, _ = scatter_read(tensors, starts, span, ahead, far)
        best = max(best, starts.shape[0] * starts.shape[1] * span / seconds / 1e9)
    return best


def step_read_gbps(tensors: list[torch.Tensor], tables: list[int], batch: int, threads: int, seed: int = 0,
                   settings=SETTINGS) -> float:
    """GB/s of the best setting for the rows of decode steps (`step_starts`, at least MIN_PROBE_BYTES), fresh rows for
    every setting."""
    generator = torch.Generator().manual_seed(seed)
    return best_gbps(tensors, lambda: step_starts(tensors, tables, batch, threads, MIN_PROBE_BYTES, generator),
                     settings)


def scattered_read_gbps(tensors: list[torch.Tensor], rows: int, split: int, threads: int, seed: int = 0,
                        settings=SETTINGS) -> float:
    """GB/s of the best setting for random rows of `tensors`: at least `rows` rows (more to reach MIN_PROBE_BYTES),
    read as `row_starts` deals them; fresh rows for every setting."""
    row_bytes = tensors[0].shape[1] * tensors[0].element_size()
    rows = max(rows, -(-MIN_PROBE_BYTES // row_bytes))
    generator = torch.Generator().manual_seed(seed)
    return best_gbps(tensors, lambda: row_starts(tensors, rows, split, threads, generator), settings)
