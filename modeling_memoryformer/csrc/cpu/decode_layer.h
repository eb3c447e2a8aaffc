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

// The block norm: "layernorm" (ATen's layer_norm, as nn.LayerNorm; into: see aten_layer_norm) or "rmsnorm"
// (MemoryFormerRMSNorm's ops).
at::Tensor decode_norm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       double eps, c10::string_view kind, at::Tensor* into = nullptr) {
  if (kind == "rmsnorm") {
    const auto dtype = x.scalar_type();
    auto h = x.to(at::promote_types(dtype, at::kFloat));
    h = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
    return weight * h.to(dtype);
  }
  TORCH_CHECK(kind == "layernorm", "memoryformer.decode_layer: unknown norm '", std::string(kind), "' (the config's "
              "norm_type takes 'layernorm' or 'rmsnorm')");
  return aten_layer_norm(x, weight, bias, eps, into);
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
// element-wise ops round them (a 16-bit T computes each in float32 and rounds it to T, which leaves no product to fuse
// into the sum; float32 products are stored before the sum, so that no fused multiply-add changes a bit). The two
// halves in separate loops (rotate_half's sign, no branch per value). With volatile stores on the 16-bit path too,
// the rotation took 1.7 us per layer of MF-small (24 heads of 16 rotated dims), about 20 us of a decode step.
template <typename T>
void rotate_heads(T* x, const T* cos, const T* sin, int64_t heads, int64_t D, int64_t r) {
  using A = typename Acc<T>::type;
  const int64_t half = r / 2;
  A rotated[512];
  const auto rotate = [&](const T* xh, int64_t j, A other) {
    if constexpr (std::is_same_v<T, A>) {
      volatile A a = xh[j] * cos[j];
      volatile A b = other * sin[j];
      return A(a + b);
    } else {
      const A a = A(T(A(xh[j]) * A(cos[j])));
      const A b = A(T(other * A(sin[j])));
      return A(T(a + b));
    }
  };
  for (int64_t h = 0; h < heads; ++h) {
    T* xh = x + h * D;
    for (int64_t j = 0; j < half; ++j) rotated[j] = rotate(xh, j, -A(xh[j + half]));
    for (int64_t j = half; j < r; ++j) rotated[j] = rotate(xh, j, A(xh[j - half]));
    for (int64_t j = 0; j < r; ++j) xh[j] = T(rotated[j]);
  }
}

// The Q and K heads of qkv [N, 3d] (contiguous) rotated in place by cos and sin ([N or 1, 1, r], checked by the
// caller), `num_heads` heads of d / num_heads each.
void rotate_qk(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads) {
  const int64_t N = qkv.size(0), d = qkv.size(1) / 3, D = d / num_heads, r = cos.size(-1);
  if (r == 0) return;
  const auto c = cos.contiguous(), s = sin.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "memoryformer_decode_qkv", [&] {
    for (int64_t n = 0; n < N; ++n) {
      const int64_t pos = c.size(0) == 1 ? 0 : n;
      rotate_heads<scalar_t>(qkv.data_ptr<scalar_t>() + n * 3 * d, c.data_ptr<scalar_t>() + pos * r,
                             s.data_ptr<scalar_t>() + pos * r, 2 * num_heads, D, r);
    }
  });
}

