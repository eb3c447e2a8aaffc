// The row-wise steps of the table optimizers.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ table optimizers
// The row-wise table optimizers of training/table_optimizer.py (same formulas), in one pass per row instead of the
// several whole-table passes of their PyTorch form: a row's mean squared gradient, then its update, while the row is
// in L1. float32 weights and gradients; the states float32. Rows split over the threads.
//   rowwise_adagrad_step: s_r += mean_j g_rj^2;  w_r = w_r (1 - lr wd) - lr g_r / (sqrt(s_r) + eps)
//   adam_rowwise_step:    m = b1 m + (1 - b1) g;  v_r = b2 v_r + (1 - b2) mean_j g_rj^2;
//                         w = w (1 - lr wd) - (lr / (1 - b1^t)) m / (sqrt(v_r / (1 - b2^t)) + eps)
void check_table_step(const at::Tensor& weight, const at::Tensor& grad, double lr, double eps, double weight_decay,
                      const char* op) {
  check_cpu_contiguous(weight, op, "weight");
  check_cpu_contiguous(grad, op, "grad");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && grad.scalar_type() == at::kFloat, "memoryformer.", op,
              ": weight and grad must be float32, got ", weight.scalar_type(), " and ", grad.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && grad.sizes() == weight.sizes(), "memoryformer.", op, ": weight must be 2-D "
              "[rows, width] and grad of the same shape, got ", weight.sizes(), " and ", grad.sizes());
  TORCH_CHECK(std::isfinite(lr) && lr >= 0, "memoryformer.", op, ": lr must be finite and >= 0, got ", lr);
  TORCH_CHECK(std::isfinite(eps) && eps > 0, "memoryformer.", op, ": eps must be finite and > 0, got ", eps);
  TORCH_CHECK(std::isfinite(weight_decay) && weight_decay >= 0, "memoryformer.", op,
              ": weight_decay must be finite and >= 0, got ", weight_decay);
}

void check_state(const at::Tensor& state, at::IntArrayRef shape, const char* op, const char* name) {
  check_cpu_contiguous(state, op, name);
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.sizes() == shape, "memoryformer.", op, ": ", name,
              " must be float32 of shape ", shape, ", got ", state.scalar_type(), " of shape ", state.sizes());
}

inline float row_mean_square(const float* g, int64_t D) {
  float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
  for (int64_t j = 0; j < D; ++j) sq += g[j] * g[j];
  return D > 0 ? sq / float(D) : 0.0f;
}

void rowwise_adagrad_step_op(const at::Tensor& weight, const at::Tensor& grad, const at::Tensor& state_sum, double lr,
                             double eps, double weight_decay) {
  const char* op = "rowwise_adagrad_step";
  check_table_step(weight, grad, lr, eps, weight_decay, op);
  const int64_t R = weight.size(0), D = weight.size(1);
  check_state(state_sum, {R}, op, "state_sum");
  float* w = weight.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  float* s = state_sum.data_ptr<float>();
  const float decay = float(1.0 - lr * weight_decay), step = float(lr), feps = float(eps);
  at::parallel_for(0, R, std::max<int64_t>(1, kSerialWork / std::max<int64_t>(1, D)), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* gr = g + r * D;
      float* wr = w + r * D;
      s[r] += row_mean_square(gr, D);
      const float scale = step / (std::sqrt(s[r]) + feps);
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) wr[j] = wr[j] * decay - scale * gr[j];
    }
  });
}

void adam_rowwise_step_op(const at::Tensor& weight, const at::Tensor& grad, const at::Tensor& exp_avg,
                          const at::Tensor& exp_avg_sq, int64_t step, double lr, double beta1, double beta2,
                          double eps, double weight_decay) {
  const char* op = "adam_rowwise_step";
  check_table_step(weight, grad, lr, eps, weight_decay, op);
  const int64_t R = weight.size(0), D = weight.size(1);
  check_state(exp_avg, weight.sizes(), op, "exp_avg");
  check_state(exp_avg_sq, {R}, op, "exp_avg_sq");
  TORCH_CHECK(step >= 1, "memoryformer.", op, ": step must be >= 1 (the number of this step), got ", step);
  TORCH_CHECK(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1, "memoryformer.", op,
              ": betas must be in [0, 1), got ", beta1, " and ", beta2);
  float* w = weight.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  const float decay = float(1.0 - lr * weight_decay), b1 = float(beta1), b2 = float(beta2), feps = float(eps);
  const float lr1 = float(lr / (1.0 - std::pow(beta1, double(step))));
  const float bias2 = float(1.0 - std::pow(beta2, double(step)));
  at::parallel_for(0, R, std::max<int64_t>(1, kSerialWork / std::max<int64_t>(1, D)), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* gr = g + r * D;
      float* wr = w + r * D;
      float* mr = m + r * D;
      v[r] = b2 * v[r] + (1.0f - b2) * row_mean_square(gr, D);
      const float scale = lr1 / (std::sqrt(v[r] / bias2) + feps);
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) {
        mr[j] = b1 * mr[j] + (1.0f - b1) * gr[j];
        wr[j] = wr[j] * decay - scale * mr[j];
      }
    }
  });
}
