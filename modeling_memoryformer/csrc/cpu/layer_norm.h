// The decode ops' layer norm: ATen's values, without ATen's call where they can be had here.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ layer norm
// A decode step takes three layer norms per decoder layer of one row each. Through ATen (at::native::layer_norm_cpu,
// the kernel of nn.LayerNorm) each took 2.6-2.8 us inside a step of MF-base bfloat16 and 1.6 us warm (three tensors
// allocated, the dispatch stub, code evicted by the step's table and LM head streams), 200-210 us of a 5 ms step
// (benchmarks/results/2026-11-29h-zen4). For bfloat16 rows on x86 CPUs with FMA, rows_layer_norm_bf16 computes the
// same values here: ATen registers no AVX-512 variant of its layer norm kernel, so every x86 CPU with AVX2 runs the
// AVX2 one, which this transcribes operation by operation:
// - the moments (ATen/native/cpu/moments_utils.h, RowwiseMoments): Welford over vectors of 16 bfloat16 values (two
//   vectors of 8 floats each, their own running moments), chunks of 16 vectors merged into a cascade of 8-lane moments,
//   the values past the last whole vector added one by one, then the 8 lanes merged in order;
// - the output: (x * rstd + (-rstd * mean)) * gamma + beta in float32, each multiply-add fused (as GCC contracts
//   ATen's vector expression), rounded to bfloat16 to nearest even (a NaN to 0xffff, as ATen's AVX2 conversion).
// ATen builds with GCC's default contraction, so each multiply-add that its compiled kernel fuses is std::fma here,
// and each that it leaves apart (a product with another use) is kept apart by a volatile store.
// Whether a width gives ATen's bits is checked once per width and process (layer_norm_verified): 16 rows of spread
// values through both, bit for bit; a mismatch (another torch, ATEN_CPU_CAPABILITY=default, another compiler) sends
// every later call to ATen. Other dtypes, rows without a weight and bias, and autocast go to ATen too.

// ATen's AddMomentsVec on one 8-lane vector: the moments (m0, m1, m2) merged with (m0_add, a1, a2).
inline void add_moments8(int64_t m0_add, const float* a1, const float* a2, int64_t& m0, float* m1, float* m2) {
  const int64_t n = m0 + m0_add;
  const float c = n == 0 ? 0.f : float(m0_add) / float(n);
  const float f0 = float(m0);
  for (int l = 0; l < 8; ++l) {
    const float delta = a1[l] - m1[l];
    const float tmp = m2[l] + a2[l];
    volatile float cd_stored = c * delta;   // ATen's c * delta, also a factor of the fused m2: m1's sum not fused
    const float cd = cd_stored;
    m1[l] = m1[l] + cd;
    m2[l] = std::fma(delta * f0, cd, tmp);
  }
  m0 = n;
}

// (mean, biased variance) of X[0, N) as ATen's AVX2 RowwiseMoments<BFloat16> computes them.
inline std::pair<float, float> rowwise_moments_bf16(const c10::BFloat16* X, int64_t N) {
  constexpr int64_t kVec = 16, kChunk = 16, kDepth = 64;
  const int64_t n = N / kVec, m = (n + kChunk - 1) / kChunk;
  int64_t depth = 0;   // utils::CeilLog2(m), which gives 1 for m <= 2: depths 0 and 1 run the same
  while (m > 1 && (int64_t(1) << depth) < m) ++depth;
  int64_t m0s[kDepth] = {0};
  float m1s[kDepth][8] = {}, m2s[kDepth][8] = {};
  for (int64_t i = 0; i < m; ++i) {
    const c10::BFloat16* xp = X + i * kChunk * kVec;
    const int64_t m0 = std::min(kChunk, n - i * kChunk);
    float a1[kVec] = {}, a2[kVec] = {};
    for (int64_t j = 0; j < m0; ++j) {
      const float c = 1.f / float(j + 1);
      const c10::BFloat16* xj = xp + j * kVec;
      for (int64_t l = 0; l < kVec; ++l) {
        const float x = float(xj[l]);
        const float d0 = x - a1[l];
        a1[l] = std::fma(d0, c, a1[l]);
        a2[l] = std::fma(d0, x - a1[l], a2[l]);
      }
    }
    add_moments8(m0, a1, a2, m0s[0], m1s[0], m2s[0]);
    add_moments8(m0, a1 + 8, a2 + 8, m0s[0], m1s[0], m2s[0]);
    int64_t mask = i + 1;
    for (int64_t j = 1; j < depth && (mask & 1) == 0; ++j) {
      add_moments8(m0s[j - 1], m1s[j - 1], m2s[j - 1], m0s[j], m1s[j], m2s[j]);
      m0s[j - 1] = 0;
      for (int l = 0; l < 8; ++l) m1s[j - 1][l] = m2s[j - 1][l] = 0.f;
      mask >>= 1;
    }
  }
  for (int64_t i = 1; i < depth; ++i) add_moments8(m0s[i], m1s[i], m2s[i], m0s[0], m1s[0], m2s[0]);
  int64_t m0 = 0;
  float m1 = 0.f, m2 = 0.f;
  for (int64_t i = n * kVec; i < N; ++i) {
    const float x = float(X[i]);
    const float delta = x - m1;
    ++m0;
    m1 += delta / float(m0);
    m2 = std::fma(delta, x - m1, m2);
  }
  const int64_t m0_add = n * kVec / 8;
  for (int l = 0; l < 8; ++l) {   // ATen's scalar AddMoments
    const int64_t total = m0 + m0_add;
    const float c = total == 0 ? 0.f : float(m0_add) / float(total);
    const float delta = m1s[0][l] - m1;
    m1 = std::fma(c, delta, m1);
    m2 = m2 + std::fma(delta * delta * c, float(m0), m2s[0][l]);
    m0 = total;
  }
  return {m1, m2 / float(N)};
}

