"""A MemoryFormer decode step on the fused CPU kernel (csrc/cpu/decode_layer.h): each decoder layer in two calls, or
every layer in one.

A decode step feeds one position per sequence through every layer. Through the module tree that is about 25 small
ops and 10 module calls per layer, each a few microseconds of Python and dispatch for a few hundred bytes of work,
while the bytes the architecture saves (K table rows per Memory Layer) take about 100 us per layer of MF-small: the
calls were most of the step. `decode_layer_step` runs the same layer as

    decode_qkv(x)               input norm -> Q/K/V Memory Layer -> rotary on the Q and K heads
    cache.update(k, v)          any transformers Cache (or the paged cache of continuous batching), as the module does
    attention                   for "sdpa" the fused decode attention, as the module runs it; over a paged cache, the
                                paged attention function the module calls
    [attention.dense(attn)]     the attention output Memory Layer, where the config has one
    decode_block(x, attn)       + residual -> post-attention norm -> Memory Block -> + residual

and `decode_stack_step` runs every layer in one `decode_stack` call where the cache is a plain `DynamicCache` (its
growth, with the values of the cat that grows it but in place where the buffer has room, and the decode attention,
done in C++ too).

Each op inside the calls is the one the modules run, in their order and dtype, so the output is bit-identical to the
modules' (tests/model/test_decode_layer.py, test_decode_stack.py). Where anything could make the two differ, the
step declines (returns None) and the caller runs the modules: gradients, training, more than one position (but a
continuous-batching step, whose tokens are rows of one sequence dimension), torch.compile (where
`decode_stack_traced`, or per layer `decode_layer_traced`, puts the same ops into the traced graph), profiling or a
dispatch mode, another attention implementation outside continuous batching, hooks on a submodule (other than
transformers' output capture on the attention, whose attention weights this path never has: the modules' "sdpa" path
returns none either) or a forward replaced on one (accelerate's offloading hooks), a replaced submodule (PEFT,
quantisation wrappers), tables, norms or rotary tables of another dtype than the hidden states, or a kernel choice
other than the fused one.
"""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter, contains, is_, itemgetter

import torch
from torch import nn

from transformers.cache_utils import DynamicCache, StaticCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .memory_kernels import _CPU_KEYS, dispatcher_watched, fused_ops, uses_fused
from .memory_layer import MemoryLayer
from .memory_ops import _DECODE_ATTENTION_DTYPES, _NOT_FOR_DECODE_ATTENTION, decode_attention_forward, decode_mask_fits
from .quantization import int8_cpu_path
from .transformers_compat import (DynamicLayer, StaticLayer, cache_grows_by_cat, causal_mask, is_paged_cache,
                                  outputs_captured, static_cache_writes_at_length, update_kv_cache)

_CAPTURE_HOOK = "output_capturing_hook"  # transformers' output capture (utils/output_capturing.py)
_DTYPE, _FORWARD_HOOKS, _PRE_HOOKS = attrgetter("dtype"), itemgetter("_forward_hooks"), itemgetter("_forward_pre_hooks")
_TRAINING, _SHAPE, _IS_CPU = itemgetter("training"), attrgetter("shape"), attrgetter("is_cpu")


def _attention_hooked(attention: nn.Module) -> bool:
    """Whether a forward hook or pre-hook other than transformers' output capture, or a forward replaced on the
    instance (accelerate's hooks, which move offloaded weights in), could see or change the attention's call (which
    the fast path skips). The plan checks the other submodules (`_Plan.state`), where no hook is allowed."""
    if attention._forward_pre_hooks or "forward" in attention.__dict__:
        return True
    return any(getattr(h, "__name__", None) != _CAPTURE_HOOK for h in attention._forward_hooks.values())


def unhooked(*modules) -> bool:
    """Whether a call of each module is its class's forward alone: no hook on it, none global, no forward set on the
    instance (accelerate's hooks replace it)."""
    module = nn.modules.module
    return not (module._global_forward_hooks or module._global_forward_pre_hooks or any(
        m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ for m in modules))


