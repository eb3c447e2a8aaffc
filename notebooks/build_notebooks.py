"""Write the example notebooks from the cell sources below, and optionally execute them in place.

    .venv/bin/python notebooks/build_notebooks.py              # write the five .ipynb files (no outputs)
    .venv/bin/python notebooks/build_notebooks.py --execute    # write, execute (cwd = notebooks/) and save outputs
    .venv/bin/python notebooks/build_notebooks.py --execute 02 # only the notebooks whose name starts with 02

The notebooks are the source of truth for readers; this script is the source of truth for their cells. Edit a
notebook here, regenerate it with --execute, and commit the .ipynb with its outputs (plots are embedded PNGs).
"""

from __future__ import annotations

import argparse
import os
import time

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook


HERE = os.path.dirname(os.path.abspath(__file__))

# First code cell of every notebook: figures inline as PNG, no terminal progress bars in the saved outputs.
SETUP = """\
%matplotlib inline
import os
import warnings

os.environ.setdefault("TQDM_DISABLE", "1")  # progress bars are for terminals; keep the saved outputs short
warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm.auto without ipywidgets"""


def md(text: str):
    return new_markdown_cell(text.strip("\n"))


def code(text: str):
    return new_code_cell(text.strip("\n"))


# ---------------------------------------------------------------------------------------------------------------------
# 01: quickstart

