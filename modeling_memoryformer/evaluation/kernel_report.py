"""`memoryformer kernels`: what the fused CPU kernel sees on this machine and which strategy it picks per layer.

Reports the CPU model and its vector features, the cache sizes and thread count the kernel plans with, whether the
fused kernel is built and loaded (and its compiled vector layer) or why not, and, for every Memory Layer shape of a
preset, the strategy the kernel's "auto" picks for the forward and the backward at a few token counts
(`torch.ops.memoryformer.plan`). Nothing here builds a model: the shapes come from the config
(`memory_layer_shapes`), and a test checks them against the MemoryLayer modules of a real model.

Default token counts (`DEFAULT_WORKLOADS`), the workloads of `make bench`: 1 (one decode step of batch 1), 2048 (a
prefill of batch 1 x 2048 tokens) and 4096 (a training step of batch 8 x 512).
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass

from ..configuration_memoryformer import MemoryFormerConfig
from ..cpu_facts import cpu_features, cpu_model, detected_cache_sizes, parse_size
from .settings import KernelsSettings


DEFAULT_WORKLOADS = {1: "decode, batch 1", 2048: "prefill, 1 x 2048", 4096: "training, 8 x 512"}
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}

def format_bytes(num_bytes: int) -> str:
    """Binary units, as cache sizes are quoted: 48 KiB, 1 MiB, 100.7 MiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            value = num_bytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{num_bytes} B"


# ---------------------------------------------------------------------------------------------------------------------
# The model's Memory Layers


@dataclass(frozen=True)
class LayerShape:
    """One Memory Layer of a decoder block, as the kernel sees it (a [num_tables * rows_per_table, out] table)."""

    name: str  # module path inside a decoder layer, e.g. "attention.query_key_value"
    in_features: int
    out_features: int
    hash_bits: int
    count: int  # how many of the model has (one per decoder layer)

    @property
    def num_tables(self) -> int:
        return self.in_features // self.hash_bits

    @property
    def rows_per_table(self) -> int:
        return 1 << self.hash_bits

    def table_bytes(self, bytes_per_value: int) -> int:
        return self.num_tables * self.rows_per_table * self.out_features * bytes_per_value


def memory_layer_shapes(config: MemoryFormerConfig) -> list[LayerShape]:
    """The Memory Layers of `MemoryFormerForCausalLM(config)`, per decoder layer, without building the model.

    Mirrors modeling_memoryformer.py: the fused Q/K/V layer (d -> 3d: one hash, one table), the optional attention
    output layer (`attention_output="memory"`, d -> d), and the Memory Block's layer1 (d -> intermediate, tau bits)
    and layer2 (intermediate -> d, tau + e bits). (flops.memory_layers lists Q, K and V separately instead, as the
    paper counts them.)
    """
    d, tau, inner, layers = config.hidden_size, config.hash_bits, config.intermediate_size, config.num_hidden_layers
    shapes = [LayerShape("attention.query_key_value", d, 3 * d, tau, layers)]
    if config.attention_output == "memory":
        shapes.append(LayerShape("attention.dense", d, d, tau, layers))
    shapes.append(LayerShape("memory_block.layer1", d, inner, tau, layers))
    shapes.append(LayerShape("memory_block.layer2", inner, d, tau + config.expand_bits, layers))
    return shapes


# ---------------------------------------------------------------------------------------------------------------------
# The kernel


def _ops():
    from ..memory_kernels import fused_ops

    return fused_ops()


def _has_op(name: str) -> bool:
    """Whether the loaded fused kernel implements op `name` (False without the kernel)."""
    from .. import memory_backend_cpu

    if memory_backend_cpu.fused_state() is not True:
        return False
    try:
        op = getattr(_ops(), name)
    except AttributeError:
        return False
    import torch

    qualname = op.default.name()
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key)
               for key in ("CPU", "CompositeExplicitAutograd"))


def kernel_status() -> dict:
    """Whether the fused kernel loads (building it the first time), its vector layer, and what Memory Layers use."""
    from .. import memory_kernels

    status = memory_kernels.kernel_status()
    return {
        "loaded": status.fused_loaded,
        "reason": status.unavailable_reason,
        "isa": status.isa,
        "setting": status.setting,
        "selected": status.selected,
        "selection_error": status.error if status.selected is None else None,
        "missing_ops": [op for op in ("isa", "machine_info", "set_cache_sizes", "plan") if not _has_op(op)]
        if status.fused_loaded else [],
    }