class _Plan:
    """One layer's operands for the two ops, and what they were read from: each step checks that every submodule and
    parameter is still the one read (PEFT, quantisation or a user may replace them), that each tensor keeps the
    hidden states' dtype (`.to()` swaps a parameter's data in place) and that no hook was added; else the plan is
    derived again. A few us against 100 us to derive it, per layer and step."""

    __slots__ = ("dtype", "links", "tensors", "tables", "int8", "watched", "captured", "qkv", "block", "stack",
                 "snapshot", "ok", "traced")

    def __init__(self, dtype, traced: bool = False):
        self.dtype, self.links, self.tensors, self.tables, self.int8, self.watched = dtype, [], [], [], [], []
        self.captured = []  # modules the step skips whose only hooks may be transformers' output capture
        self.traced = traced  # read while torch.compile traces: int8 tables are left to the modules

    def child(self, parent: nn.Module, name: str) -> nn.Module | None:
        module = parent._modules.get(name)
        self.links.append((parent._modules, name, module))
        return module

    def parameter(self, module: nn.Module, name: str) -> torch.Tensor | None:
        value = module._parameters.get(name)
        self.links.append((module._parameters, name, value))
        if value is not None:
            self.tensors.append(value)
        return value

    def norm(self, norm: nn.Module | None):
        """(weight, bias, eps, kind) of a block norm the op computes as its module does, else None."""
        if norm is None:
            return None
        self.watched.append(norm)
        kind = "layernorm" if type(norm) is nn.LayerNorm else getattr(type(norm), "decode_norm", None)
        weight = self.parameter(norm, "weight")
        if kind == "layernorm" and weight is not None and len(norm.normalized_shape) == 1:
            return weight, self.parameter(norm, "bias"), norm.eps, kind
        if kind == "rmsnorm" and weight is not None:
            return weight, None, norm.variance_epsilon, kind
        return None

    def memory_layer(self, layer: nn.Module | None, in_features: int):
        """(tables, bias, hash_bits) of a Memory Layer whose lookup the op runs as the module would (the fused kernel's
        hash and lookup, or int8_lookup on the assembled int8 block), else None."""
        if type(layer) is not MemoryLayer or layer.in_features != in_features:
            return None
        self.watched.append(layer)
        bias = self.parameter(layer, "bias")
        if layer.table_dtype == "int8":
            if self.traced:
                return None
            block = layer._int8_tables()[3]
            if block is None or self.dtype == torch.float64:
                return None
            for name in ("tables_codes", "tables_scale", "tables_offset"):
                self.links.append((layer._buffers, name, layer._buffers.get(name)))
            self.int8.append((layer, layer._int8_block))
            return block, bias, layer.hash_bits
        tables = self.parameter(layer, "tables")
        if tables is None:
            return None
        self.tables.append(tables)
        return tables, bias, layer.hash_bits

    def freeze(self, ok: bool, tokens: int) -> _Plan:
        """Ends the derivation: the checks of `state` as flat tuples, which it runs as C-level loops, and the state
        that `holds` compares against."""
        self.links = tuple(zip(*self.links)) if self.links else ((), (), ())
        self.watched = tuple(self.watched)   # modules, not their __dict__s: a deepcopy of the model maps them
        self.captured = tuple(self.captured)
        self.tensors, self.tables = tuple(self.tensors), tuple(self.tables)
        self.int8 = tuple(zip(*self.int8)) if self.int8 else ((), ())
        self.snapshot = self.state(self.dtype, tokens)
        captures_only = all(getattr(hook, "__name__", None) == _CAPTURE_HOOK
                            for module in self.captured for hook in module._forward_hooks.values())
        self.ok = ok and captures_only and self.snapshot == self.state_ok
        return self

    def state(self, dtype, tokens: int) -> tuple:
        """What the derivation read, as values: whether each submodule and parameter is the one read, each tensor's
        dtype, the tables' contiguity, the hooks and replaced forwards, the int8 blocks and the int8 path."""
        dicts, names, values = self.links
        watched = tuple(map(vars, self.watched + self.captured))  # attributes: hooks, a forward set on the instance
        return (dtype, tuple(map(is_, map(dict.get, dicts, names), values)), tuple(map(_DTYPE, self.tensors)),
                tuple(map(torch.Tensor.is_contiguous, self.tables)),
                tuple(map(bool, map(_FORWARD_HOOKS, watched[:len(self.watched)]))),
                tuple(map(tuple, map(_FORWARD_HOOKS, watched[len(self.watched):]))),  # the hooks' ids
                tuple(map(bool, map(_PRE_HOOKS, watched))), tuple(map(contains, watched, repeat("forward"))),
                tuple(map(_TRAINING, watched)),
                tuple(map(is_, map(dict.get, map(vars, self.int8[0]), repeat("_int8_block")), self.int8[1])),
                bool(self.int8[0]) and int8_cpu_path(tokens))

    @property
    def state_ok(self) -> tuple:
        """The state under which the ops run the layer as its modules: everything as read, every tensor in the
        hidden states' dtype, contiguous tables, no hook (on a captured module: output capture's, checked by
        `freeze`), no replaced forward, nothing in training mode, the fused int8 path."""
        watched, every = len(self.watched), len(self.watched) + len(self.captured)
        return (self.dtype, (True,) * len(self.links[0]), (self.dtype,) * len(self.tensors), (True,) * len(self.tables),
                (False,) * watched, self.snapshot[5], (False,) * every, (False,) * every, (False,) * every,
                (True,) * len(self.int8[0]), bool(self.int8[0]) and "fused")

    def holds(self, dtype, tokens: int) -> bool:
        """Whether the decision (run the ops or not) and the operands of this plan still stand."""
        return self.state(dtype, tokens) == self.snapshot


