// The lookup on int8 tables.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ int8 tables
// Tables stored in FBGEMM's 8-bit row-wise layout (what torch.ops.quantized.embedding_bag_byte_prepack writes): row r
// is D + 8 bytes, its D codes q then a float32 scale and a float32 offset, v = q * scale + offset. A lookup is
//   y[n] = sum_k s[n,k] (q[r] * scale[r] + offset[r]) = sum_k (s[n,k] scale[r]) q[r] + sum_k s[n,k] offset[r]
// with r = rows[n,k]: the codes are converted to float in registers and weighted by s * scale, and the offsets make one
// value per token, added to all of its columns. Each unit of the token-major pass reads its token's weights and offset
// first (int8_token_weights), the rows' scales and offsets asked for together with the rows' first codes.
constexpr int64_t kInt8RowBytes = 8;   // the float32 scale and offset after a row's codes

inline void int8_row_params(const uint8_t* row_end, float& scale, float& offset) {   // row_end: past the codes
  std::memcpy(&scale, row_end, sizeof(float));       // not 4-byte aligned when D % 4 != 0
  std::memcpy(&offset, row_end + 4, sizeof(float));
}

// A token's weights s_k scale_k and offset sum_k s_k offset_k (see above), from the 8 bytes after each hit row's codes.
inline float int8_token_weights(const int64_t* rn, const float* sn, const uint8_t* packed, int64_t K, int64_t D,
                                float* wn) {
  const int64_t W = D + kInt8RowBytes;
  float off = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    float scale, offset;
    int8_row_params(packed + rn[k] * W + D, scale, offset);
    wn[k] = sn[k] * scale;
    off += sn[k] * offset;
  }
  return off;
}

// a + s0 q0 + s1 q1 + s2 q2 + s3 q3 as four chained multiply-adds (written as one sum of products, the compiler
// emitted separate multiplies and adds, which was slower; docs/kernel.md).
inline float add_codes4(float a, float s0, float s1, float s2, float s3, uint8_t q0, uint8_t q1, uint8_t q2,
                        uint8_t q3) {
  a += s0 * float(int32_t(q0));
  a += s1 * float(int32_t(q1));
  a += s2 * float(int32_t(q2));
  a += s3 * float(int32_t(q3));
  return a;
}

constexpr int64_t kInt8Rows = 4;   // rows added per pass over a span's sums (one load and store of them per 4 rows)

// Token-major, as lookup_kernel: per token and column, the sums start from bias + the token's offset and add
// w_k * float(q_k) over its K rows in table order, the units split over the threads as for_token_units says. The
// whole vectors take lookup_kernel's orders (sum_whole_vectors: vector sums, the codes widened in registers by
// load_floats, a zero-extension and a conversion per vector); the ragged last columns (fewer than kLanes) are a plain
// loop over kInt8Rows rows per pass, with the same bits. FBGEMM's JIT kernel takes fewer
// instructions per code on many tokens, so quantization.py uses it beyond a few tokens; at one token the rows' reads
// dominate and this pass, which issues them at once with no per-call setup, is the faster one. The alternatives tried
// and dropped are in docs/kernel.md.
void int8_lookup_token(const int64_t* rows, const float* scores, const uint8_t* packed, const float* bias, float* out,
                       int64_t N, int64_t K, int64_t D) {
  const int64_t W = D + kInt8RowBytes;
  for_token_units(rows, N, K, D, 1, [=](int64_t n, int64_t cb, int64_t ce, const int64_t* rnext) {
    const int64_t* rn = rows + n * K;
    // Every row's scale and offset (the line past its codes), which int8_token_weights reads before any code is
    // summed, and its first span asked for at once: K rows of reads in flight. The scales and offsets were a pass of
    // their own before the units, on one thread: a wait on K cold lines before the codes were asked for. A ragged last
    // span prefetches each row's next span K lookups ahead (span_ahead).
    const auto prefetch = [=](int64_t k, int64_t c0) {
      int64_t pw = 0;
      if (const uint8_t* p = span_ahead(packed, W, rn, rnext, K, k, c0, cb, ce, pw, K)) prefetch_span(p, pw);
    };
    for (int64_t k = 0; k < K; ++k) {
      prefetch_span(packed + rn[k] * W + D, kInt8RowBytes);
      prefetch_span(packed + rn[k] * W + cb, std::min(kCols, ce - cb));
    }
    static thread_local std::vector<float> token_weights;   // this thread's, grown to the largest K seen
    if (static_cast<int64_t>(token_weights.size()) < K) token_weights.resize(K);
    float* wn = token_weights.data();
    const float off = int8_token_weights(rn, scores + n * K, packed, K, D, wn);
    // Whole vectors: the bf16 pass's orders (sum_whole_vectors), the sums from off + bias, row by row in table order
    // (the ragged loop's bits).
    const int64_t ragged = sum_whole_vectors(packed, W, rn, rnext, wn, K, cb, ce, [&](float* sums, int64_t w) {
      for (int64_t j = 0; j < w; j += kLanes)
        (fVec(off) + (bias ? fVec::loadu(bias + cb + j) : fVec(0.f))).store(sums + j);
    }, [&](const float* sums, int64_t w) { std::memcpy(out + n * D + cb, sums, w * sizeof(float)); });
    for (int64_t c0 = ragged; c0 < ce; c0 += kCols) {
      const int64_t w = std::min(kCols, ce - c0);
      float acc[kCols];
      for (int64_t j = 0; j < w; ++j) acc[j] = off + (bias ? bias[c0 + j] : 0.0f);
      int64_t k = 0;
      for (; k + kInt8Rows <= K; k += kInt8Rows) {   // kInt8Rows rows per pass over the sums
        for (int64_t i = 0; i < kInt8Rows; ++i) prefetch(k + i, c0);
        const uint8_t* q0 = packed + rn[k] * W + c0;
        const uint8_t* q1 = packed + rn[k + 1] * W + c0;
        const uint8_t* q2 = packed + rn[k + 2] * W + c0;
        const uint8_t* q3 = packed + rn[k + 3] * W + c0;
        const float s0 = wn[k], s1 = wn[k + 1], s2 = wn[k + 2], s3 = wn[k + 3];
        if (w == kCols) {
#pragma omp simd
          for (int64_t j = 0; j < kCols; ++j) acc[j] = add_codes4(acc[j], s0, s1, s2, s3, q0[j], q1[j], q2[j], q3[j]);
        } else {
          for (int64_t j = 0; j < w; ++j) acc[j] = add_codes4(acc[j], s0, s1, s2, s3, q0[j], q1[j], q2[j], q3[j]);
        }
      }
      for (; k < K; ++k) {
        prefetch(k, c0);
        const uint8_t* q = packed + rn[k] * W + c0;
        const float s = wn[k];
        for (int64_t j = 0; j < w; ++j) acc[j] += s * float(q[j]);
      }
      float* o = out + n * D + c0;
      for (int64_t j = 0; j < w; ++j) o[j] = acc[j];
    }
  });
}

