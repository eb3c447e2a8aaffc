// A decode step over transformers' StaticCache: every decoder layer in one call.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ static stack
// decode_stack for a cache of fixed buffers (transformers' StaticCache, the cache of the compiled decode step):
// keys[l] and values[l] are layer l's buffers [N, heads, T, D] and lengths[l] its count of positions written (a
// one-element int64 tensor, StaticLayer.cumulative_length). Per layer, as StaticLayer.update and the modules' decode
// attention do: the new key and value are written at position lengths[l] of the buffers (index_copy_ at
// arange(1) + cumulative_length), lengths[l] is advanced by one, and the attention reads the whole buffers under
// `mask` (the positions not yet written are masked). The rest is decode_stack's (`stack_layers`: decode_qkv and
// decode_block, the lean layer where it applies), so the values are the per-layer step's. The buffers and the
// lengths are written in place (the schema marks them mutable, so that torch.compile keeps the writes); returns the
// last layer's output [N, d].
at::Tensor decode_stack_static_op(const at::Tensor& x, at::TensorList keys, at::TensorList values,
                                  at::TensorList lengths, const std::optional<at::Tensor>& mask, const at::Tensor& cos,
                                  const at::Tensor& sin, int64_t num_heads, double scaling,
                                  const c10::List<std::optional<at::Tensor>>& tensors, at::ArrayRef<double> floats,
                                  at::IntArrayRef ints) {
  const char* op = "memoryformer.decode_stack_static";
  const int64_t L = static_cast<int64_t>(keys.size());
  TORCH_CHECK(static_cast<int64_t>(values.size()) == L && static_cast<int64_t>(lengths.size()) == L, op, ": for ", L,
              " layers of keys, expected as many values and lengths, got ", values.size(), " and ", lengths.size());
  TORCH_CHECK(x.dim() == 2 && num_heads >= 1 && x.size(1) % num_heads == 0, op, ": x must be [N, hidden] with hidden "
              "a multiple of num_heads ", num_heads, ", got ", x.sizes());
  const int64_t N = x.size(0), d = x.size(1), D = d / num_heads;
  std::vector<int64_t> positions(L);
  for (int64_t l = 0; l < L; ++l) {  // every layer checked before any is written: no half-written step
    const at::Tensor &k = keys[l], &v = values[l], &length = lengths[l];
    TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && k.size(0) == N && k.size(1) == num_heads &&
                k.size(3) == D && k.scalar_type() == x.scalar_type() && v.scalar_type() == x.scalar_type() &&
                k.device().is_cpu() && v.device().is_cpu(), op, ": layer ", l, "'s keys and values must be CPU "
                "buffers [", N, ", ", num_heads, ", T, ", D, "] in x's dtype ", x.scalar_type(), ", got ", k.sizes(),
                " ", k.scalar_type(), " and ", v.sizes(), " ", v.scalar_type());
    TORCH_CHECK(length.numel() == 1 && length.scalar_type() == at::kLong && length.device().is_cpu(), op, ": layer ",
                l, "'s length must be one int64 on the CPU, got ", length.sizes(), " ", length.scalar_type());
    positions[l] = length.item<int64_t>();
    TORCH_CHECK(0 <= positions[l] && positions[l] < k.size(2), op, ": layer ", l, " has ", positions[l], " of its ",
                k.size(2), " positions written: no room for another (a longer static cache, max_cache_len, holds "
                "more)");
  }
  return stack_layers(op, x, L, cos, sin, num_heads, tensors, floats, ints,
                      [&](int64_t l, const at::Tensor& qkv, bool, LeanScratch&) {
    const at::Tensor &k = keys[l], &v = values[l];
    const auto parts = qkv.view({N, 1, 3, num_heads, D}).permute({2, 0, 3, 1, 4});  // [3, N, heads, 1, D]
    k.narrow(2, positions[l], 1).copy_(parts[1]);
    v.narrow(2, positions[l], 1).copy_(parts[2]);
    lengths[l].add_(1);
    return decode_attention_op(parts[0], k, v, mask, scaling).reshape({N, 1, d}).contiguous().view({N, d});
  });
}
