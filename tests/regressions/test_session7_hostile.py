"""Hostile checks of the forwarded-call fast paths, the WebSocket upgrade's head timeout and
the remote path's refusals, with real sockets and processes."""

from __future__ import annotations

from typing import Any

import trio
from fixtures.remote_server import RemoteServer
from helpers import connect, make_config, run_gateway, text_of

FAST_RESTART = "{ backoff_initial = 0.05, backoff_max = 0.2, max_restarts = 100, window = 60.0 }"


def remote(port: int) -> str:
    return (f'[backends.ev]\nurl = "http://127.0.0.1:{port}/mcp"\nstart_timeout = 10.0\n'
            f"restart = {FAST_RESTART}\n")


async def test_each_4xx_to_a_call_fails_it_with_its_status_429_retryable() -> None:
    # A remote's 4xx without a JSON-RPC error fails that call -32001 with the status, not
    # retryable, except 429 (the remote says it did not run it: retryable even for tools/call);
    # a 404 to a request carrying the session ends that session (-32004, retryable).
    server = RemoteServer()
    got: dict[int, Any] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        cfg = make_config(remote(server.port))
        with trio.fail_after(30):
            async with run_gateway(cfg) as gw, connect(gw.url) as c:
                for status in (401, 403, 404, 405, 413, 429):
                    assert text_of(await c.call("ev__echo", {"n": 1})) == '{"n": 1}'
                    server.refuse["tools/call"] = [status]
                    got[status] = (await c.call("ev__echo", {"n": status}))["error"]
        nursery.cancel_scope.cancel()
    for status in (401, 403, 405, 413, 429):
        error = got[status]
        assert error["code"] == -32001 and error["data"]["status"] == status, error
        assert error["data"]["retryable"] is (status == 429), error
    assert got[404]["code"] == -32004 and got[404]["data"]["retryable"] is True, got[404]