QUICKSTART = [
    md("""
# 01 · Quickstart: MemoryFormer as a Hugging Face model

What this notebook shows, on a model small enough for any laptop:

1. a preset config (`MemoryFormerConfig.from_preset`) and a smaller model built from it;
2. a forward pass with a loss, and `generate()` with and without the KV cache;
3. the `save_pretrained` / `AutoModelForCausalLM.from_pretrained` round trip;
4. the Memory Layer on its own: `MemoryLayer`, `hash_codes`, a shared hash, the reference implementation;
5. the FLOPs and table-memory comparison with the Pythia twins (paper Table 1, the same table as
   `memoryformer flops`), with a bar chart.

**Run time:** about 10 s on 2 CPU cores. Nothing is downloaded.
"""),
    code(SETUP + """
import tempfile

import torch
from transformers import AutoModelForCausalLM

from modeling_memoryformer import MemoryFormerConfig, MemoryFormerForCausalLM, MemoryLayer, memory_lookup_reference

torch.manual_seed(0)
workdir = tempfile.TemporaryDirectory(prefix="mf-quickstart-")
"""),
    md("""
## A preset and a small model

The presets follow the paper: `tiny` has the shape of Pythia-70M (6 blocks, d = 512, 8 heads) with tau = 8 hash bits,
so every d -> d Memory Layer has K = 512 / 8 = 64 tables of 2^8 rows. Any field can be overridden. Counting the
parameters of the full preset on the `meta` device allocates nothing.
"""),
    code("""
preset = MemoryFormerConfig.from_preset("tiny")
print(f"MF-tiny: {preset.num_hidden_layers} blocks, d={preset.hidden_size}, heads={preset.num_attention_heads}, "
      f"tau={preset.hash_bits}, K={preset.num_tables}, expand_bits={preset.expand_bits}, "
      f"intermediate_size={preset.intermediate_size}, vocab={preset.vocab_size}")

with torch.device("meta"):  # shapes only: no memory, no initialisation cost
    full = MemoryFormerForCausalLM(preset)
params = sum(p.numel() for p in full.parameters())
tables = sum(p.numel() for name, p in full.named_parameters() if name.endswith("tables"))
print(f"MF-tiny would hold {params / 1e6:.0f} M parameters, {tables / 1e6:.0f} M of them in hash tables")
del full
"""),
    md("""
For this notebook we keep the preset's hashing (tau = 8, expand_bits = 2) but shrink width, depth and vocabulary, so
the model builds, saves and loads in well under a second.
"""),
    code("""
config = MemoryFormerConfig.from_preset(
    "tiny", num_hidden_layers=2, hidden_size=128, num_attention_heads=4, vocab_size=2048, max_position_embeddings=256
)
model = MemoryFormerForCausalLM(config).eval()
print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters; K={config.num_tables} tables per "
      f"d -> d Memory Layer\\n")
print(model.model.layers[0])
"""),
    md("""
## Forward pass and generation

Labels are the input ids; the model shifts them. At initialisation the loss is close to ln(vocab) = ln 2048 = 7.62.
Greedy decoding with the KV cache gives the same tokens as without it.
"""),
    code("""
ids = torch.randint(1, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    out = model(ids, labels=ids)
print("logits", tuple(out.logits.shape), "loss", round(out.loss.item(), 3))

prompt = ids[:1, :6]
kwargs = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
cached = model.generate(prompt, **kwargs)
uncached = model.generate(prompt, use_cache=False, **kwargs)
print("generated", cached[0, prompt.shape[1]:].tolist())
print("same tokens without the KV cache:", torch.equal(cached, uncached))
"""),
    md("""
## `save_pretrained` and `from_pretrained`

Importing `modeling_memoryformer` registers the model with the Auto classes. `save_pretrained` writes safetensors, the
config and the model's source files (with an `auto_map` in config.json), so the folder also loads with
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` in an environment without this package. Here the
package is imported, and transformers then prefers its registered classes over the copied source files.
"""),
    code("""
folder = os.path.join(workdir.name, "mf-small-demo")
model.save_pretrained(folder)
print(sorted(os.listdir(folder)))

import json

with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
    print("auto_map:", json.load(f)["auto_map"])

again = AutoModelForCausalLM.from_pretrained(folder).eval()
with torch.no_grad():
    print(type(again).__name__, "identical logits:", torch.equal(again(ids).logits, model(ids).logits))
"""),
    md("""
## The Memory Layer on its own

`MemoryLayer(d_in, d_out, hash_bits)` splits its input into K = d_in / tau chunks z_k, hashes each chunk by the signs
of its values into one of 2^tau rows of its own table, and returns `y = sum_k p(z_k) T_k[h(z_k)] + b`. Tables are
stored table-major as one parameter `[K * 2^tau, d_out]`. `hash()` computes (rows, scores) once, so several layers with
the same input can share it (MemoryFormer does this for Q, K and V). `memory_lookup_reference` is the layer written
straight from the equations; every fast path is tested against it.
"""),
    code("""
layer = MemoryLayer(128, 128, hash_bits=8)
other = MemoryLayer(128, 64, hash_bits=8)
print(layer)
print("tables", tuple(layer.tables.shape), "bias", tuple(layer.bias.shape))

x = torch.randn(3, 7, 128)
y = layer(x)
codes = layer.hash_codes(x)
print("y", tuple(y.shape), "| codes", tuple(codes.shape), codes.dtype,
      "in [0, 2**8):", codes.min().item(), codes.max().item())
print("buckets of token 0 in the first 8 tables:", codes[0, 0, :8].tolist())

shared = layer.hash(x)                                  # (rows, scores), each [3, 7, K]
y1, y2 = layer(hashed=shared), other(hashed=shared)     # one hash, two lookups
reference = memory_lookup_reference(x, layer.tables, layer.bias, layer.hash_bits, layer.score, layer.temperature)
print("shared hash gives the same output:", torch.allclose(y1, y), "| y2", tuple(y2.shape))
print(f"max |fast - reference| = {(y - reference).abs().max().item():.2e}")
"""),
    md("""
## FLOPs and table memory against the Pythia twins

The same table `memoryformer flops` prints (`modeling_memoryformer.evaluation.flops.comparison_table`), per block at
sequence length 2048, one multiply-add = one FLOP, memory in fp16 with 1 MB = 1e6 bytes. A lookup costs K * d_out
multiply-adds instead of d_in * d_out, so the fully-connected part shrinks tau = 8 times per layer; attention (2 s^2 d)
is unchanged and dominates what is left. The price is memory: 2^tau / tau = 32 times more values than the dense weights.
"""),
    code("""
from IPython.display import Markdown, display

from modeling_memoryformer.evaluation.flops import (
    comparison_table, layer_memory_table, per_block_flops, pythia_block_flops
)

presets = {name: MemoryFormerConfig.from_preset(name) for name in ("tiny", "small", "base")}
display(Markdown(comparison_table(presets, seq_len=2048)))
display(Markdown("**MF-tiny, table memory per Memory Layer of one block (fp16)**\\n\\n"
                 + layer_memory_table(presets["tiny"])))
"""),
    code("""
import matplotlib.pyplot as plt
import numpy as np

seq_len = 2048
names = list(presets)
mf = [per_block_flops(presets[n], seq_len) for n in names]
dense = [pythia_block_flops(presets[n], seq_len) for n in names]

fig, axes = plt.subplots(1, 2, figsize=(11, 4))
x = np.arange(len(names))
titles = ("fully-connected part (w/o attention)", "whole block")
for ax, key, title in zip(axes, ("without_attention", "total"), titles):
    ax.bar(x - 0.2, [d[key] / 1e9 for d in dense], 0.4, label="Pythia twin (dense)", color="tab:orange")
    ax.bar(x + 0.2, [m[key] / 1e9 for m in mf], 0.4, label="MemoryFormer", color="tab:blue")
    for i, (d, m) in enumerate(zip(dense, mf)):
        ax.text(i + 0.2, m[key] / 1e9, f"{m[key] / d[key]:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [f"MF-{n}" for n in names])
    ax.set_ylabel("GFLOPs per block")
    ax.set_title(f"{title}, seq len {seq_len}")
    ax.grid(axis="y", alpha=0.3)
axes[0].legend()
fig.tight_layout()
plt.show()
"""),
    code("""
workdir.cleanup()
"""),
]


# ---------------------------------------------------------------------------------------------------------------------
# 02: training against the Pythia twin

