from __future__ import annotations

import pytest
import trio
from helpers import connect, fixture_backend, make_config, run_gateway, text_of

pytestmark = pytest.mark.system


async def test_echo_through_gateway() -> None:
    cfg = make_config(fixture_backend("fx"))
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw, connect(gw.url) as c:
            tools = await c.request("tools/list")
            names = [t["name"] for t in tools["result"]["tools"]]
            assert "fx__echo" in names
            r = await c.call("fx__echo", {"message": "hello"})
            assert text_of(r) == "hello"
