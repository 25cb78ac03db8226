"""A backend's pipe closed by its stop (another task) while the stdio link still holds its
number: the number is the next file's, a client's socket as likely as not, and the link must
neither read nor write it.

A read of it steals a new client's first bytes (its ``initialize`` never answered on the unix
socket; a WebSocket upgrade head never read, answered 408).  Here the stop is made to land at
the worst moment: inside the read loop's own delivery of a line (the loop runs again before the
stop's task could), or from the stop's own task at a checkpoint the loop takes mid-burst, with
a socket put on the freed number and its peer already written to.  The audit log's file closed
for a reopen that then fails: the records meanwhile are counted lost, never sealed and dropped.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from gateway import cli, errors
from gateway.backend.connector import LinkContext
from gateway.backend.stdio import READ_CHUNK, SLICE, LineLink
from gateway.config import AuditSection
from gateway.events import AuditRecordsDropped, EventBus
from gateway.limits import ByteBudget
from gateway.ops.audit import AuditLog
from gateway.protocol.framing import Oversize, OversizeEnd

STOLEN = b'{"jsonrpc":"2.0","id":1,"method":"initialize"}\n'  # a client's first line
BOUND = 5.0  # seconds: the link's read loop must end well within this once its pipe is closed


def _context() -> LinkContext:
    return LinkContext(backend="fx", instance="fx/0", bus=EventBus(), max_line=1 << 20,
                       buffers=ByteBudget(sys.maxsize).open("fx/0"))


def _socket_on(fd: int, close: Callable[[], None]) -> socket.socket:
    """``close()`` the file at number ``fd``, then put one end of a connected socket pair on
    that number (as the next file opened would be); the other end, non-blocking."""
    mine, theirs = socket.socketpair()  # before the close: neither takes the number itself
    close()
    os.dup2(theirs.fileno(), fd)
    theirs.close()
    mine.setblocking(False)
    return mine


class _StopsOnFirstLine:
    """A receiver that, given the first line, closes the link's stdout (as the stop's task
    would) and puts a socket on the freed number, whose peer has sent a line already."""

    def __init__(self, stdout: trio.lowlevel.FdStream) -> None:
        self.stdout = stdout
        self.lines: list[bytes] = []
        self.done = trio.Event()
        self.peer: socket.socket | None = None

    def message(self, data: bytes, cause: int | None = None) -> None:
        self.lines.append(bytes(data))
        if self.peer is None:
            self.peer = _socket_on(self.stdout.fileno(), self.stdout.close)
            self.peer.send(STOLEN)

    def oversize(self, frame: Oversize) -> None:
        raise AssertionError(frame)

    def oversize_end(self, frame: OversizeEnd) -> None:
        raise AssertionError(frame)

    def undelivered(self, gids: list[int], error: errors.GatewayError) -> None:
        pass

    def failed(self, gid: int, error: errors.GatewayError) -> None:
        pass

    def ended(self) -> None:
        self.done.set()


@pytest.mark.parametrize("first", [b"x" * 100, b"x" * (READ_CHUNK - 1)],
                         ids=["short-read", "full-read"])
async def test_a_closed_stdout_number_reused_by_a_socket_is_never_read(first: bytes) -> None:
    """Short read: the loop would wait on the stale number; full read (64 KiB): it would read
    it at once.  Either way the socket's line stays unread, and the link ends."""
    out_r, out_w = os.pipe()
    in_r, in_w = os.pipe()
    stdout, stdin = trio.lowlevel.FdStream(out_r), trio.lowlevel.FdStream(in_w)
    receiver = _StopsOnFirstLine(stdout)
    link = LineLink(stdin, stdout, _context())
    try:
        os.write(out_w, first + b"\n")  # one line; the full-read one fills the read exactly
        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(link.run, receiver)
                await receiver.done.wait()
                nursery.cancel_scope.cancel()
        assert receiver.lines == [first]
        assert os.read(out_r, 4096) == STOLEN  # out_r: the socket's number now
    finally:
        if receiver.peer is not None:
            receiver.peer.close()
            os.close(out_r)  # the socket's number now (stdout is closed)
        stdout.close()
        stdin.close()
        os.close(out_w)
        os.close(in_r)