// Whether cos and sin are what decode_qkv rotates N rows of heads of width D by: [N or 1, 1, r] in `dtype`, r even,
// r <= D and r <= 512.
bool rotary_fits(const at::Tensor& cos, const at::Tensor& sin, int64_t N, int64_t D, at::ScalarType dtype) {
  if (cos.dim() != 3) return false;
  const int64_t r = cos.size(-1);
  return sin.sizes() == cos.sizes() && (cos.size(0) == N || cos.size(0) == 1) && cos.size(1) == 1 && r % 2 == 0 &&
         r <= D && r <= 512 && cos.scalar_type() == dtype && sin.scalar_type() == dtype;
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
  const int64_t D = d / num_heads;
  TORCH_CHECK(rotary_fits(cos, sin, N, D, x.scalar_type()), op, ": cos and sin must be [", N, " or 1, 1, r] in x's "
              "dtype with an even r <= head_dim ", D, ", got ", cos.sizes(), " ", cos.scalar_type(), " and ",
              sin.sizes());
  auto qkv = decode_memory_layer(decode_norm(x, norm_weight, norm_bias, eps, norm).contiguous(), tables, bias, tau,
                                 score, temperature);
  TORCH_CHECK(qkv.size(1) == 3 * d && qkv.is_contiguous(), op, ": the tables must have 3 * hidden = ", 3 * d,
              " columns, got ", qkv.size(1));
  rotate_qk(qkv, cos, sin, num_heads);
  return qkv;
}

// The decoder layer's step after its attention, in the order the modules run it: h = x + attn, the post-attention
// norm (of h, or of x with a parallel residual), Memory Layer 1, GELU where the block has it, the inner norm, Memory
// Layer 2, then h + its output. `steps` supplies the residual adds, add(a, b, last) = a + b (`last`: the final add,
// which may write into a), the Memory Layers, layer(x, 1 or 2), and the norms' outputs, norm_into(1 or 2) (a scratch
// tensor or nullptr: see aten_layer_norm): decode_block's ATen ops, or the lean layer's kernels and loops, which give
// the same values.
template <typename Steps>
at::Tensor block_step(const at::Tensor& x, const at::Tensor& attn, const at::Tensor& norm_weight,
                      const std::optional<at::Tensor>& norm_bias, double eps, c10::string_view norm,
                      bool parallel_residual, bool gelu, const at::Tensor& inner_weight,
                      const std::optional<at::Tensor>& inner_bias, double inner_eps, Steps& steps) {
  const auto h = steps.add(x, attn, false);
  auto y = steps.layer(decode_norm(parallel_residual ? x : h, norm_weight, norm_bias, eps, norm, steps.norm_into(1))
                           .contiguous(), 1);
  if (gelu) y = at::gelu(y);
  y = aten_layer_norm(y, inner_weight, inner_bias, inner_eps, steps.norm_into(2)).contiguous();
  return steps.add(h, steps.layer(y, 2), true);
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
  struct Steps {   // ATen's add and the Memory Layer ops
    const at::Tensor &t1, &t2;
    const std::optional<at::Tensor>&b1, &b2;
    int64_t tau1, tau2;
    c10::string_view score;
    double temperature;
    at::Tensor add(const at::Tensor& a, const at::Tensor& b, bool) { return a + b; }
    at::Tensor* norm_into(int) { return nullptr; }
    at::Tensor layer(const at::Tensor& in, int which) {
      return which == 1 ? decode_memory_layer(in, t1, b1, tau1, score, temperature)
                        : decode_memory_layer(in, t2, b2, tau2, score, temperature);
    }
  } steps{tables1, tables2, bias1, bias2, tau1, tau2, score, temperature};
  return block_step(x, attn, norm_weight, norm_bias, eps, norm, parallel_residual, gelu, inner_weight, inner_bias,
                    inner_eps, steps);
}

// ------------------------------------------------------------------------------------------------ lean stack layer
// decode_stack runs a layer whose Memory Layers have floating tables of the hidden states' dtype, at most
// kSmallBatch sequences, with the hash and token-major lookup kernels called directly and the residual adds as plain
// loops: the values of decode_qkv and decode_block (the lookup op takes the token-major kernel for so few tokens, and
// ATen's add of two float32, bfloat16 or float16 tensors is one float32 sum rounded once), without the ops' argument
// checks, strategy choice and about ten allocations and dispatches per layer. Operands it does not take (int8
// tables, another dtype, a shape the ops would refuse) go to decode_qkv and decode_block, which say what is wrong.
struct LeanScratch {
  std::vector<int64_t> rows;
  std::vector<float> scores;
  at::Tensor qkv, y1, y2, attn;   // reused by every layer of one call (shapes checked by lean_tables)
  at::Tensor normed, inner;       // the norms' outputs [N, d] and [N, d1] (aten_layer_norm's rows path writes them)
  at::Tensor residual[2];         // the layers' outputs h in turn: a layer's input is the other one (or the call's x)
};

