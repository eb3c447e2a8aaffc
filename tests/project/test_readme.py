"""README.md and the guides in docs/ work as written: their shell and Python blocks run on a fresh checkout, offline.

Files: README.md first, then the guides of GUIDES in that order, as one document: a guide's block may use what the
README or an earlier guide wrote (docs/evaluation-and-sharing.md's bucket statistics read `runs/mf`, which the
README's Training command trains). Everything below says README for all of them.

Which blocks: fenced blocks tagged ```bash, ```sh or ```shell (run with `bash -eu -o pipefail -c`) and ```python.
Untagged fences (program output, the file layout) are not code and are not run.

Markers: an HTML comment on the line right before a block's opening fence,

    <!-- readme-test: skip (REASON) -->

keeps that block from running (it needs the network, or it is too slow for the suite); the test reports it as
skipped with REASON (`pytest -rs tests/project/test_readme.py` lists them). A block without a marker MUST run and
pass: a non-zero exit status, an exception or a timeout fails its test. Any other `readme-test` comment, or one that
is not directly above a block, fails `test_readme_markers_are_well_formed`.

Order and state: the blocks run in README order in ONE working directory, a fresh temporary folder outside the
clone (so `../shared` does not exist there), as a reader following the README from the top would: a block may use
files an earlier block wrote (the Bucket statistics command reads `runs/mf`, written by the Training command). The
Python blocks under one heading (`## ` or `### `) run in one interpreter, in order, like the cells of a notebook
(`_readme_python.py`), so a block may use names an earlier block under the same heading defined; each heading
gets a new interpreter (so the first `pipeline` block really loads the saved model through remote code: nothing has
imported this package in that interpreter). Each block's test first runs every earlier block that has not run yet,
so `-k` can select one.

Environment: HF_HUB_OFFLINE=1 (and the transformers / datasets offline switches), HF_HOME in the temporary folder
(an empty Hub cache), PATH starting with this interpreter's bin folder (`memoryformer`, `python`, `hf`).

Stand-ins: the files that the README's download block (Install, skipped: it needs the network) would fetch are
made small by `make_stand_ins`:
- `pythia-70m/`, what `hf download EleutherAI/pythia-70m --local-dir pythia-70m` writes: the Pythia tokenizer
  (from ../shared/data/pythia-tokenizer of this development setup when present, else a byte-level BPE trained on the
  embedded CPython docs, so nothing here needs ../shared) and a random GPT-NeoX of width 64 and 1 layer with
  Pythia-70M's vocabulary size and config format;
- `corpus.txt`, `tinyshakespeare.txt`, `wikitext-2/valid.txt`: slices of the embedded CPython docs.

Substitutions, the only edits made to README code before it runs (each must occur in the README, so none goes stale;
`test_readme_substitutions_match_the_readme` checks that):
- `EleutherAI/pythia-70m` -> `pythia-70m`, the offline form the README gives for every use of the Hub id;
- SHORTER: the same commands with fewer steps (and, for convert, fewer calibration tokens and sweeps).

Every `memoryformer ...` command of every shell block, skipped ones included, must also parse with the CLI's own
argument parser (`test_every_memoryformer_command_in_the_readme_parses`), and every `make` target must exist.
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# The guides whose blocks run after the README's, in this order (see the module docstring).
GUIDES = ("training.md", "conversion.md", "evaluation-and-sharing.md", "serving.md", "quantization.md", "performance.md",
          "paper.md", "limitations.md", "kernel.md")
DOCUMENTS = (README, *(ROOT / "docs" / name for name in GUIDES))
SHARED_TOKENIZER = ROOT.parent / "shared" / "data" / "pythia-tokenizer"
PYTHON_RUNNER = Path(__file__).resolve().parent / "_readme_python.py"
BLOCK_TIMEOUT = 600  # seconds, per block

SHELL_LANGUAGES = ("bash", "sh", "shell")
CODE_LANGUAGES = (*SHELL_LANGUAGES, "python")
MARKER = re.compile(r"<!--\s*readme-test:(.*?)-->", re.S)
SKIP = re.compile(r"^\s*skip\s*\((.+)\)\s*$", re.S)

# The offline form of every Hub id the README uses (the README says so in Install).
HUB_TO_LOCAL = {"EleutherAI/pythia-70m": "pythia-70m"}

# README text -> what the test runs instead: the same commands, shorter. Each key must occur in a block that runs.
SHORTER = {
    # Training: 1000 steps of the demo shape (d 256) with checkpoints -> 2 steps at d 64, one checkpoint (which
    # --resume finds)
    "memoryformer train --out runs/mf --save-steps 200":
        "memoryformer train --out runs/mf --save-steps 2 --max-steps 2 --hidden-size 64",
    "hidden_size=256, num_hidden_layers=4,": "hidden_size=64, num_hidden_layers=4,",
    "max_steps=1000, save_steps=500": "max_steps=2, save_steps=2",
    # Converting: 500 distillation steps and the default calibration (32768 tokens, up to 20 sweeps) -> a sketch
    "--distill-steps 500": "--distill-steps 2 --calib-tokens 2048 --sweeps 2",
}


# ---------------------------------------------------------------------------------------------------------------------
# Reading the README


@dataclass(frozen=True)
class Block:
    index: int
    line: int  # 1-based line of the opening fence
    document: str  # "README.md" or "docs/<guide>.md"
    language: str
    section: str  # the `## ` or `### ` heading above the block ("" before the first)
    code: str
    skip_reason: str | None

    @property
    def id(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.section.lower()).strip("-")[:40] or "top"
        where = "" if self.document == "README.md" else Path(self.document).stem + "-"
        return f"{where}L{self.line}-{self.language}-{slug}"


def read_blocks(text: str, document: str = "README.md", first_index: int = 0) -> tuple[list[Block], list[str]]:
    """(code blocks of `text` in order, numbered from `first_index`; problems with markers, prefixed with `document`).
    A marker belongs to the fenced block whose opening fence is the next line after it."""
    lines = text.splitlines()
    blocks, problems = [], []
    section = ""
    pending: tuple[int, str] | None = None  # (line, marker body) waiting for its block
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = MARKER.fullmatch(line.strip())
        if "readme-test" in line and not marker:
            problems.append(f"line {i + 1}: a readme-test comment must be alone on its line: {line!r}")
        if pending is not None and not line.startswith("```"):
            problems.append(f"line {pending[0]}: marker {pending[1]!r} is not directly above a fenced block")
            pending = None
        if marker:
            pending = (i + 1, marker.group(1).strip())
            i += 1
            continue
        if line.startswith(("## ", "### ")):
            section = line.lstrip("#").strip()
        if line.startswith("```"):
            language = line[3:].strip()
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            if end is None:
                problems.append(f"line {i + 1}: unclosed fence")
                break
            reason = None
            if pending is not None:
                skip = SKIP.match(pending[1])
                if skip is None:
                    problems.append(f"line {pending[0]}: unknown marker {pending[1]!r}; the only one is "
                                    "'skip (REASON)'")
                elif language not in CODE_LANGUAGES:
                    problems.append(f"line {pending[0]}: marker above a ```{language} block, which never runs")
                reason = skip.group(1).strip() if skip else None
                pending = None
            if language in CODE_LANGUAGES:
                code = "\n".join(lines[i + 1:end]) + "\n"
                blocks.append(Block(first_index + len(blocks), i + 1, document, language, section, code, reason))
            i = end + 1
            continue
        i += 1
    if pending is not None:
        problems.append(f"line {pending[0]}: marker {pending[1]!r} is not directly above a fenced block")
    return blocks, [f"{document} {problem}" for problem in problems]


def read_documents() -> tuple[dict[str, str], list[Block], list[str]]:
    """({document: text}, the blocks of every document in DOCUMENTS order, marker problems)."""
    texts, blocks, problems = {}, [], []
    for path in DOCUMENTS:
        name = path.relative_to(ROOT).as_posix()
        texts[name] = path.read_text(encoding="utf-8")
        found, bad = read_blocks(texts[name], name, len(blocks))
        blocks += found
        problems += bad
    return texts, blocks, problems


TEXTS, BLOCKS, MARKER_PROBLEMS = read_documents()
README_TEXT = TEXTS["README.md"]


def runnable_code(block: Block) -> str:
    """The block's code as the test runs it: Hub ids replaced by their offline folder, SHORTER applied."""
    code = block.code
    for hub_id, folder in HUB_TO_LOCAL.items():
        code = code.replace(hub_id, folder)
    for readme_text, shorter in SHORTER.items():
        code = code.replace(readme_text, shorter)
    return code


