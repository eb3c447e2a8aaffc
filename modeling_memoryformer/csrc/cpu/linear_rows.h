// The few-row linear (the LM head while decoding).
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ few-row linear
// y = x W^T (+ b) for a few rows of x (decoding: the LM head of one token reads a [vocab, d] weight for one row of
// output). The output columns are split over the threads in contiguous ranges (balanced as they run: "the threads'
// shares" below), so the pass streams W once. Two loops, by what bounds them:
// - one weight row at a time (linear_rows_row: M = 1 and 2, and float32 weights): the weight is read as one
//   sequential stream per thread, each output summed in kLinearChains interleaved vector chains, with two software
//   prefetches, into L1 near and into L2 far ahead. On the 2-vCPU Intel Xeon (AMX, L2 2 MB) of docs/performance.md
//   this streams a cold bfloat16 head at 32-36 GB/s where the blocked loop below took 22 (a torch.dot read probe:
//   29-31; its L3 serves part of a re-read head, at up to 57 GB/s either way).
// - R weight rows at a time (linear_rows_block: 3 and 4 rows of bfloat16 x): one sum per (row of x, weight row), M x
//   R chains, each x vector loaded once for R weight rows. With 3-4 rows of x a bfloat16 head is bound by the core
//   (each weight vector widened, then 3-4 multiply-adds, each x vector loaded again per weight row in the loop above),
//   and sharing the x loads over two weight rows keeps the blocked loop 10-15% ahead there (3.3 against 3.8 ms for
//   MF-small's head at 4 rows).
// The sums are kept in registers, as RawVec (prelude.h): GCC kept an earlier kernel's array of sums on the stack (a
// store and a reload per FMA), which bounded a core at about 11 GB/s of bfloat16 weight on the Zen 3 of
// docs/performance.md (docs/kernel.md). A row's sums are in one order whatever the split over threads, so its outputs
// keep their bits; the order differs between the two loops (1-2 rows of x against 3-4 of bfloat16).
constexpr int64_t kLinearMaxRows = 4;   // rows of x handled in registers; the op takes up to this many

// Sums of one block: R weight rows [w, w + R * D) against M rows of x, each reduced to a float after its vector
// chain (then the D % kLanes tail, then the bias) and stored in y's dtype O (float32, or bfloat16 rounded once, as
// the float32 sum's .to(bfloat16)). T: float32, or bfloat16 widened in registers.
template <int64_t M, int64_t R, typename T, typename O>
inline void linear_rows_block(const float* x, const T* w, const float* b, O* y, int64_t D, int64_t V,
                              int64_t v, const T* w_end) {
  constexpr int64_t L = kLanes;
  constexpr int64_t B = R * L * int64_t(sizeof(T));   // bytes of weight one step of j reads
  const int64_t Dv = D - D % L;
  // The block after next, prefetched B bytes per step: the R rows are R streams D values apart, which the hardware
  // prefetcher follows worse than one (on the Zen 3 measured, MF-small's 77 MB head took 4.7-6.2 ms without this,
  // 2.6-2.9 ms with it).
  const char* next = reinterpret_cast<const char*>(w + 2 * R * D);
  const char* next_end = reinterpret_cast<const char*>(std::min(w + 3 * R * D, w_end));
  const auto add = [](fVec& p, fVec& q) { return p + q; };
  // The chains: loops over constants, unrolled by pragma so that GCC keeps the array in registers (left to its own
  // unroller, it unrolled them too late and kept the array on the stack).
  RawVec acc[M * R];   // in registers (RawVec: see prelude.h)
#pragma GCC unroll 8
  for (int64_t i = 0; i < M * R; ++i) acc[i] = raw_vec(fVec(0.f));
  for (int64_t j = 0; j < Dv; j += L, next += B) {
    if (next < next_end)
      for (int64_t c = 0; c < B; c += 64) __builtin_prefetch(next + c);
    fVec xv[M];
#pragma GCC unroll 4
    for (int64_t m = 0; m < M; ++m) xv[m] = fVec::loadu(x + m * D + j);
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) {
      const fVec u = load_floats(w + r * D + j);
#pragma GCC unroll 4
      for (int64_t m = 0; m < M; ++m) acc[m * R + r] = raw_vec(at::vec::fmadd(xv[m], u, from_raw(acc[m * R + r])));
    }
  }
  // The reduction's loops have a runtime tail inside and do not unroll: they read a copy.
  fVec sums[M * R];
