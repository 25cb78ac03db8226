"""The audit log: one chained line per tools/call, prompts/get, resources/read.

The daemon runs in-process on virtual time (tests/memharness.py) and writes a real file; each
test reads it back after the drain and checks it with ``mcp-gateway audit verify``.  The
writer on its own: rotation, the verifier on intact and tampered files, a full queue.  A real
modern child (``system``): the rounds it asks of a legacy client, and a modern client's retries.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from helpers import ROOT, connect, make_config, run_gateway
from memharness import backend, memory_config, running

from gateway import cli
from gateway.config import AuditSection
from gateway.errors import ConfigError
from gateway.events import AuditRecordsDropped, EventBus
from gateway.ops.audit import AuditLog, load_key

Clock = trio.testing.MockClock

V = "2026-07-28"
FORM = {"elicitation": {"form": {}}}
ACCEPT = {"action": "accept", "content": {"approve": True}}


def audit_toml(tmp_path: Path, extra: str = "") -> str:
    return f"""
[audit]
path = "{tmp_path / 'audit.log'}"
key_file = "{tmp_path / 'audit.key'}"
log_arguments = ["fx__echo"]
redact_keys = ["secret"]
{extra}
"""


def records(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    """The audit file's records, once ``audit verify`` found its chain intact."""
    path = tmp_path / "audit.log"
    code = cli.main(["audit", "verify", "--key-file", str(tmp_path / "audit.key"), str(path)])
    out = capsys.readouterr()
    assert code == 0 and out.out.startswith("intact:"), out
    return [json.loads(line) for line in path.read_bytes().splitlines()]


async def test_a_call_and_a_denied_call(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        autojump_clock: Clock) -> None:
    policy = '[policy]\nrules = [{ match = "fx__big", action = "deny" }]\n'
    cfg = memory_config(backend("fx"), extra=policy + audit_toml(tmp_path))
    async with running(cfg) as gw, gw.connect() as c:
        ok = await c.call("fx__echo", {"message": "hi", "Secret": "s3", "n": 1.0})
        assert ok["result"]["content"][0]["text"] == "hi"
        denied = await c.call("fx__big", {"size": 1})
        assert denied["error"]["code"] == -32005
        got = await c.request("resources/read", {"uri": "fixture://static/a"})
        assert "result" in got
        await c.request("tools/list")  # not audited
    first, second, third = records(tmp_path, capsys)
    assert first["prev"] == "0" * 64 and list(first)[-1] == "mac"
    assert {k: first[k] for k in ("type", "principal", "transport", "client", "method", "name",
                                  "backend", "instance", "outcome", "error_code", "decision",
                                  "rule", "consent", "rounds", "arguments")} == {
        "type": "call", "principal": None, "transport": "memory",
        "client": {"name": "test", "version": "0"}, "method": "tools/call", "name": "fx__echo",
        "backend": "fx", "instance": "fx/0", "outcome": "ok", "error_code": None,
        "decision": "allow", "rule": None, "consent": "none", "rounds": 0,
        "arguments": {"message": "hi", "Secret": "[REDACTED]", "n": 1.0}}
    # the hash is of the canonical arguments (sorted keys, 1.0 printed as 1)
    assert first["args_sha256"] == hashlib.sha256(
        b'{"Secret":"s3","message":"hi","n":1}').hexdigest()
    assert isinstance(first["duration_us"], int) and first["time"].endswith("Z")
    assert (second["name"], second["decision"], second["rule"], second["outcome"],
            second["error_code"], second["backend"]) == ("fx__big", "deny", "fx__big", "error",
                                                         -32005, None)
    assert "arguments" not in second and "args_sha256" in second  # not named by log_arguments
    assert (third["method"], third["uri"], third["outcome"]) == ("resources/read",
                                                                 "fixture://static/a", "ok")
    assert "prev" not in second and "prev" not in third


