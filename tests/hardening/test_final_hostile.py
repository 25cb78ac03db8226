"""Last hostile pass against the real daemon: inputs that must never end it."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from invariants import Daemon, DaemonSlot, baseline, chaos_backend, check

pytestmark = pytest.mark.system

BACKENDS = chaos_backend("fx")


@pytest.fixture(scope="module")
def slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonSlot]:
    s = DaemonSlot(tmp_path_factory.mktemp("final"), BACKENDS)
    yield s
    s.close()


async def reload_failed(daemon: Daemon, since: int) -> None:
    """Wait (bounded) for "reload failed" in the daemon's log after line ``since``."""
    with trio.fail_after(10):
        await daemon.line_until(
            lambda line: "reload failed" in line or daemon.proc.poll() is not None, since)
    assert daemon.proc.poll() is None, "daemon died:\n" + daemon.tail()


async def test_sigusr1_and_sigusr2_do_not_end_the_daemon(daemon: Daemon) -> None:
    base = await baseline(daemon)
    since = len(daemon.lines)
    for _ in range(10):
        daemon.proc.send_signal(signal.SIGUSR1)
        daemon.proc.send_signal(signal.SIGUSR2)
    with trio.fail_after(10):  # both taken (and logged), the daemon still there
        await daemon.line_until(lambda line: "ignoring SIGUSR1" in line, since)
        await daemon.line_until(lambda line: "ignoring SIGUSR2" in line, since)
    await check(daemon, base)
    assert not daemon.failures(since)
    assert any("ignoring SIGUSR1" in line for line in daemon.lines[since:]), daemon.tail()


async def test_sighup_with_a_deeply_nested_config_keeps_the_daemon(daemon: Daemon) -> None:
    """tomllib recurses per nesting level: 10^5 ``[`` in the config file raised RecursionError
    out of the reload, which ended the daemon.  Now the reload fails and the old config stays."""
    base = await baseline(daemon)
    since = len(daemon.lines)
    daemon.config_path.write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    try:
        daemon.proc.send_signal(signal.SIGHUP)
        await reload_failed(daemon, since)
    finally:
        daemon.write_config(daemon.backends)
    assert any("nested too deeply" in line for line in daemon.lines[since:]), daemon.tail()
    await check(daemon, base)
    assert [line for line in daemon.failures(since) if "reload failed" not in line] == []


async def test_sighup_with_a_fifo_for_config_fails_the_reload_and_sigterm_still_stops(
        tmp_path: Path) -> None:
    """A FIFO in the config's place: open() waited for a writer forever in the reload's thread,
    and SIGTERM then never stopped the daemon.  Now the reload fails at once (not a regular file)
    and the daemon stays and then stops on SIGTERM."""
    daemon = Daemon(tmp_path, BACKENDS)
    try:
        base = await baseline(daemon)
        since = len(daemon.lines)
        daemon.config_path.unlink()
        os.mkfifo(daemon.config_path)
        daemon.proc.send_signal(signal.SIGHUP)
        await reload_failed(daemon, since)
        assert any("not a regular file" in line for line in daemon.lines[since:]), daemon.tail()
        daemon.config_path.unlink()
        daemon.write_config(daemon.backends)
        await check(daemon, base)
        daemon.proc.send_signal(signal.SIGTERM)
        assert await trio.to_thread.run_sync(lambda: daemon.proc.wait(8)) == 0
    except subprocess.TimeoutExpired:
        raise AssertionError("SIGTERM did not stop the daemon:\n" + daemon.tail()) from None
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.kill()
        daemon.stop()


@pytest.mark.parametrize("header", [b"Host: \xff\xfe:1", b"Sec-WebSocket-Protocol: \xff\xfe",
                                    b"Sec-WebSocket-Extensions: permessage-deflate; x=\xff"])
async def test_websocket_upgrade_with_a_non_ascii_header_is_refused_not_a_traceback(
        daemon: Daemon, header: bytes) -> None:
    """wsproto decodes Host and its comma-separated headers as ASCII: a UnicodeDecodeError out
    of the handshake was logged as a gateway bug (ERROR and a traceback).  Now a 400."""
    base = await baseline(daemon)
    since = len(daemon.lines)
    stream = await trio.open_tcp_stream("127.0.0.1", daemon.ws_port)
    host = b"" if header.startswith(b"Host:") else f"Host: 127.0.0.1:{daemon.ws_port}\r\n".encode()
    await stream.send_all(b"GET / HTTP/1.1\r\n" + host + header + b"\r\nUpgrade: websocket\r\n"
                          b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                          b"Sec-WebSocket-Version: 13\r\n\r\n")
    with trio.fail_after(5):
        answer = await stream.receive_some(4096)
    await stream.aclose()
    assert answer.startswith(b"HTTP/1.1 400 "), answer
    await check(daemon, base)
    assert daemon.failures(since) == [], daemon.tail()
