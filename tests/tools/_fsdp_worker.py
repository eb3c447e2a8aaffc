"""Worker for tests/tools/test_distributed.py: FSDP2 over 2 CPU ranks vs one process, same global batch."""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from modeling_memoryformer import MemoryFormerConfig, MemoryFormerForCausalLM
from modeling_memoryformer.integrations.distributed import shard_model


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = MemoryFormerConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                hash_bits=4)
    model = MemoryFormerForCausalLM(config).double()
    reference = MemoryFormerForCausalLM(config).double()
    reference.load_state_dict(model.state_dict())
    shard_model(model)
    ids = torch.randint(0, 128, (2 * world, 16), generator=torch.Generator().manual_seed(1))
    local = ids[2 * rank: 2 * rank + 2]
    model(local, labels=local).loss.backward()  # FSDP averages gradients over ranks
    reference(ids, labels=ids).loss.backward()
    result = {"rank": rank, "max_grad_diff": 0.0, "sharded_tables": []}
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        result["max_grad_diff"] = max(result["max_grad_diff"], float((grad - q.grad).abs().max()))
        if name.endswith("tables"):
            result["sharded_tables"].append([name, list(p.to_local().shape), list(q.shape)])
    if rank == 0:
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