def _derive(plan: _Plan, layer: nn.Module) -> tuple[tuple, tuple] | None:
    """Reads a decoder layer's operands into `plan` (and what they were read from): the arguments of decode_qkv and
    decode_block after their first ones, or None where the ops cannot run the layer as its modules do."""
    attention, block = plan.child(layer, "attention"), plan.child(layer, "memory_block")
    if type(attention).__name__ != "MemoryFormerAttention" or type(block).__name__ != "MemoryBlock":
        return None  # replaced (by name: a model folder's remote code has its own classes)
    norm1 = plan.norm(plan.child(layer, "input_layernorm"))
    norm2 = plan.norm(plan.child(layer, "post_attention_layernorm"))
    for name in ("post_attention_dropout", "post_memory_dropout"):
        dropout = plan.child(layer, name)
        if type(dropout) is not nn.Dropout:
            return None
        plan.watched.append(dropout)
    hidden = attention.hidden_size
    qkv_layer = plan.child(attention, "query_key_value")
    plan.child(attention, "dense")  # called as a module (with its own fast path), if the config has one
    layer1, act, inner, layer2 = (plan.child(block, name) for name in ("layer1", "act", "norm", "layer2"))
    inner = plan.norm(inner)
    plan.watched += [block, act]
    qkv, tables1 = plan.memory_layer(qkv_layer, hidden), plan.memory_layer(layer1, hidden)
    gelu = type(act) is nn.GELU and act.approximate == "none"
    if (norm1 is None or norm2 is None or qkv is None or tables1 is None or inner is None or inner[3] != "layernorm"
            or not (gelu or type(act) is nn.Identity)):
        return None
    tables2 = plan.memory_layer(layer2, layer1.out_features)
    if tables2 is None or (layer2.score, layer2.temperature) != (layer1.score, layer1.temperature):
        return None
    return ((*norm1, *qkv, qkv_layer.score, qkv_layer.temperature),
            (*norm2, layer.use_parallel_residual, *tables1, gelu, *inner[:3], *tables2, layer1.score,
             layer1.temperature))


def _plan(layer: nn.Module, dtype: torch.dtype, tokens: int) -> _Plan:
    """The layer's plan for hidden states of `dtype`; `plan.ok` False where the ops cannot run it as its modules do
    (kept too, so that a layer the step declines costs a state check per step, not a derivation)."""
    plan = _Plan(dtype)
    operands = _derive(plan, layer)
    if operands is not None:
        plan.qkv, plan.block = operands
    return plan.freeze(operands is not None, tokens)


def _rotary_rows(position_embeddings, dtype, tokens: int, paged: bool):
    """(cos, sin) in the form the ops take them, [tokens or 1, 1, r], or None for rotary tables of another form
    (another dtype, passed in by a caller: the modules broadcast and promote them). A continuous-batching step's
    [1, tokens, r] become one row per token."""
    cos, sin = position_embeddings
    if not (cos.dtype is dtype and sin.dtype is dtype and cos.dim() == 3 and sin.shape == cos.shape
            and (cos.shape[:2] == (1, tokens) if paged else cos.shape[1] == 1 and cos.shape[0] in (1, tokens))):
        return None
    return (cos.reshape(tokens, 1, -1), sin.reshape(tokens, 1, -1)) if paged else (cos, sin)


