"""C++ source of the fused CPU Memory Layer kernels, compiled at first use by `memory_ops.load_fused_kernels`.

Kept as a string in a sibling module so that `save_pretrained` copies it with the model files and remote-code
loading (`trust_remote_code=True`) can build it too.

Operators (namespace `memoryformer_cpu`), all on contiguous CPU tensors:
- hash(x[N, K*tau], tau, l1, t) -> (rows int64 [N, K], scores [N, K])
      rows = k * 2**tau + h(z_k); scores = p(z_k) (paper) or ||z_k||_1 * p(z_k) (l1), in float32 (float64 for
      float64 x). p = 1 / prod_i (1 + exp(-2|z_i|/t)) is computed as a product: each factor lies in (1, 2], so the
      product of at most 16 factors cannot overflow and no logarithm is needed.
- lookup(rows, scores, tables[R, D], bias?) -> y[N, D] = sum_k scores[:, k] * tables[rows[:, k]] + bias,
      accumulated in float32 (float64 for float64 tables), returned in the tables' dtype.
- lookup_backward(grad_y, rows, scores, tables, need_tables, need_scores) -> (grad_scores, grad_tables)
      grad_scores[n, k] = <grad_y[n], tables[rows[n, k]]>; grad_tables[r] = sum_{(n,k): rows[n,k]=r} scores * grad_y[n]
- hash_backward(grad_scores, x, tau, l1, t) -> grad_x through the score derivative (codes are piecewise constant).

Design (measured on a 2-core AMD EPYC, see benchmarks/): the row gather is bounded by cache/TLB misses on tables
far larger than L2, not by FLOPs. Forward: up to 64 tokens, a token-major kernel that sums each token's K row spans
in registers while prefetching the rows 16 lookups ahead; beyond that, PyTorch's embedding_bag (FBGEMM's JIT
kernel), which measured fastest, called below autograd. Column-blocked table layouts that keep one block of all
tables in L2 were tried and measured 2-3x slower here (per-lookup overhead on 128-byte spans dominates).
Backward: score gradients as indexed inner products (token-parallel); table gradients by grouping lookups by row
with a counting sort, so every gradient row is written once by one thread (no atomics, no read-modify-write), into
memory advised for transparent huge pages (first-touch page faults otherwise cost more than the kernel).
"""

CPP_SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kCols = 256;             // output columns accumulated in registers per pass over a token's rows
constexpr int64_t kAhead = 16;             // table rows prefetched this many lookups ahead
constexpr int64_t kSerialWork = 1 << 18;   // below this many multiply-adds, one thread
constexpr int64_t kSmallBatch = 64;        // up to this many tokens the forward uses our own gather kernel

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

template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

template <typename T> inline typename Acc<T>::type to_acc(T v) { return static_cast<typename Acc<T>::type>(v); }

// A fresh multi-MB gradient is new memory from the OS: first-touch faults on 4 KB pages cost more than the kernel
// that fills it. Ask for transparent huge pages on the untouched range (honoured when THP is in `madvise` mode).
void advise_huge_pages(void* p, size_t bytes) {
#ifdef MADV_HUGEPAGE
  const uintptr_t huge = uintptr_t(2) << 20;
  const uintptr_t a = (reinterpret_cast<uintptr_t>(p) + huge - 1) & ~(huge - 1);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(huge - 1);
  if (e > a) madvise(reinterpret_cast<void*>(a), e - a, MADV_HUGEPAGE);
#endif
}

int64_t threads_for(int64_t work) { return work < kSerialWork ? 1 : at::get_num_threads(); }

template <typename F> void parallel_tokens(int64_t N, int64_t work, F body) {
  if (threads_for(work) == 1) body(0, N);
  else at::parallel_for(0, N, 1, body);
}

template <typename T> inline void prefetch_span(const T* p, int64_t w) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < int64_t(w * sizeof(T)); b += 64) __builtin_prefetch(c + b);
}

