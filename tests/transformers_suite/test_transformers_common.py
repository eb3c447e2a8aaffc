"""transformers' own common model tests (`ModelTesterMixin`, `ConfigTester`) on MemoryFormer, as transformers runs them
on its in-tree models (tests/models/gpt_neox/test_modeling_gpt_neox.py): from the test files of the installed
transformers release's source distribution, never a copy kept here. `scripts/transformers_tests.sh PYTHON` downloads
the sdist of PYTHON's release (pip), extracts its tests/ and prints the folder; `make test` puts it in
MEMORYFORMER_TRANSFORMERS_TESTS. Without that variable this module skips and says so.

The folder is imported as the package `transformers_release_tests` (the name `tests` is this repository's). The sdist
ships the top-level tests/*.py but not the three modules test_modeling_common.py and test_configuration_common.py
import from subfolders of transformers' repository; they stand in here (`_STAND_INS`, read their notes):
- exporters/test_export.py's `ExportTesterMixin` (ModelTesterMixin's base: the torch.export tests): empty, so those
  tests are not run here (tests/model/test_compile.py compiles the model).
- generation/test_utils.py's `GenerationTesterMixin` (the `generate` tests): empty; the model's generation is tested
  in tests/model/test_generation.py and test_capabilities.py. `test_generation_tester_mixin_inheritance` asks a
  generative model's test class to inherit it, which the test class below does.
- utils/test_configuration_utils.py's `config_common_kwargs` (non-default values of the options every config takes,
  for `ConfigTester.check_config_arguments_init`): those options, with values of the same kind.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
import unittest
from pathlib import Path

import pytest
import transformers
from transformers.models.auto import modeling_auto

from modeling_memoryformer import MemoryFormerConfig, MemoryFormerForCausalLM, MemoryFormerModel

pytestmark = pytest.mark.slow  # about a hundred tests that each build and run several models

FOLDER_VARIABLE = "MEMORYFORMER_TRANSFORMERS_TESTS"
PACKAGE = "transformers_release_tests"

_folder = os.environ.get(FOLDER_VARIABLE)
if not _folder:
    pytest.skip(
        f"{FOLDER_VARIABLE} is not set: `make test` sets it to the tests/ of the installed transformers release's "
        f"source distribution (`scripts/transformers_tests.sh {sys.executable}` prints that folder)",
        allow_module_level=True,
    )
FOLDER = Path(_folder).resolve()

from parameterized import parameterized  # transformers' tests need it (a dev dependency): asked for only when they run


def _release_of(folder: Path) -> str:
    """The version in the sdist's PKG-INFO beside its tests/ folder (scripts/transformers_tests.sh extracts both)."""
    for line in (folder.parent / "PKG-INFO").read_text(encoding="utf-8").splitlines():
        if line.startswith("Version: "):
            return line.removeprefix("Version: ").strip()
    raise RuntimeError(f"{folder.parent / 'PKG-INFO'} names no version")


if not (FOLDER / "test_modeling_common.py").is_file():
    raise RuntimeError(f"{FOLDER_VARIABLE}={FOLDER} has no test_modeling_common.py: run scripts/transformers_tests.sh")
if _release_of(FOLDER) != transformers.__version__:
    raise RuntimeError(
        f"{FOLDER_VARIABLE}={FOLDER} holds the tests of transformers {_release_of(FOLDER)}, but this environment runs "
        f"{transformers.__version__}: pass the folder `scripts/transformers_tests.sh {sys.executable}` prints"
    )


class _ExportTesterMixin:
    """Stands in for exporters/test_export.py's mixin, which the sdist does not ship (no export tests run here)."""


class _GenerationTesterMixin:
    """Stands in for generation/test_utils.py's mixin, which the sdist does not ship (no generate tests run here)."""


def _config_common_kwargs() -> dict:
    """Non-default values of options every config takes: what `ConfigTester.check_config_arguments_init` passes to the
    config class and reads back."""
    return {
        "return_dict": False,
        "output_hidden_states": True,
        "output_attentions": True,
        "dtype": "float16",
        "chunk_size_feed_forward": 5,
        "architectures": ["MemoryFormerForCausalLM"],
        "id2label": {0: "label"},
        "label2id": {"label": "0"},
        "problem_type": "regression",
    }


_STAND_INS = {
    "exporters.test_export": {"ExportTesterMixin": _ExportTesterMixin},
    "generation.test_utils": {"GenerationTesterMixin": _GenerationTesterMixin},
    "utils.test_configuration_utils": {"config_common_kwargs": _config_common_kwargs()},
}


