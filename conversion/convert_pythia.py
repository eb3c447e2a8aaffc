"""Convert a Pythia (GPT-NeoX) checkpoint into a MemoryFormer; the same as `memoryformer convert`.

    python conversion/convert_pythia.py --from PATH_OR_HUB_ID --out DIR [--init data-free|calibrated]
        [--calib-text FILE] [--distill-steps N] ...

See conversion/README.md for the method and `--help` for every option.
"""

from __future__ import annotations

import argparse
import sys

from modeling_memoryformer.conversion import add_convert_arguments, run_convert


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="convert_pythia", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_convert_arguments(parser)
    return run_convert(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
