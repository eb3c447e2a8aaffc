// A standalone copy of a decode lookup's gathers (benchmarks/results/2026-11-29-zen4/README.md): K = 128 random rows,
// one per table of R rows, of bf16 tables [K * R, D] on huge pages, `layers` sets of tables read in turn so that the
// rows come from memory, summed into float32 by 2 threads. Two ways alternate call by call: the columns split over the
// threads (each thread a half of every row; BLOCKED=1: in the kernel's row-block order, else span by span with the row
// 4 on prefetched) or the rows (each thread all columns of half the rows, then one sum of the two halves). A stream of
// `stream_mb` MB between passes over the layers stands in for the LM head.
//
//     g++ -O3 -march=native -fopenmp gather_copy.cpp -o gather_copy
//     ./gather_copy 256 3072 24 0      # MF-base's Q/K/V shape; 1280 / 256 and 1024 / 1024: its Memory Block
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
static inline __m512 load_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline void prefetch_span(const uint16_t* p) {
  for (int j = 0; j < 512; j += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + j, _MM_HINT_T0);
}

// rows k0..k1-1, columns [c0, c1) (a multiple of 256) added into acc, span by span, row k + 4 prefetched.
static void span_order(const uint16_t* T, int64_t D, const int64_t* rows, int k0, int k1, int c0, int c1, float* acc) {
  for (int c = c0; c < c1; c += 256) {
    __m512 a[16];
    for (int i = 0; i < 16; ++i) a[i] = _mm512_loadu_ps(acc + c - c0 + 16 * i);
    for (int k = k0; k < k1; ++k) {
      if (k + 4 < k1) prefetch_span(T + rows[k + 4] * D + c);
      const uint16_t* t = T + rows[k] * D + c;
      for (int i = 0; i < 16; ++i) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(0.5f), load_bf16(t + 16 * i), a[i]);
    }
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(acc + c - c0 + 16 * i, a[i]);
  }
}

// The kernel's row-block order (add_rows_blocked): 8 rows at a time, each row's spans in turn, 4 spans on prefetched.
static void block_order(const uint16_t* T, int64_t D, const int64_t* rows, int K, int cb, int ce, float* sums) {
  const int S = (ce - cb) / 256, BR = 8, BA = 4;
  auto fetch = [&](int r, int at) { if (r < K) prefetch_span(T + rows[r] * D + at); };
  for (int k = 0; k < std::min(K, BR); ++k)
    for (int a = 0; a < BA; ++a) fetch(k + a / S * BR, cb + a % S * 256);
  for (int kb = 0; kb < K; kb += BR) {
    const int ke = std::min(K, kb + BR);
    for (int c0 = cb; c0 < ce; c0 += 256) {
      __m512 a[16];
      for (int i = 0; i < 16; ++i) a[i] = _mm512_loadu_ps(sums + (c0 - cb) + 16 * i);
      const int ahead = (c0 - cb) / 256 + BA, down = ahead / S * BR, at = cb + ahead % S * 256;
      for (int k = kb; k < ke; ++k) {
        fetch(k + down, at);
        const uint16_t* t = T + rows[k] * D + c0;
        for (int i = 0; i < 16; ++i) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(0.5f), load_bf16(t + 16 * i), a[i]);
      }
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(sums + (c0 - cb) + 16 * i, a[i]);
    }
  }
}

int main(int argc, char** argv) {
  if (argc < 5) { fprintf(stderr, "usage: %s rows_per_table columns layers stream_mb\n", argv[0]); return 1; }
  const bool blocked = getenv("BLOCKED") != nullptr;
  const int64_t K = 128, R = atoi(argv[1]), D = atoi(argv[2]), L = atoi(argv[3]);
  const int64_t per = K * R * D, stream = int64_t(atoi(argv[4])) << 20;
  const size_t bytes = per * L * 2, huge = size_t(1) << 21;
  uint16_t* T = static_cast<uint16_t*>(aligned_alloc(huge, (bytes + huge - 1) / huge * huge));
  madvise(T, bytes, MADV_HUGEPAGE);
  memset(T, 1, bytes);
  std::vector<uint16_t> buffer(stream / 2 + 1, 1);
  std::vector<int64_t> rows(K);
  std::vector<float> acc0(D), acc1(D), part(D);
  volatile float sink = 0;
  double seconds[2] = {0, 0};
  unsigned seed = 1;
  const int calls = 4000, warm = 200;
  for (int it = 0; it < calls; ++it) {
    if (stream && it % L == 0) {
      float total = 0;
#pragma omp parallel for num_threads(2) reduction(+ : total)
      for (int64_t i = 0; i < stream / 2; i += 32) total += buffer[i];
      sink = sink + total;
    }
    const uint16_t* TL = T + (it % L) * per;
    for (int k = 0; k < K; ++k) { seed = seed * 1103515245 + 12345; rows[k] = k * R + (seed >> 8) % R; }
    for (int turn = 0; turn < 2; ++turn) {
      const int way = (it & 1) ? 1 - turn : turn;   // which goes first alternates
      const double start = now();
      if (way == 0) {
#pragma omp parallel num_threads(2)
        {
          const int tid = omp_get_thread_num(), half = (D / 256 + 1) / 2 * 256;
          const int c0 = tid ? half : 0, c1 = tid ? D : half;
          std::fill(acc0.begin() + c0, acc0.begin() + c1, 0.f);
          if (blocked) block_order(TL, D, rows.data(), K, c0, c1, acc0.data() + c0);
          else span_order(TL, D, rows.data(), 0, K, c0, c1, acc0.data() + c0);
        }
      } else {
#pragma omp parallel num_threads(2)
        {
          const int tid = omp_get_thread_num();
          float* a = tid ? part.data() : acc1.data();
          std::fill(a, a + D, 0.f);
          span_order(TL, D, rows.data(), tid ? K / 2 : 0, tid ? K : K / 2, 0, D, a);
#pragma omp barrier
          if (tid == 0) for (int j = 0; j < D; ++j) acc1[j] += part[j];
        }
      }
      if (it >= warm) seconds[way] += now() - start;
    }
  }
  const double n = calls - warm, row_bytes = double(K * D * 2);
  printf("R=%ld D=%ld: columns split %.1f us (%.1f GB/s), rows split %.1f us (%.1f GB/s)\n", long(R), long(D),
         seconds[0] / n * 1e6, row_bytes / (seconds[0] / n) / 1e9, seconds[1] / n * 1e6,
         row_bytes / (seconds[1] / n) / 1e9);
}
