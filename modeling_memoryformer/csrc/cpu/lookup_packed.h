// The packed forward lookup.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ packed forward
// Tables (float32, bfloat16, float16) about the size of the LLC, many tokens: the output is built in column blocks of
// kPackCols columns for chunks of tokens; a thread takes whole (chunk, column block) units. For each group of tables,
// two phases:
// 1. copy ("pack") the group's rows restricted to the block into a contiguous buffer (a quarter of L2): a pure
//    stream from L3 / DRAM, prefetched kPackAhead rows ahead. The copy exists because a column block of the table is
//    strided (rows D * 4 >= 1 KB apart) and would map onto a few L2 sets only.
// 2. the chunk's tokens add their lookups of the group from the buffer, several tokens at a time (tokens_for) with
//    their sums in registers, into a compact [chunk, kPackCols] accumulator (a quarter of L2) that goes to the output
//    after the last group, by non-temporal stores (whole 128-byte spans: no read for ownership of the output's
//    lines, which the table stream would evict from the caches anyway).
// The phases are not interleaved: interleaved, the stream's misses held the miss buffers that the gathers' L2 hits
// need, and the kernel ran at the sum of both phases' times or worse. The table is read once per chunk instead of
// once per lookup. The lookups are regrouped first, per group of tables (an int32 offset into the buffer and the
// score, contiguous per group), so that each pass over a group reads them in order from a compact array.
constexpr int64_t kPackVecs = kPackCols / kLanes;   // vectors per packed row: 2 (AVX-512), 4 (AVX2), 8 (NEON)
static_assert(kPackCols % (2 * kLanes) == 0, "a packed row is whole pairs of vectors");
constexpr int64_t kPackAhead = 32;   // rows prefetched (into L2) ahead of the copy

// bfloat16 rows are widened by the bit pattern: a 32-bit word of a packed row holds columns 2j (low half) and 2j + 1
// (high half), and `word << 16` and `word & 0xffff0000` are those two columns as float32, exactly (one integer
// operation per 16 values, instead of a zero-extension and a shift per 16 values through at::vec::load_to_float, so
// each group of rows stays a plain copy of the table's bytes). The sums of a block then hold its even columns in
// the first vector of each pair and its odd columns in the second: the accumulator keeps that order (`acc_column`)
// and the final store puts the columns back in place. AVX512_BF16's dot product (vdpbf16ps) over pairs of lookups is
// not used: it would round the scores to bfloat16 and gains little, the gathers being bound by their loads and
// integer operations as much as by the multiply-adds (docs/kernel.md).
using iVec = at::vec::Vectorized<int32_t>;
static_assert(iVec::size() == kLanes, "an int32 vector has as many lanes as a float vector");
template <typename T> constexpr bool kSplitWords = std::is_same<T, c10::BFloat16>::value;

// The column (within its block) held at position p of a block's sums: p itself, or for bfloat16 tables (see above)
// position v * kLanes + i of vector v = 2 j + h holds column 2 (j * kLanes + i) + h.
template <typename T> constexpr int64_t acc_column(int64_t p) {
  if constexpr (kSplitWords<T>) {
    const int64_t v = p / kLanes, i = p % kLanes;
    return 2 * ((v / 2) * kLanes + i) + v % 2;
  } else {
    return p;
  }
}

