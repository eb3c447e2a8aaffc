// Attention of one query position per sequence (a decode step).
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ decode attention
// out[b, 0, h] = softmax_t(scaling <q[b, h], k[b, h', t]> + mask[b, h, t]) . v[b, h', t] for one query position, where
// h' = h / (H / Hkv) (grouped KV heads). Decoding runs this once per layer and step with a single query row per head;
// PyTorch's CPU scaled_dot_product_attention handles that shape with its blocked flash kernel, whose setup and
// bfloat16 GEMM calls cost 60-80 us for 8 heads over 40 keys on an AVX2 CPU without bfloat16 instructions (about
// 1.3 ms at 4 sequences over 400 keys), for a few hundred KB of keys and values. Here each (sequence, head) pair is
// one pass over its keys (the scores in a row of float32), then one over its values, all sums in float32 (the
// probabilities are not rounded to the input dtype before the value sum, as that kernel does), the output rounded once.
// A row whose keys are all masked out gives zeros, as scaled_dot_product_attention does. The sums over keys run in
// key order, and a masked-out key adds an exact zero, so a longer, masked cache (a static cache) gives the same bits.

// kB keys' scores <qf, k_t> at once, each summed as dot_floats sums it (two partial sums of vectors, reduced, then the
// ragged tail), so every key gets the bits it gets alone: kB independent chains of multiply-adds instead of one.
constexpr int64_t kKeyBlock = 4;   // dot_keys and decode_attention_row's masked-block test are written for 4
template <typename T>
inline void dot_keys(const float* qf, const T* k, int64_t k_step, int64_t D, float* out) {
  static_assert(kKeyBlock == 4, "dot_keys sums 4 keys");
  constexpr int64_t L = kLanes;
  const T* k0 = k;
  const T* k1 = k + k_step;
  const T* k2 = k + 2 * k_step;
  const T* k3 = k + 3 * k_step;
  // Named sums, not an array: GCC keeps an array of vectors in memory (see RawVec).
  RawVec a0 = raw_vec(fVec(0.0f)), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  int64_t j = 0;
  for (; j + 2 * L <= D; j += 2 * L) {
    const fVec q0 = fVec::loadu(qf + j), q1 = fVec::loadu(qf + j + L);
    a0 = raw_vec(at::vec::fmadd(q0, load_floats(k0 + j), from_raw(a0)));
    b0 = raw_vec(at::vec::fmadd(q1, load_floats(k0 + j + L), from_raw(b0)));
    a1 = raw_vec(at::vec::fmadd(q0, load_floats(k1 + j), from_raw(a1)));
    b1 = raw_vec(at::vec::fmadd(q1, load_floats(k1 + j + L), from_raw(b1)));
    a2 = raw_vec(at::vec::fmadd(q0, load_floats(k2 + j), from_raw(a2)));
    b2 = raw_vec(at::vec::fmadd(q1, load_floats(k2 + j + L), from_raw(b2)));
    a3 = raw_vec(at::vec::fmadd(q0, load_floats(k3 + j), from_raw(a3)));
    b3 = raw_vec(at::vec::fmadd(q1, load_floats(k3 + j + L), from_raw(b3)));
  }
  const RawVec d[kKeyBlock][2] = {{a0, b0}, {a1, b1}, {a2, b2}, {a3, b3}};
  for (int64_t b = 0; b < kKeyBlock; ++b) {
    float dot = at::vec::vec_reduce_all<float>([](const fVec& x, const fVec& y) { return x + y; },
                                               from_raw(d[b][0]) + from_raw(d[b][1]));
    for (int64_t i = j; i < D; ++i) dot += qf[i] * to_acc(k[b * k_step + i]);
    out[b] = dot;
  }
}

// Where a head's pass reads next, `ahead` values on (0: nothing to prefetch): its keys [0, span), then its values
// [span, 2 span), then the next head's keys (`next_k`, or none) [2 span, 3 span); span = the head's kept positions
// times D (dense keys and values: position stride D).
template <typename T>
inline void prefetch_pass(const T* k, const T* v, const T* next_k, int64_t span, int64_t at, int64_t w) {
  if (at < span) prefetch_span(k + at, w);
  else if (at < 2 * span) prefetch_span(v + (at - span), w);
  else if (next_k != nullptr && at < 3 * span) prefetch_span(next_k + (at - 2 * span), w);
}

