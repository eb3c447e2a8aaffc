// How the few-row linear reads its weight: bfloat16 rows in pairs of values, and the row pass's prefetch trial.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ few-row reads
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "load_bf16_pairs reads a value pair as one 32-bit word");
typedef uint32_t RawWords __attribute__((vector_size(sizeof(fVec))));

// The 2 * kLanes bfloat16 values at p as float32 vectors of the even ones (p[0], p[2], ...) and the odd ones: a
// bfloat16 value is the high half of its float32, and each 32-bit word holds an even value in its low half.
inline void load_bf16_pairs(const c10::BFloat16* p, fVec& even, fVec& odd) {
  RawWords w;
  std::memcpy(&w, p, sizeof(w));
  const RawWords e = w << 16, o = w & 0xffff0000u;
  std::memcpy(&even, &e, sizeof(e));
  std::memcpy(&odd, &o, sizeof(o));
}

// x [M, D] split as load_bf16_pairs reads a row: per block of 2 * kLanes values, the even ones then the odd ones (the
// D % (2 * kLanes) last values as they are).
inline void split_pairs(const float* x, float* xs, int64_t M, int64_t D) {
  constexpr int64_t P = 2 * kLanes;
  for (int64_t m = 0; m < M; ++m) {
    const float* a = x + m * D;
    float* b = xs + m * D;
    int64_t j = 0;
    for (; j + P <= D; j += P)
      for (int64_t i = 0; i < kLanes; ++i) {
        b[j + i] = a[j + 2 * i];
        b[j + kLanes + i] = a[j + 2 * i + 1];
      }
    for (; j < D; ++j) b[j] = a[j];
  }
}

// The row pass's software prefetches, chosen on the running machine. They cost instructions that the pass otherwise
// spends on its sums, and pay only where the hardware prefetchers do not keep the stream ahead: on the 2-vCPU Intel
// Xeon of docs/performance.md (linear_rows.h) they took a cold bfloat16 head from 30 (the L1 one alone) to 32-36
// GB/s; on the 2-vCPU AMD EPYC Zen 4 of benchmarks/results/2026-11-29f-zen4 (MF-small's 77 MB head, cold, on huge
// pages, the row read in pairs) they cost up to a quarter of the rate: 43.5-45.8 GB/s against 53-58.5 without, where
// a read probe gave 55-64. So the first kPrefetchTrials passes of a kind alternate with and without them, timed, and
// every later pass of that kind takes the faster by median; a kind is the weight's dtype and whether it is larger than
// the last-level cache (the Xeon's L3 served part of a 77 MB head, where this Zen 4's 32 MB L3 holds less than half
// of it, so the answer may differ by size), one choice per kind and process (linear_rows_prefetch says which, or
// fixes one for tests). Either way every output has the same bits: a prefetch moves no value.
constexpr int64_t kPrefetchTrials = 8;

struct PrefetchTrial {
  std::mutex m;
  std::vector<double> seconds_per_byte[2];   // the timed passes, without [0] and with [1] the prefetches
  std::atomic<int> forced{-1};               // linear_rows_prefetch: -1 the trial, 0 without, 1 with
  std::atomic<int> choice{-1};               // the trial's answer; -1 while it runs
};

constexpr int kPrefetchKinds = 4;   // bfloat16 within / beyond the last-level cache, then float32's two

PrefetchTrial& prefetch_trial(int kind) {
  static PrefetchTrial trials[kPrefetchKinds];
  return trials[kind];
}

// The kind of a pass: its weight's dtype, and whether the weight is larger than the last-level cache.
inline int prefetch_kind(bool float_weight, int64_t bytes) { return (float_weight ? 2 : 0) + (bytes > tuning().llc); }

// Whether a pass of the trial's kind takes the prefetches, and the trial's arm it is timed for (-1: not timed; only
// passes on the row loop are).
inline bool linear_prefetch(PrefetchTrial& trial, bool by_row, int& arm) {
  arm = -1;
  const int forced = trial.forced.load(), chosen = trial.choice.load();
  if (forced >= 0) return forced == 1;
  if (!by_row) return false;
  if (chosen >= 0) return chosen == 1;
  std::lock_guard<std::mutex> lock(trial.m);
  arm = trial.seconds_per_byte[0].size() > trial.seconds_per_byte[1].size() ? 1 : 0;
  return arm == 1;
}

inline void record_prefetch_trial(PrefetchTrial& trial, int arm, double seconds_per_byte) {
  std::lock_guard<std::mutex> lock(trial.m);
  auto& mine = trial.seconds_per_byte[arm];
  mine.push_back(seconds_per_byte);
  auto& off = trial.seconds_per_byte[0];
  auto& on = trial.seconds_per_byte[1];
  if (trial.choice.load() >= 0 || int64_t(off.size() + on.size()) < kPrefetchTrials || off.empty() || on.empty())
    return;
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  };
  trial.choice.store(median(on) < median(off) ? 1 : 0);
}