// acc[n + i, :] (+)= sum over the gn tables of the group of sc * pack[loc], for the TT tokens n .. n + TT - 1 of the
// chunk, whose entries of the group are loc/sc[(n + i) * gn + k]; `first` starts from the bias block instead. A packed
// row (and a row of acc) is V vectors wide: V * kLanes columns.
template <int TT, int V, typename T>
inline void packed_tokens(const int32_t* loc, const float* sc, const T* pack, const float* bias_block, float* acc,
                          int64_t n, int64_t gn, bool first) {
  constexpr int64_t C = V * kLanes;
  fVec a[TT][V];
#pragma GCC unroll 4
  for (int i = 0; i < TT; ++i) {
    const float* start = first ? bias_block : acc + (n + i) * C;
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) a[i][v] = fVec::loadu(start + v * kLanes);
  }
  const int32_t* l = loc + n * gn;
  const float* s = sc + n * gn;
  for (int64_t k = 0; k < gn; ++k) {
#pragma GCC unroll 4
    for (int i = 0; i < TT; ++i) {
      const T* t = pack + l[i * gn + k];
      const fVec w(s[i * gn + k]);
      if constexpr (kSplitWords<T>) {
        const iVec shift(16), high(int32_t(0xffff0000u));
        const int32_t* words = reinterpret_cast<const int32_t*>(t);
#pragma GCC unroll 4
        for (int v = 0; v < V / 2; ++v) {
          const iVec word = iVec::loadu(words + v * kLanes);
          a[i][2 * v] = at::vec::fmadd(w, at::vec::cast<float>(word << shift), a[i][2 * v]);
          a[i][2 * v + 1] = at::vec::fmadd(w, at::vec::cast<float>(word & high), a[i][2 * v + 1]);
        }
      } else {
#pragma GCC unroll 8
        for (int v = 0; v < V; ++v) a[i][v] = at::vec::fmadd(w, load_floats(t + v * kLanes), a[i][v]);
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < TT; ++i) {
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) a[i][v].store(acc + (n + i) * C + v * kLanes);
  }
}

// Whether the packed forward can run: float32, bfloat16 or float16 tables whose width is whole column blocks.
bool packed_applies(at::ScalarType dtype, int64_t D) {
  return (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) && D % kPackCols == 0;
}

// Tokens summed at once for packed rows of V vectors: their sums fill at most half the vector registers, at most 4.
constexpr int tokens_for(int64_t V) { return int(std::max<int64_t>(1, std::min<int64_t>(4, kVecRegs / 2 / V))); }

// Column blocks of kPackCols a packed row spans: 2 for 16-bit tables (a row of 64 columns, 128 bytes) where the
// registers still sum 2 or more tokens at once with rows that wide (32 vector registers of 16 floats: AVX-512), else 1.
// The copy then reads 128 contiguous bytes of each table row instead of one 64-byte line at a stride of D * 2 bytes,
// which streamed tables beyond the L3 more slowly (docs/kernel.md). 1 when the blocks do not pair.
int64_t packed_span(int64_t element_bytes, int64_t nblk) {
  const bool wide = element_bytes * kPackCols < 128 && tokens_for(2 * kPackVecs) >= 2;
  return wide && nblk % 2 == 0 ? 2 : 1;
}