// int8 tables (see "int8 tables"): packed uint8 [K * rows_per_table, D + 8], rows and scores as for lookup (rows[:, k]
// in table k), bias of D floating values or none -> float32 [N, D], by the token-major pass. There is no packed pass
// over int8 rows: it was slower than FBGEMM's 8-bit embedding bag, which quantization.py uses for many tokens
// (docs/kernel.md).
at::Tensor int8_lookup_op(const at::Tensor& rows, const at::Tensor& scores, const at::Tensor& packed,
                          const std::optional<at::Tensor>& bias, int64_t rows_per_table) {
  const char* op = "int8_lookup";
  check_cpu_contiguous(rows, op, "rows");
  check_cpu_contiguous(packed, op, "packed");
  TORCH_CHECK(scores.defined(), "memoryformer.int8_lookup: scores is undefined");
  check_floating(scores, op, "scores");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 2, "memoryformer.int8_lookup: rows must be int64 "
              "[N, K], got ", rows.scalar_type(), " of shape ", rows.sizes());
  TORCH_CHECK(rows.size(1) >= 1, "memoryformer.int8_lookup: rows must have one column per table (K >= 1), got ",
              rows.sizes());
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.size(1) >= kInt8RowBytes,
              "memoryformer.int8_lookup: packed must be uint8 [rows, D + 8] (FBGEMM's row-wise layout: D codes, "
              "then a float32 scale and offset per row), got ", packed.scalar_type(), " of shape ", packed.sizes());
  TORCH_CHECK(rows_per_table >= 1, "memoryformer.int8_lookup: rows_per_table must be >= 1, got ", rows_per_table);
  const int64_t N = rows.size(0), K = rows.size(1), D = packed.size(1) - kInt8RowBytes, P = rows_per_table;
  TORCH_CHECK(packed.size(0) % K == 0 && packed.size(0) / K == P, "memoryformer.int8_lookup: packed must have "
              "K * rows_per_table = ", K, " * ", P, " rows, got ", packed.size(0));
  TORCH_CHECK(scores.dim() == 2 && scores.size(0) == N && scores.size(1) == K, "memoryformer.int8_lookup: scores "
              "must have the shape of rows ", rows.sizes(), ", got ", scores.sizes());
  check_rows(rows, P);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    check_floating(*bias, op, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == D, "memoryformer.int8_lookup: bias must be 1-D with one "
                "value per output column [", D, "], got shape ", bias->sizes());
    b = bias->to(at::kFloat).contiguous();
  }
  auto s = scores.to(at::kFloat).contiguous();
  auto out = at::empty({N, D}, packed.options().dtype(at::kFloat));
  if (N == 0 || D == 0) return out;
  const uint8_t* q = packed.data_ptr<uint8_t>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  int8_lookup_token(rows.data_ptr<int64_t>(), s.data_ptr<float>(), q, bp, out.data_ptr<float>(), N, K, D);
  return out;
}