TRAINING = [
    md("""
# 02 · Training a MemoryFormer against its Pythia twin

The project's main job, `memoryformer demo`, from Python:
`modeling_memoryformer.comparison.demo.run_demo(DemoSettings(...))` trains a MemoryFormer and its Pythia-shaped dense
twin (same width, depth, heads, vocabulary, rotary) on the same tokens, the MemoryFormer at 3x the twin's learning rate
(paper section 4.1), then writes a report folder: `report.md`, `summary.json`, `loss_curves.png`, `buckets.png` (paper
Fig. 4), `samples.md` and both checkpoints.

The data is the embedded default (the source and documentation of the Python standard library this interpreter
ships, split into training and held-out files, with a byte-level BPE trained on it in seconds), so nothing is
downloaded. The scale here is tiny (d = 64, 2 blocks, 48 steps of 8 x 64 tokens): the
numbers show the pipeline, not the paper's quality. The second half shows the lower-level API the demo is built from:
`build_lm_data`, `TrainingSettings`, `train` and `default_learning_rate`.

**Run time:** about 20 s on 2 CPU cores (the two training runs dominate; longer on a busy machine).
"""),
    code(SETUP + """
import tempfile

from IPython.display import Image, Markdown, display

from modeling_memoryformer.comparison.demo import DemoSettings, run_demo

workdir = tempfile.TemporaryDirectory(prefix="mf-demo-")
"""),
    md("""
## `run_demo` at a small scale

Every `DemoSettings` field is a `memoryformer demo` option (`--hidden-size`, `--max-steps`, ...). `out` must not exist
(or pass `overwrite=True`); the folder is written under `<out>.incomplete` and renamed when complete.
"""),
    code("""
settings = DemoSettings(
    out=os.path.join(workdir.name, "demo"),
    vocab_size=1024,        # of the BPE trained on the embedded text
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    hash_bits=8,            # tau: K = 64 / 8 = 8 tables per d -> d Memory Layer
    block_size=64,
    batch_size=8,
    max_steps=48,           # the same token budget for both models
    eval_points=3,
    decode_tokens=32,
)
summary = run_demo(settings)
"""),
    md("""
## The report

`report.md` is the table the command prints. Perplexities are on the held-out last 10% of the text; tokens/s are
measured on this machine and vary with its load. FLOPs are the paper's count at sequence length `block_size`.
"""),
    code("""
print(sorted(os.listdir(settings.out)))
with open(os.path.join(settings.out, "report.md"), encoding="utf-8") as f:
    display(Markdown(f.read()))
"""),
    code("""
display(Image(os.path.join(settings.out, "loss_curves.png")))
"""),
    md("""
Bucket hits of a few tables of the trained MemoryFormer on validation text (paper Fig. 4; notebook 04 looks at them in
detail). The dashed line is the uniform frequency 1 / 2^tau.
"""),
    code("""
display(Image(os.path.join(settings.out, "buckets.png")))
"""),
    code("""
models = summary["models"]
for name, result in models.items():
    print(f"{name:13s} lr {result['learning_rate']:g}  validation perplexity {result['validation_perplexity']:.1f}  "
          f"parameters {result['parameters'] / 1e6:.2f} M")
"""),
    md("""
## The lower-level API

`run_demo` is a thin layer over three pieces you can use directly:

- `modeling_memoryformer.training.data.build_lm_data(data, tokenizer, block_size, vocab_size, validation_fraction)`
  -> `LMData` with `.train` / `.validation` (datasets of `{"input_ids", "labels"}` blocks) and `.tokenizer`. `data` is
  `None` (the embedded corpus, with its own held-out files), a text file, a folder of `.txt` files, a `datasets` object or a dataset id;
  `tokenizer=None` trains a byte-level BPE of `vocab_size` tokens on the training text.
- `modeling_memoryformer.training.trainer.default_learning_rate(model)`: the Pythia rate of the model's width (1e-3 up
  to d = 512), times 3 for a MemoryFormer (paper Table 4: a table row only gets gradient from the tokens that hash to
  it, so the tables want a larger rate).
- `TrainingSettings` + `train(model, data, settings)`: `transformers.Trainer` with the paper's recipe (AdamW betas
  (0.9, 0.95), no decay on biases and norms, clipping at 1, warmup then cosine to 1%) -> `TrainingResult`.
"""),
    code("""
from transformers import set_seed

from modeling_memoryformer import MemoryFormerConfig, MemoryFormerForCausalLM
from modeling_memoryformer.training.data import build_lm_data
from modeling_memoryformer.training.trainer import TrainingSettings, default_learning_rate, train
from modeling_memoryformer.comparison.twin import pythia_twin

data = build_lm_data(None, None, block_size=64, vocab_size=1024, progress=False)
tokenizer = data.tokenizer
print(data.description)
print(f"{len(data.train)} training and {len(data.validation)} validation blocks of {data.block_size} tokens")
print("one example:", {key: tuple(value.shape) for key, value in data.train[0].items()})
print(repr(tokenizer.decode(data.train[0]["input_ids"][:24])))
"""),
    code("""
set_seed(0)
config = MemoryFormerConfig(
    vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=2, hash_bits=8,
    bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
)
model = MemoryFormerForCausalLM(config)
twin = pythia_twin(config)
print(f"dense twin lr {default_learning_rate(twin):g}, MemoryFormer lr {default_learning_rate(model):g} (3x rule), "
      f"or {default_learning_rate(model, lr_multiplier=1.0):g} with lr_multiplier=1")

run = TrainingSettings(
    output_dir=os.path.join(workdir.name, "mf-run"),
    max_steps=20,
    per_device_batch_size=8,
    eval_steps=20,          # evaluate once, at the end
    logging_steps=5,
    report_to="csv",        # log.csv in output_dir
    progress=False,
)
result = train(model, data, run)
print(f"\\n{result.steps} steps, {result.train_tokens:,} tokens, validation loss {result.eval_loss:.3f} "
      f"(perplexity {result.perplexity:.1f}), {result.train_tokens_per_second:,.0f} training tokens/s")
print("output_dir:", sorted(os.listdir(result.output_dir)))
"""),
    code("""
import csv

with open(os.path.join(result.output_dir, "log.csv"), newline="", encoding="utf-8") as f:
    for row in csv.DictReader(f):
        print({key: value for key, value in row.items() if value})
"""),
    code("""
workdir.cleanup()
"""),
]


