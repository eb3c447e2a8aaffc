"""Data-parallel training over two CPU processes (gloo) matches one process at the same global batch.

`torchrun --nproc_per_node 2` starts two ranks of the training API (`tests/tools/_ddp_worker.py`); the Trainer wraps the model in DDP and
each rank sees half of every global batch. With the same seed and data order the per-step losses (gathered over
ranks by the Trainer) must equal the single-process losses up to float32 reduction order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _free_port() -> str:
    """A free TCP port for torchrun's rendezvous (port 0 does not work there: each rank would pick its own)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


# Launchers that start 2 ranks on CPU. accelerate 1.15's `accelerate launch --cpu --num_processes 2` starts ONE
# process (its CPU path is the simple launcher; multi-CPU needs mpirun); `--multi_gpu` on a machine without GPUs runs
# torch.distributed.run, and the Trainer then uses gloo on the CPU.
LAUNCHERS = {
    "torchrun": lambda port: [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                              "--master_port", port],
    "accelerate": lambda port: [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                                "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                                "--dynamo_backend", "no", "--main_process_port", port],
}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_ddp_matches_single_process(tmp_path, launcher):
    """2 processes (gloo) at 2 sequences each = one process at 4: the same global batches, so the same losses up to
    float rounding of the gradient all-reduce."""
    here = os.path.dirname(os.path.abspath(__file__))
    worker = os.path.join(here, "_ddp_worker.py")
    tests, repo = os.path.dirname(here), os.path.dirname(os.path.dirname(here))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([here, tests, repo])}
    subprocess.run([sys.executable, worker, str(tmp_path / "one"), str(tmp_path / "one.json"), "4"],
                   check=True, env=env, timeout=600)
    subprocess.run([*LAUNCHERS[launcher](_free_port()), worker, str(tmp_path / "two"), str(tmp_path / "two.json"),
                    "2"], check=True, env=env, timeout=600)
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert one["world_size"] == 1 and two["world_size"] == 2
    assert len(one["losses"]) == len(two["losses"]) == 6
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-4)
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-4)
    # the gradients themselves, not only the losses: AdamW with clipping would hide gradients twice too large
    assert list(two["grad_norms"].values()) == pytest.approx(list(one["grad_norms"].values()), rel=1e-4)


@pytest.mark.slow
def test_ddp_with_a_table_rule_matches_single_process(tmp_path):
    """`--table-optimizer adam_rowwise` on 2 DDP ranks: the tables are kept out of DDP and each hook averages its
    table's gradient over the ranks before the row-wise update, so the run equals one process at the same global
    batch (and differs from AdamW on the tables: the rule ran)."""
    here = os.path.dirname(os.path.abspath(__file__))
    worker = os.path.join(here, "_ddp_worker.py")
    tests, repo = os.path.dirname(here), os.path.dirname(os.path.dirname(here))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([here, tests, repo])}
    subprocess.run([sys.executable, worker, str(tmp_path / "one"), str(tmp_path / "one.json"), "4", "adam_rowwise"],
                   check=True, env=env, timeout=600)
    subprocess.run([*LAUNCHERS["torchrun"](_free_port()), worker, str(tmp_path / "two"), str(tmp_path / "two.json"),
                    "2", "adam_rowwise"], check=True, env=env, timeout=600)
    subprocess.run([sys.executable, worker, str(tmp_path / "adamw"), str(tmp_path / "adamw.json"), "4"],
                   check=True, env=env, timeout=600)
    one, two, adamw = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two", "adamw"))
    assert two["world_size"] == 2 and len(two["losses"]) == 6
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-4)
    assert list(two["grad_norms"].values()) == pytest.approx(list(one["grad_norms"].values()), rel=1e-4)
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-4)
    assert one["losses"][1:] != pytest.approx(adamw["losses"][1:], rel=1e-3)


@pytest.mark.slow
def test_fsdp2_sharded_tables_give_the_single_process_gradients(tmp_path):
    """`shard_model` (FSDP2 by `_no_split_modules`) over 2 gloo ranks: every table is split in half across ranks and
    the gradients, gathered, equal a single float64 model's on the whole batch."""
    out = tmp_path / "fsdp.json"
    worker = os.path.join(os.path.dirname(__file__), "_fsdp_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", _free_port(), worker, str(out)],
        check=False, capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["max_grad_diff"] < 1e-12
    assert len(result["sharded_tables"]) == 6
    for name, local, full in result["sharded_tables"]:
        assert local == [full[0] // 2, full[1]], name


def test_shard_model_without_process_group_says_how_to_launch():
    from modeling_memoryformer import MemoryFormerConfig, MemoryFormerForCausalLM
    from modeling_memoryformer.integrations.distributed import shard_model

    model = MemoryFormerForCausalLM(
        MemoryFormerConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, hash_bits=4)
    )
    with pytest.raises(RuntimeError, match="torchrun"):
        shard_model(model)


# ----------------------------------------------------------------------------------------------------------------------
# FSDP2 through the training API (TrainingSettings(fsdp=True), the Trainer, accelerate's FSDP plugin on CPU)


