"""Facts about the running CPU, read in one place: its name and flags (/proc/cpuinfo), its caches (sysfs, then
sysconf), and which -march builds it can run. The kernel build, the kernel report and the benchmarks all ask here.
"""

from __future__ import annotations

import os
import platform


# Vector features worth knowing for this kernel, in the order printed (names as /proc/cpuinfo spells them).
X86_FEATURES = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni",
    "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
)
ARM_FEATURES = ("asimd", "asimdhp", "asimddp", "fphp", "bf16", "i8mm", "sve", "sve2", "svebf16", "sme")


def cpuinfo_lines() -> list[str]:
    """The lines of /proc/cpuinfo (none where it does not exist)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return f.read().splitlines()
    except OSError:
        return []


def cpu_model() -> str:
    """The CPU's marketing name ("AMD EPYC 9R14 ..."), or the best the platform module knows."""
    for line in cpuinfo_lines():
        key = line.split(":", 1)[0].strip().lower()
        if key in ("model name", "hardware", "cpu model") and ":" in line:
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_description() -> str:
    """The CPU as a benchmark record should name it: the model name, the x86 family and model numbers (a KVM guest
    often shows only "AMD EPYC"; family 25 model 1 is Zen 3, family 25 model 17 Zen 4) and the vector features."""
    fields = {}
    for line in cpuinfo_lines():
        if ":" in line:
            key, value = (part.strip() for part in line.split(":", 1))
            fields.setdefault(key.lower(), value)
    family = f", family {fields['cpu family']} model {fields['model']}" if "cpu family" in fields and "model" in fields else ""
    return f"{cpu_model()}{family} ({', '.join(cpu_features()) or 'no vector features listed'})"


def _flags_line() -> tuple[str, set[str]]:
    for line in cpuinfo_lines():
        key = line.split(":", 1)[0].strip().lower()
        if key in ("flags", "features") and ":" in line:
            return key, set(line.split(":", 1)[1].split())
    return "", set()


def cpu_flags() -> set[str]:
    """Every flag of the first CPU: /proc/cpuinfo's "flags" (x86) or "Features" (aarch64) line."""
    return _flags_line()[1]


def cpu_features() -> list[str]:
    """The vector features of the CPU that matter here (x86: SSE4.2 ... AVX-512, AMX; aarch64: ASIMD, SVE, ...)."""
    key, flags = _flags_line()
    wanted = ARM_FEATURES if key == "features" else X86_FEATURES
    return [name for name in wanted if name in flags]


def detected_cache_sizes() -> tuple[int, int, int]:
    """(L1d, L2, L3) bytes as the OS reports them (sysfs, then sysconf); 0 where unknown. Used without the kernel.

    sysfs first: glibc's sysconf(_SC_LEVEL3_CACHE_SIZE) can be wrong in VMs (320 MiB for a 32 MiB L3 on an AMD EPYC
    guest with glibc 2.36), while /sys/devices/system/cpu/cpu0/cache has what the hypervisor exposes.
    """
    sizes = [0, 0, 0]
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        entries = []
    for entry in entries:
        try:
            with open(os.path.join(base, entry, "level"), encoding="utf-8") as f:
                level = int(f.read())
            with open(os.path.join(base, entry, "type"), encoding="utf-8") as f:
                kind = f.read().strip()
            with open(os.path.join(base, entry, "size"), encoding="utf-8") as f:
                size = parse_size(f.read().strip())
        except (OSError, ValueError):
            continue
        if 1 <= level <= 3 and kind in ("Data", "Unified") and not sizes[level - 1]:
            sizes[level - 1] = size
    for i, name in enumerate(("SC_LEVEL1_DCACHE_SIZE", "SC_LEVEL2_CACHE_SIZE", "SC_LEVEL3_CACHE_SIZE")):
        if not sizes[i]:
            try:
                sizes[i] = max(0, int(os.sysconf(name)))
            except (ValueError, OSError, AttributeError):
                pass
    return sizes[0], sizes[1], sizes[2]


def parse_size(text: str) -> int:
    """"48K", "1M", "32MiB", "1048576" -> bytes (binary multiples)."""
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(value[-1:], 1)
    number = value[:-1] if scale > 1 else value
    try:
        size = int(float(number) * scale)
    except ValueError:
        raise ValueError(
            f"{text!r} is not a size; write bytes or a number with K, M or G, e.g. 48K, 1M, 32M."
        ) from None
    if size < 0:
        raise ValueError(f"a cache size cannot be negative, got {text!r}.")
    return size


_X86_64_V2 = ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3")
_X86_64_V3 = _X86_64_V2 + ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "abm")  # abm: lzcnt
_X86_64_LEVELS = {
    "x86-64": (),
    "x86-64-v2": _X86_64_V2,
    "x86-64-v3": _X86_64_V3,
    "x86-64-v4": _X86_64_V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
}


def cpu_can_run(march: str) -> bool:
    """Whether this CPU runs code built with -march=<march>: "native"; x86-64 levels by the /proc/cpuinfo flags
    ("x86-64" on any x86_64, "x86-64-v2"/"-v3"/"-v4" when every flag of the level is listed); "armv8-a" on aarch64."""
    machine = platform.machine().lower()
    if march == "native":
        return True
    if march == "armv8-a":
        return machine in ("aarch64", "arm64")
    if march not in _X86_64_LEVELS:
        raise ValueError(f"cpu_can_run knows native, armv8-a and {', '.join(_X86_64_LEVELS)}; got {march!r}.")
    if machine not in ("x86_64", "amd64"):
        return False
    flags = cpu_flags()
    return all(flag in flags or (flag == "abm" and "lzcnt" in flags) for flag in _X86_64_LEVELS[march])
