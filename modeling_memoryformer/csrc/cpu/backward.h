// The backward of the lookup: the bucketed backward and the rows-hit backward, and their ops.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ bucketed backward
// The backward over the lookups grouped by row as for the bucketed forward (Buckets, bucket_lookups and kBlockVecs
// are in lookup_bucketed.h), in one pass over the table rows per column block. backward_hits_f32: float32, W = kBlock
// columns, the row and the accumulators in vector registers (as scatter_hits_f32).
template <bool kTables, bool kScores>
inline void backward_hits_f32(const float* t, const int32_t* tok, const float* sc, int64_t e0, int64_t e1,
                              const float* buf, float* acc, float* part) {
  fVec tv[kBlockVecs], a[kBlockVecs];
#pragma GCC unroll 16
  for (int64_t v = 0; v < kBlockVecs; ++v) {
    if (kScores) tv[v] = fVec::loadu(t + v * kLanes);
    if (kTables) a[v] = fVec::loadu(acc + v * kLanes);
  }
  for (int64_t e = e0; e < e1; ++e) {
    const float* y = buf + int64_t(tok[e]) * kBlock;
    const fVec s(sc[e]);
    fVec d0(0.0f), d1(0.0f);   // two partial dot products: half the dependency chain
#pragma GCC unroll 16
    for (int64_t v = 0; v < kBlockVecs; ++v) {
      const fVec yv = fVec::loadu(y + v * kLanes);
      if (kTables) a[v] = at::vec::fmadd(s, yv, a[v]);
      if (kScores) {
        if (v % 2 == 0) d0 = at::vec::fmadd(yv, tv[v], d0);
        else d1 = at::vec::fmadd(yv, tv[v], d1);
      }
    }
    if (kScores) part[e] += at::vec::vec_reduce_all<float>([](const fVec& x, const fVec& z) { return x + z; }, d0 + d1);
  }
  if (kTables) {
#pragma GCC unroll 16
    for (int64_t v = 0; v < kBlockVecs; ++v) a[v].store(acc + v * kLanes);
  }
}

// Backward of one column block for one chunk, in the same single pass over the table rows:
//   grad_tables[r, block] (+)= sum over lookups of r of scores * grad_y[token, block]  (written once, by one thread)
//   part[position] += <grad_y[token, block], tables[r, block]>  (this block's share of the score gradient)
// Rows no lookup hit are written as zeros by the first chunk (`first`) and left alone by later ones.
template <typename T, int64_t W, bool kTables, bool kScores>
void backward_block(const Buckets<typename Acc<T>::type>& b, const T* tables,
                    const typename Acc<T>::type* buf, T* grad_tables, typename Acc<T>::type* part, int64_t R, int64_t D,
                    int64_t c0, int64_t w, bool first) {
  using A = typename Acc<T>::type;
  const int64_t ww = W ? W : w;
  const int64_t* st = b.start;
  const int32_t* tok = b.token;
  const A* sc = b.score;
  alignas(64) A zeros[kBlock] = {};
  for (int64_t r = 0; r < R; ++r) {
    const int64_t e0 = st[r], e1 = st[r + 1];
    T* g = kTables ? grad_tables + r * D + c0 : nullptr;
    if (e0 == e1) {
      if (kTables && first) store_span(g, zeros, ww, true);
      continue;
    }
    if (kScores && r + kRowAhead < R) prefetch_span(tables + (r + kRowAhead) * D + c0, ww);
    alignas(64) A tv[W ? W : kBlock], acc[W ? W : kBlock];
    // Widening copies (by vectors for 16-bit values); float32 rows of a whole block are read in place below.
    if (kScores && !(std::is_same<T, float>::value && W == kBlock)) load_span(tv, tables + r * D + c0, ww);
    if (kTables) {
      if (first) std::fill(acc, acc + ww, A(0));
      else load_span(acc, g, ww);
    }
    if constexpr (std::is_same<A, float>::value && W == kBlock) {
      const float* row;   // float32 tables: the row itself; bfloat16 / float16: its float32 copy in tv
      if constexpr (std::is_same<T, float>::value) row = tables + r * D + c0;
      else row = tv;
      backward_hits_f32<kTables, kScores>(row, tok, sc, e0, e1, buf, acc, part);
    } else {
      for (int64_t e = e0; e < e1; ++e) {
        const A* y = buf + int64_t(tok[e]) * ww;
        const A s = sc[e];
        A dot = 0;
        if (W) {
#pragma omp simd reduction(+ : dot)
          for (int64_t j = 0; j < W; ++j) {
            if (kTables) acc[j] += s * y[j];
            if (kScores) dot += y[j] * tv[j];
          }
        } else {   // a ragged last block: explicit fused multiply-adds, so that the backward of scores alone has the
                   // bits of the backward of both (GCC 12 for Zen 1 contracted the sums of the two differently)
          for (int64_t j = 0; j < w; ++j) {
            if (kTables) acc[j] = std::fma(s, y[j], acc[j]);
            if (kScores) dot = std::fma(y[j], tv[j], dot);
          }
        }
        if (kScores) part[e] += dot;
      }
    }
    if (kTables) store_span(g, acc, ww, first);
  }
  stream_fence();
}

