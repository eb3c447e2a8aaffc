// Hashing: hash_kernel, hash_backward_kernel and their ops.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ hashing
// exp(x) for x <= 0 in float (Cephes expf: Cody-Waite reduction, degree-6 polynomial, ~1 ulp), branch-free
// so that the compiler vectorises loops that call it.
inline float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float fx = x * 1.44269504088896341f;
  const float n = (fx + 12582912.0f) - 12582912.0f;   // round to nearest
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  const float z = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}
inline double exp_nonpos(double x) { return std::exp(x); }

// Vectorised across the K chunks of a token (lane k reads value i of chunk k, a stride-tau gather), so exp, the
// product, the norm and the code bits of 16 chunks are computed at once. prod = prod_i (1 + e_i), multiplied in
// order i = 0..tau-1 here and in the backward, so both see bit-identical scores; p = 1 / prod and each factor lies
// in (1, 2], so nothing overflows.
template <typename X>
void hash_kernel(const X* x, int64_t* rows, typename Acc<X>::type* scores, int64_t N, int64_t K, int64_t tau,
                 bool l1, double temperature) {
  using A = typename Acc<X>::type;
  const int64_t D = K * tau;
  const A c = static_cast<A>(2.0 / temperature);
  parallel_tokens(N, N * D * 16, [=](int64_t begin, int64_t end) {
    // The thread's buffers, kept between calls (a decode step hashes one row per Memory Layer: four allocations of a
    // few KB per call otherwise). Every value is written before it is read.
    static thread_local std::vector<A> z, prod, norm;
    static thread_local std::vector<int32_t> code;
    if (static_cast<int64_t>(z.size()) < D) z.resize(D);
    if (static_cast<int64_t>(prod.size()) < K) { prod.resize(K); norm.resize(K); code.resize(K); }
    for (int64_t n = begin; n < end; ++n) {
      // Transposed: zt[i * K + k] = value i of chunk k, so that the passes below read contiguous vectors of K values
      // instead of a stride-tau gather per lane. Written row by row (contiguous stores, strided loads), which is
      // faster than column by column (docs/kernel.md).
      A* zt = z.data();
      const X* xn = x + n * D;
      for (int64_t i = 0; i < tau; ++i) {
        A* zi = zt + i * K;
        const X* xi = xn + i;
#pragma omp simd
        for (int64_t k = 0; k < K; ++k) zi[k] = to_acc(xi[k * tau]);
      }
      A* pr = prod.data();
      A* nm = norm.data();
      int32_t* cd = code.data();
      for (int64_t k = 0; k < K; ++k) { pr[k] = A(1); nm[k] = A(0); cd[k] = 0; }
      for (int64_t i = 0; i < tau; ++i) {
        const A* zi = zt + i * K;
#pragma omp simd
        for (int64_t k = 0; k < K; ++k) {
          const A v = zi[k];
          const A a = std::abs(v);
          pr[k] *= A(1) + exp_nonpos(-c * a);
          nm[k] += a;
          cd[k] |= int32_t(v >= A(0)) << i;
        }
      }
      int64_t* rn = rows + n * K;
      A* sn = scores + n * K;
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) {
        rn[k] = (k << tau) + cd[k];
        sn[k] = (l1 ? nm[k] : A(1)) / pr[k];   // p = 1 / prod(1 + exp(-2|z|/t)), prod in [1, 2^tau]
      }
    }
  });
}

template <typename X>
void hash_backward_kernel(const typename Acc<X>::type* gs, const X* x, X* gx, int64_t N, int64_t K, int64_t tau,
                          bool l1, double temperature) {
  using A = typename Acc<X>::type;
  const int64_t D = K * tau;
  const A c = static_cast<A>(2.0 / temperature);
  parallel_tokens(N, N * D * 16, [=](int64_t begin, int64_t end) {
    std::vector<A> z(D), e(D), a(D), b(D), prod(K), norm(K), out(std::is_same<X, A>::value ? 0 : D);
    for (int64_t n = begin; n < end; ++n) {
      load_span(z.data(), x + n * D, D);
      A* pr = prod.data();
      A* nm = norm.data();
      A* ee = e.data();
      const A* zz = z.data();
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) ee[j] = exp_nonpos(-c * std::abs(zz[j]));
      for (int64_t k = 0; k < K; ++k) { pr[k] = A(1); nm[k] = A(0); }
      for (int64_t i = 0; i < tau; ++i) {   // the forward's scores, recomputed in the same order (see hash_kernel)
#pragma omp simd
        for (int64_t k = 0; k < K; ++k) {
          pr[k] *= A(1) + ee[k * tau + i];
          nm[k] += std::abs(zz[k * tau + i]);
        }
      }
      // d score / d z_j = sign(z_j) * (a_k + b_k * e_j / (1 + e_j)) with, for chunk k (p = 1 / prod):
      //   paper: a = 0,        b = (2/t) p          (d p / d z_j = p (2/t) sign(z_j) e_j / (1 + e_j))
      //   l1:    a = p,        b = (2/t) p ||z_k||_1
      // a and b (times the incoming gradient) are spread over their chunk, then one vector pass over all D values.
      const A* g = gs + n * K;
      A* av = a.data();
      A* bv = b.data();
      for (int64_t k = 0; k < K; ++k) {
        const A p = A(1) / pr[k], gk = g[k];
        const A ak = l1 ? gk * p : A(0), bk = gk * c * p * (l1 ? nm[k] : A(1));
        for (int64_t i = 0; i < tau; ++i) { av[k * tau + i] = ak; bv[k * tau + i] = bk; }
      }
      // 16-bit x: the gradient in float32 first, then rounded by vectors (a scalar rounding per value kept the loop
      // from vectorising; docs/kernel.md).
      X* gxn = gx + n * D;
      A* gn = std::is_same<X, A>::value ? reinterpret_cast<A*>(gxn) : out.data();
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) {
        const A v = zz[j];
        const A sg = v > A(0) ? A(1) : (v < A(0) ? A(-1) : A(0));   // d|z|/dz, 0 at 0 as autograd
        gn[j] = sg * (av[j] + bv[j] * (ee[j] / (A(1) + ee[j])));
      }
      if constexpr (!std::is_same<X, A>::value) store_span(gxn, gn, D, false);
    }
  });
}