inline uint16_t bf16_bits_rounded(float y) {   // to nearest even; a NaN to 0xffff (ATen's AVX2 cvtfp32_bf16)
  uint32_t u;
  std::memcpy(&u, &y, sizeof(u));
  if (y != y) return 0xffff;
  return uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

// y[r] = layer_norm(x[r]) over rows of N bfloat16 values (all contiguous, weight and bias [N]).
void rows_layer_norm_bf16(const c10::BFloat16* x, const c10::BFloat16* weight, const c10::BFloat16* bias, float eps,
                          int64_t rows, int64_t N, c10::BFloat16* y) {
  prefetch_span(weight, N);   // cold after the step's streams: their reads overlap the moments' sums
  prefetch_span(bias, N);
  for (int64_t r = 0; r < rows; ++r) {
    const c10::BFloat16* xr = x + r * N;
    const auto [mean, var] = rowwise_moments_bf16(xr, N);
    const float rstd = 1.f / std::sqrt(var + eps);
    const float shift = -rstd * mean;
    uint16_t* out = reinterpret_cast<uint16_t*>(y + r * N);
    for (int64_t d = 0; d < N; ++d)
      out[d] = bf16_bits_rounded(std::fma(std::fma(float(xr[d]), rstd, shift), float(weight[d]), float(bias[d])));
  }
}

// Set when a width's check fails: every later call goes to ATen.
std::atomic<bool> layer_norm_check_failed{false};

// Whether rows_layer_norm_bf16 gives ATen's bits for width N here (checked at the first call for N).
bool layer_norm_check(int64_t N, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  static std::mutex m;
  static std::map<int64_t, bool> known;
  if (layer_norm_check_failed.load()) return false;
  std::lock_guard<std::mutex> lock(m);
  const auto it = known.find(N);
  if (it != known.end()) return it->second;
  constexpr int64_t kRows = 16;
  auto x = at::empty({kRows, N}, weight.options());
  auto* xp = x.data_ptr<c10::BFloat16>();
  uint64_t state = 0x9e3779b97f4a7c15ull ^ uint64_t(N);
  for (int64_t r = 0; r < kRows; ++r) {   // rows of several scales and offsets, a few of large values
    const float scale = std::ldexp(1.f, int(r % 8) * 3 - 10), offset = float(r % 3) * scale * 4.f;
    for (int64_t d = 0; d < N; ++d) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      const float u = float(state >> 40) / float(1 << 24) - 0.5f;
      xp[r * N + d] = c10::BFloat16(offset + u * scale * (d % 17 == 0 ? 40.f : 1.f));
    }
  }
  const auto ref = std::get<0>(at::native::layer_norm_cpu(x, {N}, weight, bias, eps));
  auto out = at::empty_like(x);
  rows_layer_norm_bf16(xp, weight.data_ptr<c10::BFloat16>(), bias.data_ptr<c10::BFloat16>(), float(eps), kRows, N,
                       out.data_ptr<c10::BFloat16>());
  const bool same = std::memcmp(ref.data_ptr(), out.data_ptr(), size_t(kRows * N) * sizeof(c10::BFloat16)) == 0;
  known.emplace(N, same);
  if (!same) layer_norm_check_failed.store(true);
  return same;
}