def machine_info() -> dict | None:
    """The kernel's machine_info() as a dict, or None without the kernel."""
    if not _has_op("machine_info"):
        return None
    l1, l2, l3, threads, vector_bytes = (int(v) for v in _ops().machine_info())
    return {"l1d_bytes": l1, "l2_bytes": l2, "l3_bytes": l3, "threads": threads, "vector_bytes": vector_bytes}


def plan_strategy(tokens: int, shape: LayerShape, dtype, backward: bool) -> str:
    """The strategy the kernel's "auto" picks for `tokens` tokens through `shape` (an error text if it refuses)."""
    try:
        return str(_ops().plan(tokens, shape.num_tables, shape.rows_per_table, shape.out_features, dtype, backward))
    except RuntimeError as error:
        return f"error: {str(error).splitlines()[0]}"


# ---------------------------------------------------------------------------------------------------------------------
# The report


def collect(
    config: MemoryFormerConfig,
    tokens: list[int] | None = None,
    dtype: str = "fp32",
    cache_sizes: tuple[int, int, int] | None = None,
    preset: str | None = None,
) -> dict:
    """Everything `memoryformer kernels` prints, as a JSON-ready dict.

    cache_sizes (L1d, L2, L3 bytes) plans as if the machine had those caches (`set_cache_sizes`), then restores
    what the kernel used before.
    """
    import torch

    tokens = list(DEFAULT_WORKLOADS) if tokens is None else list(tokens)
    if any(n < 0 for n in tokens):
        raise ValueError(f"--tokens must be >= 0, got {tokens}.")
    torch_dtype = getattr(torch, DTYPES[dtype])
    kernel = kernel_status()
    os_caches = detected_cache_sizes()
    can_plan = kernel["loaded"] and _has_op("plan")
    previous = None
    if cache_sizes is not None:
        if not (kernel["loaded"] and _has_op("set_cache_sizes") and _has_op("machine_info")):
            raise ValueError("--cache-sizes needs the fused kernel with set_cache_sizes(); it is not available here.")
        previous = machine_info()
        _ops().set_cache_sizes(*cache_sizes)
    try:
        info = machine_info() if kernel["loaded"] else None
        if info is not None:
            caches = {"l1d_bytes": info["l1d_bytes"], "l2_bytes": info["l2_bytes"], "l3_bytes": info["l3_bytes"],
                      "source": "override" if cache_sizes is not None else "kernel"}
        else:
            caches = {"l1d_bytes": os_caches[0], "l2_bytes": os_caches[1], "l3_bytes": os_caches[2], "source": "os"}
        bytes_per_value = torch.empty((), dtype=torch_dtype).element_size()
        layers = []
        for shape in memory_layer_shapes(config):
            entry = {**asdict(shape), "num_tables": shape.num_tables, "rows_per_table": shape.rows_per_table,
                     "table_bytes": shape.table_bytes(bytes_per_value), "plans": []}
            for n in tokens:
                plan = {"tokens": n, "forward": None, "backward": None}
                if can_plan:
                    plan["forward"] = plan_strategy(n, shape, torch_dtype, False)
                    plan["backward"] = plan_strategy(n, shape, torch_dtype, True)
                entry["plans"].append(plan)
            layers.append(entry)
    finally:
        if previous is not None:
            _ops().set_cache_sizes(0, 0, 0)  # detect again; re-apply an earlier override if there was one
            now = machine_info()
            before = (previous["l1d_bytes"], previous["l2_bytes"], previous["l3_bytes"])
            if (now["l1d_bytes"], now["l2_bytes"], now["l3_bytes"]) != before:
                _ops().set_cache_sizes(*before)
    return {
        "cpu": {"model": cpu_model(), "arch": platform.machine(), "features": cpu_features()},
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "caches": caches,
        "os_caches": {"l1d_bytes": os_caches[0], "l2_bytes": os_caches[1], "l3_bytes": os_caches[2]},
        "machine_info": info,
        "kernel": kernel,
        "preset": preset,
        "config": {"hidden_size": config.hidden_size, "num_hidden_layers": config.num_hidden_layers,
                   "hash_bits": config.hash_bits, "expand_bits": config.expand_bits,
                   "intermediate_size": config.intermediate_size, "attention_output": config.attention_output},
        "dtype": DTYPES[dtype],
        "workloads": [{"tokens": n, "label": DEFAULT_WORKLOADS.get(n, "")} for n in tokens],
        "layers": layers,
    }


