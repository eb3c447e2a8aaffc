"""Writes benchmarks/results/: results.json, results.md, layer_forward.png, layer_fwd_bwd.png, model.png."""

from __future__ import annotations

import json
import os



MODE_TITLES = {
    "forward": "forward (torch.inference_mode)",
    "fwd_bwd": "forward + backward (grads of input, weight/tables, bias)",
}
DTYPE_TITLES = {"fp32": "float32", "bf16": "bfloat16", "int8": "int8 (int8 tables vs dynamic int8 Linear)"}
WORKLOAD_TITLES = {
    "prefill": "prefill tokens/s",
    "decode": "decode tokens/s",
    "train": "training-step tokens/s",
}
FILES = ("results.json", "results.md", "layer_forward.png", "layer_fwd_bwd.png", "model.png")


# ---------------------------------------------------------------------------------------------------------------------
# JSON


def load(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _atomic_write(path: str, data: bytes | str) -> None:
    tmp = path + ".tmp"
    mode = "wb" if isinstance(data, bytes) else "w"
    with open(tmp, mode, **({} if isinstance(data, bytes) else {"encoding": "utf-8"})) as f:
        f.write(data)
    os.replace(tmp, path)


def write_all(results: dict, out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    _atomic_write(os.path.join(out_dir, "results.json"), json.dumps(results, indent=1) + "\n")
    _atomic_write(os.path.join(out_dir, "results.md"), markdown(results))
    charts(results, out_dir)
    return [os.path.join(out_dir, f) for f in FILES]


# ---------------------------------------------------------------------------------------------------------------------
# Markdown


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    if value >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _rate(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _noisy(row: dict | None, threshold: float) -> bool:
    return bool(row) and (row.get("other_cpu_cores") or 0) > threshold


def _contention(meta: dict, threshold: float) -> str:
    other = meta.get("other_cpu_cores")
    if other is None:
        return ""
    return (
        f" Other processes used {other:.2f} cores on average during this section (from /proc/stat minus this "
        f"process's own CPU time); cells marked † were measured while they used more than {threshold} cores "
        "and are less trustworthy."
    )


def _streams(rows: list[dict]) -> list[float]:
    """The memory-stream probes recorded with the layer cells (none in results of before the probe)."""
    return [r["host_stream_gbps"] for r in rows if r.get("host_stream_gbps")]


def _stream_floor(rows: list[dict]) -> float | None:
    """The memory-stream probe below which a layer cell is marked ‡ (NOISY_STREAM of the section's best)."""
    from .common import NOISY_STREAM

    streams = _streams(rows)
    return NOISY_STREAM * max(streams) if streams else None


def _stream_note(rows: list[dict]) -> str:
    from .common import NOISY_STREAM, STREAM_PROBE_MB

    streams = _streams(rows)
    if not streams:
        return ""
    return (
        f" Memory stream just before each cell (`torch.sum` over {STREAM_PROBE_MB} MB, all threads): "
        f"{min(streams):.1f}-{max(streams):.1f} GB/s; cells marked ‡ ran below {NOISY_STREAM:.0%} of the best, "
        "i.e. while something outside this process (on a VM, the host's other guests, which /proc/stat does not "
        "show) loaded memory: the Memory Layer, which streams its tables, slows more than nn.Linear there."
    )


def _meta_line(meta: dict) -> str:
    dirty = " + uncommitted changes in the package" if meta.get("package_dirty") else ""
    return (
        f"{meta['date']}, `{meta['command']}`, torch {meta['torch']}, transformers {meta['transformers']}, "
        f"{meta['threads']} threads, {meta['cpu']}, git {meta.get('git_commit')}{dirty}, "
        f"kernels available: {', '.join(meta['kernels_available'])}{_fused_line(meta)}, "
        f"took {meta.get('elapsed_s', 0):.0f} s"
    )


def _fused_line(meta: dict) -> str:
    """The fused kernel's build target, vector layer and the caches it planned with (records since they exist)."""
    if not meta.get("fused_kernel_isa"):
        return ""
    c = meta.get("caches_bytes") or {}
    caches = ", ".join(f"{k.upper()} {v // 1024} KB" for k, v in c.items() if v)
    return f"; fused built with -march={meta.get('fused_kernel_march')}, vector layer {meta['fused_kernel_isa']}, caches {caches}"


def markdown(results: dict) -> str:
    meta = results["meta"]
    flags = ", ".join(meta.get("cpu_flags") or []) or "-"
    dirty = " (+ uncommitted changes in modeling_memoryformer/)" if meta.get("package_dirty") else ""
    out = [
        "# MemoryFormer-HF benchmarks",
        "",
        "Written by `python -m benchmarks.run` (`make bench`); regenerate rather than edit.",
        "",
        "| | |",
        "|---|---|",
        f"| date (UTC) | {meta['date']} |",
        f"| command | `{meta['command']}` |",
        f"| torch | {meta['torch']} (transformers {meta['transformers']}, Python {meta['python']}) |",
        f"| threads | {meta['threads']} (torch.get_num_threads(); {meta['logical_cpus']} logical CPUs) |",
        f"| CPU | {meta['cpu']} ({flags}); {meta['total_memory_gb']} GB RAM |",
        f"| code | git {meta.get('git_commit')}{dirty} |",
        f"| Memory Layer kernels | {', '.join(meta['kernels_available'])}{_fused_line(meta)} |",
        *([f"| kernel build/load | {meta['kernel_build_load_seconds']:.1f} s, once, before and not in any timing |"]
          if meta.get("kernel_build_load_seconds") is not None else []),
        "",
        "**Method.** Every number is the median of timed repeats taken in one process, round-robin across the",
        "contestants of a cell (repeat r runs every contestant once, starting at contestant r mod n, so drift hits",
        "all of them alike), after untimed warm-up calls; times with `time.perf_counter`, garbage collector paused",
        "inside a sample. Cells with fast calls loop the call so that a timed sample lasts at least a minimum time",
        "and report time per call. The MemoryLayer kernels share one layer / model (same tables) and are switched",
        "with `use_kernel`. Peak memory at model level is measured differently: one fresh subprocess per",
        "(contestant, workload) builds the model, runs the workload once (training: a few steps) and reads",
        "VmHWM from /proc/self/status, because models interleaved in one process share one peak. Raw samples,",
        "quartiles and shapes are in results.json.",
        "",
    ]
    if "layer" in results:
        out += _layer_markdown(results["layer"])
    if "model" in results:
        out += _model_markdown(results["model"])
    return "\n".join(out).rstrip() + "\n"


def layer_tables(layer: dict) -> dict[tuple[str, str], list[str]]:
    """{(mode, dtype): markdown table lines}."""
    rows, ratios = layer["rows"], layer["ratios"]
    time_of = {(r["mode"], r["dtype"], r["d"], r["tokens"], r["contestant"]): r for r in rows}
    ratio_of = {(r["mode"], r["dtype"], r["d"], r["tokens"], r["kernel"]): r["ratio"] for r in ratios}
    threshold = layer["spec"].get("noisy_cores_threshold", 0.25)
    floor = _stream_floor(rows)
    tables = {}
    for mode in layer["spec"]["modes"]:
        kernels = _layer_kernels(layer, mode)
        for dtype in layer["spec"]["dtypes"]:
            head = "| d | N tokens | Linear ms |"
            rule = "|---:|---:|---:|"
            for k in kernels:
                head += f" MemoryLayer[{k}] ms | Linear / MemoryLayer[{k}] |"
                rule += "---:|---:|"
            lines = [head, rule]
            for d in layer["spec"]["dims"]:
                for n in layer["spec"]["tokens"]:
                    dense = time_of.get((mode, dtype, d, n, "Linear"))
                    if dense is None:
                        continue
                    mark = " †" if _noisy(dense, threshold) else ""
                    if floor is not None and (dense.get("host_stream_gbps") or floor) < floor:
                        mark += " ‡"
                    line = f"| {d} | {n}{mark} | {_cell_ms(dense)} |"
                    for k in kernels:
                        mem = time_of.get((mode, dtype, d, n, f"MemoryLayer[{k}]"))
                        line += f" {_cell_ms(mem)} | {_ratio(ratio_of.get((mode, dtype, d, n, k)))} |"
                    lines.append(line)
            if len(lines) > 2:  # (int8 has no forward + backward)
                tables[(mode, dtype)] = lines
    return tables


def _layer_kernels(layer: dict, mode: str) -> list[str]:
    """The spec's kernels, then the variants measured in `mode` (e.g. "fused+sparse": sparse table gradients)."""
    kernels = list(layer["spec"]["kernels"])
    return kernels + sorted({r["kernel"] for r in layer["ratios"] if r["mode"] == mode} - set(kernels))


def _cell_ms(row: dict | None) -> str:
    if row is None:
        return "-"
    if not row.get("ms"):
        return row["status"].split(":")[0]
    return _ms(row["ms"]["median"])


def _layer_markdown(layer: dict) -> list[str]:
    spec = layer["spec"]
    out = [
        "## Layer level: MemoryLayer vs nn.Linear",
        "",
        f"Measured {_meta_line(layer['meta'])}.",
        "",
        f"in = out = d, hash_bits {spec['hash_bits']} (K = d / {spec['hash_bits']} tables of "
        f"{2 ** spec['hash_bits']} rows), bias on both, input [N, d] ~ N(0, 1); forward under "
        "torch.inference_mode; forward + backward: loss = (y * g).sum() with a fixed random g, "
        "torch.autograd.grad for the input, weight/tables and bias. bfloat16: both layers hold bf16 parameters "
        "and take a bf16 input. "
        f"Median of {spec['repeats']} repeats after {max(1, spec['warmup'])} warm-up calls; one timed sample lasts "
        f">= {spec['min_sample_s'] * 1e3:.0f} ms. **Ratio = Linear time / MemoryLayer time: > 1 means the "
        "MemoryLayer is faster.**" + _contention(layer["meta"], spec.get("noisy_cores_threshold", 0.25))
        + _stream_note(layer["rows"]),
        "",
    ]
    for (mode, dtype), lines in layer_tables(layer).items():
        out += [f"### {MODE_TITLES[mode]}, {DTYPE_TITLES[dtype]}", ""] + lines + [""]
    bounded = [r for r in layer["rows"] if r.get("bound") and r.get("kernel") == "fused"]
    if bounded:
        out += [
            "### Memory Layer forward against its bound on this machine (fused kernel)",
            "",
            "Bound: the bytes the forward must move (its N x K rows, or each table once when that is fewer bytes, plus "
            "input and output) at the memory stream measured before the cell, or its N x K x d multiply-adds at the "
            "fastest rate `nn.Linear` reached in this run (any dtype), whichever takes longer. Distance = measured / "
            "bound (1.0 is at the bound; under 1: the repeated input's rows came from the caches).",
            "",
            "| dtype | d | N | measured ms | bound ms | bound by | distance |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in bounded:
            b = r["bound"]
            out.append(f"| {r['dtype']} | {r['d']} | {r['tokens']} | {r['ms']['median']:.3f} | {b['bound_ms']:.3f} | "
                       f"{b['bound']} | {b['distance']:.1f}x |")
        out.append("")
    problems = [r for r in layer["rows"] if r["status"] != "ok"]
    checks = [r for r in layer["rows"] if isinstance(r.get("max_abs_diff_vs_torch"), dict)]
    if checks:
        worst = max(checks, key=lambda r: r["max_abs_diff_vs_torch"]["max_abs_diff"]
                    / max(r["max_abs_diff_vs_torch"]["max_abs_torch_output"], 1e-30))
        c = worst["max_abs_diff_vs_torch"]
        out += [
            f"Output check of the non-torch kernels against `torch` on the benchmark inputs (forward): worst max "
            f"|difference| {c['max_abs_diff']:.3g} (output scale {c['max_abs_torch_output']:.3g}) at "
            f"{worst['contestant']} {worst['dtype']} d={worst['d']} N={worst['tokens']}.",
            "",
        ]
    if problems:
        out += ["Failures:", ""]
        out += [f"- {r['contestant']} {r['mode']} {r['dtype']} d={r['d']} N={r['tokens']}: {r['status']}"
                for r in problems]
        out += [""]
    return out


def _model_markdown(model: dict) -> list[str]:
    spec = model["spec"]
    out = [
        "## Model level: MemoryFormer vs its Pythia-shaped GPT-NeoX twin",
        "",
        f"Measured {_meta_line(model['meta'])}.",
        "",
        f"Random init, {'bfloat16 (every parameter of both models)' if spec.get('dtype') == 'bf16' else 'float32'}, "
        f"SDPA attention for both. prefill: one forward of 1 x {spec['prefill_tokens']} "
        f"tokens, inference_mode, use_cache=True, logits_to_keep=1 (both). decode: `generate` of "
        f"{spec['new_tokens']} new tokens from a {spec['prompt_tokens']}-token prompt, greedy, KV cache, "
        f"min_new_tokens={spec['new_tokens']}; tokens/s counts new tokens over the whole call (prompt prefill "
        f"included). train: {spec['train_batch']} x {spec['train_seq']} tokens, forward + backward + AdamW step. "
        f"Speed: median of {spec['repeats']} repeats after {max(1, spec['warmup'])} warm-up, round-robin "
        "in one process. Peak RSS: one fresh subprocess per cell (VmHWM: weights, activations, optimizer state, "
        f"plus {_import_rss(model)} of torch/transformers after import, `rss_import_mb` in results.json); training "
        f"runs {spec['rss_train_steps']} steps there. "
        "Ratios in brackets are relative to the twin (> 1: MemoryFormer faster; for memory, > 1: MemoryFormer "
        "bigger)." + _contention(model["meta"], spec.get("noisy_cores_threshold", 0.25)),
        "",
    ]
    if spec.get("layers") is not None:
        out += [f"**Quick mode: both models cut to {spec['layers']} layer(s); shapes reduced. Smoke test only.**", ""]
    workloads = spec["workloads"]
    notes = []
    for preset, infos in model["models"].items():
        mf, twin = infos["mf"], infos["twin"]
        out += [
            f"### {mf['name']} vs {twin['name']}",
            "",
            f"{mf['name']}: {mf['params'] / 1e6:,.1f} M params ({mf['table_params'] / 1e6:,.1f} M in hash tables, "
            f"{mf['fp32_weights_gb']} GB fp32), {mf['num_hidden_layers']} layers, d={mf['hidden_size']}. "
            f"{twin['name']}: {twin['params'] / 1e6:,.1f} M params ({twin['fp32_weights_gb']} GB fp32), "
            f"{twin['num_hidden_layers']} layers, d={twin['hidden_size']}, intermediate {twin['intermediate_size']}, "
            "parallel residual.",
            "",
        ]
        head = "| contestant |" + "".join(f" {WORKLOAD_TITLES[w]} |" for w in workloads)
        head += "".join(f" peak RSS {w} GB |" for w in workloads)
        lines = [head, "|---|" + "---:|" * (2 * len(workloads))]
        speed = {(r["contestant"], r["workload"]): r for r in model["rows"] if r["preset"] == preset}
        rss = {(r["contestant"], r["workload"]): r for r in model.get("peak_rss", []) if r["preset"] == preset}
        names = list(dict.fromkeys(r["contestant"] for r in model["rows"] if r["preset"] == preset))
        twin_name = twin["name"]
        for name in names:
            line = f"| {name} |"
            for w in workloads:
                r = speed.get((name, w))
                base = speed.get((twin_name, w))
                mark = " †" if _noisy(r, spec.get("noisy_cores_threshold", 0.25)) else ""
                line += " " + _speed_cell(r, base, name == twin_name, notes) + mark + " |"
            for w in workloads:
                r = rss.get((name, w))
                base = rss.get((twin_name, w))
                line += " " + _rss_cell(r, base, name == twin_name, notes) + " |"
            lines.append(line)
        out += lines + [""]
        ratios = _ratios_to(speed, names, twin_name + " [few-row linears]", "decode", "tokens_per_s")
        if ratios:
            out += [
                f"Decode against the twin whose every nn.Linear (head included) takes the same few-row pass as "
                f"MemoryFormer's LM head: {ratios}. This is the MemoryFormer layers' own share of the "
                "decode gain; the rest comes from the head's pass, which any dense model could use.",
                "",
            ]
        ratios = _ratios_to(speed, names, twin_name + " [chunked loss]", "train", "tokens_per_s")
        if ratios:
            memory = _ratios_to(rss, names, twin_name + " [chunked loss]", "train", "peak_rss_mb")
            out += [
                "Training step against the twin computing its loss by the same chunked cross-entropy as MemoryFormer "
                f"(no [tokens, vocab] logits): {ratios}" + (f"; peak RSS {memory}" if memory else "")
                + ". This is the MemoryFormer layers' own share of the training gain; the rest comes from the loss, "
                "which any dense model could compute this way.",
                "",
            ]
    sha = model["meta"].get("fused_kernel_source_sha256")
    changed = [
        r for r in model.get("peak_rss", [])
        if r.get("model") == "mf" and r.get("fused_kernel_source_sha256") not in (None, sha)
    ]
    if changed:
        notes.append(
            "The fused kernel's source changed while this section ran (another engineer working on it): the peak-RSS "
            "workers of " + ", ".join(sorted({r["contestant"] + " " + r["workload"] for r in changed}))
            + " ran a newer kernel than the speed measurements."
        )
    if notes:
        out += ["Notes:", ""] + [f"{i + 1}. {n}" for i, n in enumerate(notes)] + [""]
    return out


def _import_rss(model: dict) -> str:
    values = [r["rss_import_mb"] for r in model.get("peak_rss", []) if r.get("rss_import_mb")]
    return f"~{max(values) / 1e3:.2f} GB" if values else "the runtime"


def _note(notes: list[str], text: str) -> int:
    if text not in notes:
        notes.append(text)
    return notes.index(text) + 1


def _speed_cell(row: dict | None, base: dict | None, is_base: bool, notes: list[str]) -> str:
    if row is None:
        return "-"
    if "tokens_per_s" not in row:
        kind = row["status"].split(":")[0]
        return f"{kind} ({_note(notes, row['contestant'] + ' ' + row['workload'] + ': ' + row['status'])})"
    text = _rate(row["tokens_per_s"])
    if not is_base and base and base.get("tokens_per_s"):
        text += f" ({row['tokens_per_s'] / base['tokens_per_s']:.2f}x)"
    return text


def _rss_cell(row: dict | None, base: dict | None, is_base: bool, notes: list[str]) -> str:
    if row is None:
        return "not measured"
    if "peak_rss_mb" not in row:
        kind = row["status"].split(":")[0]
        return f"{kind} ({_note(notes, row['contestant'] + ' peak RSS ' + row['workload'] + ': ' + row['status'])})"
    text = f"{row['peak_rss_mb'] / 1e3:.2f}"
    if not is_base and base and base.get("peak_rss_mb"):
        text += f" ({row['peak_rss_mb'] / base['peak_rss_mb']:.1f}x)"
    return text


# ---------------------------------------------------------------------------------------------------------------------
# Charts


def charts(results: dict, out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for mode, filename in (("forward", "layer_forward.png"), ("fwd_bwd", "layer_fwd_bwd.png")):
        fig = _layer_chart(plt, results.get("layer"), mode)
        fig.savefig(os.path.join(out_dir, filename), dpi=110)
        plt.close(fig)
    fig = _model_chart(plt, results.get("model"))
    fig.savefig(os.path.join(out_dir, "model.png"), dpi=110)
    plt.close(fig)


def _empty(plt, text: str):
    fig, ax = plt.subplots(figsize=(6, 2.5))
    ax.axis("off")
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True)
    return fig


def _layer_chart(plt, layer: dict | None, mode: str):
    if not layer or mode not in layer["spec"]["modes"]:
        return _empty(plt, f"layer level, {mode}: not measured in this results.json")
    spec = layer["spec"]
    dims = spec["dims"]
    fig, axes = plt.subplots(1, len(dims), figsize=(max(7.5, 4.6 * len(dims)), 4.6), sharey=True, squeeze=False)
    styles = {"fp32": "-", "bf16": "--", "int8": ":"}
    markers = {"torch": "o", "fused": "s", "torch+sparse": "v", "fused+sparse": "D"}
    colors = {"torch": "C0", "fused": "C2", "torch+sparse": "C1", "fused+sparse": "C3"}
    values = [r["ratio"] for r in layer["ratios"] if r["mode"] == mode]
    for ax, d in zip(axes[0], dims):
        for kernel in _layer_kernels(layer, mode):
            for dtype in spec["dtypes"]:
                pts = sorted(
                    (r["tokens"], r["ratio"])
                    for r in layer["ratios"]
                    if r["mode"] == mode and r["d"] == d and r["kernel"] == kernel and r["dtype"] == dtype
                )
                if pts:
                    ax.plot(*zip(*pts), styles.get(dtype, "-"), marker=markers.get(kernel, "^"),
                            color=colors.get(kernel), label=f"{kernel} {dtype}")
        ax.axhline(1.0, color="black", linewidth=1, linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(spec["tokens"])
        ax.set_xticklabels([str(n) for n in spec["tokens"]])
        ax.set_title(f"d = {d} (K = {d // spec['hash_bits']} tables)")
        ax.set_xlabel("tokens N")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("Linear time / MemoryLayer time")
    if values:
        lo, hi = min(values + [1.0]), max(values + [1.0])
        axes[0][0].set_ylim(lo / 1.5, hi * 1.5)
    axes[0][-1].legend(title="kernel, dtype", fontsize=8)
    fig.suptitle(f"MemoryLayer vs nn.Linear, {MODE_TITLES[mode]}, hash_bits {spec['hash_bits']}\n"
                 f"above the dotted line (> 1) the MemoryLayer is faster; {layer['meta']['threads']} threads, "
                 f"{layer['meta']['cpu']}", fontsize=10)
    fig.tight_layout()
    return fig


def _ratios_to(cells: dict, names: list[str], reference: str, workload: str, key: str) -> str:
    """"name 1.23x, ..." of every MemoryFormer row's `key` over the `reference` contestant's, at `workload` ("" when
    the reference was not measured)."""
    base = cells.get((reference, workload))
    if not base or not base.get(key):
        return ""
    return ", ".join(
        f"{name} {r[key] / base[key]:.2f}x"
        for name in names
        if (r := cells.get((name, workload))) and r.get("model") == "mf" and r.get(key)
    )


def _model_chart(plt, model: dict | None):
    if not model or not model.get("rows"):
        return _empty(plt, "model level: not measured in this results.json")
    workloads = model["spec"]["workloads"]
    presets = list(model["models"])
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.8 * len(workloads), 4.4), squeeze=False)
    # One colour per contestant across the panels (a twin variant is measured in one workload only).
    every = ["mf:" + (k or "") for k in model["spec"]["kernels"]] + ["twin:"]
    every += sorted({"twin:" + r["kernel"] for r in model["rows"] if r["model"] == "twin" and r["kernel"]})
    colour = {slot: f"C{i}" for i, slot in enumerate(every)}
    for ax, w in zip(axes[0], workloads):
        rows = [r for r in model["rows"] if r["workload"] == w]
        slots = ["mf:" + (k or "") for k in model["spec"]["kernels"]] + ["twin:"]
        slots += sorted({"twin:" + r["kernel"] for r in rows if r["model"] == "twin" and r["kernel"]})
        width = 0.8 / len(slots)
        for i, slot in enumerate(slots):
            kind, kernel = slot.split(":")
            xs, ys, labels = [], [], []
            for p_i, preset in enumerate(presets):
                r = next((r for r in rows if r["preset"] == preset and r["model"] == kind
                          and (r["kernel"] or "") == kernel), None)
                x = p_i - 0.4 + width * (i + 0.5)
                if r is None:
                    continue
                if r.get("tokens_per_s"):
                    xs.append(x)
                    ys.append(r["tokens_per_s"])
                    labels.append(_rate(r["tokens_per_s"]))
                else:
                    ax.text(x, 0, r["status"].split(":")[0], rotation=90, ha="center", va="bottom", fontsize=7)
            label = f"MemoryFormer [{kernel}]" if kind == "mf" else "GPT-NeoX twin" + (f" [{kernel}]" if kernel else "")
            bars = ax.bar(xs, ys, width, label=label, color=colour[slot])
            for bar, text in zip(bars, labels):
                ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), text, ha="center", va="bottom",
                        fontsize=7)
        ax.set_xticks(range(len(presets)))
        ax.set_xticklabels([f"MF-{p} vs\n{model['models'][p]['twin']['name']}" for p in presets], fontsize=8)
        ax.set_title(WORKLOAD_TITLES[w])
        ax.set_ylabel("tokens / s (higher is better)")
        ax.grid(True, axis="y", alpha=0.3)
        ax.margins(y=0.15)
    legend = {}  # every bar's label once: the twin's variants appear in one workload's panel only
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=len(legend), fontsize=9, frameon=False)
    quick = " (QUICK MODE: reduced models, smoke test)" if model["spec"].get("layers") is not None else ""
    dtype = {"bf16": "bfloat16 (both models)"}.get(model["spec"].get("dtype"), "float32")
    fig.suptitle(f"MemoryFormer vs GPT-NeoX twin, {dtype}, {model['meta']['threads']} threads{quick}", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


