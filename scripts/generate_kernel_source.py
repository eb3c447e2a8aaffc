"""Regenerate `modeling_memoryformer/memory_kernel_source.py` from `modeling_memoryformer/csrc/memoryformer_cpu.cpp`.

The C++ kernel is edited as a real file (csrc/memoryformer_cpu.cpp). `save_pretrained` copies only Python modules
for remote code, so the source also travels as a string in a generated sibling module; its first line is a `#line`
directive, so compiler errors name the .cpp file and its line. tests/kernel/test_kernel_source.py fails when the two differ.

    python scripts/generate_kernel_source.py          # rewrite the module
    python scripts/generate_kernel_source.py --check  # exit 1 when it is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPP = ROOT / "modeling_memoryformer" / "csrc" / "memoryformer_cpu.cpp"
MODULE = ROOT / "modeling_memoryformer" / "memory_kernel_source.py"
LINE_NAME = "modeling_memoryformer/csrc/memoryformer_cpu.cpp"  # the name compiler errors show

HEADER = '''"""C++ source of the fused CPU Memory Layer kernels: GENERATED from csrc/memoryformer_cpu.cpp, do not edit.

Edit modeling_memoryformer/csrc/memoryformer_cpu.cpp, then run `python scripts/generate_kernel_source.py`.
The source travels as a string so that `save_pretrained` copies it with the model files and remote-code loading
(`trust_remote_code=True`) can build the kernel too; `memory_ops.load_fused_kernels` compiles it at first use.
Its first line is a #line directive, so compiler errors name the .cpp file and its line numbers.
"""

CPP_SOURCE = r"""'''


def module_text(cpp_text: str) -> str:
    """The generated module for a given C++ source."""
    if '"""' in cpp_text:
        raise ValueError(f"{CPP} must not contain three double quotes: it is embedded in a raw triple-quoted string.")
    return f'{HEADER}#line 1 "{LINE_NAME}"\n{cpp_text}"""\n'


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the module is out of date, write nothing")
    args = parser.parse_args(argv)
    expected = module_text(CPP.read_text(encoding="utf-8"))
    current = MODULE.read_text(encoding="utf-8") if MODULE.exists() else ""
    if args.check:
        if current != expected:
            print(f"{MODULE.relative_to(ROOT)} is out of date; run: python scripts/generate_kernel_source.py",
                  file=sys.stderr)
            return 1
        return 0
    if current != expected:
        MODULE.write_text(expected, encoding="utf-8")
        print(f"wrote {MODULE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