// Whether a Memory Layer of `in` inputs and `out` outputs runs lean: tables [K << tau, out] of `dtype`, contiguous,
// K = in / tau, a positive temperature, a bias [out] of `dtype` or none.
bool lean_tables(const at::Tensor& tables, const std::optional<at::Tensor>& bias, int64_t in, int64_t out, int64_t tau,
                 double temperature, at::ScalarType dtype) {
  if (tau < 1 || tau > 16 || in % tau != 0 || !(temperature > 0)) return false;
  if (!tables.defined() || tables.scalar_type() != dtype || tables.dim() != 2 || !tables.is_contiguous() ||
      !tables.device().is_cpu() || tables.size(0) != ((in / tau) << tau) || tables.size(1) != out)
    return false;
  return !(bias.has_value() && bias->defined()) ||
         (bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == out && bias->is_contiguous() &&
          bias->device().is_cpu());
}

// out [N, D] = the Memory Layer on x [N, in] (contiguous): hash_kernel, then lookup_kernel (`lean_tables` holds).
template <typename T>
void lean_memory_layer_as(const at::Tensor& x, const at::Tensor& tables, const std::optional<at::Tensor>& bias,
                          int64_t tau, bool l1, double temperature, at::Tensor& out, LeanScratch& s) {
  const int64_t N = x.size(0), K = x.size(1) / tau, D = tables.size(1);
  s.rows.resize(N * K);
  s.scores.resize(N * K);
  hash_kernel<T>(x.data_ptr<T>(), s.rows.data(), s.scores.data(), N, K, tau, l1, temperature);
  const T* b = bias.has_value() && bias->defined() ? bias->data_ptr<T>() : nullptr;
  lookup_kernel<T>(s.rows.data(), s.scores.data(), tables.data_ptr<T>(), b, out.data_ptr<T>(), N, K, D);
}

void lean_memory_layer(const at::Tensor& x, const at::Tensor& tables, const std::optional<at::Tensor>& bias,
                       int64_t tau, bool l1, double temperature, at::Tensor& out, LeanScratch& s) {
  switch (x.scalar_type()) {   // the dtypes decode_stack runs lean
    case at::kFloat: lean_memory_layer_as<float>(x, tables, bias, tau, l1, temperature, out, s); break;
    case at::kBFloat16: lean_memory_layer_as<c10::BFloat16>(x, tables, bias, tau, l1, temperature, out, s); break;
    default: lean_memory_layer_as<c10::Half>(x, tables, bias, tau, l1, temperature, out, s); break;
  }
}

// out = a + b (contiguous, one shape and dtype; out may be a): each sum in float32, rounded once to the dtype.
void lean_add(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  const int64_t n = a.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), "memoryformer_lean_add", [&] {
    using A = typename Acc<scalar_t>::type;
    const scalar_t* pa = a.data_ptr<scalar_t>();
    const scalar_t* pb = b.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    for (int64_t i = 0; i < n; ++i) po[i] = static_cast<scalar_t>(A(pa[i]) + A(pb[i]));
  });
}

