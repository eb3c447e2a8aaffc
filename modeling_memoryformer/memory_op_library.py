"""The Memory Layer's ops, defined once with `torch.library`: schemas, fake (meta) implementations, autograd, and the
PyTorch kernels of memory_backend_torch.py as every device's default.

    torch.ops.memoryformer.hash(x, hash_bits, score, temperature) -> (rows, scores)
    torch.ops.memoryformer.lookup(rows, scores, tables, bias, rows_per_table) -> y
    ... (OP_SCHEMAS below)

Backends add kernels for their device to these ops: the fused CPU kernel (memory_backend_cpu.py builds the C++ of
csrc/cpu/, which registers CPU implementations with TORCH_LIBRARY_IMPL when it is loaded). The model calls a backend
through memory_kernels.py, which picks it by device and by the kernel choice (MEMORYFORMER_KERNEL).

`define_ops(namespace)` defines the set in a namespace: "memoryformer" at import, and one per kernel build for
another -march (memory_backend_cpu.build_kernel_variant). Two copies of this module in one process (the installed
package and a model folder's remote code) define the ops once: the second finds them and checks that their schemas
are the same.
"""

from __future__ import annotations

import torch

from .memory_backend_torch import TORCH_BACKEND
from .memory_math import acc_dtype

OPS_NAMESPACE = "memoryformer"

OP_SCHEMAS = {
    # The Memory Layer: hashing and scoring, the weighted gather, and their gradients.
    "hash": "(Tensor x, int hash_bits, str score, float temperature) -> (Tensor, Tensor)",
    "hash_backward": "(Tensor grad_scores, Tensor x, int hash_bits, str score, float temperature) -> Tensor",
    "lookup": "(Tensor rows, Tensor scores, Tensor tables, Tensor? bias, int rows_per_table) -> Tensor",
    "lookup_backward": "(Tensor grad_out, Tensor rows, Tensor scores, Tensor tables, int rows_per_table, "
                       "bool need_tables, bool need_scores) -> (Tensor, Tensor)",
    "lookup_backward_rows": "(Tensor grad_out, Tensor rows, Tensor scores, Tensor tables, int rows_per_table, "
                            "bool need_scores) -> (Tensor, Tensor, Tensor)",
    # Inference forms: int8 tables (FBGEMM's row-wise layout) and the LM head for a few tokens.
    "int8_lookup": "(Tensor rows, Tensor scores, Tensor packed, Tensor? bias, int rows_per_table) -> Tensor",
    "linear_rows": "(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    "argmax_rows": "(Tensor x) -> Tensor",  # a greedy step's token from the logits: torch.argmax(x, -1)
    "linear_rows_argmax": "(Tensor x, Tensor weight, Tensor? bias) -> (Tensor, Tensor)",  # both in one pass
    # Attention of one query position per sequence over its KV cache (a decode step).
    "decode_attention": "(Tensor q, Tensor k, Tensor v, Tensor? mask, float scaling) -> Tensor",
    # The decode ops' layer norm over the last dimension: torch.layer_norm's values (csrc/cpu/layer_norm.h).
    "decode_layer_norm": "(Tensor x, Tensor? weight, Tensor? bias, float eps, str path=\"auto\") -> Tensor",
    # The row-wise table optimizers' steps, in place.
    "rowwise_adagrad_step": "(Tensor(a!) weight, Tensor grad, Tensor(b!) state_sum, float lr, float eps, "
                            "float weight_decay) -> ()",
    "adam_rowwise_step": "(Tensor(a!) weight, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, int step, "
                         "float lr, float beta1, float beta2, float eps, float weight_decay) -> ()",
    # The fused CPU kernel's own: one named forward strategy (tests check every branch), and its facts and settings.
    # No PyTorch kernel: they exist where that kernel is loaded.
    "lookup_strategy": "(Tensor rows, Tensor scores, Tensor tables, Tensor? bias, int rows_per_table, str strategy) "
                       "-> Tensor",
    "lookup_strategies": "() -> str[]",
    # A decoder layer's decode step before and after its KV cache update and attention (csrc/cpu/decode_layer.h).
    "decode_qkv": "(Tensor x, Tensor norm_weight, Tensor? norm_bias, float eps, str norm, Tensor tables, "
                  "Tensor? bias, int hash_bits, str score, float temperature, Tensor cos, Tensor sin, int num_heads) "
                  "-> Tensor",
    "decode_block": "(Tensor x, Tensor attn, Tensor norm_weight, Tensor? norm_bias, float eps, str norm, "
                    "bool parallel_residual, Tensor tables1, Tensor? bias1, int hash_bits1, bool gelu, "
                    "Tensor inner_weight, Tensor? inner_bias, float inner_eps, Tensor tables2, Tensor? bias2, "
                    "int hash_bits2, str score, float temperature) -> Tensor",
    # Every decoder layer of a decode step, for a cache grown by concatenation (DynamicCache); owned: per layer, whether
    # its keys and values are the views the op returned last for their buffers (grown in place where there is room).
    "decode_stack": "(Tensor x, Tensor[] keys, Tensor[] values, Tensor? mask, Tensor cos, Tensor sin, int num_heads, "
                    "float scaling, Tensor?[] tensors, float[] floats, int[] ints, int[] owned=[]) "
                    "-> (Tensor, Tensor[], Tensor[])",
    # The same over a static cache (StaticCache): each layer's buffers written in place at its length, which advances.
    "decode_stack_static": "(Tensor x, Tensor(a!)[] keys, Tensor(b!)[] values, Tensor(c!)[] lengths, Tensor? mask, "
                           "Tensor cos, Tensor sin, int num_heads, float scaling, Tensor?[] tensors, float[] floats, "
                           "int[] ints) -> Tensor",
    # generate's decode steps from their tokens (the embedding, decode_stack and the final norm in one call), over
    # operands and keys and values held by the kernel from the open to the close.
    "decode_session_open": "(Tensor embed, Tensor[] keys, Tensor[] values, Tensor cos, Tensor sin, int num_heads, "
                           "float scaling, Tensor?[] tensors, float[] floats, int[] ints, bool final_norm, "
                           "Tensor? norm_weight, Tensor? norm_bias, float norm_eps, Tensor? head_weight=None, "
                           "Tensor? head_bias=None) -> int",
    "decode_session_step": "(int session, Tensor ids, int position, Tensor? cos=None, Tensor? sin=None) "
                           "-> (Tensor, Tensor)",
    "decode_session_close": "(int session) -> (Tensor[], Tensor[])",
    "plan": "(int tokens, int num_tables, int rows_per_table, int out_features, ScalarType dtype, bool backward) "
            "-> str",
    "machine_info": "() -> int[]",
    "set_cache_sizes": "(int l1, int l2, int l3) -> ()",
    "isa": "() -> str",
    "linear_rows_max": "() -> int",
    "linear_rows_balance": "(int delay_slot, int delay_us) -> int",  # tests: a late thread; pieces taken from others
    "linear_rows_prefetch": "(int setting) -> int[]",  # the row pass's prefetch trial: its state, or a fixed choice
    "release_gradient_pool": "() -> int",
}



