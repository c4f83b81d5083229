"""The tests that docs/invariants.md and docs/reliability.md name exist: each row says which test
fails when its guarantee breaks, so a renamed or moved test must take the row with it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("invariants.md", "reliability.md")
# `test_x.py::name`, `tests/a/test_x.py::name`, or `::name` (same file as the last one named)
REF = re.compile(r"`((?:tests/[\w/]+/)?(test_\w+\.py))?::(\w+)(?:\[[^`\]]*\])?`")


def named_tests(doc: str) -> list[tuple[str, str, int]]:
    """(test file name, test name, line) for every test the doc names, in order."""
    found, last = [], None
    for number, line in enumerate((ROOT / "docs" / doc).read_text().splitlines(), 1):
        for m in REF.finditer(line):
            last = m.group(2) or last
            if last is None:
                raise AssertionError(f"docs/{doc}:{number}: `::{m.group(3)}` before any test file is named")
            found.append((last, m.group(3), number))
    return found


@pytest.mark.parametrize("doc", DOCS)
def test_every_test_a_doc_names_exists(doc: str) -> None:
    files: dict[str, list[Path]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        files.setdefault(path.name, []).append(path)
    missing = []
    for name, test, line in named_tests(doc):
        texts = [p.read_text() for p in files.get(name, [])]
        if not any(re.search(rf"^\s*(async )?def {test}\(", t, re.M) for t in texts):
            missing.append(f"docs/{doc}:{line}: {name}::{test}" + ("" if texts else f" ({name} does not exist)"))
    assert len(named_tests(doc)) > 100, "the pattern no longer finds the doc's test names"
    assert not missing, "named in the docs but not defined:\n" + "\n".join(missing)
