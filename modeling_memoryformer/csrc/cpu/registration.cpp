// The end of the anonymous namespace and the op registration (CPU kernels only: the schemas are defined in Python).
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

}  // namespace

// One indirection so that MEMORYFORMER_OPS is expanded before TORCH_LIBRARY_IMPL pastes it into names.
#define MEMORYFORMER_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

// The schemas are defined in Python (memory_op_library.py, OP_SCHEMAS) before this library is loaded.
MEMORYFORMER_LIBRARY_IMPL(MEMORYFORMER_OPS, CPU, m) {
  m.impl("hash", &hash_op);
  m.impl("hash_backward", &hash_backward_op);
  m.impl("lookup", &lookup_op);
  m.impl("lookup_strategy", &lookup_strategy_op);
  m.impl("lookup_backward", &lookup_backward_op);
  m.impl("lookup_backward_rows", &lookup_backward_rows_op);
  m.impl("int8_lookup", &int8_lookup_op);
  m.impl("linear_rows", &linear_rows_op);
  m.impl("argmax_rows", &argmax_rows_op);
  m.impl("linear_rows_argmax", &linear_rows_argmax_op);
  m.impl("decode_attention", &decode_attention_op);
  m.impl("decode_layer_norm", &decode_layer_norm_op);
  m.impl("decode_qkv", &decode_qkv_op);
  m.impl("decode_block", &decode_block_op);
  m.impl("decode_stack", &decode_stack_op);
  m.impl("decode_stack_static", &decode_stack_static_op);
  m.impl("decode_session_open", &decode_session_open_op);
  m.impl("decode_session_step", &decode_session_step_op);
  m.impl("rowwise_adagrad_step", &rowwise_adagrad_step_op);
  m.impl("adam_rowwise_step", &adam_rowwise_step_op);
}

// The kernel's own facts and settings take no tensor, so the dispatcher has no device to choose by: they are
// registered for every backend.
MEMORYFORMER_LIBRARY_IMPL(MEMORYFORMER_OPS, CompositeExplicitAutograd, m) {
  m.impl("linear_rows_max", &linear_rows_max_op);
  m.impl("linear_rows_balance", &linear_rows_balance_op);
  m.impl("linear_rows_prefetch", &linear_rows_prefetch_op);
  m.impl("decode_session_close", &decode_session_close_op);
  m.impl("release_gradient_pool", &release_gradient_pool);
  m.impl("isa", &isa_op);
  m.impl("machine_info", &machine_info_op);
  m.impl("set_cache_sizes", &set_cache_sizes_op);
  m.impl("plan", &plan_op);
  m.impl("lookup_strategies", &lookup_strategies_op);
}
