// The argmax of each row of the logits (a greedy decode step's tokens).
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define (linear_rows.h: PieceTop,
// first_top_in_order, kLinearGrain; its fused head pass calls argmax_row, declared there).

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

// argmax_row over p[0, V) as the threads split it: each chunk of at::parallel_for(0, V, kLinearGrain) (the shares the
// few-row pass's threads start from, so that each thread mostly reads the logits it wrote) finds its first largest,
// and the chunks' answers are combined in order as the few-row pass combines its pieces' (first_top_in_order: the
// first NaN, else the first of the largest). On one thread, or a row of under 2 * kLinearGrain, argmax_row itself.
template <typename T>
int64_t argmax_row_split(const T* p, int64_t V) {
  if (V < 2 * kLinearGrain || at::get_num_threads() == 1 || at::in_parallel_region()) return argmax_row(p, V);
  std::mutex mutex;
  std::vector<PieceTop> found;   // each chunk's range, first largest and its value
  at::parallel_for(0, V, kLinearGrain, [&](int64_t v0, int64_t v1) {
    PieceTop top{v0, v1, {}, {}};
    top.index[0] = v0 + argmax_row(p + v0, v1 - v0);
    top.value[0] = float(p[top.index[0]]);
    std::lock_guard<std::mutex> lock(mutex);
    found.push_back(top);
  });
  return first_top_in_order(found, 1).index[0];
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
