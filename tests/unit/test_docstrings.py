"""Docstrings and comments under ``gateway/`` say what is true now, briefly (STYLE §12).

* A module docstring is a theory of operation in a few lines: at most ``MAX_MODULE_LINES``.
* No comment or docstring carries an issue number or a benchmark figure: those belong in
  commits and ``bench/``.

Run ``python -m tests.unit.test_docstrings`` to list every finding.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "gateway"
MAX_MODULE_LINES = 15
FORBIDDEN = re.compile(r"\bissue \d+\b|#\d{1,3}\b|\d+ ?µs\b|calls/s", re.IGNORECASE)

# Modules allowed over the limits (none today: add one only with the reason on its line).
EXEMPT: frozenset[str] = frozenset()


def modules() -> list[Path]:
    return sorted(
        p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).as_posix() not in EXEMPT
    )


def texts(path: Path) -> Iterator[tuple[int, str]]:
    """Every docstring and comment in the file, with the line it starts on."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(
            node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
        ):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield node.body[0].lineno, doc
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string


def long_module_docstrings() -> list[str]:
    found = []
    for path in modules():
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
        if doc is not None and len(doc.strip().splitlines()) > MAX_MODULE_LINES:
            lines = len(doc.strip().splitlines())
            found.append(f"{path.relative_to(PACKAGE)}: module docstring of {lines} lines")
    return found


def forbidden_mentions() -> list[str]:
    found = []
    for path in modules():
        for lineno, text in texts(path):
            for match in FORBIDDEN.finditer(text):
                line = lineno + text[: match.start()].count("\n")
                found.append(f"{path.relative_to(PACKAGE)}:{line}: {match.group()!r}")
    return found


def test_module_docstrings_are_short() -> None:
    assert long_module_docstrings() == []


def test_no_issue_numbers_or_benchmark_figures() -> None:
    assert forbidden_mentions() == []


def test_exemptions_exist() -> None:
    missing = [name for name in EXEMPT if not (PACKAGE / name).exists()]
    if missing:
        pytest.fail(f"exempted modules no longer exist, drop them from EXEMPT: {missing}")


if __name__ == "__main__":
    for finding in long_module_docstrings() + forbidden_mentions():
        print(finding)
