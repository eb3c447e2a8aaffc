// Fused CPU kernels of the MemoryFormer Memory Layer (PyTorch extension, namespace memoryformer_cpu).
//
// Operators (namespace `memoryformer_cpu`), all on contiguous CPU tensors:
// - hash(x[N, K*tau], tau, l1, t) -> (rows int64 [N, K], scores [N, K])
//       rows = k * 2**tau + h(z_k); scores = p(z_k) (paper) or ||z_k||_1 * p(z_k) (l1), in float32 (float64 for
//       float64 x). p = 1 / prod_i (1 + exp(-2|z_i|/t)) is computed as a product: each factor lies in (1, 2], so the
//       product of at most 16 factors cannot overflow and no logarithm is needed.
// - lookup(rows, scores, tables[R, D], bias?) -> y[N, D] = sum_k scores[:, k] * tables[rows[:, k]] + bias,
//       accumulated in float32 (float64 for float64 tables), returned in the tables' dtype.
// - lookup_strategy(..., strategy) -> the same function by one named strategy ("auto" is what lookup runs; "token",
//       "embedding_bag", "packed", "bucketed" force one; tests use them to check every branch).
// - lookup_backward(grad_y, rows, scores, tables, need_tables, need_scores) -> (grad_scores, grad_tables)
//       grad_scores[n, k] = <grad_y[n], tables[rows[n, k]]>; grad_tables[r] = sum_{(n,k): rows[n,k]=r} scores * grad_y[n]
// - hash_backward(grad_scores, x, tau, l1, t) -> grad_x through the score derivative (codes are piecewise constant).
// - release_gradient_pool() -> bytes freed (see "Gradient memory").
//
// Design (measured on a 2-core AMD EPYC, see benchmarks/): the row gather is bounded by cache/TLB misses on tables
// far larger than L2, not by FLOPs.
// Forward: up to 64 tokens, a token-major kernel that sums each token's K row spans in registers while prefetching the
// rows 16 lookups ahead. Beyond that, for tables well inside L3, PyTorch's embedding_bag (FBGEMM's JIT kernel), which
// measured fastest there, called below autograd. For float32 tables about the size of L3 (24-48 MB) with >= 8 lookups
// per row, the packed pass: per 32-column block, the rows of the next group of tables are copied into a contiguous
// L2-resident buffer while the current group serves every token, four tokens at a time in registers (the table is read
// once per chunk of up to 4096 tokens instead of once per lookup; 2.1 vs 2.4 ms at d = 512, N = 2048). For tables
// beyond L3 (>= 48 MB) with >= 4 lookups per row, the bucketed pass: lookups are grouped by row (a counting sort per
// table), the output is built in 64-column blocks of up to 2048 tokens held in a compact L2-resident buffer, and the
// table is streamed once, each hit row loaded once and applied to all its tokens (faster than the packed pass there).
// Backward: always bucketed, in one pass over the table rows per column block: the block of grad_y sits in L2, each
// row's table gradient is accumulated in registers and written once by one thread (no atomics, no read-modify-write
// of the large gradient; rows nobody hit are written as zeros), and the score gradients are the inner products of the
// same row with the same grad_y spans, summed over the column blocks.
// Gradient memory: table gradients come from a pool of huge-page-advised blocks that are reused once their tensor is