// ------------------------------------------------------------------------------------------------ hashing
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
    std::vector<A> z(D), prod(K), norm(K);
    std::vector<int32_t> code(K);
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t i = 0; i < D; ++i) z[i] = to_acc(x[n * D + i]);
      A* pr = prod.data();
      A* nm = norm.data();
      int32_t* cd = code.data();
      const A* zz = z.data();
      for (int64_t k = 0; k < K; ++k) { pr[k] = A(1); nm[k] = A(0); cd[k] = 0; }
      for (int64_t i = 0; i < tau; ++i) {
#pragma omp simd
        for (int64_t k = 0; k < K; ++k) {
          const A v = zz[k * tau + i];
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
    std::vector<A> z(D), e(D), prod(K), norm(K);
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t i = 0; i < D; ++i) z[i] = to_acc(x[n * D + i]);
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
      const A* g = gs + n * K;
      X* gxn = gx + n * D;
      for (int64_t k = 0; k < K; ++k) {
        const A p = A(1) / pr[k], gk = g[k], nk = nm[k];
#pragma omp simd
        for (int64_t i = 0; i < tau; ++i) {
          const int64_t j = k * tau + i;
          const A v = zz[j];
          const A sg = v > A(0) ? A(1) : (v < A(0) ? A(-1) : A(0));   // d|z|/dz, 0 at 0 as autograd
          // d p / d z_j = p * (2/t) * sign(z_j) * e_j / (1 + e_j)
          const A dp = p * c * sg * ee[j] / (A(1) + ee[j]);
          gxn[j] = static_cast<X>(gk * (l1 ? sg * p + nk * dp : dp));
        }
      }
    }
  });
}

// ------------------------------------------------------------------------------------------------ lookup
// Token-major gather-accumulate: for each token and each span of kCols output columns, the K row spans are summed
// into registers while the rows kAhead lookups ahead (this token's or the next one's) are prefetched, so the
// random row reads overlap instead of waiting on the cache one after another.
template <typename T>
void lookup_kernel(const int64_t* rows, const typename Acc<T>::type* scores, const T* tables, const T* bias,
                   typename Acc<T>::type* out, int64_t N, int64_t K, int64_t D) {
  using A = typename Acc<T>::type;
  parallel_tokens(N, N * K * D, [=](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t* rn = rows + n * K;
      const A* sn = scores + n * K;
      const int64_t ahead_limit = (n + 1 < end ? 2 * K : K);
      for (int64_t c0 = 0; c0 < D; c0 += kCols) {
        const int64_t w = std::min(kCols, D - c0);
        A acc[kCols];
        for (int64_t j = 0; j < w; ++j) acc[j] = bias ? to_acc(bias[c0 + j]) : A(0);
        for (int64_t k = 0; k < K; ++k) {
          if (k + kAhead < ahead_limit) prefetch_span(tables + rn[k + kAhead] * D + c0, w);
          const T* t = tables + rn[k] * D + c0;
          const A s = sn[k];
          if (w == kCols) {
#pragma omp simd
            for (int64_t j = 0; j < kCols; ++j) acc[j] += s * to_acc(t[j]);
          } else {
            for (int64_t j = 0; j < w; ++j) acc[j] += s * to_acc(t[j]);
          }
        }
        A* o = out + n * D + c0;
        for (int64_t j = 0; j < w; ++j) o[j] = acc[j];
      }
    }
  });
}

// grad_scores[n, k] = <grad_y[n], tables[rows[n, k]]>: same access pattern as the forward, read-only.
template <typename T>
void grad_scores_kernel(const typename Acc<T>::type* gy, const int64_t* rows, const T* tables,
                        typename Acc<T>::type* gs, int64_t N, int64_t K, int64_t D) {
  using A = typename Acc<T>::type;
  parallel_tokens(N, N * K * D, [=](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t* rn = rows + n * K;
      const int64_t ahead_limit = (n + 1 < end ? 2 * K : K);
      A* gsn = gs + n * K;
      for (int64_t k = 0; k < K; ++k) gsn[k] = 0;
      for (int64_t c0 = 0; c0 < D; c0 += kCols) {
        const int64_t w = std::min(kCols, D - c0);
        const A* g = gy + n * D + c0;
        for (int64_t k = 0; k < K; ++k) {
          if (k + kAhead < ahead_limit) prefetch_span(tables + rn[k + kAhead] * D + c0, w);
          const T* t = tables + rn[k] * D + c0;
          A dot = 0;
          if (w == kCols) {
#pragma omp simd reduction(+ : dot)
            for (int64_t j = 0; j < kCols; ++j) dot += g[j] * to_acc(t[j]);
          } else {
            for (int64_t j = 0; j < w; ++j) dot += g[j] * to_acc(t[j]);
          }
          gsn[k] += dot;
        }
      }
    }
  });
}

