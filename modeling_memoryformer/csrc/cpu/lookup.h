// The lookup ops: argument checks, the strategy choice, kStrategies and the forward ops.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ lookup ops
// Column k of rows must index table k (rows k*P .. k*P + P - 1): anything else would read or write out of bounds.
// One vectorised pass over all lookups (about 1% of a forward); on failure, the first bad entry is named.
void check_rows(const at::Tensor& rows, int64_t P) {
  const int64_t N = rows.size(0), K = rows.size(1);
  const int64_t* r = rows.data_ptr<int64_t>();
  bool bad = false;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t* rn = r + n * K;
#pragma omp simd reduction(| : bad)
    for (int64_t k = 0; k < K; ++k) bad |= static_cast<uint64_t>(rn[k] - k * P) >= static_cast<uint64_t>(P);
  }
  for (int64_t e = 0; bad && e < N * K; ++e) {
    const int64_t k = e % K, row = r[e];
    TORCH_CHECK(row >= k * P && row < (k + 1) * P, "memoryformer: rows[:, ", k, "] must index table ", k,
                " (rows ", k * P, " .. ", k * P + P - 1, "), got ", row);
  }
}

// Shapes and dtypes of every lookup op's operands, and the rows (check_rows).
void check_lookup_args(const at::Tensor& rows, const at::Tensor& scores, const at::Tensor& tables,
                       int64_t rows_per_table, const char* op) {
  check_cpu_contiguous(rows, op, "rows");
  check_cpu_contiguous(tables, op, "tables");
  TORCH_CHECK(scores.defined(), "memoryformer.", op, ": scores is undefined");
  check_floating(scores, op, "scores");
  check_floating(tables, op, "tables");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 2, "memoryformer.", op,
              ": rows must be int64 [N, K], got ", rows.scalar_type(), " of shape ", rows.sizes());
  TORCH_CHECK(rows.size(1) >= 1, "memoryformer.", op, ": rows must have one column per table (K >= 1), got ",
              rows.sizes());
  TORCH_CHECK(tables.dim() == 2, "memoryformer.", op, ": tables must be 2-D [K * rows_per_table, D], got shape ",
              tables.sizes());
  TORCH_CHECK(rows_per_table >= 1, "memoryformer.", op, ": rows_per_table must be >= 1, got ", rows_per_table);
  const int64_t K = rows.size(1);
  TORCH_CHECK(tables.size(0) % K == 0 && tables.size(0) / K == rows_per_table, "memoryformer.", op,
              ": tables must have K * rows_per_table = ", K, " * ", rows_per_table, " rows, got ", tables.size(0));
  TORCH_CHECK(scores.dim() == 2 && scores.size(0) == rows.size(0) && scores.size(1) == K, "memoryformer.", op,
              ": scores must have the shape of rows ", rows.sizes(), ", got ", scores.sizes());
  check_rows(rows, rows_per_table);
}

// The operands as the kernels take them: scores in the accumulation type, bias (undefined when absent) in the
// tables' dtype, both contiguous.
std::pair<at::Tensor, at::Tensor> lookup_operands(const at::Tensor& scores, const at::Tensor& tables,
                                                  const std::optional<at::Tensor>& bias, const char* op) {
  auto s = scores.to(acc_type(tables.scalar_type())).contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    check_floating(*bias, op, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == tables.size(1), "memoryformer.", op,
                ": bias must be 1-D with one value per output column [", tables.size(1), "], got shape ",
                bias->sizes());
    b = bias->to(tables.scalar_type()).contiguous();
  }
  return {s, b};
}

at::Tensor bucketed_forward(const at::Tensor& rows, const at::Tensor& s, const at::Tensor& tables, const at::Tensor& b,
                            int64_t rows_per_table) {
  const int64_t N = rows.size(0), K = rows.size(1), D = tables.size(1);
  auto out = at::empty({N, D}, tables.options().dtype(acc_type(tables.scalar_type())));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, tables.scalar_type(), "memoryformer_lookup_bucketed", [&] {
    using A = typename Acc<scalar_t>::type;
    lookup_bucketed<scalar_t>(rows.data_ptr<int64_t>(), s.data_ptr<A>(), tables.data_ptr<scalar_t>(),
                              b.defined() ? b.data_ptr<scalar_t>() : nullptr, out.data_ptr<A>(), N, K,
                              rows_per_table, D);
  });
  return out.scalar_type() == tables.scalar_type() ? out : out.to(tables.scalar_type());
}

