"""Byte I/O under a message transport: a non-blocking write that never waits, a backlog for what
the peer's socket did not take, and reads of at most 64 KiB.

:meth:`SocketIO.write` is synchronous: with nothing held it writes straight to the fd
(``os.writev``: no task switch, no checkpoint), else the bytes go behind what is held, so the
wire order is the call order.  :meth:`SocketIO.flush` waits until nothing is held; what is held
is exact at every moment, so a transport knows it is at a frame boundary when nothing is.  Both
bypass trio's socket methods, which checkpoint on every call.  :class:`StreamIO` offers the same
interface over any trio stream (TLS, pipes), holding every write until its flush.  Every
library error, and the end of the stream, is :class:`~gateway.errors.TransportClosed`; after
:meth:`close_writes` every write raises it (a closed fd's number may belong to another
connection); reads and flushes look again after each wait, as the close may come from another
task meanwhile.
"""

from __future__ import annotations

import os

import trio

from gateway import limits
from gateway.errors import IncompleteMessage, TransportClosed

#: Bytes asked of one read (a bigger buffer would be an mmap per read in glibc).
READ_SIZE = 65536
_BROKEN = (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError, OSError)


def _incomplete() -> IncompleteMessage:
    return IncompleteMessage("a message was not completed within "
                             f"{limits.INCOMPLETE_MESSAGE_TIMEOUT:g} seconds")


def stream_io(stream: trio.abc.Stream) -> SocketIO | StreamIO:
    """The I/O for ``stream``: direct on a plain socket, through the stream otherwise (TLS)."""
    return SocketIO(stream) if isinstance(stream, trio.SocketStream) else StreamIO(stream)


class SocketIO:
    """Direct I/O on a connected, non-blocking socket (a ``trio.SocketStream``'s)."""

    __slots__ = ("_held", "_lock", "_off", "_writes_closed", "fd", "stream")

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.fd = stream.socket.fileno()
        self._held = b""  # accepted, not yet written: its bytes from ``_off`` on
        self._off = 0
        self._lock: trio.Lock | None = None  # made at the first flush that has to wait
        self._writes_closed = False

    @property
    def held(self) -> int:
        """Bytes accepted by :meth:`write` and not written yet."""
        return len(self._held) - self._off if self._held else 0  # (empty when nothing is)

    def close_writes(self) -> None:
        """Refuse every write from now on (the transport is closing)."""
        self._writes_closed = True

    def write(self, parts: list[bytes]) -> bool:
        """Write ``parts`` in order, after anything held, as far as the socket takes them now.

        Returns:
            True when nothing is held afterwards (all written).

        Raises:
            TransportClosed: the socket is broken or closed.
        """
        if self._writes_closed:
            raise TransportClosed("closed")
        if self._held:  # (empty whenever nothing is held)
            self._held = self._held[self._off:] + b"".join(parts)
            self._off = 0
            return False
        try:
            n = os.writev(self.fd, parts)
        except BlockingIOError:
            n = 0
        except OSError as exc:
            raise TransportClosed(str(exc)) from None
        if len(parts) == 1:
            data = parts[0]
            if n == len(data):
                return True
        else:
            if n == sum(map(len, parts)):
                return True
            data = b"".join(parts)
        self._held, self._off = data, n
        return False

    def write_pair(self, first: bytes, second: bytes) -> bool:
        """:meth:`write` of ``[first, second]`` (a message and its framing), without the list.

        Raises:
            TransportClosed: the socket is broken or closed.
        """
        if self._writes_closed:
            raise TransportClosed("closed")
        if self._held:  # (empty whenever nothing is held)
            self._held = self._held[self._off:] + first + second
            self._off = 0
            return False
        try:
            n = os.writev(self.fd, (first, second))
        except BlockingIOError:
            n = 0
        except OSError as exc:
            raise TransportClosed(str(exc)) from None
        if n == len(first) + len(second):
            return True
        self._held, self._off = first + second, n
        return False

    async def flush(self) -> None:
        """Until nothing is held.  Cancelling it loses nothing (what is held stays exact).

        Raises:
            TransportClosed: the socket is broken or closed.
        """
        if self._off >= len(self._held):
            return
        if self._lock is None:
            self._lock = trio.Lock()
        async with self._lock:
            while self._off < len(self._held):
                if self._writes_closed:
                    raise TransportClosed("closed")
                try:
                    await trio.lowlevel.wait_writable(self.fd)
                    if self._writes_closed:  # closed while this task waited to run
                        raise TransportClosed("closed")
                    n = os.write(self.fd, memoryview(self._held)[self._off:])
                except BlockingIOError:
                    continue
                except _BROKEN as exc:
                    raise TransportClosed(str(exc)) from None
                self._off += n
                if self._off >= len(self._held):
                    self._held, self._off = b"", 0

    def drop_held(self) -> None:
        self._held, self._off = b"", 0

    async def read(self, deadline: float | None = None) -> bytes:
        """The next bytes (at most :data:`READ_SIZE`).

        Args:
            deadline: a message is partly read; its rest must start coming by then.

        Raises:
            IncompleteMessage: ``deadline`` passed.
            TransportClosed: end of stream, or the socket is broken or closed.
        """
        while True:
            try:
                if deadline is None:
                    await trio.lowlevel.wait_readable(self.fd)
                else:
                    with trio.move_on_at(deadline) as scope:
                        await trio.lowlevel.wait_readable(self.fd)
                    if scope.cancelled_caught:
                        raise _incomplete()
                if self._writes_closed:  # closed while this task waited to run
                    raise TransportClosed("closed")
                data = os.read(self.fd, READ_SIZE)
            except BlockingIOError:
                continue
            except _BROKEN as exc:
                raise TransportClosed(str(exc)) from None
            if not data:
                raise TransportClosed("end of stream")
            return data

    async def aclose(self) -> None:
        self._writes_closed = True
        await _close_quietly(self.stream)