// grad_tables[r] = sum over lookups (n, k) that hit row r of scores[n, k] * grad_y[n]. The lookups are grouped by
// row with a counting sort, then rows are split between threads: every row is written once, by one thread, with
// no atomics and no read-modify-write of the (large) gradient; rows nobody hit are written as zeros.
template <typename T>
void grad_tables_kernel(const typename Acc<T>::type* gy, const int64_t* rows, const typename Acc<T>::type* scores,
                        T* gt, int64_t N, int64_t K, int64_t R, int64_t D) {
  using A = typename Acc<T>::type;
  const int64_t L = N * K;
  std::vector<int64_t> start(R + 1, 0);
  for (int64_t e = 0; e < L; ++e) ++start[rows[e] + 1];
  for (int64_t r = 0; r < R; ++r) start[r + 1] += start[r];
  std::vector<int64_t> fill(start.begin(), start.end() - 1), order(L);
  for (int64_t e = 0; e < L; ++e) order[fill[rows[e]]++] = e;
  const int64_t* st = start.data();
  const int64_t* ord = order.data();
  auto body = [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t e0 = st[r], e1 = st[r + 1];
      T* row = gt + r * D;
      if (e0 == e1) {  // never retrieved: zero gradient
        std::memset(static_cast<void*>(row), 0, sizeof(T) * D);
        continue;
      }
      for (int64_t c0 = 0; c0 < D; c0 += kCols) {
        const int64_t w = std::min(kCols, D - c0);
        A acc[kCols];
        if (w == kCols) {
          for (int64_t j = 0; j < kCols; ++j) acc[j] = 0;
          for (int64_t i = e0; i < e1; ++i) {
            if (i + 4 < e1) prefetch_span(gy + (ord[i + 4] / K) * D + c0, kCols);
            const int64_t e = ord[i];
            const A* g = gy + (e / K) * D + c0;
            const A s = scores[e];
#pragma omp simd
            for (int64_t j = 0; j < kCols; ++j) acc[j] += s * g[j];
          }
#pragma omp simd
          for (int64_t j = 0; j < kCols; ++j) row[c0 + j] = static_cast<T>(acc[j]);
        } else {
          for (int64_t j = 0; j < w; ++j) acc[j] = 0;
          for (int64_t i = e0; i < e1; ++i) {
            const int64_t e = ord[i];
            const A* g = gy + (e / K) * D + c0;
            const A s = scores[e];
            for (int64_t j = 0; j < w; ++j) acc[j] += s * g[j];
          }
          for (int64_t j = 0; j < w; ++j) row[c0 + j] = static_cast<T>(acc[j]);
        }
      }
    }
  };
  if (threads_for(L * D + R * D) == 1) body(0, R); else at::parallel_for(0, R, 64, body);
}

// ------------------------------------------------------------------------------------------------ ops
void check_cpu_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "memoryformer_cpu: ", name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), "memoryformer_cpu: ", name, " must be contiguous");
}

at::ScalarType acc_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

std::tuple<at::Tensor, at::Tensor> hash_op(const at::Tensor& x, int64_t tau, bool l1, double temperature) {
  check_cpu_contiguous(x, "x");
  TORCH_CHECK(x.dim() == 2, "memoryformer_cpu.hash: x must be [N, K*tau]");
  TORCH_CHECK(tau >= 1 && tau <= 16 && x.size(1) % tau == 0, "memoryformer_cpu.hash: bad hash_bits");
  const int64_t N = x.size(0), K = x.size(1) / tau;
  auto rows = at::empty({N, K}, x.options().dtype(at::kLong));
  auto scores = at::empty({N, K}, x.options().dtype(acc_type(x.scalar_type())));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "memoryformer_hash", [&] {
    hash_kernel<scalar_t>(x.data_ptr<scalar_t>(), rows.data_ptr<int64_t>(),
                          scores.data_ptr<typename Acc<scalar_t>::type>(), N, K, tau, l1, temperature);
  });
  return {rows, scores};
}

at::Tensor hash_backward_op(const at::Tensor& grad_scores, const at::Tensor& x, int64_t tau, bool l1,
                            double temperature) {
  check_cpu_contiguous(x, "x");
  auto gs = grad_scores.to(acc_type(x.scalar_type())).contiguous();
  const int64_t N = x.size(0), K = x.size(1) / tau;
  auto gx = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "memoryformer_hash_backward", [&] {
    hash_backward_kernel<scalar_t>(gs.data_ptr<typename Acc<scalar_t>::type>(), x.data_ptr<scalar_t>(),
                                   gx.data_ptr<scalar_t>(), N, K, tau, l1, temperature);
  });
  return gx;
}

