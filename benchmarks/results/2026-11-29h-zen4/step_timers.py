"""Where a decode step of the kernel session goes, inside `generate`: a development build of the kernel with rdtsc
timers around each piece of decode_stack's lean layer (norms, hashes, the three lookups, rotation, cache growth,
attention, residual adds, GELU), the embedding + stack + final norm (decode_tokens) and the LM head's pass, summed
per step over the `generate` call, with a read probe before each call. The timers are string insertions into the
generated source (nothing of them is in the production kernel); the build registers as the production ops, so run
this in a process of its own.

    PYTHONPATH=. .venv/bin/python benchmarks/results/2026-11-29h-zen4/step_timers.py base [calls, default 6]
"""
import ctypes
import sys
import time

import torch

from modeling_memoryformer import memory_backend_cpu
from modeling_memoryformer.memory_kernel_source import CPP_SOURCE

TIMERS = r"""#include <x86intrin.h>
extern "C" {
extern int mf_mode;
double mf_t[32];
long long mf_n[32];
void mf_read(double* o) { for (int i = 0; i < 32; ++i) { o[i] = mf_t[i]; o[32 + i] = double(mf_n[i]); } }
void mf_reset() { for (int i = 0; i < 32; ++i) { mf_t[i] = 0; mf_n[i] = 0; } }
unsigned long long mf_tsc() { return __rdtsc(); }
int mf_mode = 0;   // 1: the decode ops' layer norms through ATen's kernel (the code before 2026-11-29h); 2: trials
void mf_set_mode(int m) { mf_mode = m; }
}
struct MfT {
  int k; unsigned long long t0;
  explicit MfT(int k_) : k(k_), t0(__rdtsc()) {}
  ~MfT() { mf_t[k] += double(__rdtsc() - t0); mf_n[k] += 1; }
};
"""
NAMES = {0: "norms", 1: "hashes", 2: "lookup QKV", 3: "lookup block 1", 4: "lookup block 2", 5: "rotation",
         6: "growth", 7: "attention", 8: "adds", 13: "gelu", 9: "decode_stack", 10: "decode_tokens", 11: "head",
         12: "session step", 14: "empty parallel_for",
         15: "layer operands", 16: "attend checks", 18: "tokens prologue"}
EDITS = [
    ("const std::optional<at::Tensor>& bias, double eps, at::Tensor* into = nullptr) {\n  if (at::autocast",
     "const std::optional<at::Tensor>& bias, double eps, at::Tensor* into = nullptr) {\n"
     "  static const bool twice = std::getenv(\"MF_NORM_TWICE\") != nullptr;\n"
     "  if (twice) (void)at::native::layer_norm_cpu(x, {x.size(-1)}, weight, bias, eps);\n"
     "  MfT _t(0);\n"
     "  if (mf_mode == 1) return std::get<0>(at::native::layer_norm_cpu(x, {x.size(-1)}, weight, bias, eps));\n"
     "  if (at::autocast"),
    ("  hash_kernel<T>(x.data_ptr<T>(), s.rows.data(), s.scores.data(), N, K, tau, l1, temperature);",
     "  { MfT _t(1); hash_kernel<T>(x.data_ptr<T>(), s.rows.data(), s.scores.data(), N, K, tau, l1, temperature); }"),
    ("  lookup_kernel<T>(s.rows.data(), s.scores.data(), tables.data_ptr<T>(), b, out.data_ptr<T>(), N, K, D);",
     "  { MfT _t(D == 3 * x.size(1) ? 2 : (D > x.size(1) ? 3 : 4));\n"
     "  lookup_kernel<T>(s.rows.data(), s.scores.data(), tables.data_ptr<T>(), b, out.data_ptr<T>(), N, K, D); }"),
    ("      rotate_qk(qkv, cos, sin, num_heads);\n    } else {",
     "      { MfT _t(5); rotate_qk(qkv, cos, sin, num_heads); }\n    } else {"),
    ("      const char* src = static_cast<const char*>(qkv.data_ptr());",
     "      MfT _tg(6);\n      const char* src = static_cast<const char*>(qkv.data_ptr());"),
    ("      decode_attention_into(qkv.data_ptr(), 3 * d, D, new_keys.back(), new_values.back(), num_heads, float(scaling),\n"
     "                            nullptr, nullptr, scratch.attn.data_ptr());",
     "      { MfT _ta(7);\n"
     "      decode_attention_into(qkv.data_ptr(), 3 * d, D, new_keys.back(), new_values.back(), num_heads, float(scaling),\n"
     "                            nullptr, nullptr, scratch.attn.data_ptr()); }"),
    ("void lean_add(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {\n",
     "void lean_add(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {\n  MfT _t(8);\n"),
    ("    const int64_t t = 12 * l, f = 5 * l, i = 9 * l;\n",
     "    const int64_t t = 12 * l, f = 5 * l, i = 9 * l;\n"
     "    if (std::getenv(\"MF_FORK_PROBE\")) { MfT _t(14); at::parallel_for(0, 2, 1, [](int64_t, int64_t) {}); }\n"),
    ("    if (const T* p = span_ahead(tables, stride, rn, rnext, K, k, c0, cb, ce, w, kRowsFar)) prefetch_span<2>(p, w);",
     "    if (mf_mode & 2) {   // trial: the first span's pass fetches each row's whole range of the unit into L2\n"
     "      if (k + kRowsFar < K) { if (c0 == cb) prefetch_span<2>(tables + rn[k + kRowsFar] * stride + cb, ce - cb); }\n"
     "      else if (const T* p = span_ahead(tables, stride, rn, rnext, K, k, c0, cb, ce, w, kRowsFar))\n"
     "        prefetch_span<2>(p, w);\n"
     "    } else if (const T* p = span_ahead(tables, stride, rn, rnext, K, k, c0, cb, ce, w, kRowsFar))\n"
     "      prefetch_span<2>(p, w);"),
    ("    const at::Tensor tables_qkv = required(t + 2), tables1 = required(t + 6), tables2 = required(t + 10);",
     "    MfT* _t15 = new MfT(15);\n"
     "    const at::Tensor tables_qkv = required(t + 2), tables1 = required(t + 6), tables2 = required(t + 10);"),
    ("    at::Tensor qkv;\n", "    delete _t15;\n    at::Tensor qkv;\n"),
    ("    const int64_t N = x.size(0), d = x.size(1), D = d / num_heads;\n",
     "    MfT* _t16 = new MfT(16);\n    const int64_t N = x.size(0), d = x.size(1), D = d / num_heads;\n"),
    ("    if (lean && !masked) {\n", "    delete _t16;\n    if (lean && !masked) {\n"),
    ("  at::Tensor c = cos, s = sin;\n", "  MfT* _t18 = new MfT(18);\n  at::Tensor c = cos, s = sin;\n"),
    ("  auto [h, new_keys, new_values] = decode_stack_op(x, keys, values, std::nullopt, c, s,",
     "  delete _t18;\n  auto [h, new_keys, new_values] = decode_stack_op(x, keys, values, std::nullopt, c, s,"),
    ("  if (gelu) y = at::gelu(y);", "  if (gelu) { MfT _t(13); y = at::gelu(y); }"),
    ('  const char* op = "memoryformer.decode_stack";\n', '  const char* op = "memoryformer.decode_stack";\n  MfT _t(9);\n'),
    ('  const char* op = "memoryformer.decode_tokens";\n', '  const char* op = "memoryformer.decode_tokens";\n  MfT _t(10);\n'),
    ('  const char* op = "memoryformer.decode_session_step";\n',
     '  const char* op = "memoryformer.decode_session_step";\n  MfT _t(12);\n'),
    ("  if (s->head_weight.has_value()) return linear_rows_argmax_op(h, *s->head_weight, s->head_bias);",
     "  if (s->head_weight.has_value()) { MfT _t(11); return linear_rows_argmax_op(h, *s->head_weight, s->head_bias); }"),
]


