"""`import modeling_memoryformer` is light (no torch), yet every public name imports and MemoryFormer is registered
with transformers' Auto classes whichever way the model is first reached. Each case runs in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest

import modeling_memoryformer

TINY_CONFIG = ("dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, hash_bits=4, "
               "expand_bits=1, max_position_embeddings=32)")


def run(code: str, timeout: float = 300) -> str:
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=timeout)
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
    from modeling_memoryformer import configuration_memoryformer, memory_ops, transformers_compat
    from modeling_memoryformer import modeling_memoryformer as modeling

    modules = (configuration_memoryformer, memory_ops, modeling, transformers_compat)
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


# Every module of the package, imported first. The parent preloads torch and other libraries that import no
# transformers module and none of this package's (those are what the import hook watches), then forks a child per module: the child's first import of the package
# is that module, as in a fresh interpreter, without paying for torch each time.
FIRST_IMPORT_OF_EACH = """
import importlib, importlib.util, os, pkgutil, sys
from concurrent.futures import ThreadPoolExecutor
import os
os.environ.setdefault("MPLBACKEND", "Agg")
for library in ("accelerate", "datasets", "huggingface_hub", "matplotlib.pyplot", "numpy", "safetensors.torch",
                "tokenizers", "torch"):
    if importlib.util.find_spec(library.split(".")[0]) is not None:  # the version venvs hold fewer extras
        importlib.import_module(library)
assert not any(n == "transformers" or n.startswith(("transformers.", "modeling_memoryformer")) for n in sys.modules)
spec = importlib.util.find_spec("modeling_memoryformer")
names = sorted(m.name for m in pkgutil.walk_packages(spec.submodule_search_locations, "modeling_memoryformer.")
               if not m.name.endswith(".__main__"))  # a program to run (`python -m`), not a module to import


def first_import(name):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(name)
            from transformers import AutoConfig
            config = AutoConfig.for_model("memoryformer")
            message = f"ok {type(config).__module__}"
        except ModuleNotFoundError as error:  # an extra this environment lacks (a tool's dependency): not checked
            ours = (error.name or "").split(".")[0] in ("modeling_memoryformer", "transformers")
            message = f"failed {error!r}" if ours else f"lacks {error.name}"
        except BaseException as error:  # noqa: BLE001 - reported to the parent
            message = f"failed {type(error).__name__}: {error}"
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        message = pipe.read()
    os.waitpid(pid, 0)
    return name, message


with ThreadPoolExecutor(2) as pool:
    for name, message in pool.map(first_import, names):
        print(name, message)
"""


TOOL_PACKAGES = {"cli", "comparison", "evaluation", "integrations", "serving", "training"}


@pytest.mark.slow
def test_every_module_imports_as_the_first_import_of_a_fresh_interpreter():
    """Before, `from modeling_memoryformer.memory_layer import MemoryLayer` as a process's first import failed: the
    import hook registered the Auto classes (importing the model files) while memory_layer was half-initialised."""
    lines = run(FIRST_IMPORT_OF_EACH, timeout=900).splitlines()
    results = dict(line.split(" ", 1) for line in lines)
    assert len(results) > 40 and "modeling_memoryformer.memory_layer" in results, lines
    failed = {name: message for name, message in results.items()
              if message != "ok modeling_memoryformer.configuration_memoryformer" and not message.startswith("lacks ")}
    assert not failed, failed
    unit = [name for name in results if name.count(".") == 1 and name.split(".")[1] not in TOOL_PACKAGES]
    assert all(results[name].startswith("ok") for name in unit), {name: results[name] for name in unit}
