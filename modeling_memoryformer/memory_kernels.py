"""Which kernels run the Memory Layer ops: the choice (MEMORYFORMER_KERNEL, `set_kernel`, `use_kernel`), the backend
for a tensor (`backend_for`), and the public status of the fused CPU kernel (`kernel_status`).

Kernels:
    "torch"  the PyTorch kernels (memory_backend_torch.py), called directly: any device, autograd as for any PyTorch
             code, nothing built.
    "fused"  the C++ CPU kernels (csrc/cpu/, built by memory_backend_cpu.py) behind the ops of
             torch.ops.memoryformer, for CPU tensors.
    "triton" the Triton kernels (memory_backend_triton.py) behind the ops of torch.ops.memoryformer_triton: CUDA
             tensors, or CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, for tests).
    "auto"   (default) "fused" on CPU tensors when the C++ builds here, else "torch"; "triton" on CUDA tensors when
             triton is installed, else "torch".
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .memory_backend_cpu import fused_error, fused_state, load_fused_kernels
from .memory_backend_torch import TORCH_BACKEND
from .memory_backend_triton import TRITON_BACKEND, triton_available
from .memory_op_library import OPS_NAMESPACE, namespace_ops

KERNELS = ("auto", "fused", "torch", "triton")
_kernel_choice = os.environ.get("MEMORYFORMER_KERNEL", "auto")


def available_kernels() -> list[str]:
    """Implementations that can run here: "torch" always, "fused" when the compiled CPU kernel loads."""
    return ["fused", "torch"] if load_fused_kernels() else ["torch"]


def get_kernel() -> str:
    """The implementation Memory Layers use now: "fused" or "torch" (resolves "auto")."""
    choice = _kernel_choice
    if choice not in KERNELS:
        raise ValueError(f"MEMORYFORMER_KERNEL={choice!r} is not supported; choose one of {', '.join(KERNELS)}.")
    if choice == "torch":
        return "torch"  # never builds nor loads the fused kernel
    if choice == "triton":
        if not triton_available():
            raise RuntimeError("MEMORYFORMER_KERNEL=triton needs triton: pip install triton (CUDA tensors, or CPU "
                               "tensors with TRITON_INTERPRET=1).")
        return "triton"
    if choice == "auto":
        return "fused" if "fused" in available_kernels() else "torch"
    if choice not in available_kernels():
        raise RuntimeError(f"The {choice!r} Memory Layer kernel is not available here; use 'torch' or 'auto'.")
    return choice


def set_kernel(name: str) -> None:
    """Force an implementation for this process: "auto" (default; also MEMORYFORMER_KERNEL), "fused", "torch" or
    "triton"."""
    global _kernel_choice
    if name not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {name!r}.")
    _kernel_choice = name
    get_kernel()


@contextlib.contextmanager
def use_kernel(name: str):
    """Context manager form of `set_kernel`."""
    global _kernel_choice
    previous = _kernel_choice
    set_kernel(name)
    try:
        yield
    finally:
        _kernel_choice = previous


def kernel_setting() -> str:
    """The kernel asked for: MEMORYFORMER_KERNEL, or what `set_kernel` / `use_kernel` set (one of KERNELS)."""
    return _kernel_choice


def uses_fused(tensor: torch.Tensor) -> bool:
    """Whether ops on `tensor` run the fused CPU kernels (building them the first time)."""
    if tensor.device.type != "cpu":
        return False
    if torch.compiler.is_compiling():  # no building or file checks while tracing: use what is already loaded
        return fused_state() is True and _kernel_choice in ("auto", "fused")
    return get_kernel() == "fused"


def fused_ops():
    """torch.ops.memoryformer: the ops, whose CPU kernels are the fused ones once `uses_fused` said so."""
    return namespace_ops(OPS_NAMESPACE)


# The ops' CPU kernels, called below their Python autograd registration: about 8 us less per call, most of a lookup
# of one token. For calls that record no gradient, and inside an autograd node of our own.
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def dispatcher_watched() -> bool:
    """Whether a call must enter the dispatcher at the top: something is being traced or profiled (the profiler names
    ops at the dispatcher's entry) or a Python dispatch mode (FakeTensorMode, FlopCounterMode, ...) would see it."""
    return (torch.compiler.is_compiling() or torch.autograd._profiler_enabled()
            or _get_current_dispatch_mode() is not None)


def fused_call(op, *args):
    """`op(*args)` (a fused op on CPU tensors), straight to its CPU kernel when no gradient is recorded and nothing
    watches the dispatcher (`dispatcher_watched`)."""
    if torch.is_grad_enabled() or dispatcher_watched():
        return op(*args)
    return op.default.redispatch(_CPU_KEYS, *args)


class _FusedBackend:
    """The fused CPU kernels with the interface of memory_backend_torch: `backend.lookup(...)` is
    `fused_call(torch.ops.memoryformer.lookup, ...)`."""

    name = "fused"

    def __getattr__(self, op_name: str):
        return functools.partial(fused_call, getattr(fused_ops(), op_name))


_FUSED = _FusedBackend()


def backend_for(tensor: torch.Tensor):
    """The kernels for ops on `tensor`: the Triton ones when asked for (or on CUDA when triton is installed), the
    fused CPU ones where they are in use, else the PyTorch ones (memory_backend_torch.TORCH_BACKEND). All take the
    ops' arguments (memory_op_library.OP_SCHEMAS) and return the same shapes and dtypes."""
    if _kernel_choice == "triton":
        if tensor.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("MEMORYFORMER_KERNEL=triton runs CPU tensors only under Triton's interpreter: set "
                               "TRITON_INTERPRET=1 before triton is imported (tests), or use a CUDA device.")
        return TRITON_BACKEND
    if tensor.device.type == "cuda" and _kernel_choice == "auto" and triton_available():
        return TRITON_BACKEND
    return _FUSED if uses_fused(tensor) else TORCH_BACKEND


def lookup_strategies() -> list[str]:
    """The fused kernel's forward strategies by name ("auto" picks one of them by shape), as the kernel lists them;
    empty without the fused kernel."""
    if not load_fused_kernels():
        return []
    return list(fused_ops().lookup_strategies())


def release_gradient_memory() -> int:
    """Free the idle blocks of the fused kernel's table-gradient pool; return the bytes freed (0 without the kernel).

    Table gradients are as large as the tables, so the fused backward hands them out from a pool of huge-page
    blocks that are reused once their tensor is freed (e.g. by `optimizer.zero_grad(set_to_none=True)`): fresh
    memory would cost more in page faults than the kernel that fills it. Blocks stay with the process after training;
    call this to give them back. `MEMORYFORMER_GRAD_POOL_MB` caps the pool (default 16384; 0 turns it off).
    """
    if fused_state() is not True:
        return 0
    return int(fused_ops().release_gradient_pool())


def cache_share_bytes() -> int:
    """A quarter of the last-level cache as the fused kernel reports it (at least 1 MB), else 8 MB: the working set a
    pass may keep in cache beside what else runs."""
    if fused_state():
        l3 = int(fused_ops().machine_info()[2])
        if l3 > 0:
            return max(1 << 20, l3 // 4)
    return 8 << 20


@dataclasses.dataclass(frozen=True)
class KernelStatus:
    """What runs the Memory Layer ops in this process.

    setting: the kernel asked for ("auto", "fused", "torch"); selected: what runs ("fused" or "torch"; None when the
    setting cannot be honoured, see `error`); fused_loaded: whether the C++ kernels are loaded; isa: their vector layer
    ("AVX512", "AVX2", "NEON", "DEFAULT"); march: the -march they were built for; unavailable_reason: why the fused
    kernel is not in use, when it is not.
    """

    setting: str
    selected: str | None
    error: str | None
    fused_loaded: bool
    isa: str | None
    march: str | None
    unavailable_reason: str | None


def kernel_status(load: bool = True) -> KernelStatus:
    """The status of the Memory Layer kernels here. `load` (default): try to build and load the fused kernel first,
    unless MEMORYFORMER_KERNEL=torch; a kernel that cannot be built is reported, not raised (the fallback warning is
    silenced: the reason is in the status), except for a malformed setting or MEMORYFORMER_REQUIRE_FUSED's error,
    which are reported as `error`."""
    import warnings

    error = None
    if load and _kernel_choice != "torch":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                load_fused_kernels()
            except (RuntimeError, ValueError) as exc:
                error = str(exc)
    try:
        selected = get_kernel() if (load or fused_state() is not None or _kernel_choice == "torch") \
            else None
    except (ValueError, RuntimeError) as exc:
        selected, error = None, error or str(exc)
    loaded = fused_state() is True
    reason = None
    if not loaded:
        reason = error or fused_error() or (
            "not loaded: MEMORYFORMER_KERNEL=torch" if _kernel_choice == "torch" else "not loaded yet")
    return KernelStatus(
        setting=_kernel_choice,
        selected=selected,
        error=error,
        fused_loaded=loaded,
        isa=str(fused_ops().isa()) if loaded else None,
        march=os.environ.get("MEMORYFORMER_KERNEL_MARCH", "native") if loaded else None,
        unavailable_reason=reason,
    )
