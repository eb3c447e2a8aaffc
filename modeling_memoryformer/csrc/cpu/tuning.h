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
