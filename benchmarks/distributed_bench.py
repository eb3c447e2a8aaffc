"""Memory and speed of sharded training: one process, DDP on 2 ranks and FSDP2 on 2 ranks, same global batch.

    python -m benchmarks.distributed_bench [--preset tiny] [--steps 8] [--global-batch 8] [--seq-len 512]
                                           [--out-dir benchmarks/results/distributed]

Every run is the project's training path (`training.trainer.train` with `TrainingSettings`: the Trainer, AdamW on every
parameter, the paper's recipe) on random token ids, started in its own processes (torchrun for 2 ranks, gloo),
one after the other so that each has the machine to itself. Reported per run: the peak RSS of each rank (VmHWM) and
the training tokens/s over the steps after the first two (median step time). The two ranks share this machine's
cores and memory, so 2 ranks cannot be faster than one process here; what the figures show is the memory each rank
needs and the cost of FSDP's gathers against DDP's all-reduce.

A second part weighs the layout FSDP uses (whole layers gathered before use: table values per layer) against a
column split of every table across ranks (each rank computes its columns of every output: tokens x width per layer),
by timing the gloo collectives each would need for one Memory Layer of the preset.

Writes results.json, results.md and distributed.png to --out-dir; every result records the CPU and its vector features.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
GB = 1e9


def _free_port() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


# ---------------------------------------------------------------------------------------------------------------------
# One training run (inside each process)


def _random_data(vocab_size: int, seq_len: int, blocks: int):
    import torch

    from modeling_memoryformer.training.data import LMData, TokenBlocks

    generator = torch.Generator().manual_seed(0)
    train = TokenBlocks(torch.randint(0, vocab_size, (blocks, seq_len), generator=generator))
    validation = TokenBlocks(torch.randint(0, vocab_size, (2, seq_len), generator=generator))
    return LMData(train=train, validation=validation, tokenizer=None, description="random ids", block_size=seq_len,
                  num_train_tokens=blocks * seq_len, num_validation_tokens=2 * seq_len, dropped_tokens=0)


def train_worker(spec: dict) -> None:
    import torch
    from transformers import TrainerCallback

    from benchmarks.common import cpu_flags, cpu_model, peak_rss_bytes
    from modeling_memoryformer import MemoryFormerConfig, MemoryFormerForCausalLM
    from modeling_memoryformer.training import trainer as trainer_module
    from modeling_memoryformer.training.trainer import TrainingSettings, train

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    overrides = {"num_hidden_layers": spec["layers"]} if spec.get("layers") else {}
    config = MemoryFormerConfig.from_preset(spec["preset"], **overrides)
    torch.manual_seed(0)
    model = MemoryFormerForCausalLM(config)
    batch = spec["global_batch"] // world
    data = _random_data(config.vocab_size, spec["seq_len"], spec["global_batch"] * (spec["steps"] + 1))

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self._start = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._start)

    times = StepTimes()
    build = trainer_module.build_trainer
    trainer_module.build_trainer = lambda *a, callbacks=(), **k: build(*a, callbacks=[*callbacks, times], **k)
    with tempfile.TemporaryDirectory() as out:
        train(model, data, TrainingSettings(
            output_dir=out, max_steps=spec["steps"], per_device_batch_size=batch, report_to="none", progress=False,
            save_final_model=False, eval_steps=spec["steps"], logging_steps=spec["steps"], fsdp=spec["fsdp"]))
    steady = times.times[2:] or times.times
    record = {"rank": rank, "peak_rss_gb": round(peak_rss_bytes() / GB, 2),
              "step_seconds_median": statistics.median(steady),
              "tokens_per_second": spec["global_batch"] * spec["seq_len"] / statistics.median(steady),
              "cpu": cpu_model(), "cpu_flags": cpu_flags(), "threads_per_rank": torch.get_num_threads()}
    with open(f"{spec['result']}.rank{rank}", "w", encoding="utf-8") as f:
        json.dump(record, f)


# ---------------------------------------------------------------------------------------------------------------------
# Collectives of the two layouts for one Memory Layer (inside each of 2 processes)


def _fsdp_collectives(dist, table_full, table_shard, grad_shard) -> None:
    """FSDP's traffic for one layer per step: gather for the forward, again for the backward (resharded after the
    forward), reduce-scatter of the gradient."""
    dist.all_gather_into_tensor(table_full, table_shard)
    dist.all_gather_into_tensor(table_full, table_shard)
    dist.reduce_scatter_tensor(grad_shard, table_full)


def _column_collectives(dist, out_full, out_cols, grad_x) -> None:
    """A column split's traffic for one layer per step: every rank's output columns gathered for the forward, the
    input gradient summed over ranks in the backward."""
    dist.all_gather_into_tensor(out_full, out_cols)
    dist.all_reduce(grad_x)


def _median_time(dist, step, repeats: int = 5) -> float:
    step()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def comm_worker(spec: dict) -> None:
    import torch
    import torch.distributed as dist

    from modeling_memoryformer import MemoryFormerConfig

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    config = MemoryFormerConfig.from_preset(spec["preset"])
    d, tau = config.hidden_size, config.hash_bits
    tokens = spec["global_batch"] * spec["seq_len"] // world  # per rank
    rows = (d // tau) << tau
    layers = {"attention qkv (d -> 3d)": 3 * d, "memory block layer1 (d -> (tau+e)K)": config.intermediate_size}
    results = []
    for name, width in layers.items():
        d_in = d if "qkv" in name else config.intermediate_size
        table_shard = torch.randn(rows // world, width)
        table_full = torch.empty(rows, width)
        grad_shard = torch.empty(rows // world, width)
        out_cols = torch.randn(tokens * world, width // world)  # column split: this rank's columns, all tokens
        out_full = torch.empty(world * tokens * world, width // world)
        grad_x = torch.randn(tokens * world, d_in)
        fsdp = functools.partial(_fsdp_collectives, dist, table_full, table_shard, grad_shard)
        column = functools.partial(_column_collectives, dist, out_full, out_cols, grad_x)
        timings = {label: _median_time(dist, step) for label, step in (("fsdp", fsdp), ("column", column))}
        bytes_fsdp = 3 * rows * width * 4 * (world - 1) // world  # received per rank
        bytes_column = tokens * world * width * 4 * (world - 1) // world + tokens * world * d_in * 4
        results.append({"layer": name, "table_rows": rows, "width": width, "tokens_per_rank": tokens,
                        "fsdp_ms": round(1e3 * timings["fsdp"], 2), "column_split_ms": round(1e3 * timings["column"], 2),
                        "fsdp_mb_per_rank": round(bytes_fsdp / 1e6, 1),
                        "column_split_mb_per_rank": round(bytes_column / 1e6, 1)})
    if rank == 0:
        with open(spec["result"], "w", encoding="utf-8") as f:
            json.dump(results, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------------
# The driver


def _launch(mode: str, ranks: int, spec: dict, result: str) -> None:
    spec = {**spec, "result": result}
    spec_path = result + ".spec.json"
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(spec, f)
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
                 _free_port()] if ranks > 1 else [sys.executable])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    subprocess.run([*launcher, "-m", "benchmarks.distributed_bench", "--worker", mode, spec_path], check=True,
                   cwd=REPO, env=env)


def _plot(rows: list[dict], path: str, title: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.8))
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    names = [r["run"] for r in rows]
    left.bar(names, [r["peak_rss_gb_per_rank"] for r in rows], color=["tab:gray", "tab:blue", "tab:orange"][:len(rows)])
    left.set_ylabel("peak RSS per process (GB)")
    right.bar(names, [r["tokens_per_second"] for r in rows], color=["tab:gray", "tab:blue", "tab:orange"][:len(rows)])
    right.set_ylabel("training tokens/s (all ranks)")
    for ax in (left, right):
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", choices=("tiny", "small", "base"))
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (the first two are not timed)")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step over all ranks")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--layers", type=int, default=None, help="blocks (default: the preset's)")
    parser.add_argument("--runs", nargs="+", default=["single", "ddp", "fsdp"], choices=("single", "ddp", "fsdp"))
    parser.add_argument("--no-comm", action="store_true", help="skip the collectives of the two layouts")
    parser.add_argument("--out-dir", default=os.path.join(HERE, "results", "distributed"))
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        mode, spec_path = args.worker
        with open(spec_path, encoding="utf-8") as f:
            spec = json.load(f)
        (comm_worker if mode == "comm" else train_worker)(spec)
        return 0

    from benchmarks.common import environment

    os.makedirs(args.out_dir, exist_ok=True)
    spec = {"preset": args.preset, "steps": args.steps, "global_batch": args.global_batch, "seq_len": args.seq_len,
            "layers": args.layers}
    env = environment()
    print(f"{env['cpu']} ({' '.join(env['cpu_flags'])}), {env['logical_cpus']} CPUs, {env['total_memory_gb']} GB")
    runs = {"single": (1, False), "ddp": (2, False), "fsdp": (2, True)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.runs:
            ranks, fsdp = runs[name]
            result = os.path.join(tmp, name)
            print(f"[{name}] {ranks} process{'es' * (ranks > 1)}, MF-{args.preset}, {args.steps} steps x "
                  f"{args.global_batch} x {args.seq_len} tokens", flush=True)
            start = time.perf_counter()
            _launch("train", ranks, {**spec, "fsdp": fsdp}, result)
            per_rank = [json.load(open(f"{result}.rank{r}", encoding="utf-8")) for r in range(ranks)]
            rows.append({"run": name, "processes": ranks, "fsdp": fsdp,
                         "peak_rss_gb_per_rank": max(r["peak_rss_gb"] for r in per_rank),
                         "peak_rss_gb_ranks": [r["peak_rss_gb"] for r in per_rank],
                         "tokens_per_second": round(per_rank[0]["tokens_per_second"], 1),
                         "step_seconds_median": round(per_rank[0]["step_seconds_median"], 3),
                         "threads_per_rank": per_rank[0]["threads_per_rank"],
                         "wall_seconds": round(time.perf_counter() - start, 1)})
            print(f"  peak RSS per rank {rows[-1]['peak_rss_gb_ranks']} GB, {rows[-1]['tokens_per_second']} "
                  "tokens/s", flush=True)
        comm = None
        if not args.no_comm:
            result = os.path.join(tmp, "comm.json")
            _launch("comm", 2, spec, result)
            comm = json.load(open(result, encoding="utf-8"))
    single = next((r for r in rows if r["run"] == "single"), None)
    for row in rows:
        if single:
            row["peak_rss_vs_single"] = round(row["peak_rss_gb_per_rank"] / single["peak_rss_gb_per_rank"], 3)
    ddp = next((r for r in rows if r["run"] == "ddp"), None)
    for row in rows:
        if ddp:
            row["tokens_per_second_vs_ddp"] = round(row["tokens_per_second"] / ddp["tokens_per_second"], 3)
    report = {"environment": env, "settings": spec, "runs": rows, "layouts": comm}
    with open(os.path.join(args.out_dir, "results.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    lines = [f"MF-{args.preset}, AdamW, {args.global_batch} x {args.seq_len} tokens per step over all ranks, "
             f"{env['cpu']} ({env['logical_cpus']} CPUs), {env['date']}", "",
             "| run | processes | peak RSS per process | vs one process | tokens/s | vs DDP |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['processes']} | {r['peak_rss_gb_per_rank']:.2f} GB | "
                     f"{r.get('peak_rss_vs_single', float('nan')):.2f}x | {r['tokens_per_second']:.0f} | "
                     f"{r.get('tokens_per_second_vs_ddp', float('nan')):.2f}x |")
    if comm:
        lines += ["", "| Memory Layer | FSDP: gather whole layer | column split: gather outputs | data per rank "
                  "(FSDP / column) |", "|---|---|---|---|"]
        for c in comm:
            lines.append(f"| {c['layer']} | {c['fsdp_ms']} ms | {c['column_split_ms']} ms | "
                         f"{c['fsdp_mb_per_rank']} / {c['column_split_mb_per_rank']} MB |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out_dir, "results.md"), "w", encoding="utf-8") as f:
        f.write(text)
    if rows:
        _plot(rows, os.path.join(args.out_dir, "distributed.png"),
              f"MF-{args.preset} training, {args.global_batch} x {args.seq_len} tokens per step, {env['cpu']}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
