"""The Triton backend (memory_backend_triton.py): its kernels against the float64 reference (forward 1e-5 relative in
float32, gradients 1e-4), on a GPU when there is one, else on CPU tensors under Triton's interpreter (conftest.py sets
TRITON_INTERPRET=1 before triton is imported). triton is a dev dependency: without it this module fails, it does not
skip. The interpreter is slow: small shapes."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  (a missing triton fails here)

from modeling_memoryformer import memory_kernels, memory_ops
from modeling_memoryformer.memory_backend_triton import TRITON_NAMESPACE, triton_ops
from modeling_memoryformer.memory_layer import MemoryLayer
from modeling_memoryformer.memory_math import memory_lookup_reference, table_rows, hash_codes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # relative to the largest output
SHAPES = [(1, 4, 2, 8), (7, 3, 5, 13), (5, 8, 2, 130), (3, 16, 1, 4)]  # tokens, tau, tables, width


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def problem(tokens, tau, tables, width, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, tables * tau, generator=g).to(DEVICE, dtype).requires_grad_()
    t = torch.randn(tables << tau, width, generator=g).to(DEVICE, dtype).requires_grad_()
    b = torch.randn(width, generator=g).to(DEVICE, dtype).requires_grad_()
    return x, t, b


@pytest.mark.parametrize("shape", SHAPES, ids=[f"N{n}-tau{t}-K{k}-D{d}" for n, t, k, d in SHAPES])
@pytest.mark.parametrize("score", memory_ops.HASH_SCORES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_forward_equals_the_float64_reference(shape, score, dtype):
    tokens, tau, tables, width = shape
    x, t, b = problem(*shape, dtype)
    ops = triton_ops()
    rows, scores = ops.hash(x, tau, score, 0.7)
    assert torch.equal(rows, table_rows(hash_codes(x.detach(), tau), tau))
    y = ops.lookup(rows, scores, t, b, 1 << tau)
    assert y.dtype == dtype and y.shape == (tokens, width)
    want = memory_lookup_reference(x.detach().double(), t.detach().double(), b.detach().double(), tau, score, 0.7)
    assert relative(y, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("shape", SHAPES[1:3], ids=["odd", "two-column-blocks"])
@pytest.mark.parametrize("score", memory_ops.HASH_SCORES)
def test_gradients_equal_the_float64_reference(shape, score):
    tau = shape[1]
    x, t, b = problem(*shape, torch.float32, seed=1)
    ops = triton_ops()
    rows, scores = ops.hash(x, tau, score, 0.7)
    y = ops.lookup(rows, scores, t, b, 1 << tau)
    grads = torch.autograd.grad(y.square().sum(), (x, t, b))
    x64, t64, b64 = (v.detach().double().requires_grad_() for v in (x, t, b))
    want = torch.autograd.grad(memory_lookup_reference(x64, t64, b64, tau, score, 0.7).square().sum(), (x64, t64, b64))
    for got, expected in zip(grads, want, strict=True):
        assert relative(got, expected) < 1e-4


def test_the_memory_layer_runs_on_triton_when_asked():
    """MEMORYFORMER_KERNEL=triton (here use_kernel): a MemoryLayer's forward and backward go through the Triton
    ops, and equal the PyTorch kernels' to float32 precision."""
    torch.manual_seed(0)
    layer = MemoryLayer(24, 10, 4).to(DEVICE)
    x = torch.randn(2, 3, 24, device=DEVICE, requires_grad=True)
    with memory_kernels.use_kernel("torch"):
        want = layer(x)
        want_grads = torch.autograd.grad(want.square().sum(), (x, layer.tables))
    with memory_kernels.use_kernel("triton"):
        assert memory_kernels.get_kernel() == "triton" and memory_kernels.backend_for(x).name == "triton"
        got = layer(x)
        got_grads = torch.autograd.grad(got.square().sum(), (x, layer.tables))
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"{TRITON_NAMESPACE}::lookup", DEVICE.upper())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("op", ["hash", "lookup"])
def test_opcheck_triton_kernels(op):
    x, t, b = problem(3, 4, 2, 8, torch.float32)
    ops = triton_ops()
    if op == "hash":  # see test_op_library: opcheck's compiled-graph check cannot sum an int64 first output
        torch.library.opcheck(ops.hash, (x, 4, "l1", 0.7),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    else:
        rows, scores = ops.hash(x.detach(), 4, "paper", 1.0)
        torch.library.opcheck(ops.lookup, (rows, scores.requires_grad_(), t, b, 16))


def test_an_unknown_score_is_refused():
    with pytest.raises(ValueError, match="is not supported"):
        triton_ops().hash(torch.randn(2, 8, device=DEVICE), 4, "cosine", 1.0)


def lookups(tokens: int, tau: int, tables: int, hot: bool, seed: int = 0):
    """rows [N, K] into K tables of 2**tau rows; `hot`: every token hits row 0 of each table (a hot row)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.zeros(tokens, tables, dtype=torch.long) if hot else torch.randint(0, 1 << tau, (tokens, tables),
                                                                                     generator=g)
    return (codes + torch.arange(tables) * (1 << tau)).to(DEVICE)


@pytest.mark.parametrize("hot", [False, True], ids=["spread", "hot-row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_lookup_backward_equals_the_pytorch_kernel_without_atomics(hot, dtype):
    """The table gradient (lookups sorted by row, each row written once) and the score gradient, dense and as the
    rows hit, equal the PyTorch kernel's; a hot row (hit by every token) too."""
    from modeling_memoryformer.memory_backend_torch import TORCH_BACKEND

    g = torch.Generator().manual_seed(2)
    rows = lookups(9, 4, 3, hot)
    scores = torch.rand(9, 3, generator=g).to(DEVICE)
    tables = torch.randn(3 << 4, 130, generator=g).to(DEVICE, dtype)
    grad = torch.randn(9, 130, generator=g).to(DEVICE, dtype)
    ops = triton_ops()
    got = ops.lookup_backward(grad, rows, scores, tables, 16, True, True)
    want = TORCH_BACKEND.lookup_backward(grad, rows, scores, tables, 16, True, True)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and relative(a, b) < tolerance
    scores_rows, hit, values = ops.lookup_backward_rows(grad, rows, scores, tables, 16, True)
    want_scores, want_hit, want_values = TORCH_BACKEND.lookup_backward_rows(grad, rows, scores, tables, 16, True)
    assert torch.equal(hit, want_hit) and relative(values, want_values) < tolerance
    assert relative(scores_rows, want_scores) < tolerance


@pytest.mark.parametrize("score", memory_ops.HASH_SCORES)
def test_hash_backward_equals_the_float64_formula(score):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 3 * 5, generator=g).to(DEVICE)
    grad_scores = torch.randn(6, 3, generator=g).to(DEVICE)
    got = triton_ops().hash_backward(grad_scores, x, 5, score, 0.6)
    x64 = x.double().requires_grad_()
    (want,) = torch.autograd.grad(memory_ops.hash_scores(x64, 5, score, 0.6), x64, grad_scores.double())
    assert relative(got, want) < 1e-5