// acc[0, V * kLanes) = sum_t p[t] v_t (key order, zero weights skipped) in V vector registers; the same
// multiply-adds, in the same order, as a sum held in memory. ahead > 0: the pass's reads `ahead` values on are
// prefetched (prefetch_pass, the values at offset span).
template <typename T, int V>
void value_sum(const T* v, int64_t v_step, const float* p, int64_t Tn, float* acc, int64_t ahead, int64_t span,
               const T* next_k) {
  RawVec a[V];
  for (int i = 0; i < V; ++i) a[i] = raw_vec(fVec(0.0f));
  for (int64_t t = 0; t < Tn; ++t) {
    if (ahead > 0) prefetch_pass<T>(nullptr, v, next_k, span, span + t * v_step + ahead, v_step);
    if (p[t] == 0.f) continue;
    const T* vt = v + t * v_step;
    const fVec pv(p[t]);
    for (int i = 0; i < V; ++i) a[i] = raw_vec(at::vec::fmadd(pv, load_floats(vt + i * kLanes), from_raw(a[i])));
  }
  for (int i = 0; i < V; ++i) from_raw(a[i]).store(acc + i * kLanes);
}

// One (sequence, head): scores into s[T] (kKeyBlock keys at a time, a block whose keys are all masked out skipped; a
// masked-out key's score is -inf), their exponentials in place, then the weighted value sum into acc[D] (both float32
// scratch): whole vectors in registers for a head of up to 8 vectors, in memory beyond, the ragged columns last.
// ahead > 0 (keys and values dense, position stride D): the reads `ahead` values on are prefetched as the passes go,
// the keys up to the last kept position, then the values, then the next head's keys (`next_k`, or none).
template <typename T>
void decode_attention_row(const T* q, const T* k, const T* v, int64_t k_step, int64_t v_step, int64_t D, int64_t Tn,
                          float scaling, const bool* keep, const float* add, float* qf, float* s, float* acc,
                          T* out, int64_t ahead, const T* next_k) {
  constexpr int64_t L = kLanes;
  const int64_t Dv = D - D % L;
  for (int64_t j = 0; j < D; ++j) qf[j] = float(q[j]);
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  float m = kMinusInf;
  int64_t kept = Tn;   // positions up to the last kept one: the rest of a static cache is never read
  if (keep && ahead > 0)
    while (kept > 0 && !keep[kept - 1]) --kept;
  const int64_t span = kept * D;
  int64_t t = 0;
  // A block of masked-out keys (a static cache's unused end) costs no read.
  for (; t + kKeyBlock <= Tn; t += kKeyBlock) {
    if (ahead > 0) prefetch_pass(k, v, next_k, span, t * D + ahead, kKeyBlock * D);
    if (keep && !(keep[t] || keep[t + 1] || keep[t + 2] || keep[t + 3])) continue;
    dot_keys(qf, k + t * k_step, k_step, D, s + t);
  }
  for (; t < Tn; ++t)
    if (!keep || keep[t]) s[t] = dot_floats(qf, k + t * k_step, D);
  for (t = 0; t < Tn; ++t) {
    if (keep && !keep[t]) {
      s[t] = kMinusInf;
      continue;
    }
    float score = s[t] * scaling;
    if (add) score += add[t];
    s[t] = score;
    m = std::max(m, score);
  }
  if (m == kMinusInf) {  // every key masked out (or -inf scores): zeros
    for (int64_t j = 0; j < D; ++j) out[j] = T(0.f);
    return;
  }
  // The weights exp(s - m), kLanes at a time (ATen's vectorised exp: within an ulp of std::exp, and 0 for a masked
  // key's -inf), their total in key order.
  const fVec mv(m);
  for (t = 0; t + L <= Tn; t += L) (fVec::loadu(s + t) - mv).exp().store(s + t);
  if (t < Tn) (fVec::loadu(s + t, Tn - t) - mv).exp().store(s + t, Tn - t);
  float total = 0.f;
  for (t = 0; t < Tn; ++t) total += s[t];   // an exact zero adds nothing: masked keys cost no value read
  switch (Dv / L) {
    case 0: break;
    case 1: value_sum<T, 1>(v, v_step, s, Tn, acc, ahead, span, next_k); break;
    case 2: value_sum<T, 2>(v, v_step, s, Tn, acc, ahead, span, next_k); break;
    case 3: value_sum<T, 3>(v, v_step, s, Tn, acc, ahead, span, next_k); break;
    case 4: value_sum<T, 4>(v, v_step, s, Tn, acc, ahead, span, next_k); break;
    case 5: value_sum<T, 5>(v, v_step, s, Tn, acc, ahead, span, next_k); break;
    case 6: value_sum<T, 6>(v, v_step, s, Tn, acc, ahead, span, next_k); break;
    case 7: value_sum<T, 7>(v, v_step, s, Tn, acc, ahead, span, next_k); break;
    case 8: value_sum<T, 8>(v, v_step, s, Tn, acc, ahead, span, next_k); break;
    default:
      for (int64_t j = 0; j < Dv; ++j) acc[j] = 0.f;
      for (t = 0; t < Tn; ++t) {
        if (ahead > 0) prefetch_pass<T>(nullptr, v, next_k, span, span + t * v_step + ahead, v_step);
        if (s[t] == 0.f) continue;
        const T* vt = v + t * v_step;
        const fVec pv(s[t]);
        for (int64_t j = 0; j < Dv; j += L)
          at::vec::fmadd(pv, load_floats(vt + j), fVec::loadu(acc + j)).store(acc + j);
      }
  }
  for (int64_t j = Dv; j < D; ++j) acc[j] = 0.f;
  for (t = 0; t < Tn && Dv < D; ++t) {
    if (s[t] == 0.f) continue;
    const float p = s[t];
    const T* vt = v + t * v_step;
    for (int64_t j = Dv; j < D; ++j) acc[j] += p * float(vt[j]);
  }
  const float inv = 1.f / total;
  for (int64_t j = 0; j < D; ++j) out[j] = T(acc[j] * inv);
}

