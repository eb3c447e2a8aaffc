"""Worker of test_distributed.py::test_ddp_matches_single_process: trains the tiny MemoryFormer on synthetic data
with `memoryformer`'s Trainer setup and writes the per-step losses (rank 0) to argv[2] as JSON.

    python tests/tools/_ddp_worker.py OUT_DIR LOSSES_JSON PER_DEVICE_BATCH [TABLE_OPTIMIZER]             (one process)
    torchrun --nproc_per_node 2 tests/tools/_ddp_worker.py OUT_DIR LOSSES_JSON BATCH [TABLE_OPTIMIZER] (DDP over gloo)
"""

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # _training_data beside this file, conftest in tests/

from _training_data import synthetic_lm_data
from conftest import tiny_model

from modeling_memoryformer.training.trainer import TrainingSettings, train


def main() -> None:
    out, losses_path, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
    table_optimizer = sys.argv[4] if len(sys.argv) > 4 else "adamw"
    torch.set_num_threads(1)
    model = tiny_model(seed=0, table_init_std=0.02, initializer_range=0.02).train()
    result = train(model, synthetic_lm_data(), TrainingSettings(
        output_dir=out, max_steps=6, per_device_batch_size=batch, logging_steps=1, eval_steps=6, report_to="none",
        learning_rate=3e-3, warmup_ratio=0.0, progress=False, save_final_model=False, table_optimizer=table_optimizer,
    ))
    if int(os.environ.get("RANK", "0")) == 0:
        losses = [entry["loss"] for entry in result.log_history if "loss" in entry]
        grad_norms = {entry["step"]: entry["grad_norm"] for entry in result.log_history if "grad_norm" in entry}
        world = int(os.environ.get("WORLD_SIZE", "1"))
        with open(losses_path, "w") as f:
            json.dump({"losses": losses, "grad_norms": grad_norms, "eval_loss": result.eval_loss, "world_size": world}, f)


if __name__ == "__main__":
    main()