def namespace_ops(namespace: str = OPS_NAMESPACE):
    """torch.ops.<namespace>, the ops' Python handles."""
    return getattr(torch.ops, namespace)


def _existing_schema(qualname: str) -> str | None:
    schemas = torch._C._jit_get_schemas_for_operator(qualname)
    return str(schemas[0]) if schemas else None


def define_ops(namespace: str = OPS_NAMESPACE) -> bool:
    """Define every op of OP_SCHEMAS in `namespace` with its fake, autograd and PyTorch kernel, unless this process
    already has them (then their schemas must be these). Returns whether this call defined them."""
    existing = _existing_schema(f"{namespace}::hash")
    if existing is not None:
        expected = f"{namespace}::hash{OP_SCHEMAS['hash']}"
        if existing.replace(" ", "") != expected.replace(" ", ""):
            raise RuntimeError(
                f"torch.ops.{namespace} is already defined in this process with other schemas ({existing}): two "
                "MemoryFormer releases with different ops cannot run in one process. Load models saved by one "
                "release per process, or re-save the older model with the installed release."
            )
        return False
    for name, schema in OP_SCHEMAS.items():
        torch.library.define(f"{namespace}::{name}", schema)
    for name, kernel in vars(TORCH_BACKEND).items():
        if name in OP_SCHEMAS:  # the PyTorch kernel of the op: every device's default
            torch.library.impl(f"{namespace}::{name}", "CompositeExplicitAutograd")(kernel)
    _register_fakes(namespace)
    _register_autograd(namespace)
    return True


