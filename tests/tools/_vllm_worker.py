"""Runs inside the vLLM venv (scripts/vllm_venv.sh), started by tests/tools/test_vllm.py: greedy generation of a saved
MemoryFormer folder through vLLM's offline `LLM` API and its Transformers backend.

    python _vllm_worker.py SPEC.json

SPEC: {"folders": [...], "prompts": [[token ids], ...], "max_tokens": N}. One engine per folder, one after the
other. Prints one line `RESULT [json, ...]`, one entry per folder: the generated token ids of each prompt, and what
vLLM built (its model class, the Transformers class inside it and the module that class came from, the classes of
the Memory Layers, the embedding and the norms, the attention implementation).

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni" executor): the same model code and
forward as the default engine and worker processes, without two more interpreters to start (about a minute on 2
cores). The test of `vllm serve` runs the default, multi-process layout. The `__main__` guard is what vLLM's spawned
processes need in any script that builds an engine.
"""

from __future__ import annotations

import json
import os
import sys


def qualified(module) -> str:
    return f"{type(module).__module__}.{type(module).__name__}"


def describe(model) -> dict:
    """What vLLM built around the MemoryFormer code (runs in vLLM's worker, here this process)."""
    inner = model.model  # the Transformers base model (AutoModel of the folder: MemoryFormerModel)
    layer = inner.layers[0]
    return {
        "vllm_class": type(model).__name__,
        "model_class": type(inner).__name__,
        "model_module": type(inner).__module__,
        "qkv_class": type(layer.attention.query_key_value).__name__,
        "memory_block_classes": [type(layer.memory_block.layer1).__name__, type(layer.memory_block.layer2).__name__],
        "embedding_class": qualified(inner.embed_tokens),
        "norm_classes": [qualified(layer.input_layernorm), qualified(layer.memory_block.norm), qualified(inner.norm)],
        "attention_implementation": inner.config._attn_implementation,
        "vllm_attention_class": type(getattr(layer.attention, "attn", None)).__name__,
    }


def generate(folder: str, prompts: list[list[int]], max_tokens: int) -> dict:
    import gc

    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=folder,
        model_impl="transformers",
        trust_remote_code=True,
        dtype="float32",
        skip_tokenizer_init=True,  # token-id prompts: the folder's tokenizer is not needed
        max_model_len=128,
        kv_cache_memory_bytes=1 << 30,  # vLLM's CPU default asks for 92% of the RAM
        enforce_eager=True,  # torch.compile would add about 25 s to each start on 2 cores (same tokens)
        distributed_executor_backend="uni",
        seed=0,
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
    (built,) = llm.apply_model(describe)
    result = {"tokens": [list(output.outputs[0].token_ids) for output in outputs], "built": built}
    del llm, outputs
    cleanup_dist_env_and_memory()  # what vLLM's own tests call between two engines in one process
    gc.collect()
    return result


def main() -> None:
    spec = json.loads(open(sys.argv[1], encoding="utf-8").read())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    results = [generate(folder, spec["prompts"], spec["max_tokens"]) for folder in spec["folders"]]
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
