// The token-major forward lookup (up to kSmallBatch tokens).
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ token-major lookup
// Token-major gather-accumulate: for each token, its K rows' spans of kCols output columns summed in vector registers
// in table order, the rows read kBlockRows at a time along their columns while the spans ahead are prefetched
// (add_rows_blocked), so the random row reads overlap instead of waiting on the cache one after another.
//
// The work is split over (token, column range) units: with fewer tokens than threads (a decode step has one token
// per sequence) the columns are split too, so that every thread reads rows. A decode step is latency-bound: its few
// hundred KB of scattered rows come from DRAM, and one core keeps only so many reads in flight, so a second core
// reading the other half of each row nearly halves the time. The split starts from kTokenSplitBytes of rows per unit
// (below it a thread's wake-up costs more than it saves) and splits the columns evenly in whole vectors (kLanes): a
// range's last span may be narrower than kCols (add_rows_span_order sums it in vectors too). Ranges of whole kCols
// spans split MF-small's Memory Block layer 2 (768 columns, 3 spans) 512 / 256 and its Q/K/V 5 / 4 spans, so one
// thread read up to twice the other's bytes while the other waited; on the 2-vCPU Zen 4 of
// benchmarks/results/2026-11-29e-zen4 (timers inside decode_stack, the two splits alternating step by step in one
// process) MF-small's lookups took 5.6% less time per step (625 -> 590 us, 5 windows of 300 steps).
constexpr int64_t kTokenSplitBytes = 32 << 10;

// Runs unit(n, cb, ce, rnext) over every (token n, column range [cb, ce)) unit, on the threads: rnext is the next
// token's rows when the same thread runs that token's unit next (for its prefetches), else nullptr. elem: bytes per
// table value read.
template <typename F>
void for_token_units(const int64_t* rows, int64_t N, int64_t K, int64_t D, int64_t elem, F unit) {
  const int64_t spans = (D + kCols - 1) / kCols;
  const int64_t bytes = N * K * D * elem;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t groups = 1;   // column ranges per token: enough units for every thread, none under kTokenSplitBytes
  if (N < threads && bytes >= 2 * kTokenSplitBytes)
    groups = std::min({(threads + N - 1) / N, spans, std::max<int64_t>(1, bytes / N / kTokenSplitBytes)});
  const int64_t per_group = ((D + kLanes - 1) / kLanes + groups - 1) / groups * kLanes;   // columns per range
  const int64_t units = N * groups;
  auto body = [=](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t n = u / groups, g = u % groups;
      const int64_t cb = std::min(D, g * per_group), ce = std::min(D, (g + 1) * per_group);
      if (cb < ce) unit(n, cb, ce, (groups == 1 && u + 1 < u1) ? rows + (n + 1) * K : nullptr);
    }
  };
  if (units == 1 || (groups == 1 && threads_for(N * K * D) == 1)) body(0, units);
  else at::parallel_for(0, units, 1, body);
}

// The row span read kAhead lookups after row k of the span at c0, in a unit's order (this span's rows, the next
// span's, the next token's first span): its start (nullptr: none) and width. stride: values per table row.
template <typename T>
inline const T* span_ahead(const T* tables, int64_t stride, const int64_t* rn, const int64_t* rnext, int64_t K,
                           int64_t k, int64_t c0, int64_t cb, int64_t ce, int64_t& w, int64_t ahead = kAhead) {
  const int64_t a = k + ahead;
  if (a < K) { w = std::min(kCols, ce - c0); return tables + rn[a] * stride + c0; }
  if (a - K >= K) return nullptr;
  if (c0 + kCols < ce) { w = std::min(kCols, ce - c0 - kCols); return tables + rn[a - K] * stride + c0 + kCols; }
  if (rnext != nullptr) { w = std::min(kCols, ce - cb); return tables + rnext[a - K] * stride + cb; }
  return nullptr;
}

