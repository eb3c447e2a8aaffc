"""MemoryFormer for Hugging Face Transformers.

The modules at this level are the model unit, the files that `save_pretrained` copies next to the weights for
`trust_remote_code=True`: configuration_memoryformer, modeling_memoryformer, memory_ops (the Memory Layer op, its
reference and the kernel dispatch and loader), quantization (int8 / bfloat16 tables and LM head for inference),
transformers_compat (the differences between the supported transformers releases) and memory_kernel_source
(generated from csrc/). They import no tool.
The tools are the subpackages, each importing the model unit and never imported by it: training, evaluation,
conversion, comparison (the Pythia twin and the demo), integrations (Hub, PEFT, distribution) and cli (the
`memoryformer` command); presets holds the preset configs.

`import modeling_memoryformer` registers MemoryFormer with AutoConfig, AutoModel and AutoModelForCausalLM.

The import itself is light (no torch, no transformers), so that `memoryformer --help` answers at once. The model
code is loaded, and registered with the Auto classes, on first need:

- a public name is read: `from modeling_memoryformer import MemoryFormerConfig`, `modeling_memoryformer.MemoryLayer`;
- transformers' Auto classes are imported (`from transformers import AutoModelForCausalLM`, or already were);
- a model module is imported directly: `from modeling_memoryformer.modeling_memoryformer import MemoryLayer`.
"""

import importlib.abc
import sys

__version__ = "0.2.0.dev0"

# public name -> the submodule that defines it
_EXPORTS = {
    "MemoryFormerConfig": "configuration_memoryformer",
    "MemoryFormerModel": "modeling_memoryformer",
    "MemoryFormerForCausalLM": "modeling_memoryformer",
    "MemoryFormerPreTrainedModel": "modeling_memoryformer",
    "MemoryLayer": "modeling_memoryformer",
    "MemoryBlock": "modeling_memoryformer",
    "hash_codes": "memory_ops",
    "hash_scores": "memory_ops",
    "memory_lookup": "memory_ops",
    "memory_lookup_reference": "memory_ops",
    "compiled_decode_kwargs": "transformers_compat",
}
__all__ = list(_EXPORTS)

# Once any of these has been imported, the model is loaded and registered: the first is where every transformers
# Auto class looks a model type up; the others are this package's model files, imported directly.
_AUTO_MODULE = "transformers.models.auto.configuration_auto"
_MODEL_MODULES = (f"{__name__}.configuration_memoryformer", f"{__name__}.modeling_memoryformer")
_registered = False


def _register() -> None:
    """Load the model classes into this namespace and register them with transformers (once)."""
    global _registered
    if _registered:
        return
    _registered = True  # first: the imports below import the watched modules again
    import importlib

    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    for name, module in _EXPORTS.items():
        globals()[name] = getattr(importlib.import_module(f".{module}", __name__), name)
    config, model, causal_lm = MemoryFormerConfig, MemoryFormerModel, MemoryFormerForCausalLM  # noqa: F821

    AutoConfig.register(config.model_type, config, exist_ok=True)
    AutoModel.register(config, model, exist_ok=True)
    AutoModelForCausalLM.register(config, causal_lm, exist_ok=True)

    # save_pretrained copies the model files next to the weights and writes `auto_map`, so that
    # `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` works without this package.
    config.register_for_auto_class("AutoConfig")
    model.register_for_auto_class("AutoModel")
    causal_lm.register_for_auto_class("AutoModelForCausalLM")

    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _RegisterAfterImport)]


def _initializing(name: str) -> bool:
    module = sys.modules.get(name)
    return module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False)


def _watched(name: str) -> bool:
    """transformers' modules and every module of this package: registration waits until the outermost import of any
    of them has finished, so that it never imports a model file that is still half-initialised (`import
    modeling_memoryformer.memory_layer` loads transformers before memory_layer has defined MemoryLayer)."""
    return name == "transformers" or name.startswith(("transformers.", f"{__name__}."))


def _ready() -> bool:
    """transformers' Auto classes or a model file are loaded (then MemoryFormer must be registered)."""
    return _AUTO_MODULE in sys.modules or any(name in sys.modules for name in _MODEL_MODULES)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for transformers' modules and this package's modules it lets the other finders find
    them and wraps the loader, to register MemoryFormer once the outermost of those imports has finished (not
    earlier: the model files import transformers modules that may still be half-initialized until then)."""

    depth = 0  # watched imports under way

    def find_spec(self, fullname, path, target=None):
        if _registered or not _watched(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module") or not hasattr(loader, "__dict__"):
            return spec
        exec_module = loader.exec_module

        def exec_then_register(module):
            del loader.exec_module  # the loader object may be reused: leave it as it was
            _RegisterAfterImport.depth += 1
            try:
                exec_module(module)
            finally:
                _RegisterAfterImport.depth -= 1
            if _RegisterAfterImport.depth == 0 and not _registered and _ready():
                module.__spec__._initializing = False  # executed: `_register` may import from it
                _register()

        loader.exec_module = exec_then_register
        return spec


def __getattr__(name: str):
    if name in _EXPORTS:
        _register()
        if name not in globals():  # asked for while registration runs (or after it failed): import just this name
            import importlib

            globals()[name] = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if _ready() and not any(_initializing(name) for name in list(sys.modules) if _watched(name)):
    _register()  # transformers' Auto classes are loaded already: register now, as users expect
if not _registered:
    sys.meta_path.insert(0, _RegisterAfterImport())
