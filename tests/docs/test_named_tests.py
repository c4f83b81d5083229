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


def defined_tests() -> dict[str, set[str]]:
    """{test file name: the functions it defines}, over every test module under tests/."""
    defined: dict[str, set[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        names = re.findall(r"^\s*(?:async )?def (\w+)\(", path.read_text(), re.M)
        defined.setdefault(path.name, set()).update(names)
    return defined


@pytest.mark.parametrize("doc", DOCS)
def test_every_test_a_doc_names_exists(doc: str) -> None:
    named, defined = named_tests(doc), defined_tests()
    assert len(named) > 100, "the pattern no longer finds the doc's test names"
    missing = [
        f"docs/{doc}:{line}: {name}::{test}" + ("" if name in defined else f" ({name} does not exist)")
        for name, test, line in named
        if test not in defined.get(name, set())
    ]
    assert not missing, "named in the docs but not defined:\n" + "\n".join(missing)