// GY: grad_y's dtype, the accumulation type or (float32 sums) a 16-bit type, widened as each column block is copied.
template <typename T, bool kTables, bool kScores, typename GY = typename Acc<T>::type>
void lookup_backward_bucketed(const GY* gy, const int64_t* rows,
                              const typename Acc<T>::type* scores, const T* tables, T* grad_tables,
                              typename Acc<T>::type* grad_scores, int64_t N, int64_t K, int64_t P, int64_t D) {
  using A = typename Acc<T>::type;
  const int threads = std::max(1, at::get_num_threads());
  const int64_t R = K * P, nb = num_blocks(D), chunk = backward_chunk<A>(tuning(), threads);
  Buckets<A> b;
  A* parts = nullptr;
  for (int64_t n0 = 0; n0 < N || n0 == 0; n0 += chunk) {
    const int64_t n = std::min(chunk, N - n0);
    bucket_lookups(rows + n0 * K, scores + n0 * K, n, K, P, b);
    const GY* g = gy + n0 * D;
    const int64_t L = n * K;
    if (kScores) {
      parts = scratch<A>(3, threads * L);
      std::fill(parts, parts + threads * L, A(0));
    }
    A* pp = parts;
    const bool first = n0 == 0;
    at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
      A* buf = scratch<A>(kWorkerSlot, n * kBlock);
      A* part = kScores ? pp + int64_t(at::get_thread_num()) * L : nullptr;
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t c0 = blk * kBlock, w = std::min(kBlock, D - c0);
        for (int64_t i = 0; i < n; ++i) load_span(buf + i * w, g + i * D + c0, w);   // memcpy when GY is A
        if (w == kBlock)
          backward_block<T, kBlock, kTables, kScores>(b, tables, buf, grad_tables, part, R, D, c0, w, first);
        else
          backward_block<T, 0, kTables, kScores>(b, tables, buf, grad_tables, part, R, D, c0, w, first);
      }
    });
    if (kScores) {  // sum the threads' shares and put each position's gradient back at its lookup (token, table)
      A* gs = grad_scores + n0 * K;
      const int32_t* tok = b.token;
      parallel_tokens(K, L * threads, [=](int64_t k0, int64_t k1) {
        for (int64_t k = k0; k < k1; ++k)
          for (int64_t e = k * n; e < (k + 1) * n; ++e) {
            A v = 0;
            for (int t = 0; t < threads; ++t) v += pp[int64_t(t) * L + e];
            gs[int64_t(tok[e]) * K + k] = v;
          }
      });
    }
    if (N == 0) break;
  }
}

