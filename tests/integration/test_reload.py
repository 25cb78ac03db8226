"""Reload: removed backends drain their in-flight calls; changed ones restart without churn."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from gateway import config
from helpers import ROOT, connect, fixture_backend, run_gateway, text_of

pytestmark = pytest.mark.system

HEAD = '[gateway]\ndrain_grace = 5.0\n[listen]\nwebsocket = "127.0.0.1:0"\n[admin]\nlisten = ""\n'


async def test_reload_drains_removed_and_restarts_changed_without_churn(tmp_path: Path) -> None:
    path = tmp_path / "gw.toml"
    path.write_text(HEAD + fixture_backend("gone") + fixture_backend("kept") + fixture_backend("changed"))
    cfg = config.load(path.read_bytes(), base_dir=ROOT)
    with trio.fail_after(40):
        async with run_gateway(cfg, config_path=str(path)) as gw, connect(gw.url) as c:
            before = (await c.request("tools/list"))["result"]["tools"]
            result: dict = {}

            async def slow() -> None:
                result.update(await c.call("gone__sleep", {"seconds": 1.0, "message": "finished"}))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(slow)
                await trio.sleep(0.3)
                path.write_text(HEAD + fixture_backend("kept")
                                + fixture_backend("changed", env={"FIXTURE_START_DELAY": "0.3"}))
                gw.control.reload()
            assert text_of(result) == "finished"  # drained, not cut off with -32004
            await c.wait_for(lambda: [n for n in c.notifications
                                      if n["method"] == "notifications/tools/list_changed"])
            with trio.fail_after(10):
                while True:
                    r = await c.call("changed__echo", {"message": "again"})
                    if "result" in r:
                        break
                    assert r["error"]["code"] == -32001 and r["error"]["data"]["retryable"] is True
                    await trio.sleep(0.05)
            assert text_of(r) == "again"
            after = (await c.request("tools/list"))["result"]["tools"]
            assert after == [t for t in before if not t["name"].startswith("gone__")]
            # exactly one list_changed: for the removed backend; the restart of "changed" caused none
            changes = [n for n in c.notifications if n["method"] == "notifications/tools/list_changed"]
            assert len(changes) == 1
