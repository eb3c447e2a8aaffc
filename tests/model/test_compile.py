"""torch.compile traces the Memory Layer through the custom op's fake implementation."""

import pytest
import torch

from conftest import require_kernel
from modeling_memoryformer import MemoryLayer, memory_ops


@pytest.mark.parametrize("kernel", ["fused", "torch"])
def test_compiled_memory_layer_matches_eager_output_and_gradients(kernel):
    require_kernel(kernel)  # a skip, or a failure under MEMORYFORMER_REQUIRE_FUSED=1
    torch.manual_seed(0)
    layer = MemoryLayer(64, 32, 8)
    x = torch.randn(5, 64, requires_grad=True)
    with memory_ops.use_kernel(kernel):
        eager = layer(x)
        (grad_eager,) = torch.autograd.grad(eager.square().sum(), x)
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        out = compiled(x)
        (grad_compiled,) = torch.autograd.grad(out.square().sum(), x)
    torch._dynamo.reset()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    torch.testing.assert_close(grad_compiled, grad_eager, rtol=1e-6, atol=1e-7)