def decode_layer_step(layer: nn.Module, hidden_states: torch.Tensor, attention_mask, position_embeddings, cache,
                      kwargs: dict) -> torch.Tensor | None:
    """`MemoryFormerDecoderLayer.forward` for a decode step ([batch, 1, hidden] on the CPU, no gradient, the "sdpa"
    attention, a transformers Cache) or a continuous-batching step ([1, tokens, hidden] over a paged cache, any
    attention function) in two fused-kernel calls; None where it does not apply (see the module's docstring): the
    caller runs the modules, which give the same values."""
    paged = is_paged_cache(cache)
    if (hidden_states.dim() != 3 or hidden_states.shape[0 if paged else 1] != 1 or cache is None or layer.training
            or torch.is_grad_enabled() or hidden_states.device.type != "cpu" or dispatcher_watched()
            or not uses_fused(hidden_states) or (paged and outputs_captured())):
        return None
    module = nn.modules.module
    attention = layer._modules.get("attention")
    if type(attention).__name__ != "MemoryFormerAttention" or attention.training:  # replaced: may have no config
        return None
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(attention.config._attn_implementation, None)
    sdpa = ALL_ATTENTION_FUNCTIONS.get("sdpa")
    if (module._global_forward_hooks or module._global_forward_pre_hooks or _attention_hooked(attention)
            or interface is None or (interface is not sdpa and not paged)):
        return None  # unpaged: "sdpa" only (another function may return attention weights that capture records)
    tokens, hidden = hidden_states.shape[1 if paged else 0], hidden_states.shape[-1]
    dtype = hidden_states.dtype
    plan = layer.__dict__.get("_decode_plan")
    if plan is None or not plan.holds(dtype, tokens):
        plan = layer.__dict__["_decode_plan"] = _plan(layer, dtype, tokens)
    if not plan.ok:
        return None
    rotary = _rotary_rows(position_embeddings, dtype, tokens, paged)
    if rotary is None:
        return None
    return _layer_ops(_redispatched, attention, hidden_states.reshape(tokens, hidden), (plan.qkv, plan.block), rotary,
                      (1, tokens) if paged else (tokens, 1), cache, attention_mask, interface, kwargs)


def _redispatched(op, *args):
    """`op(*args)` straight to its CPU kernel (the eager step: nothing records or watches the call)."""
    return op.default.redispatch(_CPU_KEYS, *args)


def _dispatched(op, *args):
    """`op(*args)` through the dispatcher (while tracing: a node of the graph)."""
    return op(*args)


def _layer_ops(call, attention: nn.Module, x: torch.Tensor, operands: tuple, rotary: tuple, shape: tuple, cache,
               attention_mask, interface, kwargs: dict) -> torch.Tensor:
    """A decoder layer's decode step on x [tokens, hidden], as `decode_layer_step` and `decode_layer_traced` run it:
    decode_qkv (by `call`), the cache update, the attention ("sdpa": the decode attention), the attention-output
    Memory Layer where there is one, decode_block; `operands` are the two ops' (`_derive`), `shape` the step's
    leading dimensions ([tokens, 1], or [1, tokens] for a continuous-batching step). Returns [*shape, hidden]."""
    ops, (tokens, hidden) = fused_ops(), x.shape
    qkv = call(ops.decode_qkv, x, *operands[0], *rotary, attention.num_heads)
    query, key, value = qkv.view(*shape, 3, attention.num_heads, attention.head_dim).permute(2, 0, 3, 1, 4).unbind()
    key, value = update_kv_cache(cache, key, value, attention.layer_idx, interface, kwargs)
    sdpa = interface is ALL_ATTENTION_FUNCTIONS.get("sdpa")
    attn, _ = (decode_attention_forward if sdpa else interface)(
        attention, query, key, value, attention_mask, dropout=0.0, scaling=attention.scaling, **kwargs)
    attn = attn.reshape(*shape, hidden).contiguous()
    if attention.dense is not None:
        attn = attention.dense(attn)
    return call(ops.decode_block, x, attn.view(tokens, hidden), *operands[1]).view(*shape, hidden)


def _traced_plan_holds(plan: _Plan) -> bool:
    """For a plan read while tracing (Dynamo guards what it read): what `_Plan.state_ok` asks of an eager plan, bar
    what the reads themselves settled (the submodules and parameters read, the int8 path)."""
    return (unhooked(*plan.watched) and all(t.dtype == plan.dtype for t in plan.tensors)
            and all(t.is_contiguous() for t in plan.tables) and not any(m.training for m in plan.watched)
            and not any(m._forward_pre_hooks or "forward" in m.__dict__ for m in plan.captured)
            and all(getattr(hook, "__name__", None) == _CAPTURE_HOOK
                    for m in plan.captured for hook in m._forward_hooks.values()))