#pragma GCC unroll 8
  for (int64_t i = 0; i < M * R; ++i) sums[i] = from_raw(acc[i]);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < R; ++r) {
      float sum = at::vec::vec_reduce_all<float>(add, sums[m * R + r]);
      for (int64_t j = Dv; j < D; ++j) sum += x[m * D + j] * float(w[r * D + j]);
      y[m * V + v + r] = static_cast<O>(b ? sum + b[v + r] : sum);
    }
}

// One weight row at a time: row w [D] against M rows of x, each output summed in kLinearChains vector chains (chain c
// takes vectors c, c + C, c + 2C, ... of the row; then the D % (C * kLanes) vectors on the first chain), the chains
// added as (0 + 1) + (2 + 3), reduced, then the D % kLanes tail and the bias. Prefetches, where the trial takes them
// (linear_reads.h), every cache line of the stream once: into L1 kLinearNearBytes ahead, into L2 kLinearFarBytes ahead
// (on the Xeon above: the near one alone 30 GB/s cold, with the far one 32-36; only the far one, 26-27), both only
// within the thread's range `end`. A bfloat16 row is read in pairs of values (load_bf16_pairs: each vector of 2 *
// kLanes values gives its even and its odd values as two float32 vectors, by a shift and a mask) instead of kLanes
// values widened at a time by a cross-lane zero-extension; x comes split to match (split_pairs), so chain 0 sums the
// even values of each step's first pair of vectors, chain 1 its odd ones, chains 2 and 3 those of the second pair.
// On the 2-vCPU Zen 4 of benchmarks/results/2026-11-29f-zen4 (MF-small's 77 MB head, cold, on huge pages, without
// prefetches; a standalone copy, passes alternated) the widening read 45-48 GB/s where the pairs read 57 and a plain
// read of the same bytes 61-65.
constexpr int64_t kLinearChains = 4;            // chains per output (one, latency-bound, read 24-28 GB/s in a copy)
constexpr int64_t kLinearNearBytes = 2 << 10;   // L2 -> L1 in flight
constexpr int64_t kLinearFarBytes = 16 << 10;   // memory -> L2 in flight (8-32 KB measured the same)