// T: the tables' dtype, which the packed rows keep (bfloat16 / float16 rows take half the bytes of float32 ones, so a
// group holds twice the rows of one block, or as many rows of two blocks, and are widened to float32 in registers as
// they are added); sums in float32; the output in T (bias in T). W: column blocks per packed row (packed_span).
template <typename T, int64_t W>
void lookup_packed_span(const int64_t* rows, const float* scores, const T* tables, const T* bias, T* out,
                        int64_t N, int64_t K, int64_t P, int64_t D) {
  constexpr int64_t C = W * kPackCols;   // columns of a packed row
  constexpr int V = int(C / kLanes), TT = tokens_for(V);
  const Tuning tu = tuning();
  const int64_t G = std::min(K, std::max<int64_t>(1, tu.pack_group / (P * C * int64_t(sizeof(T)))));
  // Chunks of equal size, at most pack_chunk tokens (a small last chunk would copy the whole table for few tokens).
  // With W = 2 their accumulator fills all of L2 rather than half and spills to L3 in part, which costs less than
  // streaming the tables once more (docs/kernel.md).
  const int64_t nchunk = (N + tu.pack_chunk - 1) / tu.pack_chunk, chunk_size = (N + nchunk - 1) / nchunk;
  const int64_t nspan = D / C;
  TORCH_CHECK(G * P * C <= std::numeric_limits<int32_t>::max(),
              "memoryformer.lookup: a packed group of ", G, " x ", P, " rows is too large for int32 offsets");
  // Group-major lookups: group [g0, g0 + gn) holds, for token n and table g0 + k, at (g0 * N + n * gn + k), the
  // offset of the row in the group's buffer and the score.
  int32_t* loc = scratch<int32_t>(0, N * K);
  float* sc = scratch<float>(1, N * K);
  parallel_tokens(N, N * K * 4, [&](int64_t n0, int64_t n1) {
    for (int64_t g0 = 0; g0 < K; g0 += G) {
      const int64_t gn = std::min(G, K - g0);
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t k = 0; k < gn; ++k) {
          loc[g0 * N + n * gn + k] = int32_t((rows[n * K + g0 + k] - g0 * P) * C);
          sc[g0 * N + n * gn + k] = scores[n * K + g0 + k];
        }
    }
  });
  // Rows [0, nrows) of the group from g0, columns c0 .. c0 + C - 1, into pack.
  auto copy = [=](T* pack, int64_t g0, int64_t nrows, int64_t c0) {
    const T* base = tables + g0 * P * D + c0;
    for (int64_t r = 0; r < nrows; ++r) {
      const T* src = base + r * D;
      if (r + kPackAhead < nrows)
        for (int64_t c = 0; c < C; c += 64 / int64_t(sizeof(T))) __builtin_prefetch(src + kPackAhead * D + c, 0, 2);
      std::memcpy(static_cast<void*>(pack + r * C), src, sizeof(T) * C);
    }
  };
  parallel_tokens(nchunk * nspan, N * K * D, [&](int64_t u0, int64_t u1) {
    // One scratch block: the accumulator [chunk, C] float32 first (64-byte aligned), then the packed rows.
    const int64_t acc_floats = chunk_size * C, pack_bytes = G * P * C * int64_t(sizeof(T));
    float* acc = static_cast<float*>(scratch_bytes(kWorkerSlot, size_t(acc_floats * int64_t(sizeof(float)) +
                                                                        pack_bytes)));
    T* pack = reinterpret_cast<T*>(acc + acc_floats);
    alignas(64) float bias_block[C];
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t n0 = (u / nspan) * chunk_size, nn = std::min(chunk_size, N - n0), c0 = (u % nspan) * C;
      for (int64_t p = 0; p < C; ++p) bias_block[p] = bias ? float(bias[c0 + acc_column<T>(p)]) : 0.0f;
      for (int64_t g0 = 0; g0 < K; g0 += G) {
        const int64_t gn = std::min(G, K - g0);
        copy(pack, g0, gn * P, c0);
        const int32_t* l = loc + g0 * N + n0 * gn;
        const float* s = sc + g0 * N + n0 * gn;
        const bool first = g0 == 0;
        int64_t n = 0;
        for (; n + TT <= nn; n += TT) packed_tokens<TT, V>(l, s, pack, bias_block, acc, n, gn, first);
        for (; n < nn; ++n) packed_tokens<1, V>(l, s, pack, bias_block, acc, n, gn, first);
      }
      if constexpr (kSplitWords<T>) {   // columns back in place (each (even, odd) pair of vectors interleaved)
        static_assert(at::vec::Vectorized<T>::size() == 2 * kLanes, "two float vectors round to one 16-bit vector");
        for (int64_t i = 0; i < nn; ++i) {
          const float* a = acc + i * C;
          T* o = out + (n0 + i) * D + c0;
#pragma GCC unroll 4
          for (int v = 0; v < V; v += 2) {
            const auto both = at::vec::interleave2(fVec::loadu(a + v * kLanes), fVec::loadu(a + (v + 1) * kLanes));
            at::vec::convert_from_float<T>(std::get<0>(both), std::get<1>(both)).store(o + v * kLanes);
          }
        }
      } else {
        for (int64_t i = 0; i < nn; ++i) store_span(out + (n0 + i) * D + c0, acc + i * C, C, true);
      }
    }
    stream_fence();
  });
}

template <typename T>
void lookup_packed(const int64_t* rows, const float* scores, const T* tables, const T* bias, T* out,
                   int64_t N, int64_t K, int64_t P, int64_t D) {
  if (N == 0) return;
  if (packed_span(sizeof(T), D / kPackCols) == 2)
    lookup_packed_span<T, 2>(rows, scores, tables, bias, out, N, K, P, D);
  else
    lookup_packed_span<T, 1>(rows, scores, tables, bias, out, N, K, P, D);
}
