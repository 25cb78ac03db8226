"""A hostile pass over ``mcp-gateway status`` (a /status answer that would hang it or crash it),
the audit log (arguments the gateway cannot decode, a write cut off by a full disk) and
tracing (a client's tracestate junk)."""

from __future__ import annotations

import hashlib
import json
import logging
import resource
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio
from memharness import backend, memory_config, running
from msgspec import Raw
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from trio.testing import MockClock

from gateway import cli
from gateway.config import AuditSection, TelemetrySection
from gateway.events import EventBus
from gateway.ops import statuscmd
from gateway.ops.audit import AuditLog
from gateway.ops.telemetry import Telemetry


@contextmanager
def fake_admin(answer: Callable[[socket.socket], None]) -> Iterator[int]:
    """A listener on loopback answering one connection with ``answer``; its port."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            try:
                answer(conn)
            except OSError:
                pass
            stop.wait(10)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        listener.close()
        thread.join(10)


def drip(conn: socket.socket) -> None:
    """An answer a byte per 0.1 s: each read within the timeout, the whole never."""
    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n")
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        conn.sendall(b" ")
        # real-clock: a server thread dripping to a synchronous client (statuscmd's blocking
        # socket), whose own deadline is what is tested; a MockClock cannot drive it
        time.sleep(0.1)


def test_a_status_answer_dripping_nested_too_deep_or_odd_is_refused_or_shown_safely(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(statuscmd, "TIMEOUT", 0.5)

    with fake_admin(drip) as port:
        start = time.monotonic()
        with pytest.raises(statuscmd.StatusUnavailable, match="no answer within"):
            statuscmd.fetch("127.0.0.1", port)
        assert time.monotonic() - start < 3

    body = b'{"backends":[],"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"

    def nested(conn: socket.socket) -> None:  # json.loads: RecursionError, not ValueError
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)

    with fake_admin(nested) as port, pytest.raises(statuscmd.StatusUnavailable):
        statuscmd.fetch("127.0.0.1", port)

    # what another program on the admin port answers: shown as far as it goes, no traceback,
    # and no escape sequence reaches the operator's terminal
    odd = {"backends": [1, {"name": "a\x1b[31m", "required": True,
                            "instances": [{"uptime": "x", "last_error": "\x1b]0;title\x07"}]}],
           "listeners": [{}], "connections": [1]}
    lines = statuscmd.render(odd)
    assert not any("\x1b" in line or "\x07" in line for line in lines)
    assert statuscmd.required_down(odd) == ["a?[31m"]


async def test_arguments_the_gateway_cannot_decode_are_not_hashed_as_null(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], autojump_clock: MockClock) -> None:
    audit = (f'[audit]\npath = "{tmp_path / "audit.log"}"\n'
             f'key_file = "{tmp_path / "audit.key"}"\n')
    async with running(memory_config(backend("fx"), extra=audit)) as gw, gw.connect() as c:
        for n, args in enumerate(('{"message": "a"}', '{"message": "a", "n": 1e400}',
                                        '{"message": "a", "n": 1' + "0" * 5000 + "}")):
            await c.send(f'{{"jsonrpc":"2.0","id":{100 + n},"method":"tools/call",'
                         f'"params":{{"name":"fx__echo","arguments":{args}}}}}')
            await c.response(100 + n)
    code = cli.main(["audit", "verify", "--key-file", str(tmp_path / "audit.key"),
                     str(tmp_path / "audit.log")])
    assert code == 0, capsys.readouterr()
    plain, huge_float, huge_int = [json.loads(line)["args_sha256"]
                                  for line in (tmp_path / "audit.log").read_bytes().splitlines()]
    assert plain == hashlib.sha256(b'{"message":"a"}').hexdigest()
    # arguments the gateway passed on but cannot print canonically have no hash, not null's
    assert huge_float is None and huge_int is None


async def test_a_write_failing_mid_line_leaves_a_chain_that_verifies(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A full disk (here: RLIMIT_FSIZE) cuts a batch mid-line: once there is room again, the
    file holds whole lines chained from the last one on disk (the lost ones told by a gap).
    A forged line after them is reported broken, however it is nested."""
    path = tmp_path / "audit.log"
    log = AuditLog(AuditSection(path=str(path), key_file=str(tmp_path / "k")), EventBus())
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    xfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(log.run)
            assert log.offer({"type": "call", "i": 0})
            await log.flushed()
            resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + 10, hard))
            try:
                assert log.offer({"type": "call", "i": 1, "pad": "x" * 100})
                await log.flushed()
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            assert log.offer({"type": "call", "i": 2})
            await log.flushed()
            nursery.cancel_scope.cancel()
    finally:
        signal.signal(signal.SIGXFSZ, xfsz)
    code = cli.main(["audit", "verify", "--key-file", str(tmp_path / "k"), str(path)])
    assert code == 0, capsys.readouterr()
    got = [json.loads(line) for line in path.read_bytes().splitlines()]
    assert [(r["type"], r.get("i"), r.get("lost")) for r in got] == [
        ("call", 0, None), ("gap", None, 1), ("call", 2, None)]
    # a forged line nested too deep for json.loads: broken, not a RecursionError
    with path.open("ab") as f:
        f.write(b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b',"mac":"' + b"0" * 64 + b'"}\n')
    code = cli.main(["audit", "verify", "--key-file", str(tmp_path / "k"), str(path)])
    assert code == 1 and "audit.log:4: not valid JSON" in capsys.readouterr().err


def test_a_clients_tracestate_junk_writes_nothing_into_the_log(
        caplog: pytest.LogCaptureFixture) -> None:
    """Not even an untrusted caller's: the SDK logs a member it refuses, CR LF and all."""
    exporter = InMemorySpanExporter()
    telemetry = Telemetry(TelemetrySection(enabled=True), service_name="t", exporter=exporter,
                          environ={})
    try:
        params = json.dumps({"name": "fx__echo", "_meta": {
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "tracestate": "a=b,x\r\nERROR forged log line"}}).encode()
        with caplog.at_level(logging.DEBUG):
            trace = telemetry.request("tools/call", Raw(params), "http", None)
            trace.end("ok", None, "fx", "fx__echo")
        assert not [r for r in caplog.records if "forged" in r.getMessage()]
    finally:
        telemetry.shutdown()
    assert [span.name for span in exporter.get_finished_spans()] == ["tools/call fx__echo"]


def test_an_authorize_answer_dripping_or_with_escapes_is_bounded_and_shown_safely(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(statuscmd, "TIMEOUT", 0.5)

    with fake_admin(drip) as port:
        start = time.monotonic()
        with pytest.raises(statuscmd.StatusUnavailable, match="no answer within"):
            statuscmd.authorize("127.0.0.1", port, "r")
        assert time.monotonic() - start < 3

    def odd(conn: socket.socket) -> None:
        body = b"no \x1b]0;title\x07 here\n"
        conn.sendall(b"HTTP/1.1 409 Conflict\r\ncontent-length: %d\r\n\r\n" % len(body) + body)

    with fake_admin(odd) as port:
        assert statuscmd.authorize("127.0.0.1", port, "r") == (409, "no ?]0;title? here")