def timed_source(source: str) -> str:
    for old, new in EDITS:
        assert source.count(old) == 1, f"expected once in the kernel source: {old[:70]!r}"
        source = source.replace(old, new)
    return TIMERS + source


def main() -> None:
    memory_backend_cpu._build_and_register(source=timed_source(CPP_SOURCE))
    from benchmarks.common import loaded_kernel_library, tsc_hz
    from benchmarks.decode_bench import build_in_dtype
    from modeling_memoryformer.evaluation.cpu_load import memory_read_gbps

    lib = loaded_kernel_library()
    hz = tsc_hz(lib)
    torch.set_num_threads(2)
    preset = sys.argv[1] if len(sys.argv) > 1 else "base"
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    ab = "--ab" in sys.argv   # alternate mode 0 and ab_mode call by call (1: the layer norms through ATen)
    ab_mode = int(sys.argv[sys.argv.index("--ab") + 1]) if ab and len(sys.argv) > sys.argv.index("--ab") + 1 else 1
    model = build_in_dtype("mf", preset, "bf16")
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, model.config.vocab_size - 1, (1, 16))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=33, do_sample=False, pad_token_id=0)
    out = (ctypes.c_double * 64)()
    print(f"tsc {hz / 1e9:.3f} GHz; per decode step in us (calls per step)", flush=True)
    for call in range(calls + 1):
        probe = memory_read_gbps(repeats=2)
        mode = (call % 2) * ab_mode if ab else 0
        lib.mf_set_mode(mode)
        with torch.inference_mode():
            model.generate(ids, **kwargs)   # the first runs the prefill and 32 steps; the timers hold the steps only
            lib.mf_reset()
            start = time.perf_counter()
            model.generate(ids, **kwargs)
            total = time.perf_counter() - start
        lib.mf_read(out)
        steps = out[32 + 12]
        if call == 0 or steps == 0:
            continue
        us = {k: out[k] / hz / steps * 1e6 for k in NAMES}
        parts = sum(us[k] for k in (0, 1, 2, 3, 4, 5, 6, 8, 13))
        line = ", ".join(f"{NAMES[k]} {us[k]:.0f}" + (f" ({out[32 + k] / steps:.0f})" if k in (0, 1, 8, 14) else "")
                         for k in NAMES)
        print(f"{f'mode {mode}, ' if ab else ''}probe {probe:.1f} GB/s, generate {total * 1e3:.0f} ms, {steps:.0f} steps: {line}; stack less its parts "
              f"{us[9] - parts:.0f}", flush=True)


if __name__ == "__main__":
    main()