# ---------------------------------------------------------------------------------------------------------------------
# 03: converting Pythia

CONVERSION = [
    md("""
# 03 · Converting a Pythia (GPT-NeoX) model into a MemoryFormer

`modeling_memoryformer.conversion.convert_pythia(ConvertSettings(...))` (the `memoryformer convert` command) starts a
MemoryFormer from a trained GPT-NeoX checkpoint: embeddings, norms and the LM head are copied, and every dense layer
becomes a Memory Layer whose tables are fitted to reproduce it, either

- **data-free**: a closed-form least-squares fit under a model of the layer's input (no text needed), or
- **calibrated**: a ridge least-squares fit on the inputs each layer really receives when text runs through the
  partially converted model (needs a plain-text file; its last 10% is held out to measure perplexity).

To stay offline and fast, the teacher here is a tiny Pythia-layout model (d = 64, 2 blocks, parallel residual)
trained for 60 steps on the embedded corpus (the Python standard library), so that it is not random. See `conversion/README.md`
for the maths and results on a real teacher.

**Run time:** about 15 s on 2 CPU cores.
"""),
    code(SETUP + """
import tempfile

import torch
from IPython.display import Image, Markdown, display
from transformers import AutoModelForCausalLM, GPTNeoXForCausalLM, set_seed

from modeling_memoryformer import MemoryFormerConfig
from modeling_memoryformer.conversion import ConvertSettings, convert_pythia
from modeling_memoryformer.training.data import build_lm_data, embedded_default_text
from modeling_memoryformer.training.trainer import TrainingSettings, train
from modeling_memoryformer.comparison.twin import pythia_twin_config

workdir = tempfile.TemporaryDirectory(prefix="mf-convert-")
"""),
    md("""
## A small trained teacher

`pythia_twin_config` gives the `GPTNeoXConfig` of the Pythia-shaped twin of a MemoryFormer shape: parallel residual,
GELU MLP of 4d, attention output projection, rotary on a quarter of each head. `train` saves the model and the
tokenizer to its output folder, which is what the converter reads.
"""),
    code("""
data = build_lm_data(None, None, block_size=64, vocab_size=1024, progress=False)
tokenizer = data.tokenizer
shape = MemoryFormerConfig(
    vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=2, hash_bits=8,
    bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
)
teacher_config = pythia_twin_config(shape)
print(f"teacher: GPT-NeoX, d={teacher_config.hidden_size}, {teacher_config.num_hidden_layers} blocks, "
      f"parallel residual={teacher_config.use_parallel_residual}, MLP {teacher_config.intermediate_size}, "
      f"{teacher_config.hidden_act}")

set_seed(0)
teacher = GPTNeoXForCausalLM(teacher_config)
teacher_dir = os.path.join(workdir.name, "teacher")
result = train(teacher, data, TrainingSettings(
    output_dir=teacher_dir, max_steps=60, per_device_batch_size=8, eval_steps=60, logging_steps=20,
    report_to="none", progress=False,
))
print(f"teacher validation perplexity {result.perplexity:.1f} after {result.steps} steps")
print(sorted(os.listdir(teacher_dir)))
"""),
    md("""
## Data-free conversion

No text: the tables come from the dense weights alone. Without held-out text nothing is measured, so the report
only says so. `hash_bits` (tau) must divide d and 4d.
"""),
    code("""
data_free = convert_pythia(ConvertSettings(
    source=teacher_dir, out=os.path.join(workdir.name, "mf-data-free"), init="data-free", hash_bits=8, progress=False,
))
print(data_free["init"], data_free["config"])
with open(os.path.join(workdir.name, "mf-data-free", "conversion_report.md"), encoding="utf-8") as f:
    display(Markdown(f.read()))
"""),
    md("""
## Calibrated conversion

The calibration text is the embedded CPython documentation (`pydoc_data`) written to a file (the converter reads plain-text files). Its
first 90% calibrates (at most `calib_tokens` tokens), the last 10% is held out (`eval_tokens`). The report lists the
held-out perplexity after each stage: the teacher, a MemoryFormer with random weights, the teacher's weights with
random tables, the data-free tables, and the calibrated tables; then the relative L2 error of every Memory Layer
against the dense layer it replaces. The teacher is far from converged (its perplexity is in the hundreds), so its
predictions lean on token frequencies and every fitted stage lands close to it; the per-layer errors show the
difference between the two inits more clearly. Add `distill_steps=N` for a distillation stage after the fit.
"""),
    code("""
calib_text = os.path.join(workdir.name, "calib.txt")
with open(calib_text, "w", encoding="utf-8") as f:
    f.write(embedded_default_text())

calibrated_dir = os.path.join(workdir.name, "mf-calibrated")
report = convert_pythia(ConvertSettings(
    source=teacher_dir,
    out=calibrated_dir,
    init="calibrated",
    calib_text=calib_text,
    hash_bits=8,
    seq_len=64,
    calib_tokens=8192,
    eval_tokens=4096,
    batch_size=8,
    progress=False,
))
print("stages:", list(report["stages"]), "| data:", report["data"])
print(sorted(os.listdir(calibrated_dir)))
"""),
    code("""
with open(os.path.join(calibrated_dir, "conversion_report.md"), encoding="utf-8") as f:
    display(Markdown(f.read()))
"""),
    code("""
display(Image(os.path.join(calibrated_dir, "layer_errors.png")))
"""),
    md("""
## The converted model is an ordinary MemoryFormer

It loads with `AutoModelForCausalLM` (and with `trust_remote_code=True` without this package) and carries the
teacher's tokenizer. It keeps the teacher's structure: parallel residual, a Memory Layer after attention
(`attention_output="memory"`), GELU inside the Memory Block and `expand_bits=0`. On the teacher's own validation
blocks we compare the two models' next-token predictions: how often their top-1 tokens agree, and the mean
KL(teacher || student) per token.
"""),
    code("""
import torch.nn.functional as F

student = AutoModelForCausalLM.from_pretrained(calibrated_dir).eval()
c = student.config
print(type(student).__name__, {k: getattr(c, k) for k in ("use_parallel_residual", "attention_output",
      "memory_block_activation", "expand_bits", "intermediate_size", "num_tables")})

blocks = data.validation.input_ids              # [S, 64]
teacher.eval()
with torch.no_grad():
    teacher_logp = F.log_softmax(teacher(blocks).logits, dim=-1)
    student_logp = F.log_softmax(student(blocks).logits, dim=-1)
agreement = (teacher_logp.argmax(-1) == student_logp.argmax(-1)).float().mean().item()
kl = F.kl_div(student_logp, teacher_logp, log_target=True, reduction="none").sum(-1).mean().item()
print(f"{blocks.numel():,} positions: top-1 agreement {agreement:.1%}, KL(teacher || student) {kl:.4f} nats/token")
"""),
    code("""
workdir.cleanup()
"""),
]


