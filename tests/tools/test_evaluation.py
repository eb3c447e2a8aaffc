"""Evaluation: sliding-window perplexity against token-by-token oracles, and lm-evaluation-harness on local tasks
whose right answers the test knows.

Everything runs offline: the tokenizer is a word-level one built here, the tasks are YAML + jsonl files written to a
temporary folder, and the Hub is switched off for huggingface_hub and datasets.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import tiny_model

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval (lm-evaluation-harness) is not installed")

from modeling_memoryformer.cli import parse_settings
from modeling_memoryformer.evaluation.harness import (
    PAPER_TASKS,
    evaluate_tasks,
    export_offline_tasks,
    perplexity,
    run_eval,
)


PROMPT_WORDS = ["Question", ":", "Answer", "."]
CONTENT_WORDS = ["a", "ox", "cat", "door", "apple", "banana", "cabinet", "elephant", "xylophone", "sun", "tree",
                 "river", "mountain", "by", "window", "glass", "paper", "kite", "lamp", "ocean"]
CERTAIN_WORD = "sure"  # the constant model gives it almost all the probability
VOCAB = ["<unk>", "<eos>", *PROMPT_WORDS, *CONTENT_WORDS, CERTAIN_WORD]
HARNESS_PIQA = Path(lm_eval.__file__).parent / "tasks" / "piqa" / "piqa.yaml"


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path_factory):
    """No Hub access for huggingface_hub or datasets, and the datasets cache in a temporary folder."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("datasets_cache"))


