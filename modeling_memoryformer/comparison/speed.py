"""Speed of models side by side, measured apart from training: the demo's speed rows.

Timings taken inside a training loop carry whatever else the machine did meanwhile, and the models of a comparison
trained at different times. Here every round times one training step and one greedy generation of each model, the
models alternated (the first one rotates with the round, so drift of the machine hits all alike), and each model's
figure is the median over the rounds. Beside every timing the CPU used by other processes is recorded
(`evaluation.cpu_load`); a measurement during which they kept more than NOISY_CORES cores busy is flagged busy. A
memory-stream probe per round records what /proc/stat cannot see: neighbours on a shared host loading memory.

The training step is the one the Trainer runs (forward with labels, backward, gradient clipping at 1.0, a fused
AdamW step), on a copy of the model with an optimizer of its own, so the trained model is left as it is.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from ..evaluation.cpu_load import NOISY_CORES, cpu_snapshot, memory_stream_gbps, other_cpu_since, stream_buffer

@dataclass
class Timings:
    """Seconds of each timed call of one workload of one model, and the CPU others used meanwhile."""

    tokens: int  # tokens one call processes (a training step's batch, or the generated tokens)
    seconds: list[float] = field(default_factory=list)
    wall_seconds: float = 0.0
    other_cpu_seconds: float = 0.0

    def time(self, fn) -> None:
        before = cpu_snapshot()
        start = time.perf_counter()
        fn()
        self.seconds.append(time.perf_counter() - start)
        wall, other = other_cpu_since(before)
        self.wall_seconds += wall
        self.other_cpu_seconds += other

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / statistics.median(self.seconds)

    @property
    def other_cores(self) -> float | None:
        return self.other_cpu_seconds / self.wall_seconds if self.wall_seconds > 0 else None

    def summary(self) -> dict:
        spread = sorted(self.tokens / s for s in self.seconds)
        return {"tokens_per_second": self.tokens_per_second, "min": spread[0], "max": spread[-1],
                "samples": len(self.seconds), "other_cores": self.other_cores, **asdict(self)}


def training_step(model: torch.nn.Module, batch: torch.Tensor, max_grad_norm: float = 1.0):
    """A function running one training step of a copy of `model` on `batch` [B, T] (labels = inputs), as the
    Trainer does: forward with labels, backward, clipping, a fused AdamW step (weight decay 0.1), gradients freed."""
    twin = copy.deepcopy(model).train()
    optimizer = torch.optim.AdamW(twin.parameters(), lr=1e-4, weight_decay=0.1, fused=True)

    def step():
        loss = twin(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def greedy_decode(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int):
    """A function generating exactly `new_tokens` tokens greedily after `prompt` [1, P] with the KV cache."""
    kwargs = dict(do_sample=False, pad_token_id=model.config.pad_token_id, eos_token_id=None,
                  max_new_tokens=new_tokens, min_new_tokens=new_tokens)

    def decode():
        model.eval()
        with torch.inference_mode():
            out = model.generate(prompt, **kwargs)
        if out.shape[1] - prompt.shape[1] != new_tokens:
            raise RuntimeError(f"the decode timing generated {out.shape[1] - prompt.shape[1]} tokens, not {new_tokens}")

    return decode


def measure_speed(models: dict[str, torch.nn.Module], batch: torch.Tensor, prompt: torch.Tensor, new_tokens: int,
                  rounds: int = 10, progress: bool = True) -> dict:
    """Training-step and decode tokens/s of each model in `models`, alternated over `rounds` rounds (medians), with
    the load of the machine: {"models": {name: {"train": ..., "decode": ...}}, "rounds", "other_cores" (mean over
    all timings), "max_other_cores" (the busiest model-workload), "busy" (any above NOISY_CORES), "threshold",
    "memory_stream_gbps" (median, min and max of the per-round probe)}."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}.")
    names = list(models)
    work = {name: {"train": (training_step(models[name], batch), Timings(batch.numel())),
                   "decode": (greedy_decode(models[name], prompt, new_tokens), Timings(new_tokens))}
            for name in names}
    for name in names:  # warm-up: first calls allocate, plan and fill caches
        for fn, _ in work[name].values():
            fn()
    memory_stream_gbps(repeats=1)  # allocates the probe's buffer, untimed, and reads it once
    streams = []
    with tqdm(total=rounds * len(names) * 2, desc="timing both models, alternated", disable=not progress) as bar:
        for r in range(rounds):
            streams.append(memory_stream_gbps(repeats=1))
            order = names[r % len(names):] + names[:r % len(names)]
            for workload in ("train", "decode"):
                for name in order:
                    fn, timings = work[name][workload]
                    timings.time(fn)
                    bar.update(1)
    results = {name: {workload: timings.summary() for workload, (_, timings) in work[name].items()} for name in names}
    del work  # the training copies and their optimizer state
    stream_buffer.cache_clear()
    loads = [w["other_cores"] for r in results.values() for w in r.values() if w["other_cores"] is not None]
    wall = sum(w["wall_seconds"] for r in results.values() for w in r.values())
    other = sum(w["other_cpu_seconds"] for r in results.values() for w in r.values())
    return {
        "models": results,
        "rounds": rounds,
        "train_batch": list(batch.shape),
        "decode": {"prompt_tokens": prompt.shape[1], "new_tokens": new_tokens},
        "other_cores": other / wall if wall > 0 and loads else None,
        "max_other_cores": max(loads) if loads else None,
        "busy": bool(loads) and max(loads) > NOISY_CORES,
        "threshold": NOISY_CORES,
        "memory_stream_gbps": {"median": statistics.median(streams), "min": min(streams), "max": max(streams)},
    }
