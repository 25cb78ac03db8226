"""Hostile TLS clients on the real daemon's TLS listeners (``listen.tls_cert`` on the WebSocket
and ``/mcp`` listeners): handshake garbage, handshakes that never finish or finish too slowly,
renegotiation asked with ``openssl s_client -tls1_2`` and its ``R`` command, a client
certificate the server never asked for.  Each attacker's connection is closed within a bound
(at once for garbage, 10 s from the accept for a handshake that does not finish or a request
that does not follow it), the daemon serves other clients meanwhile and afterwards, logs no
failure, and the invariants of tests/invariants.py hold."""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
from helpers import fixture_backend, text_of
from invariants import Daemon, DaemonSlot, baseline, check
from tlsutil import make_certs

from gateway import limits
from gateway.transports import tls

pytestmark = [pytest.mark.system,
              pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl s_client")]

# 10 s from the accept: what a silent or slow TLS peer may hold a slot for (its handshake, and
# the handshake and request head together)
HANDSHAKE = min(tls.HANDSHAKE_TIMEOUT, limits.HEAD_TIMEOUT)
FAST = 1.0  # seconds: garbage is refused by the TLS layer at once
SLACK = 1.5  # seconds past HANDSHAKE for the slow ones' close (2 cores shared by the suite)
V = "2026-07-28"
ECHO = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",  # a stateless (2026-07-28) call
        "params": {"name": "fx__echo", "arguments": {"message": "over s_client"},
                   "_meta": {"io.modelcontextprotocol/protocolVersion": V,
                             "io.modelcontextprotocol/clientCapabilities": {}}}}


class TlsDaemon(Daemon):
    """The hardening daemon with TLS on the WebSocket listener and ``/mcp`` on, TLS too."""

    def write_config(self, backends: str) -> None:
        super().write_config(backends)
        certs = make_certs(self.workdir)
        self.ssl_context = certs.client_context()
        text = self.config_path.read_text().replace('http = ""', f"""http = "127.0.0.1:0"
tls_cert = "{certs.cert}"
tls_key = "{certs.key}"
""")
        self.config_path.write_text(text)
        self.ca, self.cert = certs.ca, certs.cert

    @property
    def http_port(self) -> int:
        (line,) = [line for line in self.lines if " ready: " in line]
        return int(line.rsplit("http port ", 1)[1])


@pytest.fixture(scope="module")
def slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonSlot]:
    s = DaemonSlot(tmp_path_factory.mktemp("tls"), fixture_backend("fx"), daemon_type=TlsDaemon)
    yield s
    s.close()