@pytest.fixture(scope="module")
def tokenizer():
    """A word-level tokenizer: one token per word or punctuation mark, so the test can count tokens itself."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(VOCAB)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")


def token_logits() -> torch.Tensor:
    """Fixed next-token logits over the tiny vocabulary (128): distinct values for the content words, the certain
    word far above everything, ids the tokenizer never produces far below."""
    logits = torch.full((128,), -20.0)
    generator = torch.Generator().manual_seed(7)
    for word in CONTENT_WORDS + PROMPT_WORDS:
        logits[VOCAB.index(word)] = 3 * torch.randn((), generator=generator)
    logits[VOCAB.index(CERTAIN_WORD)] = 40.0
    return logits


def constant_model() -> torch.nn.Module:
    """A tiny MemoryFormer whose next-token distribution is softmax(token_logits()) after ANY context: the final
    LayerNorm outputs its bias e_0 whatever its input (weight 0), and column 0 of the LM head holds the logits."""
    model = tiny_model()
    with torch.no_grad():
        model.model.norm.weight.zero_()
        model.model.norm.bias.zero_()
        model.model.norm.bias[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[:, 0] = token_logits()
    return model


def word_logprob(word: str) -> float:
    return torch.log_softmax(token_logits().double(), dim=0)[VOCAB.index(word)].item()


def write_task(folder: Path, name: str, rows: list[dict]) -> None:
    """A local multiple-choice task: 'Question: <q>\\nAnswer:' followed by each choice; jsonl data, no Hub."""
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "output_type: multiple_choice\n"
        "test_split: test\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        "doc_to_target: label\n"
        'doc_to_choice: "{{choices}}"\n'
        "metric_list:\n"
        "  - {metric: acc, aggregation: mean, higher_is_better: true}\n"
        "  - {metric: acc_norm, aggregation: mean, higher_is_better: true}\n"
    )


def certain_rows(gold_is_certain: bool, count: int = 6) -> list[dict]:
    """Two choices, one of them the certain word; the label points at it or at the other choice."""
    rows = []
    for i in range(count):
        choices = [CERTAIN_WORD, CONTENT_WORDS[i]] if i % 2 == 0 else [CONTENT_WORDS[i], CERTAIN_WORD]
        certain = choices.index(CERTAIN_WORD)
        rows.append({"question": f"{CONTENT_WORDS[i]} ?", "choices": choices,
                     "label": certain if gold_is_certain else 1 - certain})
    return rows


def mixed_rows(seed: int, count: int = 12) -> list[dict]:
    """2-4 choices of 1-3 content words each, random labels."""
    generator = torch.Generator().manual_seed(seed)

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high, (), generator=generator))

    rows = []
    for _ in range(count):
        question = " ".join(CONTENT_WORDS[randint(0, len(CONTENT_WORDS))] for _ in range(randint(1, 5)))
        choices = [" ".join(CONTENT_WORDS[randint(0, len(CONTENT_WORDS))] for _ in range(randint(1, 4)))
                   for _ in range(randint(2, 5))]
        rows.append({"question": question, "choices": choices, "label": randint(0, len(choices))})
    return rows


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


# ----------------------------------------------------------------------------------------------------------------------
# Perplexity
def naive_token_nlls(model, ids: list[int], context_start) -> list[float]:
    """-log p(ids[j] | ids[context_start(j):j]) for j = 1..n-1, one full forward per token."""
    nlls = []
    with torch.no_grad():
        for j in range(1, len(ids)):
            context = torch.tensor([ids[context_start(j):j]])
            logprobs = torch.log_softmax(model(context).logits[0, -1].double(), dim=-1)
            nlls.append(-logprobs[ids[j]].item())
    return nlls


def random_text(words: int, seed: int = 0) -> str:
    generator = torch.Generator().manual_seed(seed)
    return " ".join(CONTENT_WORDS[i] for i in torch.randint(0, len(CONTENT_WORDS), (words,), generator=generator))


@pytest.mark.slow
def test_perplexity_of_a_text_within_one_window_is_the_full_context_token_by_token_nll(tokenizer, tmp_path):
    model = tiny_model(dtype=torch.float64)
    text = random_text(40)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    expected = sum(naive_token_nlls(model, ids, context_start=lambda j: 0))

    result = perplexity(model, tokenizer, text, context_length=64)
    assert result["tokens"] == 39  # every word is one token; all but the first are scored
    assert result["windows"] == 1
    assert result["nll_sum"] == pytest.approx(expected, rel=1e-10)
    assert result["ppl"] == pytest.approx(math.exp(expected / 39), rel=1e-10)

    path = tmp_path / "text.txt"
    path.write_text(text)
    assert perplexity(model, tokenizer, path, context_length=64)["nll_sum"] == pytest.approx(expected, rel=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [1, 3])
def test_perplexity_windows_score_every_token_once_with_its_window_context(tokenizer, batch_size):
    """Windows of L tokens start every S tokens; token j is scored by the first window reaching past it, whose
    start is S * max(0, ceil((j + 1 - L) / S)), with the tokens from that start as its only context."""
    model = tiny_model(dtype=torch.float64)
    length, stride = 16, 5
    text = random_text(50, seed=1)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    first_window = lambda j: max(0, math.ceil((j + 1 - length) / stride))  # noqa: E731
    expected = naive_token_nlls(model, ids, context_start=lambda j: stride * first_window(j))

    result = perplexity(model, tokenizer, text, context_length=length, stride=stride, batch_size=batch_size)
    assert (result["context_length"], result["stride"]) == (length, stride)
    assert result["tokens"] == len(expected) == 49
    assert result["windows"] == 8  # starts 0, 5, ..., 35; the last window (35..50) is one token short
    assert result["nll_sum"] == pytest.approx(sum(expected), rel=1e-10)


def test_perplexity_defaults_to_the_model_maximum_and_half_of_it_as_stride(tokenizer):
    model = tiny_model()
    result = perplexity(model, tokenizer, random_text(10))
    assert (result["context_length"], result["stride"]) == (model.config.max_position_embeddings,
                                                            model.config.max_position_embeddings // 2)


@pytest.mark.parametrize(
    "text, settings, error, message",
    [
        ("cat door", dict(context_length=16, stride=16), ValueError, "stride"),
        ("cat door", dict(context_length=16, stride=0), ValueError, "stride"),
        ("cat door", dict(context_length=1), ValueError, "context_length"),
        ("cat door", dict(context_length=129), ValueError, "max_position_embeddings"),
        ("cat door", dict(batch_size=0), ValueError, "batch_size"),
        ("cat", {}, ValueError, "at least 2"),
        (Path("/nonexistent/valid.txt"), {}, FileNotFoundError, "valid.txt"),
        (b"cat door", {}, TypeError, "text_or_path"),
    ],
)
def test_perplexity_rejects_bad_input_with_a_clear_error(tokenizer, text, settings, error, message):
    with pytest.raises(error, match=message):
        perplexity(tiny_model(), tokenizer, text, **settings)


# ----------------------------------------------------------------------------------------------------------------------
# lm-evaluation-harness
@pytest.mark.slow
def test_paper_tasks_are_the_harness_multiple_choice_tasks_of_the_paper():
    """WSC is SuperGLUE's (104 validation questions, the denominator of every WSC score in the paper)."""
    from lm_eval.tasks import TaskManager

    index = TaskManager().task_index
    data = {name: (index[name].cfg["dataset_path"], index[name].cfg.get("dataset_name")) for name in PAPER_TASKS}
    assert data == {
        "piqa": ("baber/piqa", None),
        "winogrande": ("allenai/winogrande", "winogrande_xl"),
        "wsc": ("aps/super_glue", "wsc.fixed"),
        "arc_easy": ("allenai/ai2_arc", "ARC-Easy"),
        "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge"),
        "logiqa": ("EleutherAI/logiqa", "logiqa"),
    }
    assert all(index[name].cfg["output_type"] == "multiple_choice" for name in PAPER_TASKS)


