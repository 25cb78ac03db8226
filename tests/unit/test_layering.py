"""The sans-IO layer never imports trio (ARCHITECTURE §2, STYLE item 1)."""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys

import gateway.protocol

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PURE = ["gateway.config", "gateway.errors", "gateway.events", "gateway.limits", "gateway.status"]

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