std::tuple<at::Tensor, at::Tensor> lookup_backward_op(const at::Tensor& grad_out, const at::Tensor& rows,
                                                      const at::Tensor& scores, const at::Tensor& tables,
                                                      int64_t rows_per_table, bool need_tables, bool need_scores) {
  check_lookup_args(rows, scores, tables, rows_per_table, "lookup_backward");
  const int64_t N = rows.size(0), K = rows.size(1), D = tables.size(1);
  TORCH_CHECK(grad_out.defined(), "memoryformer.lookup_backward: grad_out is undefined");
  check_floating(grad_out, "lookup_backward", "grad_out");
  TORCH_CHECK(grad_out.dim() == 2 && grad_out.size(0) == N && grad_out.size(1) == D,
              "memoryformer.lookup_backward: grad_out must be [N, D] = [", N, ", ", D, "], got ",
              grad_out.sizes());
  const auto acc = acc_type(tables.scalar_type());
  // A 16-bit grad_y (a bfloat16 or float16 model) is widened block by block inside the pass, not copied whole first.
  const bool narrow = acc == at::kFloat && (grad_out.scalar_type() == at::kBFloat16 ||
                                            grad_out.scalar_type() == at::kHalf);
  auto gy = narrow ? grad_out.contiguous() : grad_out.to(acc).contiguous();
  auto s = lookup_operands(scores, tables, std::nullopt, "lookup_backward").first;
  at::Tensor gscores, gtables;
  if (need_scores) gscores = at::empty({N, K}, tables.options().dtype(acc));
  if (need_tables) gtables = pooled_empty_like(tables);
  const int64_t P = rows_per_table;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, tables.scalar_type(), "memoryformer_lookup_bwd", [&] {
    using A = typename Acc<scalar_t>::type;
    const int64_t* r = rows.data_ptr<int64_t>();
    const A* sc = s.data_ptr<A>();
    const scalar_t* t = tables.data_ptr<scalar_t>();
    scalar_t* gt = need_tables ? gtables.data_ptr<scalar_t>() : nullptr;
    A* gs = need_scores ? gscores.data_ptr<A>() : nullptr;
    auto run = [&](const auto* g) {
      using GY = std::remove_const_t<std::remove_pointer_t<decltype(g)>>;
      if (need_tables && need_scores) lookup_backward_bucketed<scalar_t, true, true, GY>(g, r, sc, t, gt, gs, N, K, P, D);
      else if (need_tables) lookup_backward_bucketed<scalar_t, true, false, GY>(g, r, sc, t, gt, nullptr, N, K, P, D);
      else if (need_scores) lookup_backward_bucketed<scalar_t, false, true, GY>(g, r, sc, t, nullptr, gs, N, K, P, D);
    };
    if constexpr (std::is_same<A, float>::value) {
      if (gy.scalar_type() == at::kBFloat16) return run(gy.data_ptr<c10::BFloat16>());
      if (gy.scalar_type() == at::kHalf) return run(gy.data_ptr<c10::Half>());
    }
    run(gy.data_ptr<A>());
  });
  return {gscores, gtables};
}

// ------------------------------------------------------------------------------------------------ rows-hit backward
// The table gradient as the rows hit and their gradients only (a sparse gradient), for few tokens: the dense form
// writes every row of the tables (zeros for the rows nobody hit: 33.5 MB for a d=512 layer of 256-row tables), which
// dominates a backward of a few tokens. Per table k (tables split over the threads): the lookups (row, token) of the
// table sorted by row (std::sort of N 64-bit keys), then each distinct row's gradient summed in float32 registers
// over its tokens, in token order, and each lookup's score gradient <grad_y[n], tables[row]>. Output rows ascending
// (table k's rows come before table k + 1's), so the sparse gradient is coalesced as made.
// Pass 1: the sorted keys and the number of distinct rows of each table; pass 2 fills the outputs. From half a lookup
// per row (2N >= rows per table) most rows are hit: the dense bucketed backward runs instead and its rows hit are
// copied out.
template <typename T>
void backward_rows_kernel(const float* gy, const int64_t* rows, const float* scores, const T* tables,
                          const uint64_t* keys, const int64_t* start, int64_t* out_rows, T* values,
                          float* grad_scores, int64_t N, int64_t K, int64_t D) {
  parallel_tokens(K, N * K * D, [=](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const uint64_t* kk = keys + k * N;
      int64_t u = start[k];
      for (int64_t e = 0; e < N;) {
        const int64_t row = rows[(kk[e] & 0xffffffffu) * K + k];
        int64_t e1 = e + 1;
        while (e1 < N && (kk[e1] >> 32) == (kk[e] >> 32)) ++e1;
        T* v = values + u * D;
        out_rows[u++] = row;
        const T* t = tables + row * D;
        for (int64_t c0 = 0; c0 < D; c0 += kCols) {   // the row's gradient, kCols columns at a time in registers
          const int64_t w = std::min(kCols, D - c0);
          float acc[kCols] = {};
          for (int64_t i = e; i < e1; ++i) {
            const int64_t n = int64_t(kk[i] & 0xffffffffu);
            const float sn = scores[n * K + k];
            const float* g = gy + n * D + c0;
#pragma omp simd
            for (int64_t j = 0; j < w; ++j) acc[j] += sn * g[j];
          }
          store_span(v + c0, acc, w, false);   // 16-bit values rounded by vectors
        }
        if (grad_scores)
          for (int64_t i = e; i < e1; ++i) {
            const int64_t n = int64_t(kk[i] & 0xffffffffu);
            grad_scores[n * K + k] = dot_floats(gy + n * D, t, D);
          }
        e = e1;
      }
    }
  });
}

