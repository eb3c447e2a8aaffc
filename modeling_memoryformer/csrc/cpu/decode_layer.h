// A decoder layer's decode step in two calls: decode_qkv and decode_block.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ decode layer
// A decode step runs about 25 small ops per decoder layer (norms, hashes, lookups, the rotation, views, residual
// adds) through the Python module tree, each a few microseconds of dispatch for a few hundred bytes of work, while
// the layer's bytes (its K table rows per Memory Layer) take about 100 us: most of a step of MF-small went to the
// calls. Here the layer is two calls around the KV cache update and the attention, which stay in Python (the cache
// may be any transformers Cache):
//   decode_qkv:   input norm -> Q/K/V Memory Layer -> rotary on the Q and K heads             (before the cache)
//   decode_block: + attention output -> post-attention norm -> Memory Block -> + residual      (after the attention)
// Every step is the op the Python modules run, in their order and dtype (ATen's layer_norm and add, the kernel's hash
// and lookup, the rotation with the roundings of its element-wise ops), so the layer's output is bit-identical to the
// modules' (tests compare the two).

// The block norm: "layernorm" (ATen's layer_norm, as nn.LayerNorm) or "rmsnorm" (MemoryFormerRMSNorm's ops).
at::Tensor decode_norm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       double eps, c10::string_view kind) {
  if (kind == "rmsnorm") {
    const auto dtype = x.scalar_type();
    auto h = x.to(at::promote_types(dtype, at::kFloat));
    h = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
    return weight * h.to(dtype);
  }
  TORCH_CHECK(kind == "layernorm", "memoryformer.decode_layer: unknown norm '", std::string(kind), "' (the config's "
              "norm_type takes 'layernorm' or 'rmsnorm')");
  return at::layer_norm(x, {x.size(-1)}, weight, bias, eps);
}

// A Memory Layer on x [N, d] (contiguous): the hash and lookup ops (memory_ops.inference_lookup), or the hash and
// int8_lookup ops on an int8 block (uint8 [K * 2**tau, D + 8], quantization.int8_inference_lookup).
at::Tensor decode_memory_layer(const at::Tensor& x, const at::Tensor& tables, const std::optional<at::Tensor>& bias,
                               int64_t tau, c10::string_view score, double temperature) {
  auto [rows, scores] = hash_op(x, tau, score, temperature);
  const int64_t per_table = tables.size(0) / rows.size(1);
  if (tables.scalar_type() == at::kByte)
    return int8_lookup_op(rows, scores.to(at::kFloat), tables, bias, per_table).to(x.scalar_type());
  return lookup_op(rows, scores, tables, bias, per_table);
}

// The rotary embedding in place on the first r dims of each of the `heads` heads (of width D) of one token's row,
// as rotate_in_place_: x_rot * cos + rotate_half(x_rot) * sin, each product and the sum rounded to T as the three
// element-wise ops round them (a 16-bit T computes each in float32; float32 products are stored before the sum, so
// that no fused multiply-add changes a bit).
template <typename T>
void rotate_heads(T* x, const T* cos, const T* sin, int64_t heads, int64_t D, int64_t r) {
  using A = typename Acc<T>::type;
  const int64_t half = r / 2;
  A rotated[512];
  for (int64_t h = 0; h < heads; ++h) {
    T* xh = x + h * D;
    for (int64_t j = 0; j < r; ++j) {
      const A other = j < half ? -A(xh[j + half]) : A(xh[j - half]);
      volatile A a = A(T(A(xh[j]) * A(cos[j])));
      volatile A b = A(T(other * A(sin[j])));
      rotated[j] = A(T(a + b));
    }
    for (int64_t j = 0; j < r; ++j) xh[j] = T(rotated[j]);
  }
}