def test_harness_accuracy_is_one_zero_and_the_oracle_fraction_for_a_constant_model(tokenizer, tmp_path):
    """The constant model's log-likelihood of a choice is the sum of its words' fixed log-probs: the test knows
    which choice the harness must pick by raw (acc) and per-character (acc_norm) log-likelihood."""
    mixed = mixed_rows(seed=3)
    write_task(tmp_path, "certain_right", certain_rows(gold_is_certain=True))
    write_task(tmp_path, "certain_wrong", certain_rows(gold_is_certain=False))
    write_task(tmp_path, "mixed", mixed)

    loglikelihoods = [[sum(word_logprob(word) for word in choice.split()) for choice in row["choices"]]
                      for row in mixed]
    acc = [float(argmax(lls) == row["label"]) for lls, row in zip(loglikelihoods, mixed)]
    acc_norm = [float(argmax([ll / len(choice) for ll, choice in zip(lls, row["choices"])]) == row["label"])
                for lls, row in zip(loglikelihoods, mixed)]
    assert 0 < sum(acc) < len(mixed) and acc != acc_norm  # the mixed set tells the two metrics and all answers apart

    summary = evaluate_tasks(constant_model(), tokenizer, ["certain_right", "certain_wrong", "mixed"],
                             batch_size=4, include_path=tmp_path, log_samples=True)
    results = summary["tasks"]
    assert (results["certain_right"]["acc"], results["certain_right"]["acc_norm"]) == (1.0, 1.0)
    assert (results["certain_wrong"]["acc"], results["certain_wrong"]["acc_norm"]) == (0.0, 0.0)
    assert results["mixed"]["acc"] == pytest.approx(sum(acc) / len(mixed), abs=1e-12)
    assert results["mixed"]["acc_norm"] == pytest.approx(sum(acc_norm) / len(mixed), abs=1e-12)
    p = sum(acc) / len(mixed)  # the harness's stderr of a mean: the sample standard deviation / sqrt(n)
    assert results["mixed"]["acc_stderr"] == pytest.approx(math.sqrt(p * (1 - p) / (len(mixed) - 1)), rel=1e-9)
    assert [results[name]["documents"] for name in ("certain_right", "certain_wrong", "mixed")] == [6, 6, len(mixed)]

    logged = sorted(summary["samples"]["mixed"], key=lambda sample: sample["doc_id"])
    assert [sample["target"] for sample in logged] == [row["label"] for row in mixed]
    for sample, expected in zip(logged, loglikelihoods):
        assert sample["loglikelihoods"] == pytest.approx(expected, abs=1e-4)
    assert summary["num_fewshot"] == 0 and summary["lm_eval_version"] == lm_eval.__version__


@pytest.mark.slow
def test_harness_scores_choices_by_the_models_own_context_dependent_loglikelihoods(tokenizer, tmp_path):
    """A random tiny model (float64): each choice's log-likelihood equals one direct forward of prompt + choice,
    through the harness's batching and padding; `limit` keeps the first documents only."""
    model = tiny_model(dtype=torch.float64)
    rows = mixed_rows(seed=5, count=8)
    write_task(tmp_path, "mixed", rows)

    def choice_loglikelihood(row: dict, choice: str) -> float:
        context = tokenizer(f"Question: {row['question']}\nAnswer:")["input_ids"]
        continuation = tokenizer(choice)["input_ids"]
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([context + continuation])).logits[0], dim=-1)
        return sum(logprobs[len(context) - 1 + i, token].item() for i, token in enumerate(continuation))

    expected = [[choice_loglikelihood(row, choice) for choice in row["choices"]] for row in rows[:6]]
    summary = evaluate_tasks(model, tokenizer, ["mixed"], batch_size=3, limit=6, include_path=tmp_path,
                             log_samples=True)
    logged = sorted(summary["samples"]["mixed"], key=lambda sample: sample["doc_id"])
    assert [sample["doc_id"] for sample in logged] == list(range(6))
    for sample, lls in zip(logged, expected):
        assert sample["loglikelihoods"] == pytest.approx(lls, rel=1e-9)
    accuracy = sum(argmax(lls) == row["label"] for lls, row in zip(expected, rows)) / 6
    assert summary["tasks"]["mixed"]["acc"] == pytest.approx(accuracy, abs=1e-12)
    assert summary["tasks"]["mixed"]["documents"] == 6 and summary["limit"] == 6