// sums[0, ce - cb) += s_k * row_k[cb, ce) for k in table order, over a unit's whole spans [cb, ce) (a multiple of kCols
// wide), in the row-block order: the rows in blocks of kBlockRows, and for each block the spans in column order, each
// span's sums read from and written back to `sums` (an L1 buffer of floats, which the caller starts at the bias, or 0)
// around the block's rows. Shared with the int8 pass (T = uint8_t codes, stride D + 8, s the weights s_k scale_k);
// stride: values per table row. Every column adds row 0, 1, ..., K - 1 in table order, acc + s_k * row_k, the
// expression of the scalar loop for a ragged span, which the compiler contracts the same way (fused multiply-adds where
// the target has them): a column has the same bits in any of them (tests/kernel/test_fused_paths.py). Vector code
// because the compiler's vectorisation of the scalar loop ran 1.5x the instructions per row and, cold, about a third
// more time per call (MF-base Q/K/V shape on the Zen 3 of docs/performance.md, docs/kernel.md). The reads run along
// kBlockRows rows at a time, each row's spans in address order with its span kBlockAhead spans on prefetched (at the
// block's end, the next block's rows', then the next token's), which the hardware prefetchers follow, where the
// span-major order before it summed one span of all K rows at a time, each row's next span prefetched K lookups ahead.
// In a standalone copy on the 2-vCPU Zen 1 of docs/performance.md (2 threads, cold bfloat16 tables on huge pages),
// against the span-major order: MF-base's Q/K/V shape 66-68 -> 52-53 us, its Memory Block's 35 -> 28-32 and 30-35 ->
// 26-33 us, MF-small's Q/K/V 42-43 -> 31-37 us; blocks of 4-12 rows and 4-16 spans ahead measured, 8 and 4 the best or
// within 5% of it on every shape. "kBlockAhead spans on" counts in the order a row slot of the block reads them: this
// row's spans, then the spans of the row kBlockRows on, ... (a unit of fewer spans than kBlockAhead prefetches blocks
// ahead). Before, a unit of 1-3 spans (kCols = 256 on AVX-512: MF-base's and MF-small's Memory Blocks over 2
// threads) had only its first block prefetched. On a 2-vCPU AMD EPYC Zen 4 (lookup op, cold bfloat16 tables, 2 threads,
// in-process alternation, 3 runs): MF-base's Memory Block 32-33 -> 29 us and 22 -> 19 us, its Q/K/V 47-49 -> 46-48 us
// (2 and 6 spans ahead within 2% of 4); MF-small generate 4.51 -> 4.39 ms per token, MF-base 8.90 -> 8.83.
constexpr int64_t kBlockRows = 8, kBlockAhead = 4;

template <typename T>
inline void add_rows_blocked(float* sums, const T* tables, int64_t stride, const int64_t* rn, const int64_t* rnext,
                             const float* s, int64_t K, int64_t cb, int64_t ce) {
  constexpr int64_t V = kCols / kLanes;
  const int64_t S = (ce - cb) / kCols;   // spans per row of the unit
  // Row r's span at `at` (r past K: the next token's row r - K, where there is one), prefetched.
  const auto fetch = [&](int64_t r, int64_t at) {
    if (r < K) prefetch_span(tables + rn[r] * stride + at, kCols);
    else if (rnext != nullptr && r - K < K) prefetch_span(tables + rnext[r - K] * stride + at, kCols);
  };
  for (int64_t k = 0; k < std::min(K, kBlockRows); ++k)
    for (int64_t a = 0; a < kBlockAhead; ++a) fetch(k + a / S * kBlockRows, cb + a % S * kCols);
  for (int64_t kb = 0; kb < K; kb += kBlockRows) {
    const int64_t ke = std::min(K, kb + kBlockRows);
    for (int64_t c0 = cb; c0 < ce; c0 += kCols) {
      fVec acc[V];
      for (int64_t i = 0; i < V; ++i) acc[i] = fVec::loadu(sums + (c0 - cb) + i * kLanes);
      // kBlockAhead spans on in the row's slot of the block order: rows kBlockRows apart, each row's spans in turn
      const int64_t a = (c0 - cb) / kCols + kBlockAhead, down = a / S * kBlockRows, at = cb + a % S * kCols;
      for (int64_t k = kb; k < ke; ++k) {
        fetch(k + down, at);
        const T* t = tables + rn[k] * stride + c0;
        const fVec sk(s[k]);
        for (int64_t i = 0; i < V; ++i) acc[i] = acc[i] + sk * load_floats(t + i * kLanes);
      }
      for (int64_t i = 0; i < V; ++i) acc[i].store(sums + (c0 - cb) + i * kLanes);
    }
  }
}

