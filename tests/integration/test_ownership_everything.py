"""Issue 3 with a real third-party server: server-everything's eliciting tool, 8 clients at once."""

from __future__ import annotations

import json
import secrets
from typing import Any

import pytest
import trio
from helpers import EVERYTHING, connect, make_config, run_gateway

pytestmark = pytest.mark.system


def everything_backend(**extra: Any) -> str:
    lines = ["[backends.everything]", 'command = "node"',
             f"args = [{json.dumps(EVERYTHING)}, \"stdio\"]", "start_timeout = 30.0"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("mode", ["affine", "per-session"])
async def test_8_clients_elicit_through_server_everything(mode: str) -> None:
    extra: dict[str, Any] = {"sharing": mode}
    if mode == "affine":
        extra["instances"] = 2
    cfg = make_config(everything_backend(**extra))
    results: dict[str, tuple[int, str]] = {}

    async def one(i: int, url: str) -> None:
        nonce = f"user{i}-{secrets.token_hex(4)}"
        async with connect(url, capabilities={"elicitation": {"form": {}}}) as c:
            async with trio.open_nursery() as nursery:
                async def answer() -> None:
                    req = await c.wait_for(lambda: c.requests and c.requests[0], timeout=60)
                    assert req["method"] == "elicitation/create"
                    await c.send({"jsonrpc": "2.0", "id": req["id"],
                                  "result": {"action": "accept", "content": {"name": nonce}}})
                nursery.start_soon(answer)
                r = await c.call("everything__trigger-elicitation-request", {}, timeout=60)
            text = json.dumps(r["result"])
            results[nonce] = (len(c.requests), text)

    with trio.fail_after(120):
        async with run_gateway(cfg) as gw, trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(one, i, gw.url)
    assert len(results) == 8
    for nonce, (prompts, text) in results.items():
        assert prompts == 1  # each client saw exactly its own prompt
        assert nonce in text  # and got the result of its own answer
        others = [n for n in results if n != nonce and n in text]
        assert others == []
