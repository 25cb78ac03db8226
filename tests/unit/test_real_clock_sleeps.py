"""The tests wait on events, not on the real clock.

Every ``trio.sleep(...)`` call in ``tests/`` is either virtual time (inside
a function taking ``autojump_clock``, or marked ``# virtual-time: <why>`` in a module on
trio's MockClock) or carries ``# real-clock: <why it cannot be an event>`` on its line or the
line before; there are at most ``MAX_REAL_CLOCK`` of the latter.  The fixture servers
(``tests/fixtures``) are backends, not tests: their sleeps are the tools' behaviour.  The
synchronous tests' ``time.sleep`` polls of other processes are not counted here.
``python -m tests.unit.test_real_clock_sleeps`` lists every sleep and its kind.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
MAX_REAL_CLOCK = 14
CLOCK_PARAMS = {"autojump_clock", "mock_clock"}
REAL = re.compile(r"#\s*real-clock:\s*\S")
VIRTUAL = re.compile(r"#\s*virtual-time:\s*\S")


@dataclass(frozen=True)
class Sleep:
    path: str  # relative to tests/
    line: int
    kind: str  # "virtual" | "real-clock" | "unexplained"


def _is_sleep(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "sleep" and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "trio")


def _sleeps_in(path: Path, root: Path = TESTS) -> list[Sleep]:
    rel = path.relative_to(root).as_posix()
    text = path.read_text()
    lines = text.splitlines()
    on_mock_clock = "MockClock" in text or "autojump_clock" in text
    found: list[Sleep] = []

    def visit(node: ast.AST, virtual: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.args + node.args.kwonlyargs + node.args.posonlyargs
            virtual = virtual or any(a.arg in CLOCK_PARAMS for a in args)
        if _is_sleep(node):
            n = node.lineno  # type: ignore[attr-defined]
            near = lines[n - 1] + "\n" + (lines[n - 2] if n >= 2 else "")
            if virtual or (on_mock_clock and VIRTUAL.search(near)):
                kind = "virtual"
            elif REAL.search(near):
                kind = "real-clock"
            else:
                kind = "unexplained"
            found.append(Sleep(rel, n, kind))
        for child in ast.iter_child_nodes(node):
            visit(child, virtual)

    visit(ast.parse(text), False)
    return found


def all_sleeps() -> list[Sleep]:
    return [s for path in sorted(TESTS.rglob("*.py")) if "fixtures" not in path.parts
            for s in _sleeps_in(path)]


def test_every_sleep_is_virtual_or_says_why_it_cannot_be_an_event() -> None:
    unexplained = [f"{s.path}:{s.line}" for s in all_sleeps() if s.kind == "unexplained"]
    assert not unexplained, ("wait on an event (Running.events, Client.wait_for), or say "
                             f"'# real-clock: <why>': {unexplained}")


def test_at_most_the_allowed_real_clock_sleeps() -> None:
    real = [f"{s.path}:{s.line}" for s in all_sleeps() if s.kind == "real-clock"]
    assert len(real) <= MAX_REAL_CLOCK, real


def test_the_count_sees_every_sleep_call() -> None:
    # the AST walk finds exactly the sleeps a text search does (no alias slips past it)
    for path in TESTS.rglob("*.py"):
        if "fixtures" in path.parts or path == Path(__file__):
            continue
        text = path.read_text()
        assert "import sleep" not in text and "= trio.sleep\n" not in text, path
        textual = len(re.findall(r"\btrio\.sleep\(", text))
        assert textual == len(_sleeps_in(path)), path


def test_a_bare_sleep_is_caught_and_a_commented_one_counted(tmp_path: Path) -> None:
    sample = tmp_path / "test_sample.py"
    sample.write_text("import trio\n\nasync def f():\n    await trio.sleep(1)\n"
                      "    # real-clock: a process outside\n    await trio.sleep(2)\n"
                      "\nasync def test_g(autojump_clock):\n    await trio.sleep(3)\n")
    kinds = [s.kind for s in _sleeps_in(sample, tmp_path)]
    assert kinds == ["unexplained", "real-clock", "virtual"]


if __name__ == "__main__":
    for s in all_sleeps():
        print(f"{s.kind:12} {s.path}:{s.line}")
