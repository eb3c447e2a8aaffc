// The few-row linear (the LM head while decoding).
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ few-row linear
// y = x W^T (+ b) for a few rows of x (decoding: the LM head of one token reads a [vocab, d] weight for one row of
// output). Each weight row is read once for all rows of x, and the output columns are split over the threads in
// contiguous ranges, so the pass streams W once. The dot products of a weight row run as at least 4 independent FMA
// chains (4 per row of x for one row, 2 for two, one each from four): with fewer a core streams W at about half the
// speed of a plain sum over W, as the BLAS GEMV that nn.Linear calls for one row did (docs/kernel.md).
constexpr int64_t kLinearMaxRows = 4;   // rows of x handled in registers; the op takes up to this many

// T: the weight's dtype (float32, or bfloat16 widened in registers: half the bytes to stream); x, b and y float32.
template <int64_t M, typename T>
void linear_rows_kernel(const float* x, const T* w, const float* b, float* y, int64_t D, int64_t V) {
  constexpr int64_t L = kLanes;
  constexpr int64_t C = M == 1 ? 4 : 2;   // chains per row of x: 4, 4, 6 and 8 in all for M = 1 .. 4
  const int64_t Dc = D - D % (C * L), Dv = D - D % L;
  const auto add = [](fVec& p, fVec& q) { return p + q; };
  at::parallel_for(0, V, 1024, [=](int64_t v0, int64_t v1) {
    for (int64_t v = v0; v < v1; ++v) {
      const T* wv = w + v * D;
      fVec a[M][C];
      for (int64_t m = 0; m < M; ++m)
        for (int64_t c = 0; c < C; ++c) a[m][c] = fVec(0.f);
      for (int64_t j = 0; j < Dc; j += C * L) {
        for (int64_t c = 0; c < C; ++c) {
          const fVec u = load_floats(wv + j + c * L);
          for (int64_t m = 0; m < M; ++m) a[m][c] = at::vec::fmadd(fVec::loadu(x + m * D + j + c * L), u, a[m][c]);
        }
      }
      for (int64_t j = Dc; j < Dv; j += L) {
        const fVec u = load_floats(wv + j);
        for (int64_t m = 0; m < M; ++m) a[m][0] = at::vec::fmadd(fVec::loadu(x + m * D + j), u, a[m][0]);
      }
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t c = 1; c < C; ++c) a[m][0] = a[m][0] + a[m][c];
        float sum = at::vec::vec_reduce_all<float>(add, a[m][0]);
        for (int64_t j = Dv; j < D; ++j) sum += x[m * D + j] * float(wv[j]);
        y[m * V + v] = b ? sum + b[v] : sum;
      }
    }
  });
}

// y = x W^T (+ b) for x [M, D] with 1 <= M <= kLinearMaxRows, W [V, D], b [V], all float32 or all bfloat16 (see
// linear_rows_kernel): sums in float32, y in their dtype (bfloat16: rounded once, as F.linear).
at::Tensor linear_rows_op(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
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
  auto y = at::empty({M, V}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  auto run = [&](auto* wp) {
    switch (M) {
      case 1: linear_rows_kernel<1>(xp, wp, bp, yp, D, V); break;
      case 2: linear_rows_kernel<2>(xp, wp, bp, yp, D, V); break;
      case 3: linear_rows_kernel<3>(xp, wp, bp, yp, D, V); break;
      default: linear_rows_kernel<4>(xp, wp, bp, yp, D, V); break;
    }
  };
  if (dtype == at::kFloat) run(weight.data_ptr<float>());
  else run(weight.data_ptr<c10::BFloat16>());
  return dtype == at::kFloat ? y : y.to(dtype);
}