def format_report(report: dict) -> str:
    """The human-readable form of `collect`'s report."""
    cpu, caches, kernel = report["cpu"], report["caches"], report["kernel"]
    lines = [
        f"CPU:        {cpu['model']} ({cpu['arch']})",
        f"features:   {' '.join(cpu['features']) or 'none of the tracked vector features'}"
        f"   (torch dispatches {report['torch_cpu_capability']})",
    ]
    source = {"kernel": "as the kernel uses them", "override": "overridden with --cache-sizes",
              "os": "as the OS reports them; "
              + ("this kernel build has no machine_info()" if kernel["loaded"] else "the kernel is not loaded")}
    source = source[caches["source"]]
    lines.append(
        f"caches:     L1d {format_bytes(caches['l1d_bytes'])}, L2 {format_bytes(caches['l2_bytes'])}, "
        f"L3 {format_bytes(caches['l3_bytes'])} ({source})"
    )
    differ = [
        f"{label} {format_bytes(report['os_caches'][key])}"
        for label, key in (("L1d", "l1d_bytes"), ("L2", "l2_bytes"), ("L3", "l3_bytes"))
        if caches["source"] == "kernel" and report["os_caches"][key] and report["os_caches"][key] != caches[key]
    ]
    if differ:
        lines.append(f"            note: sysfs (/sys/devices/system/cpu/cpu0/cache) reports {', '.join(differ)}")
    info = report["machine_info"]
    threads = f"threads:    {report['threads']} (torch.get_num_threads())"
    if info is not None:
        threads += f"; kernel sees {info['threads']} threads, {info['vector_bytes']}-byte vectors"
    lines.append(threads)
    if kernel["loaded"]:
        isa = kernel["isa"] or "unknown (this build has no isa())"
        lines.append(f"kernel:     fused CPU kernel loaded, vector layer {isa}")
        if kernel["missing_ops"]:
            lines.append(f"            this build lacks {', '.join(kernel['missing_ops'])}: no plans shown")
    else:
        lines.append(f"kernel:     fused CPU kernel NOT available: {kernel['reason']}")
    if kernel["selected"]:
        lines.append(f"in use:     {kernel['selected']} (MEMORYFORMER_KERNEL={kernel['setting']})")
    else:
        lines.append(f"in use:     none: {kernel['selection_error']}")

    config = report["config"]
    name = f"MF-{report['preset']}" if report["preset"] else "the model"
    lines += [
        "",
        f"Memory Layers of {name} (d={config['hidden_size']}, {config['num_hidden_layers']} layers, "
        f"tau={config['hash_bits']}, e={config['expand_bits']}), {report['dtype']} tables; "
        "strategy of the kernel's \"auto\" as forward / backward:",
        "",
    ]
    heads = [f"N={w['tokens']}" + (f" ({w['label']})" if w["label"] else "") for w in report["workloads"]]
    lines.append("| Memory Layer | d_in -> d_out | tau | K | table | " + " | ".join(heads) + " |")
    lines.append("|---|---|---|---|---|" + "---|" * len(heads))
    for layer in report["layers"]:
        cells = []
        for plan in layer["plans"]:
            cells.append("-" if plan["forward"] is None else f"{plan['forward']} / {plan['backward']}")
        lines.append(
            f"| {layer['name']} (x{layer['count']}) | {layer['in_features']} -> {layer['out_features']} "
            f"| {layer['hash_bits']} | {layer['num_tables']} | {format_bytes(layer['table_bytes'])} | "
            + " | ".join(cells) + " |"
        )
    if not kernel["loaded"]:
        lines += ["", "No plans: Memory Layers run the PyTorch path (hash, then embedding_bag) without the kernel."]
    lines += [
        "",
        "token: per-token gather in registers (few tokens); embedding_bag: FBGEMM's gather (under 2 lookups per row);",
        "packed: table rows copied into an L2-resident buffer per group of tables, then gathered (float32 / 16-bit);",
        "bucketed: lookups grouped by row, the table streamed once (other widths beyond L3; the backward).",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# Command line


def run_kernels(settings: KernelsSettings) -> int:
    config = MemoryFormerConfig.from_preset(settings.preset)
    cache_sizes = None if settings.cache_sizes is None else tuple(parse_size(s) for s in settings.cache_sizes)
    report = collect(config, settings.tokens, settings.dtype, cache_sizes, preset=settings.preset)
    print(json.dumps(report, indent=2) if settings.json else format_report(report))
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# What every report states: the kernel that ran, the CPU, the versions, and the one-time kernel build/load

_load_seconds: float | None = None  # of the first load_kernel_timed() call in this process
_load_error: str | None = None


def load_kernel_timed() -> float:
    """Build (the first time) and load the fused kernel now, before anything is timed; the seconds it took.

    Commands call this before their timed work, so that no timing absorbs the one-time build. The seconds are those of
    the first call in this process (later calls return them again without loading): close to 0 when the extension
    was already built (cached on disk) or already loaded. With MEMORYFORMER_KERNEL=torch nothing is built (0 s).
    A kernel that cannot be used is not an error here: the fallback warns as usual (its reason stays in
    the kernel status), MEMORYFORMER_REQUIRE_FUSED's error or a malformed setting is kept in _load_error, and
    `run_facts` reports either.
    """
    global _load_seconds, _load_error
    if _load_seconds is None:
        import time

        from .. import memory_backend_cpu, memory_kernels

        start = time.perf_counter()
        if memory_kernels.kernel_setting() != "torch":
            try:
                memory_backend_cpu.load_fused_kernels()
            except (RuntimeError, ValueError) as error:
                _load_error = str(error)
        _load_seconds = time.perf_counter() - start
    return _load_seconds


def _package_version() -> str:
    from .. import __version__

    return __version__


def run_facts() -> dict:
    """The facts every report states (JSON-ready): the Memory Layer kernel in use and, when the fused kernel is
    loaded, its vector layer and -march; the CPU and its vector features; caches and threads; the versions; and the
    one-time kernel build/load seconds, which no timing includes (this loads the kernel first, via
    `load_kernel_timed`)."""
    import sys

    import torch
    import transformers

    from .. import memory_kernels

    load_s = load_kernel_timed()
    status = memory_kernels.kernel_status(load=False)
    kernel, kernel_error, fused_loaded = status.selected, status.error, status.fused_loaded
    info = machine_info() if fused_loaded else None
    if info is not None:
        caches = {"l1d_bytes": info["l1d_bytes"], "l2_bytes": info["l2_bytes"], "l3_bytes": info["l3_bytes"],
                  "source": "kernel"}
    else:
        l1, l2, l3 = detected_cache_sizes()
        caches = {"l1d_bytes": l1, "l2_bytes": l2, "l3_bytes": l3, "source": "os"}
    return {
        "memory_layer_kernel": kernel,  # "fused" or "torch" (None: the setting cannot be honoured, see the error)
        "kernel_setting": status.setting,
        "kernel_error": kernel_error,
        "fused_kernel_loaded": fused_loaded,
        "fused_kernel_isa": status.isa,
        "fused_kernel_march": status.march,
        "fused_kernel_unavailable_reason": None if fused_loaded else (_load_error or status.unavailable_reason),
        "cpu_model": cpu_model(),
        "cpu_arch": platform.machine(),
        "cpu_features": cpu_features(),
        "caches": caches,
        "threads": torch.get_num_threads(),
        "python": platform.python_version() or sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "memoryformer": _package_version(),
        "kernel_build_load_seconds": round(load_s, 3),
    }


def run_facts_line(facts: dict | None = None) -> str:
    """`run_facts` on one line, for the top of a printed or written report."""
    facts = run_facts() if facts is None else facts
    kernel = facts["memory_layer_kernel"]
    if kernel == "fused":
        what = f"fused ({facts['fused_kernel_isa'] or 'unknown vector layer'}, -march={facts['fused_kernel_march']})"
    elif kernel == "torch":
        reason = facts["fused_kernel_unavailable_reason"]
        if facts["kernel_setting"] == "torch":
            what = "torch (MEMORYFORMER_KERNEL=torch)"
        elif reason:
            what = f"torch (the fused kernel is not available: {' '.join(reason.split())[:160]})"
        else:
            what = "torch"
    else:
        what = f"none ({' '.join(str(facts['kernel_error']).split())[:160]})"
    features = " ".join(facts["cpu_features"]) or "no tracked vector features"
    return (f"Memory Layer kernel: {what}, CPU {facts['cpu_model']} ({features}), {facts['threads']} threads, "
            f"Python {facts['python']}, torch {facts['torch']}, transformers {facts['transformers']}, "
            f"memoryformer {facts['memoryformer']}; kernel build/load {facts['kernel_build_load_seconds']:.1f} s "
            "(not in the timings)")