// Heads are split over the threads from this many multiply-adds (scores and value sums) on, far below the kernel's
// kSerialWork: a head costs about 0.45 ns per multiply-add in bfloat16 (the conversions, the exp), so one decode step
// of MF-small (12 heads x 64 dims over 50 keys, 77 K multiply-adds) took 33-44 us on one thread and 24-26 us on two
// of the 2-vCPU Zen 1 of docs/performance.md, in the stack of a generate call (the threads are awake there). Each
// head is summed by one thread in its own order either way: the same bits.
constexpr int64_t kAttentionSerialWork = 1 << 14;

// The decode attention of B sequences x H query heads (Hkv key/value heads, H a multiple of it) over Tn positions,
// from pointers and element strides (q [B, H, D] by q_b and q_h; k and v [B, Hkv, Tn, D] by their batch, head and
// position strides; keep and add [B * H, Tn] or null), out [B, H, D] contiguous: decode_attention_row per (b, h),
// over the threads where the work is worth it. Keys and values are cold after the LM head's stream; where the
// positions are dense, each pass prefetches kAttentionAhead bytes ahead of its reads (keys, then values, then the
// thread's next head's keys: decode_attention_row), so the reads overlap the sums. A thread used to prefetch all its
// heads' keys and values first (a static cache's whole buffer too): the prefetches stalled on the full miss buffers
// and the sums then ran after them. On the 2-vCPU Zen 4 of benchmarks/results/2026-11-29e-zen4, timers inside
// decode_stack around the attention, variants alternating step by step in one process (MF-small bf16, 128 to 384
// cached positions), per step: all first 430-449 us, no prefetch 377-386 us; then no prefetch 352-375, 2 KB ahead
// 316-343, 6 KB 310-327; then 6 KB 322-346, 12 KB 334-355, 24 KB 347-369.
constexpr int64_t kAttentionAhead = 6 << 10;

template <typename T>
void decode_attention_rows(const T* qp, int64_t q_b, int64_t q_h, const T* kp, int64_t k_b, int64_t k_h, int64_t k_t,
                           const T* vp, int64_t v_b, int64_t v_h, int64_t v_t, int64_t B, int64_t H, int64_t Hkv,
                           int64_t D, int64_t Tn, float scale, const bool* keep_p, const float* add_p, T* out) {
  const int64_t group = H / Hkv;
  const int64_t ahead = k_t == D && v_t == D ? kAttentionAhead / int64_t(sizeof(T)) : 0;
  const auto keys = [&](int64_t r) { return kp + (r / H) * k_b + ((r % H) / group) * k_h; };
  const auto body = [&](int64_t r0, int64_t r1) {
    if (ahead > 0) prefetch_span(keys(r0), std::min(Tn * D, ahead));   // the first head's first keys
    std::vector<float> scratch(2 * D + Tn);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / H, h = r % H, hk = h / group;
      const T* next_k = r + 1 < r1 && (r + 1) % group == 0 ? keys(r + 1) : nullptr;   // a new key/value head next
      decode_attention_row<T>(qp + b * q_b + h * q_h, keys(r), vp + b * v_b + hk * v_h, k_t, v_t, D,
                              Tn, scale, keep_p ? keep_p + r * Tn : nullptr, add_p ? add_p + r * Tn : nullptr,
                              scratch.data(), scratch.data() + D + D, scratch.data() + D, out + (b * H + h) * D,
                              ahead, next_k);
    }
  };
  if (B * H * Tn * D * 2 < kAttentionSerialWork || B * H == 1 || at::get_num_threads() == 1) body(0, B * H);
  else at::parallel_for(0, B * H, 1, body);
}

