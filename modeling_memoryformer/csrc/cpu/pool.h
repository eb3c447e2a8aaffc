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
