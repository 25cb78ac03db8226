#!/usr/bin/env python3
"""Draw bench/growth.py's curves from its growth.json: one SVG per curve, log-log axes.

    .deps/bench/venv-plot/bin/python bench/growth_plot.py bench/results/growth.json bench/results

Needs matplotlib (``scripts/setup-bench`` installs it into ``.deps/bench/venv-plot``, apart from
the gateway's own .venv).  Each panel draws a dotted "linear" guide through its first point, so a
curve that bends above the guide grows faster than linearly; the subtitle names the backend used.
Prints the files written.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "growth", "font.size": 9})


def _guide(ax: Any, xs: list[float], ys: list[float]) -> None:
    """A dotted line through the first point with slope 1 on log-log axes (linear growth)."""
    if xs and ys and ys[0] > 0:
        ax.plot([xs[0], xs[-1]], [ys[0], ys[0] * xs[-1] / xs[0]], ":", color="grey", lw=0.8,
                label="slope 1 (linear) from the first point")


def _panel(ax: Any, xs: list[float], series: dict[str, list[float]], xlabel: str,
           ylabel: str, guide: str | None = None) -> None:
    for label, ys in series.items():
        ax.plot(xs, ys, "o-", ms=3.5, label=label)
    if guide is not None:
        _guide(ax, xs, series[guide])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", lw=0.3, alpha=0.5)
    ax.legend(fontsize=7)


def _figure(title: str, subtitle: str, ncols: int = 2) -> tuple[Any, Any]:
    fig, axes = plt.subplots(1, ncols, figsize=(4.6 * ncols, 3.6))
    fig.suptitle(title, fontsize=10)
    fig.text(0.5, 0.005, textwrap.fill(subtitle, 70 * ncols), ha="center", fontsize=7,
             color="dimgrey")
    return fig, axes


def _save(fig: Any, out_dir: str, name: str, written: list[str]) -> None:
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path = os.path.join(out_dir, name)
    fig.savefig(path, metadata={"Date": None})
    plt.close(fig)
    written.append(path)


def draw(doc: dict[str, Any], out_dir: str) -> list[str]:
    meta = doc["meta"]
    stamp = (f"{meta['mode']} run {meta['date']}, commit {meta['commit']}, load average "
             f"{meta['load_start'][0]}")
    backend = meta["backend"]
    written: list[str] = []
    if rows := doc.get("catalog"):
        fig, (a, b, c) = _figure("tools/list, gateway memory and start against catalog size",
                                 f"{backend}; 1 → {rows[-1]['backends']} backends; {stamp}",
                                 ncols=3)
        xs = [r["tools"] for r in rows]
        _panel(a, xs, {"first page p50": [r["p50_ms"] for r in rows],
                       "first page p99": [r["p99_ms"] for r in rows],
                       "all pages (one walk)": [r["walk_ms"] for r in rows]},
               "tools in the merged catalog", "ms", guide="all pages (one walk)")
        _panel(b, xs, {"gateway VmRSS": [r["rss_mib"] for r in rows]},
               "tools in the merged catalog", "MiB", guide="gateway VmRSS")
        _panel(c, xs, {"start to every backend RUNNING": [r["start_s"] for r in rows]},
               "tools in the merged catalog (over 1 → 100 backends)", "s",
               guide="start to every backend RUNNING")
        _save(fig, out_dir, "growth-catalog.svg", written)
    for key, what, title in (("ws", "connections", "WebSocket connections (idle, initialised)"),
                             ("http", "sessions", "legacy HTTP sessions (idle)")):
        if rows := doc.get(key):
            fig, (a, b) = _figure(f"call latency and gateway memory against {title}",
                                  f"one client's sequential echo calls; {backend}; {stamp}")
            xs = [r[what] for r in rows]
            _panel(a, xs, {"probe call p50": [r["p50_ms"] for r in rows],
                           "probe call p99": [r["p99_ms"] for r in rows]}, what, "ms")
            _panel(b, xs, {"gateway VmRSS": [r["rss_mib"] for r in rows]}, what, "MiB",
                   guide="gateway VmRSS")
            _save(fig, out_dir, f"growth-{key}.svg", written)
    if view := doc.get("view"):
        fig, (a, b) = _figure("per-caller tools view build (Policy.view, in-process)",
                              f"pure micro-benchmark, per-caller rules; {stamp}")
        for ax, key, what, fixed in ((a, "by_rules", "policy rules", "tools"),
                                     (b, "by_tools", "tools", "rules")):
            rows = view[key]
            field = "rules" if key == "by_rules" else "tools"
            _panel(ax, [r[field] for r in rows],
                   {"first caller (cold)": [r["cold_ms"] for r in rows],
                    "next caller": [r["warm_ms"] for r in rows]},
                   f"{what} (at {rows[0][fixed]} {fixed})", "ms", guide="first caller (cold)")
        _save(fig, out_dir, "growth-view.svg", written)
    if rows := doc.get("restart"):
        fig, ax = _figure("gateway start to ready against backends starting at once",
                          f"{backend}; {stamp}", ncols=1)
        _panel(ax, [r["backends"] for r in rows],
               {"/readyz 200": [r["ready_s"] for r in rows],
                "every backend RUNNING": [r["running_s"] for r in rows]},
               "backends", "s", guide="every backend RUNNING")
        _save(fig, out_dir, "growth-restart.svg", written)
    return written


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(sys.argv[1]) as f:
        doc = json.load(f)
    written = draw(doc, sys.argv[2])
    print("plots: " + ", ".join(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