def _register_fakes(namespace: str) -> None:
    def fake(name):
        return torch.library.register_fake(f"{namespace}::{name}")

    @fake("hash")
    def _hash(x, hash_bits, score, temperature):
        shape = (x.shape[0], x.shape[1] // hash_bits)
        return x.new_empty(shape, dtype=torch.long), x.new_empty(shape, dtype=acc_dtype(x.dtype))

    @fake("hash_backward")
    def _hash_backward(grad_scores, x, hash_bits, score, temperature):
        return torch.empty_like(x)

    @fake("lookup")
    def _lookup(rows, scores, tables, bias, rows_per_table):
        return tables.new_empty((rows.shape[0], tables.shape[1]))

    @fake("lookup_strategy")
    def _lookup_strategy(rows, scores, tables, bias, rows_per_table, strategy):
        return tables.new_empty((rows.shape[0], tables.shape[1]))

    @fake("lookup_backward")
    def _lookup_backward(grad_out, rows, scores, tables, rows_per_table, need_tables, need_scores):
        grad_scores = scores.new_empty(rows.shape, dtype=acc_dtype(tables.dtype)) if need_scores else None
        return grad_scores, (torch.empty_like(tables) if need_tables else None)

    @fake("lookup_backward_rows")
    def _lookup_backward_rows(grad_out, rows, scores, tables, rows_per_table, need_scores):
        hit = torch.library.get_ctx().new_dynamic_size()
        grad_scores = scores.new_empty(rows.shape, dtype=torch.float32) if need_scores else None
        return grad_scores, rows.new_empty((hit,)), tables.new_empty((hit, tables.shape[1]))

    @fake("int8_lookup")
    def _int8_lookup(rows, scores, packed, bias, rows_per_table):
        return packed.new_empty((rows.shape[0], packed.shape[1] - 8), dtype=torch.float32)

    @fake("linear_rows")
    def _linear_rows(x, weight, bias):
        return x.new_empty((x.shape[0], weight.shape[0]))

    @fake("argmax_rows")
    def _argmax_rows(x):
        return x.new_empty((x.shape[0],), dtype=torch.long)

    @fake("linear_rows_argmax")
    def _linear_rows_argmax(x, weight, bias):
        return x.new_empty((x.shape[0], weight.shape[0])), x.new_empty((x.shape[0],), dtype=torch.long)

    @fake("decode_attention")
    def _decode_attention(q, k, v, mask, scaling):
        return q.new_empty((q.shape[0], 1, q.shape[1], q.shape[3]))

    @fake("decode_layer_norm")
    def _decode_layer_norm(x, weight, bias, eps, path="auto"):
        return torch.empty_like(x)

    @fake("decode_qkv")
    def _decode_qkv(x, norm_weight, norm_bias, eps, norm, tables, bias, hash_bits, score, temperature, cos, sin,
                    num_heads):
        return x.new_empty((x.shape[0], 3 * x.shape[1]))

    @fake("decode_block")
    def _decode_block(x, attn, *args):
        return torch.empty_like(x)

    @fake("decode_stack")
    def _decode_stack(x, keys, values, *args):
        grown = [torch.cat([k, k[:, :, :1]], dim=-2) for k in keys]
        return torch.empty_like(x), grown, [torch.cat([v, v[:, :, :1]], dim=-2) for v in values]

    @fake("decode_stack_static")
    def _decode_stack_static(x, keys, values, lengths, *args):
        return torch.empty_like(x)

    @fake("rowwise_adagrad_step")
    def _rowwise_adagrad_step(weight, grad, state_sum, lr, eps, weight_decay):
        return None

    @fake("adam_rowwise_step")
    def _adam_rowwise_step(weight, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
        return None


def _register_autograd(namespace: str) -> None:
    ops = namespace_ops(namespace)

    def hash_setup(ctx, inputs, output):
        x, hash_bits, score, temperature = inputs
        ctx.save_for_backward(x)
        ctx.args = (hash_bits, score, temperature)

    def hash_backward(ctx, grad_rows, grad_scores):
        (x,) = ctx.saved_tensors
        if grad_scores is None or not ctx.needs_input_grad[0]:
            return None, None, None, None
        return ops.hash_backward(grad_scores.contiguous(), x, *ctx.args), None, None, None

    def lookup_setup(ctx, inputs, output):
        rows, scores, tables, bias, rows_per_table = inputs
        ctx.save_for_backward(rows, scores, tables)
        ctx.rows_per_table = rows_per_table

    def lookup_backward(ctx, grad):
        rows, scores, tables = ctx.saved_tensors
        _, need_scores, need_tables, need_bias, _ = ctx.needs_input_grad
        grad_scores, grad_tables = ops.lookup_backward(
            grad.contiguous(), rows, scores, tables, ctx.rows_per_table, need_tables, need_scores
        )
        grad_bias = grad.sum(0) if need_bias else None
        if grad_scores is not None and need_scores:
            grad_scores = grad_scores.to(scores.dtype)
        return None, grad_scores if need_scores else None, grad_tables if need_tables else None, grad_bias, None

    torch.library.register_autograd(f"{namespace}::hash", hash_backward, setup_context=hash_setup)
    torch.library.register_autograd(f"{namespace}::lookup", lookup_backward, setup_context=lookup_setup)


define_ops(OPS_NAMESPACE)
