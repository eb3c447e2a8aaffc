"""C++ source of the fused CPU Memory Layer kernels: GENERATED from csrc/cpu/, do not edit.

Edit the parts in modeling_memoryformer/csrc/cpu/ (their order: csrc/cpu/parts.txt), then run
`python scripts/generate_kernel_source.py`.
The source travels as a string so that `save_pretrained` copies it with the model files and remote-code loading
(`trust_remote_code=True`) can build the kernel too; `memory_ops.load_fused_kernels` compiles it at first use.
It is the parts joined in order, each preceded by a #line directive, so compiler errors name the part and its line.
"""

CPP_SOURCE = r"""#line 1 "modeling_memoryformer/csrc/cpu/prelude.h"
// Fused CPU kernels of the MemoryFormer Memory Layer, a PyTorch extension.
//
// Layout: one translation unit, split by concern into the parts of csrc/cpu/ and compiled as their concatenation in
// the order of csrc/cpu/parts.txt. The parts are fragments, not headers: each uses what the parts before it define.
// This prelude holds the includes, the vector layer, the opening of the anonymous namespace, the constants and the
// argument checks that the others share; registration.cpp closes the namespace and registers the ops.
// scripts/generate_kernel_source.py joins them into memory_kernel_source.py, each part preceded by
// `#line 1 "modeling_memoryformer/csrc/cpu/<part>"`, so compiler errors name the part and its line. The measurements
// behind the design choices are in docs/kernel.md.
//
// CPU kernels of the ops that memory_op_library.py defines (schemas, fakes, autograd and the PyTorch reference
// kernels live there, in Python); these parts only register implementations for them (namespace MEMORYFORMER_OPS,
// default `memoryformer`), all on contiguous CPU tensors:
// - hash(x[N, K*tau], tau, score, t) -> (rows int64 [N, K], scores [N, K]); score by name, "paper" or "l1"
//       (another name is refused)
//       rows = k * 2**tau + h(z_k); scores = p(z_k) (paper) or ||z_k||_1 * p(z_k) (l1), in float32 (float64 for
//       float64 x). p = 1 / prod_i (1 + exp(-2|z_i|/t)) is computed as a product: each factor lies in (1, 2], so the
//       product of at most 16 factors cannot overflow and no logarithm is needed.
// - lookup(rows, scores, tables[R, D], bias?) -> y[N, D] = sum_k scores[:, k] * tables[rows[:, k]] + bias,
//       accumulated in float32 (float64 for float64 tables), returned in the tables' dtype.
// - lookup_strategy(..., strategy) -> the same function by one named strategy ("auto" is what lookup runs; "token",
//       "embedding_bag", "packed", "bucketed" force one; tests use them to check every branch).
// - lookup_backward(grad_y, rows, scores, tables, need_tables, need_scores) -> (grad_scores, grad_tables)
//       grad_scores[n, k] = <grad_y[n], tables[rows[n, k]]>; grad_tables[r] = sum_{(n,k): rows[n,k]=r} scores * grad_y[n]
// - lookup_backward_rows(grad_y, rows, scores, tables, need_scores) -> (grad_scores, rows_hit [U], values [U, D]):
//       the table gradient as the U distinct rows hit only, ascending (see "rows-hit backward").
// - hash_backward(grad_scores, x, tau, score, t) -> grad_x through the score derivative (codes are piecewise constant).
// - int8_lookup(rows, scores, packed, bias?, rows_per_table) -> y[N, D] float32: lookup on int8
//       tables in FBGEMM's row-wise layout (packed uint8 [R, D + 8]: codes, float32 scale, float32 offset per row),
//       y = sum_k scores * (q * scale + offset) + bias, dequantised in registers, summed in float32 (see "int8 tables").
// - linear_rows(x[M, D], weight[V, D], bias?) -> y[M, V] for 1 <= M <= 4 rows (the LM head while decoding).
// - decode_attention(q[B, H, 1, D], k[B, Hkv, T, D], v, mask?, scaling) -> [B, 1, H, D]: attention of one query
//       position per sequence over its KV cache, in float32 (see attention.h).
// - decode_qkv(x[N, d], input norm, Q/K/V tables, ..., cos, sin, heads) -> [N, 3d] and decode_block(x, attn, post-
//       attention norm, Memory Block tables and norm, ...) -> [N, d]: a decoder layer's decode step before and after
//       its KV cache update and attention, the modules' ops in their order (see decode_layer.h).
// - decode_stack(x, keys[], values[], mask?, cos, sin, heads, scaling, operands...) -> (out, keys[], values[]): every
//       decoder layer of a decode step in one call (decode_qkv, the cache's growth, decode_attention, decode_block).
// - decode_stack_static(x, keys[], values[], lengths[], mask?, cos, sin, heads, scaling, operands...) -> out: the same
//       over a static cache's buffers, written in place at each layer's length (see static_stack.h).
// - decode_session_open(embed, keys[], values[], cos, sin, heads, scaling, operands..., final norm, LM head?) -> id;
//   decode_session_step(id, ids[N, 1], position, cos?, sin?) -> (out, tokens); decode_session_close(id) -> (keys[],
//       values[]): generate's decode steps from their tokens, the embedding, the final norm and the LM head's pass
//       with decode_stack in one call, over operands and a KV cache held between the steps (see decode_tokens.h).
// - release_gradient_pool() -> bytes freed (see "Gradient memory").
// - rowwise_adagrad_step / adam_rowwise_step(weight, grad, states..., hyperparameters) -> (): one update of a
//       table by the row-wise rules of the table optimizers, in place (see "table optimizers").
// - isa() -> the vector layer compiled in ("AVX512", "AVX2", "NEON", "DEFAULT");
//   machine_info() -> [L1d, L2, L3 bytes, threads, vector bytes] as the strategy choice sees them;
//   set_cache_sizes(l1, l2, l3) overrides the detected caches (0, 0, 0: detect again);
//   linear_rows_balance(slot, us) -> the pieces linear_rows's last pass took from another thread's share; slot >= 0
//   makes that thread start us microseconds late in later passes (tests; -1: off, see linear_rows.h);
//   linear_rows_prefetch(setting) -> the row pass's prefetch trial: its state, or a fixed choice (linear_rows.h);
//   plan(N, K, P, D, dtype, backward) -> the strategy "auto" picks for that shape here;
//   lookup_strategies() -> the names lookup_strategy takes besides "auto" (kStrategies, their one list).
//
// Portability: every strategy is written once. Vector code uses ATen's at::vec::Vectorized<float> (AVX-512, AVX2,
// NEON, or a plain array the compiler vectorises), the rest plain loops under `#pragma omp simd`. Register blocking
// follows the target's vector width and register count; block sizes, chunk lengths and the size thresholds between
// strategies follow the running machine's caches (sysconf, then sysfs, then a fallback) and the thread count.
// The only intrinsics left are the non-temporal store and its fence (SSE2 / AVX / AVX-512 forms of one plain store).
//
// Design: the row gather is bounded by cache/TLB misses on tables far larger than L2, not by FLOPs. Forward: up to 64
// tokens, a token-major kernel that sums each token's K row spans in registers while prefetching the rows 16 lookups
// ahead. Beyond that, for float32, bfloat16 and float16 tables with >= 2 lookups per row, the packed pass: per
// 32-column block and group of tables, the group's rows are first copied into a contiguous buffer of a quarter of L2 (a
// pure stream from L3 / DRAM; 16-bit rows stay 16-bit there, and span two blocks where the registers allow, see
// packed_span), then every token of the chunk adds its lookups of the group from it, several tokens at a time in
// registers, widening 16-bit values to float32 as they are loaded (bfloat16 by their bit pattern; the table is read
// once per chunk of tokens instead of once per lookup). For widths that are not whole 32-column blocks and tables
// beyond 3/2 of the LLC with >= 2 lookups per row, the bucketed pass: lookups are grouped by row (a counting sort per
// table), the output is built in 64-column blocks of a chunk of tokens held in a compact buffer of half of L2, and the
// table is streamed once, each hit row loaded once and applied to all its tokens. Otherwise PyTorch's embedding_bag
// (FBGEMM's JIT kernel), called below autograd. Packed and bucketed need as many column blocks as threads.
// Backward: always bucketed, in one pass over the table rows per column block: the block of grad_y sits in L2, each
// row's table gradient is accumulated in registers and written once by one thread (no atomics, no read-modify-write
// of the large gradient; rows nobody hit are written as zeros), and the score gradients are the inner products of the
// same row with the same grad_y spans, summed over the column blocks.
// Gradient memory: table gradients come from a pool of huge-page-advised blocks that are reused once their tensor is
// freed, because first-touch page faults on a fresh tens-of-MB gradient cost more than the kernel that fills it.

// The vector layer: at::vec picks its implementation from these macros, which PyTorch's own build sets per
// compilation unit. They follow the compiler's target here (-march), so one source serves every CPU.
// CPU_CAPABILITY itself stays undefined: our instantiations live in a namespace of their own, apart from libtorch's.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512
#define MEMORYFORMER_ISA "AVX512"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CPU_CAPABILITY_AVX2
#define MEMORYFORMER_ISA "AVX2"
#elif defined(__aarch64__)
#define MEMORYFORMER_ISA "NEON"
#else
#define MEMORYFORMER_ISA "DEFAULT"
#endif

#ifndef MEMORYFORMER_OPS
#define MEMORYFORMER_OPS memoryformer   // the op namespace; test builds for other targets set their own
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/native_layer_norm_native.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <sys/mman.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = fVec::size();   // floats per vector register of the target
// A vector of sums as a plain vector type of fVec's size (GCC's and Clang's vector extension), for arrays of sums
// that must stay in registers: GCC keeps an array of fVec (a class) in memory where its loops are not unrolled before
// its scalar replacement runs, and did so for all but one of the few-row linear's sums (a store and a reload per
// multiply-add, with GCC 12 for Zen 1 and Zen 3 alike); an array of RawVec it keeps in registers. Same values: the
// conversions are copies of the bits.
typedef float RawVec __attribute__((vector_size(sizeof(fVec))));
inline RawVec raw_vec(const fVec& v) { RawVec r; std::memcpy(&r, &v, sizeof(r)); return r; }
inline fVec from_raw(const RawVec& r) { fVec v; std::memcpy(&v, &r, sizeof(v)); return v; }
#if defined(CPU_CAPABILITY_AVX512) || defined(__aarch64__)
constexpr int kVecRegs = 32;   // architectural vector registers
#else
constexpr int kVecRegs = 16;
#endif

// Output columns accumulated per pass over a token's rows: half the vector registers (256 with AVX-512, 64 with
// AVX2 and NEON); a wider span spills the sums to memory (docs/kernel.md).
constexpr int64_t kCols = kVecRegs / 2 * kLanes;
constexpr int64_t kAhead = 16;             // table rows prefetched this many lookups ahead
constexpr int64_t kSerialWork = 1 << 18;   // below this many multiply-adds, one thread
constexpr int64_t kSmallBatch = 64;        // up to this many tokens the forward uses our own gather kernel
constexpr int64_t kBucketedHits = 2;       // lookups per row from which the bucketed forward can pay off: from 2,
                                           // one sequential pass over a table beyond the LLC costs less than the
                                           // random row reads; at 1 hit per row the gather wins (docs/kernel.md)
constexpr int64_t kPackedHits = 2;         // lookups per row from which the packed forward can pay off: from 2 it
                                           // beats embedding_bag, at 1 per row it loses (docs/kernel.md)
constexpr int64_t kBlock = 64;             // columns per block of the bucketed passes
constexpr int64_t kPackCols = 32;          // columns per block of the packed pass

template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

template <typename T> inline typename Acc<T>::type to_acc(T v) { return static_cast<typename Acc<T>::type>(v); }

// ------------------------------------------------------------------------------------------------ argument checks
// Every op checks every argument before a kernel runs: the kernels index memory with them unchecked.
void check_cpu_contiguous(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.defined(), "memoryformer.", op, ": ", name, " is undefined");
  TORCH_CHECK(t.device().is_cpu(), "memoryformer.", op, ": ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), "memoryformer.", op, ": ", name, " must be contiguous (call .contiguous())");
}

void check_floating(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "memoryformer.", op, ": ", name, " must be a CPU tensor, got ", t.device());
  const auto s = t.scalar_type();
  TORCH_CHECK(s == at::kFloat || s == at::kDouble || s == at::kBFloat16 || s == at::kHalf, "memoryformer.", op,
              ": ", name, " must be float32, float64, bfloat16 or float16, got ", s);
}

at::ScalarType acc_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }
#line 1 "modeling_memoryformer/csrc/cpu/tuning.h"
// The machine: cache sizes and the block sizes, chunk lengths and thresholds derived from them.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ the machine
// Cache sizes: the kernel's sysfs view, else sysconf, else a conservative fallback. sysfs comes first because glibc's
// sysconf can be far off in a VM (a 2-core AMD EPYC guest: L3 320 MB from sysconf, 32 MB in sysfs and lscpu).
// L2 is per core; L3 is the last-level cache as reported (0 where there is none: L2 then plays its part).
struct Caches { int64_t l1, l2, l3; };

int64_t parse_size(const std::string& s) {   // sysfs writes "48K", "2048K", "32M"
  if (s.empty()) return 0;
  int64_t v = std::atoll(s.c_str());
  const char unit = s.back() == '\n' && s.size() > 1 ? s[s.size() - 2] : s.back();
  if (unit == 'K') v <<= 10;
  else if (unit == 'M') v <<= 20;
  else if (unit == 'G') v <<= 30;
  return v;
}

int64_t sysfs_cache(int level) {
  for (int i = 0; i < 16; ++i) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    std::ifstream lv(dir + "level"), ty(dir + "type"), sz(dir + "size");
    if (!lv) break;
    int l = 0;
    std::string type, size;
    lv >> l;
    ty >> type;
    sz >> size;
    if (l == level && type != "Instruction") return parse_size(size);
  }
  return 0;
}

int64_t cache_size(int level) {
  const int64_t from_sysfs = sysfs_cache(level);
  if (from_sysfs > 0) return from_sysfs;
  long v = 0;
#if defined(_SC_LEVEL1_DCACHE_SIZE) && defined(_SC_LEVEL2_CACHE_SIZE) && defined(_SC_LEVEL3_CACHE_SIZE)
  v = sysconf(level == 1 ? _SC_LEVEL1_DCACHE_SIZE : level == 2 ? _SC_LEVEL2_CACHE_SIZE : _SC_LEVEL3_CACHE_SIZE);
#endif
  return v > 0 ? int64_t(v) : 0;
}

Caches detect_caches() {
  Caches c{cache_size(1), cache_size(2), cache_size(3)};
  if (c.l1 <= 0) c.l1 = 32 << 10;
  if (c.l2 <= 0) c.l2 = 256 << 10;   // fallback: the smallest L2 of current server cores
  if (c.l3 < 0) c.l3 = 0;
  return c;
}

std::atomic<int64_t> override_l1{0}, override_l2{0}, override_l3{-1};   // set_cache_sizes; l3 -1: not overridden

Caches caches() {
  static const Caches detected = detect_caches();
  Caches c = detected;
  if (override_l1.load() > 0) c.l1 = override_l1.load();
  if (override_l2.load() > 0) c.l2 = override_l2.load();
  if (override_l3.load() >= 0) c.l3 = override_l3.load();
  return c;
}

// The sizes the strategies use, derived from the caches (the ratios were measured on a 1 MB-L2, 32 MB-L3 machine,
// where they give a 256 KB packed group, 4096-token packed chunks and 2048-token bucketed chunks).
struct Tuning {
  int64_t llc;             // last-level cache: L3, or L2 without one
  int64_t bucketed_min;    // bucketed forward (tables other than float32) from this size: 3/2 of the LLC
  int64_t pack_group;      // bytes of one packed group (a quarter of L2: the group and the accumulator fit)
  int64_t pack_chunk;      // tokens per packed pass (their accumulator of kPackCols columns is half of L2)
  int64_t bucket_bytes;    // bytes of a bucketed chunk's compact column block (half of L2)
};

Tuning tuning() {
  const Caches c = caches();
  Tuning t;
  t.llc = c.l3 > 0 ? c.l3 : c.l2;
  t.bucketed_min = t.llc / 2 * 3;
  t.pack_group = std::max<int64_t>(16 << 10, c.l2 / 4);
  t.pack_chunk = std::max<int64_t>(256, c.l2 / 2 / (kPackCols * int64_t(sizeof(float))));
  t.bucket_bytes = std::max<int64_t>(64 << 10, c.l2 / 2);
  return t;
}

// Tokens whose compact [chunk, kBlock] block in the accumulation type fills `bytes` (256 to 2^20).
template <typename A> int64_t chunk_tokens(int64_t bytes) {
  return std::min<int64_t>(1 << 20, std::max<int64_t>(256, bytes / (kBlock * int64_t(sizeof(A)))));
}

// Tokens per chunk of the bucketed forward: the compact block fills bucket_bytes (half of L2).
template <typename A> int64_t bucket_chunk(const Tuning& t) { return chunk_tokens<A>(t.bucket_bytes); }

// Tokens per chunk of the backward: a compact block of up to a quarter of the LLC's share per thread (4 MB each for 2
// threads and a 32 MB L3), at least bucket_bytes. Every chunk beyond the first streams the table again and reads
// back and rewrites the whole table gradient (three table-sized passes, from DRAM for MemoryFormer's tables), which
// costs far more than gathering from a block that spills from L2 to L3 (docs/kernel.md).
template <typename A> int64_t backward_chunk(const Tuning& t, int threads) {
  return chunk_tokens<A>(std::max<int64_t>(t.bucket_bytes, t.llc / 4 / std::max(1, threads)));
}
#line 1 "modeling_memoryformer/csrc/cpu/scratch.h"
// Scratch memory: per-thread work buffers kept between calls.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ scratch memory
// Scratch memory that outlives a call: one set of buffers per thread (the caller's and the pool's workers), grown
// to the largest request and then reused. A fresh multi-hundred-KB buffer per call costs first-touch page faults
// (the allocator hands freed blocks of that size back to the OS), and zeroing a std::vector costs a pass over it.
// Slots name independent buffers of one thread; the contents are undefined on return.
constexpr int kScratchSlots = 5;   // 0-3: the calling thread's, 4: a worker's (the caller is one of the workers)
constexpr int kWorkerSlot = 4;
struct ScratchBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  ~ScratchBuffer() { std::free(ptr); }
};

void* scratch_bytes(int slot, size_t bytes) {
  thread_local ScratchBuffer buffers[kScratchSlots];
  ScratchBuffer& b = buffers[slot];
  const size_t want = (std::max<size_t>(1, bytes) + 63) / 64 * 64;
  if (b.bytes < want) {
    std::free(b.ptr);
    b.ptr = std::aligned_alloc(64, want);
    b.bytes = b.ptr ? want : 0;
    TORCH_CHECK(b.ptr, "memoryformer: out of memory for ", want, " bytes of scratch");
  }
  return b.ptr;
}

template <typename T> T* scratch(int slot, int64_t count) {
  return static_cast<T*>(scratch_bytes(slot, size_t(std::max<int64_t>(0, count)) * sizeof(T)));
}
#line 1 "modeling_memoryformer/csrc/cpu/spans.h"
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
#line 1 "modeling_memoryformer/csrc/cpu/pool.h"
// Gradient memory: the pool of huge-page blocks that table gradients come from.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ gradient memory
// A table gradient is as large as the tables (tens of MB per layer) and freshly allocated by every backward; the
// first-touch page faults on that memory cost more than the kernel that fills it. Gradients are therefore taken from
// a pool of 2 MB-aligned blocks advised for transparent huge pages: a block returns to the pool when its tensor is
// freed (optimizer.zero_grad(set_to_none=True)), and the next backward reuses it with its pages already mapped.
// The tensor is an ordinary one to its users (autograd steals it into .grad as usual). `release_gradient_pool`
// frees the idle blocks; MEMORYFORMER_GRAD_POOL_MB caps the pool (default 16384, 0 disables it).
// The input gradient of the hash backward ([N, d_in], a few MB, freed as soon as the layer below has used it) comes
// from the same pool as a *transient* block: glibc hands such blocks back to the OS when they are freed (its heap is
// trimmed above 2x the mmap threshold), so every backward paid first-touch faults on them again (docs/kernel.md). Its
// sizes follow the batch shape, so at most kIdleTransient idle transient blocks are kept (the least recently freed
// goes first) and a workload of changing shapes cannot pile them up.

// A fresh multi-MB gradient is new memory from the OS: first-touch faults on 4 KB pages cost more than the kernel
// that fills it. Ask for transparent huge pages on the untouched range (honoured when THP is in `madvise` mode).
void advise_huge_pages(void* p, size_t bytes) {
#ifdef MADV_HUGEPAGE
  const uintptr_t huge = uintptr_t(2) << 20;
  const uintptr_t a = (reinterpret_cast<uintptr_t>(p) + huge - 1) & ~(huge - 1);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(huge - 1);
  if (e > a) madvise(reinterpret_cast<void*>(a), e - a, MADV_HUGEPAGE);
#endif
}

struct PoolBlock { size_t bytes; void* ptr; bool used; bool transient; uint64_t freed_at; };
std::mutex pool_mutex;
std::vector<PoolBlock> pool_blocks;
uint64_t pool_clock = 0;
constexpr int kIdleTransient = 8;

size_t pool_cap_bytes() {
  static const size_t cap = [] {
    const char* v = std::getenv("MEMORYFORMER_GRAD_POOL_MB");
    return size_t(v ? std::max(0LL, std::atoll(v)) : 16384LL) << 20;
  }();
  return cap;
}

void return_to_pool(void* ptr) {
  std::lock_guard<std::mutex> lock(pool_mutex);
  bool transient = false;
  for (auto& blk : pool_blocks)
    if (blk.ptr == ptr) { blk.used = false; blk.freed_at = ++pool_clock; transient = blk.transient; break; }
  if (!transient) return;
  for (;;) {   // keep the kIdleTransient most recently freed idle transient blocks
    int idle = 0;
    size_t oldest = pool_blocks.size();
    for (size_t i = 0; i < pool_blocks.size(); ++i) {
      const PoolBlock& blk = pool_blocks[i];
      if (!blk.transient || blk.used) continue;
      ++idle;
      if (oldest == pool_blocks.size() || blk.freed_at < pool_blocks[oldest].freed_at) oldest = i;
    }
    if (idle <= kIdleTransient) return;
    std::free(pool_blocks[oldest].ptr);
    pool_blocks.erase(pool_blocks.begin() + int64_t(oldest));
  }
}

// An uninitialised tensor of `sizes` from the pool. `pow2`: the block is a power-of-two number of 2 MB pages, so that
// tensors whose size changes from call to call (the rows-hit gradient) reuse blocks, at most twice their size.
at::Tensor pooled_empty(at::IntArrayRef sizes, const at::TensorOptions& options, bool transient, bool pow2 = false) {
  const size_t huge = size_t(2) << 20;
  size_t bytes = size_t(c10::elementSize(c10::typeMetaToScalarType(options.dtype())));
  for (const int64_t n : sizes) bytes *= size_t(n);
  bytes = (bytes + huge - 1) / huge * huge;
  if (pow2)
    while (bytes & (bytes - 1)) bytes += bytes & (~bytes + 1);   // round the page count up to a power of two
  void* ptr = nullptr;
  {
    std::lock_guard<std::mutex> lock(pool_mutex);
    size_t held = 0;
    for (auto& blk : pool_blocks) {
      held += blk.bytes;
      if (!ptr && !blk.used && blk.bytes == bytes && blk.transient == transient) { blk.used = true; ptr = blk.ptr; }
    }
    if (!ptr && held + bytes <= pool_cap_bytes() && bytes > 0) {
      ptr = std::aligned_alloc(huge, bytes);
      if (ptr) {
        advise_huge_pages(ptr, bytes);
        pool_blocks.push_back({bytes, ptr, true, transient, 0});
      }
    }
  }
  if (!ptr) {  // pool full or disabled: an ordinary allocation
    auto out = at::empty(sizes, options);
    advise_huge_pages(out.data_ptr(), out.nbytes());
    return out;
  }
  return at::from_blob(ptr, sizes, return_to_pool, options);
}

at::Tensor pooled_empty_like(const at::Tensor& t, bool transient = false) {
  return pooled_empty(t.sizes(), t.options(), transient);
}

int64_t release_gradient_pool() {
  std::lock_guard<std::mutex> lock(pool_mutex);
  int64_t freed = 0;
  std::vector<PoolBlock> kept;
  for (auto& blk : pool_blocks) {
    if (blk.used) { kept.push_back(blk); continue; }
    std::free(blk.ptr);
    freed += int64_t(blk.bytes);
  }
  pool_blocks.swap(kept);
  return freed;
}
#line 1 "modeling_memoryformer/csrc/cpu/hash.h"
// Hashing: hash_kernel, hash_backward_kernel and their ops.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ hashing
// exp(x) for x <= 0 in float (Cephes expf: Cody-Waite reduction, degree-6 polynomial, ~1 ulp), branch-free
// so that the compiler vectorises loops that call it.
inline float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float fx = x * 1.44269504088896341f;
  const float n = (fx + 12582912.0f) - 12582912.0f;   // round to nearest
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  const float z = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}
inline double exp_nonpos(double x) { return std::exp(x); }

// Vectorised across the K chunks of a token (lane k reads value i of chunk k, a stride-tau gather), so exp, the
// product, the norm and the code bits of 16 chunks are computed at once. prod = prod_i (1 + e_i), multiplied in
// order i = 0..tau-1 here and in the backward, so both see bit-identical scores; p = 1 / prod and each factor lies
// in (1, 2], so nothing overflows.
template <typename X>
void hash_kernel(const X* x, int64_t* rows, typename Acc<X>::type* scores, int64_t N, int64_t K, int64_t tau,
                 bool l1, double temperature) {
  using A = typename Acc<X>::type;
  const int64_t D = K * tau;
  const A c = static_cast<A>(2.0 / temperature);
  parallel_tokens(N, N * D * 16, [=](int64_t begin, int64_t end) {
    // The thread's buffers, kept between calls (a decode step hashes one row per Memory Layer: four allocations of a
    // few KB per call otherwise). Every value is written before it is read.
    static thread_local std::vector<A> z, prod, norm;
    static thread_local std::vector<int32_t> code;
    if (static_cast<int64_t>(z.size()) < D) z.resize(D);
    if (static_cast<int64_t>(prod.size()) < K) { prod.resize(K); norm.resize(K); code.resize(K); }
    for (int64_t n = begin; n < end; ++n) {
      // Transposed: zt[i * K + k] = value i of chunk k, so that the passes below read contiguous vectors of K values
      // instead of a stride-tau gather per lane. Written row by row (contiguous stores, strided loads), which is
      // faster than column by column (docs/kernel.md).
      A* zt = z.data();
      const X* xn = x + n * D;
      for (int64_t i = 0; i < tau; ++i) {
        A* zi = zt + i * K;
        const X* xi = xn + i;
#pragma omp simd
        for (int64_t k = 0; k < K; ++k) zi[k] = to_acc(xi[k * tau]);
      }
      A* pr = prod.data();
      A* nm = norm.data();
      int32_t* cd = code.data();
      for (int64_t k = 0; k < K; ++k) { pr[k] = A(1); nm[k] = A(0); cd[k] = 0; }
      for (int64_t i = 0; i < tau; ++i) {
        const A* zi = zt + i * K;
#pragma omp simd
        for (int64_t k = 0; k < K; ++k) {
          const A v = zi[k];
          const A a = std::abs(v);
          pr[k] *= A(1) + exp_nonpos(-c * a);
          nm[k] += a;
          cd[k] |= int32_t(v >= A(0)) << i;
        }
      }
      int64_t* rn = rows + n * K;
      A* sn = scores + n * K;
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) {
        rn[k] = (k << tau) + cd[k];
        sn[k] = (l1 ? nm[k] : A(1)) / pr[k];   // p = 1 / prod(1 + exp(-2|z|/t)), prod in [1, 2^tau]
      }
    }
  });
}

template <typename X>
void hash_backward_kernel(const typename Acc<X>::type* gs, const X* x, X* gx, int64_t N, int64_t K, int64_t tau,
                          bool l1, double temperature) {
  using A = typename Acc<X>::type;
  const int64_t D = K * tau;
  const A c = static_cast<A>(2.0 / temperature);
  parallel_tokens(N, N * D * 16, [=](int64_t begin, int64_t end) {
    std::vector<A> z(D), e(D), a(D), b(D), prod(K), norm(K), out(std::is_same<X, A>::value ? 0 : D);
    for (int64_t n = begin; n < end; ++n) {
      load_span(z.data(), x + n * D, D);
      A* pr = prod.data();
      A* nm = norm.data();
      A* ee = e.data();
      const A* zz = z.data();
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) ee[j] = exp_nonpos(-c * std::abs(zz[j]));
      for (int64_t k = 0; k < K; ++k) { pr[k] = A(1); nm[k] = A(0); }
      for (int64_t i = 0; i < tau; ++i) {   // the forward's scores, recomputed in the same order (see hash_kernel)
#pragma omp simd
        for (int64_t k = 0; k < K; ++k) {
          pr[k] *= A(1) + ee[k * tau + i];
          nm[k] += std::abs(zz[k * tau + i]);
        }
      }
      // d score / d z_j = sign(z_j) * (a_k + b_k * e_j / (1 + e_j)) with, for chunk k (p = 1 / prod):
      //   paper: a = 0,        b = (2/t) p          (d p / d z_j = p (2/t) sign(z_j) e_j / (1 + e_j))
      //   l1:    a = p,        b = (2/t) p ||z_k||_1
      // a and b (times the incoming gradient) are spread over their chunk, then one vector pass over all D values.
      const A* g = gs + n * K;
      A* av = a.data();
      A* bv = b.data();
      for (int64_t k = 0; k < K; ++k) {
        const A p = A(1) / pr[k], gk = g[k];
        const A ak = l1 ? gk * p : A(0), bk = gk * c * p * (l1 ? nm[k] : A(1));
        for (int64_t i = 0; i < tau; ++i) { av[k * tau + i] = ak; bv[k * tau + i] = bk; }
      }
      // 16-bit x: the gradient in float32 first, then rounded by vectors (a scalar rounding per value kept the loop
      // from vectorising; docs/kernel.md).
      X* gxn = gx + n * D;
      A* gn = std::is_same<X, A>::value ? reinterpret_cast<A*>(gxn) : out.data();
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) {
        const A v = zz[j];
        const A sg = v > A(0) ? A(1) : (v < A(0) ? A(-1) : A(0));   // d|z|/dz, 0 at 0 as autograd
        gn[j] = sg * (av[j] + bv[j] * (ee[j] / (A(1) + ee[j])));
      }
      if constexpr (!std::is_same<X, A>::value) store_span(gxn, gn, D, false);
    }
  });
}

void check_hash_args(const at::Tensor& x, int64_t tau, double temperature, const char* op) {
  check_cpu_contiguous(x, op, "x");
  check_floating(x, op, "x");
  TORCH_CHECK(x.dim() == 2, "memoryformer.", op, ": x must be 2-D [N, K * hash_bits], got shape ", x.sizes());
  TORCH_CHECK(tau >= 1 && tau <= 16, "memoryformer.", op, ": hash_bits must be in 1 .. 16, got ", tau);
  TORCH_CHECK(x.size(1) % tau == 0, "memoryformer.", op, ": the width of x (", x.size(1),
              ") must be a multiple of hash_bits (", tau, ")");
  TORCH_CHECK(temperature > 0, "memoryformer.", op, ": temperature must be > 0, got ", temperature);
}

// The scores this kernel implements, by name: the op layer passes the config's `hash_score` as it is, so a score
// added in Python only is refused here instead of running as another one.
bool score_is_l1(c10::string_view score, const char* op) {
  TORCH_CHECK(score == "paper" || score == "l1", "memoryformer.", op, ": unknown score '", std::string(score),
              "'; the fused CPU kernel implements 'paper' and 'l1'. A new score needs its formula in hash_kernel and "
              "hash_backward_kernel (csrc/) as well as in the PyTorch kernels (memory_backend_torch.py).");
  return score == "l1";
}

std::tuple<at::Tensor, at::Tensor> hash_op(const at::Tensor& x, int64_t tau, c10::string_view score,
                                           double temperature) {
  check_hash_args(x, tau, temperature, "hash");
  const bool l1 = score_is_l1(score, "hash");
  const int64_t N = x.size(0), K = x.size(1) / tau;
  auto rows = at::empty({N, K}, x.options().dtype(at::kLong));
  auto scores = at::empty({N, K}, x.options().dtype(acc_type(x.scalar_type())));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "memoryformer_hash", [&] {
    hash_kernel<scalar_t>(x.data_ptr<scalar_t>(), rows.data_ptr<int64_t>(),
                          scores.data_ptr<typename Acc<scalar_t>::type>(), N, K, tau, l1, temperature);
  });
  return {rows, scores};
}

at::Tensor hash_backward_op(const at::Tensor& grad_scores, const at::Tensor& x, int64_t tau, c10::string_view score,
                            double temperature) {
  check_hash_args(x, tau, temperature, "hash_backward");
  const bool l1 = score_is_l1(score, "hash_backward");
  const int64_t N = x.size(0), K = x.size(1) / tau;
  TORCH_CHECK(grad_scores.defined(), "memoryformer.hash_backward: grad_scores is undefined");
  check_floating(grad_scores, "hash_backward", "grad_scores");
  TORCH_CHECK(grad_scores.dim() == 2 && grad_scores.size(0) == N && grad_scores.size(1) == K,
              "memoryformer.hash_backward: grad_scores must be [N, K] = [", N, ", ", K, "] for x of shape ",
              x.sizes(), " and hash_bits ", tau, ", got ", grad_scores.sizes());
  auto gs = grad_scores.to(acc_type(x.scalar_type())).contiguous();
  auto gx = pooled_empty_like(x, /*transient=*/true);   // see "gradient memory"
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "memoryformer_hash_backward", [&] {
    hash_backward_kernel<scalar_t>(gs.data_ptr<typename Acc<scalar_t>::type>(), x.data_ptr<scalar_t>(),
                                   gx.data_ptr<scalar_t>(), N, K, tau, l1, temperature);
  });
  return gx;
}
#line 1 "modeling_memoryformer/csrc/cpu/lookup_token.h"
// The token-major forward lookup (up to kSmallBatch tokens).
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ token-major lookup
// Token-major gather-accumulate: for each token, its K rows' spans of kCols output columns summed in vector registers
// in table order, the rows read kBlockRows at a time along their columns while the spans ahead are prefetched
// (add_rows_blocked), so the random row reads overlap instead of waiting on the cache one after another.
//
// The work is split over (token, column range) units: with fewer tokens than threads (a decode step has one token
// per sequence) the columns are split too, so that every thread reads rows. A decode step is latency-bound: its few
// hundred KB of scattered rows come from DRAM, and one core keeps only so many reads in flight, so a second core
// reading the other half of each row nearly halves the time. The split starts from kTokenSplitBytes of rows per unit
// (below it a thread's wake-up costs more than it saves) and splits the columns evenly in whole vectors (kLanes): a
// range's last span may be narrower than kCols (add_rows_span_order sums it in vectors too). Ranges of whole kCols
// spans split MF-small's Memory Block layer 2 (768 columns, 3 spans) 512 / 256 and its Q/K/V 5 / 4 spans, so one
// thread read up to twice the other's bytes while the other waited; on the 2-vCPU Zen 4 of
// benchmarks/results/2026-11-29e-zen4 (timers inside decode_stack, the two splits alternating step by step in one
// process) MF-small's lookups took 5.6% less time per step (625 -> 590 us, 5 windows of 300 steps).
constexpr int64_t kTokenSplitBytes = 32 << 10;

// Runs unit(n, cb, ce, rnext) over every (token n, column range [cb, ce)) unit, on the threads: rnext is the next
// token's rows when the same thread runs that token's unit next (for its prefetches), else nullptr. elem: bytes per
// table value read.
template <typename F>
void for_token_units(const int64_t* rows, int64_t N, int64_t K, int64_t D, int64_t elem, F unit) {
  const int64_t spans = (D + kCols - 1) / kCols;
  const int64_t bytes = N * K * D * elem;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t groups = 1;   // column ranges per token: enough units for every thread, none under kTokenSplitBytes
  if (N < threads && bytes >= 2 * kTokenSplitBytes)
    groups = std::min({(threads + N - 1) / N, spans, std::max<int64_t>(1, bytes / N / kTokenSplitBytes)});
  const int64_t per_group = ((D + kLanes - 1) / kLanes + groups - 1) / groups * kLanes;   // columns per range
  const int64_t units = N * groups;
  auto body = [=](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t n = u / groups, g = u % groups;
      const int64_t cb = std::min(D, g * per_group), ce = std::min(D, (g + 1) * per_group);
      if (cb < ce) unit(n, cb, ce, (groups == 1 && u + 1 < u1) ? rows + (n + 1) * K : nullptr);
    }
  };
  if (units == 1 || (groups == 1 && threads_for(N * K * D) == 1)) body(0, units);
  else at::parallel_for(0, units, 1, body);
}

// The row span read kAhead lookups after row k of the span at c0, in a unit's order (this span's rows, the next
// span's, the next token's first span): its start (nullptr: none) and width. stride: values per table row.
template <typename T>
inline const T* span_ahead(const T* tables, int64_t stride, const int64_t* rn, const int64_t* rnext, int64_t K,
                           int64_t k, int64_t c0, int64_t cb, int64_t ce, int64_t& w, int64_t ahead = kAhead) {
  const int64_t a = k + ahead;
  if (a < K) { w = std::min(kCols, ce - c0); return tables + rn[a] * stride + c0; }
  if (a - K >= K) return nullptr;
  if (c0 + kCols < ce) { w = std::min(kCols, ce - c0 - kCols); return tables + rn[a - K] * stride + c0 + kCols; }
  if (rnext != nullptr) { w = std::min(kCols, ce - cb); return tables + rnext[a - K] * stride + cb; }
  return nullptr;
}

// sums[0, ce - cb) += s_k * row_k[cb, ce) for k in table order, over a unit's whole spans [cb, ce) (a multiple of kCols
// wide), in the row-block order: the rows in blocks of kBlockRows, and for each block the spans in column order, each
// span's sums read from and written back to `sums` (an L1 buffer of floats, which the caller starts at the bias, or 0)
// around the block's rows. Shared with the int8 pass (T = uint8_t codes, stride D + 8, s the weights s_k scale_k);
// stride: values per table row. Every column adds row 0, 1, ..., K - 1 in table order, acc + s_k * row_k, the
// expression of the scalar loop for a ragged span, which the compiler contracts the same way (fused multiply-adds where
// the target has them): a column has the same bits in any of them (tests/kernel/test_fused_paths.py). Vector code
// because the compiler's vectorisation of the scalar loop ran 1.5x the instructions per row and, cold, about a third
// more time per call (MF-base Q/K/V shape on the Zen 3 of docs/performance.md, docs/kernel.md). The reads run along
// kBlockRows rows at a time, each row's spans in address order with its span kBlockAhead spans on prefetched (at the
// block's end, the next block's rows', then the next token's), which the hardware prefetchers follow, where the
// span-major order before it summed one span of all K rows at a time, each row's next span prefetched K lookups ahead.
// In a standalone copy on the 2-vCPU Zen 1 of docs/performance.md (2 threads, cold bfloat16 tables on huge pages),
// against the span-major order: MF-base's Q/K/V shape 66-68 -> 52-53 us, its Memory Block's 35 -> 28-32 and 30-35 ->
// 26-33 us, MF-small's Q/K/V 42-43 -> 31-37 us; blocks of 4-12 rows and 4-16 spans ahead measured, 8 and 4 the best or
// within 5% of it on every shape. "kBlockAhead spans on" counts in the order a row slot of the block reads them: this
// row's spans, then the spans of the row kBlockRows on, ... (a unit of fewer spans than kBlockAhead prefetches blocks
// ahead). Before, a unit of 1-3 spans (kCols = 256 on AVX-512: MF-base's and MF-small's Memory Blocks over 2
// threads) had only its first block prefetched. On a 2-vCPU AMD EPYC Zen 4 (lookup op, cold bfloat16 tables, 2 threads,
// in-process alternation, 3 runs): MF-base's Memory Block 32-33 -> 29 us and 22 -> 19 us, its Q/K/V 47-49 -> 46-48 us
// (2 and 6 spans ahead within 2% of 4); MF-small generate 4.51 -> 4.39 ms per token, MF-base 8.90 -> 8.83.
constexpr int64_t kBlockRows = 8, kBlockAhead = 4;

template <typename T>
inline void add_rows_blocked(float* sums, const T* tables, int64_t stride, const int64_t* rn, const int64_t* rnext,
                             const float* s, int64_t K, int64_t cb, int64_t ce) {
  constexpr int64_t V = kCols / kLanes;
  const int64_t S = (ce - cb) / kCols;   // spans per row of the unit
  // Row r's span at `at` (r past K: the next token's row r - K, where there is one), prefetched.
  const auto fetch = [&](int64_t r, int64_t at) {
    if (r < K) prefetch_span(tables + rn[r] * stride + at, kCols);
    else if (rnext != nullptr && r - K < K) prefetch_span(tables + rnext[r - K] * stride + at, kCols);
  };
  for (int64_t k = 0; k < std::min(K, kBlockRows); ++k)
    for (int64_t a = 0; a < kBlockAhead; ++a) fetch(k + a / S * kBlockRows, cb + a % S * kCols);
  for (int64_t kb = 0; kb < K; kb += kBlockRows) {
    const int64_t ke = std::min(K, kb + kBlockRows);
    for (int64_t c0 = cb; c0 < ce; c0 += kCols) {
      fVec acc[V];
      for (int64_t i = 0; i < V; ++i) acc[i] = fVec::loadu(sums + (c0 - cb) + i * kLanes);
      // kBlockAhead spans on in the row's slot of the block order: rows kBlockRows apart, each row's spans in turn
      const int64_t a = (c0 - cb) / kCols + kBlockAhead, down = a / S * kBlockRows, at = cb + a % S * kCols;
      for (int64_t k = kb; k < ke; ++k) {
        fetch(k + down, at);
        const T* t = tables + rn[k] * stride + c0;
        const fVec sk(s[k]);
        for (int64_t i = 0; i < V; ++i) acc[i] = acc[i] + sk * load_floats(t + i * kLanes);
      }
      for (int64_t i = 0; i < V; ++i) acc[i].store(sums + (c0 - cb) + i * kLanes);
    }
  }
}

// A narrow unit (at most kNarrowSpans whole spans per row) in the span order instead: each span of all K rows in
// table order, row k + kRowsAhead's span prefetched into L1 and row k + kRowsFar's into L2 as row k's is summed (past
// the last row, the next span's first rows, then the next token's: span_ahead), the same sums as add_rows_blocked
// (every column adds rows 0..K-1 in table order, the same expression): the same bits. The L2 prefetches keep more
// reads in flight than L1's miss buffers hold. On a 2-vCPU AMD EPYC Zen 4 (AVX-512: 256-column spans), timers inside
// decode_stack alternating the code before and after step by step in one process, both step parities
// (benchmarks/results/2026-11-29-zen4 and 2026-11-29b-zen4), per step:
// - the span order for units of 1-3 spans, L1 prefetches only, against the row-block order: MF-base's Memory Block
//   lookups 1.2-1.4 -> 0.9-1.1 ms (24 layers), MF-small's 367 -> 283 us, MF-tiny's (its Q/K/V too) 355 -> 264 us;
//   units of 6 spans (MF-base's Q/K/V) the same time in either order;
// - with the L2 prefetches 12 rows ahead and units of up to 6 spans: MF-base's Q/K/V 906-932 -> 744-793 us, its
//   Memory Block's layer 1 480-486 -> 391-407 us and layer 2 390-647 -> 349-387 us, its stack 2.86 -> 2.29-2.51 ms;
//   MF-small's stack 889-923 -> 780-825 us, MF-tiny's 261-270 -> 242-245 us, int8 MF-base's 2.63-2.93 -> 2.49-2.69
//   ms. The same L2 prefetches added to the row-block order (8-16 spans ahead) moved MF-base's Q/K/V by +6% to -11%
//   from run to run: not taken.
// An AVX2 build (64-column spans) on the same Zen 4, in this order: MF-tiny's Memory Block units (4 and 5 spans)
// 55-61 -> 37-43 us per layer and step, MF-small's second Memory Block layer (6 spans) 181-499 -> 143-366 us; wider
// units (7-24 spans: MF-small's first layer and Q/K/V, MF-base's) keep the row-block order, which ran MF-base's Q/K/V
// in 1.04 and 1.48 ms per step against 1.85 and 2.30 in the span order with L1 prefetches 6 and 12 rows ahead: the
// rule goes by spans per unit.
// The span sum (load the sums, add s_k * row_k per row, store) is written out here and in add_rows_blocked: one
// inline helper taking the prefetches as a lambda, called by both, made MF-base's lookups 1.2-3.3x slower in
// decode_stack (alternating step by step with these loops in one process, both parities, always_inline or not, on the
// Zen 4 of benchmarks/results/2026-11-29c-zen4).
constexpr int64_t kNarrowSpans = 6, kRowsAhead = 4, kRowsFar = 12;

// One span of V vectors at c0 of a unit [cb, ce) (V = kCols / kLanes but for a unit's narrower last span).
template <int64_t V, typename T>
inline void add_span_rows(float* sums, const T* tables, int64_t stride, const int64_t* rn, const int64_t* rnext,
                          const float* s, int64_t K, int64_t c0, int64_t cb, int64_t ce) {
  fVec acc[V];
  for (int64_t i = 0; i < V; ++i) acc[i] = fVec::loadu(sums + (c0 - cb) + i * kLanes);
  for (int64_t k = 0; k < K; ++k) {
    int64_t w = 0;
    if (const T* p = span_ahead(tables, stride, rn, rnext, K, k, c0, cb, ce, w, kRowsAhead)) prefetch_span(p, w);
    if (const T* p = span_ahead(tables, stride, rn, rnext, K, k, c0, cb, ce, w, kRowsFar)) prefetch_span<2>(p, w);
    const T* t = tables + rn[k] * stride + c0;
    const fVec sk(s[k]);
    for (int64_t i = 0; i < V; ++i) acc[i] = acc[i] + sk * load_floats(t + i * kLanes);
  }
  for (int64_t i = 0; i < V; ++i) acc[i].store(sums + (c0 - cb) + i * kLanes);
}

// f(std::integral_constant<int64_t, v>) for a run-time v in [1, sizeof...(I)].
template <typename F, int64_t... I>
inline void with_vectors(int64_t v, F&& f, std::integer_sequence<int64_t, I...>) {
  ((v == I + 1 ? (f(std::integral_constant<int64_t, I + 1>{}), 0) : 0), ...);
}

// [cb, ce): whole vectors, the spans kCols wide but the last.
template <typename T>
inline void add_rows_span_order(float* sums, const T* tables, int64_t stride, const int64_t* rn, const int64_t* rnext,
                                const float* s, int64_t K, int64_t cb, int64_t ce) {
  for (int64_t k = 0; k < std::min(K, kRowsAhead); ++k)
    prefetch_span(tables + rn[k] * stride + cb, std::min(kCols, ce - cb));
  int64_t c0 = cb;
  for (; c0 + kCols <= ce; c0 += kCols)
    add_span_rows<kCols / kLanes>(sums, tables, stride, rn, rnext, s, K, c0, cb, ce);
  if (c0 < ce)
    with_vectors((ce - c0) / kLanes, [&](auto v) {
      add_span_rows<decltype(v)::value>(sums, tables, stride, rn, rnext, s, K, c0, cb, ce);
    }, std::make_integer_sequence<int64_t, kCols / kLanes>{});
}

// The whole vectors of a unit [cb, ce), for lookup_kernel and the int8 pass: a thread's buffer of
// float sums (grown to the widest unit seen, then reused), started by start(sums, w), summed by add_rows_blocked
// (its whole spans, the narrower rest in the span order) or, for a narrow unit, add_rows_span_order (the next token's
// rows prefetched only where no ragged columns follow, which read them themselves), handed to finish(sums, w), w = the
// whole vectors' width. Returns where the ragged last columns (fewer than kLanes) start (ce where there are none).
template <typename T, typename Start, typename Finish>
int64_t sum_whole_vectors(const T* tables, int64_t stride, const int64_t* rn, const int64_t* rnext, const float* s,
                          int64_t K, int64_t cb, int64_t ce, Start start, Finish finish) {
  const int64_t spans = cb + (ce - cb) / kCols * kCols, whole = cb + (ce - cb) / kLanes * kLanes;
  if (whole == cb) return cb;
  static thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < whole - cb) buffer.resize(whole - cb);
  float* sums = buffer.data();
  start(sums, whole - cb);
  const int64_t* next = whole == ce ? rnext : nullptr;
  if ((spans - cb) / kCols <= kNarrowSpans) {
    add_rows_span_order(sums, tables, stride, rn, next, s, K, cb, whole);
  } else {
    add_rows_blocked(sums, tables, stride, rn, spans == whole ? next : nullptr, s, K, cb, spans);
    if (spans < whole) add_rows_span_order(sums + (spans - cb), tables, stride, rn, next, s, K, spans, whole);
  }
  finish(static_cast<const float*>(sums), whole - cb);
  return whole;
}

template <typename T>
void lookup_kernel(const int64_t* rows, const typename Acc<T>::type* scores, const T* tables, const T* bias,
                   T* out, int64_t N, int64_t K, int64_t D) {
  using A = typename Acc<T>::type;
  for_token_units(rows, N, K, D, int64_t(sizeof(T)), [=](int64_t n, int64_t cb, int64_t ce, const int64_t* rnext) {
    const int64_t* rn = rows + n * K;
    const A* sn = scores + n * K;
    int64_t c0 = cb;
    if constexpr (std::is_same<A, float>::value) {   // whole vectors (sum_whole_vectors), from the bias (or 0)
      c0 = sum_whole_vectors(tables, D, rn, rnext, sn, K, cb, ce, [&](float* sums, int64_t w) {
        for (int64_t j = 0; j < w; j += kLanes) (bias ? load_floats(bias + cb + j) : fVec(0.f)).store(sums + j);
      }, [&](const float* sums, int64_t w) {
        T* o = out + n * D + cb;   // accumulated in float32, stored in the tables' dtype
        for (int64_t j = 0; j < w; ++j) o[j] = static_cast<T>(sums[j]);
      });
    }
    // The ragged last columns (fewer than kLanes; all of a float64 table's): summed one span at a time, as scalars.
    if (c0 < ce)
      for (int64_t k = 0; k < K; ++k) prefetch_span(tables + rn[k] * D + c0, std::min(kCols, ce - c0));
    for (; c0 < ce; c0 += kCols) {
      const int64_t w = std::min(kCols, ce - c0);
      A acc[kCols];
      for (int64_t j = 0; j < w; ++j) acc[j] = bias ? to_acc(bias[c0 + j]) : A(0);
      for (int64_t k = 0; k < K; ++k) {
        int64_t pw = 0;
        if (const T* p = span_ahead(tables, D, rn, rnext, K, k, c0, cb, ce, pw, K)) prefetch_span(p, pw);
        const T* t = tables + rn[k] * D + c0;
        const A s = sn[k];
        if (w == kCols) {
#pragma omp simd
          for (int64_t j = 0; j < kCols; ++j) acc[j] += s * to_acc(t[j]);
        } else {
          for (int64_t j = 0; j < w; ++j) acc[j] += s * to_acc(t[j]);
        }
      }
      T* o = out + n * D + c0;   // accumulated in A, stored in the tables' dtype
      for (int64_t j = 0; j < w; ++j) o[j] = static_cast<T>(acc[j]);
    }
  });
}
#line 1 "modeling_memoryformer/csrc/cpu/lookup_bucketed.h"
// The bucketed forward lookup, and the grouping of lookups by row that the backward shares.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ bucketed passes
// For many tokens the lookups are grouped by table row (a counting sort per table: each table holds every token
// exactly once), and the work is split by column blocks of kBlock columns. One column block of a chunk of tokens
// (half of L2, see Tuning) lives in a contiguous buffer that stays in L2, while the rows of the table are streamed
// once, in order, each hit row loaded into registers once and applied to all of its tokens. The table is then read
// once per chunk instead of once per lookup (N / 2**tau times), and the random accesses go to L2 instead of L3 /
// DRAM. The buffer is compact because a strided column block of a [N, D] matrix with D*4 a multiple of 2 KB maps
// onto a few cache sets only.
constexpr int64_t kRowAhead = 12;  // table rows prefetched ahead in the stream

template <typename A> struct Buckets {   // in the calling thread's scratch slots 0-2
  int64_t* start = nullptr;     // [R + 1]: the lookups of row r are positions start[r] .. start[r + 1]
  int32_t* token = nullptr;     // [n * K]: token (chunk-relative) of each position
  A* score = nullptr;           // [n * K]: its score
};  // position e belongs to table e / n (see bucket_lookups), so its lookup is (token[e], e / n)

// Group the lookups of tokens [0, n) by row. Table k owns rows k*P .. k*P + P - 1 and positions k*n .. k*n + n - 1.
template <typename A>
void bucket_lookups(const int64_t* rows, const A* scores, int64_t n, int64_t K, int64_t P, Buckets<A>& b) {
  b.start = scratch<int64_t>(0, K * P + 1);
  b.token = scratch<int32_t>(1, n * K);
  b.score = scratch<A>(2, n * K);
  int64_t* st = b.start;
  int32_t* tok = b.token;
  A* sc = b.score;
  parallel_tokens(K, n * K * 8, [=](int64_t k0, int64_t k1) {
    std::vector<int64_t> fill(P);
    for (int64_t k = k0; k < k1; ++k) {
      std::fill(fill.begin(), fill.end(), 0);
      for (int64_t i = 0; i < n; ++i) ++fill[rows[i * K + k] - k * P];   // rows checked by check_lookup_args
      int64_t pos = k * n;
      for (int64_t c = 0; c < P; ++c) { st[k * P + c] = pos; pos += fill[c]; fill[c] = st[k * P + c]; }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t at = fill[rows[i * K + k] - k * P]++;
        tok[at] = static_cast<int32_t>(i);
        sc[at] = scores[i * K + k];
      }
    }
  });
  st[K * P] = n * K;
}

// float32, W = kBlock columns: the row and the accumulators are vectors that the compiler keeps in registers across
// the hit loop (it does not do so for the generic loops' arrays). kBlock / kLanes vectors each: 4 with AVX-512,
// 8 with AVX2, 16 with NEON.
constexpr int64_t kBlockVecs = kBlock / kLanes;
static_assert(kBlock % kLanes == 0, "a column block is whole vectors");

inline void scatter_hits_f32(const float* t, const int32_t* tok, const float* sc, int64_t e0, int64_t e1,
                             float* buf) {
  fVec tv[kBlockVecs];
#pragma GCC unroll 16
  for (int64_t v = 0; v < kBlockVecs; ++v) tv[v] = fVec::loadu(t + v * kLanes);
  for (int64_t e = e0; e < e1; ++e) {
    float* y = buf + int64_t(tok[e]) * kBlock;
    const fVec s(sc[e]);
#pragma GCC unroll 16
    for (int64_t v = 0; v < kBlockVecs; ++v)
      at::vec::fmadd(s, tv[v], fVec::loadu(y + v * kLanes)).store(y + v * kLanes);
  }
}

// Forward of one column block [c0, c0 + W) for the tokens of one chunk: buf[i, :] = sum over the chunk's lookups
// (i, k) of scores * tables[row, c0:c0+W]. W is kBlock (vectorised, unrolled) or the ragged last block.
template <typename T, int64_t W>
void scatter_block(const Buckets<typename Acc<T>::type>& b, const T* tables, typename Acc<T>::type* buf, int64_t n,
                   int64_t R, int64_t D, int64_t c0, int64_t w) {
  using A = typename Acc<T>::type;
  const int64_t ww = W ? W : w;
  std::memset(static_cast<void*>(buf), 0, sizeof(A) * n * ww);
  const int64_t* st = b.start;
  const int32_t* tok = b.token;
  const A* sc = b.score;
  for (int64_t r = 0; r < R; ++r) {
    if (r + kRowAhead < R && st[r + kRowAhead] != st[r + kRowAhead + 1])
      prefetch_span(tables + (r + kRowAhead) * D + c0, ww);
    const int64_t e0 = st[r], e1 = st[r + 1];
    if (e0 == e1) continue;
    const T* t = tables + r * D + c0;
    if constexpr (std::is_same<T, float>::value && W == kBlock) {
      scatter_hits_f32(t, tok, sc, e0, e1, buf);
    } else if constexpr (std::is_same<A, float>::value && W == kBlock) {   // bfloat16 / float16: the row in float32
      alignas(64) float tv[kBlock];
#pragma GCC unroll 16
      for (int64_t v = 0; v < kBlockVecs; ++v) load_floats(t + v * kLanes).store(tv + v * kLanes);
      scatter_hits_f32(tv, tok, sc, e0, e1, buf);
    } else {
      A tv[W ? W : kBlock];
      for (int64_t j = 0; j < ww; ++j) tv[j] = to_acc(t[j]);
      for (int64_t e = e0; e < e1; ++e) {
        A* y = buf + int64_t(tok[e]) * ww;
        const A s = sc[e];
        if (W) {
#pragma omp simd
          for (int64_t j = 0; j < W; ++j) y[j] += s * tv[j];
        } else {
          for (int64_t j = 0; j < w; ++j) y[j] += s * tv[j];
        }
      }
    }
  }
}

// Column blocks of width kBlock, the last one ragged; threads take whole blocks.
inline int64_t num_blocks(int64_t D) { return (D + kBlock - 1) / kBlock; }

template <typename T>
void lookup_bucketed(const int64_t* rows, const typename Acc<T>::type* scores, const T* tables, const T* bias,
                     typename Acc<T>::type* out, int64_t N, int64_t K, int64_t P, int64_t D) {
  using A = typename Acc<T>::type;
  const int64_t R = K * P, nb = num_blocks(D), chunk = bucket_chunk<A>(tuning());
  Buckets<A> b;
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t n = std::min(chunk, N - n0);
    bucket_lookups(rows + n0 * K, scores + n0 * K, n, K, P, b);
    A* o = out + n0 * D;
    at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
      A* buf = scratch<A>(kWorkerSlot, n * kBlock);
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t c0 = blk * kBlock, w = std::min(kBlock, D - c0);
        if (w == kBlock) scatter_block<T, kBlock>(b, tables, buf, n, R, D, c0, w);
        else scatter_block<T, 0>(b, tables, buf, n, R, D, c0, w);
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < w; ++j) o[i * D + c0 + j] = buf[i * w + j] + (bias ? to_acc(bias[c0 + j]) : A(0));
      }
    });
  }
}
#line 1 "modeling_memoryformer/csrc/cpu/lookup_packed.h"
// The packed forward lookup.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ packed forward
// Tables (float32, bfloat16, float16) about the size of the LLC, many tokens: the output is built in column blocks of
// kPackCols columns for chunks of tokens; a thread takes whole (chunk, column block) units. For each group of tables,
// two phases:
// 1. copy ("pack") the group's rows restricted to the block into a contiguous buffer (a quarter of L2): a pure
//    stream from L3 / DRAM, prefetched kPackAhead rows ahead. The copy exists because a column block of the table is
//    strided (rows D * 4 >= 1 KB apart) and would map onto a few L2 sets only.
// 2. the chunk's tokens add their lookups of the group from the buffer, several tokens at a time (tokens_for) with
//    their sums in registers, into a compact [chunk, kPackCols] accumulator (a quarter of L2) that goes to the output
//    after the last group, by non-temporal stores (whole 128-byte spans: no read for ownership of the output's
//    lines, which the table stream would evict from the caches anyway).
// The phases are not interleaved: interleaved, the stream's misses held the miss buffers that the gathers' L2 hits
// need, and the kernel ran at the sum of both phases' times or worse. The table is read once per chunk instead of
// once per lookup. The lookups are regrouped first, per group of tables (an int32 offset into the buffer and the
// score, contiguous per group), so that each pass over a group reads them in order from a compact array.
constexpr int64_t kPackVecs = kPackCols / kLanes;   // vectors per packed row: 2 (AVX-512), 4 (AVX2), 8 (NEON)
static_assert(kPackCols % (2 * kLanes) == 0, "a packed row is whole pairs of vectors");
constexpr int64_t kPackAhead = 32;   // rows prefetched (into L2) ahead of the copy

// bfloat16 rows are widened by the bit pattern: a 32-bit word of a packed row holds columns 2j (low half) and 2j + 1
// (high half), and `word << 16` and `word & 0xffff0000` are those two columns as float32, exactly (one integer
// operation per 16 values, instead of a zero-extension and a shift per 16 values through at::vec::load_to_float, so
// each group of rows stays a plain copy of the table's bytes). The sums of a block then hold its even columns in
// the first vector of each pair and its odd columns in the second: the accumulator keeps that order (`acc_column`)
// and the final store puts the columns back in place. AVX512_BF16's dot product (vdpbf16ps) over pairs of lookups is
// not used: it would round the scores to bfloat16 and gains little, the gathers being bound by their loads and
// integer operations as much as by the multiply-adds (docs/kernel.md).
using iVec = at::vec::Vectorized<int32_t>;
static_assert(iVec::size() == kLanes, "an int32 vector has as many lanes as a float vector");
template <typename T> constexpr bool kSplitWords = std::is_same<T, c10::BFloat16>::value;

// The column (within its block) held at position p of a block's sums: p itself, or for bfloat16 tables (see above)
// position v * kLanes + i of vector v = 2 j + h holds column 2 (j * kLanes + i) + h.
template <typename T> constexpr int64_t acc_column(int64_t p) {
  if constexpr (kSplitWords<T>) {
    const int64_t v = p / kLanes, i = p % kLanes;
    return 2 * ((v / 2) * kLanes + i) + v % 2;
  } else {
    return p;
  }
}

// acc[n + i, :] (+)= sum over the gn tables of the group of sc * pack[loc], for the TT tokens n .. n + TT - 1 of the
// chunk, whose entries of the group are loc/sc[(n + i) * gn + k]; `first` starts from the bias block instead. A packed
// row (and a row of acc) is V vectors wide: V * kLanes columns.
template <int TT, int V, typename T>
inline void packed_tokens(const int32_t* loc, const float* sc, const T* pack, const float* bias_block, float* acc,
                          int64_t n, int64_t gn, bool first) {
  constexpr int64_t C = V * kLanes;
  fVec a[TT][V];
#pragma GCC unroll 4
  for (int i = 0; i < TT; ++i) {
    const float* start = first ? bias_block : acc + (n + i) * C;
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) a[i][v] = fVec::loadu(start + v * kLanes);
  }
  const int32_t* l = loc + n * gn;
  const float* s = sc + n * gn;
  for (int64_t k = 0; k < gn; ++k) {
#pragma GCC unroll 4
    for (int i = 0; i < TT; ++i) {
      const T* t = pack + l[i * gn + k];
      const fVec w(s[i * gn + k]);
      if constexpr (kSplitWords<T>) {
        const iVec shift(16), high(int32_t(0xffff0000u));
        const int32_t* words = reinterpret_cast<const int32_t*>(t);
#pragma GCC unroll 4
        for (int v = 0; v < V / 2; ++v) {
          const iVec word = iVec::loadu(words + v * kLanes);
          a[i][2 * v] = at::vec::fmadd(w, at::vec::cast<float>(word << shift), a[i][2 * v]);
          a[i][2 * v + 1] = at::vec::fmadd(w, at::vec::cast<float>(word & high), a[i][2 * v + 1]);
        }
      } else {
#pragma GCC unroll 8
        for (int v = 0; v < V; ++v) a[i][v] = at::vec::fmadd(w, load_floats(t + v * kLanes), a[i][v]);
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < TT; ++i) {
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) a[i][v].store(acc + (n + i) * C + v * kLanes);
  }
}

// Whether the packed forward can run: float32, bfloat16 or float16 tables whose width is whole column blocks.
bool packed_applies(at::ScalarType dtype, int64_t D) {
  return (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) && D % kPackCols == 0;
}

// Tokens summed at once for packed rows of V vectors: their sums fill at most half the vector registers, at most 4.
constexpr int tokens_for(int64_t V) { return int(std::max<int64_t>(1, std::min<int64_t>(4, kVecRegs / 2 / V))); }

// Column blocks of kPackCols a packed row spans: 2 for 16-bit tables (a row of 64 columns, 128 bytes) where the
// registers still sum 2 or more tokens at once with rows that wide (32 vector registers of 16 floats: AVX-512), else 1.
// The copy then reads 128 contiguous bytes of each table row instead of one 64-byte line at a stride of D * 2 bytes,
// which streamed tables beyond the L3 more slowly (docs/kernel.md). 1 when the blocks do not pair.
int64_t packed_span(int64_t element_bytes, int64_t nblk) {
  const bool wide = element_bytes * kPackCols < 128 && tokens_for(2 * kPackVecs) >= 2;
  return wide && nblk % 2 == 0 ? 2 : 1;
}

// T: the tables' dtype, which the packed rows keep (bfloat16 / float16 rows take half the bytes of float32 ones, so a
// group holds twice the rows of one block, or as many rows of two blocks, and are widened to float32 in registers as
// they are added); sums in float32; the output in T (bias in T). W: column blocks per packed row (packed_span).
template <typename T, int64_t W>
void lookup_packed_span(const int64_t* rows, const float* scores, const T* tables, const T* bias, T* out,
                        int64_t N, int64_t K, int64_t P, int64_t D) {
  constexpr int64_t C = W * kPackCols;   // columns of a packed row
  constexpr int V = int(C / kLanes), TT = tokens_for(V);
  const Tuning tu = tuning();
  const int64_t G = std::min(K, std::max<int64_t>(1, tu.pack_group / (P * C * int64_t(sizeof(T)))));
  // Chunks of equal size, at most pack_chunk tokens (a small last chunk would copy the whole table for few tokens).
  // With W = 2 their accumulator fills all of L2 rather than half and spills to L3 in part, which costs less than
  // streaming the tables once more (docs/kernel.md).
  const int64_t nchunk = (N + tu.pack_chunk - 1) / tu.pack_chunk, chunk_size = (N + nchunk - 1) / nchunk;
  const int64_t nspan = D / C;
  TORCH_CHECK(G * P * C <= std::numeric_limits<int32_t>::max(),
              "memoryformer.lookup: a packed group of ", G, " x ", P, " rows is too large for int32 offsets");
  // Group-major lookups: group [g0, g0 + gn) holds, for token n and table g0 + k, at (g0 * N + n * gn + k), the
  // offset of the row in the group's buffer and the score.
  int32_t* loc = scratch<int32_t>(0, N * K);
  float* sc = scratch<float>(1, N * K);
  parallel_tokens(N, N * K * 4, [&](int64_t n0, int64_t n1) {
    for (int64_t g0 = 0; g0 < K; g0 += G) {
      const int64_t gn = std::min(G, K - g0);
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t k = 0; k < gn; ++k) {
          loc[g0 * N + n * gn + k] = int32_t((rows[n * K + g0 + k] - g0 * P) * C);
          sc[g0 * N + n * gn + k] = scores[n * K + g0 + k];
        }
    }
  });
  // Rows [0, nrows) of the group from g0, columns c0 .. c0 + C - 1, into pack.
  auto copy = [=](T* pack, int64_t g0, int64_t nrows, int64_t c0) {
    const T* base = tables + g0 * P * D + c0;
    for (int64_t r = 0; r < nrows; ++r) {
      const T* src = base + r * D;
      if (r + kPackAhead < nrows)
        for (int64_t c = 0; c < C; c += 64 / int64_t(sizeof(T))) __builtin_prefetch(src + kPackAhead * D + c, 0, 2);
      std::memcpy(static_cast<void*>(pack + r * C), src, sizeof(T) * C);
    }
  };
  parallel_tokens(nchunk * nspan, N * K * D, [&](int64_t u0, int64_t u1) {
    // One scratch block: the accumulator [chunk, C] float32 first (64-byte aligned), then the packed rows.
    const int64_t acc_floats = chunk_size * C, pack_bytes = G * P * C * int64_t(sizeof(T));
    float* acc = static_cast<float*>(scratch_bytes(kWorkerSlot, size_t(acc_floats * int64_t(sizeof(float)) +
                                                                        pack_bytes)));
    T* pack = reinterpret_cast<T*>(acc + acc_floats);
    alignas(64) float bias_block[C];
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t n0 = (u / nspan) * chunk_size, nn = std::min(chunk_size, N - n0), c0 = (u % nspan) * C;
      for (int64_t p = 0; p < C; ++p) bias_block[p] = bias ? float(bias[c0 + acc_column<T>(p)]) : 0.0f;
      for (int64_t g0 = 0; g0 < K; g0 += G) {
        const int64_t gn = std::min(G, K - g0);
        copy(pack, g0, gn * P, c0);
        const int32_t* l = loc + g0 * N + n0 * gn;
        const float* s = sc + g0 * N + n0 * gn;
        const bool first = g0 == 0;
        int64_t n = 0;
        for (; n + TT <= nn; n += TT) packed_tokens<TT, V>(l, s, pack, bias_block, acc, n, gn, first);
        for (; n < nn; ++n) packed_tokens<1, V>(l, s, pack, bias_block, acc, n, gn, first);
      }
      if constexpr (kSplitWords<T>) {   // columns back in place (each (even, odd) pair of vectors interleaved)
        static_assert(at::vec::Vectorized<T>::size() == 2 * kLanes, "two float vectors round to one 16-bit vector");
        for (int64_t i = 0; i < nn; ++i) {
          const float* a = acc + i * C;
          T* o = out + (n0 + i) * D + c0;
#pragma GCC unroll 4
          for (int v = 0; v < V; v += 2) {
            const auto both = at::vec::interleave2(fVec::loadu(a + v * kLanes), fVec::loadu(a + (v + 1) * kLanes));
            at::vec::convert_from_float<T>(std::get<0>(both), std::get<1>(both)).store(o + v * kLanes);
          }
        }
      } else {
        for (int64_t i = 0; i < nn; ++i) store_span(out + (n0 + i) * D + c0, acc + i * C, C, true);
      }
    }
    stream_fence();
  });
}

template <typename T>
void lookup_packed(const int64_t* rows, const float* scores, const T* tables, const T* bias, T* out,
                   int64_t N, int64_t K, int64_t P, int64_t D) {
  if (N == 0) return;
  if (packed_span(sizeof(T), D / kPackCols) == 2)
    lookup_packed_span<T, 2>(rows, scores, tables, bias, out, N, K, P, D);
  else
    lookup_packed_span<T, 1>(rows, scores, tables, bias, out, N, K, P, D);
}
#line 1 "modeling_memoryformer/csrc/cpu/lookup.h"
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
#line 1 "modeling_memoryformer/csrc/cpu/backward.h"
// The backward of the lookup: the bucketed backward and the rows-hit backward, and their ops.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ bucketed backward
// The backward over the lookups grouped by row as for the bucketed forward (Buckets, bucket_lookups and kBlockVecs
// are in lookup_bucketed.h), in one pass over the table rows per column block. backward_hits_f32: float32, W = kBlock
// columns, the row and the accumulators in vector registers (as scatter_hits_f32).
template <bool kTables, bool kScores>
inline void backward_hits_f32(const float* t, const int32_t* tok, const float* sc, int64_t e0, int64_t e1,
                              const float* buf, float* acc, float* part) {
  fVec tv[kBlockVecs], a[kBlockVecs];
#pragma GCC unroll 16
  for (int64_t v = 0; v < kBlockVecs; ++v) {
    if (kScores) tv[v] = fVec::loadu(t + v * kLanes);
    if (kTables) a[v] = fVec::loadu(acc + v * kLanes);
  }
  for (int64_t e = e0; e < e1; ++e) {
    const float* y = buf + int64_t(tok[e]) * kBlock;
    const fVec s(sc[e]);
    fVec d0(0.0f), d1(0.0f);   // two partial dot products: half the dependency chain
#pragma GCC unroll 16
    for (int64_t v = 0; v < kBlockVecs; ++v) {
      const fVec yv = fVec::loadu(y + v * kLanes);
      if (kTables) a[v] = at::vec::fmadd(s, yv, a[v]);
      if (kScores) {
        if (v % 2 == 0) d0 = at::vec::fmadd(yv, tv[v], d0);
        else d1 = at::vec::fmadd(yv, tv[v], d1);
      }
    }
    if (kScores) part[e] += at::vec::vec_reduce_all<float>([](const fVec& x, const fVec& z) { return x + z; }, d0 + d1);
  }
  if (kTables) {
#pragma GCC unroll 16
    for (int64_t v = 0; v < kBlockVecs; ++v) a[v].store(acc + v * kLanes);
  }
}

// Backward of one column block for one chunk, in the same single pass over the table rows:
//   grad_tables[r, block] (+)= sum over lookups of r of scores * grad_y[token, block]  (written once, by one thread)
//   part[position] += <grad_y[token, block], tables[r, block]>  (this block's share of the score gradient)
// Rows no lookup hit are written as zeros by the first chunk (`first`) and left alone by later ones.
template <typename T, int64_t W, bool kTables, bool kScores>
void backward_block(const Buckets<typename Acc<T>::type>& b, const T* tables,
                    const typename Acc<T>::type* buf, T* grad_tables, typename Acc<T>::type* part, int64_t R, int64_t D,
                    int64_t c0, int64_t w, bool first) {
  using A = typename Acc<T>::type;
  const int64_t ww = W ? W : w;
  const int64_t* st = b.start;
  const int32_t* tok = b.token;
  const A* sc = b.score;
  alignas(64) A zeros[kBlock] = {};
  for (int64_t r = 0; r < R; ++r) {
    const int64_t e0 = st[r], e1 = st[r + 1];
    T* g = kTables ? grad_tables + r * D + c0 : nullptr;
    if (e0 == e1) {
      if (kTables && first) store_span(g, zeros, ww, true);
      continue;
    }
    if (kScores && r + kRowAhead < R) prefetch_span(tables + (r + kRowAhead) * D + c0, ww);
    alignas(64) A tv[W ? W : kBlock], acc[W ? W : kBlock];
    // Widening copies (by vectors for 16-bit values); float32 rows of a whole block are read in place below.
    if (kScores && !(std::is_same<T, float>::value && W == kBlock)) load_span(tv, tables + r * D + c0, ww);
    if (kTables) {
      if (first) std::fill(acc, acc + ww, A(0));
      else load_span(acc, g, ww);
    }
    if constexpr (std::is_same<A, float>::value && W == kBlock) {
      const float* row;   // float32 tables: the row itself; bfloat16 / float16: its float32 copy in tv
      if constexpr (std::is_same<T, float>::value) row = tables + r * D + c0;
      else row = tv;
      backward_hits_f32<kTables, kScores>(row, tok, sc, e0, e1, buf, acc, part);
    } else {
      for (int64_t e = e0; e < e1; ++e) {
        const A* y = buf + int64_t(tok[e]) * ww;
        const A s = sc[e];
        A dot = 0;
        if (W) {
#pragma omp simd reduction(+ : dot)
          for (int64_t j = 0; j < W; ++j) {
            if (kTables) acc[j] += s * y[j];
            if (kScores) dot += y[j] * tv[j];
          }
        } else {   // a ragged last block: explicit fused multiply-adds, so that the backward of scores alone has the
                   // bits of the backward of both (GCC 12 for Zen 1 contracted the sums of the two differently)
          for (int64_t j = 0; j < w; ++j) {
            if (kTables) acc[j] = std::fma(s, y[j], acc[j]);
            if (kScores) dot = std::fma(y[j], tv[j], dot);
          }
        }
        if (kScores) part[e] += dot;
      }
    }
    if (kTables) store_span(g, acc, ww, first);
  }
  stream_fence();
}

// GY: grad_y's dtype, the accumulation type or (float32 sums) a 16-bit type, widened as each column block is copied.
template <typename T, bool kTables, bool kScores, typename GY = typename Acc<T>::type>
void lookup_backward_bucketed(const GY* gy, const int64_t* rows,
                              const typename Acc<T>::type* scores, const T* tables, T* grad_tables,
                              typename Acc<T>::type* grad_scores, int64_t N, int64_t K, int64_t P, int64_t D) {
  using A = typename Acc<T>::type;
  const int threads = std::max(1, at::get_num_threads());
  const int64_t R = K * P, nb = num_blocks(D), chunk = backward_chunk<A>(tuning(), threads);
  Buckets<A> b;
  A* parts = nullptr;
  for (int64_t n0 = 0; n0 < N || n0 == 0; n0 += chunk) {
    const int64_t n = std::min(chunk, N - n0);
    bucket_lookups(rows + n0 * K, scores + n0 * K, n, K, P, b);
    const GY* g = gy + n0 * D;
    const int64_t L = n * K;
    if (kScores) {
      parts = scratch<A>(3, threads * L);
      std::fill(parts, parts + threads * L, A(0));
    }
    A* pp = parts;
    const bool first = n0 == 0;
    at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
      A* buf = scratch<A>(kWorkerSlot, n * kBlock);
      A* part = kScores ? pp + int64_t(at::get_thread_num()) * L : nullptr;
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t c0 = blk * kBlock, w = std::min(kBlock, D - c0);
        for (int64_t i = 0; i < n; ++i) load_span(buf + i * w, g + i * D + c0, w);   // memcpy when GY is A
        if (w == kBlock)
          backward_block<T, kBlock, kTables, kScores>(b, tables, buf, grad_tables, part, R, D, c0, w, first);
        else
          backward_block<T, 0, kTables, kScores>(b, tables, buf, grad_tables, part, R, D, c0, w, first);
      }
    });
    if (kScores) {  // sum the threads' shares and put each position's gradient back at its lookup (token, table)
      A* gs = grad_scores + n0 * K;
      const int32_t* tok = b.token;
      parallel_tokens(K, L * threads, [=](int64_t k0, int64_t k1) {
        for (int64_t k = k0; k < k1; ++k)
          for (int64_t e = k * n; e < (k + 1) * n; ++e) {
            A v = 0;
            for (int t = 0; t < threads; ++t) v += pp[int64_t(t) * L + e];
            gs[int64_t(tok[e]) * K + k] = v;
          }
      });
    }
    if (N == 0) break;
  }
}

std::tuple<at::Tensor, at::Tensor> lookup_backward_op(const at::Tensor& grad_out, const at::Tensor& rows,
                                                      const at::Tensor& scores, const at::Tensor& tables,
                                                      int64_t rows_per_table, bool need_tables, bool need_scores) {
  check_lookup_args(rows, scores, tables, rows_per_table, "lookup_backward");
  const int64_t N = rows.size(0), K = rows.size(1), D = tables.size(1);
  TORCH_CHECK(grad_out.defined(), "memoryformer.lookup_backward: grad_out is undefined");
  check_floating(grad_out, "lookup_backward", "grad_out");
  TORCH_CHECK(grad_out.dim() == 2 && grad_out.size(0) == N && grad_out.size(1) == D,
              "memoryformer.lookup_backward: grad_out must be [N, D] = [", N, ", ", D, "], got ",
              grad_out.sizes());
  const auto acc = acc_type(tables.scalar_type());
  // A 16-bit grad_y (a bfloat16 or float16 model) is widened block by block inside the pass, not copied whole first.
  const bool narrow = acc == at::kFloat && (grad_out.scalar_type() == at::kBFloat16 ||
                                            grad_out.scalar_type() == at::kHalf);
  auto gy = narrow ? grad_out.contiguous() : grad_out.to(acc).contiguous();
  auto s = lookup_operands(scores, tables, std::nullopt, "lookup_backward").first;
  at::Tensor gscores, gtables;
  if (need_scores) gscores = at::empty({N, K}, tables.options().dtype(acc));
  if (need_tables) gtables = pooled_empty_like(tables);
  const int64_t P = rows_per_table;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, tables.scalar_type(), "memoryformer_lookup_bwd", [&] {
    using A = typename Acc<scalar_t>::type;
    const int64_t* r = rows.data_ptr<int64_t>();
    const A* sc = s.data_ptr<A>();
    const scalar_t* t = tables.data_ptr<scalar_t>();
    scalar_t* gt = need_tables ? gtables.data_ptr<scalar_t>() : nullptr;
    A* gs = need_scores ? gscores.data_ptr<A>() : nullptr;
    auto run = [&](const auto* g) {
      using GY = std::remove_const_t<std::remove_pointer_t<decltype(g)>>;
      if (need_tables && need_scores) lookup_backward_bucketed<scalar_t, true, true, GY>(g, r, sc, t, gt, gs, N, K, P, D);
      else if (need_tables) lookup_backward_bucketed<scalar_t, true, false, GY>(g, r, sc, t, gt, nullptr, N, K, P, D);
      else if (need_scores) lookup_backward_bucketed<scalar_t, false, true, GY>(g, r, sc, t, nullptr, gs, N, K, P, D);
    };
    if constexpr (std::is_same<A, float>::value) {
      if (gy.scalar_type() == at::kBFloat16) return run(gy.data_ptr<c10::BFloat16>());
      if (gy.scalar_type() == at::kHalf) return run(gy.data_ptr<c10::Half>());
    }
    run(gy.data_ptr<A>());
  });
  return {gscores, gtables};
}

// ------------------------------------------------------------------------------------------------ rows-hit backward
// The table gradient as the rows hit and their gradients only (a sparse gradient), for few tokens: the dense form
// writes every row of the tables (zeros for the rows nobody hit: 33.5 MB for a d=512 layer of 256-row tables), which
// dominates a backward of a few tokens. Per table k (tables split over the threads): the lookups (row, token) of the
// table sorted by row (std::sort of N 64-bit keys), then each distinct row's gradient summed in float32 registers
// over its tokens, in token order, and each lookup's score gradient <grad_y[n], tables[row]>. Output rows ascending
// (table k's rows come before table k + 1's), so the sparse gradient is coalesced as made.
// Pass 1: the sorted keys and the number of distinct rows of each table; pass 2 fills the outputs. From half a lookup
// per row (2N >= rows per table) most rows are hit: the dense bucketed backward runs instead and its rows hit are
// copied out.
template <typename T>
void backward_rows_kernel(const float* gy, const int64_t* rows, const float* scores, const T* tables,
                          const uint64_t* keys, const int64_t* start, int64_t* out_rows, T* values,
                          float* grad_scores, int64_t N, int64_t K, int64_t D) {
  parallel_tokens(K, N * K * D, [=](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const uint64_t* kk = keys + k * N;
      int64_t u = start[k];
      for (int64_t e = 0; e < N;) {
        const int64_t row = rows[(kk[e] & 0xffffffffu) * K + k];
        int64_t e1 = e + 1;
        while (e1 < N && (kk[e1] >> 32) == (kk[e] >> 32)) ++e1;
        T* v = values + u * D;
        out_rows[u++] = row;
        const T* t = tables + row * D;
        for (int64_t c0 = 0; c0 < D; c0 += kCols) {   // the row's gradient, kCols columns at a time in registers
          const int64_t w = std::min(kCols, D - c0);
          float acc[kCols] = {};
          for (int64_t i = e; i < e1; ++i) {
            const int64_t n = int64_t(kk[i] & 0xffffffffu);
            const float sn = scores[n * K + k];
            const float* g = gy + n * D + c0;
#pragma omp simd
            for (int64_t j = 0; j < w; ++j) acc[j] += sn * g[j];
          }
          store_span(v + c0, acc, w, false);   // 16-bit values rounded by vectors
        }
        if (grad_scores)
          for (int64_t i = e; i < e1; ++i) {
            const int64_t n = int64_t(kk[i] & 0xffffffffu);
            grad_scores[n * K + k] = dot_floats(gy + n * D, t, D);
          }
        e = e1;
      }
    }
  });
}

// The rows-hit backward (see above): -> (grad_scores [N, K] float32 or undefined, rows [U] int64 ascending, values
// [U, D] in the tables' dtype), the U distinct rows hit and their gradients. float32, bfloat16 and float16 tables
// (float64 ones take the dense backward); at most 2^32 - 1 tokens.
std::tuple<at::Tensor, at::Tensor, at::Tensor> lookup_backward_rows_op(const at::Tensor& grad_out,
                                                                       const at::Tensor& rows,
                                                                       const at::Tensor& scores,
                                                                       const at::Tensor& tables,
                                                                       int64_t rows_per_table, bool need_scores) {
  const char* op = "lookup_backward_rows";
  check_lookup_args(rows, scores, tables, rows_per_table, op);
  const int64_t N = rows.size(0), K = rows.size(1), D = tables.size(1);
  TORCH_CHECK(tables.scalar_type() != at::kDouble, "memoryformer.lookup_backward_rows: float64 tables take the "
              "dense backward (lookup_backward)");
  TORCH_CHECK(N < (int64_t(1) << 32), "memoryformer.lookup_backward_rows: at most 2^32 - 1 tokens, got ", N);
  TORCH_CHECK(grad_out.defined(), "memoryformer.lookup_backward_rows: grad_out is undefined");
  check_floating(grad_out, op, "grad_out");
  TORCH_CHECK(grad_out.dim() == 2 && grad_out.size(0) == N && grad_out.size(1) == D,
              "memoryformer.lookup_backward_rows: grad_out must be [N, D] = [", N, ", ", D, "], got ",
              grad_out.sizes());
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t P = rows_per_table, R = K * P;
  if (2 * N >= P) {
    // Half a lookup per row or more: most rows are hit, and the per-row pass below reads grad_y rows at random, far
    // slower than the dense pass (docs/kernel.md). The dense bucketed backward, then its rows hit.
    at::Tensor gscores, gtables;
    std::tie(gscores, gtables) = lookup_backward_op(grad_out, rows, scores, tables, P, true, need_scores);
    std::vector<uint8_t> hit(size_t(R), 0);
    for (int64_t e = 0; e < N * K; ++e) hit[size_t(r[e])] = 1;
    int64_t U = 0;
    for (int64_t i = 0; i < R; ++i) U += hit[size_t(i)];
    auto out_rows = at::empty({U}, rows.options());
    int64_t* o = out_rows.data_ptr<int64_t>();
    for (int64_t i = 0, u = 0; i < R; ++i)
      if (hit[size_t(i)]) o[u++] = i;
    auto values = pooled_empty({U, D}, tables.options(), /*transient=*/true, /*pow2=*/true);
    at::index_select_out(values, gtables, 0, out_rows);
    return {gscores, out_rows, values};
  }
  auto gy = grad_out.to(at::kFloat).contiguous();
  auto s = scores.to(at::kFloat).contiguous();
  // Pass 1: per table, keys (row << 32 | token) sorted, and the count of distinct rows.
  std::vector<uint64_t> keys(size_t(N * K));
  std::vector<int64_t> start(size_t(K + 1), 0);
  uint64_t* kp = keys.data();
  int64_t* sp = start.data();
  parallel_tokens(K, N * K * 16, [=](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      uint64_t* kk = kp + k * N;
      for (int64_t n = 0; n < N; ++n) kk[n] = (uint64_t(r[n * K + k]) << 32) | uint64_t(n);
      std::sort(kk, kk + N);
      int64_t distinct = 0;
      for (int64_t e = 0; e < N; ++e) distinct += (e == 0 || (kk[e] >> 32) != (kk[e - 1] >> 32));
      sp[k + 1] = distinct;
    }
  });
  for (int64_t k = 0; k < K; ++k) start[k + 1] += start[k];
  const int64_t U = start[K];
  auto out_rows = at::empty({U}, rows.options());
  // From the pool (see "gradient memory"): tens of MB for a few hundred tokens, whose first-touch page faults took
  // longer than the kernel; the size changes with the rows hit, hence blocks of a power of two of 2 MB pages.
  auto values = pooled_empty({U, D}, tables.options(), /*transient=*/true, /*pow2=*/true);
  at::Tensor gscores;
  if (need_scores) gscores = at::empty({N, K}, tables.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, tables.scalar_type(), "memoryformer_lookup_bwd_rows", [&] {
    if constexpr (!std::is_same<scalar_t, double>::value)
      backward_rows_kernel<scalar_t>(gy.data_ptr<float>(), r, s.data_ptr<float>(), tables.data_ptr<scalar_t>(), kp,
                                     sp, out_rows.data_ptr<int64_t>(), values.data_ptr<scalar_t>(),
                                     need_scores ? gscores.data_ptr<float>() : nullptr, N, K, D);
  });
  return {gscores, out_rows, values};
}
#line 1 "modeling_memoryformer/csrc/cpu/int8.h"
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
#line 1 "modeling_memoryformer/csrc/cpu/linear_reads.h"
// How the few-row linear reads its weight: bfloat16 rows in pairs of values, and the row pass's prefetch trial.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ few-row reads
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "load_bf16_pairs reads a value pair as one 32-bit word");
typedef uint32_t RawWords __attribute__((vector_size(sizeof(fVec))));

// The 2 * kLanes bfloat16 values at p as float32 vectors of the even ones (p[0], p[2], ...) and the odd ones: a
// bfloat16 value is the high half of its float32, and each 32-bit word holds an even value in its low half.
inline void load_bf16_pairs(const c10::BFloat16* p, fVec& even, fVec& odd) {
  RawWords w;
  std::memcpy(&w, p, sizeof(w));
  const RawWords e = w << 16, o = w & 0xffff0000u;
  std::memcpy(&even, &e, sizeof(e));
  std::memcpy(&odd, &o, sizeof(o));
}

// x [M, D] split as load_bf16_pairs reads a row: per block of 2 * kLanes values, the even ones then the odd ones (the
// D % (2 * kLanes) last values as they are).
inline void split_pairs(const float* x, float* xs, int64_t M, int64_t D) {
  constexpr int64_t P = 2 * kLanes;
  for (int64_t m = 0; m < M; ++m) {
    const float* a = x + m * D;
    float* b = xs + m * D;
    int64_t j = 0;
    for (; j + P <= D; j += P)
      for (int64_t i = 0; i < kLanes; ++i) {
        b[j + i] = a[j + 2 * i];
        b[j + kLanes + i] = a[j + 2 * i + 1];
      }
    for (; j < D; ++j) b[j] = a[j];
  }
}

// The row pass's software prefetches, chosen on the running machine. They cost instructions that the pass otherwise
// spends on its sums, and pay only where the hardware prefetchers do not keep the stream ahead: on the 2-vCPU Intel
// Xeon of docs/performance.md (linear_rows.h) they took a cold bfloat16 head from 30 (the L1 one alone) to 32-36
// GB/s; on the 2-vCPU AMD EPYC Zen 4 of benchmarks/results/2026-11-29f-zen4 (MF-small's 77 MB head, cold, on huge
// pages, the row read in pairs) they cost up to a quarter of the rate: 43.5-45.8 GB/s against 53-58.5 without, where
// a read probe gave 55-64. So the first kPrefetchTrials passes of a kind alternate with and without them, timed, and
// every later pass of that kind takes the faster by median; a kind is the weight's dtype and whether it is larger than
// the last-level cache (the Xeon's L3 served part of a 77 MB head, where this Zen 4's 32 MB L3 holds less than half
// of it, so the answer may differ by size), one choice per kind and process (linear_rows_prefetch says which, or
// fixes one for tests). Either way every output has the same bits: a prefetch moves no value.
constexpr int64_t kPrefetchTrials = 8;

struct PrefetchTrial {
  std::mutex m;
  std::vector<double> seconds_per_byte[2];   // the timed passes, without [0] and with [1] the prefetches
  std::atomic<int> forced{-1};               // linear_rows_prefetch: -1 the trial, 0 without, 1 with
  std::atomic<int> choice{-1};               // the trial's answer; -1 while it runs
};

constexpr int kPrefetchKinds = 4;   // bfloat16 within / beyond the last-level cache, then float32's two

PrefetchTrial& prefetch_trial(int kind) {
  static PrefetchTrial trials[kPrefetchKinds];
  return trials[kind];
}

// The kind of a pass: its weight's dtype, and whether the weight is larger than the last-level cache.
inline int prefetch_kind(bool float_weight, int64_t bytes) { return (float_weight ? 2 : 0) + (bytes > tuning().llc); }

// Whether a pass of the trial's kind takes the prefetches, and the trial's arm it is timed for (-1: not timed; only
// passes on the row loop are).
inline bool linear_prefetch(PrefetchTrial& trial, bool by_row, int& arm) {
  arm = -1;
  const int forced = trial.forced.load(), chosen = trial.choice.load();
  if (forced >= 0) return forced == 1;
  if (!by_row) return false;
  if (chosen >= 0) return chosen == 1;
  std::lock_guard<std::mutex> lock(trial.m);
  arm = trial.seconds_per_byte[0].size() > trial.seconds_per_byte[1].size() ? 1 : 0;
  return arm == 1;
}

inline void record_prefetch_trial(PrefetchTrial& trial, int arm, double seconds_per_byte) {
  std::lock_guard<std::mutex> lock(trial.m);
  auto& mine = trial.seconds_per_byte[arm];
  mine.push_back(seconds_per_byte);
  auto& off = trial.seconds_per_byte[0];
  auto& on = trial.seconds_per_byte[1];
  if (trial.choice.load() >= 0 || int64_t(off.size() + on.size()) < kPrefetchTrials || off.empty() || on.empty())
    return;
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  };
  trial.choice.store(median(on) < median(off) ? 1 : 0);
}
#line 1 "modeling_memoryformer/csrc/cpu/linear_rows.h"
// The few-row linear (the LM head while decoding).
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ few-row linear
// y = x W^T (+ b) for a few rows of x (decoding: the LM head of one token reads a [vocab, d] weight for one row of
// output). The output columns are split over the threads in contiguous ranges (balanced as they run: "the threads'
// shares" below), so the pass streams W once. Two loops, by what bounds them:
// - one weight row at a time (linear_rows_row: M = 1 and 2, and float32 weights): the weight is read as one
//   sequential stream per thread, each output summed in kLinearChains interleaved vector chains, with two software
//   prefetches, into L1 near and into L2 far ahead. On the 2-vCPU Intel Xeon (AMX, L2 2 MB) of docs/performance.md
//   this streams a cold bfloat16 head at 32-36 GB/s where the blocked loop below took 22 (a torch.dot read probe:
//   29-31; its L3 serves part of a re-read head, at up to 57 GB/s either way).
// - R weight rows at a time (linear_rows_block: 3 and 4 rows of bfloat16 x): one sum per (row of x, weight row), M x
//   R chains, each x vector loaded once for R weight rows. With 3-4 rows of x a bfloat16 head is bound by the core
//   (each weight vector widened, then 3-4 multiply-adds, each x vector loaded again per weight row in the loop above),
//   and sharing the x loads over two weight rows keeps the blocked loop 10-15% ahead there (3.3 against 3.8 ms for
//   MF-small's head at 4 rows).
// The sums are kept in registers, as RawVec (prelude.h): GCC kept an earlier kernel's array of sums on the stack (a
// store and a reload per FMA), which bounded a core at about 11 GB/s of bfloat16 weight on the Zen 3 of
// docs/performance.md (docs/kernel.md). A row's sums are in one order whatever the split over threads, so its outputs
// keep their bits; the order differs between the two loops (1-2 rows of x against 3-4 of bfloat16).
constexpr int64_t kLinearMaxRows = 4;   // rows of x handled in registers; the op takes up to this many

// Sums of one block: R weight rows [w, w + R * D) against M rows of x, each reduced to a float after its vector
// chain (then the D % kLanes tail, then the bias) and stored in y's dtype O (float32, or bfloat16 rounded once, as
// the float32 sum's .to(bfloat16)). T: float32, or bfloat16 widened in registers.
template <int64_t M, int64_t R, typename T, typename O>
inline void linear_rows_block(const float* x, const T* w, const float* b, O* y, int64_t D, int64_t V,
                              int64_t v, const T* w_end) {
  constexpr int64_t L = kLanes;
  constexpr int64_t B = R * L * int64_t(sizeof(T));   // bytes of weight one step of j reads
  const int64_t Dv = D - D % L;
  // The block after next, prefetched B bytes per step: the R rows are R streams D values apart, which the hardware
  // prefetcher follows worse than one (on the Zen 3 measured, MF-small's 77 MB head took 4.7-6.2 ms without this,
  // 2.6-2.9 ms with it).
  const char* next = reinterpret_cast<const char*>(w + 2 * R * D);
  const char* next_end = reinterpret_cast<const char*>(std::min(w + 3 * R * D, w_end));
  const auto add = [](fVec& p, fVec& q) { return p + q; };
  // The chains: loops over constants, unrolled by pragma so that GCC keeps the array in registers (left to its own
  // unroller, it unrolled them too late and kept the array on the stack).
  RawVec acc[M * R];   // in registers (RawVec: see prelude.h)
#pragma GCC unroll 8
  for (int64_t i = 0; i < M * R; ++i) acc[i] = raw_vec(fVec(0.f));
  for (int64_t j = 0; j < Dv; j += L, next += B) {
    if (next < next_end)
      for (int64_t c = 0; c < B; c += 64) __builtin_prefetch(next + c);
    fVec xv[M];
#pragma GCC unroll 4
    for (int64_t m = 0; m < M; ++m) xv[m] = fVec::loadu(x + m * D + j);
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) {
      const fVec u = load_floats(w + r * D + j);
#pragma GCC unroll 4
      for (int64_t m = 0; m < M; ++m) acc[m * R + r] = raw_vec(at::vec::fmadd(xv[m], u, from_raw(acc[m * R + r])));
    }
  }
  // The reduction's loops have a runtime tail inside and do not unroll: they read a copy.
  fVec sums[M * R];
#pragma GCC unroll 8
  for (int64_t i = 0; i < M * R; ++i) sums[i] = from_raw(acc[i]);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < R; ++r) {
      float sum = at::vec::vec_reduce_all<float>(add, sums[m * R + r]);
      for (int64_t j = Dv; j < D; ++j) sum += x[m * D + j] * float(w[r * D + j]);
      y[m * V + v + r] = static_cast<O>(b ? sum + b[v + r] : sum);
    }
}

// One weight row at a time: row w [D] against M rows of x, each output summed in kLinearChains vector chains (chain c
// takes vectors c, c + C, c + 2C, ... of the row; then the D % (C * kLanes) vectors on the first chain), the chains
// added as (0 + 1) + (2 + 3), reduced, then the D % kLanes tail and the bias. Prefetches, where the trial takes them
// (linear_reads.h), every cache line of the stream once: into L1 kLinearNearBytes ahead, into L2 kLinearFarBytes ahead
// (on the Xeon above: the near one alone 30 GB/s cold, with the far one 32-36; only the far one, 26-27), both only
// within the thread's range `end`. A bfloat16 row is read in pairs of values (load_bf16_pairs: each vector of 2 *
// kLanes values gives its even and its odd values as two float32 vectors, by a shift and a mask) instead of kLanes
// values widened at a time by a cross-lane zero-extension; x comes split to match (split_pairs), so chain 0 sums the
// even values of each step's first pair of vectors, chain 1 its odd ones, chains 2 and 3 those of the second pair.
// On the 2-vCPU Zen 4 of benchmarks/results/2026-11-29f-zen4 (MF-small's 77 MB head, cold, on huge pages, without
// prefetches; a standalone copy, passes alternated) the widening read 45-48 GB/s where the pairs read 57 and a plain
// read of the same bytes 61-65.
constexpr int64_t kLinearChains = 4;            // chains per output (one, latency-bound, read 24-28 GB/s in a copy)
constexpr int64_t kLinearNearBytes = 2 << 10;   // L2 -> L1 in flight
constexpr int64_t kLinearFarBytes = 16 << 10;   // memory -> L2 in flight (8-32 KB measured the same)

template <int64_t M, bool Prefetch, typename T, typename O>
inline void linear_rows_row(const float* x, const T* w, const float* b, O* y, int64_t D, int64_t V, int64_t v,
                            const char* end) {
  constexpr int64_t L = kLanes, C = kLinearChains, S = C * L;
  constexpr int64_t B = S * int64_t(sizeof(T));   // bytes of weight one step reads
  constexpr bool pairs = std::is_same_v<T, c10::BFloat16>;   // x split by split_pairs
  static_assert(C == 4, "the chains are added as (0 + 1) + (2 + 3) below");
  const int64_t Ds = D - D % S, Dv = D - D % L;
  const char* near = reinterpret_cast<const char*>(w) + kLinearNearBytes;
  const char* far = reinterpret_cast<const char*>(w) + kLinearFarBytes;
  RawVec acc[M * C];   // in registers (RawVec: see prelude.h)
#pragma GCC unroll 16
  for (int64_t i = 0; i < M * C; ++i) acc[i] = raw_vec(fVec(0.f));
  int64_t j = 0;
  for (; j < Ds; j += S, near += B, far += B) {
#pragma GCC unroll 4
    for (int64_t c = 0; c < B; c += 64) {
      if (Prefetch && near + c < end) __builtin_prefetch(near + c);
      if (Prefetch && far + c < end) __builtin_prefetch(far + c, 0, 2);
    }
    fVec u0, u1, u2, u3;   // named, not an array (see RawVec)
    if constexpr (pairs) {
      load_bf16_pairs(w + j, u0, u1);
      load_bf16_pairs(w + j + 2 * L, u2, u3);
    } else {
      u0 = load_floats(w + j);
      u1 = load_floats(w + j + L);
      u2 = load_floats(w + j + 2 * L);
      u3 = load_floats(w + j + 3 * L);
    }
#pragma GCC unroll 4
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * D + j;
      RawVec* a = acc + m * C;
      a[0] = raw_vec(at::vec::fmadd(fVec::loadu(xm), u0, from_raw(a[0])));
      a[1] = raw_vec(at::vec::fmadd(fVec::loadu(xm + L), u1, from_raw(a[1])));
      a[2] = raw_vec(at::vec::fmadd(fVec::loadu(xm + 2 * L), u2, from_raw(a[2])));
      a[3] = raw_vec(at::vec::fmadd(fVec::loadu(xm + 3 * L), u3, from_raw(a[3])));
    }
  }
  if constexpr (pairs) {   // a last pair of vectors, on chains 0 and 1
    if (j + 2 * L <= Dv) {
      fVec e, o;
      load_bf16_pairs(w + j, e, o);
#pragma GCC unroll 4
      for (int64_t m = 0; m < M; ++m) {
        acc[m * C] = raw_vec(at::vec::fmadd(fVec::loadu(x + m * D + j), e, from_raw(acc[m * C])));
        acc[m * C + 1] = raw_vec(at::vec::fmadd(fVec::loadu(x + m * D + j + L), o, from_raw(acc[m * C + 1])));
      }
      j += 2 * L;
    }
  }
  for (; j < Dv; j += L) {
    const fVec u = load_floats(w + j);
#pragma GCC unroll 4
    for (int64_t m = 0; m < M; ++m)
      acc[m * C] = raw_vec(at::vec::fmadd(fVec::loadu(x + m * D + j), u, from_raw(acc[m * C])));
  }
  // The reduction's loop has a runtime tail inside and does not unroll: it reads a copy (indexing the sums by a
  // runtime m kept all of them in memory for two rows of x: 31 against 85 GB/s for one row, hot, on the Zen 4).
  RawVec sums[M * C];
#pragma GCC unroll 16
  for (int64_t i = 0; i < M * C; ++i) sums[i] = acc[i];
  const auto add = [](fVec& p, fVec& q) { return p + q; };
  for (int64_t m = 0; m < M; ++m) {
    const RawVec* a = sums + m * C;
    fVec sum4 = (from_raw(a[0]) + from_raw(a[1])) + (from_raw(a[2]) + from_raw(a[3]));
    float sum = at::vec::vec_reduce_all<float>(add, sum4);
    for (int64_t k = Dv; k < D; ++k) sum += x[m * D + k] * float(w[k]);
    y[m * V + v] = static_cast<O>(b ? sum + b[v] : sum);
  }
}

// T: the weight's dtype (float32, or bfloat16 widened in registers: half the bytes to stream); x and b float32, y
// float32 or T.
//
// The threads' shares. Each thread (a slot) starts with a contiguous range of the weight's rows, as a static split
// would give it, and takes it piece by piece from the front (kLinearPieceBytes of weight a piece); a slot whose range
// is done takes the pieces left at the back of another's. So the pass ends when the rows do, not when the slower
// thread's half does: inside MF-tiny's `generate` on the 2-vCPU Zen 1 of docs/performance.md one thread of the static
// split finished its half 350-800 us after the other in some processes (the head 3.0-3.2 ms against 2.4-2.5 ms where
// the halves kept pace; which half was late moved between processes), and on CPUs with cores of two speeds one half
// always would. A slot's own pieces are contiguous, so its stream and its prefetch run across them as across one
// range. Each output is one weight row's sum, whoever computes it: the same bits on any split. A weight of two pieces
// or more is split, however few its rows: a rule of 1024 rows per slot at least (argmax.h's kLinearGrain, for a row
// of logits) ran a dense model's [768, 3072] and [1024, 4096] matrices (4.7 and 8.4 MB of bfloat16) on one thread, at
// 9-10 GB/s where the split passes read 16-18 on the 2-vCPU Xeon of benchmarks/results/2026-11-29-xeon-amx.
constexpr int64_t kLinearGrain = 1024;              // argmax_rows: logits per thread at least
constexpr int64_t kLinearPieceBytes = 256 << 10;    // weight bytes per piece (rows: a multiple of 8)

// A slot's range of pieces [front, back) in one word, so that its owner (from the front) and another slot (from the
// back) never take the same piece. On its own cache line: the owner takes a piece without sharing one.
struct alignas(64) PieceRange {
  std::atomic<uint64_t> word{0};
  void set(uint64_t front, uint64_t back) { word.store(back << 32 | front, std::memory_order_relaxed); }
  int64_t take(bool from_back) {   // the piece taken, or -1 where none is left
    uint64_t w = word.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t front = w & 0xffffffffu, back = w >> 32;
      if (front >= back) return -1;
      const uint64_t next = from_back ? (back - 1) << 32 | front : back << 32 | (front + 1);
      if (word.compare_exchange_weak(w, next, std::memory_order_relaxed)) return int64_t(from_back ? back - 1 : front);
    }
  }
};

// For tests (memoryformer.linear_rows_balance): slot `delay_slot` starts `delay_us` late, so that the others take its
// pieces; and the pieces the last pass took from another slot's range. Off (-1) unless a test sets it.
std::atomic<int64_t> linear_delay_slot{-1}, linear_delay_us{0}, linear_stolen{0};

template <typename T>
int64_t linear_piece_rows(int64_t D) {
  return std::max<int64_t>(8, kLinearPieceBytes / std::max<int64_t>(1, D * int64_t(sizeof(T))) / 8 * 8);
}

// The slots a pass of V rows runs on (1: no split): linear_rows_kernel's S, which its caller sizes per-slot state by.
template <typename T>
int64_t linear_slots(int64_t D, int64_t V) {
  if (at::in_parallel_region()) return 1;
  const int64_t pieces = (V + linear_piece_rows<T>(D) - 1) / linear_piece_rows<T>(D);
  return std::max<int64_t>(1, std::min(int64_t(at::get_num_threads()), pieces));
}

template <typename T>
int64_t argmax_row(const T* p, int64_t V);   // argmax.h

// chunk(slot, v0, v1) runs after a slot has stored the outputs of rows [v0, v1) (the argmax of those outputs, while
// they sit in that thread's caches); none: nothing.
struct NoChunk {
  void operator()(int64_t, int64_t, int64_t) const {}
};

// The loop (see the top of this part): one weight row at a time, or 2 at a time for 3-4 rows of bfloat16 x.
constexpr bool linear_by_row(int64_t M, bool float_weight) { return M <= 2 || float_weight; }

template <int64_t M, typename T, typename O, typename Chunk = NoChunk>
void linear_rows_kernel(const float* x, const T* w, const float* b, O* y, int64_t D, int64_t V, int64_t S,
                        bool prefetch, const Chunk& chunk = Chunk()) {
  constexpr bool by_row = linear_by_row(M, std::is_same_v<T, float>);
  constexpr int64_t R = 2;
  // Rows [v0, v1) of slot s, prefetching up to `end` (the end of the slot's own range: its next piece).
  const auto rows = [&](int64_t s, int64_t v0, int64_t v1, const T* end) {
    int64_t v = v0;
    if constexpr (by_row) {
      const char* e = reinterpret_cast<const char*>(end);
      if (prefetch) for (; v < v1; ++v) linear_rows_row<M, true>(x, w + v * D, b, y, D, V, v, e);
      else for (; v < v1; ++v) linear_rows_row<M, false>(x, w + v * D, b, y, D, V, v, e);
    } else {
      for (; v + R <= v1; v += R) linear_rows_block<M, R>(x, w + v * D, b, y, D, V, v, end);
      for (; v < v1; ++v) linear_rows_block<M, 1>(x, w + v * D, b, y, D, V, v, end);
    }
    chunk(s, v0, v1);
  };
  if (S == 1) {
    rows(0, 0, V, w + V * D);
    linear_stolen.store(0);
    return;
  }
  const int64_t piece = linear_piece_rows<T>(D), pieces = (V + piece - 1) / piece;
  std::vector<PieceRange> ranges(S);
  for (int64_t s = 0; s < S; ++s) ranges[s].set(pieces * s / S, pieces * (s + 1) / S);
  const int64_t delay_slot = linear_delay_slot.load(), delay_us = linear_delay_us.load();
  std::atomic<int64_t> stolen{0};
  at::parallel_for(0, S, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      if (s == delay_slot) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
      const T* end = w + std::min(V, pieces * (s + 1) / S * piece) * D;
      for (int64_t p; (p = ranges[s].take(false)) >= 0;) rows(s, p * piece, std::min(V, (p + 1) * piece), end);
      for (int64_t o = 1; o < S; ++o)   // then the others' last pieces, the next slot's first
        for (int64_t p; (p = ranges[(s + o) % S].take(true)) >= 0; stolen.fetch_add(1)) {
          const int64_t v1 = std::min(V, (p + 1) * piece);
          rows(s, p * piece, v1, w + v1 * D);
        }
    }
  });
  linear_stolen.store(stolen.load());
}

// The first largest output per row of x over rows [start, end) of the weight (argmax_row's answer: a NaN counts as
// larger than any number), and its value.
struct PieceTop {
  int64_t start, end;
  std::array<int64_t, kLinearMaxRows> index;
  std::array<float, kLinearMaxRows> value;
};

// The answer over a's rows followed by b's (adjacent or not, a first): a's where it is a NaN or b's is not larger.
inline PieceTop first_top(const PieceTop& a, const PieceTop& b, int64_t M) {
  PieceTop c{std::min(a.start, b.start), std::max(a.end, b.end), a.index, a.value};
  for (int64_t m = 0; m < M; ++m) {
    const float u = a.value[m], v = b.value[m];
    if (u == u && (v != v || v > u)) { c.index[m] = b.index[m]; c.value[m] = v; }
  }
  return c;
}

// The answer over the union of the ranges of `tops` (any order, at least one): first_top of them in row order.
inline PieceTop first_top_in_order(std::vector<PieceTop>& tops, int64_t M) {
  std::sort(tops.begin(), tops.end(), [](const PieceTop& a, const PieceTop& b) { return a.start < b.start; });
  PieceTop best = tops[0];
  for (size_t i = 1; i < tops.size(); ++i) best = first_top(best, tops[i], M);
  return best;
}

// y = x W^T (+ b) for x [M, D] with 1 <= M <= kLinearMaxRows, W [V, D], b [V], all float32 or all bfloat16 (see
// linear_rows_kernel): sums in float32, y in their dtype (bfloat16: rounded once, as F.linear), each thread storing
// its own outputs (a float32 y converted afterwards was a second pass over the logits, its halves on the other core).
// linear_rows_op's checks and pass; with `tokens` (int64 [M]) defined, also each row's argmax of the stored outputs
// (argmax_rows_op's answer for y), found per thread chunk right after the chunk is stored.
at::Tensor linear_rows_run(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           at::Tensor* tokens) {
  const char* op = "linear_rows";
  check_cpu_contiguous(x, op, "x");
  check_cpu_contiguous(weight, op, "weight");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && x.scalar_type() == dtype, "memoryformer."
              "linear_rows: x and weight must be both float32 or both bfloat16, got ", x.scalar_type(), " and ", dtype);
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kLinearMaxRows, "memoryformer.linear_rows: x must "
              "be [M, D] with 1 <= M <= ", kLinearMaxRows, ", got shape ", x.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(1), "memoryformer.linear_rows: weight must be "
              "[V, D] with D = ", x.size(1), " (the width of x), got shape ", weight.sizes());
  const int64_t M = x.size(0), D = x.size(1), V = weight.size(0);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    check_cpu_contiguous(*bias, op, "bias");
    TORCH_CHECK(bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == V,
                "memoryformer.linear_rows: bias must be ", dtype, " [V] = [", V, "] (the weight's dtype), got ",
                bias->scalar_type(), " of shape ", bias->sizes());
    b = bias->to(at::kFloat);
  }
  auto xf = x.to(at::kFloat);
  if (dtype == at::kBFloat16 && linear_by_row(M, false)) {   // the row pass reads bfloat16 in pairs: x split to match
    auto xs = at::empty_like(xf);
    split_pairs(xf.data_ptr<float>(), xs.data_ptr<float>(), M, D);
    xf = xs;
  }
  auto y = at::empty({M, V}, x.options());
  const float* xp = xf.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  auto pass = [&](auto* wp, int64_t S, const auto& chunk) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(wp)>>;
    T* yp = y.data_ptr<T>();
    const int64_t bytes = V * D * int64_t(sizeof(T));
    PrefetchTrial& trial = prefetch_trial(prefetch_kind(std::is_same_v<T, float>, bytes));
    int arm;
    const bool prefetch = linear_prefetch(trial, linear_by_row(M, std::is_same_v<T, float>), arm);
    const auto start = std::chrono::steady_clock::now();
    switch (M) {
      case 1: linear_rows_kernel<1>(xp, wp, bp, yp, D, V, S, prefetch, chunk); break;
      case 2: linear_rows_kernel<2>(xp, wp, bp, yp, D, V, S, prefetch, chunk); break;
      case 3: linear_rows_kernel<3>(xp, wp, bp, yp, D, V, S, prefetch, chunk); break;
      default: linear_rows_kernel<4>(xp, wp, bp, yp, D, V, S, prefetch, chunk); break;
    }
    if (arm >= 0)
      record_prefetch_trial(trial, arm, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()
                                            / double(bytes));
  };
  auto run = [&](auto* wp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(wp)>>;
    const int64_t S = linear_slots<T>(D, V);
    if (tokens == nullptr) return pass(wp, S, NoChunk());
    // Every piece's first largest per row, found right after the piece is stored, merged into the slot's runs of
    // adjacent pieces (a slot takes its own in order and another's backwards), then the runs in row order: the first
    // NaN, else the first of the largest (a later range only where strictly larger), as argmax_rows.
    const T* yp = y.data_ptr<T>();
    std::vector<std::vector<PieceTop>> tops(S);
    pass(wp, S, [&](int64_t s, int64_t v0, int64_t v1) {
      PieceTop top{v0, v1, {}, {}};
      for (int64_t m = 0; m < M; ++m) {
        top.index[m] = v0 + argmax_row(yp + m * V + v0, v1 - v0);
        top.value[m] = float(yp[m * V + top.index[m]]);
      }
      auto& mine = tops[s];
      if (!mine.empty() && mine.back().end == v0) mine.back() = first_top(mine.back(), top, M);
      else if (!mine.empty() && mine.back().start == v1) mine.back() = first_top(top, mine.back(), M);
      else mine.push_back(top);
    });
    std::vector<PieceTop> all;
    for (const auto& mine : tops) all.insert(all.end(), mine.begin(), mine.end());
    const PieceTop best = first_top_in_order(all, M);
    *tokens = at::empty({M}, x.options().dtype(at::kLong));
    std::copy(best.index.begin(), best.index.begin() + M, tokens->data_ptr<int64_t>());
  };
  if (dtype == at::kFloat) run(weight.data_ptr<float>());
  else run(weight.data_ptr<c10::BFloat16>());
  return y;
}

at::Tensor linear_rows_op(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return linear_rows_run(x, weight, bias, nullptr);
}

// (linear_rows(x, weight, bias), argmax_rows of it) in one pass: a greedy decode step's logits and tokens, the argmax
// of each thread's outputs taken while they sit in its caches (a separate argmax_rows call after MF-small's head took
// 150-160 us on 2 Zen 1 cores against 40-50 us on the same logits warm: its code and data evicted by the head).
std::tuple<at::Tensor, at::Tensor> linear_rows_argmax_op(const at::Tensor& x, const at::Tensor& weight,
                                                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() != 2 || weight.size(0) >= 1, "memoryformer.linear_rows_argmax: the weight has no rows "
              "(shape ", weight.sizes(), "): an argmax needs at least one output column");
  at::Tensor tokens;
  at::Tensor y = linear_rows_run(x, weight, bias, &tokens);
  return {y, tokens};
}
#line 1 "modeling_memoryformer/csrc/cpu/argmax.h"
// The argmax of each row of the logits (a greedy decode step's tokens).
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define (linear_rows.h: PieceTop,
// first_top_in_order, kLinearGrain; its fused head pass calls argmax_row, declared there).

// ------------------------------------------------------------------------------------------------ argmax of rows
// torch.argmax(x, -1) for x [N, V] (contiguous rows; float32, bfloat16 or float16; V >= 1), the token a greedy
// decode step picks from the head's logits: per row the index of the first largest value, a NaN counting as larger
// than any number (so the first NaN's index), as ATen's argmax. One vector pass finds the largest value (NaN
// propagating), a scan from the start its first index: about 15 us over a 50K vocabulary where ATen's reduction,
// which carries an index per value, takes about 90 us on 2 Zen 1 cores, and a bfloat16 row needs no float32 copy.
template <typename T>
int64_t argmax_row(const T* p, int64_t V) {
  auto top = [](float a, float b) { return a != a || b != b ? std::numeric_limits<float>::quiet_NaN() : std::max(a, b); };
  float best = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  if (V >= 4 * kLanes) {   // four independent chains of maxima (the largest value is one whatever the grouping)
    fVec l0(best), l1(best), l2(best), l3(best);
    for (; j + 4 * kLanes <= V; j += 4 * kLanes) {
      l0 = at::vec::maximum(l0, load_floats(p + j));
      l1 = at::vec::maximum(l1, load_floats(p + j + kLanes));
      l2 = at::vec::maximum(l2, load_floats(p + j + 2 * kLanes));
      l3 = at::vec::maximum(l3, load_floats(p + j + 3 * kLanes));
    }
    float values[kLanes];
    at::vec::maximum(at::vec::maximum(l0, l1), at::vec::maximum(l2, l3)).store(values);
    for (int64_t l = 0; l < kLanes; ++l) best = top(best, values[l]);
  }
  for (; j < V; ++j) best = top(best, float(p[j]));
  // The first index holding it: whole vectors compared at once, then the lanes of the first that has it.
  const bool nan = best != best;
  const fVec bv(best);
  int64_t i = 0;
  for (; i + kLanes <= V; i += kLanes) {
    const fVec v = load_floats(p + i);
    const int hits = ~(nan ? v.isnan() : (v == bv)).zero_mask() & ((1 << kLanes) - 1);
    if (hits) return i + __builtin_ctz(static_cast<unsigned>(hits));
  }
  for (; i < V; ++i) {
    const float v = float(p[i]);
    if (nan ? v != v : v == best) return i;
  }
  return 0;   // not reached: best is one of the values
}

// argmax_row over p[0, V) as the threads split it: each chunk of at::parallel_for(0, V, kLinearGrain) (the shares the
// few-row pass's threads start from, so that each thread mostly reads the logits it wrote) finds its first largest,
// and the chunks' answers are combined in order as the few-row pass combines its pieces' (first_top_in_order: the
// first NaN, else the first of the largest). On one thread, or a row of under 2 * kLinearGrain, argmax_row itself.
template <typename T>
int64_t argmax_row_split(const T* p, int64_t V) {
  if (V < 2 * kLinearGrain || at::get_num_threads() == 1 || at::in_parallel_region()) return argmax_row(p, V);
  std::mutex mutex;
  std::vector<PieceTop> found;   // each chunk's range, first largest and its value
  at::parallel_for(0, V, kLinearGrain, [&](int64_t v0, int64_t v1) {
    PieceTop top{v0, v1, {}, {}};
    top.index[0] = v0 + argmax_row(p + v0, v1 - v0);
    top.value[0] = float(p[top.index[0]]);
    std::lock_guard<std::mutex> lock(mutex);
    found.push_back(top);
  });
  return first_top_in_order(found, 1).index[0];
}

at::Tensor argmax_rows_op(const at::Tensor& x) {
  check_cpu_contiguous(x, "argmax_rows", "x");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.size(1) >= 1 && (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf),
              "memoryformer.argmax_rows: x must be float32, bfloat16 or float16 [N, V] with V >= 1, got ", dtype,
              " of shape ", x.sizes());
  const int64_t N = x.size(0), V = x.size(1);
  auto out = at::empty({N}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  auto rows = [&](const auto* p) {
    for (int64_t n = 0; n < N; ++n) o[n] = argmax_row_split(p + n * V, V);
  };
  if (dtype == at::kFloat) rows(x.data_ptr<float>());
  else if (dtype == at::kBFloat16) rows(x.data_ptr<c10::BFloat16>());
  else rows(x.data_ptr<c10::Half>());
  return out;
}
#line 1 "modeling_memoryformer/csrc/cpu/attention.h"
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
#line 1 "modeling_memoryformer/csrc/cpu/kv_growth.h"
// A KV cache's growth by one position (the decode stack's DynamicCache layers).
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ KV buffer pool
// The buffers grow_cache makes, kept when their tensors are freed (up to kKeptBytes in all) for the next ones of
// about their size: a generate call's KV buffers otherwise come from the C library's allocator, which maps anything
// over 128 KB afresh from the kernel and unmaps it when freed, so every call faulted each page of its buffers in again
// as it wrote them. MF-base bf16 (batch 1: 48 buffers of 166 KB), at::empty against this pool in one process,
// alternating call by call on the 2-vCPU AMD EPYC Zen 4 of docs/performance.md: 1,890 minor page faults per 33-token
// `generate` call and 240.0 ms a call, against 0 and 229.2 ms (benchmarks/results/2026-11-29b-zen4).
constexpr size_t kKeptBytes = size_t(64) << 20;

class BufferPool {
 public:
  // A block of at least `bytes` (64-byte aligned, nullptr where none can be had): a kept one of at most 5/4 of that
  // size, else a new one. `size`: the block's size, for give().
  void* take(size_t bytes, size_t& size) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = kept_.lower_bound(bytes);
      if (it != kept_.end() && it->first <= bytes + bytes / 4) {
        size = it->first;
        void* block = it->second;
        held_ -= size;
        kept_.erase(it);
        return block;
      }
    }
    size = (bytes + 4095) & ~size_t(4095);
    void* block = nullptr;
    return posix_memalign(&block, 64, size) == 0 ? block : nullptr;
  }

  // Keeps a block of `size` bytes, the largest kept ones freed to make room for it (the C library's free where it is
  // larger than kKeptBytes itself).
  void give(void* block, size_t size) {
    std::vector<void*> dropped;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (size <= kKeptBytes) {
        while (held_ + size > kKeptBytes) {
          const auto last = std::prev(kept_.end());
          held_ -= last->first;
          dropped.push_back(last->second);
          kept_.erase(last);
        }
        kept_.emplace(size, block);
        held_ += size;
        block = nullptr;
      }
    }
    for (void* d : dropped) std::free(d);
    std::free(block);
  }

 private:
  std::mutex mutex_;
  std::multimap<size_t, void*> kept_;
  size_t held_ = 0;
};

// Never destroyed: a buffer's tensor may be freed after the library's statics are (at interpreter exit).
BufferPool& buffer_pool() {
  static BufferPool* pool = new BufferPool();
  return *pool;
}

// at::empty(sizes, options) (contiguous, CPU) on a block of the pool, which takes it back when the tensor's storage is
// freed.
at::Tensor pooled_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  size_t bytes = c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  for (const int64_t s : sizes) bytes *= static_cast<size_t>(s);
  size_t size = 0;
  void* block = buffer_pool().take(std::max<size_t>(bytes, 1), size);
  if (block == nullptr) return at::empty(sizes, options);   // ATen's allocator says what went wrong
  return at::from_blob(block, sizes, [size](void* b) { buffer_pool().give(b, size); }, options);
}

// ------------------------------------------------------------------------------------------------ KV cache growth
// grow_cache's growth once decided (`in_place` or a new buffer), the new position read from `src` (bytes; element
// strides n_stride, h_stride and j_stride over [N, H, D]).
at::Tensor grow_cache_from(const at::Tensor& cache, const char* src, int64_t n_stride, int64_t h_stride,
                           int64_t j_stride, bool in_place) {
  const int64_t N = cache.size(0), H = cache.size(1), T = cache.size(2), D = cache.size(3);
  const int64_t esize = static_cast<int64_t>(cache.element_size());
  at::Tensor buffer;
  int64_t C = D > 0 ? cache.stride(1) / D : 0;
  if (in_place) {
    buffer = cache;
  } else {
    C = T + 1 + std::max<int64_t>(64, (T + 1) / 4);
    buffer = pooled_empty({N, H, C, D}, cache.options());
    buffer.narrow(2, 0, T).copy_(cache);
  }
  char* base = static_cast<char*>(buffer.data_ptr());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) {
      char* dst = base + ((n * H + h) * C + T) * D * esize;
      const char* from = src + (n * n_stride + h * h_stride) * esize;
      if (j_stride == 1) {
        std::memcpy(dst, from, D * esize);
      } else {
        for (int64_t j = 0; j < D; ++j) std::memcpy(dst + j * esize, from + j * j_stride * esize, esize);
      }
    }
  return buffer.as_strided({N, H, T + 1, D}, {H * C * D, C * D, D, 1}, 0);
}

// Whether grow_cache may write the new position of `cache` in place: `owned` (see grow_cache, below), a buffer of
// the layout grow_cache makes ([N, H, C, D] contiguous, the view at its start) with room past T.
bool grows_in_place(const at::Tensor& cache, bool owned) {
  const int64_t N = cache.size(0), H = cache.size(1), T = cache.size(2), D = cache.size(3);
  const int64_t esize = static_cast<int64_t>(cache.element_size());
  const int64_t room = D > 0 ? cache.stride(1) / D : 0;   // positions per head the buffer holds
  return owned && D > 0 && cache.stride(3) == 1 && cache.stride(2) == D && cache.stride(1) == room * D &&
         cache.stride(0) == H * room * D && room > T && cache.storage_offset() == 0 &&
         static_cast<int64_t>(cache.storage().nbytes()) >= N * H * room * D * esize;
}

// A layer's keys or values [N, H, T, D] grown by one position `part` ([N, H, 1, D], any strides), with the values
// torch.cat([cache, part], dim=-2) has. The result is a view [N, H, T + 1, D] of a buffer with room for more
// positions (head stride C * D, C > T): where `owned` (the caller's word that `cache` is the view this op returned
// last for its buffer, and that nothing has grown that buffer since) and the buffer has room, the new position is
// written in place into the room past T, which no view of length T sees; else a new buffer of C = T + 1 +
// max(64, (T + 1) / 4) positions gets the cache's values and the new position (a copy every 64 or more steps instead
// of the whole cache on every step, as torch.cat costs).
at::Tensor grow_cache(const at::Tensor& cache, const at::Tensor& part, bool owned) {
  const int64_t N = cache.size(0), H = cache.size(1), D = cache.size(3);
  TORCH_CHECK(part.dim() == 4 && part.size(0) == N && part.size(1) == H && part.size(2) == 1 && part.size(3) == D &&
              part.scalar_type() == cache.scalar_type(), "memoryformer.decode_stack: a new key or value must be [",
              N, ", ", H, ", 1, ", D, "] in the cache's dtype, got ", part.sizes());
  const bool in_place = grows_in_place(cache, owned);
  return grow_cache_from(cache, static_cast<const char*>(part.data_ptr()), part.stride(0), part.stride(1),
                         part.stride(3), in_place);
}
#line 1 "modeling_memoryformer/csrc/cpu/layer_norm.h"
// The decode ops' layer norm: ATen's values, without ATen's call where they can be had here.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ layer norm
// A decode step takes three layer norms per decoder layer of one row each. Through ATen (at::native::layer_norm_cpu,
// the kernel of nn.LayerNorm) each took 2.6-2.8 us inside a step of MF-base bfloat16 and 1.6 us warm (three tensors
// allocated, the dispatch stub, code evicted by the step's table and LM head streams), 200-210 us of a 5 ms step
// (benchmarks/results/2026-11-29h-zen4). For bfloat16 rows on x86 CPUs with FMA, rows_layer_norm_bf16 computes the
// same values here: ATen registers no AVX-512 variant of its layer norm kernel, so every x86 CPU with AVX2 runs the
// AVX2 one, which this transcribes operation by operation:
// - the moments (ATen/native/cpu/moments_utils.h, RowwiseMoments): Welford over vectors of 16 bfloat16 values (two
//   vectors of 8 floats each, their own running moments), chunks of 16 vectors merged into a cascade of 8-lane moments,
//   the values past the last whole vector added one by one, then the 8 lanes merged in order;
// - the output: (x * rstd + (-rstd * mean)) * gamma + beta in float32, each multiply-add fused (as GCC contracts
//   ATen's vector expression), rounded to bfloat16 to nearest even (a NaN to 0xffff, as ATen's AVX2 conversion).
// ATen builds with GCC's default contraction, so each multiply-add that its compiled kernel fuses is std::fma here,
// and each that it leaves apart (a product with another use) is kept apart by a volatile store.
// Whether a width gives ATen's bits is checked once per width and process (layer_norm_verified): 16 rows of spread
// values through both, bit for bit; a mismatch (another torch, ATEN_CPU_CAPABILITY=default, another compiler) sends
// every later call to ATen. Other dtypes, rows without a weight and bias, and autocast go to ATen too.

// ATen's AddMomentsVec on one 8-lane vector: the moments (m0, m1, m2) merged with (m0_add, a1, a2).
inline void add_moments8(int64_t m0_add, const float* a1, const float* a2, int64_t& m0, float* m1, float* m2) {
  const int64_t n = m0 + m0_add;
  const float c = n == 0 ? 0.f : float(m0_add) / float(n);
  const float f0 = float(m0);
  for (int l = 0; l < 8; ++l) {
    const float delta = a1[l] - m1[l];
    const float tmp = m2[l] + a2[l];
    volatile float cd_stored = c * delta;   // ATen's c * delta, also a factor of the fused m2: m1's sum not fused
    const float cd = cd_stored;
    m1[l] = m1[l] + cd;
    m2[l] = std::fma(delta * f0, cd, tmp);
  }
  m0 = n;
}

// (mean, biased variance) of X[0, N) as ATen's AVX2 RowwiseMoments<BFloat16> computes them.
inline std::pair<float, float> rowwise_moments_bf16(const c10::BFloat16* X, int64_t N) {
  constexpr int64_t kVec = 16, kChunk = 16, kDepth = 64;
  const int64_t n = N / kVec, m = (n + kChunk - 1) / kChunk;
  int64_t depth = 0;   // utils::CeilLog2(m), which gives 1 for m <= 2: depths 0 and 1 run the same
  while (m > 1 && (int64_t(1) << depth) < m) ++depth;
  int64_t m0s[kDepth] = {0};
  float m1s[kDepth][8] = {}, m2s[kDepth][8] = {};
  for (int64_t i = 0; i < m; ++i) {
    const c10::BFloat16* xp = X + i * kChunk * kVec;
    const int64_t m0 = std::min(kChunk, n - i * kChunk);
    float a1[kVec] = {}, a2[kVec] = {};
    for (int64_t j = 0; j < m0; ++j) {
      const float c = 1.f / float(j + 1);
      const c10::BFloat16* xj = xp + j * kVec;
      for (int64_t l = 0; l < kVec; ++l) {
        const float x = float(xj[l]);
        const float d0 = x - a1[l];
        a1[l] = std::fma(d0, c, a1[l]);
        a2[l] = std::fma(d0, x - a1[l], a2[l]);
      }
    }
    add_moments8(m0, a1, a2, m0s[0], m1s[0], m2s[0]);
    add_moments8(m0, a1 + 8, a2 + 8, m0s[0], m1s[0], m2s[0]);
    int64_t mask = i + 1;
    for (int64_t j = 1; j < depth && (mask & 1) == 0; ++j) {
      add_moments8(m0s[j - 1], m1s[j - 1], m2s[j - 1], m0s[j], m1s[j], m2s[j]);
      m0s[j - 1] = 0;
      for (int l = 0; l < 8; ++l) m1s[j - 1][l] = m2s[j - 1][l] = 0.f;
      mask >>= 1;
    }
  }
  for (int64_t i = 1; i < depth; ++i) add_moments8(m0s[i], m1s[i], m2s[i], m0s[0], m1s[0], m2s[0]);
  int64_t m0 = 0;
  float m1 = 0.f, m2 = 0.f;
  for (int64_t i = n * kVec; i < N; ++i) {
    const float x = float(X[i]);
    const float delta = x - m1;
    ++m0;
    m1 += delta / float(m0);
    m2 = std::fma(delta, x - m1, m2);
  }
  const int64_t m0_add = n * kVec / 8;
  for (int l = 0; l < 8; ++l) {   // ATen's scalar AddMoments
    const int64_t total = m0 + m0_add;
    const float c = total == 0 ? 0.f : float(m0_add) / float(total);
    const float delta = m1s[0][l] - m1;
    m1 = std::fma(c, delta, m1);
    m2 = m2 + std::fma(delta * delta * c, float(m0), m2s[0][l]);
    m0 = total;
  }
  return {m1, m2 / float(N)};
}

inline uint16_t bf16_bits_rounded(float y) {   // to nearest even; a NaN to 0xffff (ATen's AVX2 cvtfp32_bf16)
  uint32_t u;
  std::memcpy(&u, &y, sizeof(u));
  if (y != y) return 0xffff;
  return uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

// y[r] = layer_norm(x[r]) over rows of N bfloat16 values (all contiguous, weight and bias [N]).
void rows_layer_norm_bf16(const c10::BFloat16* x, const c10::BFloat16* weight, const c10::BFloat16* bias, float eps,
                          int64_t rows, int64_t N, c10::BFloat16* y) {
  prefetch_span(weight, N);   // cold after the step's streams: their reads overlap the moments' sums
  prefetch_span(bias, N);
  for (int64_t r = 0; r < rows; ++r) {
    const c10::BFloat16* xr = x + r * N;
    const auto [mean, var] = rowwise_moments_bf16(xr, N);
    const float rstd = 1.f / std::sqrt(var + eps);
    const float shift = -rstd * mean;
    uint16_t* out = reinterpret_cast<uint16_t*>(y + r * N);
    for (int64_t d = 0; d < N; ++d)
      out[d] = bf16_bits_rounded(std::fma(std::fma(float(xr[d]), rstd, shift), float(weight[d]), float(bias[d])));
  }
}

// Set when a width's check fails: every later call goes to ATen.
std::atomic<bool> layer_norm_check_failed{false};

// Whether rows_layer_norm_bf16 gives ATen's bits for width N here (checked at the first call for N).
bool layer_norm_check(int64_t N, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  static std::mutex m;
  static std::map<int64_t, bool> known;
  if (layer_norm_check_failed.load()) return false;
  std::lock_guard<std::mutex> lock(m);
  const auto it = known.find(N);
  if (it != known.end()) return it->second;
  constexpr int64_t kRows = 16;
  auto x = at::empty({kRows, N}, weight.options());
  auto* xp = x.data_ptr<c10::BFloat16>();
  uint64_t state = 0x9e3779b97f4a7c15ull ^ uint64_t(N);
  for (int64_t r = 0; r < kRows; ++r) {   // rows of several scales and offsets, a few of large values
    const float scale = std::ldexp(1.f, int(r % 8) * 3 - 10), offset = float(r % 3) * scale * 4.f;
    for (int64_t d = 0; d < N; ++d) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      const float u = float(state >> 40) / float(1 << 24) - 0.5f;
      xp[r * N + d] = c10::BFloat16(offset + u * scale * (d % 17 == 0 ? 40.f : 1.f));
    }
  }
  const auto ref = std::get<0>(at::native::layer_norm_cpu(x, {N}, weight, bias, eps));
  auto out = at::empty_like(x);
  rows_layer_norm_bf16(xp, weight.data_ptr<c10::BFloat16>(), bias.data_ptr<c10::BFloat16>(), float(eps), kRows, N,
                       out.data_ptr<c10::BFloat16>());
  const bool same = std::memcmp(ref.data_ptr(), out.data_ptr(), size_t(kRows * N) * sizeof(c10::BFloat16)) == 0;
  known.emplace(N, same);
  if (!same) layer_norm_check_failed.store(true);
  return same;
}

bool layer_norm_verified(int64_t N, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  static thread_local int64_t last_verified[2] = {0, 0};   // this thread's last widths found verified
  if ((N == last_verified[0] || N == last_verified[1]) && !layer_norm_check_failed.load(std::memory_order_relaxed))
    return true;
  const bool verified = layer_norm_check(N, weight, bias, eps);
  if (verified) {
    last_verified[1] = last_verified[0];
    last_verified[0] = N;
  }
  return verified;
}

// Whether rows_layer_norm_bf16 applies to x, weight and bias: a build for x86 with FMA, contiguous bfloat16 rows of
// N >= 1 values, weight and bias [N] of that dtype.
bool layer_norm_rows_apply(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& bias) {
#if defined(__x86_64__) && defined(__FMA__)
  const int64_t N = x.dim() >= 1 ? x.size(-1) : 0;
  const auto fits = [&](const std::optional<at::Tensor>& t) {
    return t.has_value() && t->defined() && t->scalar_type() == at::kBFloat16 && t->dim() == 1 && t->size(0) == N &&
           t->is_contiguous() && t->device().is_cpu();
  };
  return N > 0 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.device().is_cpu() && fits(weight) &&
         fits(bias);
#else
  return false;
#endif
}

// rows_layer_norm_bf16 on x into a new tensor, or into *into (made anew where it is not of x's shape and dtype).
at::Tensor layer_norm_rows(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps,
                           at::Tensor* into = nullptr) {
  const int64_t N = x.size(-1);
  at::Tensor y = into != nullptr ? *into : at::Tensor();
  if (!y.defined() || y.sizes() != x.sizes() || y.scalar_type() != x.scalar_type())
    y = at::empty(x.sizes(), x.options());
  rows_layer_norm_bf16(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(), bias.data_ptr<c10::BFloat16>(),
                       float(eps), x.numel() / N, N, y.data_ptr<c10::BFloat16>());
  if (into != nullptr) *into = y;
  return y;
}

// ATen's layer_norm over the last dimension of a CPU tensor (the values of nn.LayerNorm): rows_layer_norm_bf16 where
// it applies and its width is verified, else ATen's CPU kernel called directly (at::layer_norm is composite: it calls
// native_layer_norm through the dispatcher, which calls this, so the values are its values without two dispatches).
// For the decode ops, which run below autograd (under CPU autocast, which casts layer_norm's inputs, the dispatched
// call). `into` (optional): a contiguous tensor of x's shape and dtype that the rows path writes and returns instead of
// a new one (a decode step's scratch: an allocation cost about 0.5 us per norm there).
at::Tensor aten_layer_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& bias, double eps, at::Tensor* into = nullptr) {
  if (at::autocast::is_autocast_enabled(at::kCPU)) return at::layer_norm(x, {x.size(-1)}, weight, bias, eps);
  if (layer_norm_rows_apply(x, weight, bias) && layer_norm_verified(x.size(-1), *weight, *bias, eps))
    return layer_norm_rows(x, *weight, *bias, eps, into);
  return std::get<0>(at::native::layer_norm_cpu(x, {x.size(-1)}, weight, bias, eps));
}

// The op: aten_layer_norm on a CPU tensor (path "auto"), or one of its two paths: "rows" (rows_layer_norm_bf16,
// unverified; refused where it does not apply) or "aten" (ATen's kernel). Tests compare each with torch.layer_norm.
at::Tensor decode_layer_norm_op(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                const std::optional<at::Tensor>& bias, double eps, c10::string_view path) {
  const char* op = "memoryformer.decode_layer_norm";
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1, op, ": x must be a CPU tensor of at least one dimension, got ",
              x.sizes());
  TORCH_CHECK(path == "auto" || path == "rows" || path == "aten", op, ": path must be 'auto', 'rows' or 'aten', got '",
              std::string(path), "'");
  if (path == "aten") return std::get<0>(at::native::layer_norm_cpu(x, {x.size(-1)}, weight, bias, eps));
  if (path == "auto") return aten_layer_norm(x, weight, bias, eps);
  TORCH_CHECK(layer_norm_rows_apply(x, weight, bias), op, ": the 'rows' path takes contiguous bfloat16 rows with a "
              "bfloat16 weight and bias of their width, in a build for x86 with FMA (isa AVX2 or AVX512); got ",
              x.scalar_type(), " ", x.sizes(), " on ", MEMORYFORMER_ISA, " (use path 'auto')");
  return layer_norm_rows(x, *weight, *bias, eps);
}
#line 1 "modeling_memoryformer/csrc/cpu/decode_layer.h"
// A decoder layer's decode step in two calls: decode_qkv and decode_block.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ decode layer
// A decode step runs about 25 small ops per decoder layer (norms, hashes, lookups, the rotation, views, residual
// adds) through the Python module tree, each a few microseconds of dispatch for a few hundred bytes of work, while
// the layer's bytes (its K table rows per Memory Layer) take about 100 us: most of a step of MF-small went to the
// calls. Here the layer is two calls around the KV cache update and the attention, which stay in Python (the cache
// may be any transformers Cache):
//   decode_qkv:   input norm -> Q/K/V Memory Layer -> rotary on the Q and K heads             (before the cache)
//   decode_block: + attention output -> post-attention norm -> Memory Block -> + residual      (after the attention)
// Every step is the op the Python modules run, in their order and dtype (ATen's layer_norm and add, the kernel's hash
// and lookup, the rotation with the roundings of its element-wise ops), so the layer's output is bit-identical to the
// modules' (tests compare the two).

// The block norm: "layernorm" (ATen's layer_norm, as nn.LayerNorm; into: see aten_layer_norm) or "rmsnorm"
// (MemoryFormerRMSNorm's ops).
at::Tensor decode_norm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       double eps, c10::string_view kind, at::Tensor* into = nullptr) {
  if (kind == "rmsnorm") {
    const auto dtype = x.scalar_type();
    auto h = x.to(at::promote_types(dtype, at::kFloat));
    h = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
    return weight * h.to(dtype);
  }
  TORCH_CHECK(kind == "layernorm", "memoryformer.decode_layer: unknown norm '", std::string(kind), "' (the config's "
              "norm_type takes 'layernorm' or 'rmsnorm')");
  return aten_layer_norm(x, weight, bias, eps, into);
}

// A Memory Layer on x [N, d] (contiguous): the hash and lookup ops (memory_ops.inference_lookup), or the hash and
// int8_lookup ops on an int8 block (uint8 [K * 2**tau, D + 8], quantization.int8_inference_lookup).
at::Tensor decode_memory_layer(const at::Tensor& x, const at::Tensor& tables, const std::optional<at::Tensor>& bias,
                               int64_t tau, c10::string_view score, double temperature) {
  auto [rows, scores] = hash_op(x, tau, score, temperature);
  const int64_t per_table = tables.size(0) / rows.size(1);
  if (tables.scalar_type() == at::kByte)
    return int8_lookup_op(rows, scores.to(at::kFloat), tables, bias, per_table).to(x.scalar_type());
  return lookup_op(rows, scores, tables, bias, per_table);
}

// The rotary embedding in place on the first r dims of each of the `heads` heads (of width D) of one token's row,
// as rotate_in_place_: x_rot * cos + rotate_half(x_rot) * sin, each product and the sum rounded to T as the three
// element-wise ops round them (a 16-bit T computes each in float32 and rounds it to T, which leaves no product to fuse
// into the sum; float32 products are stored before the sum, so that no fused multiply-add changes a bit). The two
// halves in separate loops (rotate_half's sign, no branch per value). With volatile stores on the 16-bit path too,
// the rotation took 1.7 us per layer of MF-small (24 heads of 16 rotated dims), about 20 us of a decode step.
template <typename T>
void rotate_heads(T* x, const T* cos, const T* sin, int64_t heads, int64_t D, int64_t r) {
  using A = typename Acc<T>::type;
  const int64_t half = r / 2;
  A rotated[512];
  const auto rotate = [&](const T* xh, int64_t j, A other) {
    if constexpr (std::is_same_v<T, A>) {
      volatile A a = xh[j] * cos[j];
      volatile A b = other * sin[j];
      return A(a + b);
    } else {
      const A a = A(T(A(xh[j]) * A(cos[j])));
      const A b = A(T(other * A(sin[j])));
      return A(T(a + b));
    }
  };
  for (int64_t h = 0; h < heads; ++h) {
    T* xh = x + h * D;
    for (int64_t j = 0; j < half; ++j) rotated[j] = rotate(xh, j, -A(xh[j + half]));
    for (int64_t j = half; j < r; ++j) rotated[j] = rotate(xh, j, A(xh[j - half]));
    for (int64_t j = 0; j < r; ++j) xh[j] = T(rotated[j]);
  }
}

// The Q and K heads of qkv [N, 3d] (contiguous) rotated in place by cos and sin ([N or 1, 1, r], checked by the
// caller), `num_heads` heads of d / num_heads each.
void rotate_qk(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads) {
  const int64_t N = qkv.size(0), d = qkv.size(1) / 3, D = d / num_heads, r = cos.size(-1);
  if (r == 0) return;
  const auto c = cos.contiguous(), s = sin.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "memoryformer_decode_qkv", [&] {
    for (int64_t n = 0; n < N; ++n) {
      const int64_t pos = c.size(0) == 1 ? 0 : n;
      rotate_heads<scalar_t>(qkv.data_ptr<scalar_t>() + n * 3 * d, c.data_ptr<scalar_t>() + pos * r,
                             s.data_ptr<scalar_t>() + pos * r, 2 * num_heads, D, r);
    }
  });
}

// Whether cos and sin are what decode_qkv rotates N rows of heads of width D by: [N or 1, 1, r] in `dtype`, r even,
// r <= D and r <= 512.
bool rotary_fits(const at::Tensor& cos, const at::Tensor& sin, int64_t N, int64_t D, at::ScalarType dtype) {
  if (cos.dim() != 3) return false;
  const int64_t r = cos.size(-1);
  return sin.sizes() == cos.sizes() && (cos.size(0) == N || cos.size(0) == 1) && cos.size(1) == 1 && r % 2 == 0 &&
         r <= D && r <= 512 && cos.scalar_type() == dtype && sin.scalar_type() == dtype;
}

// x [N, d] (one position of N sequences) -> [N, 3d] = the Q/K/V Memory Layer on norm(x), Q and K rotated by cos
// and sin ([N or 1, 1, r], r <= head_dim, even) over `num_heads` heads each.
at::Tensor decode_qkv_op(const at::Tensor& x, const at::Tensor& norm_weight, const std::optional<at::Tensor>& norm_bias,
                         double eps, c10::string_view norm, const at::Tensor& tables,
                         const std::optional<at::Tensor>& bias, int64_t tau, c10::string_view score,
                         double temperature, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads) {
  const char* op = "memoryformer.decode_qkv";
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), op, ": x must be a CPU tensor [N, hidden], got shape ", x.sizes());
  const int64_t N = x.size(0), d = x.size(1);
  TORCH_CHECK(num_heads >= 1 && d % num_heads == 0, op, ": hidden size ", d, " is not a multiple of num_heads ",
              num_heads);
  const int64_t D = d / num_heads;
  TORCH_CHECK(rotary_fits(cos, sin, N, D, x.scalar_type()), op, ": cos and sin must be [", N, " or 1, 1, r] in x's "
              "dtype with an even r <= head_dim ", D, ", got ", cos.sizes(), " ", cos.scalar_type(), " and ",
              sin.sizes());
  auto qkv = decode_memory_layer(decode_norm(x, norm_weight, norm_bias, eps, norm).contiguous(), tables, bias, tau,
                                 score, temperature);
  TORCH_CHECK(qkv.size(1) == 3 * d && qkv.is_contiguous(), op, ": the tables must have 3 * hidden = ", 3 * d,
              " columns, got ", qkv.size(1));
  rotate_qk(qkv, cos, sin, num_heads);
  return qkv;
}

// The decoder layer's step after its attention, in the order the modules run it: h = x + attn, the post-attention
// norm (of h, or of x with a parallel residual), Memory Layer 1, GELU where the block has it, the inner norm, Memory
// Layer 2, then h + its output. `steps` supplies the residual adds, add(a, b, last) = a + b (`last`: the final add,
// which may write into a), the Memory Layers, layer(x, 1 or 2), and the norms' outputs, norm_into(1 or 2) (a scratch
// tensor or nullptr: see aten_layer_norm): decode_block's ATen ops, or the lean layer's kernels and loops, which give
// the same values.
template <typename Steps>
at::Tensor block_step(const at::Tensor& x, const at::Tensor& attn, const at::Tensor& norm_weight,
                      const std::optional<at::Tensor>& norm_bias, double eps, c10::string_view norm,
                      bool parallel_residual, bool gelu, const at::Tensor& inner_weight,
                      const std::optional<at::Tensor>& inner_bias, double inner_eps, Steps& steps) {
  const auto h = steps.add(x, attn, false);
  auto y = steps.layer(decode_norm(parallel_residual ? x : h, norm_weight, norm_bias, eps, norm, steps.norm_into(1))
                           .contiguous(), 1);
  if (gelu) y = at::gelu(y);
  y = aten_layer_norm(y, inner_weight, inner_bias, inner_eps, steps.norm_into(2)).contiguous();
  return steps.add(h, steps.layer(y, 2), true);
}

// x and attn [N, d] -> the decoder layer's output: h = x + attn, then h + MemoryBlock(norm(h)) (sequential residual)
// or h + MemoryBlock(norm(x)) (parallel residual), the Memory Block being layer2(inner_norm(act(layer1(.)))) with act
// GELU or none.
at::Tensor decode_block_op(const at::Tensor& x, const at::Tensor& attn, const at::Tensor& norm_weight,
                           const std::optional<at::Tensor>& norm_bias, double eps, c10::string_view norm,
                           bool parallel_residual, const at::Tensor& tables1, const std::optional<at::Tensor>& bias1,
                           int64_t tau1, bool gelu, const at::Tensor& inner_weight,
                           const std::optional<at::Tensor>& inner_bias, double inner_eps, const at::Tensor& tables2,
                           const std::optional<at::Tensor>& bias2, int64_t tau2, c10::string_view score,
                           double temperature) {
  const char* op = "memoryformer.decode_block";
  TORCH_CHECK(x.dim() == 2 && attn.sizes() == x.sizes() && x.device().is_cpu(), op, ": x and attn must be CPU "
              "tensors of one shape [N, hidden], got ", x.sizes(), " and ", attn.sizes());
  struct Steps {   // ATen's add and the Memory Layer ops
    const at::Tensor &t1, &t2;
    const std::optional<at::Tensor>&b1, &b2;
    int64_t tau1, tau2;
    c10::string_view score;
    double temperature;
    at::Tensor add(const at::Tensor& a, const at::Tensor& b, bool) { return a + b; }
    at::Tensor* norm_into(int) { return nullptr; }
    at::Tensor layer(const at::Tensor& in, int which) {
      return which == 1 ? decode_memory_layer(in, t1, b1, tau1, score, temperature)
                        : decode_memory_layer(in, t2, b2, tau2, score, temperature);
    }
  } steps{tables1, tables2, bias1, bias2, tau1, tau2, score, temperature};
  return block_step(x, attn, norm_weight, norm_bias, eps, norm, parallel_residual, gelu, inner_weight, inner_bias,
                    inner_eps, steps);
}

// ------------------------------------------------------------------------------------------------ lean stack layer
// decode_stack runs a layer whose Memory Layers have floating tables of the hidden states' dtype, at most
// kSmallBatch sequences, with the hash and token-major lookup kernels called directly and the residual adds as plain
// loops: the values of decode_qkv and decode_block (the lookup op takes the token-major kernel for so few tokens, and
// ATen's add of two float32, bfloat16 or float16 tensors is one float32 sum rounded once), without the ops' argument
// checks, strategy choice and about ten allocations and dispatches per layer. Operands it does not take (int8
// tables, another dtype, a shape the ops would refuse) go to decode_qkv and decode_block, which say what is wrong.
struct LeanScratch {
  std::vector<int64_t> rows;
  std::vector<float> scores;
  at::Tensor qkv, y1, y2, attn;   // reused by every layer of one call (shapes checked by lean_tables)
  at::Tensor normed, inner;       // the norms' outputs [N, d] and [N, d1] (aten_layer_norm's rows path writes them)
  at::Tensor residual[2];         // the layers' outputs h in turn: a layer's input is the other one (or the call's x)
};

// Whether a Memory Layer of `in` inputs and `out` outputs runs lean: tables [K << tau, out] of `dtype`, contiguous,
// K = in / tau, a positive temperature, a bias [out] of `dtype` or none.
bool lean_tables(const at::Tensor& tables, const std::optional<at::Tensor>& bias, int64_t in, int64_t out, int64_t tau,
                 double temperature, at::ScalarType dtype) {
  if (tau < 1 || tau > 16 || in % tau != 0 || !(temperature > 0)) return false;
  if (!tables.defined() || tables.scalar_type() != dtype || tables.dim() != 2 || !tables.is_contiguous() ||
      !tables.device().is_cpu() || tables.size(0) != ((in / tau) << tau) || tables.size(1) != out)
    return false;
  return !(bias.has_value() && bias->defined()) ||
         (bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == out && bias->is_contiguous() &&
          bias->device().is_cpu());
}

// out [N, D] = the Memory Layer on x [N, in] (contiguous): hash_kernel, then lookup_kernel (`lean_tables` holds).
template <typename T>
void lean_memory_layer_as(const at::Tensor& x, const at::Tensor& tables, const std::optional<at::Tensor>& bias,
                          int64_t tau, bool l1, double temperature, at::Tensor& out, LeanScratch& s) {
  const int64_t N = x.size(0), K = x.size(1) / tau, D = tables.size(1);
  s.rows.resize(N * K);
  s.scores.resize(N * K);
  hash_kernel<T>(x.data_ptr<T>(), s.rows.data(), s.scores.data(), N, K, tau, l1, temperature);
  const T* b = bias.has_value() && bias->defined() ? bias->data_ptr<T>() : nullptr;
  lookup_kernel<T>(s.rows.data(), s.scores.data(), tables.data_ptr<T>(), b, out.data_ptr<T>(), N, K, D);
}

void lean_memory_layer(const at::Tensor& x, const at::Tensor& tables, const std::optional<at::Tensor>& bias,
                       int64_t tau, bool l1, double temperature, at::Tensor& out, LeanScratch& s) {
  switch (x.scalar_type()) {   // the dtypes decode_stack runs lean
    case at::kFloat: lean_memory_layer_as<float>(x, tables, bias, tau, l1, temperature, out, s); break;
    case at::kBFloat16: lean_memory_layer_as<c10::BFloat16>(x, tables, bias, tau, l1, temperature, out, s); break;
    default: lean_memory_layer_as<c10::Half>(x, tables, bias, tau, l1, temperature, out, s); break;
  }
}

// out = a + b (contiguous, one shape and dtype; out may be a): each sum in float32, rounded once to the dtype.
void lean_add(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  const int64_t n = a.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), "memoryformer_lean_add", [&] {
    using A = typename Acc<scalar_t>::type;
    const scalar_t* pa = a.data_ptr<scalar_t>();
    const scalar_t* pb = b.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    for (int64_t i = 0; i < n; ++i) po[i] = static_cast<scalar_t>(A(pa[i]) + A(pb[i]));
  });
}

// decode_block's value for x and attn [N, d] (contiguous): block_step with the lean Memory Layers (into the scratch
// outputs) and adds (the last one in place).
at::Tensor lean_block(const at::Tensor& x, const at::Tensor& attn, const at::Tensor& norm_weight,
                      const std::optional<at::Tensor>& norm_bias, double eps, c10::string_view norm,
                      bool parallel_residual, const at::Tensor& tables1, const std::optional<at::Tensor>& bias1,
                      int64_t tau1, bool gelu, const at::Tensor& inner_weight,
                      const std::optional<at::Tensor>& inner_bias, double inner_eps, const at::Tensor& tables2,
                      const std::optional<at::Tensor>& bias2, int64_t tau2, bool l1, double temperature,
                      LeanScratch& s) {
  const int64_t N = x.size(0);
  if (!s.y1.defined() || s.y1.size(0) != N || s.y1.size(1) != tables1.size(1))
    s.y1 = at::empty({N, tables1.size(1)}, x.options());
  if (!s.y2.defined() || s.y2.size(0) != N || s.y2.size(1) != tables2.size(1))
    s.y2 = at::empty({N, tables2.size(1)}, x.options());
  struct Steps {
    const at::Tensor &t1, &t2;
    const std::optional<at::Tensor>&b1, &b2;
    int64_t tau1, tau2;
    bool l1;
    double temperature;
    LeanScratch& s;
    at::Tensor add(const at::Tensor& a, const at::Tensor& b, bool last) {
      at::Tensor out = a;
      if (!last) {   // h = x + attn into the residual buffer that is not x's
        at::Tensor& r = s.residual[s.residual[0].defined() && s.residual[0].data_ptr() == a.data_ptr() ? 1 : 0];
        if (!r.defined() || r.sizes() != a.sizes()) r = at::empty(a.sizes(), a.options());
        out = r;
      }
      lean_add(a, b, out);
      return out;
    }
    at::Tensor* norm_into(int which) { return which == 1 ? &s.normed : &s.inner; }
    at::Tensor layer(const at::Tensor& in, int which) {
      at::Tensor& out = which == 1 ? s.y1 : s.y2;
      lean_memory_layer(in, which == 1 ? t1 : t2, which == 1 ? b1 : b2, which == 1 ? tau1 : tau2, l1, temperature,
                        out, s);
      return out;
    }
  } steps{tables1, tables2, bias1, bias2, tau1, tau2, l1, temperature, s};
  return block_step(x, attn, norm_weight, norm_bias, eps, norm, parallel_residual, gelu, inner_weight, inner_bias,
                    inner_eps, steps);
}

// The layers of a decode step as decode_stack and decode_stack_static run them: per layer decode_qkv (the lean layer
// where it applies), then `attend(l, qkv, lean, scratch)`, which puts the layer's new key and value into its cache and
// returns the attention [N, d], then decode_block. The operands come flat, as decode_stack's comment says.
template <typename Attend>
at::Tensor stack_layers(const char* op, const at::Tensor& x, int64_t L, const at::Tensor& cos, const at::Tensor& sin,
                        int64_t num_heads, const c10::List<std::optional<at::Tensor>>& tensors,
                        at::ArrayRef<double> floats, at::IntArrayRef ints, Attend&& attend) {
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) == 12 * L && static_cast<int64_t>(floats.size()) == 5 * L &&
              static_cast<int64_t>(ints.size()) == 9 * L, op, ": for ", L, " layers, expected 12 tensors, 5 floats "
              "and 9 ints per layer, got ", tensors.size(), ", ", floats.size(), " and ", ints.size());
  TORCH_CHECK(x.dim() == 2 && num_heads >= 1 && x.size(1) % num_heads == 0, op, ": x must be [N, hidden] with hidden "
              "a multiple of num_heads ", num_heads, ", got ", x.sizes());
  const int64_t N = x.size(0), d = x.size(1), D = d / num_heads;
  static const c10::string_view norms[] = {"layernorm", "rmsnorm"}, scores[] = {"paper", "l1"};
  auto pick = [&](const c10::string_view* names, int64_t i) {
    TORCH_CHECK(i == 0 || i == 1, op, ": a norm kind or score code is 0 or 1, got ", i);
    return names[i];
  };
  auto tensor = [&](int64_t i) { return tensors.get(i); };
  auto required = [&](int64_t i) {
    const auto t = tensors.get(i);
    TORCH_CHECK(t.has_value(), op, ": operand ", i % 12, " of layer ", i / 12, " is required");
    return *t;
  };
  at::Tensor h = x;
  const auto dtype = x.scalar_type();
  // The lean layer takes cos and sin only in the form decode_qkv accepts (else decode_qkv runs each layer and says
  // what is wrong with them).
  const bool lean_batch = N <= kSmallBatch && x.is_contiguous() &&
                          (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) &&
                          rotary_fits(cos, sin, N, D, dtype);
  LeanScratch scratch;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t t = 12 * l, f = 5 * l, i = 9 * l;
    const at::Tensor tables_qkv = required(t + 2), tables1 = required(t + 6), tables2 = required(t + 10);
    const int64_t d1 = tables1.dim() == 2 ? tables1.size(1) : -1;
    const bool lean = lean_batch && d1 > 0 &&
                      lean_tables(tables_qkv, tensor(t + 3), d, 3 * d, ints[i + 1], floats[f + 1], dtype) &&
                      lean_tables(tables1, tensor(t + 7), d, d1, ints[i + 5], floats[f + 4], dtype) &&
                      lean_tables(tables2, tensor(t + 11), d1, d, ints[i + 7], floats[f + 4], dtype) &&
                      (ints[i + 2] == 0 || ints[i + 2] == 1) && (ints[i + 8] == 0 || ints[i + 8] == 1);
    at::Tensor qkv;
    if (lean) {
      if (!scratch.qkv.defined()) scratch.qkv = at::empty({N, 3 * d}, x.options());
      qkv = scratch.qkv;
      lean_memory_layer(decode_norm(h, required(t), tensor(t + 1), floats[f], pick(norms, ints[i]), &scratch.normed)
                            .contiguous(),
                        tables_qkv, tensor(t + 3), ints[i + 1], ints[i + 2] == 1, floats[f + 1], qkv, scratch);
      rotate_qk(qkv, cos, sin, num_heads);
    } else {
      qkv = decode_qkv_op(h, required(t), tensor(t + 1), floats[f], pick(norms, ints[i]), tables_qkv, tensor(t + 3),
                          ints[i + 1], pick(scores, ints[i + 2]), floats[f + 1], cos, sin, num_heads);
    }
    const at::Tensor attn = attend(l, qkv, lean, scratch);
    if (lean)
      h = lean_block(h, attn, required(t + 4), tensor(t + 5), floats[f + 2], pick(norms, ints[i + 3]),
                     ints[i + 4] != 0, tables1, tensor(t + 7), ints[i + 5], ints[i + 6] != 0, required(t + 8),
                     tensor(t + 9), floats[f + 3], tables2, tensor(t + 11), ints[i + 7], ints[i + 8] == 1,
                     floats[f + 4], scratch);
    else
      h = decode_block_op(h, attn, required(t + 4), tensor(t + 5), floats[f + 2], pick(norms, ints[i + 3]),
                          ints[i + 4] != 0, tables1, tensor(t + 7), ints[i + 5], ints[i + 6] != 0,
                          required(t + 8), tensor(t + 9), floats[f + 3], tables2, tensor(t + 11), ints[i + 7],
                          pick(scores, ints[i + 8]), floats[f + 4]);
  }
  return h;
}

// Every decoder layer of a decode step in one call, for a cache whose layers grow by concatenation (transformers'
// DynamicCache: DynamicLayer.update is torch.cat([keys, new], dim=-2)): per layer, decode_qkv, the cache's growth
// (grow_cache: the values of that cat, in place where `owned[l]` allows), the decode attention and decode_block, the
// same ops in the same order as decode_layer.py's per-layer step, without the Python between them (about 150 us per
// layer of MF-small). keys[l] and values[l] are layer l's cache [N, heads, T, D]; the layers' operands come flat:
// `tensors` 12 per layer (norm1 weight and bias, Q/K/V tables and bias, norm2 weight and bias, layer1 tables and
// bias, inner norm weight and bias, layer2 tables and bias), `floats` 5 (norm1 eps, Q/K/V temperature, norm2 eps,
// inner eps, block temperature) and `ints` 9 (norm1 kind, Q/K/V hash bits, Q/K/V score, norm2 kind, parallel
// residual, layer1 hash bits, gelu, layer2 hash bits, block score), a kind being 0 = layernorm, 1 = rmsnorm and a
// score 0 = paper, 1 = l1. `owned` holds one flag per layer (or none: no layer owned). Returns the last layer's
// output and every layer's grown keys and values, which the caller stores in its cache.
std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> decode_stack_op(
    const at::Tensor& x, at::TensorList keys, at::TensorList values, const std::optional<at::Tensor>& mask,
    const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, double scaling,
    const c10::List<std::optional<at::Tensor>>& tensors, at::ArrayRef<double> floats, at::IntArrayRef ints,
    at::IntArrayRef owned) {
  const char* op = "memoryformer.decode_stack";
  const int64_t L = static_cast<int64_t>(keys.size());
  TORCH_CHECK(static_cast<int64_t>(values.size()) == L, op, ": for ", L, " layers of keys, expected as many values, "
              "got ", values.size());
  TORCH_CHECK(owned.empty() || static_cast<int64_t>(owned.size()) == L, op, ": owned must hold one flag per layer (",
              L, ") or none, got ", owned.size());
  std::vector<at::Tensor> new_keys, new_values;
  new_keys.reserve(L);
  new_values.reserve(L);
  const bool masked = mask.has_value() && mask->defined();
  at::Tensor h = stack_layers(op, x, L, cos, sin, num_heads, tensors, floats, ints,
                              [&](int64_t l, const at::Tensor& qkv, bool lean, LeanScratch& scratch) {
    const int64_t N = x.size(0), d = x.size(1), D = d / num_heads;
    const bool own = !owned.empty() && owned[l] != 0;
    TORCH_CHECK(keys[l].dim() == 4 && values[l].sizes() == keys[l].sizes() && keys[l].size(0) == N &&
                keys[l].size(1) == num_heads && keys[l].size(3) == D && keys[l].scalar_type() == x.scalar_type() &&
                values[l].scalar_type() == x.scalar_type(), op, ": layer ", l, "'s keys and values must be [", N,
                ", ", num_heads, ", T, ", D, "] in x's dtype ", x.scalar_type(), ", got ", keys[l].sizes(), " ",
                keys[l].scalar_type(), " and ", values[l].sizes(), " ", values[l].scalar_type());
    if (lean && !masked) {
      // qkv [N, 3, heads, D] (contiguous) read in place: the new keys and values grown into the cache, the attention
      // written into the scratch [N, d] ([N, 1, heads, D] as decode_attention gives it): the values of the op path
      // below, without its views and checks.
      const char* src = static_cast<const char*>(qkv.data_ptr());
      const int64_t esize = static_cast<int64_t>(qkv.element_size());
      new_keys.push_back(grow_cache_from(keys[l], src + d * esize, 3 * d, D, 1, grows_in_place(keys[l], own)));
      new_values.push_back(grow_cache_from(values[l], src + 2 * d * esize, 3 * d, D, 1,
                                           grows_in_place(values[l], own)));
      if (!scratch.attn.defined()) scratch.attn = at::empty({N, d}, x.options());
      decode_attention_into(qkv.data_ptr(), 3 * d, D, new_keys.back(), new_values.back(), num_heads, float(scaling),
                            nullptr, nullptr, scratch.attn.data_ptr());
      return scratch.attn;
    }
    const auto parts = qkv.view({N, 1, 3, num_heads, D}).permute({2, 0, 3, 1, 4});  // [3, N, heads, 1, D]
    new_keys.push_back(grow_cache(keys[l], parts[1], own));
    new_values.push_back(grow_cache(values[l], parts[2], own));
    return decode_attention_op(parts[0], new_keys.back(), new_values.back(), mask, scaling)
        .reshape({N, 1, d}).contiguous().view({N, d});
  });
  return {h, new_keys, new_values};
}
#line 1 "modeling_memoryformer/csrc/cpu/static_stack.h"
// A decode step over transformers' StaticCache: every decoder layer in one call.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ static stack
// decode_stack for a cache of fixed buffers (transformers' StaticCache, the cache of the compiled decode step):
// keys[l] and values[l] are layer l's buffers [N, heads, T, D] and lengths[l] its count of positions written (a
// one-element int64 tensor, StaticLayer.cumulative_length). Per layer, as StaticLayer.update and the modules' decode
// attention do: the new key and value are written at position lengths[l] of the buffers (index_copy_ at
// arange(1) + cumulative_length), lengths[l] is advanced by one, and the attention reads the whole buffers under
// `mask` (the positions not yet written are masked). The rest is decode_stack's (`stack_layers`: decode_qkv and
// decode_block, the lean layer where it applies), so the values are the per-layer step's. The buffers and the
// lengths are written in place (the schema marks them mutable, so that torch.compile keeps the writes); returns the
// last layer's output [N, d].
at::Tensor decode_stack_static_op(const at::Tensor& x, at::TensorList keys, at::TensorList values,
                                  at::TensorList lengths, const std::optional<at::Tensor>& mask, const at::Tensor& cos,
                                  const at::Tensor& sin, int64_t num_heads, double scaling,
                                  const c10::List<std::optional<at::Tensor>>& tensors, at::ArrayRef<double> floats,
                                  at::IntArrayRef ints) {
  const char* op = "memoryformer.decode_stack_static";
  const int64_t L = static_cast<int64_t>(keys.size());
  TORCH_CHECK(static_cast<int64_t>(values.size()) == L && static_cast<int64_t>(lengths.size()) == L, op, ": for ", L,
              " layers of keys, expected as many values and lengths, got ", values.size(), " and ", lengths.size());
  TORCH_CHECK(x.dim() == 2 && num_heads >= 1 && x.size(1) % num_heads == 0, op, ": x must be [N, hidden] with hidden "
              "a multiple of num_heads ", num_heads, ", got ", x.sizes());
  const int64_t N = x.size(0), d = x.size(1), D = d / num_heads;
  std::vector<int64_t> positions(L);
  for (int64_t l = 0; l < L; ++l) {  // every layer checked before any is written: no half-written step
    const at::Tensor &k = keys[l], &v = values[l], &length = lengths[l];
    TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && k.size(0) == N && k.size(1) == num_heads &&
                k.size(3) == D && k.scalar_type() == x.scalar_type() && v.scalar_type() == x.scalar_type() &&
                k.device().is_cpu() && v.device().is_cpu(), op, ": layer ", l, "'s keys and values must be CPU "
                "buffers [", N, ", ", num_heads, ", T, ", D, "] in x's dtype ", x.scalar_type(), ", got ", k.sizes(),
                " ", k.scalar_type(), " and ", v.sizes(), " ", v.scalar_type());
    TORCH_CHECK(length.numel() == 1 && length.scalar_type() == at::kLong && length.device().is_cpu(), op, ": layer ",
                l, "'s length must be one int64 on the CPU, got ", length.sizes(), " ", length.scalar_type());
    positions[l] = length.item<int64_t>();
    TORCH_CHECK(0 <= positions[l] && positions[l] < k.size(2), op, ": layer ", l, " has ", positions[l], " of its ",
                k.size(2), " positions written: no room for another (a longer static cache, max_cache_len, holds "
                "more)");
  }
  return stack_layers(op, x, L, cos, sin, num_heads, tensors, floats, ints,
                      [&](int64_t l, const at::Tensor& qkv, bool, LeanScratch&) {
    const at::Tensor &k = keys[l], &v = values[l];
    const auto parts = qkv.view({N, 1, 3, num_heads, D}).permute({2, 0, 3, 1, 4});  // [3, N, heads, 1, D]
    k.narrow(2, positions[l], 1).copy_(parts[1]);
    v.narrow(2, positions[l], 1).copy_(parts[2]);
    lengths[l].add_(1);
    return decode_attention_op(parts[0], k, v, mask, scaling).reshape({N, 1, d}).contiguous().view({N, d});
  });
}
#line 1 "modeling_memoryformer/csrc/cpu/decode_tokens.h"
// generate's decode steps from their tokens: the embedding, every decoder layer and the final norm in one call, over
// operands and a KV cache held here between the steps of one loop.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ decode tokens
// A step of decode_loop._StackSession (through decode_session_step, below): x = embed[ids] (nn.Embedding's forward:
// the rows copied), the rotary rows of `position` (cos and sin the tables [positions, r], every sequence at that
// position) or cos and sin as decode_stack takes them ([N or 1, 1, r], position -1), decode_stack (no mask: every
// key), then, where `final_norm`, the final layer norm (ATen's kernel, the values of torch.layer_norm over the last
// dimension, as nn.LayerNorm). In Python these were four ATen calls around decode_stack (the embedding, two rotary
// rows, the norm): each took 5-30 us right after the LM head, whose 50-100 MB stream evicts their code and data from
// the caches, where the same calls take 2-5 us warm (MF-small bfloat16 on the 2-vCPU Zen 4 of docs/performance.md:
// the embedding 24-45 us, the norm 22-35 us, per step). A token outside [0, embeddings) writes nothing and returns an
// empty output and no keys or values (a 1-D output, where a step's is [N, hidden]): the caller declines the step, and
// the module path raises its error.
std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> decode_tokens(
    const at::Tensor& ids, const at::Tensor& embed, at::TensorList keys, at::TensorList values, const at::Tensor& cos,
    const at::Tensor& sin, int64_t position, int64_t num_heads, double scaling,
    const c10::List<std::optional<at::Tensor>>& tensors, at::ArrayRef<double> floats, at::IntArrayRef ints,
    at::IntArrayRef owned, bool final_norm, const std::optional<at::Tensor>& norm_weight,
    const std::optional<at::Tensor>& norm_bias, double norm_eps) {
  const char* op = "memoryformer.decode_tokens";
  TORCH_CHECK(ids.dim() == 2 && ids.size(1) == 1 && ids.scalar_type() == at::kLong && ids.device().is_cpu(), op,
              ": ids must be one int64 token per sequence [N, 1] on the CPU, got ", ids.sizes(), " ",
              ids.scalar_type());
  TORCH_CHECK(embed.dim() == 2 && embed.device().is_cpu() && embed.stride(1) == 1, op, ": the embedding must be a CPU "
              "matrix [embeddings, hidden] with contiguous rows, got ", embed.sizes(), " strides ", embed.strides());
  const int64_t N = ids.size(0), V = embed.size(0), d = embed.size(1);
  const at::Tensor tokens = ids.contiguous();
  const int64_t* t = tokens.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    if (t[n] < 0 || t[n] >= V) return {at::empty({0}, embed.options()), {}, {}};
  at::Tensor x = at::empty({N, d}, embed.options());
  const int64_t row = d * static_cast<int64_t>(embed.element_size());
  const char* from = static_cast<const char*>(embed.data_ptr());
  for (int64_t n = 0; n < N; ++n)
    std::memcpy(static_cast<char*>(x.data_ptr()) + n * row, from + t[n] * embed.stride(0) * embed.element_size(), row);
  at::Tensor c = cos, s = sin;
  if (position >= 0) {
    TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && position < cos.size(0), op, ": with a position, cos "
                "and sin must be the rotary tables [positions, r] holding it, got ", cos.sizes(), " and ", sin.sizes(),
                " for position ", position);
    c = cos.narrow(0, position, 1).reshape({1, 1, cos.size(1)});
    s = sin.narrow(0, position, 1).reshape({1, 1, sin.size(1)});
  }
  auto [h, new_keys, new_values] = decode_stack_op(x, keys, values, std::nullopt, c, s, num_heads, scaling, tensors,
                                                   floats, ints, owned);
  if (final_norm) h = aten_layer_norm(h, norm_weight, norm_bias, norm_eps);
  return {h, std::move(new_keys), std::move(new_values)};
}

// ------------------------------------------------------------------------------------------------ decode sessions
// decode_tokens's operands (per layer 12 tensors, 5 floats and 9 ints, decode_stack's) and the layers' keys and
// values, held here from decode_session_open to decode_session_close, so that a step passes its tokens alone: the
// operand lists cost 18 us (MF-small, 144 tensors) to 37 us (MF-base) per call to convert, warm, and the keys and
// values it returned as many Python objects again, which the loop then stored into the cache's layers. The loop
// (decode_loop.py) takes the keys and values at the close and stores them into its cache then: only transformers' own
// callbacks run between the steps, which read nothing of the cache. Sessions are numbered per process; each is run
// by one loop at a time.
struct DecodeSession {
  at::Tensor embed, cos, sin;
  std::vector<at::Tensor> keys, values;
  c10::List<std::optional<at::Tensor>> tensors;
  std::vector<double> floats;
  std::vector<int64_t> ints, owned;
  int64_t num_heads = 0;
  double scaling = 1.0;
  bool final_norm = false;
  std::optional<at::Tensor> norm_weight, norm_bias, head_weight, head_bias;
  double norm_eps = 0.0;
};

struct DecodeSessions {
  std::mutex m;
  std::map<int64_t, std::shared_ptr<DecodeSession>> open;
  int64_t next = 1;
};

DecodeSessions& decode_sessions() {
  static DecodeSessions sessions;
  return sessions;
}

// A session over the cache's keys and values (the views decode_stack returned last for their buffers, so that a
// step may grow them in place), the embedding, the rotary tables cos and sin [positions, r], decode_stack's operands,
// the final norm and, for greedy search, the LM head (its weight [vocabulary, hidden] and bias: each step then ends
// with linear_rows_argmax, the logits and their argmax in one pass); returns its number.
int64_t decode_session_open_op(const at::Tensor& embed, at::TensorList keys, at::TensorList values,
                               const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, double scaling,
                               const c10::List<std::optional<at::Tensor>>& tensors, at::ArrayRef<double> floats,
                               at::IntArrayRef ints, bool final_norm, const std::optional<at::Tensor>& norm_weight,
                               const std::optional<at::Tensor>& norm_bias, double norm_eps,
                               const std::optional<at::Tensor>& head_weight,
                               const std::optional<at::Tensor>& head_bias) {
  TORCH_CHECK(keys.size() == values.size(), "memoryformer.decode_session_open: ", keys.size(), " layers of keys, ",
              values.size(), " of values");
  auto s = std::make_shared<DecodeSession>();
  s->embed = embed;
  s->cos = cos;
  s->sin = sin;
  s->keys = keys.vec();
  s->values = values.vec();
  s->tensors = tensors.copy();
  s->floats = floats.vec();
  s->ints = ints.vec();
  s->owned.assign(keys.size(), 1);
  s->num_heads = num_heads;
  s->scaling = scaling;
  s->final_norm = final_norm;
  s->norm_weight = norm_weight;
  s->norm_bias = norm_bias;
  s->norm_eps = norm_eps;
  s->head_weight = head_weight;
  s->head_bias = head_bias;
  DecodeSessions& all = decode_sessions();
  std::lock_guard<std::mutex> lock(all.m);
  const int64_t id = all.next++;
  all.open.emplace(id, std::move(s));
  return id;
}

std::shared_ptr<DecodeSession> decode_session(const char* op, int64_t id, bool close) {
  DecodeSessions& all = decode_sessions();
  std::lock_guard<std::mutex> lock(all.m);
  const auto it = all.open.find(id);
  TORCH_CHECK(it != all.open.end(), op, ": no open decode session ", id, " (closed already, or never opened)");
  auto s = it->second;
  if (close) all.open.erase(it);
  return s;
}

// One step of session `id` for `ids` [N, 1]: at `position` of the session's rotary tables, or (position -1) at the
// rows cos and sin [N, 1, r]. Returns decode_tokens's output [N, hidden] and no tokens (an empty tensor), or, for a
// session with the LM head, the logits [N, vocabulary] and their argmax [N]; a 1-D empty output where a token lies
// outside the vocabulary (nothing written: the session's keys and values stay the last step's).
std::tuple<at::Tensor, at::Tensor> decode_session_step_op(int64_t id, const at::Tensor& ids, int64_t position,
                                                          const std::optional<at::Tensor>& cos,
                                                          const std::optional<at::Tensor>& sin) {
  const char* op = "memoryformer.decode_session_step";
  const auto s = decode_session(op, id, false);
  TORCH_CHECK((position >= 0) != (cos.has_value() && sin.has_value()), op, ": give a position of the session's rotary "
              "tables or the rows cos and sin (position -1), got position ", position);
  auto [h, keys, values] = decode_tokens(ids, s->embed, s->keys, s->values, cos ? *cos : s->cos, sin ? *sin : s->sin,
                                         position, s->num_heads, s->scaling, s->tensors, s->floats, s->ints, s->owned,
                                         s->final_norm, s->norm_weight, s->norm_bias, s->norm_eps);
  if (h.dim() != 2) return {h, at::empty({0}, ids.options())};
  s->keys = std::move(keys);
  s->values = std::move(values);
  if (s->head_weight.has_value()) return linear_rows_argmax_op(h, *s->head_weight, s->head_bias);
  return {h, at::empty({0}, ids.options())};
}

// Ends session `id`: its layers' keys and values as its last step left them.
std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> decode_session_close_op(int64_t id) {
  const auto s = decode_session("memoryformer.decode_session_close", id, true);
  return {std::move(s->keys), std::move(s->values)};
}
#line 1 "modeling_memoryformer/csrc/cpu/introspection.h"
// Introspection: the kernel's facts and settings.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ introspection
std::string isa_op() { return MEMORYFORMER_ISA; }

int64_t linear_rows_max_op() { return kLinearMaxRows; }

int64_t linear_rows_balance_op(int64_t delay_slot, int64_t delay_us) {
  TORCH_CHECK(delay_slot >= -1 && delay_us >= 0 && delay_us <= 10000000, "memoryformer.linear_rows_balance: slot "
              "must be >= -1 (-1: no delay) and the delay 0 .. 10 s in microseconds, got ", delay_slot, ", ", delay_us);
  linear_delay_slot.store(delay_slot);
  linear_delay_us.store(delay_us);
  return linear_stolen.load();
}

// setting -1: run the trials again (their passes forgotten); 0 / 1: every row pass without / with the prefetches; -2:
// change nothing. Returns [the fixed setting (-1: none), then per kind (bfloat16 weights within, then beyond the
// last-level cache; float32's two) the trial's choice (-1 while it runs) and its timed passes].
std::vector<int64_t> linear_rows_prefetch_op(int64_t setting) {
  TORCH_CHECK(setting >= -2 && setting <= 1, "memoryformer.linear_rows_prefetch: setting must be -2 (read only), -1 "
              "(the trial), 0 (without) or 1 (with the prefetches), got ", setting);
  std::vector<int64_t> out{setting == -2 ? int64_t(prefetch_trial(0).forced.load()) : setting};
  for (int kind = 0; kind < kPrefetchKinds; ++kind) {
    PrefetchTrial& trial = prefetch_trial(kind);
    std::lock_guard<std::mutex> lock(trial.m);
    if (setting != -2) trial.forced.store(int(setting));
    if (setting == -1) {
      trial.choice.store(-1);
      for (auto& v : trial.seconds_per_byte) v.clear();
    }
    out.push_back(trial.choice.load());
    out.push_back(int64_t(trial.seconds_per_byte[0].size() + trial.seconds_per_byte[1].size()));
  }
  return out;
}

std::vector<int64_t> machine_info_op() {
  const Caches c = caches();
  return {c.l1, c.l2, c.l3, int64_t(std::max(1, at::get_num_threads())), kLanes * int64_t(sizeof(float))};
}

void set_cache_sizes_op(int64_t l1, int64_t l2, int64_t l3) {
  TORCH_CHECK(l1 >= 0 && l2 >= 0 && l3 >= 0, "memoryformer.set_cache_sizes: sizes must be >= 0 bytes "
              "(0, 0, 0 restores the detected caches), got ", l1, ", ", l2, ", ", l3);
  const bool reset = l1 == 0 && l2 == 0 && l3 == 0;
  override_l1.store(l1);
  override_l2.store(l2);
  override_l3.store(reset ? -1 : l3);
}

std::string plan_op(int64_t N, int64_t K, int64_t P, int64_t D, at::ScalarType dtype, bool backward) {
  TORCH_CHECK(N >= 0 && K >= 1 && P >= 1 && D >= 1, "memoryformer.plan: need tokens >= 0, num_tables >= 1, "
              "rows_per_table >= 1 and out_features >= 1, got ", N, ", ", K, ", ", P, ", ", D);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf,
              "memoryformer.plan: dtype must be float32, float64, bfloat16 or float16, got ", dtype);
  return backward ? "bucketed" : choose_strategy(N, K, P, D, dtype);
}
#line 1 "modeling_memoryformer/csrc/cpu/optimizer_steps.h"
// The row-wise steps of the table optimizers.
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

// ------------------------------------------------------------------------------------------------ table optimizers
// The row-wise table optimizers of training/table_optimizer.py (same formulas), in one pass per row instead of the
// several whole-table passes of their PyTorch form: a row's mean squared gradient, then its update, while the row is
// in L1. float32 weights and gradients; the states float32. Rows split over the threads.
//   rowwise_adagrad_step: s_r += mean_j g_rj^2;  w_r = w_r (1 - lr wd) - lr g_r / (sqrt(s_r) + eps)
//   adam_rowwise_step:    m = b1 m + (1 - b1) g;  v_r = b2 v_r + (1 - b2) mean_j g_rj^2;
//                         w = w (1 - lr wd) - (lr / (1 - b1^t)) m / (sqrt(v_r / (1 - b2^t)) + eps)
void check_table_step(const at::Tensor& weight, const at::Tensor& grad, double lr, double eps, double weight_decay,
                      const char* op) {
  check_cpu_contiguous(weight, op, "weight");
  check_cpu_contiguous(grad, op, "grad");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && grad.scalar_type() == at::kFloat, "memoryformer.", op,
              ": weight and grad must be float32, got ", weight.scalar_type(), " and ", grad.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && grad.sizes() == weight.sizes(), "memoryformer.", op, ": weight must be 2-D "
              "[rows, width] and grad of the same shape, got ", weight.sizes(), " and ", grad.sizes());
  TORCH_CHECK(std::isfinite(lr) && lr >= 0, "memoryformer.", op, ": lr must be finite and >= 0, got ", lr);
  TORCH_CHECK(std::isfinite(eps) && eps > 0, "memoryformer.", op, ": eps must be finite and > 0, got ", eps);
  TORCH_CHECK(std::isfinite(weight_decay) && weight_decay >= 0, "memoryformer.", op,
              ": weight_decay must be finite and >= 0, got ", weight_decay);
}

void check_state(const at::Tensor& state, at::IntArrayRef shape, const char* op, const char* name) {
  check_cpu_contiguous(state, op, name);
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.sizes() == shape, "memoryformer.", op, ": ", name,
              " must be float32 of shape ", shape, ", got ", state.scalar_type(), " of shape ", state.sizes());
}

inline float row_mean_square(const float* g, int64_t D) {
  float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
  for (int64_t j = 0; j < D; ++j) sq += g[j] * g[j];
  return D > 0 ? sq / float(D) : 0.0f;
}

void rowwise_adagrad_step_op(const at::Tensor& weight, const at::Tensor& grad, const at::Tensor& state_sum, double lr,
                             double eps, double weight_decay) {
  const char* op = "rowwise_adagrad_step";
  check_table_step(weight, grad, lr, eps, weight_decay, op);
  const int64_t R = weight.size(0), D = weight.size(1);
  check_state(state_sum, {R}, op, "state_sum");
  float* w = weight.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  float* s = state_sum.data_ptr<float>();
  const float decay = float(1.0 - lr * weight_decay), step = float(lr), feps = float(eps);
  at::parallel_for(0, R, std::max<int64_t>(1, kSerialWork / std::max<int64_t>(1, D)), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* gr = g + r * D;
      float* wr = w + r * D;
      s[r] += row_mean_square(gr, D);
      const float scale = step / (std::sqrt(s[r]) + feps);
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) wr[j] = wr[j] * decay - scale * gr[j];
    }
  });
}

void adam_rowwise_step_op(const at::Tensor& weight, const at::Tensor& grad, const at::Tensor& exp_avg,
                          const at::Tensor& exp_avg_sq, int64_t step, double lr, double beta1, double beta2,
                          double eps, double weight_decay) {
  const char* op = "adam_rowwise_step";
  check_table_step(weight, grad, lr, eps, weight_decay, op);
  const int64_t R = weight.size(0), D = weight.size(1);
  check_state(exp_avg, weight.sizes(), op, "exp_avg");
  check_state(exp_avg_sq, {R}, op, "exp_avg_sq");
  TORCH_CHECK(step >= 1, "memoryformer.", op, ": step must be >= 1 (the number of this step), got ", step);
  TORCH_CHECK(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1, "memoryformer.", op,
              ": betas must be in [0, 1), got ", beta1, " and ", beta2);
  float* w = weight.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  const float decay = float(1.0 - lr * weight_decay), b1 = float(beta1), b2 = float(beta2), feps = float(eps);
  const float lr1 = float(lr / (1.0 - std::pow(beta1, double(step))));
  const float bias2 = float(1.0 - std::pow(beta2, double(step)));
  at::parallel_for(0, R, std::max<int64_t>(1, kSerialWork / std::max<int64_t>(1, D)), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* gr = g + r * D;
      float* wr = w + r * D;
      float* mr = m + r * D;
      v[r] = b2 * v[r] + (1.0f - b2) * row_mean_square(gr, D);
      const float scale = lr1 / (std::sqrt(v[r] / bias2) + feps);
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) {
        mr[j] = b1 * mr[j] + (1.0f - b1) * gr[j];
        wr[j] = wr[j] * decay - scale * mr[j];
      }
    }
  });
}
#line 1 "modeling_memoryformer/csrc/cpu/registration.cpp"
// The end of the anonymous namespace and the op registration (CPU kernels only: the schemas are defined in Python).
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

}  // namespace

// One indirection so that MEMORYFORMER_OPS is expanded before TORCH_LIBRARY_IMPL pastes it into names.
#define MEMORYFORMER_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

// The schemas are defined in Python (memory_op_library.py, OP_SCHEMAS) before this library is loaded.
MEMORYFORMER_LIBRARY_IMPL(MEMORYFORMER_OPS, CPU, m) {
  m.impl("hash", &hash_op);
  m.impl("hash_backward", &hash_backward_op);
  m.impl("lookup", &lookup_op);
  m.impl("lookup_strategy", &lookup_strategy_op);
  m.impl("lookup_backward", &lookup_backward_op);
  m.impl("lookup_backward_rows", &lookup_backward_rows_op);
  m.impl("int8_lookup", &int8_lookup_op);
  m.impl("linear_rows", &linear_rows_op);
  m.impl("argmax_rows", &argmax_rows_op);
  m.impl("linear_rows_argmax", &linear_rows_argmax_op);
  m.impl("decode_attention", &decode_attention_op);
  m.impl("decode_layer_norm", &decode_layer_norm_op);
  m.impl("decode_qkv", &decode_qkv_op);
  m.impl("decode_block", &decode_block_op);
  m.impl("decode_stack", &decode_stack_op);
  m.impl("decode_stack_static", &decode_stack_static_op);
  m.impl("decode_session_open", &decode_session_open_op);
  m.impl("decode_session_step", &decode_session_step_op);
  m.impl("rowwise_adagrad_step", &rowwise_adagrad_step_op);
  m.impl("adam_rowwise_step", &adam_rowwise_step_op);
}

// The kernel's own facts and settings take no tensor, so the dispatcher has no device to choose by: they are
// registered for every backend.
MEMORYFORMER_LIBRARY_IMPL(MEMORYFORMER_OPS, CompositeExplicitAutograd, m) {
  m.impl("linear_rows_max", &linear_rows_max_op);
  m.impl("linear_rows_balance", &linear_rows_balance_op);
  m.impl("linear_rows_prefetch", &linear_rows_prefetch_op);
  m.impl("decode_session_close", &decode_session_close_op);
  m.impl("release_gradient_pool", &release_gradient_pool);
  m.impl("isa", &isa_op);
  m.impl("machine_info", &machine_info_op);
  m.impl("set_cache_sizes", &set_cache_sizes_op);
  m.impl("plan", &plan_op);
  m.impl("lookup_strategies", &lookup_strategies_op);
}
"""