template <int64_t M, bool Prefetch, typename T, typename O>
inline void linear_rows_row(const float* x, const T* w, const float* b, O* y, int64_t D, int64_t V, int64_t v,
                            const char* end) {
  constexpr int64_t L = kLanes, C = kLinearChains, S = C * L;
  constexpr int64_t B = S * int64_t(sizeof(T));   // bytes of weight one step reads
  constexpr bool pairs = std::is_same_v<T, c10::BFloat16>;   // x split by split_pairs
  static_assert(C == 4, "the chains are added as (0 + 1) + (2 + 3) below");
  const int64_t Ds = D - D % S, Dv = D - D % L;
  const char* near = reinterpret_cast<const char*>(w) + kLinearNearBytes;
  const char* far = reinterpret_cast<const char*>(w) + kLinearFarBytes;
  RawVec acc[M * C];   // in registers (RawVec: see prelude.h)
#pragma GCC unroll 16
  for (int64_t i = 0; i < M * C; ++i) acc[i] = raw_vec(fVec(0.f));
  int64_t j = 0;
  for (; j < Ds; j += S, near += B, far += B) {
#pragma GCC unroll 4
    for (int64_t c = 0; c < B; c += 64) {
      if (Prefetch && near + c < end) __builtin_prefetch(near + c);
      if (Prefetch && far + c < end) __builtin_prefetch(far + c, 0, 2);
    }
    fVec u0, u1, u2, u3;   // named, not an array (see RawVec)
    if constexpr (pairs) {
      load_bf16_pairs(w + j, u0, u1);
      load_bf16_pairs(w + j + 2 * L, u2, u3);
    } else {
      u0 = load_floats(w + j);
      u1 = load_floats(w + j + L);
      u2 = load_floats(w + j + 2 * L);
      u3 = load_floats(w + j + 3 * L);
    }
#pragma GCC unroll 4
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * D + j;
      RawVec* a = acc + m * C;
      a[0] = raw_vec(at::vec::fmadd(fVec::loadu(xm), u0, from_raw(a[0])));
      a[1] = raw_vec(at::vec::fmadd(fVec::loadu(xm + L), u1, from_raw(a[1])));
      a[2] = raw_vec(at::vec::fmadd(fVec::loadu(xm + 2 * L), u2, from_raw(a[2])));
      a[3] = raw_vec(at::vec::fmadd(fVec::loadu(xm + 3 * L), u3, from_raw(a[3])));
    }
  }
  if constexpr (pairs) {   // a last pair of vectors, on chains 0 and 1
    if (j + 2 * L <= Dv) {
      fVec e, o;
      load_bf16_pairs(w + j, e, o);
#pragma GCC unroll 4
      for (int64_t m = 0; m < M; ++m) {
        acc[m * C] = raw_vec(at::vec::fmadd(fVec::loadu(x + m * D + j), e, from_raw(acc[m * C])));
        acc[m * C + 1] = raw_vec(at::vec::fmadd(fVec::loadu(x + m * D + j + L), o, from_raw(acc[m * C + 1])));
      }
      j += 2 * L;
    }
  }
  for (; j < Dv; j += L) {
    const fVec u = load_floats(w + j);
#pragma GCC unroll 4
    for (int64_t m = 0; m < M; ++m)
      acc[m * C] = raw_vec(at::vec::fmadd(fVec::loadu(x + m * D + j), u, from_raw(acc[m * C])));
  }
  // The reduction's loop has a runtime tail inside and does not unroll: it reads a copy (indexing the sums by a
  // runtime m kept all of them in memory for two rows of x: 31 against 85 GB/s for one row, hot, on the Zen 4).
  RawVec sums[M * C];
#pragma GCC unroll 16
  for (int64_t i = 0; i < M * C; ++i) sums[i] = acc[i];
  const auto add = [](fVec& p, fVec& q) { return p + q; };
  for (int64_t m = 0; m < M; ++m) {
    const RawVec* a = sums + m * C;
    fVec sum4 = (from_raw(a[0]) + from_raw(a[1])) + (from_raw(a[2]) + from_raw(a[3]));
    float sum = at::vec::vec_reduce_all<float>(add, sum4);
    for (int64_t k = Dv; k < D; ++k) sum += x[m * D + k] * float(w[k]);
    y[m * V + v] = static_cast<O>(b ? sum + b[v] : sum);
  }
}

// T: the weight's dtype (float32, or bfloat16 widened in registers: half the bytes to stream); x and b float32, y
// float32 or T.
//
// The threads' shares. Each thread (a slot) starts with a contiguous range of the weight's rows, as a static split
// would give it, and takes it piece by piece from the front (kLinearPieceBytes of weight a piece); a slot whose range
// is done takes the pieces left at the back of another's. So the pass ends when the rows do, not when the slower
// thread's half does: inside MF-tiny's `generate` on the 2-vCPU Zen 1 of docs/performance.md one thread of the static
// split finished its half 350-800 us after the other in some processes (the head 3.0-3.2 ms against 2.4-2.5 ms where
// the halves kept pace; which half was late moved between processes), and on CPUs with cores of two speeds one half
// always would. A slot's own pieces are contiguous, so its stream and its prefetch run across them as across one
// range. Each output is one weight row's sum, whoever computes it: the same bits on any split. A weight of two pieces
// or more is split, however few its rows: a rule of 1024 rows per slot at least (argmax.h's kLinearGrain, for a row
// of logits) ran a dense model's [768, 3072] and [1024, 4096] matrices (4.7 and 8.4 MB of bfloat16) on one thread, at
// 9-10 GB/s where the split passes read 16-18 on the 2-vCPU Xeon of benchmarks/results/2026-11-29-xeon-amx.
constexpr int64_t kLinearGrain = 1024;              // argmax_rows: logits per thread at least
constexpr int64_t kLinearPieceBytes = 256 << 10;    // weight bytes per piece (rows: a multiple of 8)