// decode_block's value for x and attn [N, d] (contiguous): block_step with the lean Memory Layers (into the scratch
// outputs) and adds (the last one in place).
at::Tensor lean_block(const at::Tensor& x, const at::Tensor& attn, const at::Tensor& norm_weight,
                      const std::optional<at::Tensor>& norm_bias, double eps, c10::string_view norm,
                      bool parallel_residual, const at::Tensor& tables1, const std::optional<at::Tensor>& bias1,
                      int64_t tau1, bool gelu, const at::Tensor& inner_weight,
                      const std::optional<at::Tensor>& inner_bias, double inner_eps, const at::Tensor& tables2,
                      const std::optional<at::Tensor>& bias2, int64_t tau2, bool l1, double temperature,
                      LeanScratch& s) {
  const int64_t N = x.size(0);
  if (!s.y1.defined() || s.y1.size(0) != N || s.y1.size(1) != tables1.size(1))
    s.y1 = at::empty({N, tables1.size(1)}, x.options());
  if (!s.y2.defined() || s.y2.size(0) != N || s.y2.size(1) != tables2.size(1))
    s.y2 = at::empty({N, tables2.size(1)}, x.options());
  struct Steps {
    const at::Tensor &t1, &t2;
    const std::optional<at::Tensor>&b1, &b2;
    int64_t tau1, tau2;
    bool l1;
    double temperature;
    LeanScratch& s;
    at::Tensor add(const at::Tensor& a, const at::Tensor& b, bool last) {
      at::Tensor out = a;
      if (!last) {   // h = x + attn into the residual buffer that is not x's
        at::Tensor& r = s.residual[s.residual[0].defined() && s.residual[0].data_ptr() == a.data_ptr() ? 1 : 0];
        if (!r.defined() || r.sizes() != a.sizes()) r = at::empty(a.sizes(), a.options());
        out = r;
      }
      lean_add(a, b, out);
      return out;
    }
    at::Tensor* norm_into(int which) { return which == 1 ? &s.normed : &s.inner; }
    at::Tensor layer(const at::Tensor& in, int which) {
      at::Tensor& out = which == 1 ? s.y1 : s.y2;
      lean_memory_layer(in, which == 1 ? t1 : t2, which == 1 ? b1 : b2, which == 1 ? tau1 : tau2, l1, temperature,
                        out, s);
      return out;
    }
  } steps{tables1, tables2, bias1, bias2, tau1, tau2, l1, temperature, s};
  return block_step(x, attn, norm_weight, norm_bias, eps, norm, parallel_residual, gelu, inner_weight, inner_bias,
                    inner_eps, steps);
}