// A narrow unit (at most kNarrowSpans whole spans per row) in the span order instead: each span of all K rows in
// table order, row k + kRowsAhead's span prefetched into L1 and row k + kRowsFar's into L2 as row k's is summed (past
// the last row, the next span's first rows, then the next token's: span_ahead), the same sums as add_rows_blocked
// (every column adds rows 0..K-1 in table order, the same expression): the same bits. The L2 prefetches keep more
// reads in flight than L1's miss buffers hold. On a 2-vCPU AMD EPYC Zen 4 (AVX-512: 256-column spans), timers inside
// decode_stack alternating the code before and after step by step in one process, both step parities
// (benchmarks/results/2026-11-29-zen4 and 2026-11-29b-zen4), per step:
// - the span order for units of 1-3 spans, L1 prefetches only, against the row-block order: MF-base's Memory Block
//   lookups 1.2-1.4 -> 0.9-1.1 ms (24 layers), MF-small's 367 -> 283 us, MF-tiny's (its Q/K/V too) 355 -> 264 us;
//   units of 6 spans (MF-base's Q/K/V) the same time in either order;
// - with the L2 prefetches 12 rows ahead and units of up to 6 spans: MF-base's Q/K/V 906-932 -> 744-793 us, its
//   Memory Block's layer 1 480-486 -> 391-407 us and layer 2 390-647 -> 349-387 us, its stack 2.86 -> 2.29-2.51 ms;
//   MF-small's stack 889-923 -> 780-825 us, MF-tiny's 261-270 -> 242-245 us, int8 MF-base's 2.63-2.93 -> 2.49-2.69
//   ms. The same L2 prefetches added to the row-block order (8-16 spans ahead) moved MF-base's Q/K/V by +6% to -11%
//   from run to run: not taken.
// An AVX2 build (64-column spans) on the same Zen 4, in this order: MF-tiny's Memory Block units (4 and 5 spans)
// 55-61 -> 37-43 us per layer and step, MF-small's second Memory Block layer (6 spans) 181-499 -> 143-366 us; wider
// units (7-24 spans: MF-small's first layer and Q/K/V, MF-base's) keep the row-block order, which ran MF-base's Q/K/V
// in 1.04 and 1.48 ms per step against 1.85 and 2.30 in the span order with L1 prefetches 6 and 12 rows ahead: the
// rule goes by spans per unit.
// The span sum (load the sums, add s_k * row_k per row, store) is written out here and in add_rows_blocked: one
// inline helper taking the prefetches as a lambda, called by both, made MF-base's lookups 1.2-3.3x slower in
// decode_stack (alternating step by step with these loops in one process, both parities, always_inline or not, on the
// Zen 4 of benchmarks/results/2026-11-29c-zen4).
constexpr int64_t kNarrowSpans = 6, kRowsAhead = 4, kRowsFar = 12;

// One span of V vectors at c0 of a unit [cb, ce) (V = kCols / kLanes but for a unit's narrower last span).
template <int64_t V, typename T>
inline void add_span_rows(float* sums, const T* tables, int64_t stride, const int64_t* rn, const int64_t* rnext,
                          const float* s, int64_t K, int64_t c0, int64_t cb, int64_t ce) {
  fVec acc[V];
  for (int64_t i = 0; i < V; ++i) acc[i] = fVec::loadu(sums + (c0 - cb) + i * kLanes);
  for (int64_t k = 0; k < K; ++k) {
    int64_t w = 0;
    if (const T* p = span_ahead(tables, stride, rn, rnext, K, k, c0, cb, ce, w, kRowsAhead)) prefetch_span(p, w);
    if (const T* p = span_ahead(tables, stride, rn, rnext, K, k, c0, cb, ce, w, kRowsFar)) prefetch_span<2>(p, w);
    const T* t = tables + rn[k] * stride + c0;
    const fVec sk(s[k]);
    for (int64_t i = 0; i < V; ++i) acc[i] = acc[i] + sk * load_floats(t + i * kLanes);
  }
  for (int64_t i = 0; i < V; ++i) acc[i].store(sums + (c0 - cb) + i * kLanes);
}

// f(std::integral_constant<int64_t, v>) for a run-time v in [1, sizeof...(I)].
template <typename F, int64_t... I>
inline void with_vectors(int64_t v, F&& f, std::integer_sequence<int64_t, I...>) {
  ((v == I + 1 ? (f(std::integral_constant<int64_t, I + 1>{}), 0) : 0), ...);
}

