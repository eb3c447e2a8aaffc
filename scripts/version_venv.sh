#!/usr/bin/env bash
# Usage: scripts/version_venv.sh VENV PYTHON TORCH_VERSION TRANSFORMERS_REQUIREMENT
# A venv holding this package beside one transformers release, for the version tests of `make test`:
# torch first (pinned), then transformers as asked (an exact release, or a range: the newest release in it), then this
# package (editable, with the serve extra: the server runs on transformers' serving code), pytest and parameterized
# (transformers' own common tests import it: tests/transformers_suite). Fails if
# installing the package changed the transformers release: the declared range
# in pyproject.toml must keep what a user already has.
set -euo pipefail
venv=$1 python=$2 torch_version=$3 requirement=$4
pip=("$venv/bin/python" -m pip)
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; return "${PIPESTATUS[0]}"; }

echo "[versions] $venv: $requirement"
rm -rf "$venv"
"$python" -m venv "$venv"
quiet "${pip[@]}" install --quiet --upgrade pip
quiet "${pip[@]}" install --quiet "torch==$torch_version"
quiet "${pip[@]}" install --quiet "$requirement" "torch==$torch_version"
before=$("$venv/bin/python" -c "import transformers; print(transformers.__version__)")
PYTHONWARNINGS="ignore:Editable installation" quiet "${pip[@]}" install --quiet -e ".[serve]" "pytest>=8" "parameterized" "torch==$torch_version"
after=$("$venv/bin/python" -c "import transformers; print(transformers.__version__)")
if [ "$before" != "$after" ]; then
  echo "error: installing memoryformer-hf replaced transformers $before by $after: widen pyproject.toml's range" >&2
  exit 1
fi
echo "[versions] $venv: transformers $after kept"
touch "$venv/.memoryformer-installed"