async def test_consent_outcomes_and_a_bridged_call_counted_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], autojump_clock: Clock) -> None:
    ask = """
[policy]
elicitation_timeout = 30.0
rules = [{ match = "fx__echo", action = "ask" }, { match = "fx__elicit", action = "ask" }]
"""
    cfg = memory_config(backend("fx"), extra=ask + audit_toml(tmp_path))
    async with running(cfg) as gw:
        async with gw.connect(capabilities=FORM) as c:
            for approve in (True, False):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(c.call, "fx__echo", {"message": "m"})
                    prompt = await c.wait_for(lambda: c.requests and c.requests[-1])
                    await c.send({"jsonrpc": "2.0", "id": prompt["id"], "result": {
                        "action": "accept", "content": {"approve": approve}}})
                    c.requests.clear()
        # a modern caller: consent (round 1), then the legacy child's own elicitation (round 2)
        async with gw.connect(initialize=False) as m:
            meta = {"io.modelcontextprotocol/protocolVersion": V,
                    "io.modelcontextprotocol/clientCapabilities": FORM,
                    "io.modelcontextprotocol/clientInfo": {"name": "modern", "version": "2"}}
            params = {"name": "fx__elicit", "arguments": {"message": "name?"}, "_meta": meta}
            first = (await m.request("tools/call", params))["result"]
            second = (await m.request("tools/call", {
                **params, "inputResponses": {"consent": ACCEPT},
                "requestState": first["requestState"]}))["result"]
            (key,) = second["inputRequests"]
            done = await m.request("tools/call", {
                **params, "inputResponses": {key: {"action": "accept",
                                                   "content": {"answer": "Ada"}}},
                "requestState": second["requestState"]})
            assert "Ada" in done["result"]["content"][0]["text"]
    accepted, declined, bridged = records(tmp_path, capsys)
    assert (accepted["decision"], accepted["rule"], accepted["consent"], accepted["outcome"]) == (
        "ask", "fx__echo", "accepted", "ok")
    assert (declined["consent"], declined["outcome"], declined["error_code"]) == (
        "declined", "error", -32005)
    assert (bridged["name"], bridged["consent"], bridged["rounds"], bridged["outcome"],
            bridged["client"], bridged["decision"]) == (
        "fx__elicit", "accepted", 2, "ok", {"name": "modern", "version": "2"}, "ask")
    assert "continues" not in bridged