// [cb, ce): whole vectors, the spans kCols wide but the last.
template <typename T>
inline void add_rows_span_order(float* sums, const T* tables, int64_t stride, const int64_t* rn, const int64_t* rnext,
                                const float* s, int64_t K, int64_t cb, int64_t ce) {
  for (int64_t k = 0; k < std::min(K, kRowsAhead); ++k)
    prefetch_span(tables + rn[k] * stride + cb, std::min(kCols, ce - cb));
  int64_t c0 = cb;
  for (; c0 + kCols <= ce; c0 += kCols)
    add_span_rows<kCols / kLanes>(sums, tables, stride, rn, rnext, s, K, c0, cb, ce);
  if (c0 < ce)
    with_vectors((ce - c0) / kLanes, [&](auto v) {
      add_span_rows<decltype(v)::value>(sums, tables, stride, rn, rnext, s, K, c0, cb, ce);
    }, std::make_integer_sequence<int64_t, kCols / kLanes>{});
}

// The whole vectors of a unit [cb, ce), for lookup_kernel and the int8 pass: a thread's buffer of
// float sums (grown to the widest unit seen, then reused), started by start(sums, w), summed by add_rows_blocked
// (its whole spans, the narrower rest in the span order) or, for a narrow unit, add_rows_span_order (the next token's
// rows prefetched only where no ragged columns follow, which read them themselves), handed to finish(sums, w), w = the
// whole vectors' width. Returns where the ragged last columns (fewer than kLanes) start (ce where there are none).
template <typename T, typename Start, typename Finish>
int64_t sum_whole_vectors(const T* tables, int64_t stride, const int64_t* rn, const int64_t* rnext, const float* s,
                          int64_t K, int64_t cb, int64_t ce, Start start, Finish finish) {
  const int64_t spans = cb + (ce - cb) / kCols * kCols, whole = cb + (ce - cb) / kLanes * kLanes;
  if (whole == cb) return cb;
  static thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < whole - cb) buffer.resize(whole - cb);
  float* sums = buffer.data();
  start(sums, whole - cb);
  const int64_t* next = whole == ce ? rnext : nullptr;
  if ((spans - cb) / kCols <= kNarrowSpans) {
    add_rows_span_order(sums, tables, stride, rn, next, s, K, cb, whole);
  } else {
    add_rows_blocked(sums, tables, stride, rn, spans == whole ? next : nullptr, s, K, cb, spans);
    if (spans < whole) add_rows_span_order(sums + (spans - cb), tables, stride, rn, next, s, K, spans, whole);
  }
  finish(static_cast<const float*>(sums), whole - cb);
  return whole;
}

template <typename T>
void lookup_kernel(const int64_t* rows, const typename Acc<T>::type* scores, const T* tables, const T* bias,
                   T* out, int64_t N, int64_t K, int64_t D) {
  using A = typename Acc<T>::type;
  for_token_units(rows, N, K, D, int64_t(sizeof(T)), [=](int64_t n, int64_t cb, int64_t ce, const int64_t* rnext) {
    const int64_t* rn = rows + n * K;
    const A* sn = scores + n * K;
    int64_t c0 = cb;
    if constexpr (std::is_same<A, float>::value) {   // whole vectors (sum_whole_vectors), from the bias (or 0)
      c0 = sum_whole_vectors(tables, D, rn, rnext, sn, K, cb, ce, [&](float* sums, int64_t w) {
        for (int64_t j = 0; j < w; j += kLanes) (bias ? load_floats(bias + cb + j) : fVec(0.f)).store(sums + j);
      }, [&](const float* sums, int64_t w) {
        T* o = out + n * D + cb;   // accumulated in float32, stored in the tables' dtype
        for (int64_t j = 0; j < w; ++j) o[j] = static_cast<T>(sums[j]);
      });
    }
    // The ragged last columns (fewer than kLanes; all of a float64 table's): summed one span at a time, as scalars.
    if (c0 < ce)
      for (int64_t k = 0; k < K; ++k) prefetch_span(tables + rn[k] * D + c0, std::min(kCols, ce - c0));
    for (; c0 < ce; c0 += kCols) {
      const int64_t w = std::min(kCols, ce - c0);
      A acc[kCols];
      for (int64_t j = 0; j < w; ++j) acc[j] = bias ? to_acc(bias[c0 + j]) : A(0);
      for (int64_t k = 0; k < K; ++k) {
        int64_t pw = 0;
        if (const T* p = span_ahead(tables, D, rn, rnext, K, k, c0, cb, ce, pw, K)) prefetch_span(p, pw);
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
  });
}
