// Introspection: the kernel's facts and settings.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ introspection
std::string isa_op() { return MEMORYFORMER_ISA; }

int64_t linear_rows_max_op() { return kLinearMaxRows; }

int64_t linear_rows_balance_op(int64_t delay_slot, int64_t delay_us) {
  TORCH_CHECK(delay_slot >= -1 && delay_us >= 0 && delay_us <= 10000000, "memoryformer.linear_rows_balance: slot "
              "must be >= -1 (-1: no delay) and the delay 0 .. 10 s in microseconds, got ", delay_slot, ", ", delay_us);
  linear_delay_slot.store(delay_slot);
  linear_delay_us.store(delay_us);
  return linear_stolen.load();
}

std::vector<int64_t> machine_info_op() {
  const Caches c = caches();
  return {c.l1, c.l2, c.l3, int64_t(std::max(1, at::get_num_threads())), kLanes * int64_t(sizeof(float))};
}

void set_cache_sizes_op(int64_t l1, int64_t l2, int64_t l3) {
  TORCH_CHECK(l1 >= 0 && l2 >= 0 && l3 >= 0, "memoryformer.set_cache_sizes: sizes must be >= 0 bytes "
              "(0, 0, 0 restores the detected caches), got ", l1, ", ", l2, ", ", l3);
  const bool reset = l1 == 0 && l2 == 0 && l3 == 0;
  override_l1.store(l1);
  override_l2.store(l2);
  override_l3.store(reset ? -1 : l3);
}

std::string plan_op(int64_t N, int64_t K, int64_t P, int64_t D, at::ScalarType dtype, bool backward) {
  TORCH_CHECK(N >= 0 && K >= 1 && P >= 1 && D >= 1, "memoryformer.plan: need tokens >= 0, num_tables >= 1, "
              "rows_per_table >= 1 and out_features >= 1, got ", N, ", ", K, ", ", P, ", ", D);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf,
              "memoryformer.plan: dtype must be float32, float64, bfloat16 or float16, got ", dtype);
  return backward ? "bucketed" : choose_strategy(N, K, P, D, dtype);
}