// The layers of a decode step as decode_stack and decode_stack_static run them: per layer decode_qkv (the lean layer
// where it applies), then `attend(l, qkv, lean, scratch)`, which puts the layer's new key and value into its cache and
// returns the attention [N, d], then decode_block. The operands come flat, as decode_stack's comment says.
template <typename Attend>
at::Tensor stack_layers(const char* op, const at::Tensor& x, int64_t L, const at::Tensor& cos, const at::Tensor& sin,
                        int64_t num_heads, const c10::List<std::optional<at::Tensor>>& tensors,
                        at::ArrayRef<double> floats, at::IntArrayRef ints, Attend&& attend) {
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) == 12 * L && static_cast<int64_t>(floats.size()) == 5 * L &&
              static_cast<int64_t>(ints.size()) == 9 * L, op, ": for ", L, " layers, expected 12 tensors, 5 floats "
              "and 9 ints per layer, got ", tensors.size(), ", ", floats.size(), " and ", ints.size());
  TORCH_CHECK(x.dim() == 2 && num_heads >= 1 && x.size(1) % num_heads == 0, op, ": x must be [N, hidden] with hidden "
              "a multiple of num_heads ", num_heads, ", got ", x.sizes());
  const int64_t N = x.size(0), d = x.size(1), D = d / num_heads;
  static const c10::string_view norms[] = {"layernorm", "rmsnorm"}, scores[] = {"paper", "l1"};
  auto pick = [&](const c10::string_view* names, int64_t i) {
    TORCH_CHECK(i == 0 || i == 1, op, ": a norm kind or score code is 0 or 1, got ", i);
    return names[i];
  };
  auto tensor = [&](int64_t i) { return tensors.get(i); };
  auto required = [&](int64_t i) {
    const auto t = tensors.get(i);
    TORCH_CHECK(t.has_value(), op, ": operand ", i % 12, " of layer ", i / 12, " is required");
    return *t;
  };
  at::Tensor h = x;
  const auto dtype = x.scalar_type();
  // The lean layer takes cos and sin only in the form decode_qkv accepts (else decode_qkv runs each layer and says
  // what is wrong with them).
  const bool lean_batch = N <= kSmallBatch && x.is_contiguous() &&
                          (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) &&
                          rotary_fits(cos, sin, N, D, dtype);
  LeanScratch scratch;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t t = 12 * l, f = 5 * l, i = 9 * l;
    const at::Tensor tables_qkv = required(t + 2), tables1 = required(t + 6), tables2 = required(t + 10);
    const int64_t d1 = tables1.dim() == 2 ? tables1.size(1) : -1;
    const bool lean = lean_batch && d1 > 0 &&
                      lean_tables(tables_qkv, tensor(t + 3), d, 3 * d, ints[i + 1], floats[f + 1], dtype) &&
                      lean_tables(tables1, tensor(t + 7), d, d1, ints[i + 5], floats[f + 4], dtype) &&
                      lean_tables(tables2, tensor(t + 11), d1, d, ints[i + 7], floats[f + 4], dtype) &&
                      (ints[i + 2] == 0 || ints[i + 2] == 1) && (ints[i + 8] == 0 || ints[i + 8] == 1);
    at::Tensor qkv;
    if (lean) {
      if (!scratch.qkv.defined()) scratch.qkv = at::empty({N, 3 * d}, x.options());
      qkv = scratch.qkv;
      lean_memory_layer(decode_norm(h, required(t), tensor(t + 1), floats[f], pick(norms, ints[i]), &scratch.normed)
                            .contiguous(),
                        tables_qkv, tensor(t + 3), ints[i + 1], ints[i + 2] == 1, floats[f + 1], qkv, scratch);
      rotate_qk(qkv, cos, sin, num_heads);
    } else {
      qkv = decode_qkv_op(h, required(t), tensor(t + 1), floats[f], pick(norms, ints[i]), tables_qkv, tensor(t + 3),
                          ints[i + 1], pick(scores, ints[i + 2]), floats[f + 1], cos, sin, num_heads);
    }
    const at::Tensor attn = attend(l, qkv, lean, scratch);
    if (lean)
      h = lean_block(h, attn, required(t + 4), tensor(t + 5), floats[f + 2], pick(norms, ints[i + 3]),
                     ints[i + 4] != 0, tables1, tensor(t + 7), ints[i + 5], ints[i + 6] != 0, required(t + 8),
                     tensor(t + 9), floats[f + 3], tables2, tensor(t + 11), ints[i + 7], ints[i + 8] == 1,
                     floats[f + 4], scratch);
    else
      h = decode_block_op(h, attn, required(t + 4), tensor(t + 5), floats[f + 2], pick(norms, ints[i + 3]),
                          ints[i + 4] != 0, tables1, tensor(t + 7), ints[i + 5], ints[i + 6] != 0,
                          required(t + 8), tensor(t + 9), floats[f + 3], tables2, tensor(t + 11), ints[i + 7],
                          pick(scores, ints[i + 8]), floats[f + 4]);
  }
  return h;
}

