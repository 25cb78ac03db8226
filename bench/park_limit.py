"""An abandoned bridged call and the next caller's prompt, with server-everything.

A modern (2026-07-28) client calls server-everything's eliciting tool over HTTP, gets its
``InputRequiredResult`` and never retries; ``--after`` seconds later another modern client calls
the same tool.  Reports when the second client got its answer, counted from the first call's
``InputRequiredResult`` (its park start), and what it was: its own prompt (``input_required``)
or a refusal (the tool's result after the gateway declined the child's request).

Two setups: ``shared`` (one instance, ``gateway.shared_park_limit`` as configured, default 30 s;
expect the prompt within the limit + 1 s), and ``example``: ``config/gateway.toml`` as shipped
(server-everything ``affine`` with two instances; expect it at once).

    .venv/bin/python bench/park_limit.py [--setup shared|example|both] [--after 5] [--limit S]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway import config, service  # noqa: E402 - imported once sys.path holds the repo

EVERYTHING = (ROOT / ".deps" / "node" / "node_modules" / "@modelcontextprotocol"
              / "server-everything" / "dist" / "index.js")
TOOL = "everything__trigger-elicitation-request"
V = "2026-07-28"


def shared_config(limit: float | None) -> config.GatewayConfig:
    gateway = "" if limit is None else f"shared_park_limit = {limit}"
    return config.load(f"""
[gateway]
drain_delay = 0.0
drain_grace = 1.0
{gateway}
[listen]
websocket = ""
http = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
[backends.everything]
command = "node"
args = [{json.dumps(str(EVERYTHING))}, "stdio"]
start_timeout = 30.0
sharing = "shared"
instances = 1
""", base_dir=str(ROOT))


def example_config() -> config.GatewayConfig:
    path = ROOT / "config" / "gateway.toml"
    text = re.sub(r'"127\.0\.0\.1:\d+"', '"127.0.0.1:0"', path.read_text())
    text = re.sub(r"(?m)^drain_(delay|grace) = [0-9.]+", r"drain_\1 = 0.5", text)  # a quick exit
    return config.load(text, base_dir=str(path.parent))


async def call(c: httpx.AsyncClient, url: str, id: int) -> dict[str, Any]:
    headers = {"accept": "application/json, text/event-stream", "content-type": "application/json",
               "mcp-protocol-version": V, "mcp-method": "tools/call", "mcp-name": TOOL}
    meta = {"io.modelcontextprotocol/protocolVersion": V,
            "io.modelcontextprotocol/clientCapabilities": {"elicitation": {"form": {}}}}
    body = {"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": TOOL, "arguments": {}, "_meta": meta}}
    r = await c.post(url, headers=headers, json=body)
    if not r.headers.get("content-type", "").startswith("text/event-stream"):
        return r.json()
    # a long wait is answered as an SSE stream (keep-alive comments first): the last data event
    events = [line[5:].strip() for line in r.text.splitlines() if line.startswith("data:")]
    return json.loads(events[-1])


async def measure(name: str, cfg: config.GatewayConfig, after: float) -> None:
    control = service.Control()
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(lambda task_status: service.run(cfg, control=control,
                                                                    task_status=task_status))
        url = f"http://127.0.0.1:{bound.http_port}/mcp"
        try:
            async with httpx.AsyncClient(timeout=120) as c:
                first = await call(c, url, 1)
                parked = time.monotonic()
                assert first["result"]["resultType"] == "input_required", first
                await trio.sleep(after)
                started = time.monotonic()
                second = await call(c, url, 2)
                got = time.monotonic()
            result = second.get("result") or {}
            if result.get("resultType") == "input_required":
                what = "its prompt (input_required)"
            else:
                what = f"no prompt: {json.dumps(second)[:160]}"
            limit = getattr(cfg.gateway, "shared_park_limit", "-")  # (a tree without it: "-")
            print(f"{name}: second call {after:g}s after the first parked; answered "
                  f"{got - parked:.2f}s after the park ({got - started:.2f}s after it was sent), "
                  f"shared_park_limit {limit}s: {what}", flush=True)
        finally:
            control.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setup", choices=["shared", "example", "both"], default="both")
    parser.add_argument("--after", type=float, default=5.0)
    parser.add_argument("--limit", type=float, default=None,
                        help="gateway.shared_park_limit for the shared setup "
                             "(default: the default)")
    args = parser.parse_args()
    if args.setup in ("shared", "both"):
        trio.run(measure, "shared, 1 instance", shared_config(args.limit), args.after)
    if args.setup in ("example", "both"):
        trio.run(measure, "config/gateway.toml (affine, 2 instances)", example_config(), args.after)


if __name__ == "__main__":
    main()