// A slot's range of pieces [front, back) in one word, so that its owner (from the front) and another slot (from the
// back) never take the same piece. On its own cache line: the owner takes a piece without sharing one.
struct alignas(64) PieceRange {
  std::atomic<uint64_t> word{0};
  void set(uint64_t front, uint64_t back) { word.store(back << 32 | front, std::memory_order_relaxed); }
  int64_t take(bool from_back) {   // the piece taken, or -1 where none is left
    uint64_t w = word.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t front = w & 0xffffffffu, back = w >> 32;
      if (front >= back) return -1;
      const uint64_t next = from_back ? (back - 1) << 32 | front : back << 32 | (front + 1);
      if (word.compare_exchange_weak(w, next, std::memory_order_relaxed)) return int64_t(from_back ? back - 1 : front);
    }
  }
};

// For tests (memoryformer.linear_rows_balance): slot `delay_slot` starts `delay_us` late, so that the others take its
// pieces; and the pieces the last pass took from another slot's range. Off (-1) unless a test sets it.
std::atomic<int64_t> linear_delay_slot{-1}, linear_delay_us{0}, linear_stolen{0};

template <typename T>
int64_t linear_piece_rows(int64_t D) {
  return std::max<int64_t>(8, kLinearPieceBytes / std::max<int64_t>(1, D * int64_t(sizeof(T))) / 8 * 8);
}

// The slots a pass of V rows runs on (1: no split): linear_rows_kernel's S, which its caller sizes per-slot state by.
template <typename T>
int64_t linear_slots(int64_t D, int64_t V) {
  if (at::in_parallel_region()) return 1;
  const int64_t pieces = (V + linear_piece_rows<T>(D) - 1) / linear_piece_rows<T>(D);
  return std::max<int64_t>(1, std::min(int64_t(at::get_num_threads()), pieces));
}

template <typename T>
int64_t argmax_row(const T* p, int64_t V);   // argmax.h

// chunk(slot, v0, v1) runs after a slot has stored the outputs of rows [v0, v1) (the argmax of those outputs, while
// they sit in that thread's caches); none: nothing.
struct NoChunk {
  void operator()(int64_t, int64_t, int64_t) const {}
};

// The loop (see the top of this part): one weight row at a time, or 2 at a time for 3-4 rows of bfloat16 x.
constexpr bool linear_by_row(int64_t M, bool float_weight) { return M <= 2 || float_weight; }

template <int64_t M, typename T, typename O, typename Chunk = NoChunk>
void linear_rows_kernel(const float* x, const T* w, const float* b, O* y, int64_t D, int64_t V, int64_t S,
                        bool prefetch, const Chunk& chunk = Chunk()) {
  constexpr bool by_row = linear_by_row(M, std::is_same_v<T, float>);
  constexpr int64_t R = 2;
  // Rows [v0, v1) of slot s, prefetching up to `end` (the end of the slot's own range: its next piece).
  const auto rows = [&](int64_t s, int64_t v0, int64_t v1, const T* end) {
    int64_t v = v0;
    if constexpr (by_row) {
      const char* e = reinterpret_cast<const char*>(end);
      if (prefetch) for (; v < v1; ++v) linear_rows_row<M, true>(x, w + v * D, b, y, D, V, v, e);
      else for (; v < v1; ++v) linear_rows_row<M, false>(x, w + v * D, b, y, D, V, v, e);
    } else {
      for (; v + R <= v1; v += R) linear_rows_block<M, R>(x, w + v * D, b, y, D, V, v, end);
      for (; v < v1; ++v) linear_rows_block<M, 1>(x, w + v * D, b, y, D, V, v, end);
    }
    chunk(s, v0, v1);
  };
  if (S == 1) {
    rows(0, 0, V, w + V * D);
    linear_stolen.store(0);
    return;
  }
  const int64_t piece = linear_piece_rows<T>(D), pieces = (V + piece - 1) / piece;
  std::vector<PieceRange> ranges(S);
  for (int64_t s = 0; s < S; ++s) ranges[s].set(pieces * s / S, pieces * (s + 1) / S);
  const int64_t delay_slot = linear_delay_slot.load(), delay_us = linear_delay_us.load();
  std::atomic<int64_t> stolen{0};
  at::parallel_for(0, S, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      if (s == delay_slot) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
      const T* end = w + std::min(V, pieces * (s + 1) / S * piece) * D;
      for (int64_t p; (p = ranges[s].take(false)) >= 0;) rows(s, p * piece, std::min(V, (p + 1) * piece), end);
      for (int64_t o = 1; o < S; ++o)   // then the others' last pieces, the next slot's first
        for (int64_t p; (p = ranges[(s + o) % S].take(true)) >= 0; stolen.fetch_add(1)) {
          const int64_t v1 = std::min(V, (p + 1) * piece);
          rows(s, p * piece, v1, w + v1 * D);
        }
    }
  });
  linear_stolen.store(stolen.load());
}