at::Tensor lookup_op(const at::Tensor& rows, const at::Tensor& scores, const at::Tensor& tables,
                     const std::optional<at::Tensor>& bias, int64_t rows_per_table) {
  check_cpu_contiguous(rows, "rows");
  check_cpu_contiguous(tables, "tables");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 2, "memoryformer_cpu.lookup: rows must be int64 [N, K]");
  TORCH_CHECK(tables.dim() == 2, "memoryformer_cpu.lookup: tables must be [R, D]");
  const int64_t N = rows.size(0), K = rows.size(1), D = tables.size(1);
  TORCH_CHECK(K * rows_per_table == tables.size(0), "memoryformer_cpu.lookup: tables do not match rows");
  const auto acc = acc_type(tables.scalar_type());
  auto s = scores.to(acc).contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(tables.scalar_type()).contiguous();
  if (N > kSmallBatch && tables.scalar_type() != at::kDouble) {
    // Many tokens: PyTorch's embedding_bag (FBGEMM's JIT-generated, prefetching EmbeddingSpMDM kernel) is the
    // fastest row gather-accumulate we have measured on CPU; it runs here below autograd, without its backward.
    auto offsets = at::arange(0, N * K, K, rows.options());
    auto bag = std::get<0>(at::embedding_bag(tables, rows.reshape({-1}), offsets, /*scale_grad_by_freq=*/false,
                                             /*mode=sum*/ 0, /*sparse=*/false, s.to(tables.scalar_type()).reshape({-1})));
    return b.defined() ? bag.add_(b) : bag;
  }
  auto out = at::empty({N, D}, tables.options().dtype(acc));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, tables.scalar_type(), "memoryformer_lookup", [&] {
    using A = typename Acc<scalar_t>::type;
    lookup_kernel<scalar_t>(rows.data_ptr<int64_t>(), s.data_ptr<A>(), tables.data_ptr<scalar_t>(),
                            b.defined() ? b.data_ptr<scalar_t>() : nullptr, out.data_ptr<A>(), N, K, D);
  });
  return out.scalar_type() == tables.scalar_type() ? out : out.to(tables.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> lookup_backward_op(const at::Tensor& grad_out, const at::Tensor& rows,
                                                      const at::Tensor& scores, const at::Tensor& tables,
                                                      int64_t rows_per_table, bool need_tables, bool need_scores) {
  check_cpu_contiguous(rows, "rows");
  check_cpu_contiguous(tables, "tables");
  const int64_t N = rows.size(0), K = rows.size(1), D = tables.size(1), R = tables.size(0);
  TORCH_CHECK(K * rows_per_table == R, "memoryformer_cpu.lookup_backward: tables do not match rows");
  const auto acc = acc_type(tables.scalar_type());
  auto gy = grad_out.to(acc).contiguous();
  auto s = scores.to(acc).contiguous();
  at::Tensor gscores, gtables;
  if (need_scores) gscores = at::empty({N, K}, tables.options().dtype(acc));
  if (need_tables) {
    gtables = at::empty_like(tables);
    advise_huge_pages(gtables.data_ptr(), gtables.nbytes());
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, tables.scalar_type(), "memoryformer_lookup_bwd", [&] {
    using A = typename Acc<scalar_t>::type;
    if (need_scores)
      grad_scores_kernel<scalar_t>(gy.data_ptr<A>(), rows.data_ptr<int64_t>(), tables.data_ptr<scalar_t>(),
                                   gscores.data_ptr<A>(), N, K, D);
    if (need_tables)
      grad_tables_kernel<scalar_t>(gy.data_ptr<A>(), rows.data_ptr<int64_t>(), s.data_ptr<A>(),
                                   gtables.data_ptr<scalar_t>(), N, K, R, D);
  });
  return {gscores, gtables};
}

}  // namespace

TORCH_LIBRARY(memoryformer_cpu, m) {
  m.def("hash(Tensor x, int hash_bits, bool l1, float temperature) -> (Tensor, Tensor)");
  m.def("hash_backward(Tensor grad_scores, Tensor x, int hash_bits, bool l1, float temperature) -> Tensor");
  m.def("lookup(Tensor rows, Tensor scores, Tensor tables, Tensor? bias, int rows_per_table) -> Tensor");
  m.def("lookup_backward(Tensor grad_out, Tensor rows, Tensor scores, Tensor tables, int rows_per_table, "
        "bool need_tables, bool need_scores) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(memoryformer_cpu, CPU, m) {
  m.impl("hash", &hash_op);
  m.impl("hash_backward", &hash_backward_op);
  m.impl("lookup", &lookup_op);
  m.impl("lookup_backward", &lookup_backward_op);
}
"""
