"""Reload: removed backends drain their in-flight calls; changed ones restart without churn."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio
from helpers import ROOT, connect, fixture_backend, run_gateway, text_of

from gateway import config, events

pytestmark = pytest.mark.system

HEAD = ('[gateway]\ndrain_grace = 5.0\n[listen]\nwebsocket = "127.0.0.1:0"\nhttp = ""\n[admin]\n'
        'listen = ""\n')


async def test_reload_drains_removed_and_restarts_changed_without_churn(tmp_path: Path) -> None:
    path = tmp_path / "gw.toml"
    path.write_text(
        HEAD + fixture_backend("gone") + fixture_backend("kept") + fixture_backend("changed"))
    cfg = config.load(path.read_bytes(), base_dir=ROOT)
    with trio.fail_after(40):
        async with run_gateway(cfg, config_path=str(path)) as gw, connect(gw.url) as c:
            before = (await c.request("tools/list"))["result"]["tools"]
            result: dict = {}

            async def slow() -> None:
                result.update(await c.call("gone__sleep", {"seconds": 1.0, "message": "finished"}))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(slow)
                await gw.events.wait(events.RequestStarted, backend="gone")
                path.write_text(HEAD + fixture_backend("kept")
                                + fixture_backend("changed", env={"FIXTURE_START_DELAY": "0.3"}))
                mark = gw.events.count
                gw.control.reload()
            assert text_of(result) == "finished"  # drained, not cut off with -32004
            await c.wait_for(lambda: [n for n in c.notifications
                                      if n["method"] == "notifications/tools/list_changed"])
            await gw.events.wait(events.ReloadFinished, success=True, since=mark)
            await gw.events.wait(events.BackendStarted, backend="changed", since=mark)
            r = await c.call("changed__echo", {"message": "again"})
            assert text_of(r) == "again"
            after = (await c.request("tools/list"))["result"]["tools"]
            assert after == [t for t in before if not t["name"].startswith("gone__")]
            # exactly one list_changed: for the removed backend; the restart of "changed" caused
            # none
            changes = [n for n in c.notifications
                       if n["method"] == "notifications/tools/list_changed"]
            assert len(changes) == 1


class _LogLine(logging.Handler):
    """Sets ``seen`` when a log message contains ``text`` (records are emitted in the trio
    thread)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.seen = trio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.seen.set()


async def test_a_call_during_a_reload_restart_waits_for_the_new_backend(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Issue 7: while a reload drained a changed backend, a new call got -32001 retryable: false
    # ("being removed"). Now it waits for the restarted backend (up to restart_wait) and succeeds;
    # a backend the reload removes still answers retryable: false.
    head = HEAD.replace("drain_grace = 5.0", "drain_grace = 5.0\nrestart_wait = 10.0")
    path = tmp_path / "gw.toml"
    path.write_text(head + fixture_backend("changed") + fixture_backend("gone"))
    cfg = config.load(path.read_bytes(), base_dir=ROOT)
    caplog.set_level(logging.INFO, logger="gateway.service")
    draining = _LogLine("reload: draining and stopping backend changed")
    logging.getLogger("gateway.service").addHandler(draining)
    try:
        with trio.fail_after(30):
            async with run_gateway(cfg, config_path=str(path)) as gw, connect(gw.url) as c:
                for name in ("changed", "gone"):  # a call in flight on each (proved by progress)
                    await c.send({"jsonrpc": "2.0", "id": f"slow-{name}", "method": "tools/call",
                                  "params": {
                        "name": f"{name}__progress", "arguments": {"steps": 100, "delay": 0.01},
                        "_meta": {"progressToken": name}}})
                    await c.wait_for(lambda name=name: [n for n in c.notifications
                                                        if n["params"].get(
                                                            "progressToken") == name])
                path.write_text(head + fixture_backend("changed",
                                                       env={"FIXTURE_START_DELAY": "0.2"}))
                gw.control.reload()
                await draining.seen.wait()
                gone = await c.call("gone__echo", {"message": "x"})  # answered at once
                assert gone["error"]["code"] == -32001
                assert gone["error"]["data"]["retryable"] is False
                r = await c.call("changed__echo", {"message": "waited"})
                assert text_of(r) == "waited", r
                assert "result" in await c.response("slow-changed")  # drained, not cut off
    finally:
        logging.getLogger("gateway.service").removeHandler(draining)
