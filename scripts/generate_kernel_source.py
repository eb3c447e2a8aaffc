"""Regenerate `modeling_memoryformer/memory_kernel_source.py` from the parts in `modeling_memoryformer/csrc/cpu/`.

The C++ kernel is edited as real files: one translation unit split by concern into the parts of csrc/cpu/, joined in
the order that csrc/cpu/parts.txt lists (a part uses what the parts before it define). `save_pretrained` copies only
Python modules for remote code, so the joined source also travels as a string in a generated sibling module. Each
part is preceded by a `#line 1 "modeling_memoryformer/csrc/cpu/<part>"` directive, so compiler errors name the part
and its line. tests/kernel/test_kernel_source.py fails when the module and the parts differ.

    python scripts/generate_kernel_source.py          # rewrite the module
    python scripts/generate_kernel_source.py --check  # exit 1 when it is out of date
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS_DIR = ROOT / "modeling_memoryformer" / "csrc" / "cpu"
MANIFEST = PARTS_DIR / "parts.txt"  # the parts in order, one file name a line; `#` starts a comment
MODULE = ROOT / "modeling_memoryformer" / "memory_kernel_source.py"
LINE_PREFIX = "modeling_memoryformer/csrc/cpu/"  # + the part's name: the file compiler errors name

HEADER = '''"""C++ source of the fused CPU Memory Layer kernels: GENERATED from csrc/cpu/, do not edit.

Edit the parts in modeling_memoryformer/csrc/cpu/ (their order: csrc/cpu/parts.txt), then run
`python scripts/generate_kernel_source.py`.
The source travels as a string so that `save_pretrained` copies it with the model files and remote-code loading
(`trust_remote_code=True`) can build the kernel too; `memory_ops.load_fused_kernels` compiles it at first use.
It is the parts joined in order, each preceded by a #line directive, so compiler errors name the part and its line.
"""

CPP_SOURCE = r"""'''


def part_names() -> list[str]:
    """The parts in csrc/cpu/parts.txt's order. Every listed part exists, and every file of csrc/cpu/ but the manifest
    is listed once (a part left out of the list would silently drop out of the build)."""
    names = [line.strip() for line in MANIFEST.read_text(encoding="utf-8").splitlines()]
    names = [name for name in names if name and not name.startswith("#")]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    missing = [name for name in names if not (PARTS_DIR / name).is_file()]
    unlisted = sorted(p.name for p in PARTS_DIR.iterdir() if p.is_file() and p != MANIFEST and p.name not in names)
    if duplicates or missing or unlisted:
        raise ValueError(f"{MANIFEST.relative_to(ROOT)} must list every part of {PARTS_DIR.relative_to(ROOT)} once: "
                         f"listed twice {duplicates}, missing {missing}, not listed {unlisted}")
    return names


def read_parts() -> list[tuple[str, str]]:
    """(name, text) of every part, in order."""
    return [(name, (PARTS_DIR / name).read_text(encoding="utf-8")) for name in part_names()]


def cpp_source(parts: Iterable[tuple[str, str]] | None = None) -> str:
    """The translation unit: each part preceded by `#line 1 "modeling_memoryformer/csrc/cpu/<name>"`. `parts`: (name,
    text) pairs in order, read from csrc/cpu/ by default (tests pass altered copies)."""
    chunks = []
    for name, text in read_parts() if parts is None else parts:
        if not text.endswith("\n"):
            raise ValueError(f"{LINE_PREFIX}{name} must end with a newline (the next part's #line starts a line)")
        chunks.append(f'#line 1 "{LINE_PREFIX}{name}"\n{text}')
    return "".join(chunks)


def module_text(cpp_text: str) -> str:
    """The generated module for a given C++ source (the joined parts, #line directives included)."""
    if '"""' in cpp_text:
        raise ValueError(f"{PARTS_DIR} must not contain three double quotes: the source is embedded in a raw "
                         "triple-quoted string.")
    return f'{HEADER}{cpp_text}"""\n'


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the module is out of date, write nothing")
    args = parser.parse_args(argv)
    expected = module_text(cpp_source())
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
