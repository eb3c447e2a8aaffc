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