void check_hash_args(const at::Tensor& x, int64_t tau, double temperature, const char* op) {
  check_cpu_contiguous(x, op, "x");
  check_floating(x, op, "x");
  TORCH_CHECK(x.dim() == 2, "memoryformer.", op, ": x must be 2-D [N, K * hash_bits], got shape ", x.sizes());
  TORCH_CHECK(tau >= 1 && tau <= 16, "memoryformer.", op, ": hash_bits must be in 1 .. 16, got ", tau);
  TORCH_CHECK(x.size(1) % tau == 0, "memoryformer.", op, ": the width of x (", x.size(1),
              ") must be a multiple of hash_bits (", tau, ")");
  TORCH_CHECK(temperature > 0, "memoryformer.", op, ": temperature must be > 0, got ", temperature);
}

// The scores this kernel implements, by name: the op layer passes the config's `hash_score` as it is, so a score
// added in Python only is refused here instead of running as another one.
bool score_is_l1(c10::string_view score, const char* op) {
  TORCH_CHECK(score == "paper" || score == "l1", "memoryformer.", op, ": unknown score '", std::string(score),
              "'; the fused CPU kernel implements 'paper' and 'l1'. A new score needs its formula in hash_kernel and "
              "hash_backward_kernel (csrc/) as well as in the PyTorch kernels (memory_backend_torch.py).");
  return score == "l1";
}

std::tuple<at::Tensor, at::Tensor> hash_op(const at::Tensor& x, int64_t tau, c10::string_view score,
                                           double temperature) {
  check_hash_args(x, tau, temperature, "hash");
  const bool l1 = score_is_l1(score, "hash");
  const int64_t N = x.size(0), K = x.size(1) / tau;
  auto rows = at::empty({N, K}, x.options().dtype(at::kLong));
  auto scores = at::empty({N, K}, x.options().dtype(acc_type(x.scalar_type())));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "memoryformer_hash", [&] {
    hash_kernel<scalar_t>(x.data_ptr<scalar_t>(), rows.data_ptr<int64_t>(),
                          scores.data_ptr<typename Acc<scalar_t>::type>(), N, K, tau, l1, temperature);
  });
  return {rows, scores};
}

at::Tensor hash_backward_op(const at::Tensor& grad_scores, const at::Tensor& x, int64_t tau, c10::string_view score,
                            double temperature) {
  check_hash_args(x, tau, temperature, "hash_backward");
  const bool l1 = score_is_l1(score, "hash_backward");
  const int64_t N = x.size(0), K = x.size(1) / tau;
  TORCH_CHECK(grad_scores.defined(), "memoryformer.hash_backward: grad_scores is undefined");
  check_floating(grad_scores, "hash_backward", "grad_scores");
  TORCH_CHECK(grad_scores.dim() == 2 && grad_scores.size(0) == N && grad_scores.size(1) == K,
              "memoryformer.hash_backward: grad_scores must be [N, K] = [", N, ", ", K, "] for x of shape ",
              x.sizes(), " and hash_bits ", tau, ", got ", grad_scores.sizes());
  auto gs = grad_scores.to(acc_type(x.scalar_type())).contiguous();
  auto gx = pooled_empty_like(x, /*transient=*/true);   // see "gradient memory"
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "memoryformer_hash_backward", [&] {
    hash_backward_kernel<scalar_t>(gs.data_ptr<typename Acc<scalar_t>::type>(), x.data_ptr<scalar_t>(),
                                   gx.data_ptr<scalar_t>(), N, K, tau, l1, temperature);
  });
  return gx;
}