def shell_commands(code: str) -> list[list[str]]:
    """The simple commands of a shell block as argument lists: continuation lines joined, comments dropped,
    here-documents left out, split at ;, &&, || and |."""
    joined = re.sub(r"\\\n", " ", code)
    commands, heredoc_end = [], None
    for line in joined.splitlines():
        if heredoc_end is not None:
            heredoc_end = None if line.strip() == heredoc_end else heredoc_end
            continue
        heredoc = re.search(r"<<-?\s*'?\"?(\w+)'?\"?", line)
        if heredoc:
            heredoc_end = heredoc.group(1)
            line = line[:heredoc.start()]
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: list[str] = []
        for token in lexer:
            if token in (";", "&&", "||", "|", "&"):
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(token)
        if current:
            commands.append(current)
    return commands


# ---------------------------------------------------------------------------------------------------------------------
# Static checks: every block, skipped ones included


def test_readme_markers_are_well_formed():
    assert not MARKER_PROBLEMS, "\n".join(MARKER_PROBLEMS)
    for block in BLOCKS:
        assert block.skip_reason is None or block.skip_reason, f"{block.id}: a skip marker needs a reason"


def test_markers_are_read_as_the_docstring_says():
    text = "\n".join([
        "## A", "<!-- readme-test: skip (needs the network) -->", "```bash", "curl x", "```",
        "```bash", "echo runs", "```", "```", "output, not code", "```",
        "### B", "```python", "x = 1", "```",
        "<!-- readme-test: skip (a reason) -->", "", "```bash", "echo marker not directly above", "```",
        "<!-- readme-test: network -->", "```sh", "echo unknown marker", "```",
    ])
    blocks, problems = read_blocks(text)
    assert [(b.language, b.section, b.skip_reason) for b in blocks] == [
        ("bash", "A", "needs the network"), ("bash", "A", None), ("python", "B", None), ("bash", "B", None),
        ("sh", "B", None),
    ]
    assert blocks[1].code == "echo runs\n"
    assert len(problems) == 2 and "not directly above" in problems[0] and "unknown marker" in problems[1]


