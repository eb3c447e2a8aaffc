"""Shared fixtures: tiny MemoryFormer configs and models that build in milliseconds on CPU.

The tiny shape (vocab 128, d 64, 2 layers, 4 heads, tau 4 -> K 16) keeps every test fast. The hash tables are
initialised with a larger std than the paper's 0.02 so that attention is far from uniform and logits have clear
argmax gaps: tests that compare two code paths then exercise real structure, and greedy decoding is not decided by
float noise.

Two tiers: a test that takes seconds on 2 cores (a README or notebook run, a kernel build or cross-compile, a
distributed or subprocess run, training end to end) is marked `@pytest.mark.slow`, or the whole module is with
`pytestmark = pytest.mark.slow` when a module-scoped fixture is the cost. `make test-fast` (`-m "not slow"`) leaves
those out for the edit-test loop; `make test` runs everything.
"""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU the Triton backend's tests (tests/kernel/test_triton_backend.py) run its kernels on CPU tensors under
# Triton's interpreter. The variable must be set before triton is imported, and importing the model imports it
# (through transformers), so it is set here, first; with a GPU the same tests run on it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import modeling_memoryformer  # noqa: F401  (registers the Auto classes)
from modeling_memoryformer import MemoryFormerConfig, MemoryFormerForCausalLM
from modeling_memoryformer import memory_ops


TINY = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    hash_bits=4,
    expand_bits=2,
    table_init_std=0.5,
    initializer_range=0.5,
    bos_token_id=None,
    eos_token_id=None,  # no early stop: generation tests compare a fixed number of new tokens
    pad_token_id=0,
)


def tiny_config(**overrides) -> MemoryFormerConfig:
    """A tiny MemoryFormerConfig; keyword arguments override TINY."""
    return MemoryFormerConfig(**{**TINY, **overrides})


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> MemoryFormerForCausalLM:
    """A seeded tiny MemoryFormerForCausalLM in eval mode."""
    torch.manual_seed(seed)
    model = MemoryFormerForCausalLM(tiny_config(**overrides)).eval()
    return model.to(dtype)


def checkpointing_enable(model, use_reentrant: bool | None = None) -> None:
    """`activation_checkpointing_enable` (transformers 5.23+), or the `gradient_checkpointing_enable` it renamed."""
    options = None if use_reentrant is None else {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


def checkpointing_disable(model) -> None:
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def checkpointing_enabled(model) -> bool:
    if hasattr(type(model), "is_activation_checkpointing"):
        return model.is_activation_checkpointing
    return model.is_gradient_checkpointing


@pytest.fixture
def model():
    return tiny_model()


@pytest.fixture
def input_ids():
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(3, TINY["vocab_size"], (2, 11), generator=generator)


def require_kernel(name: str) -> None:
    """Skip the calling test when the Memory Layer kernel `name` is not available here; with
    MEMORYFORMER_REQUIRE_FUSED=1 (as `make test` runs) fail instead: no silent skips of the fused kernel."""
    if name == "torch":
        return  # always there, and asking must not build the fused kernel
    if name == "triton":  # a dev dependency; without a GPU its kernels run under the interpreter (set above)
        import triton  # noqa: F401  (missing: an error, not a skip)

        return
    if name not in memory_ops.available_kernels():  # under MEMORYFORMER_REQUIRE_FUSED=1 this raises the build error
        if memory_ops.fused_required():
            pytest.fail(f"the {name!r} Memory Layer kernel is not available and MEMORYFORMER_REQUIRE_FUSED=1")
        pytest.skip(f"the {name!r} Memory Layer kernel is not available in this environment")


@pytest.fixture(params=["fused", "torch"])
def kernel(request):
    """Every concrete Memory Layer implementation ("fused", "torch"); the ones not built here are skipped (an error
    under MEMORYFORMER_REQUIRE_FUSED=1)."""
    name = request.param
    require_kernel(name)
    with memory_ops.use_kernel(name):
        yield name
