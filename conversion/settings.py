"""The options of `memoryformer convert`: `ConvertSettings`, from whose fields the command line is made
(`cli.arguments`), and the checks of their values.

A light module (no torch, no transformers), so that `memoryformer convert --help` answers at once; the conversion
itself is `convert.convert_pythia`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..training.settings import option, required

INITS = ("data-free", "calibrated")


class ConversionError(ValueError):
    """The source checkpoint, the options or the output folder cannot be converted; the message says why and how."""


@dataclass
class ConvertSettings:
    """Options of `memoryformer convert`. Values are checked here, when the settings are made; paths and the source
    when the conversion starts (`convert.check_settings`)."""

    source: str = required("GPT-NeoX model folder (safetensors) or Hub id", flag="--from")
    out: str = required("output folder (must not exist unless --overwrite)")
    init: str | None = option(
        None, "table initialisation (default: calibrated with --calib-text, else data-free)", choices=INITS)
    calib_text: str | None = option(None, "plain-text file for calibration and distillation")
    eval_text: str | None = option(
        None, "held-out plain text (default: the last --eval-fraction of --calib-text)")
    eval_fraction: float = option(
        0.1, "share of --calib-text held out for evaluation when no --eval-text is given")
    tokenizer: str | None = option(None, "tokenizer folder or Hub id (default: the source's)")
    hash_bits: int = option(8, "tau; must divide d and 4d")
    hash_temperature: float = option(1.0, "temperature t of the bucket scores")
    seq_len: int = option(128, "tokens per sequence (calibration, distillation and evaluation)")
    calib_tokens: int = option(32768, "calibration tokens per fit (bounds the fit's memory)")
    eval_tokens: int = option(16384, "held-out tokens for the perplexities and layer errors")
    ridge: float = option(0.1, "ridge strength relative to the mean diagonal of the design's normal matrix")
    sweeps: int = option(20, "max block-coordinate sweeps per layer")
    tolerance: float = option(
        1e-3, "stop a layer's sweeps once one changes its tables by less than this (relative norm)")
    distill_steps: int = option(0, "distillation steps (0: none, unless --distill-cpu-minutes sets a budget)")
    distill_cpu_minutes: float | None = option(
        None, "CPU-time budget of distillation (the schedule runs over it; with --distill-steps, whichever ends "
        "first)")
    distill_lr: float = option(1e-4, "peak AdamW rate; higher rates (3e-4 and up) measurably hurt a calibrated start")
    distill_embeddings: bool = option(
        False, "also train the token embeddings and LM head (copied from the teacher; frozen by default)")
    batch_size: int = option(8, "distillation batch size")
    seed: int = option(0, "seed of the calibration sample and of distillation")
    overwrite: bool = option(False, "replace an existing --out folder")
    progress: bool = option(True, "no progress bars (default: progress bars shown)", flag="--no-progress")

    @property
    def resolved_init(self) -> str:
        return self.init or ("calibrated" if self.calib_text else "data-free")

    def __post_init__(self):
        if self.init not in (None, *INITS):
            raise ConversionError(f"--init {self.init!r} is not supported; choose one of {', '.join(INITS)}.")
        if self.resolved_init == "calibrated" and not self.calib_text:
            raise ConversionError("--init calibrated needs calibration text: pass --calib-text FILE (plain text).")
        if (self.distill_steps or self.distill_cpu_minutes) and not self.calib_text:
            raise ConversionError("Distillation needs training text: pass --calib-text FILE (plain text).")
        if self.distill_cpu_minutes is not None and not self.distill_cpu_minutes > 0:
            raise ConversionError(f"--distill-cpu-minutes must be > 0, got {self.distill_cpu_minutes!r}.")
        for flag, value, low in (
            ("--seq-len", self.seq_len, 2),
            ("--calib-tokens", self.calib_tokens, self.seq_len),
            ("--eval-tokens", self.eval_tokens, self.seq_len),
            ("--sweeps", self.sweeps, 1),
            ("--batch-size", self.batch_size, 1),
            ("--distill-steps", self.distill_steps, 0),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConversionError(f"{flag} must be an integer >= {low}, got {value!r}.")
        if not 0 < self.eval_fraction < 1:
            raise ConversionError(f"--eval-fraction must be in (0, 1), got {self.eval_fraction!r}.")
        if not self.ridge >= 0:
            raise ConversionError(f"--ridge must be >= 0, got {self.ridge!r}.")
        # hash_bits and hash_temperature: MemoryFormerConfig checks them (conversion.mapping names the flag)