# ---------------------------------------------------------------------------------------------------------------------
# 04: bucket distribution

BUCKETS = [
    md("""
# 04 · Bucket distribution of the hash tables (paper Fig. 4)

Each table of a Memory Layer has 2^tau rows; a token lands in row h(z_k) given by the signs of its chunk z_k. A table
whose rows are hit evenly uses all its parameters; the paper argues that zero-centred inputs (a LayerNorm before
every Memory Layer) give exactly that, and shows near-uniform histograms (Fig. 4).

This notebook

1. trains a tiny MemoryFormer for a few dozen steps on the embedded text;
2. counts bucket hits on validation text with `modeling_memoryformer.evaluation.buckets.collect_bucket_stats`,
   before and after training, and plots them with `plot_bucket_histograms`; uniformity is read as the normalised entropy
   H(p) / log 2^tau (1 = uniform) in `format_summary`;
3. feeds one Memory Layer zero-centred, shifted and re-normalised inputs, to show why the LayerNorm matters.

**Run time:** about 15 s on 2 CPU cores.
"""),
    code(SETUP + """
import tempfile

import torch
from IPython.display import Image, display
from transformers import set_seed

from modeling_memoryformer import MemoryFormerConfig, MemoryFormerForCausalLM, MemoryLayer
from modeling_memoryformer.evaluation.buckets import (
    BucketStats, collect_bucket_stats, format_summary, plot_bucket_histograms
)
from modeling_memoryformer.training.data import build_lm_data
from modeling_memoryformer.training.trainer import TrainingSettings, train

workdir = tempfile.TemporaryDirectory(prefix="mf-buckets-")
"""),
    md("""
## A tiny MemoryFormer, before and after training

The validation blocks (the embedded corpus's held-out files) are the counted tokens. `collect_bucket_stats` takes any iterable of
`LongTensor [B, T]` or dict batches, so a `DataLoader` over `data.validation` works as it is.
"""),
    code("""
data = build_lm_data(None, None, block_size=64, vocab_size=1024, progress=False)
tokenizer = data.tokenizer
set_seed(0)
model = MemoryFormerForCausalLM(MemoryFormerConfig(
    vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=2, hash_bits=8,
    bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
))
validation = torch.utils.data.DataLoader(data.validation, batch_size=16)

at_init = collect_bucket_stats(model, validation, progress=False)
print(f"at initialisation, {at_init.tokens:,} tokens (normalised entropy, 1 = uniform):\\n")
print(format_summary(at_init))
"""),
    code("""
result = train(model, data, TrainingSettings(
    output_dir=os.path.join(workdir.name, "run"), max_steps=80, per_device_batch_size=8, eval_steps=80,
    logging_steps=20, report_to="none", progress=False, save_final_model=False,
))
print(f"validation perplexity {result.perplexity:.1f} after {result.steps} steps")

trained = collect_bucket_stats(model, validation, progress=False)
print(f"\\nafter training, {trained.tokens:,} tokens:\\n")
print(format_summary(trained))
"""),
    md("""
`uniform` is the entropy a perfectly uniform table would show on this many tokens (the plug-in estimate is biased low
when the tokens are not many times the buckets); `max/unif` is the most-hit bucket's frequency over 1 / 2^tau.
The histograms below are table 0 of each kind of Memory Layer in the first and last block.
"""),
    code("""
path = plot_bucket_histograms(trained, os.path.join(workdir.name, "buckets.png"),
                              title=f"Bucket hits after {result.steps} training steps ({trained.tokens:,} tokens)")
display(Image(path))
"""),
    code("""
def entropy_by_layer(stats):
    return {name: s["mean_entropy"] for name, s in stats.summary().items()}

before, after = entropy_by_layer(at_init), entropy_by_layer(trained)
print(f"{'Memory Layer':45s} {'init':>6s} {'trained':>8s}")
for name in before:
    print(f"{name:45s} {before[name]:6.3f} {after[name]:8.3f}")
all_after = list(trained.normalised_entropy().values())
print(f"\\nall {len(all_after)} tables after training: mean {sum(all_after) / len(all_after):.3f}, "
      f"min {min(all_after):.3f}")
"""),
    md("""
At this scale (80 steps, d = 64) the histograms are far from the paper's: the inputs of the later Memory Layers develop
per-feature offsets during training, and a LayerNorm only removes the mean over the features of each token, not an
offset of one feature across tokens. The next section isolates both effects on a single layer.

## Why the LayerNorm matters: one Memory Layer, four kinds of input

Hash codes are sign patterns, so a table's rows are hit evenly only if each input value is positive about half the
time. We hash 16,384 random vectors with a `MemoryLayer(64, 64, hash_bits=8)` (K = 8 tables of 256 rows):

- **zero-centred**: x ~ N(0, 1);
- **shifted**: x + 1, every feature moved by the same amount: most values positive, a few rows take most hits;
- **shifted, then LayerNorm**: LayerNorm subtracts each token's mean over its features, which undoes the shift exactly;
- **per-feature offsets, then LayerNorm**: each feature gets its own fixed offset (mean zero over features); the
  LayerNorm cannot remove it, since it centres each token, not each feature.

`BucketStats` is a plain container (counts `[K, 2^tau]` per layer name), so the same summary and plot apply.
"""),
    code("""
torch.manual_seed(0)
layer = MemoryLayer(64, 64, hash_bits=8)
norm = torch.nn.LayerNorm(64, elementwise_affine=False)
x = torch.randn(16384, 64)
offsets = torch.randn(64)
offsets -= offsets.mean()                      # mean zero over the features of every token

inputs = {
    "zero-centred": x,
    "shifted (+1)": x + 1.0,
    "shifted, LayerNorm": norm(x + 1.0),
    "per-feature offsets, LayerNorm": norm(x + offsets),
}

def bucket_counts(layer, x):
    codes = layer.hash_codes(x)                # [N, K]
    return torch.stack([torch.bincount(codes[:, k], minlength=2**layer.hash_bits) for k in range(layer.num_tables)])

with torch.no_grad():
    counts = {name: bucket_counts(layer, value) for name, value in inputs.items()}
contrast = BucketStats(counts=counts, tokens=x.shape[0])
print(format_summary(contrast))
"""),
    code("""
path = plot_bucket_histograms(contrast, os.path.join(workdir.name, "contrast.png"),
                              tables=[f"{name}[0]" for name in inputs], title="Table 0 of one Memory Layer")
display(Image(path))
"""),
    code("""
workdir.cleanup()
"""),
]


