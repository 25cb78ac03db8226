"""Layering (ARCHITECTURE §2, STYLE item 1).

* The sans-IO layer (``gateway/protocol/``) and the pure modules never load trio (checked by
  importing them in a fresh interpreter).
* ``gateway/protocol/`` does no I/O at all: it imports none of ``trio``, ``socket``,
  ``subprocess``, ``asyncio``, ``select``, ``selectors``, and calls none of ``open()``,
  ``os.open``, ``os.read``, ``os.write`` (checked on the source).
* ``gateway/transports/`` is the only code touching sockets: no module elsewhere imports
  ``socket`` or uses ``trio.socket`` (checked on the source; no exceptions).
* No import cycle anywhere in ``gateway/``, imports under ``if TYPE_CHECKING:`` and inside
  functions included, and imports point down the layers: transports → core → backend →
  protocol (the hub and the service compose them from above).  Checked on the source with
  ``ast``; run ``python -m tests.unit.test_layering`` to print the import graph's cycles.
"""

from __future__ import annotations

import ast
import json
import os
import pkgutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import gateway.protocol

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PURE = ["gateway.config", "gateway.errors", "gateway.events", "gateway.limits", "gateway.procfs",
        "gateway.status"]
PACKAGE = Path(ROOT) / "gateway"
#: Modules the sans-IO layer must not import (nor any submodule of them).
PROTOCOL_BANNED_MODULES = frozenset({"trio", "socket", "subprocess", "asyncio", "select",
                                     "selectors"})
#: ``os`` functions that do I/O on file descriptors, banned in the sans-IO layer with ``open()``.
PROTOCOL_BANNED_OS_CALLS = frozenset({"open", "read", "write"})
TRANSPORTS = PACKAGE / "transports"

# Runs in a fresh interpreter: imports the modules one by one and reports the first one that
# pulled in trio (or trio_websocket, …), and every trio module loaded in the end.
PROBE = """
import importlib, json, sys
def trio_loaded():
    return sorted(m for m in sys.modules if m.split(".")[0] == "trio" or m.startswith("trio_"))
culprit = None
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
    if culprit is None and trio_loaded():
        culprit = name
print(json.dumps({"culprit": culprit, "loaded": trio_loaded()}))
"""


def protocol_modules() -> list[str]:
    return sorted(
        m.name for m in pkgutil.walk_packages(gateway.protocol.__path__, "gateway.protocol.")
    )


def test_protocol_has_the_expected_modules() -> None:
    mods = protocol_modules()
    for name in ("jsonrpc", "framing", "catalog", "supervision", "mcp", "policy"):
        assert f"gateway.protocol.{name}" in mods


def test_pure_modules_do_not_import_trio() -> None:
    modules = ["gateway.protocol", *protocol_modules(), *PURE]
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(modules)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report == {"culprit": None, "loaded": []}, f"trio imported via {report['culprit']}"


# ---- source checks ------------------------------------------------------------------------