def test_int8_reads_equal_dequantise_then_gather():
    from modeling_memoryformer.quantization import dequantize_int8, int8_views, quantize_int8_rows

    g = torch.Generator().manual_seed(4)
    tables = torch.randn(3 << 4, 40, generator=g)
    packed = quantize_int8_rows(tables)
    codes, scale, offset = int8_views(packed)
    packed = packed.to(DEVICE)
    rows = lookups(5, 4, 3, hot=False)
    scores = torch.rand(5, 3, generator=g).to(DEVICE)
    bias = torch.randn(40, generator=g).to(DEVICE)
    got = triton_ops().int8_lookup(rows, scores, packed, bias, 16)
    dequantised = dequantize_int8(codes, scale, offset).to(DEVICE)
    want = (scores.unsqueeze(-1) * dequantised[rows]).sum(1) + bias
    assert got.dtype == torch.float32 and relative(got, want) < 1e-6


@pytest.mark.parametrize("rule", ["rowwise_adagrad_step", "adam_rowwise_step"])
def test_the_fused_row_wise_updates_equal_their_formula(rule):
    from modeling_memoryformer.memory_backend_torch import TORCH_BACKEND

    g = torch.Generator().manual_seed(5)
    weight = torch.randn(20, 37, generator=g).to(DEVICE)
    grad = torch.randn(20, 37, generator=g).to(DEVICE)
    if rule == "rowwise_adagrad_step":
        states = (torch.rand(20, generator=g).to(DEVICE),)
        args = (0.05, 1e-8, 0.01)
    else:
        states = (torch.randn(20, 37, generator=g).to(DEVICE), torch.rand(20, generator=g).to(DEVICE))
        args = (3, 0.05, 0.9, 0.999, 1e-8, 0.01)
    ours = [weight.clone(), grad, *(s.clone() for s in states)]
    theirs = [weight.clone(), grad, *(s.clone() for s in states)]
    getattr(triton_ops(), rule)(*ours, *args)
    getattr(TORCH_BACKEND, rule)(*theirs, *args)
    for a, b in zip(ours, theirs, strict=True):
        assert relative(a, b) < 1e-6
    assert not torch.equal(ours[0], weight)  # the weight did change


