// A decode step of generate's loop from its tokens: the embedding, every decoder layer and the final norm in one call.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ decode tokens
// decode_loop._StackSession's step: x = embed[ids] (nn.Embedding's forward: the rows copied), the rotary rows of
// `position` (cos and sin the tables [positions, r], every sequence at that position) or cos and sin as decode_stack
// takes them ([N or 1, 1, r], position -1), decode_stack (no mask: every key), then, where `final_norm`, the final
// layer norm (ATen's kernel, the values of torch.layer_norm over the last dimension, as nn.LayerNorm). In Python
// these were four ATen calls around decode_stack (the embedding, two rotary rows, the norm): each took 5-30 us right
// after the LM head, whose 50-100 MB stream evicts their code and data from the caches, where the same calls take
// 2-5 us warm (MF-small bfloat16 on the 2-vCPU Zen 4 of docs/performance.md: the embedding 24-45 us, the norm
// 22-35 us, per step). A token outside [0, embeddings) writes nothing and returns an empty output and no keys or
// values (a 1-D output, where a step's is [N, hidden]): the caller declines the step, and the module path raises
// its error.
std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> decode_tokens_op(
    const at::Tensor& ids, const at::Tensor& embed, at::TensorList keys, at::TensorList values, const at::Tensor& cos,
    const at::Tensor& sin, int64_t position, int64_t num_heads, double scaling,
    const c10::List<std::optional<at::Tensor>>& tensors, at::ArrayRef<double> floats, at::IntArrayRef ints,
    at::IntArrayRef owned, bool final_norm, const std::optional<at::Tensor>& norm_weight,
    const std::optional<at::Tensor>& norm_bias, double norm_eps) {
  const char* op = "memoryformer.decode_tokens";
  TORCH_CHECK(ids.dim() == 2 && ids.size(1) == 1 && ids.scalar_type() == at::kLong && ids.device().is_cpu(), op,
              ": ids must be one int64 token per sequence [N, 1] on the CPU, got ", ids.sizes(), " ",
              ids.scalar_type());
  TORCH_CHECK(embed.dim() == 2 && embed.device().is_cpu() && embed.stride(1) == 1, op, ": the embedding must be a CPU "
              "matrix [embeddings, hidden] with contiguous rows, got ", embed.sizes(), " strides ", embed.strides());
  const int64_t N = ids.size(0), V = embed.size(0), d = embed.size(1);
  const at::Tensor tokens = ids.contiguous();
  const int64_t* t = tokens.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    if (t[n] < 0 || t[n] >= V) return {at::empty({0}, embed.options()), {}, {}};
  at::Tensor x = at::empty({N, d}, embed.options());
  const int64_t row = d * static_cast<int64_t>(embed.element_size());
  const char* from = static_cast<const char*>(embed.data_ptr());
  for (int64_t n = 0; n < N; ++n)
    std::memcpy(static_cast<char*>(x.data_ptr()) + n * row, from + t[n] * embed.stride(0) * embed.element_size(), row);
  at::Tensor c = cos, s = sin;
  if (position >= 0) {
    TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && position < cos.size(0), op, ": with a position, cos "
                "and sin must be the rotary tables [positions, r] holding it, got ", cos.sizes(), " and ", sin.sizes(),
                " for position ", position);
    c = cos.narrow(0, position, 1).reshape({1, 1, cos.size(1)});
    s = sin.narrow(0, position, 1).reshape({1, 1, sin.size(1)});
  }
  auto [h, new_keys, new_values] = decode_stack_op(x, keys, values, std::nullopt, c, s, num_heads, scaling, tensors,
                                                   floats, ints, owned);
  if (final_norm) h = aten_layer_norm(h, norm_weight, norm_bias, norm_eps);
  return {h, std::move(new_keys), std::move(new_values)};
}
