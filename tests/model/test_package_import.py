"""`import modeling_memoryformer` is light (no torch), yet every public name imports and MemoryFormer is registered
with transformers' Auto classes whichever way the model is first reached. Each case runs in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest

import modeling_memoryformer

TINY_CONFIG = ("dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, hash_bits=4, "
               "expand_bits=1, max_position_embeddings=32)")


def run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_import_loads_no_torch():
    assert run("import sys, modeling_memoryformer\nprint('torch' in sys.modules, 'transformers' in sys.modules)"
               ).split() == ["False", "False"]


@pytest.mark.slow
@pytest.mark.parametrize("first", [
    "import modeling_memoryformer\nfrom transformers import AutoConfig, AutoModelForCausalLM",  # package, then Auto
    "from transformers import AutoConfig, AutoModelForCausalLM\nimport modeling_memoryformer",  # Auto, then package
    "from modeling_memoryformer.modeling_memoryformer import MemoryLayer\n"  # a model file directly
    "from transformers import AutoConfig, AutoModelForCausalLM",
])
def test_auto_classes_know_memoryformer_however_it_is_reached(first):
    code = f"""{first}
config = AutoConfig.for_model("memoryformer", **{TINY_CONFIG})
model = AutoModelForCausalLM.from_config(config)
import modeling_memoryformer as package
import sys
from pathlib import Path
unit = {{path.stem for path in Path(package.__file__).parent.glob("*.py")}}  # the model unit: the top-level modules
tools = sorted(name for name in sys.modules if name.split(".")[0] == "modeling_memoryformer" and "." in name
               and name.split(".", 1)[1] not in unit)  # the model imports no tool
print(type(config).__name__, type(model).__name__, type(model).__module__, type(model)._auto_class, tools or "none")
"""
    assert run(code).split() == ["MemoryFormerConfig", "MemoryFormerForCausalLM",
                                 "modeling_memoryformer.modeling_memoryformer", "AutoModelForCausalLM", "none"]


def test_every_public_name_is_the_object_of_its_module():
    from modeling_memoryformer import configuration_memoryformer, memory_ops
    from modeling_memoryformer import modeling_memoryformer as modeling

    modules = (configuration_memoryformer, memory_ops, modeling)
    for name in modeling_memoryformer.__all__:
        value = getattr(modeling_memoryformer, name)
        assert any(getattr(module, name, None) is value for module in modules), name
        assert name in dir(modeling_memoryformer)
    with pytest.raises(AttributeError, match="no attribute 'NotAThing'"):
        modeling_memoryformer.NotAThing  # noqa: B018


def test_star_import_gives_the_public_names():
    namespace = {}
    exec("from modeling_memoryformer import *", namespace)
    assert set(modeling_memoryformer.__all__) <= set(namespace)
    assert namespace["MemoryFormerConfig"].model_type == "memoryformer"