def decode_layer_traced(layer: nn.Module, hidden_states: torch.Tensor, attention_mask, position_embeddings, cache,
                        kwargs: dict) -> torch.Tensor | None:
    """`decode_layer_step` while torch.compile traces a decode step (transformers' compiled step over a static cache):
    the same two fused ops, called through the dispatcher so that they become nodes of the graph (their fake kernels
    give the shapes; Inductor calls the CPU kernels), around the cache update and the attention as the modules trace
    them. Without it the graph holds each Memory Layer's hash and lookup and the norms, rotation and residuals between
    them: more calls per layer, the lookups on the general kernel (MF-small's compiled step 1.7x its eager one, 1.2x
    with it). The operands are read as `_derive` reads them for the eager step; Dynamo guards what the reads touched
    (submodules, parameters, their dtypes), so a replaced submodule or a cast compiles the step again. Hooks are read
    when the step is compiled: a layer with one runs its modules; one added later is not seen, here as on the modules'
    path (torch's `skip_nnmodule_hook_guards`). None where the modules run: outside tracing, where the conditions of
    `decode_layer_step` fail (bar the ones about tracing), int8 tables (whose prefill does not compile either)."""
    if (not torch.compiler.is_compiling() or hidden_states.dim() != 3 or hidden_states.shape[1] != 1 or cache is None
            or is_paged_cache(cache) or layer.training or torch.is_grad_enabled() or hidden_states.device.type != "cpu"
            or not uses_fused(hidden_states)):
        return None
    module = nn.modules.module
    attention = layer._modules.get("attention")
    if (type(attention).__name__ != "MemoryFormerAttention" or attention.training or module._global_forward_hooks
            or module._global_forward_pre_hooks or _attention_hooked(attention)):
        return None
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(attention.config._attn_implementation, None)
    if interface is not ALL_ATTENTION_FUNCTIONS.get("sdpa"):
        return None
    dtype = hidden_states.dtype
    plan = _Plan(dtype, traced=True)  # declines int8 tables (their block is assembled outside tracing)
    operands = _derive(plan, layer)
    if operands is None or not _traced_plan_holds(plan):
        return None
    tokens, hidden = hidden_states.shape[0], hidden_states.shape[-1]
    rotary = _rotary_rows(position_embeddings, dtype, tokens, paged=False)
    if rotary is None:
        return None
    return _layer_ops(_dispatched, attention, hidden_states.reshape(tokens, hidden), operands, rotary, (tokens, 1),
                      cache, attention_mask, interface, kwargs)


_NORM_CODES, _SCORE_CODES = {"layernorm": 0, "rmsnorm": 1}, {"paper": 0, "l1": 1}  # decode_stack's codes


def _stack_operands(plan: _Plan, model: nn.Module) -> tuple | None:
    """`decode_stack`'s operands for a `MemoryFormerModel`: every decoder layer's (as `_derive` reads them), flat, with
    the attention's shape, read into `plan`; None where one layer cannot run on the ops, has an attention-output
    Memory Layer (a module call between the ops) or attention of another shape than the first layer's."""
    layers = plan.child(model, "layers")
    if type(layers) is not nn.ModuleList:
        return None
    modules = [plan.child(layers, name) for name in tuple(layers._modules)]
    plan.links.append((layers._modules, str(len(modules)), None))  # a layer appended to the list
    tensors, floats, ints, shape = [], [], [], None
    for index, layer in enumerate(modules):
        if type(layer).__name__ != "MemoryFormerDecoderLayer":
            return None
        plan.captured.append(layer)
        operands = _derive(plan, layer)
        if operands is None:
            return None
        attention = layer._modules["attention"]
        plan.captured.append(attention)
        if shape is None:
            shape = (attention.num_heads, attention.head_dim, attention.scaling)
        (w1, b1, eps1, norm1, qkv, qkv_bias, qkv_bits, qkv_score, qkv_temperature), block = operands
        (w2, b2, eps2, norm2, parallel, t1, bias1, bits1, gelu, wi, bi, eps_i, t2, bias2, bits2, score,
         temperature) = block
        if (attention.dense is not None or attention.layer_idx != index or qkv_score not in _SCORE_CODES
                or score not in _SCORE_CODES or (attention.num_heads, attention.head_dim, attention.scaling) != shape):
            return None
        tensors += [w1, b1, qkv, qkv_bias, w2, b2, t1, bias1, wi, bi, t2, bias2]
        floats += [eps1, qkv_temperature, eps2, eps_i, temperature]
        ints += [_NORM_CODES[norm1], qkv_bits, _SCORE_CODES[qkv_score], _NORM_CODES[norm2], int(parallel), bits1,
                 int(gelu), bits2, _SCORE_CODES[score]]
    if shape is None:
        return None
    return tensors, [float(f) for f in floats], ints, shape[0], float(shape[2]), shape[1], len(modules)


