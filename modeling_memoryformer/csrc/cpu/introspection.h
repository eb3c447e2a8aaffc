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

// setting -1: run the trials again (their passes forgotten); 0 / 1: every row pass without / with the prefetches; -2:
// change nothing. Returns [the fixed setting (-1: none), then per kind (bfloat16 weights within, then beyond the
// last-level cache; float32's two) the trial's choice (-1 while it runs) and its timed passes].
std::vector<int64_t> linear_rows_prefetch_op(int64_t setting) {
  TORCH_CHECK(setting >= -2 && setting <= 1, "memoryformer.linear_rows_prefetch: setting must be -2 (read only), -1 "
              "(the trial), 0 (without) or 1 (with the prefetches), got ", setting);
  std::vector<int64_t> out{setting == -2 ? int64_t(prefetch_trial(0).forced.load()) : setting};
  for (int kind = 0; kind < kPrefetchKinds; ++kind) {
    PrefetchTrial& trial = prefetch_trial(kind);
    std::lock_guard<std::mutex> lock(trial.m);
    if (setting != -2) trial.forced.store(int(setting));
    if (setting == -1) {
      trial.choice.store(-1);
      for (auto& v : trial.seconds_per_byte) v.clear();
    }
    out.push_back(trial.choice.load());
    out.push_back(int64_t(trial.seconds_per_byte[0].size() + trial.seconds_per_byte[1].size()));
  }
  return out;
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
