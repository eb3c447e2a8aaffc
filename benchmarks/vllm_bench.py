"""Serving speed through vLLM: MF-tiny and its Pythia-70M-shaped twin behind `vllm serve` (the Transformers backend,
docs/serving.md "vLLM"), N concurrent streaming clients (1, 4, 16), completion tokens per second and time to first
token. The twin of `benchmarks.serve_bench`, with vLLM's scheduler and paged attention in place of `memoryformer serve`.

    python -m benchmarks.vllm_bench --cpu-tag zen3   # writes benchmarks/results/<date>-zen3-vllm/results.{json,md,png}
    python -m benchmarks.vllm_bench --clients 1 4 --requests 2 --max-tokens 32 --enforce-eager

Needs the vLLM venv (`make vllm`; `--vllm-python` or MEMORYFORMER_VLLM_PYTHON names its interpreter). This process
(the main venv) saves both models, randomly initialised with the MF-tiny preset's shape and vocabulary and the same
tokenizer as serve_bench, and runs the clients (openai's, streaming, threads); each model is served by `vllm serve`
in a process group of its own, on 127.0.0.1. The prompts are the same token ids for both models (vLLM takes ids as a
prompt); `ignore_eos` keeps every completion at `--max-tokens`. tokens/s: all completion tokens of a level over its
wall time. Time to first token: from sending a request to its first streamed token. The server's CPU time is the sum
over its process group (API server, engine, worker), read from /proc and kept apart from other processes' (BUSY above
0.25 cores). vLLM's own CPU settings are left at their defaults unless given (`--omp-bind`; by default vLLM keeps one
core for its API server and binds the model's threads to the others), and the run records them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from .common import REPO_ROOT, environment
from .serve_bench import NOISY_CORES, _free_port, _machine_busy_seconds, _plot, _tokenizer, save_models

DEFAULT_VLLM_PYTHON = os.path.join(REPO_ROOT, ".venv-vllm", "bin", "python")
START_TIMEOUT = 900  # seconds: the compiled mode compiles the model at start


def _group_cpu_seconds(pgid: int) -> float:
    """utime + stime of every process of process group `pgid`, from /proc."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, ValueError, IndexError):
            continue
        if int(fields[2]) == pgid:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


class VllmServer:
    """`vllm serve FOLDER` on 127.0.0.1 in a process group of its own, until `stop()`."""

    def __init__(self, vllm_python: str, folder: str, args: argparse.Namespace, dtype: str, model_impl: str):
        self.port = _free_port()
        command = [os.path.join(os.path.dirname(vllm_python), "vllm"), "serve", folder, "--model-impl", model_impl,
                   "--trust-remote-code", "--dtype", dtype, "--host", "127.0.0.1", "--port", str(self.port),
                   "--kv-cache-memory-bytes", args.kv_cache, "--max-num-seqs", str(max(args.clients)),
                   "--max-model-len", str(args.prompt_tokens + args.max_tokens + 16), "--seed", str(args.seed)]
        if args.enforce_eager:
            command.append("--enforce-eager")
        env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
        env.update(VLLM_HOST_IP="127.0.0.1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1")
        if args.omp_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = args.omp_bind
        if args.reserved_cpus is not None:
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(args.reserved_cpus)
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        start = time.monotonic()
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() - start > START_TIMEOUT:
                self.stop()
                with open(self.log.name, encoding="utf-8", errors="replace") as f:
                    raise RuntimeError(f"`{' '.join(command)}` did not start: {f.read()[-3000:]}")
            time.sleep(1)
        self.start_s = round(time.monotonic() - start, 1)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        self.log.close()
        os.unlink(self.log.name)


