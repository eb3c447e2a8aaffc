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
