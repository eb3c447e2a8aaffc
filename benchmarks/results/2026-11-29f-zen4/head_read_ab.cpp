#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <vector>
#include <algorithm>
using bf16 = uint16_t;
static inline __m512 ld(const bf16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static void* hmap(size_t n){ void* p=mmap(0,n,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0); madvise(p,n,MADV_HUGEPAGE); return p; }
template <int NEAR, int FAR, int FARLOC>
static void rows(const float* x, const bf16* w, float* y, int64_t D, int64_t v0, int64_t v1, const char* end) {
  for (int64_t v = v0; v < v1; ++v) {
    const bf16* wr = w + v * D;
    const char* near = (const char*)wr + NEAR; const char* far = (const char*)wr + FAR;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t j = 0; j < D; j += 64, near += 128, far += 128) {
      for (int c = 0; c < 128; c += 64) {
        if (NEAR && near + c < end) __builtin_prefetch(near + c);
        if (FAR && far + c < end) __builtin_prefetch(far + c, 0, FARLOC);
      }
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j), ld(wr + j), a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j + 16), ld(wr + j + 16), a1);
      a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j + 32), ld(wr + j + 32), a2);
      a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + j + 48), ld(wr + j + 48), a3);
    }
    y[v] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  }
}
// even/odd conversion: 32 bf16 a 512-bit load, the even ones shifted up, the odd ones masked; x pre-split (xe: evens, xo: odds per 32-chunk)
template <int NEAR, int FAR>
static void rows_eo(const float* x, const bf16* w, float* y, int64_t D, int64_t v0, int64_t v1, const char* end) {
  const float* xe = x + D; const float* xo = x + D + D / 2;
  const __m512i hi = _mm512_set1_epi32(0xffff0000);
  for (int64_t v = v0; v < v1; ++v) {
    const bf16* wr = w + v * D;
    const char* near = (const char*)wr + NEAR; const char* far = (const char*)wr + FAR;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t j = 0; j < D; j += 64, near += 128, far += 128) {
      for (int c = 0; c < 128; c += 64) {
        if (NEAR && near + c < end) __builtin_prefetch(near + c);
        if (FAR && far + c < end) __builtin_prefetch(far + c, 0, 2);
      }
      __m512i u0 = _mm512_loadu_si512(wr + j), u1 = _mm512_loadu_si512(wr + j + 32);
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(xe + j / 2), _mm512_castsi512_ps(_mm512_slli_epi32(u0, 16)), a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(xo + j / 2), _mm512_castsi512_ps(_mm512_and_si512(u0, hi)), a1);
      a2 = _mm512_fmadd_ps(_mm512_loadu_ps(xe + j / 2 + 16), _mm512_castsi512_ps(_mm512_slli_epi32(u1, 16)), a2);
      a3 = _mm512_fmadd_ps(_mm512_loadu_ps(xo + j / 2 + 16), _mm512_castsi512_ps(_mm512_and_si512(u1, hi)), a3);
    }
    y[v] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  }
}
static void probe(const float* x, const bf16* w, float* y, int64_t D, int64_t v0, int64_t v1, const char*) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const bf16* p = w + v0 * D, *e = w + v1 * D;
  for (; p < e; p += 64) { a0 = _mm512_add_ps(a0, ld(p)); a1 = _mm512_add_ps(a1, ld(p + 16)); a2 = _mm512_add_ps(a2, ld(p + 32)); a3 = _mm512_add_ps(a3, ld(p + 48)); }
  y[v0] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}
typedef void (*Fn)(const float*, const bf16*, float*, int64_t, int64_t, int64_t, const char*);
int main(int argc, char** argv) {
  const int64_t V = 50304, D = argc > 1 ? atoi(argv[1]) : 768;
  bf16* w = (bf16*)hmap(V * D * 2); for (int64_t i = 0; i < V * D; ++i) w[i] = 0x3f80 + (i & 15);
  float* x = (float*)aligned_alloc(64, 4 * D * 4); for (int i = 0; i < D; ++i) x[i] = 1e-3f * i; for (int j = 0; j < D; j += 32) for (int i = 0; i < 16; ++i) { x[D + j / 2 + i] = x[j + 2 * i]; x[D + D / 2 + j / 2 + i] = x[j + 2 * i + 1]; }
  float* y = (float*)aligned_alloc(64, V * 4);
  const int64_t fn = 64ll << 20; float* fl = (float*)hmap(fn * 4); for (int64_t i = 0; i < fn; ++i) fl[i] = 1;
  const char* names[] = {"probe", "n2K f16K(cur)", "none", "eo none", "eo n2K f16K", "eo f16K"};
  Fn fns[] = {probe, rows<2048, 16384, 2>, rows<0, 0, 2>, rows_eo<0, 0>, rows_eo<2048, 16384>, rows_eo<0, 16384>};
  const int S = sizeof(fns) / sizeof(*fns);
  std::vector<std::vector<double>> t(S);
  for (int it = 0; it < 40 * S; ++it) {
    int f = it % S;
    double fs = 0;
    #pragma omp parallel for num_threads(2) reduction(+:fs)
    for (int64_t i = 0; i < fn; i += 16) fs += fl[i];
    auto t0 = std::chrono::steady_clock::now();
    #pragma omp parallel num_threads(2)
    { int th = omp_get_thread_num(); int64_t v0 = V * th / 2, v1 = V * (th + 1) / 2; fns[f](x, w, y, D, v0, v1, (const char*)(w + v1 * D)); }
    t[f].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    if (fs < 0) printf("x");
  }
  for (int f = 1; f < S; ++f) { double tt = 0; for (int r = 0; r < 30; ++r) { auto t0 = std::chrono::steady_clock::now();
    #pragma omp parallel num_threads(2)
    { int th = omp_get_thread_num(); int64_t v0 = 6000 * th / 2, v1 = 6000 * (th + 1) / 2; fns[f](x, w, y, D, v0, v1, (const char*)(w + v1 * D)); }
    if (r >= 10) tt += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }
    printf("hot %-14s %5.1f GB/s\n", names[f], 6000.0 * D * 2 * 20 / tt / 1e9);
  }
  { float r1, r2; rows<0,0,2>(x, w, y, D, 5, 6, (const char*)(w + V * D)); r1 = y[5]; rows_eo<0,0>(x, w, y, D, 5, 6, (const char*)(w + V * D)); r2 = y[5]; printf("check %g %g\n", r1, r2); }
  for (int f = 0; f < S; ++f) { auto& v = t[f]; std::sort(v.begin(), v.end());
    printf("%-14s median %5.1f GB/s  best %5.1f\n", names[f], V * D * 2 / v[v.size() / 2] / 1e9, V * D * 2 / v[0] / 1e9); }
}