bool layer_norm_verified(int64_t N, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  static thread_local int64_t last_verified[2] = {0, 0};   // this thread's last widths found verified
  if ((N == last_verified[0] || N == last_verified[1]) && !layer_norm_check_failed.load(std::memory_order_relaxed))
    return true;
  const bool verified = layer_norm_check(N, weight, bias, eps);
  if (verified) {
    last_verified[1] = last_verified[0];
    last_verified[0] = N;
  }
  return verified;
}

// Whether rows_layer_norm_bf16 applies to x, weight and bias: a build for x86 with FMA, contiguous bfloat16 rows of
// N >= 1 values, weight and bias [N] of that dtype.
bool layer_norm_rows_apply(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& bias) {
#if defined(__x86_64__) && defined(__FMA__)
  const int64_t N = x.dim() >= 1 ? x.size(-1) : 0;
  const auto fits = [&](const std::optional<at::Tensor>& t) {
    return t.has_value() && t->defined() && t->scalar_type() == at::kBFloat16 && t->dim() == 1 && t->size(0) == N &&
           t->is_contiguous() && t->device().is_cpu();
  };
  return N > 0 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.device().is_cpu() && fits(weight) &&
         fits(bias);
#else
  return false;
#endif
}

// rows_layer_norm_bf16 on x into a new tensor, or into *into (made anew where it is not of x's shape and dtype).
at::Tensor layer_norm_rows(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps,
                           at::Tensor* into = nullptr) {
  const int64_t N = x.size(-1);
  at::Tensor y = into != nullptr ? *into : at::Tensor();
  if (!y.defined() || y.sizes() != x.sizes() || y.scalar_type() != x.scalar_type())
    y = at::empty(x.sizes(), x.options());
  rows_layer_norm_bf16(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(), bias.data_ptr<c10::BFloat16>(),
                       float(eps), x.numel() / N, N, y.data_ptr<c10::BFloat16>());
  if (into != nullptr) *into = y;
  return y;
}

// ATen's layer_norm over the last dimension of a CPU tensor (the values of nn.LayerNorm): rows_layer_norm_bf16 where
// it applies and its width is verified, else ATen's CPU kernel called directly (at::layer_norm is composite: it calls
// native_layer_norm through the dispatcher, which calls this, so the values are its values without two dispatches).
// For the decode ops, which run below autograd (under CPU autocast, which casts layer_norm's inputs, the dispatched
// call). `into` (optional): a contiguous tensor of x's shape and dtype that the rows path writes and returns instead of
// a new one (a decode step's scratch: an allocation cost about 0.5 us per norm there).
at::Tensor aten_layer_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& bias, double eps, at::Tensor* into = nullptr) {
  if (at::autocast::is_autocast_enabled(at::kCPU)) return at::layer_norm(x, {x.size(-1)}, weight, bias, eps);
  if (layer_norm_rows_apply(x, weight, bias) && layer_norm_verified(x.size(-1), *weight, *bias, eps))
    return layer_norm_rows(x, *weight, *bias, eps, into);
  return std::get<0>(at::native::layer_norm_cpu(x, {x.size(-1)}, weight, bias, eps));
}

// The op: aten_layer_norm on a CPU tensor (path "auto"), or one of its two paths: "rows" (rows_layer_norm_bf16,
// unverified; refused where it does not apply) or "aten" (ATen's kernel). Tests compare each with torch.layer_norm.
at::Tensor decode_layer_norm_op(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                const std::optional<at::Tensor>& bias, double eps, c10::string_view path) {
  const char* op = "memoryformer.decode_layer_norm";
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1, op, ": x must be a CPU tensor of at least one dimension, got ",
              x.sizes());
  TORCH_CHECK(path == "auto" || path == "rows" || path == "aten", op, ": path must be 'auto', 'rows' or 'aten', got '",
              std::string(path), "'");
  if (path == "aten") return std::get<0>(at::native::layer_norm_cpu(x, {x.size(-1)}, weight, bias, eps));
  if (path == "auto") return aten_layer_norm(x, weight, bias, eps);
  TORCH_CHECK(layer_norm_rows_apply(x, weight, bias), op, ": the 'rows' path takes contiguous bfloat16 rows with a "
              "bfloat16 weight and bias of their width, in a build for x86 with FMA (isa AVX2 or AVX512); got ",
              x.scalar_type(), " ", x.sizes(), " on ", MEMORYFORMER_ISA, " (use path 'auto')");
  return layer_norm_rows(x, *weight, *bias, eps);
}
