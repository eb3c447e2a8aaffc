# Every target sets up its own environment: a venv in .venv, torch 2.13.0 (CPU) first, then this package.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.memoryformer-installed
TORCH_VERSION := 2.13.0

.PHONY: setup demo test bench flops clean

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
	@PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install --quiet -e ".[dev]" torch==$(TORCH_VERSION)
	@touch $(STAMP)
	@echo "ready: $(VENV)/bin/memoryformer --help"

# The main job on the embedded default: no files, no network.
demo: $(STAMP)
	$(VENV)/bin/memoryformer demo --overwrite

flops: $(STAMP)
	$(VENV)/bin/memoryformer flops

# pytest exits 5 when it collects nothing: that is a failure here, not a pass. MEMORYFORMER_REQUIRE_FUSED=1: a fused
# CPU kernel that cannot be built fails the run instead of skipping its tests.
test: $(STAMP)
	MEMORYFORMER_REQUIRE_FUSED=1 $(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) -m benchmarks.run

clean:
	rm -rf $(VENV) build *.egg-info