async def test_a_send_after_the_stop_closed_stdin_writes_nothing_to_the_reused_number() -> None:
    """The stop closes the child's stdin first; a message sent after that (a cancellation, a
    health ping) is NotDelivered, not written to whatever file has the number now."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    stdin, stdout = trio.lowlevel.FdStream(in_w), trio.lowlevel.FdStream(out_r)
    link = LineLink(stdin, stdout, _context())
    try:
        peer = _socket_on(in_w, stdin.close)
        try:
            with pytest.raises(errors.NotDelivered):
                link.send(b'{"jsonrpc":"2.0","method":"notifications/cancelled"}')
            with pytest.raises(BlockingIOError):
                peer.recv(4096)  # nothing arrived on the socket
        finally:
            peer.close()
            os.close(in_w)  # the socket's number now (stdin is closed)
        assert link.closed is not None
    finally:
        stdout.close()
        os.close(in_r)
        os.close(out_w)


class _Lines(_StopsOnFirstLine):
    """A receiver that only collects lines, and sets ``reached`` at line ``at``."""

    def __init__(self, stdout: trio.lowlevel.FdStream, at: int) -> None:
        super().__init__(stdout)
        self.at = at
        self.reached = trio.Event()

    def message(self, data: bytes, cause: int | None = None) -> None:
        self.lines.append(bytes(data))
        if len(self.lines) == self.at:
            self.reached.set()


async def test_a_stop_landing_mid_burst_leaves_the_reused_number_unread() -> None:
    """The stop's own task closes stdout at a checkpoint the read loop takes in the middle of a
    full 64 KiB read of many lines (one every ``SLICE`` lines), and a socket gets the number
    in the same batch: the lines already read are all delivered, the socket's line is not
    read, and the link ends."""
    size = READ_CHUNK // 64
    lines = [b"%04d" % n + b"x" * (size - 5) for n in range(64)]  # 64 KiB with their newlines
    out_r, out_w = os.pipe()
    in_r, in_w = os.pipe()
    stdout, stdin = trio.lowlevel.FdStream(out_r), trio.lowlevel.FdStream(in_w)
    receiver = _Lines(stdout, at=SLICE)  # the loop's first checkpoint in this read
    link = LineLink(stdin, stdout, _context())

    async def stop() -> None:  # as process.stop_process, with a client accepted at once
        await receiver.reached.wait()
        receiver.peer = _socket_on(stdout.fileno(), stdout.close)
        receiver.peer.send(STOLEN)

    try:
        os.write(out_w, b"".join(line + b"\n" for line in lines))  # the read fills its buffer
        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stop)
                nursery.start_soon(link.run, receiver)
                await receiver.done.wait()
                nursery.cancel_scope.cancel()
        assert receiver.lines == lines
        assert os.read(out_r, 4096) == STOLEN  # out_r: the socket's number now
    finally:
        if receiver.peer is not None:
            receiver.peer.close()
            os.close(out_r)
        stdout.close()
        stdin.close()
        os.close(out_w)
        os.close(in_r)


async def test_an_audit_file_that_cannot_be_reopened_loses_records_counted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The reopen after logrotate's rename fails (a directory where the file was): the log is
    left without a file.  The records meanwhile are counted lost (not sealed into the chain
    and vanished), the file is tried again at the next batch, and a gap record there says
    how many went: the files still verify as one chain."""
    path = tmp_path / "audit.log"
    cfg = AuditSection(path=str(path), key_file=str(tmp_path / "k"), fsync="always")
    bus = EventBus()
    dropped: list[int] = []
    bus.subscribe(lambda event: dropped.append(event.count), AuditRecordsDropped)
    log = AuditLog(cfg, bus)

    def offer(first: int, n: int) -> None:
        for i in range(first, first + n):
            assert log.offer({"type": "call", "method": "tools/call", "name": "t", "i": i})

    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            await nursery.start(log.run)
            offer(0, 3)
            await log.flushed()
            path.rename(tmp_path / "audit.log.1")
            path.mkdir()  # the reopen fails (EISDIR)
            log.reload()
            offer(3, 3)
            await log.flushed()
            assert dropped == [3]
            path.rmdir()  # no reload: the next batch opens a new file
            offer(6, 2)
            await log.flushed()
            nursery.cancel_scope.cancel()
    lines = [json.loads(line) for line in path.read_bytes().splitlines()]
    assert [(r["type"], r.get("lost"), r.get("i")) for r in lines] == [
        ("gap", 3, None), ("call", None, 6), ("call", None, 7)]
    capsys.readouterr()
    assert cli.main(["audit", "verify", "--key-file", str(tmp_path / "k"),
                     str(tmp_path / "audit.log.1"), str(path)]) == 0, capsys.readouterr().out