// x [N, d] (one position of N sequences) -> [N, 3d] = the Q/K/V Memory Layer on norm(x), Q and K rotated by cos
// and sin ([N or 1, 1, r], r <= head_dim, even) over `num_heads` heads each.
at::Tensor decode_qkv_op(const at::Tensor& x, const at::Tensor& norm_weight, const std::optional<at::Tensor>& norm_bias,
                         double eps, c10::string_view norm, const at::Tensor& tables,
                         const std::optional<at::Tensor>& bias, int64_t tau, c10::string_view score,
                         double temperature, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads) {
  const char* op = "memoryformer.decode_qkv";
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), op, ": x must be a CPU tensor [N, hidden], got shape ", x.sizes());
  const int64_t N = x.size(0), d = x.size(1);
  TORCH_CHECK(num_heads >= 1 && d % num_heads == 0, op, ": hidden size ", d, " is not a multiple of num_heads ",
              num_heads);
  const int64_t D = d / num_heads, r = cos.size(-1);
  TORCH_CHECK(cos.dim() == 3 && sin.sizes() == cos.sizes() && (cos.size(0) == N || cos.size(0) == 1) &&
              cos.size(1) == 1 && r % 2 == 0 && r <= D && r <= 512 && cos.scalar_type() == x.scalar_type() &&
              sin.scalar_type() == x.scalar_type(), op, ": cos and sin must be [", N, " or 1, 1, r] in x's dtype with "
              "an even r <= head_dim ", D, ", got ", cos.sizes(), " ", cos.scalar_type(), " and ", sin.sizes());
  auto qkv = decode_memory_layer(decode_norm(x, norm_weight, norm_bias, eps, norm).contiguous(), tables, bias, tau,
                                 score, temperature);
  TORCH_CHECK(qkv.size(1) == 3 * d && qkv.is_contiguous(), op, ": the tables must have 3 * hidden = ", 3 * d,
              " columns, got ", qkv.size(1));
  if (r == 0) return qkv;
  const auto c = cos.contiguous(), s = sin.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "memoryformer_decode_qkv", [&] {
    for (int64_t n = 0; n < N; ++n) {
      const int64_t pos = c.size(0) == 1 ? 0 : n;
      rotate_heads<scalar_t>(qkv.data_ptr<scalar_t>() + n * 3 * d, c.data_ptr<scalar_t>() + pos * r,
                             s.data_ptr<scalar_t>() + pos * r, 2 * num_heads, D, r);
    }
  });
  return qkv;
}

// x and attn [N, d] -> the decoder layer's output: h = x + attn, then h + MemoryBlock(norm(h)) (sequential residual)
// or h + MemoryBlock(norm(x)) (parallel residual), the Memory Block being layer2(inner_norm(act(layer1(.)))) with act
// GELU or none.
at::Tensor decode_block_op(const at::Tensor& x, const at::Tensor& attn, const at::Tensor& norm_weight,
                           const std::optional<at::Tensor>& norm_bias, double eps, c10::string_view norm,
                           bool parallel_residual, const at::Tensor& tables1, const std::optional<at::Tensor>& bias1,
                           int64_t tau1, bool gelu, const at::Tensor& inner_weight,
                           const std::optional<at::Tensor>& inner_bias, double inner_eps, const at::Tensor& tables2,
                           const std::optional<at::Tensor>& bias2, int64_t tau2, c10::string_view score,
                           double temperature) {
  const char* op = "memoryformer.decode_block";
  TORCH_CHECK(x.dim() == 2 && attn.sizes() == x.sizes() && x.device().is_cpu(), op, ": x and attn must be CPU "
              "tensors of one shape [N, hidden], got ", x.sizes(), " and ", attn.sizes());
  const auto h = x + attn;
  auto y = decode_memory_layer(decode_norm(parallel_residual ? x : h, norm_weight, norm_bias, eps, norm).contiguous(),
                               tables1, bias1, tau1, score, temperature);
  if (gelu) y = at::gelu(y);
  y = at::layer_norm(y, {y.size(-1)}, inner_weight, inner_bias, inner_eps).contiguous();
  return h + decode_memory_layer(y, tables2, bias2, tau2, score, temperature);
}
