// The bucketed forward lookup, and the grouping of lookups by row that the backward shares.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ bucketed passes
// For many tokens the lookups are grouped by table row (a counting sort per table: each table holds every token
// exactly once), and the work is split by column blocks of kBlock columns. One column block of a chunk of tokens
// (half of L2, see Tuning) lives in a contiguous buffer that stays in L2, while the rows of the table are streamed
// once, in order, each hit row loaded into registers once and applied to all of its tokens. The table is then read
// once per chunk instead of once per lookup (N / 2**tau times), and the random accesses go to L2 instead of L3 /
// DRAM. The buffer is compact because a strided column block of a [N, D] matrix with D*4 a multiple of 2 KB maps
// onto a few cache sets only.
constexpr int64_t kRowAhead = 12;  // table rows prefetched ahead in the stream

template <typename A> struct Buckets {   // in the calling thread's scratch slots 0-2
  int64_t* start = nullptr;     // [R + 1]: the lookups of row r are positions start[r] .. start[r + 1]
  int32_t* token = nullptr;     // [n * K]: token (chunk-relative) of each position
  A* score = nullptr;           // [n * K]: its score
};  // position e belongs to table e / n (see bucket_lookups), so its lookup is (token[e], e / n)

// Group the lookups of tokens [0, n) by row. Table k owns rows k*P .. k*P + P - 1 and positions k*n .. k*n + n - 1.
template <typename A>
void bucket_lookups(const int64_t* rows, const A* scores, int64_t n, int64_t K, int64_t P, Buckets<A>& b) {
  b.start = scratch<int64_t>(0, K * P + 1);
  b.token = scratch<int32_t>(1, n * K);
  b.score = scratch<A>(2, n * K);
  int64_t* st = b.start;
  int32_t* tok = b.token;
  A* sc = b.score;
  parallel_tokens(K, n * K * 8, [=](int64_t k0, int64_t k1) {
    std::vector<int64_t> fill(P);
    for (int64_t k = k0; k < k1; ++k) {
      std::fill(fill.begin(), fill.end(), 0);
      for (int64_t i = 0; i < n; ++i) ++fill[rows[i * K + k] - k * P];   // rows checked by check_lookup_args
      int64_t pos = k * n;
      for (int64_t c = 0; c < P; ++c) { st[k * P + c] = pos; pos += fill[c]; fill[c] = st[k * P + c]; }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t at = fill[rows[i * K + k] - k * P]++;
        tok[at] = static_cast<int32_t>(i);
        sc[at] = scores[i * K + k];
      }
    }
  });
  st[K * P] = n * K;
}

// float32, W = kBlock columns: the row and the accumulators are vectors that the compiler keeps in registers across
// the hit loop (it does not do so for the generic loops' arrays). kBlock / kLanes vectors each: 4 with AVX-512,
// 8 with AVX2, 16 with NEON.
constexpr int64_t kBlockVecs = kBlock / kLanes;
static_assert(kBlock % kLanes == 0, "a column block is whole vectors");

inline void scatter_hits_f32(const float* t, const int32_t* tok, const float* sc, int64_t e0, int64_t e1,
                             float* buf) {
  fVec tv[kBlockVecs];
#pragma GCC unroll 16
  for (int64_t v = 0; v < kBlockVecs; ++v) tv[v] = fVec::loadu(t + v * kLanes);
  for (int64_t e = e0; e < e1; ++e) {
    float* y = buf + int64_t(tok[e]) * kBlock;
    const fVec s(sc[e]);
#pragma GCC unroll 16
    for (int64_t v = 0; v < kBlockVecs; ++v)
      at::vec::fmadd(s, tv[v], fVec::loadu(y + v * kLanes)).store(y + v * kLanes);
  }
}

// Forward of one column block [c0, c0 + W) for the tokens of one chunk: buf[i, :] = sum over the chunk's lookups
// (i, k) of scores * tables[row, c0:c0+W]. W is kBlock (vectorised, unrolled) or the ragged last block.
template <typename T, int64_t W>
void scatter_block(const Buckets<typename Acc<T>::type>& b, const T* tables, typename Acc<T>::type* buf, int64_t n,
                   int64_t R, int64_t D, int64_t c0, int64_t w) {
  using A = typename Acc<T>::type;
  const int64_t ww = W ? W : w;
  std::memset(static_cast<void*>(buf), 0, sizeof(A) * n * ww);
  const int64_t* st = b.start;
  const int32_t* tok = b.token;
  const A* sc = b.score;
  for (int64_t r = 0; r < R; ++r) {
    if (r + kRowAhead < R && st[r + kRowAhead] != st[r + kRowAhead + 1])
      prefetch_span(tables + (r + kRowAhead) * D + c0, ww);
    const int64_t e0 = st[r], e1 = st[r + 1];
    if (e0 == e1) continue;
    const T* t = tables + r * D + c0;
    if constexpr (std::is_same<T, float>::value && W == kBlock) {
      scatter_hits_f32(t, tok, sc, e0, e1, buf);
    } else if constexpr (std::is_same<A, float>::value && W == kBlock) {   // bfloat16 / float16: the row in float32
      alignas(64) float tv[kBlock];
#pragma GCC unroll 16
      for (int64_t v = 0; v < kBlockVecs; ++v) load_floats(t + v * kLanes).store(tv + v * kLanes);
      scatter_hits_f32(tv, tok, sc, e0, e1, buf);
    } else {
      A tv[W ? W : kBlock];
      for (int64_t j = 0; j < ww; ++j) tv[j] = to_acc(t[j]);
      for (int64_t e = e0; e < e1; ++e) {
        A* y = buf + int64_t(tok[e]) * ww;
        const A s = sc[e];
        if (W) {
#pragma omp simd
          for (int64_t j = 0; j < W; ++j) y[j] += s * tv[j];
        } else {
          for (int64_t j = 0; j < w; ++j) y[j] += s * tv[j];
        }
      }
    }
  }
}

// Column blocks of width kBlock, the last one ragged; threads take whole blocks.
inline int64_t num_blocks(int64_t D) { return (D + kBlock - 1) / kBlock; }

template <typename T>
void lookup_bucketed(const int64_t* rows, const typename Acc<T>::type* scores, const T* tables, const T* bias,
                     typename Acc<T>::type* out, int64_t N, int64_t K, int64_t P, int64_t D) {
  using A = typename Acc<T>::type;
  const int64_t R = K * P, nb = num_blocks(D), chunk = bucket_chunk<A>(tuning());
  Buckets<A> b;
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t n = std::min(chunk, N - n0);
    bucket_lookups(rows + n0 * K, scores + n0 * K, n, K, P, b);
    A* o = out + n0 * D;
    at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
      A* buf = scratch<A>(kWorkerSlot, n * kBlock);
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t c0 = blk * kBlock, w = std::min(kBlock, D - c0);
        if (w == kBlock) scatter_block<T, kBlock>(b, tables, buf, n, R, D, c0, w);
        else scatter_block<T, 0>(b, tables, buf, n, R, D, c0, w);
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < w; ++j) o[i * D + c0 + j] = buf[i * w + j] + (bias ? to_acc(bias[c0 + j]) : A(0));
      }
    });
  }
}