def test_readme_uses_no_development_paths():
    """`../shared/...` exists in the development setup only; a reader's clone has no such folder."""
    for name, text in TEXTS.items():
        assert "../shared" not in text, name
        assert "/work/" not in text, name


def test_every_guide_in_docs_is_run_and_linked_from_the_readme():
    guides = sorted(path.name for path in (ROOT / "docs").glob("*.md"))
    assert guides == sorted(GUIDES), "add a new guide to GUIDES (its blocks must run) or remove it"
    for name in GUIDES:
        assert f"(docs/{name})" in README_TEXT, f"the README does not link docs/{name}"


def test_readme_stays_short():
    assert README_TEXT.count("\n") <= 300, "README.md is a front page: move detail to a guide in docs/"


def test_relative_links_of_every_document_point_at_files_that_exist():
    for name, text in TEXTS.items():
        folder = (ROOT / name).parent
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            assert (folder / target).exists(), f"{name}: link to {target} which does not exist"


def test_readme_substitutions_match_the_readme():
    running = [block for block in BLOCKS if block.skip_reason is None]
    for readme_text in SHORTER:
        assert any(readme_text in block.code for block in running), f"SHORTER key {readme_text!r} not in a run block"
    for hub_id, folder in HUB_TO_LOCAL.items():
        assert hub_id in README_TEXT
        # the README itself gives the folder as the offline form of the Hub id
        assert re.search(rf"the folder `{folder}`\s+works in place of `{hub_id}`", README_TEXT)


