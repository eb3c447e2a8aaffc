# Every target sets up its own environment: a venv in .venv, torch 2.13.0 (CPU) first, then this package.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.memoryformer-installed
TORCH_VERSION := 2.13.0

.PHONY: setup demo test bench flops clean

setup: $(STAMP)

# One line per stage; pip runs quietly (its errors still show). torch is pinned again in the last stage so that
# resolving this package's dependencies can never replace it with another build. editable_mode=compat: a .pth file
# puts this folder on sys.path (the presets are read from configuration/, see configuration_memoryformer._preset_path);
# the default editable mode would, for the configuration/ -> modeling_memoryformer.presets mapping, install an import
# hook and print a warning about it.
$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found; run 'make PYTHON=/path/to/python3.11 ...'"; exit 1; }
	@echo "[1/4] creating the venv $(VENV) ($(PYTHON))"
	@$(PYTHON) -m venv $(VENV)
	@echo "[2/4] upgrading pip"
	@$(PY) -m pip install --quiet --upgrade pip
	@echo "[3/4] torch $(TORCH_VERSION) (CPU)"
	@$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	@echo "[4/4] memoryformer-hf (editable) with its dev extras"
	@$(PY) -m pip install --quiet --config-settings editable_mode=compat -e ".[dev]" torch==$(TORCH_VERSION)
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