def _run_fsdp_worker(tmp_path, name: str, ranks: int, launcher: list[str] | None = None, **spec) -> dict:
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fsdp_train_worker.py")
    spec = {"out": str(tmp_path / name), "result": str(tmp_path / f"{name}.json"), **spec}
    (tmp_path / f"{name}.spec.json").write_text(json.dumps(spec))
    if launcher is None:
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
                     _free_port()] if ranks > 1 else [sys.executable])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([*launcher, worker, str(tmp_path / f"{name}.spec.json")], check=False, capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(open(spec["result"]).read())


@pytest.mark.slow
def test_fsdp_training_matches_one_process_shards_the_tables_and_resumes_exactly(tmp_path):
    """`TrainingSettings(fsdp=True)` on 2 gloo ranks at 2 sequences each = one process at 4 (float32, relative 1e-4
    per step); each rank holds half of every table; the final model, saved whole, loads with from_pretrained in
    one process and equals the single-process one; a run resumed from the sharded checkpoint at step 3 continues the
    uninterrupted losses exactly, also when gloo's AVG returns the sum (the reported bug, simulated)."""
    import torch
    from transformers import AutoModelForCausalLM

    from conftest import tiny_model

    start = tmp_path / "start"
    tiny_model(seed=0, table_init_std=0.02, initializer_range=0.02).save_pretrained(start)  # a one-process model
    common = {"model": str(start), "max_steps": 6}
    one = _run_fsdp_worker(tmp_path, "one", 1, batch=4, fsdp=False, **common)
    two = _run_fsdp_worker(tmp_path, "two", 2, batch=2, fsdp=True, save_steps=3, **common)

    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert list(two["losses"]) == [str(step) for step in range(1, 7)]
    assert list(two["losses"].values()) == pytest.approx(list(one["losses"].values()), rel=1e-4)
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-4)
    # the gradients themselves, not only the losses: AdamW with clipping would hide gradients twice too large
    assert list(two["grad_norms"].values()) == pytest.approx(list(one["grad_norms"].values()), rel=1e-4)
    assert two["model_class"].startswith("FSDP") and one["model_class"] == "MemoryFormerForCausalLM"
    assert two["table_values_held"] == two["table_values"] // 2 and one["table_values_held"] == one["table_values"]

    sharded, single = (AutoModelForCausalLM.from_pretrained(tmp_path / n) for n in ("two", "one"))
    for (name, a), (_, b) in zip(sharded.state_dict().items(), single.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)

    resumed = _run_fsdp_worker(tmp_path, "two", 2, batch=2, fsdp=True, resume=str(tmp_path / "two" / "checkpoint-3"),
                               broken_avg=True, result=str(tmp_path / "resumed.json"), **common)
    assert list(resumed["losses"]) == [str(step) for step in range(1, 7)]  # 1-3 from the checkpoint's log history
    assert [resumed["losses"][s] for s in "456"] == [two["losses"][s] for s in "456"]  # bit for bit
    # with gloo's AVG returning the sum, FSDP's own AVG reduce-scatter would double every gradient (grad norm 2x);
    # the training reduces with SUM and divides, so the resumed run's gradients are the uninterrupted run's
    assert [resumed["grad_norms"][s] for s in "456"] == [two["grad_norms"][s] for s in "456"]
    assert resumed["gloo_avg_is_mean"] is False and two["gloo_avg_is_mean"] in (True, False)


def test_fsdp_with_a_table_optimizer_is_refused_with_the_reason(tmp_path):
    from modeling_memoryformer.training.settings import TrainingSettings

    with pytest.raises(ValueError, match="do not compose.*table_optimizer='adamw'"):
        TrainingSettings(output_dir=str(tmp_path / "run"), fsdp=True, table_optimizer="rowwise_adagrad")


@pytest.mark.slow
def test_accelerate_launch_use_fsdp_shards_on_cpu_and_saves_a_loadable_model(tmp_path):
    """`accelerate launch --use_fsdp --fsdp_version 2` (its FSDP_* variables, no fsdp in the settings): the Trainer
    shards on CPU (accelerate alone would train DDP), one FSDP unit per decoder layer, and the final model is written
    whole although accelerate's default state dict for FSDP2 is sharded."""
    from transformers import AutoModelForCausalLM

    from conftest import tiny_model

    start = tmp_path / "start"
    tiny_model(seed=0).save_pretrained(start)
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
                "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", _free_port(),
                "--use_fsdp", "--fsdp_version", "2"]
    result = _run_fsdp_worker(tmp_path, "acc", 2, launcher=launcher, batch=2, fsdp=False, model=str(start),
                              max_steps=2)
    assert result["world_size"] == 2 and result["model_class"].startswith("FSDP")
    assert result["table_values_held"] == result["table_values"] // 2
    layers = tiny_model().config.num_hidden_layers
    assert {"root", *(f"model.layers.{i}" for i in range(layers))} <= set(result["fsdp_units"])  # one per layer
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "acc")
    assert sum(p.numel() for n, p in saved.named_parameters() if n.endswith("tables")) == result["table_values"]