def client_hello() -> bytes:
    """A real TLS ClientHello (as Python's ssl writes it), never sent by a real client."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


async def closed_after(port: int, data: bytes, trickle: float = 0.0) -> tuple[float, bytes]:
    """Connect, send ``data`` (``trickle``: 8 bytes per that many seconds), read until the
    daemon closes; (seconds until closed, what came back)."""
    start = trio.current_time()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    got = b""
    async with stream:

        async def send() -> None:
            try:
                if not trickle:
                    await stream.send_all(data)
                for i in range(0, len(data) if trickle else 0, 8):
                    await stream.send_all(data[i:i + 8])
                    await trio.sleep(trickle)  # real-clock: the trickle is the attack under test
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            try:
                while chunk := await stream.receive_some(65536):
                    got += chunk
            except trio.BrokenResourceError:  # reset: closed with our bytes unread
                pass
            nursery.cancel_scope.cancel()
    return trio.current_time() - start, got


async def slow_handshake_then_silence(daemon: TlsDaemon, port: int, spread: float) -> float:
    """A real TLS handshake whose ClientHello is trickled over ``spread`` seconds, then not a
    byte of a request; seconds from the connect until the daemon closes."""
    ctx = ssl.create_default_context(cafile=str(daemon.ca))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    start = trio.current_time()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        try:
            while True:
                try:
                    obj.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    out = outgoing.read()
                    for i in range(0, len(out), 8):
                        await stream.send_all(out[i:i + 8])
                        # real-clock: a handshake this slow is the attack under test
                        await trio.sleep(spread * 8 / len(out))
                    if not (data := await stream.receive_some(65536)):
                        return trio.current_time() - start
                    incoming.write(data)
            await stream.send_all(outgoing.read())  # the client's Finished
            assert trio.current_time() - start < HANDSHAKE - 1.0
            while await stream.receive_some(65536):
                pass
        except trio.BrokenResourceError:
            pass
    return trio.current_time() - start


async def test_handshake_garbage_and_slow_handshakes_are_closed_in_bounded_time(
        daemon: Daemon) -> None:
    """On both TLS ports at once: garbage is closed within FAST, a handshake that does not
    finish (silent, truncated, a record header and no record, a ClientHello trickled over
    13 s) within HANDSHAKE_TIMEOUT, and so is one that finishes at 6 s and then sends nothing
    (the request head's deadline counts from the accept, the handshake included: it was
    handshake + 10 s on wss://, + 60 s on https://); no TLS alert or HTTP answer leaks plain
    text; meanwhile and afterwards a wss:// client is served."""
    assert isinstance(daemon, TlsDaemon)
    base, mark = await baseline(daemon), len(daemon.lines)
    hello = client_hello()
    fast = {
        "random bytes": os.urandom(4096),
        "plain HTTP": b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-length: 2\r\n\r\n{}",
        "oversize record": b"\x16\x03\x01\xff\xff" + os.urandom(70_000),
        "two ClientHellos": hello + hello,
        "ClientHello + garbage": hello + os.urandom(100),
        "an alert first": b"\x15\x03\x03\x00\x02\x02\x28",
    }
    slow = {
        "silent": (b"", 0.0),
        "half a ClientHello": (hello[:len(hello) // 2], 0.0),
        "a record header only": (b"\x16\x03\x01\x40\x00\x01", 0.0),
        "ClientHello trickled": (hello, 0.2),  # 8 bytes / 0.2 s: 13 s for the whole
    }
    results: dict[tuple[str, int], tuple[float, bytes]] = {}
    bystander: list[float] = []

    async def attack(name: str, port: int, data: bytes, trickle: float = 0.0) -> None:
        results[name, port] = await closed_after(port, data, trickle)

    async def handshake_then_silence(port: int) -> None:  # the deadline covers both
        results["handshake done at 6 s, then silence", port] = \
            (await slow_handshake_then_silence(daemon, port, 6.0), b"")

    async def meanwhile() -> None:  # once the slow ones hold their slots (each port's 5)
        await daemon.status_until(lambda st: st["connection_slots"] >= 2 * (len(slow) + 1))
        start = trio.current_time()
        async with daemon.client("websocket") as c:
            assert text_of(await c.call("fx__echo", {"message": "meanwhile"})) == "meanwhile"
        bystander.append(trio.current_time() - start)

    with trio.fail_after(HANDSHAKE + SLACK + 5):
        async with trio.open_nursery() as nursery:
            for port in (daemon.ws_port, daemon.http_port):
                for name, data in fast.items():
                    nursery.start_soon(attack, name, port, data)
                for name, (data, trickle) in slow.items():
                    nursery.start_soon(attack, name, port, data, trickle)
                nursery.start_soon(handshake_then_silence, port)
            nursery.start_soon(meanwhile)
    for (name, port), (seconds, got) in results.items():
        assert not got.startswith(b"HTTP/"), (name, port, got[:80])
        if name in fast:
            assert seconds < FAST, (name, port, seconds)
        else:
            assert HANDSHAKE - 0.5 < seconds < HANDSHAKE + SLACK, (name, port, seconds)
    assert bystander and bystander[0] < 3.0, bystander
    await check(daemon, base)
    assert not daemon.failures(mark), daemon.failures(mark)


class SClient:
    """``openssl s_client`` on a TLS port of the daemon, its output collected as it comes."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.output = b""
        self.ended = False
        self._changed = trio.Event()

    async def read(self) -> None:
        assert self.process.stdout is not None
        async for chunk in self.process.stdout:
            self.output += chunk
            self._changed.set()
            self._changed = trio.Event()
        self.ended = True  # its output is closed: all it wrote is in
        self._changed.set()

    async def wait_for(self, marker: bytes) -> bool:
        """Until ``marker`` is in the output (True) or s_client's output ended without it
        (False)."""
        while marker not in self.output:
            if self.ended:
                return False
            await self._changed.wait()
        return True

    async def send(self, data: bytes) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send_all(data)


@asynccontextmanager
async def s_client(daemon: TlsDaemon, port: int, *args: str) -> AsyncIterator[SClient]:
    """``openssl s_client`` to ``port``, its output read meanwhile; killed on the way out."""
    process = await trio.lowlevel.open_process(
        ["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-CAfile", str(daemon.ca),
         "-verify_return_error", *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    client = SClient(process)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.read)
            yield client
            nursery.cancel_scope.cancel()
    finally:
        if process.poll() is None:
            process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()


def post(body: dict[str, object]) -> bytes:
    data = json.dumps(body).encode()
    return (b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"accept: application/json, text/event-stream\r\n"
            + f"mcp-protocol-version: {V}\r\nmcp-method: tools/call\r\nmcp-name: fx__echo\r\n"
              f"content-length: {len(data)}\r\n\r\n".encode() + data)


async def tls_exchange(daemon: TlsDaemon, request: bytes, marker: bytes) -> bytes:
    """A fresh TLS connection to ``/mcp`` (no ALPN offered, as s_client), ``request`` sent in one
    write; what came back until ``marker`` was in it."""
    ctx = ssl.create_default_context(cafile=str(daemon.ca))
    stream = trio.SSLStream(await trio.open_tcp_stream("127.0.0.1", daemon.http_port), ctx,
                            server_hostname="127.0.0.1")
    got = b""
    async with stream:
        await stream.send_all(request)
        while marker not in got and (chunk := await stream.receive_some(65536)):
            got += chunk
    return got


async def test_every_answer_over_tls_arrives(daemon: Daemon) -> None:
    """Twenty stateless calls, each on its own TLS connection, each answered within 2 s.  The
    session's writer, cancelled as its request ended, had taken the answer out of the TLS
    stream's buffer and dropped it: most such calls got nothing until the idle timeout."""
    assert isinstance(daemon, TlsDaemon)
    base, mark = await baseline(daemon), len(daemon.lines)
    for i in range(20):
        with trio.fail_after(2.0):
            got = await tls_exchange(daemon, post(ECHO), b'"over s_client"')
        assert got.startswith(b"HTTP/1.1 200 OK"), (i, got[:200])
    await check(daemon, base)
    assert not daemon.failures(mark), daemon.failures(mark)


UPGRADE = (b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
           b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
           b"Sec-WebSocket-Protocol: mcp\r\n\r\n")


async def test_renegotiation_is_refused(daemon: Daemon) -> None:
    """``s_client -tls1_2`` then ``R`` (a client-initiated renegotiation) after an answered
    request on ``/mcp``, and on a WebSocket connection after its upgrade: refused (OpenSSL's
    ``no renegotiation`` alert; s_client then gives up and its connection ends), within 2 s;
    the daemon closes its side and goes on."""
    assert isinstance(daemon, TlsDaemon)
    base, mark = await baseline(daemon), len(daemon.lines)
    for port, opening, answered in ((daemon.http_port, post(ECHO), b'"over s_client"'),
                                    (daemon.ws_port, UPGRADE, b"101 Switching Protocols")):
        with trio.fail_after(15):
            async with s_client(daemon, port, "-tls1_2") as client:
                assert await client.wait_for(b"Verify return code: 0 (ok)"), client.output
                await client.send(opening)
                assert await client.wait_for(answered), client.output
                start = trio.current_time()
                await client.send(b"R\n")
                assert await client.wait_for(b"RENEGOTIATING"), client.output
                refused = await client.wait_for(b"no renegotiation")
                assert refused, client.output[-600:]
                with trio.fail_after(2.0):
                    await client.process.wait()
                assert trio.current_time() - start < 2.0
                assert b"Secure Renegotiation IS supported" in client.output
    await check(daemon, base)
    assert not daemon.failures(mark), daemon.failures(mark)


def client_certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed client certificate and its key (openssl req)."""
    cert, key = folder / "mallory.pem", folder / "mallory.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec",
                    "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-subj", "/CN=mallory", "-days", "1"],
                   check=True, capture_output=True, timeout=30)
    return cert, key


def unsolicited_certificate(cert: Path) -> bytes:
    """A TLS 1.2 handshake record holding a Certificate message with ``cert``."""
    der = ssl.PEM_cert_to_DER_cert(cert.read_text())
    chain = len(der).to_bytes(3, "big") + der
    message = b"\x0b" + (len(chain) + 3).to_bytes(3, "big") + len(chain).to_bytes(3, "big") + chain
    return b"\x16\x03\x03" + len(message).to_bytes(2, "big") + message


async def certificate_unasked(daemon: TlsDaemon, cert: Path) -> float:
    """A TLS 1.2 ClientHello, the server's flight up to ServerHelloDone, then a Certificate
    message the server did not ask for; seconds from it until the daemon closes."""
    ctx = ssl.create_default_context(cafile=str(daemon.ca))
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    outgoing = ssl.MemoryBIO()
    obj = ctx.wrap_bio(ssl.MemoryBIO(), outgoing, server_hostname="127.0.0.1")
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    stream = await trio.open_tcp_stream("127.0.0.1", daemon.http_port)
    async with stream:
        await stream.send_all(outgoing.read())
        flight = b""
        while not flight.endswith(b"\x0e\x00\x00\x00"):  # ServerHelloDone
            flight += await stream.receive_some(65536)
        start = trio.current_time()
        await stream.send_all(unsolicited_certificate(cert))
        try:
            while await stream.receive_some(65536):
                pass
        except trio.BrokenResourceError:
            pass
    return trio.current_time() - start


async def test_a_client_certificate_nobody_asked_for_is_not_used(
        daemon: Daemon, tmp_path: Path) -> None:
    """s_client with ``-cert`` (and ``-enable_pha``: TLS 1.3 post-handshake authentication
    offered) on TLS 1.2 and 1.3: the server asks for no certificate, the handshake succeeds,
    the request is answered as any other; the certificate changes nothing.  A Certificate
    message sent unasked (TLS 1.2, before the key exchange) ends that handshake at once."""
    assert isinstance(daemon, TlsDaemon)
    base, mark = await baseline(daemon), len(daemon.lines)
    cert, key = client_certificate(tmp_path)
    for version in ("-tls1_2", "-tls1_3"):
        with trio.fail_after(15):
            async with s_client(daemon, daemon.http_port, version, "-cert", str(cert),
                                "-key", str(key), "-enable_pha") as client:
                assert await client.wait_for(b"Verify return code: 0 (ok)"), client.output
                assert b"No client certificate CA names sent" in client.output
                await client.send(post(ECHO))
                assert await client.wait_for(b'"over s_client"'), client.output[-600:]
                assert b"HTTP/1.1 200 OK" in client.output
    with trio.fail_after(HANDSHAKE):
        assert await certificate_unasked(daemon, cert) < FAST
    await check(daemon, base)
    assert not daemon.failures(mark), daemon.failures(mark)




async def reload_outcome(daemon: Daemon) -> list[str]:
    """SIGHUP; the lines logged up to the reload's outcome (bounded)."""
    seen = len(daemon.lines)
    daemon.proc.send_signal(signal.SIGHUP)
    with trio.fail_after(5):
        await daemon.line_until(lambda x: "reload done" in x or "reload failed" in x, seen)
    return daemon.lines[seen:]


async def test_a_bad_certificate_on_reload_keeps_the_one_loaded(daemon: Daemon) -> None:
    """The certificate file replaced by garbage, then by a FIFO, and SIGHUP: the first is
    logged and the certificate loaded before stays in use, the second fails the reload (not a
    readable file) instead of blocking the daemon on its open; TLS clients are served all along."""
    assert isinstance(daemon, TlsDaemon)
    base, mark, good = await baseline(daemon), len(daemon.lines), daemon.cert.read_bytes()
    try:
        daemon.cert.write_text("garbage\n")
        lines = await reload_outcome(daemon)
        assert any("the certificate loaded before stays in use" in x for x in lines), lines
        with trio.fail_after(2.0):
            answer = await tls_exchange(daemon, post(ECHO), b'"over s_client"')
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        daemon.cert.unlink()
        os.mkfifo(daemon.cert, 0o600)
        lines = await reload_outcome(daemon)
        assert any("reload failed" in x and "listen.tls_cert" in x for x in lines), lines
        with trio.fail_after(2.0):
            answer = await tls_exchange(daemon, post(ECHO), b'"over s_client"')
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    finally:
        daemon.cert.unlink(missing_ok=True)
        daemon.cert.write_bytes(good)
    lines = await reload_outcome(daemon)
    assert any("TLS certificate loaded again" in x for x in lines), lines
    await check(daemon, base)
    failures = [x for x in daemon.failures(mark) if "reload" not in x]
    assert not failures, failures
