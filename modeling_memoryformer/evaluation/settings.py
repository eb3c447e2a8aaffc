"""The options of the measuring commands, `memoryformer eval / buckets / kernels / flops / generate`: one settings
dataclass each, from whose fields the command line is made (`cli.arguments`), with the checks of their values.

A light module (standard library only), so that `--help` answers at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..training.settings import PRESETS, check_at_least, option, required
from .flops import BYTES_PER_VALUE  # a light module: no torch at import

# The paper's zero-shot tasks (Table 2), the default of `memoryformer eval --tasks`.
PAPER_TASKS = ("piqa", "winogrande", "wsc", "arc_easy", "arc_challenge", "logiqa")
# kernel_report.DTYPES (its keys), repeated because that module imports torch; tests/tools/test_cli_help.py checks it.
KERNEL_DTYPES = ("fp32", "bf16", "fp16", "fp64")
TABLE_DTYPES = tuple(BYTES_PER_VALUE)  # table value types of the memory figures


STORAGE_DTYPES = ("int8", "bf16")  # modeling_memoryformer.quantization's storages, by their command-line names


@dataclass
class StorageSettings:
    """How an inference command stores the model it runs (`memoryformer generate / eval / convert`): the tables and
    the LM head in int8 or bf16, summed in float32 (see the README's Quantized tables)."""

    table_dtype: str | None = option(
        None, "store the Memory Layer tables as int8 (a scale and offset per row) or bf16 for inference (default: as "
        "the model has them)", choices=STORAGE_DTYPES)
    lm_head_dtype: str | None = option(
        None, "store the LM head as int8 or bf16 for inference (default: as the model has it)", choices=STORAGE_DTYPES)

    @property
    def requested(self) -> bool:
        """Whether anything is to be stored narrower than the model has it."""
        return bool(self.table_dtype or self.lm_head_dtype)

    def apply(self, model):
        """`model` stored as asked, in place (`quantize_tables` / `quantize_lm_head`; they check what they are
        given); returns it."""
        if self.table_dtype:
            model.quantize_tables(self.table_dtype, lm_head=self.lm_head_dtype)
        elif self.lm_head_dtype:
            model.quantize_lm_head(self.lm_head_dtype)
        return model

    def describe(self) -> str:
        parts = [f"tables {self.table_dtype}" if self.table_dtype else "", f"LM head {self.lm_head_dtype}"
                 if self.lm_head_dtype else ""]
        return ", ".join(p for p in parts if p) or "as saved"


@dataclass
class EvalSettings:
    """`memoryformer eval`: lm-evaluation-harness tasks and sliding-window perplexity of one model."""

    model: str | None = option(None, "model folder or Hub id (AutoModelForCausalLM)")
    tokenizer: str | None = option(None, "tokenizer folder or Hub id (default: the model's)")
    tasks: list[str] | None = option(
        None, f"harness tasks (default: the paper's {' '.join(PAPER_TASKS)}; none when only --perplexity is given)")
    num_fewshot: int = option(0, "in-context examples (the paper: 0)")
    limit: float | None = option(
        None, "documents per task (N), or a fraction (0 < F < 1); for quick checks only (default: every document)")
    include_path: str | None = option(
        None, "folder of local task YAMLs (offline data, see --export-tasks); overrides same names (default: none)")
    batch_size: int = option(8, "sequences per forward")
    device: str = option("cpu", "torch device")
    perplexity: str | None = option(None, "text file for sliding-window perplexity (default: none)", metavar="FILE")
    context_length: int | None = option(
        None, "perplexity window (default: the model's max_position_embeddings)")
    stride: int | None = option(None, "perplexity stride (default: context length // 2)")
    out: str | None = option(None, "write the results to this file (default: print only)", metavar="JSON")
    export_tasks: str | None = option(
        None, "instead of evaluating: save --tasks' data as jsonl + task YAMLs in DIR (needs the Hub once), for "
        "--include-path DIR offline (default: evaluate)", metavar="DIR")
    # checked where they are used: the harness (tasks, limit, batch_size), perplexity (context_length, stride)


@dataclass
class BucketSettings:
    """`memoryformer buckets`: bucket-hit histograms of a trained model's hash tables (paper Fig. 4)."""

    model: str = required("trained MemoryFormer: a local folder or a Hub id")
    data: str | None = option(None, "text file, folder or Hub dataset (default: the embedded text)")
    tokenizer: str | None = option(None, "tokenizer path or Hub id (default: the model's own)")
    layers: list[str] | None = option(None, "Memory Layer names to count (default: all)")
    block_size: int = option(128, "tokens per block")
    batch_size: int = option(8, "blocks per forward")
    max_tokens: int | None = option(
        None, "stop after at least this many tokens, whole blocks (default: all of --split)")
    split: str = option("validation", "count the validation blocks or every block", choices=("validation", "all"))
    out: str | None = option(
        None, "folder for bucket_stats.json and buckets.png (default: MODEL/buckets when --model is a local folder; "
        "required for a Hub id)")
    progress: bool = option(True, "no progress bar", flag="--no-progress")

    def __post_init__(self):
        check_at_least(self, ("batch_size",))
        check_at_least(self, ("max_tokens",), optional=True)
        # block_size: build_lm_data


@dataclass
class KernelsSettings:
    """`memoryformer kernels`: the CPU, its caches and the fused kernel's strategy for every Memory Layer."""

    preset: str = option("tiny", "model whose Memory Layers are planned", choices=PRESETS)
    tokens: list[int] | None = option(
        None, "token counts per call to plan for (default: 1 = decode, 2048 = prefill 1 x 2048, 4096 = training "
        "8 x 512)")
    dtype: str = option("fp32", "table value type (default fp32)", choices=KERNEL_DTYPES)
    cache_sizes: list[str] | None = option(
        None, "plan as if the caches had these sizes (e.g. 48K 1M 32M) instead of the detected ones", nargs=3,
        metavar=("L1D", "L2", "L3"))
    json: bool = option(False, "print the report as JSON")
    # tokens and cache_sizes: kernel_report.collect and parse_size


@dataclass
class FlopsSettings:
    """`memoryformer flops`: FLOPs per block and table memory against the Pythia twin (paper Table 1)."""

    presets: tuple[str, ...] = option(PRESETS, "presets to compare", flag="--preset", choices=PRESETS)
    seq_len: int = option(2048, "sequence length s of the FLOPs counts")
    dtype: str = option("fp16", "table value type for memory", choices=TABLE_DTYPES)

    def __post_init__(self):
        check_at_least(self, ("seq_len",))


@dataclass
class GenerateSettings:
    """`memoryformer generate`: build a preset, run a forward and a generation, print FLOPs and memory."""

    preset: str = option("tiny", "model shape (random weights)", choices=PRESETS)
    layers: int | None = option(None, "number of blocks (default: the preset's)")
    tokenizer: str | None = option(None, "tokenizer path or Hub id (default: random token ids)")
    prompt: str = option("The meaning of life is", "prompt text (with --tokenizer)")
    new_tokens: int = option(16, "tokens to generate")
    seq_len: int = option(2048, "sequence length for the FLOPs table")
    seed: int = option(0, "random seed of the weights and prompt")

    def __post_init__(self):
        check_at_least(self, ("seq_len", "new_tokens"))
        # layers: MemoryFormerConfig (num_hidden_layers)
