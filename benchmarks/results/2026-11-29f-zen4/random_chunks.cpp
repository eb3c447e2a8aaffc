#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#include <random>
// Random chunks of C lines from a 2 GB huge-page buffer; per thread M chunks; read by plain loads summed (independent),
// measure GB/s. Variants: plain loads only; with prefetcht0 P chunks ahead; with prefetcht1 P ahead.
int main(int argc,char**argv){
  const int64_t n = 2ll<<30; char* p=(char*)mmap(0,n,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0); madvise(p,n,MADV_HUGEPAGE);
  for(int64_t i=0;i<n;i+=4096) p[i]=1;
  std::mt19937_64 rng(2);
  for (int C : {1, 2, 4, 8, 16, 36}) for (int threads : {1, 2}) for (int mode : {0, 1, 2, 3}) {
    const int M = 200000 / C; std::vector<int64_t> off(M * 2);
    double best = 0;
    for (int rep = 0; rep < 3; ++rep) {
      for (auto& o : off) o = (rng() % (n / 4096 - 1)) * 4096 + (rng() % (4096 / 64 / 1)) * 0;
      auto t0 = std::chrono::steady_clock::now(); float tot = 0;
      #pragma omp parallel num_threads(threads) reduction(+:tot)
      { int th = omp_get_thread_num(); const int64_t* o = off.data() + th * M; __m512 acc = _mm512_setzero_ps();
        const int P = 16 / C + 2;
        for (int m = 0; m < M; ++m) {
          if (mode == 1 && m + P < M) for (int c = 0; c < C; ++c) _mm_prefetch(p + o[m + P] + c * 64, _MM_HINT_T0);
          if (mode == 2 && m + 3 * P < M) for (int c = 0; c < C; ++c) _mm_prefetch(p + o[m + 3 * P] + c * 64, _MM_HINT_T1);
          if (mode == 3) { if (m + P < M) for (int c = 0; c < C; ++c) _mm_prefetch(p + o[m + P] + c * 64, _MM_HINT_T0);
                           if (m + 3 * P < M) for (int c = 0; c < C; ++c) _mm_prefetch(p + o[m + 3 * P] + c * 64, _MM_HINT_T1); }
          for (int c = 0; c < C; ++c) acc = _mm512_add_ps(acc, _mm512_loadu_ps((float*)(p + o[m] + c * 64)));
        }
        tot += _mm512_reduce_add_ps(acc); }
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      double gb = double(M) * threads * C * 64 / s / 1e9; if (gb > best) best = gb;
    }
    printf("chunk %2d lines threads %d mode %d: %5.1f GB/s\n", C, threads, mode, best);
  }
}
