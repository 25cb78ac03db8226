"""Edges of the routing core (gateway.protocol.routing) seen from outside: real children, real
sockets, calls queued behind ``max_inflight`` at the moments the core changes its mind."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
import trio
from helpers import (
    connect,
    fixture_backend,
    http_json,
    make_config,
    run_gateway,
    text_of,
    wait_status,
)

pytestmark = pytest.mark.system


def call_msg(id: Any, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": tool, "arguments": arguments}}


def load(st: dict[str, Any]) -> int:
    return st["backends"][0]["instances"][0]["inflight"]


async def test_a_cancelled_call_frees_its_slot_for_a_queued_call_of_another_client() -> None:
    """max_inflight = 1, the slot held by a call whose client cancels it and which the child
    never answers (per the spec it should not).  The queued call of another client must not wait
    for it (one client could otherwise hold a shared child by cancelling its own calls): it is
    sent at once.  The abandoned call still counts for attribution, so where that matters the
    child is recycled after cancel_grace all the same."""
    cfg = make_config(fixture_backend("fx", max_inflight=1, cancel_grace=2.0, request_timeout=30.0))
    with trio.fail_after(20):
        async with run_gateway(cfg) as gw, connect(gw.url) as a, connect(gw.url) as b:
            port = gw.bound.admin_port
            await a.send(call_msg("hog", "fx__sleep", {"seconds": 60}))
            await wait_status(port, lambda st: load(st) == 1)
            await b.send(call_msg("queued", "fx__echo", {"message": "through"}))
            await wait_status(port, lambda st: load(st) == 2)  # queued behind the sleep
            await a.notify("notifications/cancelled", {"requestId": "hog"})
            with trio.fail_after(1.5):  # before cancel_grace, far before request_timeout
                r = await b.response("queued", timeout=10)
            assert text_of(r) == "through", r
            st = await http_json(port, "/status")
            assert st["backends"][0]["instances"][0]["recycles"] == 0
            await wait_status(port, lambda st: st["backends"][0]["instances"][0]["recycles"] == 1)
            assert "hog" not in a.responses  # cancelled: no answer


#: A backend that answers its first call only after the gateway queued many more behind it
#: (max_inflight = 1) and after closing its stdin: the gateway's write of the next queued call
#: fails.  Its later generations answer every call ("later").
CLOSER = r'''
import json, os, sys, time
out = sys.stdout.buffer
def send(o):
    out.write(json.dumps(o).encode() + b"\n"); out.flush()
for line in sys.stdin.buffer:
    msg = json.loads(line)
    m, i = msg.get("method"), msg.get("id")
    if m == "initialize":
        send({"jsonrpc": "2.0", "id": i,
              "result": {"protocolVersion": msg["params"]["protocolVersion"],
                         "capabilities": {"tools": {}},
                         "serverInfo": {"name": "closer", "version": "0"}}})
    elif m == "tools/list":
        send({"jsonrpc": "2.0", "id": i,
              "result": {"tools": [{"name": "t", "inputSchema": {"type": "object"}}]}})
    elif m == "tools/call" and os.path.exists(os.environ["MARK"]):
        send({"jsonrpc": "2.0", "id": i,
              "result": {"content": [{"type": "text", "text": "later"}]}})
    elif m == "tools/call":
        open(os.environ["MARK"], "w").close()
        while not os.path.exists(os.environ["GO"]):
            time.sleep(0.01)
        os.close(0)
        send({"jsonrpc": "2.0", "id": i,
              "result": {"content": [{"type": "text", "text": "first"}]}})
        time.sleep(5)
        os._exit(0)
    elif i is not None:
        send({"jsonrpc": "2.0", "id": i, "error": {"code": -32601, "message": "no"}})
'''


async def test_a_thousand_queued_calls_when_the_childs_stdin_breaks(tmp_path: Any) -> None:
    """The child's reply frees the slot, the next queued call's write fails (stdin closed), which
    frees the slot for the next one...: that cascade ran as nested calls, one level per queued
    call, and with ~1000 queued a RecursionError took the whole daemon down.  Every call must be
    answered (retried once on the next child) and the daemon must survive."""
    script = tmp_path / "closer.py"
    script.write_text(CLOSER)
    n = 1100
    backend = (f'[backends.c]\ncommand = {json.dumps(sys.executable)}\n'
               f'args = [{json.dumps(str(script))}]\n'
               f'max_inflight = 1\ndeclare = ["roots"]\nrestart = {{ backoff_initial = 0.05 }}\n'
               f'env = {{ MARK = {json.dumps(str(tmp_path / "mark"))}, GO = '
               f'{json.dumps(str(tmp_path / "go"))} }}\n')
    cfg = make_config(backend, gateway=f"max_inflight_per_connection = {n + 10}")
    with trio.fail_after(60):
        async with run_gateway(cfg) as gw, connect(gw.url) as a:
            for i in range(n):
                await a.send(call_msg(f"c{i}", "c__t", {}))
            await wait_status(gw.bound.admin_port, lambda st: load(st) == n)
            (tmp_path / "go").touch()
            await a.wait_for(lambda: all(f"c{i}" in a.responses for i in range(n)), timeout=50)
            texts = [text_of(a.responses[f"c{i}"]) for i in range(n)]
            assert texts == ["first"] + ["later"] * (n - 1)
            st = await wait_status(gw.bound.admin_port,
                                   lambda st: st["client_requests_in_flight"] == 0)
            assert st["buffered_bytes"] == 0
