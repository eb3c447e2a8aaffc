"""Registers the pytest markers of transformers' own test files (`@mark.flash_attn_test`, `@slow`'s ...), read from the
folder in MEMORYFORMER_TRANSFORMERS_TESTS and from `transformers.testing_utils`, so that `--strict-markers`
(pyproject.toml) accepts them: transformers registers them in its repository's conftest.py, which the source
distribution does not ship."""

from __future__ import annotations

import os
import re
from pathlib import Path

MARK = re.compile(r"\bmark\.([A-Za-z_]\w*)")


def pytest_configure(config) -> None:
    folder = os.environ.get("MEMORYFORMER_TRANSFORMERS_TESTS")
    if not folder:
        return
    import transformers.testing_utils

    sources = [*Path(folder).glob("test_*.py"), Path(transformers.testing_utils.__file__)]
    names = {name for path in sources for name in MARK.findall(path.read_text(encoding="utf-8"))}
    known = {line.split(":")[0].split("(")[0].strip() for line in config.getini("markers")}
    for name in sorted(names - known):
        config.addinivalue_line("markers", f"{name}: a marker of transformers' own tests")