# ---------------------------------------------------------------------------------------------------------------------
# 05: LoRA

LORA = [
    md("""
# 05 · LoRA fine-tuning with PEFT

A Memory Layer has no weight matrix, so LoRA can adapt it in two ways (`modeling_memoryformer.integrations.peft`):

- `kind="memory_layers"`: a dense low-rank path beside each lookup, y = MemoryLayer(x) + (alpha / r) B A x
  (`MemoryLayerLoRA`). It cannot be merged: the lookup is not linear in x.
- `kind="tables"`: LoRA on each layer's `tables` parameter through peft's `target_parameters`,
  T' = T + (alpha / r) B A. The layer stays a lookup, so `merge_and_unload` is exact.

The LM head, the model's only `nn.Linear`, can be added to either (`include_lm_head=True`, trained in full as
`modules_to_save` or with LoRA). This notebook pretrains a tiny MemoryFormer for a moment on one part of the embedded
text, fine-tunes both kinds of adapter on another part, saves and reloads them, and merges.

**Run time:** about 15 s on 2 CPU cores. Needs `peft` (`pip install -e ".[peft]"`).
"""),
    code(SETUP + """
import tempfile

import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM

from modeling_memoryformer import MemoryFormerConfig, MemoryFormerForCausalLM
from modeling_memoryformer.training.data import embedded_default_text, text_blocks, train_bpe_tokenizer
from modeling_memoryformer.integrations.peft import load_memoryformer_adapter, memoryformer_lora_config

warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")  # peft reads it, not us

torch.manual_seed(0)
workdir = tempfile.TemporaryDirectory(prefix="mf-lora-")
"""),
    md("""
## Data and a small base model

Two slices of the embedded CPython documentation: the first 150,000 characters to pretrain the base model, and a
later slice of 40,000 characters as the fine-tuning "domain" (a random 10% of its blocks held out). A byte-level BPE of
512 tokens is trained on the pretraining slice. Training is a short plain PyTorch loop (AdamW on whatever requires
grad), fast enough for a notebook; `transformers.Trainer` works on the PeftModel as well.
"""),
    code("""
text = embedded_default_text()
pretrain_text, domain_text = text[:150_000], text[300_000:340_000]
tokenizer = train_bpe_tokenizer(pretrain_text, vocab_size=512)
pretrain = text_blocks(pretrain_text, tokenizer, 64)                # [S, 64]
domain = text_blocks(domain_text, tokenizer, 64)
order = torch.randperm(domain.shape[0], generator=torch.Generator().manual_seed(0))
held_out, finetune = domain[order[: domain.shape[0] // 10]], domain[order[domain.shape[0] // 10:]]
print(f"blocks of 64 tokens: {pretrain.shape[0]} to pretrain, {finetune.shape[0]} to fine-tune, "
      f"{held_out.shape[0]} held out")


def train_steps(model, blocks, steps, lr, batch_size=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        batch = blocks[torch.randint(0, blocks.shape[0], (batch_size,), generator=generator)]
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return loss.item()


@torch.no_grad()
def held_out_loss(model):
    model.eval()
    return model(held_out, labels=held_out).loss.item()


config = MemoryFormerConfig(
    vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, hash_bits=8,
    bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
)
base = MemoryFormerForCausalLM(config)
train_steps(base, pretrain, steps=150, lr=3e-3)
base_dir = os.path.join(workdir.name, "base")
base.save_pretrained(base_dir)
print(f"base model: {sum(p.numel() for p in base.parameters()):,} parameters; "
      f"held-out loss on the new domain {held_out_loss(base):.3f}")
"""),
    md("""
## Kind "memory_layers": a low-rank path beside every lookup, plus the LM head

`memoryformer_lora_config` builds the `LoraConfig` and registers `MemoryLayerLoRA` with it (peft does not know Memory
Layers). Only the adapters and the LM head copy train.
"""),
    code("""
def fresh_base():
    return AutoModelForCausalLM.from_pretrained(base_dir).eval()


lora_config = memoryformer_lora_config("memory_layers", r=8, alpha=16, include_lm_head=True)
print("target_modules:", sorted(lora_config.target_modules), "| modules_to_save:", lora_config.modules_to_save)
peft_model = get_peft_model(fresh_base(), lora_config)
peft_model.print_trainable_parameters()
print(peft_model.base_model.model.model.layers[0].memory_block.layer1)

before = held_out_loss(peft_model)          # B starts at zero: the same model as the base
train_steps(peft_model, finetune, steps=60, lr=3e-3)  # adapters and the LM head copy
print(f"held-out loss on the new domain: {before:.3f} -> {held_out_loss(peft_model):.3f}")
"""),
    md("""
### Save, load, and the merge that cannot be

The custom-module registration is not stored in `adapter_config.json`, so load with `load_memoryformer_adapter`, which
registers `MemoryLayerLoRA` again. The reloaded adapter gives identical logits. `merge_and_unload` raises a clear
error: no change of the tables reproduces a dense path B A x.
"""),
    code("""
adapter_dir = os.path.join(workdir.name, "adapter-memory-layers")
peft_model.save_pretrained(adapter_dir)
print(sorted(os.listdir(adapter_dir)))

reloaded = load_memoryformer_adapter(fresh_base(), adapter_dir)
with torch.no_grad():
    print("identical logits after reload:", torch.equal(reloaded(held_out).logits, peft_model(held_out).logits))

try:
    peft_model.merge_and_unload()
except ValueError as error:
    print("ValueError:", error)
"""),
    md("""
## Kind "tables": LoRA on the hash tables, mergeable

Here A is `[r, d_out]` and B is `[K * 2^tau, r]` for each Memory Layer's tables. The update T + (alpha / r) B A is
built in full at every forward, so this kind costs table-sized memory while training, and merges exactly. Like the
tables themselves (the 3x rule of notebook 02), it wants a larger learning rate: a row of B only gets gradient from
the tokens that hash to it.
"""),
    code("""
tables_config = memoryformer_lora_config("tables", r=4, alpha=8)
print("target_parameters:", tables_config.target_parameters)
tables_model = get_peft_model(fresh_base(), tables_config)
tables_model.print_trainable_parameters()

before = held_out_loss(tables_model)
train_steps(tables_model, finetune, steps=60, lr=1e-2)
print(f"held-out loss on the new domain: {before:.3f} -> {held_out_loss(tables_model):.3f}")

tables_dir = os.path.join(workdir.name, "adapter-tables")
tables_model.save_pretrained(tables_dir)
reloaded = load_memoryformer_adapter(fresh_base(), tables_dir)
with torch.no_grad():
    print("identical logits after reload:", torch.equal(reloaded(held_out).logits, tables_model(held_out).logits))
"""),
    md("""
`merge_and_unload` folds the update into the tables and returns a plain `MemoryFormerForCausalLM`. The comparison
runs in float64: a Memory Layer hashes the signs of its input, so float32 rounding differences between the two code
paths could flip a bit somewhere and change an output.
"""),
    code("""
reloaded = load_memoryformer_adapter(fresh_base(), tables_dir).double()
with torch.no_grad():
    unmerged = reloaded(held_out).logits
merged = reloaded.merge_and_unload()
with torch.no_grad():
    merged_logits = merged(held_out).logits
print(type(merged).__name__, "| parameters:", f"{sum(p.numel() for p in merged.parameters()):,}")
print(f"max |merged - unmerged| = {(merged_logits - unmerged).abs().max().item():.1e}")
print("merged model is a plain MemoryFormer again:", not any("lora" in name for name, _ in merged.named_parameters()))
"""),
    code("""
workdir.cleanup()
"""),
]


