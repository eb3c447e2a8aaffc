// The thread split, and the loads, prefetches and stores of row spans that every kernel uses.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ threads and spans
int64_t threads_for(int64_t work) { return work < kSerialWork ? 1 : at::get_num_threads(); }

template <typename F> void parallel_tokens(int64_t N, int64_t work, F body) {
  if (threads_for(work) == 1) body(0, N);
  else at::parallel_for(0, N, 1, body);
}

// kLanes values of a float32, bfloat16 or float16 span, or kLanes int8 table codes (uint8), as one float32 vector
// (bfloat16: a shift per value; codes: a zero-extension and a conversion, exact).
template <typename T> inline fVec load_floats(const T* p) {
  if constexpr (std::is_same<T, float>::value) {
    return fVec::loadu(p);
  } else if constexpr (std::is_same<T, uint8_t>::value) {
#if defined(CPU_CAPABILITY_AVX512)
    return fVec(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
    return fVec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
    float f[kLanes];
    for (int64_t j = 0; j < kLanes; ++j) f[j] = float(int32_t(p[j]));
    return fVec::loadu(f);
#endif
  } else {
    fVec v;
    at::vec::load_to_float<T>(p, v);
    return v;
  }
}

// <a, b> over D values, summed in float32: a float32, b float32 or 16-bit (widened by vectors); two partial sums by
// vectors, then the tail one value at a time.
template <typename T> inline float dot_floats(const float* a, const T* b, int64_t D) {
  fVec d0(0.0f), d1(0.0f);
  int64_t j = 0;
  for (; j + 2 * kLanes <= D; j += 2 * kLanes) {
    d0 = at::vec::fmadd(fVec::loadu(a + j), load_floats(b + j), d0);
    d1 = at::vec::fmadd(fVec::loadu(a + j + kLanes), load_floats(b + j + kLanes), d1);
  }
  float dot = at::vec::vec_reduce_all<float>([](const fVec& x, const fVec& y) { return x + y; }, d0 + d1);
  for (; j < D; ++j) dot += a[j] * to_acc(b[j]);
  return dot;
}

// Every cache line the span [p, p + w) touches: a span that does not start on a line (an int8 row is D + 8 bytes, so
// its spans start 8 bytes further into a line per row) reaches into one more line than its width in lines. Locality
// is __builtin_prefetch's: 3 (the default) into L1, 2 into L2 (prefetcht1 on x86, PLDL2KEEP on aarch64).
template <int Locality = 3, typename T> inline void prefetch_span(const T* p, int64_t w) {
  if (w <= 0) return;
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(63);
  const uintptr_t last = (reinterpret_cast<uintptr_t>(p + w) - 1) & ~uintptr_t(63);
  for (uintptr_t c = first; c <= last; c += 64) __builtin_prefetch(reinterpret_cast<const void*>(c), 0, Locality);
}

// Non-temporal store of float spans (no read-for-ownership, no eviction of what sits in L2): the widest form the
// target has, the plain store elsewhere. Same values either way; `g` is 64-byte aligned and w a multiple of 16.
inline void stream_floats(float* g, const float* v, int64_t w) {
#if defined(__AVX512F__)
  for (int64_t j = 0; j < w; j += 16) _mm512_stream_ps(g + j, _mm512_loadu_ps(v + j));
#elif defined(__AVX__)
  for (int64_t j = 0; j < w; j += 8) _mm256_stream_ps(g + j, _mm256_loadu_ps(v + j));
#elif defined(__SSE2__)
  for (int64_t j = 0; j < w; j += 4) _mm_stream_ps(g + j, _mm_loadu_ps(v + j));
#else
  std::memcpy(g, v, sizeof(float) * w);
#endif
}

inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();   // order the streaming stores before the gradient is handed on
#endif
}

// Store a finished gradient span that nothing will read soon: non-temporal where the span is float32, 64-byte
// aligned whole lines (stream_floats), a plain converting store otherwise.
template <typename T, typename A> inline void store_span(T* g, const A* v, int64_t w, bool stream) {
  if constexpr (std::is_same<T, float>::value && std::is_same<A, float>::value) {
    if (stream && w % 16 == 0 && (reinterpret_cast<uintptr_t>(g) & 63) == 0) {
      stream_floats(g, v, w);
      return;
    }
  }
  int64_t j = 0;
  if constexpr ((std::is_same<T, c10::BFloat16>::value || std::is_same<T, c10::Half>::value) &&
                std::is_same<A, float>::value) {   // 16-bit: two float vectors rounded to one 16-bit vector at a time
    static_assert(at::vec::Vectorized<T>::size() == 2 * kLanes, "two float vectors round to one 16-bit vector");
    for (; j + 2 * kLanes <= w; j += 2 * kLanes)
      at::vec::convert_from_float<T>(fVec::loadu(v + j), fVec::loadu(v + j + kLanes)).store(g + j);
  }
  for (; j < w; ++j) g[j] = static_cast<T>(v[j]);
}

// dst[0, w) = src[0, w) widened (vector loads for 16-bit values into float32, memcpy for the same type).
template <typename A, typename S> inline void load_span(A* dst, const S* src, int64_t w) {
  if constexpr (std::is_same<S, A>::value) {
    std::memcpy(dst, src, sizeof(A) * w);
  } else {
    int64_t j = 0;
    if constexpr (std::is_same<A, float>::value)
      for (; j + kLanes <= w; j += kLanes) load_floats(src + j).store(dst + j);
    for (; j < w; ++j) dst[j] = static_cast<A>(static_cast<float>(src[j]));
  }
}