def write_records(log: AuditLog, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        assert log.offer({"type": "call", "method": "tools/call", "name": "t", "i": i,
                          "pad": "x" * 200})


async def test_rotation_and_verify_on_intact_and_tampered_files(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "audit.log"
    cfg = AuditSection(path=str(path), key_file=str(tmp_path / "k"), max_bytes=4096, keep=3,
                       fsync="always")
    log = AuditLog(cfg, EventBus())
    async with trio.open_nursery() as nursery:
        await nursery.start(log.run)
        write_records(log, 55)
        await log.flushed()
        path.rename(tmp_path / "moved")
        log.reload()  # SIGHUP after logrotate moved the file away: a new file, chained
        write_records(log, 5, 55)
        nursery.cancel_scope.cancel()  # the rest is written on the way out
    # a restart continues the chain in the same file
    log = AuditLog(cfg, EventBus())
    async with trio.open_nursery() as nursery:
        await nursery.start(log.run)
        write_records(log, 1, 60)
        nursery.cancel_scope.cancel()
    check_rotated_files(tmp_path, capsys)


def check_rotated_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "audit.log"
    rotated = [str(tmp_path / f"audit.log.{n}") for n in (3, 2, 1)]
    assert all(Path(p).stat().st_size <= 4096 for p in rotated)
    files = [str(tmp_path / "moved"), str(path)]
    key = ["--key-file", str(tmp_path / "k")]

    def verify(*paths: str) -> tuple[int, str]:
        code = cli.main(["audit", "verify", *key, *paths])
        out = capsys.readouterr()
        return code, out.out + out.err

    code, out = verify(*rotated, *files)
    assert code == 0 and "intact: " in out, out
    lines = sum(len(Path(p).read_bytes().splitlines()) for p in [*rotated, *files])
    assert f"{lines} lines in 5 file(s)" in out
    numbers = [json.loads(x)["i"] for p in [*rotated, *files]
               for x in Path(p).read_bytes().splitlines()]
    assert numbers == list(range(61 - len(numbers), 61)) and numbers[0] > 0  # the oldest: gone
    code, out = verify(rotated[0], rotated[2])  # a file missing between them
    assert code == 1 and f"{rotated[2]}:1: " in out and "previous file" in out
    original = Path(rotated[1]).read_bytes()
    flipped = bytearray(original)
    flipped[original.index(b'"i":') + 4] ^= 1  # a digit of the second file's first record
    Path(rotated[1]).write_bytes(bytes(flipped))
    code, out = verify(*rotated, *files)
    assert code == 1 and f"broken: {rotated[1]}:1: MAC mismatch" in out, out
    lines_of = original.splitlines(keepends=True)
    Path(rotated[1]).write_bytes(b"".join(lines_of[:2] + lines_of[3:]))  # line 3 deleted
    code, out = verify(*rotated, *files)
    assert code == 1 and f"{rotated[1]}:3: MAC mismatch" in out, out
    assert cli.main(["audit", "verify", "--key-file", str(tmp_path / "absent"), str(path)]) == 2


async def test_a_full_queue_drops_with_a_gap_record_or_blocks(
        tmp_path: Path, autojump_clock: Clock) -> None:
    bus = EventBus()
    dropped: list[int] = []
    bus.subscribe(lambda e: dropped.append(e.count), AuditRecordsDropped)
    path = tmp_path / "audit.log"
    drop = AuditLog(AuditSection(path=str(path), key_file=str(tmp_path / "k"), queue=3,
                                 on_full="drop"), bus)
    write_records(drop, 5)  # the writer is not running yet: 2 do not fit
    assert drop.queued == 3 and dropped == [1, 1]
    async with trio.open_nursery() as nursery:
        await nursery.start(drop.run)
        await drop.flushed()
        write_records(drop, 1, 5)  # space returned: the gap goes in first
        await drop.flushed()
        nursery.cancel_scope.cancel()
    got = [json.loads(x) for x in path.read_bytes().splitlines()]
    assert [r.get("i", r["type"]) for r in got] == [0, 1, 2, "gap", 5]
    assert got[3]["lost"] == 2
    block = AuditLog(AuditSection(path=str(path), key_file=str(tmp_path / "k"), queue=1), bus)
    assert block.offer({"type": "call", "i": 6}) and not block.offer({"type": "call", "i": 7})
    async with trio.open_nursery() as nursery:
        waiting = trio.Event()

        async def put() -> None:
            await block.put({"type": "call", "i": 7})
            waiting.set()

        nursery.start_soon(put)
        await trio.testing.wait_all_tasks_blocked()
        assert not waiting.is_set()  # it waits for a place; nothing else does
        await nursery.start(block.run)
        await waiting.wait()
        nursery.cancel_scope.cancel()
    assert [json.loads(x).get("i") for x in path.read_bytes().splitlines()][-2:] == [6, 7]
    assert dropped == [1, 1]
    # block, in the daemon: a call whose record finds the queue full waits for its answer;
    # the rest of its connection and the other connections go on (the writer is held in a
    # journal that returns when told)
    release, took = threading.Event(), trio.Event()
    token = trio.lowlevel.current_trio_token()

    def held_journal(**fields: str) -> None:
        token.run_sync_soon(took.set)
        release.wait(30)

    held = AuditLog(AuditSection(journald=True, key_file=str(tmp_path / "k"), queue=1), bus,
                    journal=held_journal)
    async with running(memory_config(backend("fx"))) as gw, trio.open_nursery() as nursery:
        await nursery.start(held.run)
        gw.hub.audit = held
        async with gw.connect() as a, gw.connect() as b:
            await a.call("fx__echo", {"message": "1"})  # its record: held in the journal
            await took.wait()  # the writer thread took it
            await a.call("fx__echo", {"message": "2"})  # its record fills the queue
            await a.send({"jsonrpc": "2.0", "id": "late", "method": "tools/call",
                          "params": {"name": "fx__echo", "arguments": {"message": "3"}}})
            assert "result" in await b.request("tools/list")  # another connection: served
            assert "result" in await a.request("ping")  # its own connection: served
            assert "late" not in a.responses  # the call: done, its answer waits for a place
            release.set()
            await held.flushed()  # (no deadline while the thread writes: virtual time jumps)
            late = await a.wait_for(lambda: a.responses.get("late"))
            assert late["result"]["content"][0]["text"] == "3"
        nursery.cancel_scope.cancel()
    sent: list[dict[str, str]] = []  # the journal's side: what systemd.journal.send is given
    journal = AuditLog(AuditSection(journald=True, key_file=str(tmp_path / "k")), bus,
                       journal=lambda **fields: sent.append(fields))
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        journal.offer({"type": "call", "method": "tools/call", "name": "t", "rounds": 2,
                       "client": {"name": "c"}})
        await journal.flushed()
        nursery.cancel_scope.cancel()
    (fields,) = sent
    assert (fields["MCP_AUDIT_METHOD"], fields["MCP_AUDIT_ROUNDS"], fields["MCP_AUDIT_CLIENT"]) == (
        "tools/call", "2", '{"name":"c"}')
    assert json.loads(fields["MCP_AUDIT_LINE"])["prev"] == "0" * 64  # the chain, in the journal
    if importlib.util.find_spec("systemd") is None:  # the extra absent: a clear config error
        with pytest.raises(ConfigError, match="systemd extra"):
            AuditLog(AuditSection(journald=True, key_file=str(tmp_path / "k")), bus)
    (tmp_path / "k").chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 0600"):
        load_key(str(tmp_path / "k"))
    # check-config reads it as the start would (run as root, its owner is not checked)
    conf = tmp_path / "gw.toml"
    conf.write_text(f'[audit]\npath = "{path}"\nkey_file = "{tmp_path / "k"}"\n')
    assert cli.main(["check-config", str(conf)]) == 1
    (tmp_path / "k").chmod(0o600)
    assert cli.main(["check-config", str(conf)]) == 0


@pytest.mark.system
@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_a_modern_childs_rounds_once_and_its_passed_through_retries_marked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A real modern child (tests/fixtures/modern_server.py): its two rounds pushed to a legacy
    client are one line; a modern client's retry carries the child's own state: its own line,
    marked ``continues``."""
    child = (f"[backends.m]\ncommand = {json.dumps(sys.executable)}\n"
             f"args = {json.dumps([os.path.join(ROOT, 'tests', 'fixtures', 'modern_server.py')])}"
             '\nprotocol_mode = "modern_only"\n')
    cfg = make_config(child, extra=audit_toml(tmp_path))
    meta = {"io.modelcontextprotocol/protocolVersion": V,
            "io.modelcontextprotocol/clientCapabilities": {"elicitation": {}}}
    headers = {"accept": "application/json, text/event-stream", "content-type": "application/json",
               "mcp-protocol-version": V, "mcp-method": "tools/call", "mcp-name": "m__ask_name"}
    with trio.fail_after(30):
        async with run_gateway(cfg) as gw:
            async with (connect(gw.url, capabilities={"elicitation": {}}) as c,
                        trio.open_nursery() as n):

                async def answer() -> None:
                    done: set[Any] = set()
                    while True:
                        asked = await c.wait_for(lambda: [q for q in c.requests
                                                          if q["id"] not in done])
                        for q in asked:
                            done.add(q["id"])
                            await c.send({"jsonrpc": "2.0", "id": q["id"], "result": {
                                "action": "accept", "content": {"name": "x"}}})

                n.start_soon(answer)
                assert "result" in await c.call("m__ask_two")
                n.cancel_scope.cancel()
            async with httpx.AsyncClient() as http:
                params = {"name": "m__ask_name", "arguments": {}, "_meta": meta}
                r = await http.post(gw.http_url, headers=headers, json={
                    "jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params})
                first = r.json()["result"]
                r = await http.post(gw.http_url, headers=headers, json={
                    "jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
                        **params, "requestState": first["requestState"],
                        "inputResponses": {"user_name": {"action": "accept",
                                                         "content": {"name": "Grace"}}}}})
                assert r.json()["result"]["content"][0]["text"] == "Hello, Grace"
    two, asked, retry = records(tmp_path, capsys)
    assert (two["name"], two["rounds"], two["outcome"], two["transport"]) == (
        "m__ask_two", 2, "ok", "websocket")
    assert (asked["transport"], asked["outcome"], asked.get("continues")) == ("http", "ok", None)
    assert retry["continues"] is True and retry["rounds"] == 0
