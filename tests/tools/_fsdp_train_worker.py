"""Worker of test_distributed.py's FSDP tests: trains the tiny MemoryFormer with `memoryformer`'s Trainer setup
(`TrainingSettings(fsdp=...)`) and writes, from rank 0, the per-step losses, the evaluation loss and what each rank
held of the tables to a JSON file.

    python tests/tools/_fsdp_train_worker.py SPEC_JSON                      (one process)
    torchrun --nproc_per_node 2 tests/tools/_fsdp_train_worker.py SPEC_JSON (2 ranks over gloo)

SPEC_JSON: {"out": folder, "result": json path, "batch": per-device batch, "fsdp": bool, "model": folder to start
from, "max_steps": N, "save_steps": N or null, "resume": checkpoint or null, "broken_avg": bool}. With
"broken_avg", gloo's ReduceOp.AVG is replaced by SUM in this process (the reported gloo bug), to show that the
training does not depend on it.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # _training_data beside this file

from _training_data import synthetic_lm_data

from transformers import AutoModelForCausalLM, TrainerCallback

import modeling_memoryformer  # noqa: F401  (registers the Auto classes)
from modeling_memoryformer.training.trainer import TrainingSettings, train


def break_avg() -> None:
    """Make ReduceOp.AVG behave as SUM in the collectives FSDP2 and DDP call (as gloo was reported to do)."""
    for name in ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor"):
        original = getattr(dist, name, None)
        if original is None:
            continue

        def broken(*args, _original=original, **kwargs):
            if kwargs.get("op") == dist.ReduceOp.AVG:
                kwargs["op"] = dist.ReduceOp.SUM
            args = tuple(dist.ReduceOp.SUM if isinstance(a, dist.ReduceOp.RedOpType) and a == dist.ReduceOp.AVG
                         else a for a in args)
            return _original(*args, **kwargs)

        setattr(dist, name, broken)


class Holdings(TrainerCallback):
    """Table values held by this rank (local shards) against the whole tables, after the first step."""

    def __init__(self):
        self.local = self.full = 0
        self.units = []
        self.sharded = None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step != 1:
            return
        from torch.distributed.tensor import DTensor

        for name, p in model.named_parameters():
            if name.endswith("tables"):
                self.local += (p.to_local() if isinstance(p, DTensor) else p).numel()
                self.full += p.numel()
        self.sharded = type(model).__name__
        from torch.distributed.fsdp import FSDPModule

        self.units = [name or "root" for name, module in model.named_modules() if isinstance(module, FSDPModule)]


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    torch.set_num_threads(1)
    if spec.get("broken_avg"):
        break_avg()
    model = AutoModelForCausalLM.from_pretrained(spec["model"])  # a model saved by one process
    holdings = Holdings()
    from modeling_memoryformer.training import trainer as trainer_module

    build = trainer_module.build_trainer
    trainer_module.build_trainer = lambda *a, callbacks=(), **k: build(*a, callbacks=[*callbacks, holdings], **k)
    result = train(model, synthetic_lm_data(), TrainingSettings(
        output_dir=spec["out"], max_steps=spec["max_steps"], per_device_batch_size=spec["batch"], logging_steps=1,
        eval_steps=spec["max_steps"], report_to="none", learning_rate=3e-3, warmup_ratio=0.0, progress=False,
        fsdp=spec["fsdp"], save_steps=spec.get("save_steps"), resume_from_checkpoint=spec.get("resume"),
    ))
    from modeling_memoryformer.integrations.distributed import gloo_avg_is_mean

    avg_ok = gloo_avg_is_mean() if dist.is_initialized() else None
    if int(os.environ.get("RANK", "0")) == 0:
        with open(spec["result"], "w") as f:
            json.dump({
                "world_size": int(os.environ.get("WORLD_SIZE", "1")),
                "losses": {e["step"]: e["loss"] for e in result.log_history if "loss" in e},
                "grad_norms": {e["step"]: e["grad_norm"] for e in result.log_history if "grad_norm" in e},
                "eval_loss": result.eval_loss,
                "table_values_held": holdings.local, "table_values": holdings.full, "model_class": holdings.sharded,
                "fsdp_units": holdings.units,
                "gloo_avg_is_mean": avg_ok,
            }, f)


if __name__ == "__main__":
    main()
