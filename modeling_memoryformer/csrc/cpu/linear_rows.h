// The few-row linear (the LM head while decoding).
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ few-row linear
// y = x W^T (+ b) for a few rows of x (decoding: the LM head of one token reads a [vocab, d] weight for one row of
// output). The output columns are split over the threads in contiguous ranges, so the pass streams W once; each
// thread takes R weight rows at a time and keeps one sum per (row of x, weight row) in a vector register: M x R
// independent FMA chains (8, 8, 6 and 8 for M = 1 .. 4), each x vector loaded once for R weight rows. The sums are
// kept in registers, as RawVec (prelude.h): GCC kept an earlier kernel's array of sums on the stack (a store and a
// reload per FMA), which bounded a core at about 11 GB/s of bfloat16 weight on the Zen 3 of docs/performance.md, and
// the array of fVec that replaced it kept 7 of its 8 sums there still (GCC 12); on a 2-vCPU Zen 1 the MF-base head
// (50304 x 1024 bf16) went from 5.5 to 4.7-5.0 ms with them in registers, in a copy of this loop (docs/kernel.md).
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

// T: the weight's dtype (float32, or bfloat16 widened in registers: half the bytes to stream); x and b float32, y
// float32 or T. Each thread writes the outputs of its own weight rows (kLinearGrain per chunk, the split argmax_rows
// repeats).
constexpr int64_t kLinearGrain = 1024;

template <typename T>
int64_t argmax_row(const T* p, int64_t V);
template <typename T>
int64_t combine_chunk_argmax(const T* p, std::vector<std::pair<int64_t, int64_t>>& found);

// chunk(v0, v1) runs after each thread's chunk [v0, v1) of outputs is stored (the argmax of those outputs, while they
// sit in that thread's caches); none: nothing.
struct NoChunk {
  void operator()(int64_t, int64_t) const {}
};