def write_local_piqa(local: Path) -> None:
    """The harness's `piqa` re-pointed at four local questions (piqa's schema); the certain word is gold in 3."""
    local.mkdir()
    rows = [{"goal": f"{CONTENT_WORDS[i]} {CONTENT_WORDS[i + 1]}", "sol1": sol1, "sol2": sol2, "label": label}
            for i, (sol1, sol2, label) in enumerate([(CERTAIN_WORD, "cat", 0), ("door", CERTAIN_WORD, 1),
                                                      (CERTAIN_WORD, "banana apple", 0), ("ox", CERTAIN_WORD, 0)])]
    for split in ("train", "validation"):
        (local / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (local / "piqa.yaml").write_text(
        f"include: {HARNESS_PIQA}\ntask: piqa\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    train: {local / 'train.jsonl'}\n"
        f"    validation: {local / 'validation.jsonl'}\n"
    )


def test_a_paper_task_runs_offline_from_local_jsonl_and_exports_to_a_self_contained_folder(tokenizer, tmp_path):
    """`piqa` re-pointed at local data keeps the harness's own prompt and choices; exporting it writes data and
    a YAML that no longer need the original files."""
    local = tmp_path / "local"
    write_local_piqa(local)
    model = constant_model()
    summary = evaluate_tasks(model, tokenizer, ["piqa"], include_path=local, log_samples=True)
    assert summary["tasks"]["piqa"]["acc"] == 0.75  # the certain word is gold in 3 of 4
    assert summary["tasks"]["piqa"]["documents"] == 4
    first = min(summary["samples"]["piqa"], key=lambda sample: sample["doc_id"])  # sol1 is the certain word
    assert first["loglikelihoods"][0] == pytest.approx(word_logprob(CERTAIN_WORD), abs=1e-4)

    exported = export_offline_tasks(tmp_path / "exported", ["piqa"], include_path=local)
    assert sorted(path.relative_to(exported).as_posix() for path in exported.rglob("*.jsonl")) == [
        "piqa/train.jsonl", "piqa/validation.jsonl"]
    for split in ("train", "validation"):
        (local / f"{split}.jsonl").unlink()
    again = evaluate_tasks(model, tokenizer, ["piqa"], include_path=exported)
    assert again["tasks"] == summary["tasks"]


@pytest.mark.parametrize(
    "tasks, settings, error, message",
    [
        ("piqa", {}, TypeError, r"\['piqa'\]"),
        ([], {}, ValueError, "non-empty"),
        (["piqa"], dict(limit=0), ValueError, "limit"),
        (["piqa"], dict(limit=1.5), ValueError, "limit"),
        (["piqa"], dict(batch_size=0), ValueError, "batch_size"),
        (["piqa"], dict(num_fewshot=-1), ValueError, "num_fewshot"),
        (["piqa"], dict(include_path="/nonexistent/tasks"), FileNotFoundError, "include_path"),
    ],
)
def test_evaluate_tasks_rejects_bad_input_with_a_clear_error(tokenizer, tasks, settings, error, message):
    with pytest.raises(error, match=message):
        evaluate_tasks(tiny_model(), tokenizer, tasks, **settings)


@pytest.mark.slow
def test_an_unknown_task_name_is_reported_with_the_closest_names(tokenizer, tmp_path):
    write_task(tmp_path, "certain_right", certain_rows(gold_is_certain=True))
    with pytest.raises(ValueError, match=r"unknown task 'certain_rigth' \(did you mean certain_right"):
        evaluate_tasks(tiny_model(), tokenizer, ["certain_rigth"], include_path=tmp_path)


@pytest.mark.slow
def test_task_data_out_of_reach_says_how_to_evaluate_offline(tokenizer):
    with pytest.raises(ConnectionError, match=r"--export-tasks DIR --tasks piqa.*--include-path DIR"):
        evaluate_tasks(tiny_model(), tokenizer, ["piqa"], limit=2)


# ----------------------------------------------------------------------------------------------------------------------
# `memoryformer eval`
def parse(argv: list[str]):
    """The settings objects of `memoryformer eval ARGV` (EvalSettings, StorageSettings), for `run_eval(*...)`."""
    return parse_settings(["eval", *argv])


def test_eval_command_runs_tasks_and_perplexity_from_a_saved_model_and_writes_json(tokenizer, tmp_path, capsys):
    model = constant_model()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write_task(tasks, "certain_right", certain_rows(gold_is_certain=True))
    text = tmp_path / "text.txt"
    text.write_text(random_text(30))

    out = tmp_path / "results.json"
    code = run_eval(*parse(["--model", str(tmp_path / "model"), "--tasks", "certain_right", "--include-path",
                           str(tasks), "--perplexity", str(text), "--context-length", "16", "--stride", "8",
                           "--out", str(out)]))
    assert code == 0
    report = json.loads(out.read_text())
    assert report["harness"]["tasks"]["certain_right"]["acc"] == 1.0
    assert report["run"]["memory_layer_kernel"] in ("fused", "torch") and report["run"]["torch"] == torch.__version__
    expected = perplexity(model, tokenizer, text, context_length=16, stride=8)
    assert report["perplexity"]["nll_sum"] == pytest.approx(expected["nll_sum"], rel=1e-6)
    assert (report["perplexity"]["tokens"], report["perplexity"]["stride"]) == (29, 8)
    printed = capsys.readouterr().out
    assert "| certain_right | 1.0000" in printed and "perplexity of" in printed


def test_eval_command_exports_tasks_for_offline_use(tmp_path, capsys):
    write_local_piqa(tmp_path / "local")
    argv = ["--export-tasks", str(tmp_path / "out"), "--tasks", "piqa", "--include-path", str(tmp_path / "local")]
    assert run_eval(*parse(argv)) == 0
    assert sorted(path.name for path in (tmp_path / "out").rglob("*") if path.is_file()) == [
        "piqa.yaml", "train.jsonl", "validation.jsonl"]
    assert f"--include-path {tmp_path / 'out'}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tasks", "piqa"], "--model is required"),
        (["--model", "/nonexistent/model", "--perplexity", "/nonexistent/text.txt"], "no such text file"),
        (["--model", "/nonexistent/model"], "could not load a model"),
    ],
)
def test_eval_command_reports_bad_input_and_exits_2(argv, message, capsys):
    assert run_eval(*parse(argv)) == 2
    assert message in capsys.readouterr().err


