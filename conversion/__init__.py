"""Convert a Pythia (GPT-NeoX) checkpoint into a MemoryFormer: `memoryformer convert --from SRC --out DIR`, or
`convert_pythia(ConvertSettings(source=..., out=...))` from Python.

The pipeline, one module per step:

    settings        ConvertSettings and the `memoryformer convert` options (no torch: `--help` answers at once)
    mapping         config and weights that carry over; the dense layers each Memory Layer replaces
    tables          least-squares tables: data-free closed form, calibrated ridge fit (formulas there)
    initialization  which input model / calibration data each Memory Layer of a block gets
    distill         optional distillation, KL(teacher || student) through transformers.Trainer
    evaluate        per-layer relative errors and held-out perplexity
    convert         the checks, the steps in order, the output folder and its report (`convert_pythia`)

This folder installs as `modeling_memoryformer.conversion` (a package-dir mapping in pyproject.toml). Beside it,
`experiments/` holds the teacher and quality scripts and `results/` their committed output; neither is installed.
"""

from .settings import ConvertSettings

__all__ = ["ConvertSettings", "convert_pythia"]


def __getattr__(name: str):
    # The converter imports torch and transformers: loaded on first use, so that the settings import light.
    if name == "convert_pythia":
        from .convert import convert_pythia

        return convert_pythia
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