def _stack_plan(model: nn.Module, dtype: torch.dtype, tokens: int) -> _Plan:
    """The plan of `decode_stack` for a `MemoryFormerModel`: `_stack_operands` in `plan.stack`; `plan.ok` False where
    they are None."""
    plan = _Plan(dtype)
    plan.stack = _stack_operands(plan, model)
    return plan.freeze(plan.stack is not None, tokens)


# The mark (in a tensor's __dict__) of the one view of a KV buffer with room that `decode_stack` may grow in place:
# the view it returned last for that buffer. A copy of the layer list, a crop, a reorder or a second cache holding the
# same tensor gets no mark (or loses it when the buffer grows), so that two holders never write the same position.
_ROOM = "_memoryformer_kv_room"

# As `cache_grows_by_cat` found them (a class patched later is left to the per-layer step).
_LAYER_UPDATE, _CACHE_UPDATE = getattr(DynamicLayer, "update", None), DynamicCache.update
# As `static_cache_writes_at_length` found them, at import: while tracing, the trial (tensor ops) cannot run.
_STATIC_UPDATE, _STATIC_CACHE_UPDATE = getattr(StaticLayer, "update", None), StaticCache.update
_STATIC_WRITES = StaticLayer is not None and static_cache_writes_at_length()
_GROWN = attrgetter("keys", "values", "is_initialized")


def _stack_may_run(model: nn.Module, hidden_states: torch.Tensor, kwargs: dict) -> bool:
    """What the stack asks whatever the cache: one position per sequence on the CPU in a dtype the decode attention
    takes, no gradient, inference mode, the fused kernel, no output capture recording, no keyword the decode attention
    does not take, no global hook, the "sdpa" attention."""
    module = nn.modules.module
    implementation = model.config._attn_implementation
    return not (hidden_states.dim() != 3 or hidden_states.shape[1] != 1 or model.training or torch.is_grad_enabled()
                or hidden_states.device.type != "cpu" or hidden_states.dtype not in _DECODE_ATTENTION_DTYPES
                or not uses_fused(hidden_states) or outputs_captured()
                or any(kwargs.get(name) is not None for name in _NOT_FOR_DECODE_ATTENTION)
                or module._global_forward_hooks or module._global_forward_pre_hooks
                or (implementation != "sdpa" and ALL_ATTENTION_FUNCTIONS.get_interface(implementation, None) is not
                    ALL_ATTENTION_FUNCTIONS.get("sdpa")))


def decode_stack_step(model: nn.Module, hidden_states: torch.Tensor, attention_mask, position_embeddings, cache,
                      kwargs: dict) -> torch.Tensor | None:
    """Every decoder layer of `MemoryFormerModel` for a decode step in one `decode_stack` call: the per-layer step's
    calls (`decode_layer_step`) in C++ and the `DynamicCache`'s layers grown to the values `DynamicLayer.update` gives
    them, as views of buffers with room that later steps fill in place (`_ROOM` marks the view that may).
    None where it does not apply: where the per-layer step would not, a cache other than a plain `DynamicCache`
    (static, offloaded, quantized, paged: the per-layer step then runs), output capture recording (it calls the layers),
    an attention-output Memory Layer, a mask or keyword the decode attention does not take."""
    if (type(cache) is not DynamicCache or dispatcher_watched() or not _stack_may_run(model, hidden_states, kwargs)
            or getattr(cache, "offloading", True) or getattr(DynamicLayer, "update", None) is not _LAYER_UPDATE
            or DynamicCache.update is not _CACHE_UPDATE or not cache_grows_by_cat()):
        return None
    batch, hidden = hidden_states.shape[0], hidden_states.shape[-1]
    dtype = hidden_states.dtype
    plan = model.__dict__.get("_decode_stack")
    if plan is None or not plan.holds(dtype, batch):
        plan = model.__dict__["_decode_stack"] = _stack_plan(model, dtype, batch)
    if not plan.ok:
        return None
    tensors, floats, ints, heads, scaling, head_dim, count = plan.stack
    layers = cache.layers
    if len(layers) != count or any(type(layer) is not DynamicLayer for layer in layers):
        return None
    keys, values, initialized = zip(*map(_GROWN, layers))
    every = keys + values
    if not all(initialized) or len(set(map(_SHAPE, every))) != 1 or len(set(map(_DTYPE, every))) != 1:
        return None
    shape = keys[0].shape
    if (keys[0].dtype != dtype or not keys[0].is_cpu or len(shape) != 4 or shape[0] != batch or shape[1] != heads
            or shape[3] != head_dim or shape[2] == 0 or not all(map(_IS_CPU, every))):
        return None
    rotary = _rotary_rows(position_embeddings, dtype, batch, paged=False)
    if rotary is None or not decode_mask_fits(attention_mask, batch, heads, shape[2] + 1, dtype):
        return None
    owned = [int(_ROOM in vars(key) and _ROOM in vars(value)) for key, value in zip(keys, values)]
    out, grown_keys, grown_values = fused_ops().decode_stack.default.redispatch(
        _CPU_KEYS, hidden_states.reshape(batch, hidden), keys, values, attention_mask, *rotary, heads, scaling, tensors,
        floats, ints, owned)
    for layer, old_key, old_value, key, value in zip(layers, keys, values, grown_keys, grown_values):
        vars(old_key).pop(_ROOM, None)  # the grown views are now their buffers' only ones that may grow in place
        vars(old_value).pop(_ROOM, None)
        vars(key)[_ROOM] = vars(value)[_ROOM] = True
        layer.keys, layer.values = key, value
    return out.view(batch, 1, hidden)


