"""bench/growth.py at its smallest point of every curve (``--smoke``), run as the bench runs:
real daemons of this tree, lean backends, the lean WebSocket and HTTP clients; the table and
the JSON it writes carry every curve with plausible numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

pytestmark = pytest.mark.system


def test_growth_smoke_run_writes_every_curve(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(Path(ROOT) / "bench" / "growth.py"), "--smoke",
                           "--no-plot", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads((tmp_path / "growth.json").read_text())
    (catalog,) = doc["catalog"]
    assert catalog["tools"] == 100 and catalog["pages"] == 1 and catalog["rss_mib"] > 5
    assert 0 < catalog["p50_ms"] <= catalog["p99_ms"]
    (ws,) = doc["ws"]
    assert ws["alive"] == ws["connections"] == 10 and ws["gateway_counts"]["websocket"] == 10
    (http,) = doc["http"]
    assert http["sessions"] == 10 and http["gateway_counts"]["http"] == 10
    assert doc["view"]["by_rules"][0]["visible"] == 100
    (restart,) = doc["restart"]
    assert 0 < restart["ready_s"] <= restart["running_s"]
    table = (tmp_path / "growth.md").read_text()
    for heading in ("catalog size", "WebSocket connections", "Legacy HTTP sessions",
                    "view build", "backends starting at once", "Shapes"):
        assert heading in table
