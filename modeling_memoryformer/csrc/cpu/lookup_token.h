// The token-major forward lookup (up to kSmallBatch tokens).
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ token-major lookup
// Token-major gather-accumulate: for each token and each span of kCols output columns, the K row spans are summed
// into registers while the rows kAhead lookups ahead (this token's or the next one's) are prefetched, so the
// random row reads overlap instead of waiting on the cache one after another.
template <typename T>
void lookup_kernel(const int64_t* rows, const typename Acc<T>::type* scores, const T* tables, const T* bias,
                   T* out, int64_t N, int64_t K, int64_t D) {
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
        T* o = out + n * D + c0;   // accumulated in A, stored in the tables' dtype
        for (int64_t j = 0; j < w; ++j) o[j] = static_cast<T>(acc[j]);
      }
    }
  });
}