// The first largest output per row of x over rows [start, end) of the weight (argmax_row's answer: a NaN counts as
// larger than any number), and its value.
struct PieceTop {
  int64_t start, end;
  std::array<int64_t, kLinearMaxRows> index;
  std::array<float, kLinearMaxRows> value;
};

// The answer over a's rows followed by b's (adjacent or not, a first): a's where it is a NaN or b's is not larger.
inline PieceTop first_top(const PieceTop& a, const PieceTop& b, int64_t M) {
  PieceTop c{std::min(a.start, b.start), std::max(a.end, b.end), a.index, a.value};
  for (int64_t m = 0; m < M; ++m) {
    const float u = a.value[m], v = b.value[m];
    if (u == u && (v != v || v > u)) { c.index[m] = b.index[m]; c.value[m] = v; }
  }
  return c;
}

// The answer over the union of the ranges of `tops` (any order, at least one): first_top of them in row order.
inline PieceTop first_top_in_order(std::vector<PieceTop>& tops, int64_t M) {
  std::sort(tops.begin(), tops.end(), [](const PieceTop& a, const PieceTop& b) { return a.start < b.start; });
  PieceTop best = tops[0];
  for (size_t i = 1; i < tops.size(); ++i) best = first_top(best, tops[i], M);
  return best;
}

