// Microbenchmark: gather-sum of K bf16 rows' column ranges, MF-small decode shapes, 2 threads, cold rows.
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <random>
#include <algorithm>
static void* hmap(size_t n){ void* p=mmap(0,n,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0); madvise(p,n,MADV_HUGEPAGE); return p; }
using bf16 = uint16_t;
static inline __m512 ld(const bf16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
template <int L> static inline void pf(const void* p, int64_t bytes) {
  uintptr_t a = (uintptr_t)p & ~uintptr_t(63), e = ((uintptr_t)p + bytes - 1) & ~uintptr_t(63);
  for (; a <= e; a += 64) __builtin_prefetch((const void*)a, 0, L);
}
constexpr int kCols = 256, kL = 16, V = 16;
// S0: span order, t0 4 ahead, t1 12 ahead
template <int VV, int A0 = 4, int A1 = 12> static void span_rows(float* sums, const bf16* T, int64_t stride, const int64_t* rn, int K, int64_t c0, int64_t cb, int64_t ce) {
  __m512 acc[VV];
  for (int i = 0; i < VV; ++i) acc[i] = _mm512_loadu_ps(sums + (c0 - cb) + i * kL);
  const int64_t w = VV * kL;
  for (int k = 0; k < K; ++k) {
    int a = k + A0; if (A0 && a < K) pf<3>(T + rn[a] * stride + c0, w * 2); else if (A0 && a - K < K && c0 + w < ce) pf<3>(T + rn[a - K] * stride + c0 + w, std::min<int64_t>(kCols, ce - c0 - w) * 2);
    a = k + A1; if (a < K) pf<2>(T + rn[a] * stride + c0, w * 2); else if (a - K < K && c0 + w < ce) pf<2>(T + rn[a - K] * stride + c0 + w, std::min<int64_t>(kCols, ce - c0 - w) * 2);
    const bf16* t = T + rn[k] * stride + c0; __m512 s = _mm512_set1_ps(1.0f);
    for (int i = 0; i < VV; ++i) acc[i] = _mm512_fmadd_ps(s, ld(t + i * kL), acc[i]);
  }
  for (int i = 0; i < VV; ++i) _mm512_storeu_ps(sums + (c0 - cb) + i * kL, acc[i]);
}
template <int A0 = 4, int A1 = 12> static void s0(float* sums, const bf16* T, int64_t stride, const int64_t* rn, int K, int64_t cb, int64_t ce) {
  for (int k = 0; k < A0; ++k) pf<3>(T + rn[k] * stride + cb, std::min<int64_t>(kCols, ce - cb) * 2); for (int k = A0; k < A1; ++k) pf<2>(T + rn[k] * stride + cb, std::min<int64_t>(kCols, ce - cb) * 2);
  int64_t c0 = cb;
  for (; c0 + kCols <= ce; c0 += kCols) span_rows<16, A0, A1>(sums, T, stride, rn, K, c0, cb, ce);
  int64_t v = (ce - c0) / kL;
  switch (v) { case 0: break; case 2: span_rows<2, A0, A1>(sums,T,stride,rn,K,c0,cb,ce); break; case 4: span_rows<4, A0, A1>(sums,T,stride,rn,K,c0,cb,ce); break;
    case 6: span_rows<6, A0, A1>(sums,T,stride,rn,K,c0,cb,ce); break; case 8: span_rows<8, A0, A1>(sums,T,stride,rn,K,c0,cb,ce); break;
    case 14: span_rows<14, A0, A1>(sums,T,stride,rn,K,c0,cb,ce); break; case 10: span_rows<10, A0, A1>(sums,T,stride,rn,K,c0,cb,ce); break; default: std::abort(); }
}
// S1..: row-major, sums in L1; prefetch row k+A whole unit at locality L1; row k+F at L2 (F=0: none)
template <int A, int F, int LA>
static void rowmajor(float* sums, const bf16* T, int64_t stride, const int64_t* rn, int K, int64_t cb, int64_t ce) {
  const int64_t W = ce - cb;
  if (A) for (int k = 0; k < std::min(K, A); ++k) pf<LA>(T + rn[k] * stride + cb, W * 2);
  if (F) for (int k = A; k < std::min(K, F); ++k) pf<2>(T + rn[k] * stride + cb, W * 2);
  for (int k = 0; k < K; ++k) {
    if (A && k + A < K) pf<LA>(T + rn[k + A] * stride + cb, W * 2);
    if (F && k + F < K) pf<2>(T + rn[k + F] * stride + cb, W * 2);
    const bf16* t = T + rn[k] * stride + cb; __m512 s = _mm512_set1_ps(1.0f);
    int64_t j = 0;
    for (; j + 4 * kL <= W; j += 4 * kL) {
      __m512 a0 = _mm512_fmadd_ps(s, ld(t + j), _mm512_loadu_ps(sums + j));
      __m512 a1 = _mm512_fmadd_ps(s, ld(t + j + 16), _mm512_loadu_ps(sums + j + 16));
      __m512 a2 = _mm512_fmadd_ps(s, ld(t + j + 32), _mm512_loadu_ps(sums + j + 32));
      __m512 a3 = _mm512_fmadd_ps(s, ld(t + j + 48), _mm512_loadu_ps(sums + j + 48));
      _mm512_storeu_ps(sums + j, a0); _mm512_storeu_ps(sums + j + 16, a1); _mm512_storeu_ps(sums + j + 32, a2); _mm512_storeu_ps(sums + j + 48, a3);
    }
    for (; j < W; j += kL) _mm512_storeu_ps(sums + j, _mm512_fmadd_ps(s, ld(t + j), _mm512_loadu_ps(sums + j)));
  }
}
// S: all rows' whole units prefetched into L2 first (one pass of t1), then row-major with t0 4 ahead
static void l2first(float* sums, const bf16* T, int64_t stride, const int64_t* rn, int K, int64_t cb, int64_t ce) {
  const int64_t W = ce - cb;
  for (int k = 0; k < K; ++k) pf<2>(T + rn[k] * stride + cb, W * 2);
  rowmajor<4, 0, 3>(sums, T, stride, rn, K, cb, ce);
}
typedef void (*Fn)(float*, const bf16*, int64_t, const int64_t*, int, int64_t, int64_t);
struct Layer { bf16* t; int64_t D; };
int main(int argc, char** argv) {
  const int K = 96, R = 256, layers = 12, steps = argc > 1 ? atoi(argv[1]) : 200;
  const int64_t widths[3] = {2304, 960, 768};
  std::vector<Layer> L;
  std::mt19937_64 rng(1);
  for (int l = 0; l < layers; ++l) for (int w = 0; w < 3; ++w) {
    int64_t n = int64_t(K) * R * widths[w];
    bf16* p = (bf16*)hmap(n * 2);
    madvise(p, n * 2, MADV_HUGEPAGE);
    for (int64_t i = 0; i < n; ++i) p[i] = 0x3f80 + (i & 7);
    L.push_back({p, widths[w]});
  }
  // a 96 MB buffer streamed between steps, like the LM head
  const int64_t hb = 48ll << 20; bf16* head = (bf16*)hmap(hb * 2); madvise(head, hb * 2, MADV_HUGEPAGE);
  for (int64_t i = 0; i < hb; ++i) head[i] = 1;
  const char* names[] = {"span 4/12", "span 0/12", "span 0/16", "span 0/24", "span 2/16", "span 4/24", "span 0/8", "row A4 F12"};
  Fn fns[] = {s0<4,12>, s0<0,12>, s0<0,16>, s0<0,24>, s0<2,16>, s0<4,24>, s0<0,8>, rowmajor<4, 12, 3>};
  const int S = sizeof(fns) / sizeof(fns[0]);
  std::vector<double> tsum(S * 3, 0); std::vector<int> cnt(S, 0);
  std::vector<int64_t> rows(K);
  float* sums[2]; for (int i = 0; i < 2; ++i) sums[i] = (float*)aligned_alloc(64, 8192 * 4);
  double chk = 0; double headsum = 0;
  for (int st = 0; st < steps; ++st) {
    int f = st % S;
    for (int l = 0; l < layers; ++l) for (int w = 0; w < 3; ++w) {
      const Layer& ly = L[l * 3 + w];
      for (int k = 0; k < K; ++k) rows[k] = getenv("SEQ") ? (int64_t)(rng() % 2) * 0 + k + (st % 2) * 128 : k * R + (rng() % R);
      auto t0 = std::chrono::steady_clock::now();
      #pragma omp parallel num_threads(2)
      {
        int th = omp_get_thread_num();
        int64_t per = (ly.D / 16 + 1) / 2 * 16, cb = th * per, ce = std::min<int64_t>(ly.D, cb + per);
        memset(sums[th], 0, (ce - cb) * 4);
        fns[f](sums[th], ly.t, ly.D, rows.data(), K, cb, ce);
      }
      auto t1 = std::chrono::steady_clock::now();
      if (st >= S) tsum[f * 3 + w] += std::chrono::duration<double, std::micro>(t1 - t0).count();
      chk += sums[0][0] + sums[1][0];
    }
    if (st >= S) cnt[f]++;
    // stream the "head"
    __m512 a = _mm512_setzero_ps();
    #pragma omp parallel for num_threads(2) reduction(+:headsum)
    for (int64_t i = 0; i < hb; i += 32 * 16) { __m512 x = _mm512_setzero_ps(); for (int j = 0; j < 32; ++j) x = _mm512_add_ps(x, ld(head + i + j * 16)); headsum += _mm512_reduce_add_ps(x); }
  }
  printf("chk %g %g\n", chk, headsum); { FILE*f=fopen("/proc/self/smaps_rollup","r"); char l[256]; while(fgets(l,256,f)) if(strstr(l,"AnonHuge")) fputs(l,stdout);}
  for (int f = 0; f < S; ++f) {
    double q = tsum[f * 3] / cnt[f] / layers, a = tsum[f * 3 + 1] / cnt[f] / layers, b = tsum[f * 3 + 2] / cnt[f] / layers;
    double bytes = K * (2304 + 960 + 768) * 2.0;
    printf("%-12s qkv %6.1f us  ffn1 %5.1f  ffn2 %5.1f  layer %6.1f us  %5.1f GB/s\n", names[f], q, a, b, q + a + b, bytes / (q + a + b) / 1e3);
  }
}
