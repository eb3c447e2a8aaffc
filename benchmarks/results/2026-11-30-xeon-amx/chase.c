#include <stdint.h>
#include <time.h>
static double now(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec + 1e-9 * ts.tv_nsec; }
/* next[i] = index of the next 64-byte line (uint64 index into buf of lines*8 words); follow `steps` loads */
double chase(const uint64_t* buf, int64_t start, int64_t steps, uint64_t* out) {
  double t0 = now();
  uint64_t i = (uint64_t)start;
  for (int64_t s = 0; s < steps; ++s) i = buf[i * 8];
  *out = i;
  return (now() - t0) / (double)steps;
}