def decode_stack_traced(model: nn.Module, hidden_states: torch.Tensor, attention_mask, position_embeddings, cache,
                        kwargs: dict) -> torch.Tensor | None:
    """`decode_stack_step` while torch.compile traces a decode step over a static cache (transformers' compiled step):
    every decoder layer in one `decode_stack_static` call, a node of the graph that writes each layer's buffers and
    length in place as `StaticLayer.update` does (`static_cache_writes_at_length` checked that the running release's
    does that) and attends over them as the modules do; one call per step instead of five to six per layer (MF-base:
    about 1 ms a step of the compiled wrapper's calls). The operands are read as for the eager stack (Dynamo guards
    the reads); None where the layers' traced step or the modules run: where `decode_stack_step`'s conditions fail
    (bar the ones about tracing and the cache's class), a cache other than a plain `StaticCache` of `StaticLayer`s,
    int8 tables. A buffer with no position left is the op's error (the modules' `index_copy_` fails there too)."""
    if (not torch.compiler.is_compiling() or not _STATIC_WRITES or type(cache) is not StaticCache
            or not _stack_may_run(model, hidden_states, kwargs) or StaticLayer.update is not _STATIC_UPDATE
            or StaticCache.update is not _STATIC_CACHE_UPDATE):
        return None
    batch, hidden, dtype = hidden_states.shape[0], hidden_states.shape[-1], hidden_states.dtype
    plan = _Plan(dtype, traced=True)
    stack = _stack_operands(plan, model)
    if stack is None or not _traced_plan_holds(plan):
        return None
    tensors, floats, ints, heads, scaling, head_dim, count = stack
    layers = cache.layers
    if len(layers) != count or any(type(layer) is not StaticLayer or not layer.is_initialized for layer in layers):
        return None
    keys, values = [layer.keys for layer in layers], [layer.values for layer in layers]
    lengths = [layer.cumulative_length for layer in layers]
    shape = keys[0].shape
    if (len(shape) != 4 or shape[0] != batch or shape[1] != heads or shape[3] != head_dim
            or any(t.shape != shape or t.dtype != dtype or not t.is_cpu for t in keys + values)
            or any(not isinstance(n, torch.Tensor) or n.numel() != 1 or n.dtype != torch.long for n in lengths)):
        return None
    rotary = _rotary_rows(position_embeddings, dtype, batch, paged=False)
    if rotary is None or not decode_mask_fits(attention_mask, batch, heads, shape[2], dtype):
        return None
    out = fused_ops().decode_stack_static(hidden_states.reshape(batch, hidden), keys, values, lengths, attention_mask,
                                          *rotary, heads, scaling, tensors, floats, ints)
    return out.view(batch, 1, hidden)