NOTEBOOKS = {
    "01_quickstart.ipynb": QUICKSTART,
    "02_training_vs_pythia_twin.ipynb": TRAINING,
    "03_converting_pythia.ipynb": CONVERSION,
    "04_bucket_distribution.ipynb": BUCKETS,
    "05_lora_finetuning.ipynb": LORA,
}


def build(cells) -> nbformat.NotebookNode:
    notebook = new_notebook(cells=cells)
    for index, cell in enumerate(notebook.cells):
        cell.id = f"cell-{index:02d}"  # stable ids: regenerating a notebook does not rewrite every cell
    notebook.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    notebook.metadata["language_info"] = {"name": "python"}
    return notebook


def execute(notebook: nbformat.NotebookNode, timeout: int = 600) -> nbformat.NotebookNode:
    """Run every cell with the python3 kernel, cwd = notebooks/; raises on the first error. One OpenMP thread: the
    models are too small to gain from more, and on a busy machine OpenMP threads waiting for each other can make a
    step tens of times slower (tests/project/test_notebooks.py runs them the same way)."""
    from nbclient import NotebookClient

    client = NotebookClient(notebook, timeout=timeout, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": HERE}})
    client.execute(env={**os.environ, "OMP_NUM_THREADS": "1"})
    return notebook


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--execute", action="store_true", help="run the notebooks and save them with outputs")
    parser.add_argument("only", nargs="*", help="name prefixes of the notebooks to write (default: all)")
    args = parser.parse_args()
    for name, cells in NOTEBOOKS.items():
        if args.only and not any(name.startswith(prefix) for prefix in args.only):
            continue
        notebook = build(cells)
        if args.execute:
            start = time.perf_counter()
            execute(notebook)
            print(f"{name}: executed in {time.perf_counter() - start:.0f} s")
        nbformat.validate(notebook)
        nbformat.write(notebook, os.path.join(HERE, name))


if __name__ == "__main__":
    main()