// The forward strategy "auto" runs (see the design notes in prelude.h):
//   up to kSmallBatch tokens (or float64): token-major; float32, bfloat16 or float16 tables (width a multiple of
//   kPackCols) with >= kPackedHits lookups per row and a (chunk, column block) unit per thread: packed, whatever the
//   tables' size; other widths, tables beyond the LLC (Tuning::bucketed_min) with >= kBucketedHits lookups per row and
//   a column block per thread: bucketed; otherwise PyTorch's embedding_bag (FBGEMM's JIT-generated, prefetching
//   EmbeddingSpMDM kernel, the fastest gather we measured for few lookups per row; it splits tokens, so it uses every
//   thread on any shape).
std::string choose_strategy(int64_t N, int64_t K, int64_t P, int64_t D, at::ScalarType dtype) {
  if (N <= kSmallBatch || dtype == at::kDouble) return "token";
  const Tuning t = tuning();
  const int64_t bytes = K * P * D * int64_t(c10::elementSize(dtype));
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t nblk = D / kPackCols, span = packed_span(int64_t(c10::elementSize(dtype)), nblk);
  const int64_t packed_units = (N + t.pack_chunk - 1) / t.pack_chunk * (nblk / span);
  if (packed_applies(dtype, D) && N >= kPackedHits * P && packed_units >= threads) return "packed";
  if (bytes >= t.bucketed_min && N >= kBucketedHits * P && num_blocks(D) >= threads) return "bucketed";
  return "embedding_bag";
}

// The forward strategies by name: the one list (Python reads it through the op lookup_strategies). A new strategy
// is added here and in lookup_strategy_op's branches below.
const std::array<std::string, 4> kStrategies = {"token", "embedding_bag", "packed", "bucketed"};

std::string strategy_list() {
  std::string out;
  for (const auto& name : kStrategies) out += (out.empty() ? "" : ", ") + name;
  return out;
}

std::vector<std::string> lookup_strategies_op() { return {kStrategies.begin(), kStrategies.end()}; }

// "auto" is what `lookup` runs; the others force one strategy (tests use them to check every branch).
at::Tensor lookup_strategy_op(const at::Tensor& rows, const at::Tensor& scores, const at::Tensor& tables,
                              const std::optional<at::Tensor>& bias, int64_t rows_per_table,
                              c10::string_view strategy) {
  check_lookup_args(rows, scores, tables, rows_per_table, "lookup");
  const int64_t N = rows.size(0), K = rows.size(1), D = tables.size(1), P = rows_per_table;
  std::string how(strategy);
  const bool known = how == "auto" || std::find(kStrategies.begin(), kStrategies.end(), how) != kStrategies.end();
  TORCH_CHECK(known, "memoryformer.lookup_strategy: unknown strategy '", how, "' (use auto or one of ",
              strategy_list(), ")");
  if (how == "auto") how = choose_strategy(N, K, P, D, tables.scalar_type());
  TORCH_CHECK(how != "packed" || packed_applies(tables.scalar_type(), D), "memoryformer.lookup_strategy: "
              "'packed' needs float32, bfloat16 or float16 tables with a width that is a multiple of ", kPackCols,
              ", got ", tables.scalar_type(), " tables of width ", D);
  TORCH_CHECK(how != "embedding_bag" || tables.scalar_type() != at::kDouble,
              "memoryformer.lookup_strategy: 'embedding_bag' does not take float64 tables");
  at::Tensor s, b;
  std::tie(s, b) = lookup_operands(scores, tables, bias, "lookup");
  if (how == "bucketed") return bucketed_forward(rows, s, tables, b, P);
  if (how == "embedding_bag") {
    auto offsets = at::arange(0, N * K, K, rows.options());
    auto weights = s.to(tables.scalar_type()).reshape({-1});
    auto bag = std::get<0>(at::embedding_bag(tables, rows.reshape({-1}), offsets, /*scale_grad_by_freq=*/false,
                                             /*mode=sum*/ 0, /*sparse=*/false, weights));
    return b.defined() ? bag.add_(b) : bag;
  }
  auto out = at::empty({N, D}, tables.options());
  if (how == "packed") {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, tables.scalar_type(), "memoryformer_lookup_packed", [&] {
      if constexpr (!std::is_same<scalar_t, double>::value)   // float64 is refused above (packed_applies)
        lookup_packed<scalar_t>(rows.data_ptr<int64_t>(), s.data_ptr<float>(), tables.data_ptr<scalar_t>(),
                                b.defined() ? b.data_ptr<scalar_t>() : nullptr, out.data_ptr<scalar_t>(), N, K, P, D);
    });
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, tables.scalar_type(), "memoryformer_lookup", [&] {
    using A = typename Acc<scalar_t>::type;
    lookup_kernel<scalar_t>(rows.data_ptr<int64_t>(), s.data_ptr<A>(), tables.data_ptr<scalar_t>(),
                            b.defined() ? b.data_ptr<scalar_t>() : nullptr, out.data_ptr<scalar_t>(), N, K, D);
  });
  return out;
}

at::Tensor lookup_op(const at::Tensor& rows, const at::Tensor& scores, const at::Tensor& tables,
                     const std::optional<at::Tensor>& bias, int64_t rows_per_table) {
  return lookup_strategy_op(rows, scores, tables, bias, rows_per_table, "auto");
}