def test_every_memoryformer_command_in_the_readme_parses():
    from modeling_memoryformer.cli import build_parser

    parser = build_parser()
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    checked = 0
    for block in BLOCKS:
        if block.language not in SHELL_LANGUAGES:
            continue
        for argv in shell_commands(block.code):
            words = [word for word in argv if not re.fullmatch(r"[A-Z_]+=.*", word)]  # leading VAR=value
            if "modeling_memoryformer.cli" in words:  # torchrun / accelerate launch ... -m modeling_memoryformer.cli
                words = ["memoryformer", *words[words.index("modeling_memoryformer.cli") + 1:]]
            if words[:1] == ["memoryformer"]:
                try:
                    parser.parse_args(words[1:])
                except SystemExit:
                    pytest.fail(f"{block.id}: `{shlex.join(words)}` is not a valid memoryformer command")
                checked += 1
            elif words[:1] == ["make"]:
                for target in words[1:]:
                    assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"{block.id}: no make target {target}"
    assert checked >= 10, f"only {checked} memoryformer commands found: is the parser of shell blocks broken?"


# ---------------------------------------------------------------------------------------------------------------------
# Running the blocks


def make_stand_ins(workspace: Path) -> None:
    """Small versions of what the README's download block fetches (see the module docstring)."""
    import torch
    from transformers import AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM

    from modeling_memoryformer.training.data import embedded_default_text, train_bpe_tokenizer

    text = embedded_default_text()
    (workspace / "corpus.txt").write_text(text[:60_000], encoding="utf-8")  # 10% of it: validation blocks to spare
    (workspace / "tinyshakespeare.txt").write_text(text[100_000:160_000], encoding="utf-8")
    (workspace / "wikitext-2").mkdir()
    (workspace / "wikitext-2" / "valid.txt").write_text(text[200_000:210_000], encoding="utf-8")  # a few windows

    folder = workspace / "pythia-70m"
    if SHARED_TOKENIZER.is_dir():
        tokenizer = AutoTokenizer.from_pretrained(SHARED_TOKENIZER)
    else:
        tokenizer = train_bpe_tokenizer(text, vocab_size=1024)
    tokenizer.save_pretrained(folder)
    vocab_size = 50304 if len(tokenizer) <= 50304 else len(tokenizer)  # Pythia pads its vocabulary to 50304
    config = GPTNeoXConfig(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=256,
        max_position_embeddings=2048, rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    GPTNeoXForCausalLM(config).save_pretrained(folder)


class ReadmeRun:
    """Runs README blocks in order in one workspace; Python blocks of one section share an interpreter."""

    def __init__(self, root: Path):
        self.workspace = root / "workspace"
        self.scratch = root / "blocks"  # the Python blocks as files (tracebacks show their lines), not in the workspace
        self.workspace.mkdir()
        self.scratch.mkdir()
        make_stand_ins(self.workspace)
        env = dict(os.environ)
        for name in ("PYTHONPATH", "HF_ENDPOINT", "MEMORYFORMER_KERNEL"):
            env.pop(name, None)
        env.update(
            HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
            HF_HOME=str(root / "hf-home"), TOKENIZERS_PARALLELISM="false",
            PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        )
        self.env = env
        self.done: dict[int, str | None] = {}  # block index -> None (passed) or why it failed
        self.workers: dict[str, subprocess.Popen] = {}
        self.worker_logs: dict[str, Path] = {}
        self.open_logs = []

    def run_through(self, index: int) -> None:
        """Run every block up to `index` that has not run; fail this test if an earlier one failed."""
        for block in BLOCKS[:index]:
            if block.skip_reason is None and block.index not in self.done:
                self.done[block.index] = self._run(block)
        failed = [i for i, error in sorted(self.done.items()) if error is not None and i < index]
        if failed:
            pytest.fail(f"earlier README blocks failed ({', '.join(BLOCKS[i].id for i in failed)}), so this one "
                        f"cannot run as written. The first:\n{self.done[failed[0]]}", pytrace=False)
        block = BLOCKS[index]
        if index not in self.done:
            self.done[index] = self._run(block)
        if self.done[index] is not None:
            pytest.fail(self.done[index], pytrace=False)

    def _run(self, block: Block) -> str | None:
        code = runnable_code(block)
        start = time.perf_counter()
        error = self._run_shell(code) if block.language in SHELL_LANGUAGES else self._run_python(block, code)
        seconds = time.perf_counter() - start
        if error is None:
            return None
        return f"{block.document} block {block.id} failed after {seconds:.0f} s:\n{code}\n{error}"

    def _run_shell(self, code: str) -> str | None:
        try:
            result = subprocess.run(["bash", "-eu", "-o", "pipefail", "-c", code], cwd=self.workspace, env=self.env,
                                    check=False, capture_output=True, text=True, timeout=BLOCK_TIMEOUT)
        except subprocess.TimeoutExpired as timeout:
            return f"timed out after {BLOCK_TIMEOUT} s; output:\n{_tail(timeout.stdout)}\n{_tail(timeout.stderr)}"
        if result.returncode == 0:
            return None
        return f"exit status {result.returncode}\n--- stdout ---\n{_tail(result.stdout)}\n--- stderr ---\n" \
               f"{_tail(result.stderr)}"

    def _worker(self, section: str) -> tuple[subprocess.Popen, Path]:
        if section not in self.workers:
            log = self.scratch / f"section-{len(self.workers)}.log"
            self.worker_logs[section] = log
            self.open_logs.append(log.open("w", encoding="utf-8"))
            self.workers[section] = subprocess.Popen(
                [sys.executable, str(PYTHON_RUNNER)], cwd=self.workspace, env=self.env, text=True,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.open_logs[-1],
            )
        return self.workers[section], self.worker_logs[section]

    def _run_python(self, block: Block, code: str) -> str | None:
        path = self.scratch / f"readme_{block.id.replace('-', '_')}.py"
        path.write_text(code, encoding="utf-8")
        worker, log = self._worker(f"{block.document}: {block.section}")
        offset = log.stat().st_size
        if worker.poll() is not None:
            return f"the interpreter of this section exited (status {worker.returncode}) before this block"
        worker.stdin.write(json.dumps({"label": block.id, "path": str(path)}) + "\n")
        worker.stdin.flush()
        ready, _, _ = select.select([worker.stdout], [], [], BLOCK_TIMEOUT)
        answer_line = worker.stdout.readline() if ready else ""
        output = log.read_text(encoding="utf-8", errors="replace")[offset:]
        if not answer_line:
            worker.kill()
            return f"no answer within {BLOCK_TIMEOUT} s (or the interpreter died)\n--- output ---\n{_tail(output)}"
        answer = json.loads(answer_line)
        if answer["ok"]:
            return None
        return f"--- output ---\n{_tail(output)}\n--- exception ---\n{answer['error']}"

    def close(self) -> None:
        for worker in self.workers.values():
            worker.stdin.close()
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
        for log in self.open_logs:
            log.close()


def _tail(text: str | bytes | None, limit: int = 6000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    text = text or ""
    return text if len(text) <= limit else "...\n" + text[-limit:]


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme")
    run = ReadmeRun(root)
    yield run
    run.close()
    shutil.rmtree(run.workspace, ignore_errors=True)  # some GB of models and checkpoints


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[block.id for block in BLOCKS])
def test_readme_block_runs_as_written(block, readme_run):
    if block.skip_reason is not None:
        pytest.skip(f"README {block.id}: {block.skip_reason}")
    readme_run.run_through(block.index)

