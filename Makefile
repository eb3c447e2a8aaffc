# Every target sets up its own environment: a venv in .venv, torch 2.13.0 (CPU) first, then this package.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.memoryformer-installed

.PHONY: setup demo test bench flops clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found; run 'make PYTHON=/path/to/python3.11 ...'"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	@touch $(STAMP)

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