// Every decoder layer of a decode step in one call, for a cache whose layers grow by concatenation (transformers'
// DynamicCache: DynamicLayer.update is torch.cat([keys, new], dim=-2)): per layer, decode_qkv, the cache's growth
// (grow_cache: the values of that cat, in place where `owned[l]` allows), the decode attention and decode_block, the
// same ops in the same order as decode_layer.py's per-layer step, without the Python between them (about 150 us per
// layer of MF-small). keys[l] and values[l] are layer l's cache [N, heads, T, D]; the layers' operands come flat:
// `tensors` 12 per layer (norm1 weight and bias, Q/K/V tables and bias, norm2 weight and bias, layer1 tables and
// bias, inner norm weight and bias, layer2 tables and bias), `floats` 5 (norm1 eps, Q/K/V temperature, norm2 eps,
// inner eps, block temperature) and `ints` 9 (norm1 kind, Q/K/V hash bits, Q/K/V score, norm2 kind, parallel
// residual, layer1 hash bits, gelu, layer2 hash bits, block score), a kind being 0 = layernorm, 1 = rmsnorm and a
// score 0 = paper, 1 = l1. `owned` holds one flag per layer (or none: no layer owned). Returns the last layer's
// output and every layer's grown keys and values, which the caller stores in its cache.
std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> decode_stack_op(
    const at::Tensor& x, at::TensorList keys, at::TensorList values, const std::optional<at::Tensor>& mask,
    const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, double scaling,
    const c10::List<std::optional<at::Tensor>>& tensors, at::ArrayRef<double> floats, at::IntArrayRef ints,
    at::IntArrayRef owned) {
  const char* op = "memoryformer.decode_stack";
  const int64_t L = static_cast<int64_t>(keys.size());
  TORCH_CHECK(static_cast<int64_t>(values.size()) == L, op, ": for ", L, " layers of keys, expected as many values, "
              "got ", values.size());
  TORCH_CHECK(owned.empty() || static_cast<int64_t>(owned.size()) == L, op, ": owned must hold one flag per layer (",
              L, ") or none, got ", owned.size());
  std::vector<at::Tensor> new_keys, new_values;
  new_keys.reserve(L);
  new_values.reserve(L);
  const bool masked = mask.has_value() && mask->defined();
  at::Tensor h = stack_layers(op, x, L, cos, sin, num_heads, tensors, floats, ints,
                              [&](int64_t l, const at::Tensor& qkv, bool lean, LeanScratch& scratch) {
    const int64_t N = x.size(0), d = x.size(1), D = d / num_heads;
    const bool own = !owned.empty() && owned[l] != 0;
    TORCH_CHECK(keys[l].dim() == 4 && values[l].sizes() == keys[l].sizes() && keys[l].size(0) == N &&
                keys[l].size(1) == num_heads && keys[l].size(3) == D && keys[l].scalar_type() == x.scalar_type() &&
                values[l].scalar_type() == x.scalar_type(), op, ": layer ", l, "'s keys and values must be [", N,
                ", ", num_heads, ", T, ", D, "] in x's dtype ", x.scalar_type(), ", got ", keys[l].sizes(), " ",
                keys[l].scalar_type(), " and ", values[l].sizes(), " ", values[l].scalar_type());
    if (lean && !masked) {
      // qkv [N, 3, heads, D] (contiguous) read in place: the new keys and values grown into the cache, the attention
      // written into the scratch [N, d] ([N, 1, heads, D] as decode_attention gives it): the values of the op path
      // below, without its views and checks.
      const char* src = static_cast<const char*>(qkv.data_ptr());
      const int64_t esize = static_cast<int64_t>(qkv.element_size());
      new_keys.push_back(grow_cache_from(keys[l], src + d * esize, 3 * d, D, 1, grows_in_place(keys[l], own)));
      new_values.push_back(grow_cache_from(values[l], src + 2 * d * esize, 3 * d, D, 1,
                                           grows_in_place(values[l], own)));
      if (!scratch.attn.defined()) scratch.attn = at::empty({N, d}, x.options());
      decode_attention_into(qkv.data_ptr(), 3 * d, D, new_keys.back(), new_values.back(), num_heads, float(scaling),
                            nullptr, nullptr, scratch.attn.data_ptr());
      return scratch.attn;
    }
    const auto parts = qkv.view({N, 1, 3, num_heads, D}).permute({2, 0, 3, 1, 4});  // [3, N, heads, 1, D]
    new_keys.push_back(grow_cache(keys[l], parts[1], own));
    new_values.push_back(grow_cache(values[l], parts[2], own));
    return decode_attention_op(parts[0], new_keys.back(), new_values.back(), mask, scaling)
        .reshape({N, 1, d}).contiguous().view({N, d});
  });
  return {h, new_keys, new_values};
}