def run_level(server: VllmServer, model_name: str, clients: int, requests: int, prompts: list[list[int]],
              max_tokens: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0,
                           timeout=600)

    def one_client(index: int) -> list[tuple[float, int]]:
        out = []
        for r in range(requests):
            prompt = prompts[(index * requests + r) % len(prompts)]
            start = time.perf_counter()
            first, tokens = None, 0
            stream = client.completions.create(model=model_name, prompt=prompt, max_tokens=max_tokens,
                                               temperature=0, stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True})
            for chunk in stream:
                if first is None and chunk.choices:
                    first = time.perf_counter() - start
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            out.append((first if first is not None else time.perf_counter() - start, tokens))
        return out

    busy_before, server_before, start = _machine_busy_seconds(), _group_cpu_seconds(server.process.pid), \
        time.perf_counter()
    own_before = time.process_time()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = [item for items in pool.map(one_client, range(clients)) for item in items]
    wall = time.perf_counter() - start
    server_cpu = _group_cpu_seconds(server.process.pid) - server_before
    own_cpu = time.process_time() - own_before
    other = max(0.0, (_machine_busy_seconds() - busy_before) - server_cpu - own_cpu) / wall
    tokens = sum(t for _, t in results)
    return {"clients": clients, "requests": len(results), "tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 2), "ttft_median_ms": round(1000 * statistics.median(
                f for f, _ in results), 1), "server_cores": round(server_cpu / wall, 2),
            "client_cores": round(own_cpu / wall, 2), "other_cores": round(other, 3), "busy": other > NOISY_CORES}


def default_out_dir(cpu_tag: str | None, cpu: str | None) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", (cpu_tag or cpu or "cpu").lower()).strip("-") or "cpu"
    date = datetime.date.today().isoformat()
    return os.path.join(REPO_ROOT, "benchmarks", "results", f"{date}-{slug}-vllm")


