// A KV cache's growth by one position (the decode stack's DynamicCache layers).
// A part of the fused CPU kernel: one translation unit, the parts concatenated in the order of
// csrc/cpu/parts.txt (see prelude.h); it uses what the parts before it define.

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
    buffer = at::empty({N, H, C, D}, cache.options().memory_format(at::MemoryFormat::Contiguous));
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
