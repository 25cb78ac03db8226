"""Opening (or adopting) listening sockets, with the loopback guard on the real address."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from gateway.config import host_name, is_loopback
from gateway.limits import ConnectionSlots

LOGGER = logging.getLogger(__name__)


class ListenerError(Exception):
    """A listener cannot be opened, or would be exposed beyond loopback."""


@dataclass(slots=True)
class Accepted(trio.abc.AsyncResource):
    """A connection accepted by a :class:`SlottedListener`; ``admitted``: it holds a slot, which
    its handler must release (whatever happens) once the connection is over.  Closing it closes
    the stream (``trio.serve_listeners`` does, after the handler)."""

    stream: trio.SocketStream
    admitted: bool

    async def aclose(self) -> None:
        await self.stream.aclose()


class SlottedListener(trio.abc.Listener[Accepted]):
    """A listener whose ``accept()`` takes a ``max_connections`` slot for each connection at
    once — in the accept loop, in accept order, before a single byte is read (a WebSocket whose
    handshake never completes holds a slot too, so half-open sockets cannot pile up past the
    cap).  A connection beyond the cap comes back with ``admitted=False`` (already counted as
    refused) for its handler to turn away at once."""

    def __init__(self, inner: trio.SocketListener, slots: ConnectionSlots | None,
                 transport: str) -> None:
        self.inner = inner
        self.socket = inner.socket
        self._slots = slots
        self._transport = transport

    async def accept(self) -> Accepted:
        stream = await self.inner.accept()
        return Accepted(stream, self._slots is None or self._slots.acquire(self._transport))

    async def aclose(self) -> None:
        await self.inner.aclose()


#: accept(2) errors that say the process or system is out of a resource (file descriptors,
#: memory): not the peer's doing; accepting pauses (:data:`ACCEPT_BACKOFF`) instead of failing.
ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
#: The first pause after such an error, doubled on each one in a row up to
#: :data:`ACCEPT_BACKOFF_MAX`.
ACCEPT_BACKOFF = 0.1
ACCEPT_BACKOFF_MAX = 1.0
#: At most one log line per this many seconds about accept errors (the rest are counted in it).
ACCEPT_LOG_INTERVAL = 10.0


class _AcceptLog:
    """One warning per :data:`ACCEPT_LOG_INTERVAL` for all listeners together, no traceback."""

    def __init__(self) -> None:
        self.next_at = -float("inf")
        self.unlogged = 0

    def failed(self, exc: OSError, pause: float) -> None:
        now = trio.current_time()
        if now < self.next_at:
            self.unlogged += 1
            return
        more = f" ({self.unlogged} more since the last such line)" if self.unlogged else ""
        LOGGER.warning("accept failed: %s (%s); accepting paused for %gs, then up to %gs while it "
                       "lasts%s", errno.errorcode.get(exc.errno or 0, exc.errno), exc.strerror,
                       pause, ACCEPT_BACKOFF_MAX, more)
        self.next_at = now + ACCEPT_LOG_INTERVAL
        self.unlogged = 0


_accept_log = _AcceptLog()


Handler = Callable[[Any], Awaitable[object]]


async def serve_listeners(handler: Handler, listeners: Sequence[trio.abc.Listener[Any]], *,
                          handler_nursery: trio.Nursery | None = None,
                          task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
    """``trio.serve_listeners`` (each accepted stream handled in ``handler_nursery``, closed
    after its handler), but an accept that fails for lack of resources (EMFILE: out of file
    descriptors) pauses that listener :data:`ACCEPT_BACKOFF` seconds, doubling to
    :data:`ACCEPT_BACKOFF_MAX` while it lasts, with one rate-limited log line and no traceback
    (trio's own logs a traceback 10 times a second)."""
    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(_serve_one, listener, handler_nursery or nursery, handler)
        task_status.started(listeners)


async def _serve_one(listener: trio.abc.Listener[Any], handler_nursery: trio.Nursery,
                     handler: Handler) -> None:
    pause = ACCEPT_BACKOFF
    async with listener:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                    raise
                _accept_log.failed(exc, pause)
                await trio.sleep(pause)
                pause = min(ACCEPT_BACKOFF_MAX, pause * 2)
                continue
            pause = ACCEPT_BACKOFF
            handler_nursery.start_soon(_handle, stream, handler)


async def _handle(stream: trio.abc.AsyncResource, handler: Handler) -> None:
    try:
        await handler(stream)
    finally:
        await trio.aclose_forcefully(stream)


def adopt_listener(fd: int) -> trio.SocketListener:
    """Wrap a listening socket passed by systemd (socket activation, see
    :func:`gateway.ops.systemd.listen_fds_with_names`) in a :class:`trio.SocketListener`.

    The family and type are detected from the fd itself; ``trio.SocketListener`` checks that it
    is a listening stream socket. The socket takes ownership of ``fd``.
    """
    sock = socket.socket(fileno=fd)
    sock.setblocking(False)
    return trio.SocketListener(trio.socket.from_stdlib_socket(sock))


def check_loopback(listener: trio.SocketListener, what: str,
                   problems: Sequence[str] = ("authentication, which is not configured",)) -> None:
    """Refuse a TCP listener bound to anything but loopback (checked with getsockname()) while
    ``problems`` is not empty: what exposing it still lacks (see
    :func:`gateway.config.client_exposure_problems`); a unix socket always passes."""
    sock = listener.socket
    if sock.family == socket.AF_UNIX or not problems:
        return
    host = sock.getsockname()[0]
    if not is_loopback(host):
        raise ListenerError(
            f"{what}: bound to {host}, which is not loopback, and a listener off loopback needs "
            + "; ".join(problems)
        )


def bound_off_loopback(listeners: Sequence[trio.SocketListener]) -> bool:
    """Whether any of ``listeners`` is a TCP socket bound to an address that is not loopback."""
    return any(lst.socket.family != socket.AF_UNIX
               and not is_loopback(str(lst.socket.getsockname()[0]))
               for lst in listeners)


def allowed_host_names(listeners: Sequence[trio.SocketListener],
                       extra: Sequence[str]) -> frozenset[str]:
    """The ``Host`` names a TCP listener answers to besides the loopback names (see
    :func:`gateway.config.host_allowed`): its bound address unless a wildcard, and ``extra``
    (the operator's ``allowed_hosts``)."""
    bound = {host_name(str(lst.socket.getsockname()[0])) for lst in listeners
             if lst.socket.family in (socket.AF_INET, socket.AF_INET6)}
    return frozenset((bound - {"0.0.0.0", "::"}) | {host_name(h) for h in extra})


async def open_tcp(host: str, port: int, what: str,
                   problems: Sequence[str]) -> list[trio.SocketListener]:
    """Listen on ``host:port``; refused off loopback while ``problems`` (see
    :func:`check_loopback`)."""
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise ListenerError(
            f"{what}: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    for listener in listeners:
        try:
            check_loopback(listener, what, problems)
        except ListenerError:
            for lst in listeners:
                lst.socket.close()
            raise
    return listeners


def bound_port(listeners: list[trio.SocketListener]) -> int:
    port: int = listeners[0].socket.getsockname()[1]
    return port


async def open_unix(path: str, mode: int) -> trio.SocketListener:
    """Listen on a unix socket at ``path`` with file mode ``mode``.

    A stale socket file (nobody listening) is replaced; anything else at ``path`` is an error.
    """
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode):
            raise ListenerError(f"listen.unix: {path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise ListenerError(f"listen.unix: {path}: {exc}") from None
            os.unlink(path)
        else:
            raise ListenerError(f"listen.unix: another process is listening on {path}")
        finally:
            probe.close()
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o777 & ~mode)
    try:
        await sock.bind(path)
    except OSError as exc:
        sock.close()
        raise ListenerError(f"listen.unix: cannot bind {path}: {exc.strerror or exc}") from None
    finally:
        os.umask(old_umask)
    os.chmod(path, mode)
    sock.listen(socket.SOMAXCONN)
    return trio.SocketListener(sock)