def vllm_versions(vllm_python: str) -> dict:
    code = ("import json, importlib.metadata as m; print(json.dumps({n: m.version(n) for n in "
            "('vllm-cpu', 'torch', 'transformers')}))")
    result = subprocess.run([vllm_python, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(result.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=os.environ.get("MEMORYFORMER_VLLM_PYTHON", DEFAULT_VLLM_PYTHON),
                        help="the vLLM venv's interpreter (default: MEMORYFORMER_VLLM_PYTHON, else .venv-vllm)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--requests", type=int, default=3, help="requests per client at each level (default 3)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--kv-cache", default="2G", help="vLLM's --kv-cache-memory-bytes (default 2G = 2 GiB)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no torch.compile of the models (vLLM's default compiles them at start)")
    parser.add_argument("--omp-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: vLLM's, 'auto')")
    parser.add_argument("--reserved-cpus", type=int, default=None,
                        help="VLLM_CPU_NUM_OF_RESERVED_CPU (default: vLLM's, one core for the API server)")
    parser.add_argument("--twin-impl", default="transformers", choices=["transformers", "vllm"],
                        help="the twin through vLLM's Transformers backend, as MF-tiny (default), or vLLM's own GPT-NeoX")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--note", default="", help="a line for results.md: what was served, how the machine was")
    parser.add_argument("--cpu-tag", default=None,
                        help="the <cpu> of the default --out-dir, e.g. zen3 (default: the CPU's model name)")
    parser.add_argument("--out-dir", default=None, help="default: benchmarks/results/<date>-<cpu>-vllm")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.vllm_python):
        parser.error(f"no vLLM venv at {args.vllm_python}: build it with `make vllm` or pass --vllm-python")

    import torch

    env = environment()
    env["vllm_venv"] = vllm_versions(args.vllm_python)
    out_dir = args.out_dir or default_out_dir(args.cpu_tag, env.get("cpu"))
    tokenizer, tokenizer_name = _tokenizer()
    generator = torch.Generator().manual_seed(args.seed)
    text_ids = tokenizer(" ".join(["memory layers replace every dense layer of the transformer with hash tables"]
                                  * 8)).input_ids
    prompts = []
    for _ in range(64):
        start = int(torch.randint(0, max(1, len(text_ids) - args.prompt_tokens), (1,), generator=generator))
        prompts.append(text_ids[start:start + args.prompt_tokens])
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        folders = save_models(folder, args.seed)
        for dtype in args.dtypes:
            for name, path in folders.items():
                impl = "transformers" if name == "MF-tiny" else args.twin_impl
                server = VllmServer(args.vllm_python, path, args, dtype, impl)
                print(f"{name} {dtype}: vllm serve ready in {server.start_s} s", flush=True)
                try:
                    run_level(server, path, 1, 1, prompts, 4)  # warm-up
                    for clients in args.clients:
                        row = run_level(server, path, clients, args.requests, prompts, args.max_tokens)
                        row.update(model=name, dtype=dtype, model_impl=impl, server_start_s=server.start_s)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                finally:
                    server.stop()
    ratios = []
    for dtype in args.dtypes:
        for clients in args.clients:
            mf = next(r for r in rows if r["model"] == "MF-tiny" and r["dtype"] == dtype and r["clients"] == clients)
            tw = next(r for r in rows if r["model"] == "twin" and r["dtype"] == dtype and r["clients"] == clients)
            ratios.append({"dtype": dtype, "clients": clients, "mf": mf, "twin": tw,
                           "tokens_per_s_ratio": round(mf["tokens_per_s"] / tw["tokens_per_s"], 2)})
    os.makedirs(out_dir, exist_ok=True)
    result = {"environment": env, "tokenizer": tokenizer_name, "settings": vars(args), "rows": rows,
              "ratios": [{k: v for k, v in r.items() if k not in ("mf", "twin")} for r in ratios]}
    with open(os.path.join(out_dir, "results.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    versions = env["vllm_venv"]
    twin_how = "vLLM's own GPT-NeoX" if args.twin_impl == "vllm" else "the same"
    lines = ["# Serving through vLLM: MF-tiny vs its twin behind `vllm serve`\n",
             f"CPU: {env.get('cpu')}, {env.get('logical_cpus')} logical CPUs; vllm-cpu {versions['vllm-cpu']}, "
             f"torch {versions['torch']}, transformers {versions['transformers']}; "
             f"{'eager (--enforce-eager)' if args.enforce_eager else 'compiled (vLLM default)'}; "
             f"VLLM_CPU_OMP_THREADS_BIND={args.omp_bind or 'auto (default)'}, VLLM_CPU_NUM_OF_RESERVED_CPU="
             f"{args.reserved_cpus if args.reserved_cpus is not None else 'default'}; MF-tiny through the Transformers "
             f"backend, the twin through {twin_how}. Each client: {args.requests} "
             f"streaming completions of {args.max_tokens} tokens from {args.prompt_tokens}-token prompts. "
             f"Command: `{env.get('command')}`.\n",
             *([f"{args.note}\n"] if args.note else []),
             "| dtype | clients | MF-tiny tokens/s | twin tokens/s | MF/twin | MF TTFT ms | twin TTFT ms | "
             "MF / twin server cores | other cores |",
             "|---|---|---|---|---|---|---|---|---|"]
    for ratio in ratios:
        mf, tw = ratio["mf"], ratio["twin"]
        busy = " BUSY" if mf["busy"] or tw["busy"] else ""
        lines.append(f"| {ratio['dtype']} | {ratio['clients']} | {mf['tokens_per_s']} | {tw['tokens_per_s']} | "
                     f"{ratio['tokens_per_s_ratio']}x | {mf['ttft_median_ms']} | {tw['ttft_median_ms']} | "
                     f"{mf['server_cores']} / {tw['server_cores']} | "
                     f"{max(mf['other_cores'], tw['other_cores'])}{busy} |")
    with open(os.path.join(out_dir, "results.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    _plot(rows, args, os.path.join(out_dir, "tokens_per_s.png"), server="vllm serve")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