// decode_attention_rows in k's dtype (float32, bfloat16 or float16; q, out and the caller's checks agree): q by its
// batch and head strides q_b and q_h, k and v [B, Hkv, Tn, D] with a contiguous last dimension, H query heads, out
// [B, H, D] contiguous. The one dtype dispatch of the op and of decode_stack's lean layer.
void decode_attention_into(const void* q, int64_t q_b, int64_t q_h, const at::Tensor& k, const at::Tensor& v,
                           int64_t H, float scale, const bool* keep_p, const float* add_p, void* out) {
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    decode_attention_rows<T>(static_cast<const T*>(q), q_b, q_h, static_cast<const T*>(k.data_ptr()), k.stride(0),
                             k.stride(1), k.stride(2), static_cast<const T*>(v.data_ptr()), v.stride(0), v.stride(1),
                             v.stride(2), k.size(0), H, k.size(1), k.size(3), k.size(2), scale, keep_p, add_p,
                             static_cast<T*>(out));
  };
  const auto dtype = k.scalar_type();
  if (dtype == at::kFloat) run(static_cast<float*>(nullptr));
  else if (dtype == at::kBFloat16) run(static_cast<c10::BFloat16*>(nullptr));
  else run(static_cast<c10::Half*>(nullptr));
}

// q [B, H, 1, D], k and v [B, Hkv, T, D] (any strides with a contiguous last dimension: the views a KV cache and a
// fused Q/K/V output give), mask None, bool (true: attend) or additive float, broadcastable to [B, H, 1, T];
// float32, bfloat16 or float16, all one dtype. Returns [B, 1, H, D] contiguous in that dtype (the layout transformers'
// attention functions return).
at::Tensor decode_attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const std::optional<at::Tensor>& mask, double scaling) {
  const char* op = "memoryformer.decode_attention";
  for (const auto* t : {&q, &k, &v}) {
    TORCH_CHECK(t->defined() && t->device().is_cpu(), op, ": q, k and v must be CPU tensors");
    TORCH_CHECK(t->dim() == 4, op, ": q, k and v must be 4-D ([batch, heads, positions, head_dim]), got shape ",
                t->sizes());
    TORCH_CHECK(t->stride(3) == 1 || t->size(3) <= 1, op, ": the last dimension of q, k and v must be contiguous, "
                "got strides ", t->strides());
  }
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op, ": q must be float32, "
              "bfloat16 or float16 (other dtypes take scaled_dot_product_attention), got ", dtype);
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype, op, ": q, k and v must have one dtype, got ",
              dtype, ", ", k.scalar_type(), " and ", v.scalar_type());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), Hkv = k.size(1), Tn = k.size(2);
  TORCH_CHECK(q.size(2) == 1, op, ": q must hold one query position (decoding), got ", q.size(2), " (use "
              "scaled_dot_product_attention for more)");
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && k.size(3) == D && v.size(3) == D && v.size(1) == Hkv &&
              v.size(2) == Tn, op, ": k and v must be [", B, ", Hkv, T, ", D, "] alike, got ", k.sizes(), " and ",
              v.sizes());
  TORCH_CHECK(Hkv >= 1 && H % Hkv == 0, op, ": the query heads (", H, ") must be a multiple of the key/value heads (",
              Hkv, ")");
  TORCH_CHECK(Tn >= 1, op, ": k and v hold no position");
  at::Tensor keep, add;
  if (mask.has_value() && mask->defined()) {
    TORCH_CHECK(mask->device().is_cpu() && mask->dim() == 4 && mask->size(2) == 1 && mask->size(3) == Tn &&
                (mask->size(0) == 1 || mask->size(0) == B) && (mask->size(1) == 1 || mask->size(1) == H), op,
                ": mask must be broadcastable to [", B, ", ", H, ", 1, ", Tn, "], got shape ", mask->sizes());
    if (mask->scalar_type() == at::kBool) keep = mask->expand({B, H, 1, Tn}).contiguous();
    else add = mask->to(at::kFloat).expand({B, H, 1, Tn}).contiguous();
  }
  auto out = at::empty({B, 1, H, D}, q.options());
  const bool* keep_p = keep.defined() ? keep.data_ptr<bool>() : nullptr;
  const float* add_p = add.defined() ? add.data_ptr<float>() : nullptr;
  decode_attention_into(q.data_ptr(), q.stride(0), q.stride(1), k, v, H, float(scaling), keep_p, add_p, out.data_ptr());
  return out;
}
