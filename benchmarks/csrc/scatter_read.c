/* The machine's rate for scattered reads: what a decode step's table rows cost when they come from DRAM.

   scatter_read(bases, starts, threads, count, span, ahead, far, checksums) -> seconds
   Thread t reads `count` spans of `span` bytes (a multiple of 8), span i at bases[starts[(t * count + i) * 2]] +
   starts[(t * count + i) * 2 + 1] (an 8-byte aligned offset), in order, each span's 64-byte lines prefetched `ahead`
   spans before it is read (L1 hint; 0: none) and `far` spans before (L2 hint; 0: none), as the lookup kernel keeps
   reads in flight; checksums[t] = the XOR of every 8-byte word thread t read (so the reads happen, and a test can check
   them). Returns the wall seconds of the parallel region.

   chase_read(bases, starts, count, zero, checksum) -> seconds
   One thread reads the 8-byte word at each of `count` starts in turn (bases[starts[2 i]] + starts[2 i + 1]), the
   address of each read made to depend on the word the read before it returned (+ (word & zero), `zero` 0 at run
   time, which the compiler cannot know): no read can start before the one before it has returned, so the seconds per
   read are the machine's latency at those addresses, address translation included. *checksum = the XOR of the words.

   flush_lines(base, nbytes, threads) -> seconds
   Writes back and evicts every 64-byte line of [base, base + nbytes) from every level of the caches (x86 `clflush`,
   aarch64 `dc civac`, then a full fence), so that a read timed next comes from DRAM: a buffer smaller than a large
   shared L3 (a cloud guest can be shown hundreds of MB) otherwise reads partly from it when read back to back.
   Returns -1 on other architectures.

   Plain C and OpenMP, no intrinsics but the flush's: the compiler's own vectors for the running CPU (-O3
   -march=native, -mcpu=native on aarch64). */
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <omp.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline void prefetch_span(const char* p, int64_t span, int far) {
  for (int64_t o = 0; o < span; o += 64) {
    if (far) __builtin_prefetch(p + o, 0, 2);
    else __builtin_prefetch(p + o, 0, 3);
  }
}

double scatter_read(const char* const* bases, const int64_t* starts, int64_t threads, int64_t count, int64_t span,
                    int64_t ahead, int64_t far, uint64_t* checksums) {
  const double t0 = now();
#pragma omp parallel for num_threads((int)threads) schedule(static, 1)
  for (int64_t t = 0; t < threads; ++t) {
    const int64_t* s = starts + 2 * t * count;
    uint64_t acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = 0; i < count; ++i) {
      if (ahead > 0 && i + ahead < count) prefetch_span(bases[s[2 * (i + ahead)]] + s[2 * (i + ahead) + 1], span, 0);
      if (far > 0 && i + far < count) prefetch_span(bases[s[2 * (i + far)]] + s[2 * (i + far) + 1], span, 1);
      const char* p = bases[s[2 * i]] + s[2 * i + 1];
      int64_t o = 0;
      for (; o + 64 <= span; o += 64) {
        uint64_t w[8];
        memcpy(w, p + o, 64);
        for (int j = 0; j < 8; ++j) acc[j] ^= w[j];
      }
      for (; o < span; o += 8) {
        uint64_t w;
        memcpy(&w, p + o, 8);
        acc[0] ^= w;
      }
    }
    checksums[t] = acc[0] ^ acc[1] ^ acc[2] ^ acc[3] ^ acc[4] ^ acc[5] ^ acc[6] ^ acc[7];
  }
  return now() - t0;
}

double chase_read(const char* const* bases, const int64_t* starts, int64_t count, uint64_t zero, uint64_t* checksum) {
  const double t0 = now();
  uint64_t word = 0, acc = 0;
  for (int64_t i = 0; i < count; ++i) {
    memcpy(&word, bases[starts[2 * i]] + starts[2 * i + 1] + (word & zero), 8);
    acc ^= word;
  }
  *checksum = acc;
  return now() - t0;
}

double flush_lines(const char* base, int64_t nbytes, int64_t threads) {
#if defined(__x86_64__) || defined(__i386__) || defined(__aarch64__)
  const double t0 = now();
  const char* first = (const char*)((uintptr_t)base & ~(uintptr_t)63); /* the line holding the first byte */
  const uintptr_t last = (uintptr_t)base + (uintptr_t)nbytes - 1; /* the last byte */
  const int64_t lines = nbytes > 0 ? (int64_t)((last - (uintptr_t)first) / 64 + 1) : 0;
#pragma omp parallel num_threads((int)threads)
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < lines; ++i) {
#if defined(__aarch64__)
      __asm__ volatile("dc civac, %0" : : "r"(first + 64 * i) : "memory");
#else
      _mm_clflush(first + 64 * i);
#endif
    }
    /* each thread waits for its own flushes (a fence orders only the flushes of the core that runs it) */
#if defined(__aarch64__)
    __asm__ volatile("dsb ish" : : : "memory");
#else
    _mm_mfence();
#endif
  }
  return now() - t0;
#else
  (void)base;
  (void)nbytes;
  (void)threads;
  return -1.0;
#endif
}
