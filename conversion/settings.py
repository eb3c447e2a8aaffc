"""The options of `memoryformer convert`: `ConvertSettings` and the command-line arguments made from it.

A light module (no torch, no transformers), so that `memoryformer convert --help` answers at once; the conversion
itself is `convert.convert_pythia`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


INITS = ("data-free", "calibrated")


@dataclass
class ConvertSettings:
    """Options of `memoryformer convert` (see `add_convert_arguments` for their meaning)."""

    source: str
    out: str
    init: str | None = None  # None: "calibrated" when calib_text is given, else "data-free"
    calib_text: str | None = None
    eval_text: str | None = None  # None: the last eval_fraction of calib_text is held out
    eval_fraction: float = 0.1
    tokenizer: str | None = None  # None: the source folder's tokenizer
    hash_bits: int = 8
    hash_temperature: float = 1.0
    seq_len: int = 128
    calib_tokens: int = 32768
    eval_tokens: int = 16384
    ridge: float = 0.1
    sweeps: int = 20
    tolerance: float = 1e-3
    distill_steps: int = 0
    distill_cpu_minutes: float | None = None
    distill_lr: float = 1e-4
    distill_embeddings: bool = False
    batch_size: int = 8
    seed: int = 0
    overwrite: bool = False
    progress: bool = True

    @property
    def resolved_init(self) -> str:
        return self.init or ("calibrated" if self.calib_text else "data-free")


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `memoryformer convert`."""
    defaults = ConvertSettings(source="", out="")
    parser.add_argument("--from", dest="source", required=True, help="GPT-NeoX model folder (safetensors) or Hub id")
    parser.add_argument("--out", required=True, help="output folder (must not exist unless --overwrite)")
    parser.add_argument("--init", choices=INITS, default=None,
                        help="table initialisation (default: calibrated with --calib-text, else data-free)")
    parser.add_argument("--calib-text", default=None, help="plain-text file for calibration and distillation")
    parser.add_argument("--eval-text", default=None,
                        help="held-out plain text (default: the last --eval-fraction of --calib-text)")
    parser.add_argument("--eval-fraction", type=float, default=defaults.eval_fraction,
                        help="share of --calib-text held out for evaluation when no --eval-text is given")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder or Hub id (default: the source's)")
    parser.add_argument("--hash-bits", type=int, default=defaults.hash_bits, help="tau; must divide d and 4d")
    parser.add_argument("--hash-temperature", type=float, default=defaults.hash_temperature,
                        help="temperature t of the bucket scores")
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len, help="tokens per sequence (calibration, "
                        "distillation and evaluation)")
    parser.add_argument("--calib-tokens", type=int, default=defaults.calib_tokens,
                        help="calibration tokens per fit (bounds the fit's memory)")
    parser.add_argument("--eval-tokens", type=int, default=defaults.eval_tokens,
                        help="held-out tokens for the perplexities and layer errors")
    parser.add_argument("--ridge", type=float, default=defaults.ridge,
                        help="ridge strength relative to the mean diagonal of the design's normal matrix")
    parser.add_argument("--sweeps", type=int, default=defaults.sweeps, help="max block-coordinate sweeps per layer")
    parser.add_argument("--tolerance", type=float, default=defaults.tolerance,
                        help="stop a layer's sweeps once one changes its tables by less than this (relative norm)")
    parser.add_argument("--distill-steps", type=int, default=defaults.distill_steps,
                        help="distillation steps (0: none, unless --distill-cpu-minutes sets a budget)")
    parser.add_argument("--distill-cpu-minutes", type=float, default=None,
                        help="CPU-time budget of distillation (the schedule runs over it; with --distill-steps, whichever ends first)")
    parser.add_argument("--distill-lr", type=float, default=defaults.distill_lr,
                        help="peak AdamW rate; higher rates (3e-4 and up) measurably hurt a calibrated start")
    parser.add_argument("--distill-embeddings", action="store_true",
                        help="also train the token embeddings and LM head (copied from the teacher; frozen by default)")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="distillation batch size")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed of the calibration sample and of "
                        "distillation")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    parser.add_argument("--quiet", dest="progress", action="store_false",
                        help="no progress bars (default: progress bars shown)")
