"""trust_remote_code: a saved folder must load and compute identically in a process that cannot import the package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import modeling_memoryformer

from conftest import tiny_model


PACKAGE_DIR = Path(modeling_memoryformer.__file__).parent
MODEL_FILES = ["configuration_memoryformer.py", "modeling_memoryformer.py", "memory_ops.py"]
AUTO_MAP = {
    "AutoConfig": "configuration_memoryformer.MemoryFormerConfig",
    "AutoModel": "modeling_memoryformer.MemoryFormerModel",
    "AutoModelForCausalLM": "modeling_memoryformer.MemoryFormerForCausalLM",
}

# Runs in a fresh interpreter whose cwd is a temporary folder. A meta-path finder makes the package unimportable, so
# everything must come from the saved folder's own copy of the code.
CHILD = textwrap.dedent(
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


def test_save_pretrained_copies_the_model_code(saved_folder):
    _, folder = saved_folder
    for name in MODEL_FILES:
        copied = folder / name
        assert copied.is_file(), name
        assert copied.read_bytes() == (PACKAGE_DIR / name).read_bytes(), name
    # Only sibling imports: the copied code must not need the package itself.
    for copied in folder.glob("*.py"):
        source = copied.read_text()
        assert "import modeling_memoryformer" not in source, copied.name
        assert "from modeling_memoryformer" not in source, copied.name


def test_saved_folder_loads_with_trust_remote_code_without_the_package(saved_folder, tmp_path):
    model, folder = saved_folder
    input_ids = torch.tensor([[5, 17, 99, 42, 8, 63, 120], [64, 3, 90, 11, 7, 7, 100]])
    inputs_path, outputs_path = tmp_path / "inputs.pt", tmp_path / "outputs.pt"
    torch.save(input_ids, inputs_path)
    child_dir = tmp_path / "child_cwd"
    child_dir.mkdir()
    (child_dir / "child.py").write_text(CHILD)

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HF_TOKEN")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf_home"),
        HF_MODULES_CACHE=str(tmp_path / "hf_modules"),
        PYTHONDONTWRITEBYTECODE="1",
    )
    result = subprocess.run(
        [sys.executable, "child.py", str(folder), str(inputs_path), str(outputs_path)],
        cwd=child_dir, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    report = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("REPORT "))[7:])
    assert report["package_imported"] is False
    for key, name in [("config_class", "MemoryFormerConfig"), ("lm_class", "MemoryFormerForCausalLM"),
                      ("base_class", "MemoryFormerModel")]:
        assert report[key].startswith("transformers_modules."), report[key]
        assert report[key].endswith(name), report[key]
    assert (tmp_path / "hf_modules" / "transformers_modules").is_dir()  # the cache went where we pointed it

    remote = torch.load(outputs_path)
    with torch.no_grad():
        logits = model(input_ids).logits
        hidden = model.model(input_ids).last_hidden_state
        generated = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=5,
                                   do_sample=False)
    assert torch.equal(remote["logits"], logits)
    assert torch.equal(remote["hidden"], hidden)
    assert torch.equal(remote["generated"], generated)