@pytest.mark.parametrize("score", memory_ops.HASH_SCORES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_fused_forward_hashes_scores_and_gathers_in_one_kernel(score, dtype):
    """memory_lookup on the Triton backend takes the one-kernel forward (FusedMemoryLookup); output and gradients
    equal the float64 reference."""
    from modeling_memoryformer.memory_backend_triton import FusedMemoryLookup

    x, t, b = problem(5, 5, 3, 37, dtype, seed=6)
    calls = []
    original = FusedMemoryLookup.forward

    def counting(ctx, *args):
        calls.append(1)
        return original(ctx, *args)

    FusedMemoryLookup.forward = staticmethod(counting)
    try:
        with memory_kernels.use_kernel("triton"):
            y = memory_ops.memory_lookup(x.unsqueeze(0), t, b, 5, score, 0.8)[0]
    finally:
        FusedMemoryLookup.forward = staticmethod(original)
    assert calls == [1] and y.dtype == dtype
    grads = torch.autograd.grad(y.float().square().sum(), (x, t, b))
    x64, t64, b64 = (v.detach().double().requires_grad_() for v in (x, t, b))
    want = memory_lookup_reference(x64, t64, b64, 5, score, 0.8)
    want_grads = torch.autograd.grad(want.square().sum(), (x64, t64, b64))
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert relative(y, want) < tolerance
    for got, expected in zip(grads, want_grads, strict=True):
        assert relative(got, expected) < (1e-4 if dtype == torch.float32 else 3e-2)


COMPILED_DECODE = """
import torch
from modeling_memoryformer import MemoryFormerConfig, MemoryFormerForCausalLM, compiled_decode_kwargs
from modeling_memoryformer.memory_kernels import backend_for
device = "cuda" if torch.cuda.is_available() else "cpu"
config = MemoryFormerConfig.from_preset("tiny", num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                                        vocab_size=256)
torch.manual_seed(0)
model = MemoryFormerForCausalLM(config).to(device).eval()
model.generation_config.eos_token_id = None
assert backend_for(model.model.layers[0].attention.query_key_value.tables).name == "triton"
ids = torch.randint(0, 255, (2, 8), device=device)
with torch.inference_mode():
    eager = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    compiled = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, **compiled_decode_kwargs(device))
assert compiled.shape == (2, 14), compiled.shape
assert torch.equal(eager, compiled), (eager.tolist(), compiled.tolist())
print("same tokens")
"""


@pytest.mark.slow
def test_generate_compiles_its_decode_step_on_the_triton_kernels(tmp_path):
    """`generate` with `compiled_decode_kwargs` on the Triton backend, in a fresh process (the ops must exist before
    torch.compile traces the first Memory Layer call: a GPU's compiled decode step failed in Dynamo when they were
    defined on first use): the compiled step gives the eager step's greedy tokens (CUDA graphs on a GPU; Inductor
    over Triton's interpreter here)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "compiled_decode.py"
    script.write_text(COMPILED_DECODE)
    env = {**os.environ, "MEMORYFORMER_KERNEL": "triton", "TRITON_INTERPRET": "0" if DEVICE == "cuda" else "1"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900,
                            cwd=root, check=False)
    assert result.returncode == 0 and "same tokens" in result.stdout, result.stderr[-3000:]


def test_a_second_copy_of_the_module_keeps_the_first_kernels_without_a_warning():
    """The ops are defined at import; a saved model's remote code is a second copy of this module in the same process.
    Its import checks the schemas and leaves the kernels registered: registering them again warned ("Overriding a
    previously registered kernel") at every such import."""
    import warnings

    from modeling_memoryformer.memory_backend_triton import _define_triton_ops

    before = triton_ops().hash
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _define_triton_ops()
    assert triton_ops().hash is before
    x = torch.randn(3, 8, device=DEVICE)
    rows, scores = triton_ops().hash(x, 4, "paper", 1.0)
    want_rows, want_scores = memory_kernels.TORCH_BACKEND.hash(x, 4, "paper", 1.0)
    assert torch.equal(rows, want_rows) and torch.allclose(scores, want_scores, rtol=1e-5, atol=1e-6)
