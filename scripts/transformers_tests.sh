#!/usr/bin/env bash
# Usage: scripts/transformers_tests.sh PYTHON [CACHE]
# Prints the folder of transformers' own common tests (tests/test_modeling_common.py, tests/test_configuration_common.py)
# for the transformers release installed in PYTHON's environment, taken from that release's source distribution: the
# wheel ships no tests. pip downloads the sdist once into CACHE/<version>/ (default .transformers-tests, which ignores
# itself in git), and its tests/ is extracted beside it; later calls reuse it. tests/transformers_suite reads the
# printed folder from MEMORYFORMER_TRANSFORMERS_TESTS.
set -euo pipefail
python=$1 cache=${2:-.transformers-tests}
version=$("$python" -c "from importlib.metadata import version; print(version('transformers'))")
dir="$cache/$version"
if [ ! -f "$dir/.complete" ]; then
  echo "[transformers tests] downloading the source distribution of transformers $version into $dir" >&2
  rm -rf "$dir"
  mkdir -p "$dir"
  [ -f "$cache/.gitignore" ] || echo "*" > "$cache/.gitignore"  # downloads, never committed
  "$python" -m pip download --quiet --no-deps --no-binary :all: "transformers==$version" -d "$dir" 2>&1 \
    | { grep -v "^WARNING: Location" || true; } >&2
  sdist=$(ls "$dir"/transformers-*.tar.gz)
  tar -xzf "$sdist" --no-same-owner -C "$dir" --strip-components=1 "transformers-$version/tests" "transformers-$version/PKG-INFO"
  # The repository's tests/__init__.py is empty and the sdist leaves it out; test_configuration_common.py imports the
  # folder as a package (direct_transformers_import), so it gets its empty file back.
  touch "$dir/tests/__init__.py"
  grep -qx "Version: $version" "$dir/PKG-INFO" || { echo "error: $sdist is not transformers $version" >&2; exit 1; }
  touch "$dir/.complete"
fi
cd "$dir/tests" && pwd