def test_eval_command_stores_the_model_as_asked_before_measuring(tokenizer, tmp_path, capsys):
    """`eval --table-dtype int8 --lm-head-dtype int8`: the perplexity is that of the model quantised by its own
    method (the oracle, computed here), not of the float32 one, and the report says how it was stored."""
    model = tiny_model(seed=3)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    text = tmp_path / "text.txt"
    text.write_text(random_text(30))
    out = tmp_path / "results.json"
    argv = ["eval", "--model", str(tmp_path / "model"), "--perplexity", str(text), "--context-length", "16",
            "--stride", "8", "--out", str(out), "--table-dtype", "int8", "--lm-head-dtype", "int8"]
    assert run_eval(*parse_settings(argv)) == 0
    report = json.loads(out.read_text())
    assert report["storage"] == {"table_dtype": "int8", "lm_head_dtype": "int8"}
    stored = tiny_model(seed=3).quantize_tables("int8", lm_head="int8")
    # batch 8 as the command's default: the int8 head quantises its input per call, over the whole batch
    expected = perplexity(stored, tokenizer, text, context_length=16, stride=8, batch_size=8)
    float_ppl = perplexity(model, tokenizer, text, context_length=16, stride=8, batch_size=8)
    assert report["perplexity"]["nll_sum"] == pytest.approx(expected["nll_sum"], rel=1e-6)
    assert report["perplexity"]["nll_sum"] != pytest.approx(float_ppl["nll_sum"], rel=1e-9)
    assert "stored for inference: tables int8, LM head int8" in capsys.readouterr().out