// y = x W^T (+ b) for x [M, D] with 1 <= M <= kLinearMaxRows, W [V, D], b [V], all float32 or all bfloat16 (see
// linear_rows_kernel): sums in float32, y in their dtype (bfloat16: rounded once, as F.linear), each thread storing
// its own outputs (a float32 y converted afterwards was a second pass over the logits, its halves on the other core).
// linear_rows_op's checks and pass; with `tokens` (int64 [M]) defined, also each row's argmax of the stored outputs
// (argmax_rows_op's answer for y), found per thread chunk right after the chunk is stored.
at::Tensor linear_rows_run(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           at::Tensor* tokens) {
  const char* op = "linear_rows";
  check_cpu_contiguous(x, op, "x");
  check_cpu_contiguous(weight, op, "weight");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && x.scalar_type() == dtype, "memoryformer."
              "linear_rows: x and weight must be both float32 or both bfloat16, got ", x.scalar_type(), " and ", dtype);
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kLinearMaxRows, "memoryformer.linear_rows: x must "
              "be [M, D] with 1 <= M <= ", kLinearMaxRows, ", got shape ", x.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(1), "memoryformer.linear_rows: weight must be "
              "[V, D] with D = ", x.size(1), " (the width of x), got shape ", weight.sizes());
  const int64_t M = x.size(0), D = x.size(1), V = weight.size(0);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    check_cpu_contiguous(*bias, op, "bias");
    TORCH_CHECK(bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == V,
                "memoryformer.linear_rows: bias must be ", dtype, " [V] = [", V, "] (the weight's dtype), got ",
                bias->scalar_type(), " of shape ", bias->sizes());
    b = bias->to(at::kFloat);
  }
  auto xf = x.to(at::kFloat);
  if (dtype == at::kBFloat16 && linear_by_row(M, false)) {   // the row pass reads bfloat16 in pairs: x split to match
    auto xs = at::empty_like(xf);
    split_pairs(xf.data_ptr<float>(), xs.data_ptr<float>(), M, D);
    xf = xs;
  }
  auto y = at::empty({M, V}, x.options());
  const float* xp = xf.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  auto pass = [&](auto* wp, int64_t S, const auto& chunk) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(wp)>>;
    T* yp = y.data_ptr<T>();
    const int64_t bytes = V * D * int64_t(sizeof(T));
    PrefetchTrial& trial = prefetch_trial(prefetch_kind(std::is_same_v<T, float>, bytes));
    int arm;
    const bool prefetch = linear_prefetch(trial, linear_by_row(M, std::is_same_v<T, float>), arm);
    const auto start = std::chrono::steady_clock::now();
    switch (M) {
      case 1: linear_rows_kernel<1>(xp, wp, bp, yp, D, V, S, prefetch, chunk); break;
      case 2: linear_rows_kernel<2>(xp, wp, bp, yp, D, V, S, prefetch, chunk); break;
      case 3: linear_rows_kernel<3>(xp, wp, bp, yp, D, V, S, prefetch, chunk); break;
      default: linear_rows_kernel<4>(xp, wp, bp, yp, D, V, S, prefetch, chunk); break;
    }
    if (arm >= 0)
      record_prefetch_trial(trial, arm, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()
                                            / double(bytes));
  };
  auto run = [&](auto* wp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(wp)>>;
    const int64_t S = linear_slots<T>(D, V);
    if (tokens == nullptr) return pass(wp, S, NoChunk());
    // Every piece's first largest per row, found right after the piece is stored, merged into the slot's runs of
    // adjacent pieces (a slot takes its own in order and another's backwards), then the runs in row order: the first
    // NaN, else the first of the largest (a later range only where strictly larger), as argmax_rows.
    const T* yp = y.data_ptr<T>();
    std::vector<std::vector<PieceTop>> tops(S);
    pass(wp, S, [&](int64_t s, int64_t v0, int64_t v1) {
      PieceTop top{v0, v1, {}, {}};
      for (int64_t m = 0; m < M; ++m) {
        top.index[m] = v0 + argmax_row(yp + m * V + v0, v1 - v0);
        top.value[m] = float(yp[m * V + top.index[m]]);
      }
      auto& mine = tops[s];
      if (!mine.empty() && mine.back().end == v0) mine.back() = first_top(mine.back(), top, M);
      else if (!mine.empty() && mine.back().start == v1) mine.back() = first_top(top, mine.back(), M);
      else mine.push_back(top);
    });
    std::vector<PieceTop> all;
    for (const auto& mine : tops) all.insert(all.end(), mine.begin(), mine.end());
    const PieceTop best = first_top_in_order(all, M);
    *tokens = at::empty({M}, x.options().dtype(at::kLong));
    std::copy(best.index.begin(), best.index.begin() + M, tokens->data_ptr<int64_t>());
  };
  if (dtype == at::kFloat) run(weight.data_ptr<float>());
  else run(weight.data_ptr<c10::BFloat16>());
  return y;
}

at::Tensor linear_rows_op(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return linear_rows_run(x, weight, bias, nullptr);
}

// (linear_rows(x, weight, bias), argmax_rows of it) in one pass: a greedy decode step's logits and tokens, the argmax
// of each thread's outputs taken while they sit in its caches (a separate argmax_rows call after MF-small's head took
// 150-160 us on 2 Zen 1 cores against 40-50 us on the same logits warm: its code and data evicted by the head).
std::tuple<at::Tensor, at::Tensor> linear_rows_argmax_op(const at::Tensor& x, const at::Tensor& weight,
                                                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() != 2 || weight.size(0) >= 1, "memoryformer.linear_rows_argmax: the weight has no rows "
              "(shape ", weight.sizes(), "): an argmax needs at least one output column");
  at::Tensor tokens;
  at::Tensor y = linear_rows_run(x, weight, bias, &tokens);
  return {y, tokens};
}
