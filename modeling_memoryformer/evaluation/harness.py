"""Evaluate a MemoryFormer: the paper's zero-shot tasks through lm-evaluation-harness, and sliding-window perplexity.

`evaluate_tasks` runs `lm_eval.simple_evaluate` on the model instance wrapped in the harness's `HFLM`, so scores come
from the community's own prompts, choice scoring and metrics. The paper (Table 2) reports six zero-shot tasks; their
lm-evaluation-harness names, as in `PAPER_TASKS`:

| paper | harness task | data (Hub) | split scored |
|---|---|---|---|
| PIQA | `piqa` | baber/piqa | validation |
| WinoGrande | `winogrande` | allenai/winogrande, winogrande_xl | validation |
| WSC | `wsc` | aps/super_glue, wsc.fixed (SuperGLUE WSC, 104 questions) | validation |
| ARC-E | `arc_easy` | allenai/ai2_arc, ARC-Easy | test |
| ARC-C | `arc_challenge` | allenai/ai2_arc, ARC-Challenge | test |
| LogiQA | `logiqa` | EleutherAI/logiqa | test |

WSC is the harness's `wsc` (SuperGLUE), not `wsc273`: the paper's WSC scores (0.365, 0.375, 0.394, 0.471, 0.385,
0.433, 0.635) are all k/104 rounded, the size of SuperGLUE WSC's validation split, and none is k/273. Pythia, the
paper's baseline, was evaluated on the same task.

Task data comes from the Hub. For offline use, `export_offline_tasks` (run once where the Hub is reachable) saves the
data of each task as jsonl and writes a task YAML next to it that includes the harness's own definition and only
swaps the data source (`dataset_path: json`, `dataset_kwargs: {data_files: ...}`); `include_path=` then points the
harness at that folder and the same task names run without network. Any folder of task YAMLs works the same way.

`perplexity` (from `perplexity.py`) is the sliding-window perplexity of a text.

`run_eval` is the `memoryformer eval` command (its options: `cli.add_eval_arguments`).
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import pickle
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .perplexity import perplexity
from .settings import PAPER_TASKS, EvalSettings, StorageSettings


# ----------------------------------------------------------------------------------------------------------------------
# Zero-shot tasks (lm-evaluation-harness)
def evaluate_tasks(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | str,
    tasks: Sequence[str] = PAPER_TASKS,
    *,
    num_fewshot: int = 0,
    batch_size: int = 8,
    limit: int | float | None = None,
    include_path: str | os.PathLike | None = None,
    device: str = "cpu",
    log_samples: bool = False,
) -> dict[str, Any]:
    """Score `model` on lm-evaluation-harness tasks and return the accuracies compactly.

    Args:
        model: a causal LM instance (moved to `device` and put in eval mode, in place).
        tokenizer: a tokenizer instance, or a path / Hub id to load one from (the harness gives it a pad token if it
            has none).
        tasks: harness task names (default: the paper's six, see the module docstring for the mapping).
        num_fewshot: examples in the prompt (the paper is zero-shot). Tasks whose definition fixes 0 keep 0.
        batch_size: sequences per forward.
        limit: score only the first `limit` documents of each task (an int), or that fraction of them (a float in
            (0, 1)); None scores all. For quick checks only: the numbers are not comparable to full runs.
        include_path: a folder of task YAMLs (e.g. written by `export_offline_tasks`); its tasks take precedence
            over the harness's built-in tasks of the same name. When every requested task is defined there, the
            harness's ~14k built-in definitions are not even indexed.
        device: where the model runs.
        log_samples: also return, per task, every document's target and per-choice log-likelihoods.

    Returns:
        {"tasks": {task: {"acc": float, "acc_stderr": float, "acc_norm": float, "acc_norm_stderr": float,
        "documents": int}}, "num_fewshot", "limit", "lm_eval_version"} (the metrics present are those each task
        defines; a stderr the harness could not compute is None), plus "samples": {task: [{"doc_id", "target",
        "loglikelihoods", "acc", ...}]} with `log_samples`.
    """
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    tasks = _check_task_names(tasks)
    if not isinstance(num_fewshot, int) or num_fewshot < 0:
        raise ValueError(f"num_fewshot must be an integer >= 0, got {num_fewshot!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    limit = _check_limit(limit)
    task_manager = _task_manager(tasks, include_path)
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = _load_tokenizer(str(tokenizer))

    model = model.to(device).eval()
    # The harness cannot tell a third-party model type is causal and would warn: say it.
    lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size)
    with _explain_missing_data(tasks):
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=list(tasks),
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=task_manager,
            log_samples=log_samples,
        )
    summary: dict[str, Any] = {
        "tasks": {name: _compact_metrics(metrics, results.get("n-samples", {}).get(name))
                  for name, metrics in results["results"].items()},
        "num_fewshot": num_fewshot,
        "limit": limit,
        "lm_eval_version": lm_eval.__version__,
    }
    if log_samples:
        summary["samples"] = {name: [_compact_sample(sample) for sample in samples]
                              for name, samples in results["samples"].items()}
    return summary


def export_offline_tasks(
    out_dir: str | os.PathLike,
    tasks: Sequence[str] = PAPER_TASKS,
    *,
    include_path: str | os.PathLike | None = None,
) -> Path:
    """Save the data of harness tasks as jsonl with task YAMLs that read it, for `include_path=` without network.

    Loads each task through the harness (which downloads its data from the Hub, or reads it from `include_path`),
    writes every split the task uses to `out_dir/<task>/<split>.jsonl` and `out_dir/<task>.yaml`:

        include: <the task's own YAML>       # prompts, choices, metrics, !function helpers: unchanged
        task: <task>
        dataset_path: json
        dataset_name: null
        dataset_kwargs: {data_files: {<split>: <absolute path of the jsonl>}}

    The paths are absolute: after moving the folder, export again (or edit `data_files`). Returns `out_dir`.
    """
    import yaml
    from lm_eval.tasks._index import Kind

    tasks = _check_task_names(tasks)
    manager = _task_manager(tasks, include_path)
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in tqdm(tasks, desc="export tasks", unit="task"):
        entry = manager.task_index[name]
        if entry.kind is not Kind.TASK:
            raise ValueError(f"{name!r} is a {entry.kind.name.lower()}, not a task defined by a YAML of its own, so "
                             "it cannot be re-pointed at local data; export the tasks it consists of by name")
        with _explain_missing_data((name,)):
            task = manager.load([name])["tasks"][name]
        config = task.config
        splits = dict.fromkeys(split for split in (config.training_split, config.validation_split,
                                                   config.test_split, config.fewshot_split) if split)
        data_files = {}
        for split in splits:
            path = out_dir / name / f"{split}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            task.dataset[split].to_json(str(path), lines=True, force_ascii=False)
            data_files[split] = str(path)
        definition = {
            "include": str(Path(entry.yaml_path).resolve()),
            "task": name,
            "dataset_path": "json",
            "dataset_name": None,
            "dataset_kwargs": {"data_files": data_files},
        }
        (out_dir / f"{name}.yaml").write_text(yaml.safe_dump(definition, sort_keys=False))
    return out_dir


def _check_task_names(tasks: Sequence[str]) -> tuple[str, ...]:
    if isinstance(tasks, str):
        raise TypeError(f"tasks must be a list of task names, got the string {tasks!r}; pass [{tasks!r}]")
    tasks = tuple(tasks)
    if not tasks or not all(isinstance(name, str) and name for name in tasks):
        raise ValueError(f"tasks must be a non-empty list of task names, got {list(tasks)!r}")
    return tasks


def _check_limit(limit: int | float | None) -> int | float | None:
    """The harness reads an int as a document count and a float below 1 as a fraction."""
    if limit is None:
        return None
    if isinstance(limit, float) and limit.is_integer() and limit >= 1:
        limit = int(limit)
    count = isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1
    fraction = isinstance(limit, float) and 0 < limit < 1
    if not (count or fraction):
        raise ValueError(f"limit must be a document count >= 1 or a fraction in (0, 1), got {limit!r}")
    return limit


def _task_manager(tasks: tuple[str, ...], include_path: str | os.PathLike | None):
    """A TaskManager that knows every name in `tasks`; the local folder alone when it defines them all."""
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._index import Kind

    if include_path is not None:
        include_path = Path(include_path)
        if not include_path.is_dir():
            raise FileNotFoundError(f"include_path {str(include_path)!r} is not a folder of task YAML files")
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if all(name in local.task_index and local.task_index[name].kind in (Kind.TASK, Kind.PY_TASK)
               for name in tasks):
            return local
    manager = TaskManager(include_path=None if include_path is None else str(include_path))
    missing = [name for name in tasks if name not in manager.task_index]
    if missing:
        hints = []
        for name in missing:
            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            hints.append(f"{name!r}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
        where = "the harness's tasks" + ("" if include_path is None else f" or the YAMLs under {str(include_path)!r}")
        raise ValueError(f"unknown task {', '.join(hints)}: not among {where}. `lm-eval ls tasks` lists the "
                         "harness's tasks; a YAML the harness cannot parse is skipped silently, so check local ones")
    return manager


@contextlib.contextmanager
def _explain_missing_data(tasks: tuple[str, ...]):
    """Turn datasets' "Couldn't reach ... on the Hub" into what to do about it."""
    try:
        yield
    except ConnectionError as error:
        raise ConnectionError(
            f"{error}. The data of {', '.join(tasks)} comes from the Hub: where it is reachable, run `memoryformer "
            f"eval --export-tasks DIR --tasks {' '.join(tasks)}` (export_offline_tasks), then evaluate offline with "
            "--include-path DIR (include_path=DIR)"
        ) from error


EVAL_TOKENIZER_HINT = (
    "Pass the folder or Hub id of the tokenizer the model was trained with (e.g. --tokenizer EleutherAI/pythia-70m)."
)


def _load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    from ..training.data import load_tokenizer

    return load_tokenizer(name_or_path, hint=EVAL_TOKENIZER_HINT, pad_with_eos=False)


def _compact_metrics(metrics: dict[str, Any], counts: dict[str, int] | None) -> dict[str, Any]:
    """{"acc,none": x, "acc_stderr,none": "N/A", "alias": ...} -> {"acc": x, "acc_stderr": None, "documents": n}."""
    compact: dict[str, Any] = {}
    for key, value in metrics.items():
        if "," not in key:  # "alias", "name", ...: labels, not metrics
            continue
        metric, filter_name = key.split(",", 1)
        name = metric if filter_name == "none" else key
        compact[name] = float(value) if isinstance(value, (int, float)) else None
    if counts is not None:
        compact["documents"] = int(counts["effective"])
    return compact


def _compact_sample(sample: dict[str, Any]) -> dict[str, Any]:
    """One logged document: its target, the log-likelihood of each choice (or request) and its per-document metrics."""
    metrics = {name: sample[name] for name in sample["metrics"]}
    responses = [response[0] if isinstance(response, (tuple, list)) else response
                 for response in sample["filtered_resps"]]
    return {"doc_id": sample["doc_id"], "target": sample["target"], "loglikelihoods": responses, **metrics}


# ----------------------------------------------------------------------------------------------------------------------
# `memoryformer eval`
def run_eval(settings: EvalSettings, storage: StorageSettings | None = None) -> int:
    """`memoryformer eval`: harness tasks and/or perplexity of one model, printed and optionally saved as JSON."""
    tasks = settings.tasks if settings.tasks is not None else (None if settings.perplexity else list(PAPER_TASKS))
    try:
        if settings.export_tasks:
            exported = settings.tasks or PAPER_TASKS
            out_dir = export_offline_tasks(settings.export_tasks, exported, include_path=settings.include_path)
            print(f"wrote {len(exported)} task(s) to {out_dir}; evaluate offline with --include-path {out_dir}")
            return 0
        if not settings.model:
            raise ValueError("--model is required: the folder or Hub id of the model to evaluate")
        if settings.perplexity and not Path(settings.perplexity).is_file():
            raise FileNotFoundError(f"--perplexity {settings.perplexity!r}: no such text file")
        from .kernel_report import run_facts, run_facts_line

        facts = run_facts()  # loads (builds) the Memory Layer kernel before any evaluation
        print(run_facts_line(facts))
        model, tokenizer = _load_model_and_tokenizer(settings.model, settings.tokenizer, settings.device)
        if storage is not None and storage.requested:
            storage.apply(model)
            print(f"stored for inference: {storage.describe()}")
        report: dict[str, Any] = {"model": settings.model, "run": facts,
                                  "storage": {"table_dtype": getattr(model.config, "table_dtype", None),
                                              "lm_head_dtype": getattr(model.config, "lm_head_dtype", None)}}
        if tasks:
            report["harness"] = evaluate_tasks(model, tokenizer, tasks, num_fewshot=settings.num_fewshot,
                                               batch_size=settings.batch_size, limit=settings.limit,
                                               include_path=settings.include_path, device=settings.device)
            print(_task_table(report["harness"]))
        if settings.perplexity:
            result = perplexity(model, tokenizer, Path(settings.perplexity), context_length=settings.context_length,
                                stride=settings.stride, batch_size=settings.batch_size)
            report["perplexity"] = {"file": settings.perplexity, **result}
            print(f"\nperplexity of {settings.perplexity}: {result['ppl']:.3f} over {result['tokens']} tokens "
                  f"(context {result['context_length']}, stride {result['stride']}, {result['windows']} windows)")
    except (ValueError, TypeError, FileNotFoundError, ConnectionError) as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)  # one line, whatever the cause printed
        return 2
    if settings.out:
        Path(settings.out).parent.mkdir(parents=True, exist_ok=True)
        Path(settings.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {settings.out}")
    return 0


def _load_model_and_tokenizer(model_name: str, tokenizer_name: str | None, device: str):
    from transformers import AutoModelForCausalLM

    try:  # MemoryFormer is registered with the Auto classes: importing this module imported the package
        from ..training.checkpoints import load_pretrained_strict

        model = load_pretrained_strict(AutoModelForCausalLM, model_name, "--model")
    except (OSError, ValueError) as error:
        raise ValueError(f"could not load a model from {model_name!r} ({error}); pass a folder written by "
                         "save_pretrained or a Hub id") from error
    except pickle.UnpicklingError as error:
        from ..training.data import refused_checkpoint_message

        raise ValueError(refused_checkpoint_message(model_name, "--model", error)) from error
    tokenizer = _load_tokenizer(tokenizer_name or model_name)
    return model.to(device).eval(), tokenizer


def _task_table(summary: dict[str, Any]) -> str:
    """A markdown table of acc / acc_norm per task, stderr in brackets."""
    def cell(metrics: dict[str, Any], name: str) -> str:
        if metrics.get(name) is None:
            return "-"
        stderr = metrics.get(f"{name}_stderr")
        return f"{metrics[name]:.4f}" + (f" (+- {stderr:.4f})" if stderr is not None else "")

    lines = [f"lm-evaluation-harness {summary['lm_eval_version']}, {summary['num_fewshot']}-shot"
             + ("" if summary["limit"] is None else f", limit {summary['limit']}"), "",
             "| task | acc | acc_norm | documents |", "|---|---|---|---|"]
    for name, metrics in summary["tasks"].items():
        documents = metrics.get("documents", "-")
        lines.append(f"| {name} | {cell(metrics, 'acc')} | {cell(metrics, 'acc_norm')} | {documents} |")
    return "\n".join(lines)


__all__ = ["PAPER_TASKS", "evaluate_tasks", "export_offline_tasks", "perplexity", "run_eval"]
