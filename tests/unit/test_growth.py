"""bench/growth.py's pure parts: the plans' points, the shape verdict, the lean backend's
answers, the view micro-benchmark's set-up against the pure policy decision, and the table."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
from helpers import load_bench

from gateway.protocol import policy as pure

growth = load_bench("growth")
lean = load_bench("lean_server")


def _spread(xs: tuple[int, ...], low: int, high: int) -> None:
    """At least six points from ``low`` to ``high``, none more than ~4x the one before."""
    assert len(xs) >= 6
    assert xs[0] == low and xs[-1] == high
    assert all(b > a and b <= 4.2 * a for a, b in itertools.pairwise(xs))


def test_the_full_plan_spans_the_ranges_it_claims() -> None:
    plan = growth.FULL
    _spread(tuple(t for t, _ in plan.catalog), 100, 20_000)
    _spread(tuple(b for _, b in plan.catalog), 1, 100)
    _spread(plan.ws, 10, 4000)
    _spread(plan.http, 10, 1024)
    _spread(plan.view_rules, 1, 1000)
    _spread(plan.view_tools, 100, 20_000)
    _spread(plan.restart, 1, 50)


def test_shape_tells_flat_linear_and_worse_apart() -> None:
    xs = [1, 10, 100, 1000]
    assert growth.shape(xs, [5.0, 5.5, 5.2, 6.0]).startswith("flat")
    assert growth.shape(xs, [1.0, 10.0, 100.0, 1000.0]).startswith("linear or less")
    assert growth.shape(xs, [1.0, 3.0, 20.0, 150.0]).startswith("linear or less")
    assert growth.shape(xs, [1.0, 100.0, 10_000.0, 1_000_000.0]).startswith("worse than linear")
    # a step between small points (fixed costs, caches) but linear at scale: judged at scale
    assert growth.shape([1, 10, 100, 1000], [1.0, 30.0, 300.0, 3000.0]).startswith(
        "linear or less (k top=1.00")
    quadratic_at_scale = [x + x * x / 100 for x in (1.0, 10.0, 100.0, 1000.0)]
    assert growth.shape([1, 10, 100, 1000], quadratic_at_scale).startswith("worse than")
    assert math.isclose(growth.exponent(xs, [2.0, 200.0, 20_000.0, 2_000_000.0]), 2.0)


def test_lean_backends_spread_the_tools() -> None:
    assert growth.lean_backends(20_000, 100) == {f"b{i}": 200 for i in range(100)}
    assert list(growth.lean_backends(7, 3).values()) == [3, 2, 2]


def test_the_lean_server_pages_its_tools_and_echoes() -> None:
    names: list[str] = []
    cursor = None
    for i in range(10):  # bounded: 5 tools at 2 per page are 3 pages
        params = {} if cursor is None else {"cursor": cursor}
        reply = lean.answer({"jsonrpc": "2.0", "id": i, "method": "tools/list",
                             "params": params}, 5, 2)
        names += [t["name"] for t in reply["result"]["tools"]]
        cursor = reply["result"].get("nextCursor")
        if cursor is None:
            break
    assert names == ["t0", "t1", "t2", "t3", "t4"]
    call = lean.answer({"jsonrpc": "2.0", "id": 9, "method": "tools/call",
                        "params": {"name": "t3", "arguments": {"message": "m"}}}, 5, 2)
    assert call["result"]["content"][0]["text"] == "m"
    assert lean.answer({"jsonrpc": "2.0", "id": 1, "method": "nope"}, 5, 2)["error"]["code"] == (
        -32601)
    assert lean.answer({"jsonrpc": "2.0", "method": "notifications/initialized"}, 5, 2) is None


def test_the_view_benchmark_builds_what_the_pure_policy_decides() -> None:
    catalog, policy = growth.view_setup(300, 20)
    caller = pure.Caller("ws", "user-0")
    view = policy.view(catalog, "tools", caller)
    expected = [t for t in catalog.tools
                if pure.visible(t["name"], policy.rules, "allow", sensitive=False, caller=caller,
                                kind="tool")]
    assert view == expected
    assert 0 < len(view) < 300  # the rules hide something from this caller
    row = growth.view_point(300, 20, 1)
    assert row["visible"] == len(view) and row["cold_ms"] > 0 and row["warm_ms"] > 0


def test_the_table_names_every_curve_and_its_shape() -> None:
    load = [0.5, 0.4, 0.3]
    doc = {
        "meta": {"mode": "smoke", "date": "d", "commit": "c", "machine": "m", "python": "3",
                 "cpus": 2, "load_start": load, "load_end": load, "command": "x",
                 "fd_note": "f", "backend": "b"},
        "catalog": [{"tools": t, "backends": 1, "p50_ms": 0.2, "p99_ms": 0.3, "walk_ms": t / 100,
                     "pages": t // 100, "rss_mib": 40.0, "start_s": 0.5, "load": load}
                    for t in (100, 1000)],
        "restart": [{"backends": n, "ready_s": 0.4 * n, "running_s": 0.4 * n, "load": load}
                    for n in (1, 10)],
    }
    doc["extra"] = {"gateway_open_files_limit": "soft 20000, hard 20000"}
    doc["shapes"] = growth.shapes_of(doc)
    text = growth.markdown(doc)
    assert "| 1000 | 1 | 0.2 | 0.3 | 10.0 (10) | 1.000 | 40.0 | 0.5 | 0.5 / 0.4 / 0.3 |" in text
    assert doc["shapes"]["gateway VmRSS vs tools"].startswith("flat")
    assert doc["shapes"]["start to all RUNNING vs backends"].startswith("linear or less")
    json.dumps(doc)


def test_redraw_writes_the_table_of_a_recorded_run(tmp_path: Path) -> None:
    load = [1.0, 1.0, 1.0]
    doc = {
        "meta": {"mode": "full", "date": "d", "commit": "c", "machine": "m", "python": "3",
                 "cpus": 2, "load_start": load, "load_end": load, "command": "x",
                 "fd_note": "f", "backend": "b"},
        "ws": [{"connections": n, "alive": n, "p50_ms": 0.3, "p99_ms": 2.0, "rss_mib": 36 + n / 64,
                "rss_per_conn_kib": 15.0, "gateway_counts": {"websocket": n}, "load": load}
               for n in (10, 100, 1000)],
        "extra": {"gateway_open_files_limit": "soft 4096, hard 4096"},
    }
    (tmp_path / "run.json").write_text(json.dumps(doc))
    assert growth.main(["--redraw", str(tmp_path / "run.json"), "--no-plot",
                        "--out", str(tmp_path / "out")]) == 0
    table = (tmp_path / "out" / "growth.md").read_text()
    assert "| 1000 | 1000 | 0.3 | 2.0 |" in table and "soft 4096, hard 4096" in table
    assert "probe call p99 vs connections | flat" in table


@pytest.mark.parametrize("argv", [["--only", "nope"]])
def test_unknown_curves_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        growth.main(argv)