// The rows-hit backward (see above): -> (grad_scores [N, K] float32 or undefined, rows [U] int64 ascending, values
// [U, D] in the tables' dtype), the U distinct rows hit and their gradients. float32, bfloat16 and float16 tables
// (float64 ones take the dense backward); at most 2^32 - 1 tokens.
std::tuple<at::Tensor, at::Tensor, at::Tensor> lookup_backward_rows_op(const at::Tensor& grad_out,
                                                                       const at::Tensor& rows,
                                                                       const at::Tensor& scores,
                                                                       const at::Tensor& tables,
                                                                       int64_t rows_per_table, bool need_scores) {
  const char* op = "lookup_backward_rows";
  check_lookup_args(rows, scores, tables, rows_per_table, op);
  const int64_t N = rows.size(0), K = rows.size(1), D = tables.size(1);
  TORCH_CHECK(tables.scalar_type() != at::kDouble, "memoryformer.lookup_backward_rows: float64 tables take the "
              "dense backward (lookup_backward)");
  TORCH_CHECK(N < (int64_t(1) << 32), "memoryformer.lookup_backward_rows: at most 2^32 - 1 tokens, got ", N);
  TORCH_CHECK(grad_out.defined(), "memoryformer.lookup_backward_rows: grad_out is undefined");
  check_floating(grad_out, op, "grad_out");
  TORCH_CHECK(grad_out.dim() == 2 && grad_out.size(0) == N && grad_out.size(1) == D,
              "memoryformer.lookup_backward_rows: grad_out must be [N, D] = [", N, ", ", D, "], got ",
              grad_out.sizes());
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t P = rows_per_table, R = K * P;
  if (2 * N >= P) {
    // Half a lookup per row or more: most rows are hit, and the per-row pass below reads grad_y rows at random, far
    // slower than the dense pass (docs/kernel.md). The dense bucketed backward, then its rows hit.
    at::Tensor gscores, gtables;
    std::tie(gscores, gtables) = lookup_backward_op(grad_out, rows, scores, tables, P, true, need_scores);
    std::vector<uint8_t> hit(size_t(R), 0);
    for (int64_t e = 0; e < N * K; ++e) hit[size_t(r[e])] = 1;
    int64_t U = 0;
    for (int64_t i = 0; i < R; ++i) U += hit[size_t(i)];
    auto out_rows = at::empty({U}, rows.options());
    int64_t* o = out_rows.data_ptr<int64_t>();
    for (int64_t i = 0, u = 0; i < R; ++i)
      if (hit[size_t(i)]) o[u++] = i;
    auto values = pooled_empty({U, D}, tables.options(), /*transient=*/true, /*pow2=*/true);
    at::index_select_out(values, gtables, 0, out_rows);
    return {gscores, out_rows, values};
  }
  auto gy = grad_out.to(at::kFloat).contiguous();
  auto s = scores.to(at::kFloat).contiguous();
  // Pass 1: per table, keys (row << 32 | token) sorted, and the count of distinct rows.
  std::vector<uint64_t> keys(size_t(N * K));
  std::vector<int64_t> start(size_t(K + 1), 0);
  uint64_t* kp = keys.data();
  int64_t* sp = start.data();
  parallel_tokens(K, N * K * 16, [=](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      uint64_t* kk = kp + k * N;
      for (int64_t n = 0; n < N; ++n) kk[n] = (uint64_t(r[n * K + k]) << 32) | uint64_t(n);
      std::sort(kk, kk + N);
      int64_t distinct = 0;
      for (int64_t e = 0; e < N; ++e) distinct += (e == 0 || (kk[e] >> 32) != (kk[e - 1] >> 32));
      sp[k + 1] = distinct;
    }
  });
  for (int64_t k = 0; k < K; ++k) start[k + 1] += start[k];
  const int64_t U = start[K];
  auto out_rows = at::empty({U}, rows.options());
  // From the pool (see "gradient memory"): tens of MB for a few hundred tokens, whose first-touch page faults took
  // longer than the kernel; the size changes with the rows hit, hence blocks of a power of two of 2 MB pages.
  auto values = pooled_empty({U, D}, tables.options(), /*transient=*/true, /*pow2=*/true);
  at::Tensor gscores;
  if (need_scores) gscores = at::empty({N, K}, tables.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, tables.scalar_type(), "memoryformer_lookup_bwd_rows", [&] {
    if constexpr (!std::is_same<scalar_t, double>::value)
      backward_rows_kernel<scalar_t>(gy.data_ptr<float>(), r, s.data_ptr<float>(), tables.data_ptr<scalar_t>(), kp,
                                     sp, out_rows.data_ptr<int64_t>(), values.data_ptr<scalar_t>(),
                                     need_scores ? gscores.data_ptr<float>() : nullptr, N, K, D);
  });
  return {gscores, out_rows, values};
}