template <int64_t M, typename T, typename O, typename Chunk = NoChunk>
void linear_rows_kernel(const float* x, const T* w, const float* b, O* y, int64_t D, int64_t V,
                        const Chunk& chunk = Chunk()) {
  constexpr int64_t R = M == 1 ? 8 : M == 2 ? 4 : 2;   // weight rows per block: M x R chains
  at::parallel_for(0, V, kLinearGrain, [&](int64_t v0, int64_t v1) {
    int64_t v = v0;
    const T* end = w + v1 * D;
    for (; v + R <= v1; v += R) linear_rows_block<M, R>(x, w + v * D, b, y, D, V, v, end);
    for (; v < v1; ++v) linear_rows_block<M, 1>(x, w + v * D, b, y, D, V, v, end);
    chunk(v0, v1);
  });
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
  auto y = at::empty({M, V}, x.options());
  const float* xp = xf.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  auto pass = [&](auto* wp, const auto& chunk) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(wp)>>;
    T* yp = y.data_ptr<T>();
    switch (M) {
      case 1: linear_rows_kernel<1>(xp, wp, bp, yp, D, V, chunk); break;
      case 2: linear_rows_kernel<2>(xp, wp, bp, yp, D, V, chunk); break;
      case 3: linear_rows_kernel<3>(xp, wp, bp, yp, D, V, chunk); break;
      default: linear_rows_kernel<4>(xp, wp, bp, yp, D, V, chunk); break;
    }
  };
  auto run = [&](auto* wp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(wp)>>;
    if (tokens == nullptr) return pass(wp, NoChunk());
    // Every chunk's first largest per row, combined as argmax_row_split combines them (combine_chunk_argmax puts them
    // in chunk order; the chunks are the same: at::parallel_for(0, V, kLinearGrain)).
    const T* yp = y.data_ptr<T>();
    std::mutex mutex;
    std::vector<std::pair<int64_t, std::array<int64_t, kLinearMaxRows>>> found;   // (chunk start, its answers)
    pass(wp, [&](int64_t v0, int64_t v1) {
      std::array<int64_t, kLinearMaxRows> top{};
      for (int64_t m = 0; m < M; ++m) top[m] = v0 + argmax_row(yp + m * V + v0, v1 - v0);
      std::lock_guard<std::mutex> lock(mutex);
      found.emplace_back(v0, top);
    });
    *tokens = at::empty({M}, x.options().dtype(at::kLong));
    int64_t* t = tokens->data_ptr<int64_t>();
    for (int64_t m = 0; m < M; ++m) {
      std::vector<std::pair<int64_t, int64_t>> answers;
      for (const auto& f : found) answers.emplace_back(f.first, f.second[m]);
      t[m] = combine_chunk_argmax(yp + m * V, answers);
    }
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

// ------------------------------------------------------------------------------------------------ argmax of rows
// torch.argmax(x, -1) for x [N, V] (contiguous rows; float32, bfloat16 or float16; V >= 1), the token a greedy
// decode step picks from the head's logits: per row the index of the first largest value, a NaN counting as larger
// than any number (so the first NaN's index), as ATen's argmax. One vector pass finds the largest value (NaN
// propagating), a scan from the start its first index: about 15 us over a 50K vocabulary where ATen's reduction,
// which carries an index per value, takes about 90 us on 2 Zen 1 cores, and a bfloat16 row needs no float32 copy.
template <typename T>
int64_t argmax_row(const T* p, int64_t V) {
  auto top = [](float a, float b) { return a != a || b != b ? std::numeric_limits<float>::quiet_NaN() : std::max(a, b); };
  float best = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  if (V >= 4 * kLanes) {   // four independent chains of maxima (the largest value is one whatever the grouping)
    fVec l0(best), l1(best), l2(best), l3(best);
    for (; j + 4 * kLanes <= V; j += 4 * kLanes) {
      l0 = at::vec::maximum(l0, load_floats(p + j));
      l1 = at::vec::maximum(l1, load_floats(p + j + kLanes));
      l2 = at::vec::maximum(l2, load_floats(p + j + 2 * kLanes));
      l3 = at::vec::maximum(l3, load_floats(p + j + 3 * kLanes));
    }
    float values[kLanes];
    at::vec::maximum(at::vec::maximum(l0, l1), at::vec::maximum(l2, l3)).store(values);
    for (int64_t l = 0; l < kLanes; ++l) best = top(best, values[l]);
  }
  for (; j < V; ++j) best = top(best, float(p[j]));
  // The first index holding it: whole vectors compared at once, then the lanes of the first that has it.
  const bool nan = best != best;
  const fVec bv(best);
  int64_t i = 0;
  for (; i + kLanes <= V; i += kLanes) {
    const fVec v = load_floats(p + i);
    const int hits = ~(nan ? v.isnan() : (v == bv)).zero_mask() & ((1 << kLanes) - 1);
    if (hits) return i + __builtin_ctz(static_cast<unsigned>(hits));
  }
  for (; i < V; ++i) {
    const float v = float(p[i]);
    if (nan ? v != v : v == best) return i;
  }
  return 0;   // not reached: best is one of the values
}

// The row's argmax from its chunks' (start, first largest) in any order: the first NaN, else the first of the
// largest (a later chunk only where strictly larger).
template <typename T>
int64_t combine_chunk_argmax(const T* p, std::vector<std::pair<int64_t, int64_t>>& found) {
  std::sort(found.begin(), found.end());
  int64_t best = found[0].second;
  for (size_t c = 1; c < found.size(); ++c) {
    const float b = float(p[best]), v = float(p[found[c].second]);
    if (b != b) break;                     // a NaN: nothing later comes first
    if (v != v || v > b) best = found[c].second;
  }
  return best;
}

// argmax_row over p[0, V) as the threads split it: each chunk of at::parallel_for(0, V, kLinearGrain) (the split of
// the few-row pass, so that each thread reads the logits it wrote, from its own caches) finds its first largest,
// and the chunks' answers are combined in order: the first NaN, else the first of the largest (a later chunk only
// where strictly larger). On one thread, or a row of under 2 * kLinearGrain, argmax_row itself.
template <typename T>
int64_t argmax_row_split(const T* p, int64_t V) {
  if (V < 2 * kLinearGrain || at::get_num_threads() == 1 || at::in_parallel_region()) return argmax_row(p, V);
  std::mutex mutex;
  std::vector<std::pair<int64_t, int64_t>> found;   // (chunk start, its answer)
  at::parallel_for(0, V, kLinearGrain, [&](int64_t v0, int64_t v1) {
    const int64_t i = v0 + argmax_row(p + v0, v1 - v0);
    std::lock_guard<std::mutex> lock(mutex);
    found.emplace_back(v0, i);
  });
  return combine_chunk_argmax(p, found);
}

at::Tensor argmax_rows_op(const at::Tensor& x) {
  check_cpu_contiguous(x, "argmax_rows", "x");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.size(1) >= 1 && (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf),
              "memoryformer.argmax_rows: x must be float32, bfloat16 or float16 [N, V] with V >= 1, got ", dtype,
              " of shape ", x.sizes());
  const int64_t N = x.size(0), V = x.size(1);
  auto out = at::empty({N}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  auto rows = [&](const auto* p) {
    for (int64_t n = 0; n < N; ++n) o[n] = argmax_row_split(p + n * V, V);
  };
  if (dtype == at::kFloat) rows(x.data_ptr<float>());
  else if (dtype == at::kBFloat16) rows(x.data_ptr<c10::BFloat16>());
  else rows(x.data_ptr<c10::Half>());
  return out;
}
