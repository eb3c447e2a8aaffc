"""`memoryformer generate`: build a preset with random weights, run a forward and a short greedy generation, and
print the FLOPs / memory comparison against its Pythia twin (its options: evaluation.settings.GenerateSettings)."""

from __future__ import annotations

import time

from .settings import GenerateSettings, StorageSettings


def run_generate(settings: GenerateSettings, storage: StorageSettings | None = None) -> int:
    """Build a preset, run a forward and a short greedy generation, print the FLOPs/memory comparison."""
    import torch

    from .. import MemoryFormerConfig, MemoryFormerForCausalLM
    from .flops import comparison_table, layer_memory_table
    from .kernel_report import run_facts, run_facts_line

    print(run_facts_line(run_facts()))  # loads (builds) the kernel first: not inside any timing below
    torch.manual_seed(settings.seed)
    overrides = {} if settings.layers is None else {"num_hidden_layers": settings.layers}
    config = MemoryFormerConfig.from_preset(settings.preset, **overrides)
    tokenizer = None
    if settings.tokenizer:  # before the model is built: a wrong path fails at once, with the fix
        from ..training.data import load_tokenizer

        tokenizer = load_tokenizer(settings.tokenizer, hint="Pass --tokenizer a tokenizer folder (with tokenizer.json) "
                                   "or a Hub id, or leave it out to prompt with random token ids.", pad_with_eos=False)
    print(f"Building MF-{settings.preset} (random init): {config.num_hidden_layers} layers, d={config.hidden_size}, "
          f"heads={config.num_attention_heads}, tau={config.hash_bits}, K={config.num_tables}, e={config.expand_bits}")
    start = time.perf_counter()
    model = MemoryFormerForCausalLM(config).eval()
    n_params = sum(p.numel() for p in model.parameters())
    n_tables = sum(p.numel() for name, p in model.named_parameters() if name.endswith("tables"))
    print(f"  built in {time.perf_counter() - start:.1f} s: {n_params / 1e6:.1f} M parameters, "
          f"{n_tables / 1e6:.1f} M of them in hash tables")
    if storage is not None and storage.requested:
        storage.apply(model)
        size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        print(f"  stored for inference: {storage.describe()}; {size / 1e6:.0f} MB of weights")

    if tokenizer is not None:
        prompt = tokenizer(settings.prompt, return_tensors="pt").input_ids
    else:
        prompt = torch.randint(0, config.vocab_size, (1, 16))
    with torch.inference_mode():
        start = time.perf_counter()
        logits = model(prompt).logits
        forward_s = time.perf_counter() - start
        start = time.perf_counter()
        generated = model.generate(prompt, max_new_tokens=settings.new_tokens, do_sample=False, pad_token_id=0)
        generate_s = time.perf_counter() - start
    print(f"  forward of {prompt.shape[1]} tokens: logits {tuple(logits.shape)} in {forward_s * 1e3:.0f} ms")
    new_tokens = generated[0, prompt.shape[1]:]
    shown = tokenizer.decode(new_tokens) if tokenizer else new_tokens.tolist()
    print(f"  greedy generation of {settings.new_tokens} tokens in {generate_s:.2f} s "
          f"({settings.new_tokens / generate_s:.1f} tokens/s, untrained weights): {shown!r}")
    print("\nFLOPs and memory per block against the Pythia twin (paper Table 1 counting, fp16 tables):\n")
    print(comparison_table({settings.preset: config}, settings.seq_len))
    print()
    print(layer_memory_table(config))
    return 0