def _imports(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """``(line, dotted name)`` of every module imported, and of every name imported from one."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            yield node.lineno, node.module
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def _top(name: str) -> str:
    return name.split(".")[0]


def io_violations(source: str) -> list[str]:
    """What in ``source`` (a module of ``gateway/protocol/``) imports or does I/O."""
    tree = ast.parse(source)
    found = [f"line {line}: imports {name}" for line, name in _imports(tree)
             if _top(name) in PROTOCOL_BANNED_MODULES or _top(name).startswith("trio_")
             or name in {f"os.{f}" for f in PROTOCOL_BANNED_OS_CALLS}]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "open":
            found.append(f"line {node.lineno}: calls open()")
        elif (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
              and func.value.id in ("os", "io") and func.attr in PROTOCOL_BANNED_OS_CALLS):
            found.append(f"line {node.lineno}: calls {func.value.id}.{func.attr}()")
    return found


def socket_violations(source: str) -> list[str]:
    """Where ``source`` (a module outside ``gateway/transports/``) touches the socket module."""
    tree = ast.parse(source)
    found = [f"line {line}: imports {name}" for line, name in _imports(tree)
             if _top(name) == "socket" or name == "trio.socket"]
    found += [f"line {node.lineno}: uses trio.socket" for node in ast.walk(tree)
              if isinstance(node, ast.Attribute) and node.attr == "socket"
              and isinstance(node.value, ast.Name) and node.value.id == "trio"]
    return found


def _sources(under: Path) -> list[Path]:
    return sorted(under.rglob("*.py"))


@pytest.mark.parametrize("path", _sources(PACKAGE / "protocol"), ids=lambda p: p.name)
def test_protocol_does_no_io(path: Path) -> None:
    assert io_violations(path.read_text()) == []


@pytest.mark.parametrize("path", [p for p in _sources(PACKAGE) if TRANSPORTS not in p.parents],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_transports_touch_sockets(path: Path) -> None:
    assert socket_violations(path.read_text()) == []


@pytest.mark.parametrize("source", [
    "import socket", "import trio", "from trio import socket", "import trio.lowlevel",
    "import subprocess", "import asyncio", "import select", "import selectors",
    "from select import epoll", "import trio_websocket", "from os import read",
    "open('/proc/self/stat')", "import os\nos.read(0, 1)", "import os\nos.write(1, b'')",
    "import os\nos.open('x', 0)", "import io\nio.open('x')",
])
def test_the_io_check_catches(source: str) -> None:
    assert io_violations(source)


@pytest.mark.parametrize("source", [
    "import socket", "from socket import AF_UNIX", "import socket as s", "from trio import socket",
    "import trio\ntrio.socket.socket()", "import trio.socket",
])
def test_the_socket_check_catches(source: str) -> None:
    assert socket_violations(source)


def test_the_checks_pass_plain_code() -> None:
    source = "import os, re\nfrom msgspec import Raw\nos.path.join('a', 'b')\nx = trio_like = 1\n"
    assert io_violations(source) == [] and socket_violations(source) == []


# ---- the import graph ---------------------------------------------------------------------


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(module: str, is_package: bool, tree: ast.AST) -> Iterator[str]:
    """Every dotted name an import statement anywhere in ``tree`` names (relative ones resolved),
    and for ``from X import a`` both ``X`` and ``X.a``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            head = node.module or ""
            if node.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                head = ".".join([*parts, *([node.module] if node.module else [])])
            yield head
            yield from (f"{head}.{alias.name}" for alias in node.names)


def import_graph(sources: dict[str, str],
                 packages: frozenset[str] = frozenset()) -> dict[str, set[str]]:
    """``module -> modules of the same tree it imports`` from their source text."""
    graph: dict[str, set[str]] = {m: set() for m in sources}
    for module, source in sources.items():
        for name in imported_names(module, module in packages, ast.parse(source)):
            while name and name not in sources:
                name = name.rpartition(".")[0]
            # a package's ``__init__`` is loaded by importing any module under it: not an edge
            if name and name != module and not module.startswith(name + "."):
                graph[module].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(found)


def gateway_graph() -> dict[str, set[str]]:
    paths = _sources(PACKAGE)
    sources = {module_name(p): p.read_text() for p in paths}
    packages = frozenset(module_name(p) for p in paths if p.name == "__init__.py")
    return import_graph(sources, packages)


def test_no_import_cycle() -> None:
    found = cycles(gateway_graph())
    assert found == [], "import cycles (TYPE_CHECKING imports included):\n" + "\n".join(
        f"  cycle of {len(c)}: {', '.join(c)}" for c in found)


#: ``(importer prefix, imported prefix)``: a layer that must not import another (imports point
#: down: transports → core → backend → protocol; the hub and the service sit above them all).
FORBIDDEN = [
    *((f"gateway.{low}", f"gateway.{high}") for low in ("protocol", "backend", "core")
      for high in ("hub", "service", "cli", "transports")),
    *(("gateway.protocol", f"gateway.{high}") for high in ("core", "backend", "auth", "ops")),
    ("gateway.backend", "gateway.core"),
]


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{module} imports {target}" for module, targets in graph.items()
                  for target in targets for low, high in FORBIDDEN
                  if _within(module, low) and _within(target, high))


def test_imports_point_down() -> None:
    assert layer_violations(gateway_graph()) == []


def test_the_cycle_check_catches() -> None:
    sources = {
        "g": "", "g.a": "from g import b", "g.b": "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from g.c import C", "g.c": "def f():\n    import g.a",
        "g.d": "from . import a", "g.sub": "", "g.sub.e": "from ..d import x",
    }
    graph = import_graph(sources, frozenset({"g", "g.sub"}))
    assert graph["g.d"] == {"g.a"} and graph["g.sub.e"] == {"g.d"}
    assert cycles(graph) == [["g.a", "g.b", "g.c"]]
    assert cycles(import_graph({"g.x": "import g.y", "g.y": "import g.z", "g.z": ""})) == []


def test_the_layer_check_catches() -> None:
    graph = {"gateway.backend.pool": {"gateway.core.session"},
             "gateway.core.handlers": {"gateway.hub"},
             "gateway.core.serving": {"gateway.backend.pool"}}
    assert layer_violations(graph) == ["gateway.backend.pool imports gateway.core.session",
                                       "gateway.core.handlers imports gateway.hub"]


if __name__ == "__main__":  # the import graph's cycles, as the test sees them
    graph = gateway_graph()
    for component in cycles(graph):
        print(f"cycle of {len(component)}: {', '.join(component)}")
    for violation in layer_violations(graph):
        print(violation)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports, "
          f"{len(cycles(graph))} cycles, {len(layer_violations(graph))} upward imports")