def _import_release_tests(folder: Path):
    """Import test_modeling_common and test_configuration_common from `folder` as modules of the package PACKAGE, with
    the stand-ins for the modules the folder lacks (a release whose sdist ships one gets its own)."""
    spec = importlib.util.spec_from_file_location(PACKAGE, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = package
    spec.loader.exec_module(package)
    for dotted, names in _STAND_INS.items():
        if folder.joinpath(*dotted.split(".")).with_suffix(".py").is_file():
            continue
        parent = PACKAGE
        for part in dotted.split("."):
            name = f"{parent}.{part}"
            if name not in sys.modules:
                sys.modules[name] = types.ModuleType(name)
                setattr(sys.modules[parent], part, sys.modules[name])
            parent = name
        for attribute, value in names.items():
            setattr(sys.modules[parent], attribute, value)
    return (importlib.import_module(f"{PACKAGE}.test_modeling_common"),
            importlib.import_module(f"{PACKAGE}.test_configuration_common"))


_modeling_common, _configuration_common = _import_release_tests(FOLDER)
ModelTesterMixin = _modeling_common.ModelTesterMixin
ConfigTester = _configuration_common.ConfigTester
ids_tensor = _modeling_common.ids_tensor
random_attention_mask = _modeling_common.random_attention_mask


class MemoryFormerModelTester:
    """Small shapes, as tests/model/test_modeling_common.py's tester: head_dim 16, 2 layers, hash_bits 4 (K = 16
    sub-tables per layer). The tables and embeddings use a large std (0.5) so that attention is far from uniform and
    the logits have clear argmax gaps."""

    def __init__(
        self,
        parent,
        batch_size=3,
        seq_length=9,
        is_training=True,
        use_input_mask=True,
        use_labels=True,
        vocab_size=99,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        hash_bits=4,
        expand_bits=2,
        max_position_embeddings=64,
        table_init_std=0.5,
        initializer_range=0.5,
        pad_token_id=0,
        use_parallel_residual=False,
    ):
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = is_training
        self.use_input_mask = use_input_mask
        self.use_labels = use_labels
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.hash_bits = hash_bits
        self.expand_bits = expand_bits
        self.max_position_embeddings = max_position_embeddings
        self.table_init_std = table_init_std
        self.initializer_range = initializer_range
        self.pad_token_id = pad_token_id
        self.use_parallel_residual = use_parallel_residual

    def get_config(self) -> MemoryFormerConfig:
        return MemoryFormerConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            max_position_embeddings=self.max_position_embeddings,
            hash_bits=self.hash_bits,
            expand_bits=self.expand_bits,
            table_init_std=self.table_init_std,
            initializer_range=self.initializer_range,
            pad_token_id=self.pad_token_id,
            use_parallel_residual=self.use_parallel_residual,
        )

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        input_mask = random_attention_mask([self.batch_size, self.seq_length]) if self.use_input_mask else None
        token_labels = ids_tensor([self.batch_size, self.seq_length], self.vocab_size) if self.use_labels else None
        return self.get_config(), input_ids, input_mask, token_labels

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, input_mask, _ = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "attention_mask": input_mask}


# The tables transformers' tests read to tell a base model from a causal LM (`_prepare_for_class` adds labels for a
# causal LM, the training tests skip base models, `test_base_model_prefix_loads_base_weights` looks the base model up):
# an in-tree model is listed in them (models/auto/modeling_auto.py), a registered one is not, so the test class lists
# MemoryFormer while it runs.
_NAME_TABLES = [
    (modeling_auto.MODEL_MAPPING_NAMES, MemoryFormerModel.__name__),
    (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MemoryFormerForCausalLM.__name__),
]


class MemoryFormerModelTest(ModelTesterMixin, _GenerationTesterMixin, unittest.TestCase):
    all_model_classes = (MemoryFormerModel, MemoryFormerForCausalLM)
    # transformers dates a model by the copyright line of its config file and runs this test only on models from 2023
    # on (or with this flag): the config file has no such line, and `_init_weights` covers every tensor.
    test_can_init_all_missing_weights_before_2023 = True

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        for table, name in _NAME_TABLES:
            cls.addClassCleanup(table.pop, MemoryFormerConfig.model_type, None)
            table[MemoryFormerConfig.model_type] = name

    def setUp(self):
        self.model_tester = MemoryFormerModelTester(self)
        self.config_tester = ConfigTester(self, config_class=MemoryFormerConfig, hidden_size=64)

    @parameterized.expand(_modeling_common.TEST_EAGER_MATCHES_SDPA_INFERENCE_PARAMETERIZATION)
    def test_eager_matches_sdpa_inference(self, name, dtype, *args):
        """transformers' test, run in half precision on one layer with the parallel residual (y = x + Attn(N1(x)) +
        MB(N2(x))), where the attention output reaches the output without passing through a hashed layer. Eager and
        SDPA round differently in float16 / bfloat16, and a Memory Layer after the attention hashes the signs of its
        input: a rounding difference at a value near zero picks another table row, a step in the output (the model is
        piecewise constant in those inputs, not wrong), so on the default tester most rows differ by more than the
        test's tolerance. float32 runs on the default tester."""
        if dtype != "fp32":
            self.model_tester = MemoryFormerModelTester(self, num_hidden_layers=1, use_parallel_residual=True)
        _modeling_common._test_eager_matches_sdpa_inference(self, name, dtype, *args)

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_model(self):
        config, input_ids, input_mask, _ = self.model_tester.prepare_config_and_inputs()
        model = MemoryFormerModel(config).eval()
        result = model(input_ids, attention_mask=input_mask)
        self.assertEqual(result.last_hidden_state.shape,
                         (self.model_tester.batch_size, self.model_tester.seq_length, self.model_tester.hidden_size))

    def test_for_causal_lm(self):
        config, input_ids, input_mask, token_labels = self.model_tester.prepare_config_and_inputs()
        model = MemoryFormerForCausalLM(config).eval()
        result = model(input_ids, attention_mask=input_mask, labels=token_labels)
        self.assertEqual(result.logits.shape,
                         (self.model_tester.batch_size, self.model_tester.seq_length, self.model_tester.vocab_size))
        self.assertEqual(result.loss.shape, ())
