"""trust_remote_code: a saved folder holds exactly the model unit's files, and loads and computes identically in a
process that cannot import the package; a folder saved by release 0.1.0 still loads."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import modeling_memoryformer
from modeling_memoryformer import MemoryFormerForCausalLM

from conftest import tiny_model


PACKAGE_DIR = Path(modeling_memoryformer.__file__).parent
# The model unit: what save_pretrained copies next to the weights, and all that stands at the package's top level
# (besides __init__.py and the C++ in csrc/, which travels as memory_kernel_source.py).
MODEL_FILES = [
    "configuration_memoryformer.py", "cpu_facts.py", "decode_layer.py", "decode_loop.py", "huge_pages.py", "memory_backend_cpu.py", "memory_backend_torch.py", "memory_backend_triton.py",
    "memory_kernel_source.py", "memory_kernels.py", "memory_layer.py", "memory_loss.py", "memory_math.py", "memory_op_library.py",
    "memory_ops.py", "memory_table_updates.py", "modeling_memoryformer.py", "quantization.py",
    "transformers_compat.py",
]
SAVED_FILES = ["config.json", "generation_config.json", "model.safetensors", *MODEL_FILES]
# config.json, generation_config.json and model.safetensors of a tiny model saved by release 0.1.0 (git 0630197), and
# its logits on fixed input ids (expected.safetensors). Its copies of the model files are not kept here.
RELEASE_0_1_0 = Path(__file__).resolve().parent / "data" / "saved-0.1.0"
AUTO_MAP = {
    "AutoConfig": "configuration_memoryformer.MemoryFormerConfig",
    "AutoModel": "modeling_memoryformer.MemoryFormerModel",
    "AutoModelForCausalLM": "modeling_memoryformer.MemoryFormerForCausalLM",
}

# Runs in a fresh interpreter whose cwd is a temporary folder. A meta-path finder makes the package unimportable, so
# everything must come from the saved folder's own copy of the code.
WITHOUT_THE_PACKAGE = textwrap.dedent(
    '''
    import json
    import sys


    class BlockPackage:
        def find_spec(self, name, path=None, target=None):
            if name == "modeling_memoryformer" or name.startswith("modeling_memoryformer."):
                raise ImportError(f"{name} is blocked: this process must use the saved folder's code")
            return None


    sys.meta_path.insert(0, BlockPackage())
    try:
        import modeling_memoryformer  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("modeling_memoryformer is importable: the remote-code test would prove nothing")
    '''
)
CHILD = WITHOUT_THE_PACKAGE + textwrap.dedent(
    '''
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    folder, inputs_path, outputs_path = sys.argv[1:4]
    input_ids = torch.load(inputs_path)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    lm = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    base = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = lm(input_ids).logits
        hidden = base(input_ids).last_hidden_state
        generated = lm.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=5,
                                do_sample=False)
    torch.save({"logits": logits, "hidden": hidden, "generated": generated}, outputs_path)
    report = {
        "config_class": f"{type(config).__module__}.{type(config).__name__}",
        "lm_class": f"{type(lm).__module__}.{type(lm).__name__}",
        "base_class": f"{type(base).__module__}.{type(base).__name__}",
        "package_imported": any(name.split(".")[0] == "modeling_memoryformer" for name in sys.modules),
    }
    print("REPORT " + json.dumps(report))
    '''
)


@pytest.fixture
def saved_folder(tmp_path):
    model = tiny_model(attention_output="memory", hash_score="l1")
    folder = tmp_path / "saved_memoryformer"
    model.save_pretrained(folder)
    return model, folder


def test_save_pretrained_writes_auto_map_for_all_three_auto_classes(saved_folder):
    _, folder = saved_folder
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP


def test_the_package_top_level_is_the_model_unit():
    assert sorted(path.name for path in PACKAGE_DIR.glob("*.py")) == sorted(["__init__.py", *MODEL_FILES])


def test_remote_code_requires_only_torch_transformers_and_safetensors():
    """transformers' remote-code loader lists each model file's imports (its own `get_imports`, which skips imports
    inside try blocks) and refuses to load the model when one is not installed: an optional dependency (triton)
    imported outside a try block would make every saved folder unloadable where it is missing."""
    from transformers.dynamic_module_utils import get_imports

    allowed = {"torch", "transformers", "safetensors", *sys.stdlib_module_names}
    needed = {name: set(get_imports(PACKAGE_DIR / name)) - allowed for name in MODEL_FILES}
    assert {name: imports for name, imports in needed.items() if imports} == {}


def test_save_pretrained_writes_exactly_the_model_unit(saved_folder):
    _, folder = saved_folder
    assert sorted(path.name for path in folder.iterdir()) == sorted(SAVED_FILES)


def test_save_pretrained_copies_the_model_code(saved_folder):
    _, folder = saved_folder
    for name in MODEL_FILES:
        copied = folder / name
        assert copied.is_file(), name
        assert copied.read_bytes() == (PACKAGE_DIR / name).read_bytes(), name
    # Only sibling imports: the copied code must not need the package itself, nor any tool.
    siblings = {name.removesuffix(".py") for name in MODEL_FILES}
    for copied in folder.glob("*.py"):
        source = copied.read_text()
        assert "import modeling_memoryformer" not in source, copied.name
        assert "from modeling_memoryformer" not in source, copied.name
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.level:
                where = f"{copied.name}: from {'.' * node.level}{node.module}"
                assert node.level == 1 and node.module in siblings, where


def load_without_the_package(folder: Path, input_ids, tmp_path: Path, python: str = sys.executable,
                             child: str = CHILD) -> tuple[dict, dict]:
    """Load `folder` with trust_remote_code=True in a fresh process of `python` that cannot import the package; the
    report and the outputs of the `child` script (by default: logits, hidden states, greedy generation) on
    `input_ids`."""
    inputs_path, outputs_path = tmp_path / "inputs.pt", tmp_path / "outputs.pt"
    torch.save(input_ids, inputs_path)
    child_dir = tmp_path / "child_cwd"
    child_dir.mkdir()
    (child_dir / "child.py").write_text(child)

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HF_TOKEN")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf_home"),
        HF_MODULES_CACHE=str(tmp_path / "hf_modules"),
        PYTHONDONTWRITEBYTECODE="1",
    )
    result = subprocess.run(
        [python, "child.py", str(folder), str(inputs_path), str(outputs_path)],
        cwd=child_dir, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    report = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("REPORT "))[7:])
    assert report["package_imported"] is False
    assert (tmp_path / "hf_modules" / "transformers_modules").is_dir()  # the cache went where we pointed it
    return report, torch.load(outputs_path)


@pytest.mark.slow
def test_saved_folder_loads_with_trust_remote_code_without_the_package(saved_folder, tmp_path):
    model, folder = saved_folder
    input_ids = torch.tensor([[5, 17, 99, 42, 8, 63, 120], [64, 3, 90, 11, 7, 7, 100]])
    report, remote = load_without_the_package(folder, input_ids, tmp_path)
    for key, name in [("config_class", "MemoryFormerConfig"), ("lm_class", "MemoryFormerForCausalLM"),
                      ("base_class", "MemoryFormerModel")]:
        assert report[key].startswith("transformers_modules."), report[key]
        assert report[key].endswith(name), report[key]

    with torch.no_grad():
        logits = model(input_ids).logits
        hidden = model.model(input_ids).last_hidden_state
        generated = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=5,
                                   do_sample=False)
    assert torch.equal(remote["logits"], logits)
    assert torch.equal(remote["hidden"], hidden)
    assert torch.equal(remote["generated"], generated)


def test_a_folder_saved_by_release_0_1_0_loads_with_the_package():
    expected = load_file(RELEASE_0_1_0 / "expected.safetensors")
    model = AutoModelForCausalLM.from_pretrained(RELEASE_0_1_0).eval()
    assert type(model) is MemoryFormerForCausalLM
    with torch.no_grad():
        logits = model(expected["input_ids"]).logits
    torch.testing.assert_close(logits, expected["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_the_auto_map_of_release_0_1_0_names_the_model_unit_of_today(tmp_path):
    """A Hub repo made by 0.1.0 keeps its config.json; its auto_map must name classes the current model files define
    (e.g. once the code files of the repo are replaced by today's)."""
    folder = tmp_path / "saved-0.1.0"
    shutil.copytree(RELEASE_0_1_0, folder)
    for name in MODEL_FILES:
        shutil.copy(PACKAGE_DIR / name, folder / name)
    expected = load_file(folder / "expected.safetensors")
    report, remote = load_without_the_package(folder, expected["input_ids"], tmp_path)
    assert report["lm_class"].endswith("modeling_memoryformer.MemoryFormerForCausalLM"), report["lm_class"]
    assert report["config_class"].endswith("configuration_memoryformer.MemoryFormerConfig"), report["config_class"]
    torch.testing.assert_close(remote["logits"], expected["logits"], rtol=1e-5, atol=1e-5)