def decode_stack_run(lm: nn.Module, input_ids, attention_mask, position_ids, cache, inputs_embeds, labels,
                     kwargs: dict):
    """For `MemoryFormerForCausalLM.forward` (`lm`): a decode step's body of `MemoryFormerModel.forward`, called as a
    method (`_run`): (last hidden states, cache) where every layer runs in one `decode_stack` call, else None and the
    step calls the model as a module. The module call around the body (nn.Module's call, transformers'
    config-defaults and output-capture decorators, the BaseModelOutputWithPast) cost about 0.15-0.2 ms of a 4-10 ms
    step on the Zen 3 of docs/performance.md; they change nothing here: the call is taken only where the model has no
    hook or replaced forward, nothing asks for hidden states or attentions, and no keyword or label is given, so the
    result is the module call's (tests/model/test_decode_stack.py)."""
    model = lm._modules.get("model")
    if (kwargs or labels is not None or inputs_embeds is not None or type(model).__name__ != "MemoryFormerModel"
            or type(cache) is not DynamicCache or not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2
            or input_ids.shape[1] != 1 or torch.is_grad_enabled() or model.training
            or torch.compiler.is_compiling() or torch.jit.is_tracing() or not unhooked(model)
            or getattr(lm.config, "output_attentions", False) or getattr(lm.config, "output_hidden_states", False)):
        return None
    return model._run(input_ids, attention_mask, position_ids, cache, None, None, {}, stack_only=True)


def decode_step_mask(model: nn.Module, attention_mask, inputs_embeds, cache, position_ids, stack_only: bool):
    """The attention mask of `MemoryFormerModel._run`: transformers' `create_causal_mask`, but for a stacked decode
    step (`stack_only`: one position per sequence after the cached ones, a `DynamicCache`, the decode attention)
    whose 2-D mask keeps every position, or is None: None, which the decode attention reads as "every key", as that
    mask says and as `create_causal_mask` answers there for "sdpa", without its 0.07-0.13 ms per step. Where the stack
    then declines, `_run` returns None and the module call computes everything again, this mask included."""
    if (stack_only and inputs_embeds.shape[1] == 1
            and (attention_mask is None or (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
                                            and not attention_mask.is_floating_point()
                                            and bool(attention_mask.all())))):
        return None
    return causal_mask(config=model.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache,
                       position_ids=position_ids)


_TABLE_TOKENS = 64       # at most this many positions per call take the table (a decode step: one per sequence)
_TABLE_BYTES = 16 << 20  # the table's size at most; positions beyond what fits are computed


def rotary_table_rows(rotary: nn.Module, x: torch.Tensor, position_ids: torch.Tensor):
    """For `MemoryFormerRotaryEmbedding.forward`: a decode step's few positions, on the CPU, read from a table of
    every position's cos and sin that the module's `_compute` made in one call (the same element-wise ops on the same
    values, so the same bits: tests/model/test_rotary_table.py), in two index_selects instead of about ten small ops
    (0.15-0.19 ms of a 4-15 ms MF-tiny to MF-base decode step on the Zen 3 of docs/performance.md); None where the
    module computes them. Not for the "dynamic" types and "longrope", whose `inv_freq` follows the sequence length,
    nor under torch.compile, which traces `_compute`. The table is made again when `inv_freq` (moved, converted or
    changed in place), `attention_scaling` or the dtype changes, or a position lies past its end."""
    if ("dynamic" in rotary.rope_type or rotary.rope_type == "longrope" or not isinstance(position_ids, torch.Tensor)
            or position_ids.device.type != "cpu" or x.device.type != "cpu" or position_ids.dim() != 2
            or position_ids.numel() > _TABLE_TOKENS or position_ids.dtype != torch.long
            or torch.compiler.is_compiling()):
        return None
    positions = position_ids.reshape(-1)
    ids = positions.tolist()
    inv_freq = rotary.inv_freq
    fits = _TABLE_BYTES // (4 * max(1, inv_freq.numel()) * max(4, x.element_size()))  # cos and sin rows
    last = max(ids, default=-1)
    if last < 0 or min(ids) < 0 or last >= fits:
        return None
    key = (inv_freq.data_ptr(), inv_freq._version, inv_freq.dtype, rotary.attention_scaling, x.dtype)
    table = rotary.__dict__.get("_rope_table")
    if table is None or table[0] != key or last >= table[1].shape[0]:
        length = min(fits, max(64, 2 * last + 2))  # doubled as positions grow: each made again O(1) times
        with torch.inference_mode(False), torch.no_grad():  # plain tensors, usable outside inference mode too
            cos, sin = rotary._compute(x.new_empty(0), torch.arange(length, device="cpu")[None])
        table = rotary.__dict__["_rope_table"] = (key, cos[0], sin[0])
    _, cos, sin = table
    shape = (*position_ids.shape, cos.shape[-1])
    return cos.index_select(0, positions).view(shape), sin.index_select(0, positions).view(shape)