class StreamIO:
    """The interface of :class:`SocketIO` over any trio stream (a TLS connection's
    ``trio.SSLStream``, the stdio bridge's pipes): writes are held until :meth:`flush`, which
    sends them under a lock (one ``send_all`` at a time, in call order).  ``held`` counts what
    was written and is not yet sent, a ``send_all`` under way included.  A flush cancelled
    before its ``send_all`` began leaves what it would have sent held, for the next flush; one
    cancelled during it may have sent part (a TLS stream is broken by it: every later write
    fails)."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self._held: list[bytes] = []
        self._sending = 0  # bytes of the send_all under way
        self._lock = trio.Lock()
        self._writes_closed = False

    @property
    def held(self) -> int:
        return sum(map(len, self._held)) + self._sending

    def close_writes(self) -> None:
        self._writes_closed = True

    def write(self, parts: list[bytes]) -> bool:
        if self._writes_closed:
            raise TransportClosed("closed")
        self._held.extend(parts)
        return False

    def write_pair(self, first: bytes, second: bytes) -> bool:
        if self._writes_closed:
            raise TransportClosed("closed")
        self._held += (first, second)
        return False

    async def flush(self) -> None:
        if not self._held and not self._sending:
            return
        async with self._lock:  # after a send under way: it ends before this returns
            while self._held:
                if self._writes_closed:
                    raise TransportClosed("closed")
                # Cancelled already (the lock was taken without a cancel point), raise before
                # taking the bytes: send_all would raise at once, and they would be lost (a
                # TLS answer's writer cancelled as its request ends: the client waited forever)
                await trio.lowlevel.checkpoint_if_cancelled()
                data, self._held = b"".join(self._held), []
                self._sending = len(data)
                try:
                    await self.stream.send_all(data)
                except _BROKEN as exc:
                    raise TransportClosed(str(exc)) from None
                finally:
                    self._sending = 0

    def drop_held(self) -> None:
        self._held = []

    async def read(self, deadline: float | None = None) -> bytes:
        try:
            if deadline is None:
                data = bytes(await self.stream.receive_some(READ_SIZE))  # bytes: not copied
            else:
                data = b""
                with trio.move_on_at(deadline) as scope:
                    data = bytes(await self.stream.receive_some(READ_SIZE))
                if scope.cancelled_caught:
                    raise _incomplete()
        except _BROKEN as exc:
            raise TransportClosed(str(exc)) from None
        if not data:
            raise TransportClosed("end of stream")
        return data

    async def aclose(self) -> None:
        self._writes_closed = True
        await _close_quietly(self.stream)


async def _close_quietly(stream: trio.abc.AsyncResource) -> None:
    """Close ``stream``; a peer already gone is not an error here."""
    try:
        await stream.aclose()
    except _BROKEN:
        pass
