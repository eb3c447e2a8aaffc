"""The decode lookups' prefetch distances and unit orders on the running CPU: a development build of the kernel with
lookup_token.h's constants (kNarrowSpans, kRowsAhead, kRowsFar, kBlockRows, kBlockAhead) made settable at run time and
rdtsc timers around the three lookups of decode_stack's lean layer (Q/K/V, the Memory Block's two layers), summed per
step inside `generate`; the settings alternate call by call in one process, round after round, so each round compares
them in the same minute. String insertions into the generated source: nothing of this is in the production kernel.

    PYTHONPATH=. .venv/bin/python benchmarks/results/2026-11-29-xeon-amx/lookup_sweep.py base [rounds, default 4]
"""
import ctypes
import statistics
import sys

import torch

from modeling_memoryformer import memory_backend_cpu
from modeling_memoryformer.memory_kernel_source import CPP_SOURCE

HEADER = r"""#include <x86intrin.h>
#include <cstdint>
extern "C" {
double mf_t[8];
long long mf_n[8];
int64_t mf_knob[5] = {6, 4, 12, 8, 4};
void mf_read(double* o) { for (int i = 0; i < 8; ++i) { o[i] = mf_t[i]; o[8 + i] = double(mf_n[i]); } }
void mf_reset() { for (int i = 0; i < 8; ++i) { mf_t[i] = 0; mf_n[i] = 0; } }
unsigned long long mf_tsc() { return __rdtsc(); }
void mf_set(int64_t a, int64_t b, int64_t c, int64_t d, int64_t e) {
  mf_knob[0] = a; mf_knob[1] = b; mf_knob[2] = c; mf_knob[3] = d; mf_knob[4] = e; }
}
struct MfT {
  int k; unsigned long long t0;
  explicit MfT(int k_) : k(k_), t0(__rdtsc()) {}
  ~MfT() { mf_t[k] += double(__rdtsc() - t0); mf_n[k] += 1; }
};
"""
EDITS = [
    ("constexpr int64_t kBlockRows = 8, kBlockAhead = 4;",
     "static int64_t& kBlockRows = mf_knob[3];\nstatic int64_t& kBlockAhead = mf_knob[4];"),
    ("constexpr int64_t kNarrowSpans = 6, kRowsAhead = 4, kRowsFar = 12;",
     "static int64_t& kNarrowSpans = mf_knob[0];\nstatic int64_t& kRowsAhead = mf_knob[1];\n"
     "static int64_t& kRowsFar = mf_knob[2];"),
    ("  lookup_kernel<T>(s.rows.data(), s.scores.data(), tables.data_ptr<T>(), b, out.data_ptr<T>(), N, K, D);",
     "  { MfT _t(D == 3 * x.size(1) ? 0 : (D > x.size(1) ? 1 : 2));\n"
     "  lookup_kernel<T>(s.rows.data(), s.scores.data(), tables.data_ptr<T>(), b, out.data_ptr<T>(), N, K, D); }"),
    ('  const char* op = "memoryformer.decode_session_step";\n',
     '  const char* op = "memoryformer.decode_session_step";\n  MfT _t(3);\n'),
]
# (kNarrowSpans, kRowsAhead, kRowsFar, kBlockRows, kBlockAhead): the production settings first
SETTINGS = [(6, 4, 12, 8, 4), (6, 4, 24, 8, 4), (6, 8, 24, 8, 4), (6, 4, 40, 8, 4), (6, 8, 48, 8, 4),
            (0, 4, 12, 8, 4), (0, 4, 12, 8, 8), (0, 4, 12, 16, 8), (24, 4, 24, 8, 4)]


def main() -> None:
    source = CPP_SOURCE
    for old, new in EDITS:
        assert source.count(old) == 1, old[:60]
        source = source.replace(old, new)
    memory_backend_cpu._build_and_register(source=HEADER + source)
    from benchmarks.common import loaded_kernel_library, tsc_hz
    from benchmarks.decode_bench import build_in_dtype
    from modeling_memoryformer.evaluation.cpu_load import memory_read_gbps

    lib = loaded_kernel_library()
    hz = tsc_hz(lib)
    torch.set_num_threads(2)
    preset = sys.argv[1] if len(sys.argv) > 1 else "base"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    model = build_in_dtype("mf", preset, "bf16")
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, model.config.vocab_size - 1, (1, 16))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=33, do_sample=False, pad_token_id=0)
    out = (ctypes.c_double * 16)()
    results = {s: [] for s in SETTINGS}
    with torch.inference_mode():
        reference = model.generate(ids, **kwargs)
    for r in range(rounds):
        probe = memory_read_gbps(repeats=2)
        for setting in SETTINGS:
            lib.mf_set(*[ctypes.c_int64(v) for v in setting])
            with torch.inference_mode():
                model.generate(ids, **kwargs)
                lib.mf_reset()
                got = model.generate(ids, **kwargs)
            assert torch.equal(got, reference), setting
            lib.mf_read(out)
            steps = out[8 + 3]
            us = [out[k] / hz / steps * 1e6 for k in range(4)]
            results[setting].append(us)
            print(f"round {r} probe {probe:.1f} GB/s {setting}: QKV {us[0]:.0f} block1 {us[1]:.0f} block2 {us[2]:.0f} "
                  f"lookups {sum(us[:3]):.0f} step {us[3]:.0f} us", flush=True)
    print("medians over rounds (us per step): lookups / step")
    for setting, rows in results.items():
        print(setting, f"{statistics.median(sum(u[:3]) for u in rows):.0f} / {statistics.median(u[3] for u in rows):.0f}")


if __name__ == "__main__":
    main()
