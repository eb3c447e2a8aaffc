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
