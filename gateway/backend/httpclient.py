"""A small HTTP/1.1 client on h11 over trio streams, for remote backends.

:class:`Origin` is a parsed ``url``; :class:`Connection` carries one
exchange at a time over a stream (a TCP or TLS one, or a memory stream in tests): the request
sent whole, the answer's head read within a deadline, the body read chunk by chunk within an
idle deadline and a byte bound.  :class:`Pool` keeps up to ``idle_max`` idle keep-alive
connections to one origin and opens new ones within ``connect_timeout``.  Every failure is an
:class:`HttpFailure` naming what went wrong; no redirect is ever followed and no proxy used.
"""

from __future__ import annotations

import math
import os
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import h11
import trio

from gateway.protocol import http1

#: Opens a byte stream to (host, port).
Opener = Callable[[str, int], Awaitable[trio.abc.Stream]]
#: Bytes read from a connection at once.
READ_CHUNK = 65536
#: The most an answer's head (status line and headers) may take.
MAX_HEAD = 16384
#: Seconds an idle connection is kept for reuse (servers close idle ones after a few seconds:
#: node's default is 5).
IDLE_TTL = 2.0
#: Requests written and answered without h11 when of the common shape (a HEAD's answer has no
#: body whatever its head says: h11's).
_LEAN_METHODS = frozenset({"GET", "POST", "DELETE"})


class HttpFailure(Exception):
    """An exchange failed: ``detail`` says how (never a header value)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class ConnectFailed(HttpFailure):
    """No connection could be opened (refused, unreachable, TLS refused, timed out)."""


class HttpTimeout(HttpFailure):
    """The remote did not answer, or stopped sending, within the deadline."""


class BodyTooLarge(HttpFailure):
    """A body grew past its bound: the connection is not reusable."""


class ConnectionLost(HttpFailure):
    """The connection broke or closed in the middle of an exchange."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a remote lives: ``http(s)://host:port`` and the request target."""

    scheme: str
    host: str
    port: int
    target: str  # path and query
    authority: str  # the Host header

    @property
    def text(self) -> str:
        """``scheme://host:port`` (what /status and the logs show: no path, no credentials)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    @property
    def tls(self) -> bool:
        return self.scheme == "https"


def parse_url(url: str) -> Origin:
    """An :class:`Origin` from ``url`` (checked by the config already).

    Raises:
        ValueError: not an http(s) URL with a host and a valid port.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Origin(parts.scheme, parts.hostname, port, target, parts.netloc)


def tls_context(ca_file: str | None) -> ssl.SSLContext:
    """A client context verifying certificates and host names (against ``ca_file``, else the
    system's CAs).

    Raises:
        OSError, ssl.SSLError: ``ca_file`` unreadable or not PEM certificates.
    """
    return ssl.create_default_context(cafile=ca_file)


@dataclass(frozen=True, slots=True)
class Response:
    """An answer's head."""

    status: int
    headers: dict[str, str]  # names lowercased; a repeated header: the last value

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";")[0].strip().lower()


#: Request heads written without h11, by method, target and stable headers (the same for
#: every call of a session; a request's own, such as routing or trace headers, are encoded
#: each time after them), kept by each pool (they may hold credentials: they go with it): at
#: most this many, emptied when full, each of at most :data:`HEAD_CACHED_MAX` bytes.
HEADS_MAX = 64
HEAD_CACHED_MAX = 16384
#: Answers' heads parsed, by their bytes (a remote sends the same head but for its ``Date``'s
#: second), kept by each pool: at most this many (each under :data:`MAX_HEAD`), emptied when
#: full.
ANSWER_HEADS_MAX = 16
Heads = dict[tuple[str, str, tuple[tuple[str, str], ...]], bytes]


def _common_head(method: str, target: str, head: list[tuple[str, str]],
                 extra: list[tuple[str, str]], body: bytes, cache: Heads) -> bytes | None:
    """The request's head as h11 writes it (``extra`` after ``head``, ``content-length`` last,
    as :meth:`Connection.request` adds them), or None when it is not of the common shape;
    ``head`` checked and encoded once while in ``cache``."""
    if method not in _LEAN_METHODS:
        return None
    key = (method, target, tuple(head))
    raw = cache.get(key)
    if raw is None:
        raw = http1.request_head(method, target, head)
        if raw is None:
            return None
        if len(raw) <= HEAD_CACHED_MAX:
            if len(cache) >= HEADS_MAX:
                cache.clear()
            cache[key] = raw
    more = b""
    if extra:
        lines = http1.header_lines(extra)
        if lines is None:
            return None
        more = lines
    if body or method in ("POST", "PUT"):
        more += b"content-length: %d\r\n" % len(body)
    return raw[:-2] + more + b"\r\n" if more else raw


def _deadline(timeout: float) -> float:
    """The deadline ``timeout`` seconds from now (none for an infinite one: no clock read)."""
    return math.inf if timeout == math.inf else trio.current_time() + timeout


class Connection:
    """One HTTP/1.1 connection: one exchange at a time, kept alive when both sides allow.

    A common exchange is written and read without h11 (:mod:`gateway.protocol.http1`); a
    request or an answer's head of another shape hands the connection to h11 for good."""

    def __init__(self, stream: trio.abc.Stream, authority: str,
                 pool: Pool | None = None) -> None:
        self.stream = stream
        # a plain TCP stream: a request is written straight to its socket (see :meth:`_send`)
        self._socket = stream.socket if isinstance(stream, trio.SocketStream) else None
        self._pool = pool
        self.authority = authority
        self._h11: h11.Connection | None = None  # h11 serves it (an exchange of another shape)
        self._buf = bytearray()  # received and not read yet (without h11)
        self._body: http1.BodyReader | None = None  # the answer's body being read
        # the request written without h11 until its answer's head is read (h11 is told of it
        # if the answer is not of the common shape)
        self._sent: tuple[str, str, list[tuple[str, str]], bytes] | None = None
        self._unsent: bytes | None = None  # written by :meth:`send_now`: what the socket left
        self._keep = True  # the remote keeps it alive after the answer being read
        self.broken = False
        self.reused = False  # it carried an exchange before this one
        self.idle_since = 0.0
        self._ready = False  # a wait said it is readable: the next read goes first

    async def _receive(self, deadline: float, awaited: bool = False) -> bytes:
        if deadline == math.inf:  # no deadline: no cancel scope either
            return await self._receive_some(awaited)
        with trio.move_on_at(deadline):
            return await self._receive_some(awaited)
        self.broken = True
        raise HttpTimeout("the remote sent nothing in time")

    async def _receive_some(self, awaited: bool = False) -> bytes:
        """The next bytes (b"" at the end).  ``awaited``: bytes are not expected yet (an
        answer's head just asked for): on a plain TCP socket the wait comes first, then one
        read straight from it, not a read that fails first."""
        sock = self._socket
        if awaited and sock is not None:
            try:
                while True:
                    if self._ready:
                        self._ready = False
                    else:
                        await trio.lowlevel.wait_readable(sock)
                    fd = sock.fileno()
                    if fd < 0:
                        raise trio.ClosedResourceError("the socket was closed")
                    try:
                        return os.read(fd, READ_CHUNK)
                    except BlockingIOError:  # woken for nothing: wait again
                        continue
            except (trio.BusyResourceError, trio.ClosedResourceError, OSError) as exc:
                self.broken = True
                raise ConnectionLost(f"the connection broke: {exc}") from None
        try:
            return bytes(await self.stream.receive_some(READ_CHUNK))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self.broken = True
            raise ConnectionLost(f"the connection broke: {exc.__cause__ or exc}") from None

    @property
    def can_send_now(self) -> bool:
        """A plain TCP connection not served by h11: :meth:`send_now` may write to it."""
        return self._socket is not None and self._h11 is None

    async def wait_readable(self) -> None:
        """Until bytes (or the end) can be read from its plain TCP socket, or it is closed: then
        the next read of an answer's head reads first.  Only for a connection :meth:`send_now`
        can write to."""
        sock = self._socket
        assert sock is not None
        try:
            await trio.lowlevel.wait_readable(sock)
        except (trio.BusyResourceError, trio.ClosedResourceError, OSError):
            return  # (the read that follows says what went wrong)
        self._ready = True

    async def _event(self, deadline: float) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        conn = self._h11
        assert conn is not None
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                self.broken = True
                raise ConnectionLost(f"the remote broke HTTP/1.1: {exc}") from None
            if event is not h11.NEED_DATA:
                return event
            conn.receive_data(await self._receive(deadline))

    async def request(self, method: str, target: str, headers: list[tuple[str, str]],
                      body: bytes = b"", *, extra: list[tuple[str, str]] | None = None,
                      head_timeout: float = math.inf) -> Response:
        """Send a request (``extra``: headers of its own after ``headers``, not cached) and
        read its answer's head (within ``head_timeout`` seconds).

        Raises:
            ConnectionLost, HttpTimeout.
        """
        head, out = self._prepare(method, target, headers, body, extra or [])
        if out is None:
            if self._h11 is None:
                self._h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
            conn = self._h11
            try:
                out = conn.send(h11.Request(method=method, target=target, headers=head))
                if body:
                    out += conn.send(h11.Data(data=body))
                out += conn.send(h11.EndOfMessage())
            except (h11.LocalProtocolError, UnicodeError):  # its text may quote a header value
                self.broken = True
                raise ConnectionLost("cannot send the request: h11 refused its head") from None
        await self._send(out)
        deadline = _deadline(head_timeout)
        if self._h11 is None:
            return await self._lean_head(deadline)
        return await self._h11_head(deadline)

    def _prepare(self, method: str, target: str, headers: list[tuple[str, str]], body: bytes,
                 extra: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], bytes | None]:
        """The request's headers (``host`` first, ``extra``, ``content-length`` last) and, when
        it is of the common shape and h11 is not in use, its bytes as h11 would write them (the
        request kept in ``_sent`` until its answer's head is read); else None."""
        head = [("host", self.authority), *headers]
        raw = (_common_head(method, target, head, extra, body,
                            self._pool.heads if self._pool is not None else {})
               if self._h11 is None else None)
        head += extra
        if body or method in ("POST", "PUT"):
            head.append(("content-length", str(len(body))))
        if raw is None:
            return head, None
        self._sent = (method, target, head, body)
        return head, raw + body

    def send_now(self, method: str, target: str, headers: list[tuple[str, str]], body: bytes,
                 extra: list[tuple[str, str]]) -> bool:
        """Write a request of the common shape straight to a plain TCP socket, without waiting:
        what the socket takes goes now, from the caller's task; :meth:`answer_head` sends the
        rest and reads the answer's head.  False (nothing written): not of that shape or
        socket."""
        sock = self._socket
        fd = sock.fileno() if sock is not None and self._h11 is None else -1
        if fd < 0:
            return False
        out = self._prepare(method, target, headers, body, extra)[1]
        if out is None:
            return False
        try:
            sent = os.write(fd, out)
        except OSError:  # full (the rest goes in answer_head), or broken (it fails there)
            sent = 0
        self._unsent = out[sent:]
        return True

    async def answer_head(self, head_timeout: float = math.inf) -> Response:
        """The rest of the request :meth:`send_now` began, then its answer's head (within
        ``head_timeout`` seconds).

        Raises:
            ConnectionLost, HttpTimeout.
        """
        out, self._unsent = self._unsent, None
        assert out is not None, "no request begun by send_now"
        if out:
            await self._send(out)
        return await self._lean_head(_deadline(head_timeout))

    async def _send(self, out: bytes) -> None:
        """Write ``out``: on a plain TCP socket first straight to it (what it takes at once goes
        without a scheduling round: the answer awaited next is the checkpoint), the rest, or on
        another stream all of it, through the stream.

        Raises:
            ConnectionLost.
        """
        try:
            sock = self._socket
            fd = sock.fileno() if sock is not None else -1  # -1: closed
            if fd >= 0:
                # cancelled: nothing is sent (raises; else returns without letting a task run,
                # so fd is still this socket's at the write)
                await trio.lowlevel.checkpoint_if_cancelled()
                try:
                    sent = os.write(fd, out)
                except BlockingIOError:
                    sent = 0
                if sent == len(out):
                    return
                out = out[sent:]
            await self.stream.send_all(out)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self.broken = True
            raise ConnectionLost(f"the connection broke: {exc.__cause__ or exc}") from None

    async def _lean_head(self, deadline: float) -> Response:
        buf = self._buf
        while (end := buf.find(b"\r\n\r\n")) < 0:
            if len(buf) > MAX_HEAD:
                return await self._to_h11(deadline)
            data = await self._receive(deadline, not buf)
            if not data:
                self.broken = True
                raise ConnectionLost("the connection closed before an answer")
            buf += data
        parsed = self._parse_head(bytes(buf[:end + 2])) if end < MAX_HEAD else None
        if parsed is None:
            return await self._to_h11(deadline)
        del buf[:end + 4]
        self._sent = None  # h11 will not need it: not kept while the connection idles
        self._body = http1.BodyReader(parsed.length)
        self._keep = not parsed.close
        return Response(parsed.status, dict(parsed.headers))

    def _parse_head(self, raw: bytes) -> http1.ResponseHead | None:
        """:func:`http1.parse_response_head`, once per distinct head while in the pool's
        :attr:`Pool.answers`."""
        cache = self._pool.answers if self._pool is not None else None
        parsed = cache.get(raw) if cache is not None else None
        if parsed is None:
            parsed = http1.parse_response_head(raw)
            if parsed is not None and cache is not None:
                if len(cache) >= ANSWER_HEADS_MAX:
                    cache.clear()
                cache[raw] = parsed
        return parsed

    async def _to_h11(self, deadline: float) -> Response:
        """From now on h11 serves this connection: told the request sent, given what came."""
        assert self._sent is not None
        method, target, head, body = self._sent
        self._sent = None
        conn = self._h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        conn.send(h11.Request(method=method, target=target, headers=head))  # sent already
        if body:
            conn.send(h11.Data(data=body))
        conn.send(h11.EndOfMessage())
        conn.receive_data(bytes(self._buf))
        self._buf.clear()
        return await self._h11_head(deadline)

    async def _h11_head(self, deadline: float) -> Response:
        while True:
            event = await self._event(deadline)
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                return Response(event.status_code, {k.decode("latin-1").lower(): v.decode("latin-1")
                                                    for k, v in event.headers})
            self.broken = True
            raise ConnectionLost("the connection closed before an answer")

    async def chunk(self, idle_timeout: float = math.inf) -> bytes | None:
        """The body's next bytes, None at its end (within ``idle_timeout`` seconds).

        Raises:
            ConnectionLost: it broke or closed before the body's end.  HttpTimeout.
        """
        if self._h11 is None:
            return await self._lean_chunk(idle_timeout)
        event = await self._event(_deadline(idle_timeout))
        if isinstance(event, h11.Data):
            return bytes(event.data)
        if isinstance(event, h11.EndOfMessage):
            return None
        self.broken = True
        raise ConnectionLost("the connection closed before the end of the answer")

    async def _lean_chunk(self, idle_timeout: float) -> bytes | None:
        body = self._body
        if body is None:
            return None
        deadline = None  # taken at the first wait
        while True:
            try:
                data = body.take(self._buf)
            except ValueError as exc:
                self.broken = True
                raise ConnectionLost(f"the remote broke HTTP/1.1: {exc}") from None
            if body.done:
                self._body = None  # the end read with the last data: :attr:`ended` says so
            if data or body.done:
                return data or None
            if deadline is None:
                deadline = _deadline(idle_timeout)
            got = await self._receive(deadline)
            if not got:
                self.broken = True
                raise ConnectionLost("the connection closed before the end of the answer")
            self._buf += got

    async def body(self, limit: int, idle_timeout: float = math.inf) -> bytes:
        """The whole body, at most ``limit`` bytes.

        Raises:
            BodyTooLarge, ConnectionLost, HttpTimeout.
        """
        first = await self.chunk(idle_timeout)
        if first is None:
            return b""
        if len(first) > limit:
            self.broken = True
            raise BodyTooLarge(f"a body of more than {limit} bytes")
        chunk = await self.chunk(idle_timeout)
        if chunk is None:
            return first  # the whole body came at once (a JSON answer, as a rule): no copy
        data = bytearray(first)
        while chunk is not None:
            data += chunk
            if len(data) > limit:
                self.broken = True
                raise BodyTooLarge(f"a body of more than {limit} bytes")
            chunk = await self.chunk(idle_timeout)
        return bytes(data)

    @property
    def ended(self) -> bool:
        """The answer's body is all read (the next :meth:`chunk` returns None at once); False
        when not known without a read (h11 serving it)."""
        return self._h11 is None and (self._body is None or self._body.done)

    def reusable(self) -> bool:
        """Ready for the next exchange (answer read to its end, keep-alive on both sides)."""
        conn = self._h11
        if self.broken:
            return False
        if conn is None:
            if not self.ended or not self._keep or self._buf:
                return False
        elif conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
            return False
        else:
            conn.start_next_cycle()
        self.reused = True
        return True

    async def aclose(self) -> None:
        self.broken = True
        if self._pool is not None:
            self._pool.open.discard(self)
        with trio.CancelScope(shield=True):
            await trio.aclose_forcefully(self.stream)


class Pool:
    """Connections to one origin: up to ``idle_max`` idle ones kept for reuse, each for at most
    :data:`IDLE_TTL` seconds."""

    def __init__(self, origin: Origin, *, connect_timeout: float, idle_max: int,
                 ssl_context: ssl.SSLContext | None = None,
                 opener: Opener | None = None) -> None:
        self.origin = origin
        self.opener = opener or trio.open_tcp_stream  # (host, port): a byte stream to it
        self.ssl_context = ssl_context  # for https
        self.connect_timeout = connect_timeout
        self.idle_max = idle_max
        self._idle: list[Connection] = []
        self.open: set[Connection] = set()  # every connection not closed yet, idle or in use
        self.heads: Heads = {}  # request heads encoded once (HEADS_MAX)
        self.answers: dict[bytes, http1.ResponseHead] = {}  # heads parsed (ANSWER_HEADS_MAX)
        self.closed = False

    async def connect(self) -> Connection:
        """A new connection (TCP, then TLS for https), within ``connect_timeout``.

        Raises:
            ConnectFailed: with the reason.
        """
        origin = self.origin
        stream: trio.abc.Stream | None = None
        try:
            with trio.fail_after(self.connect_timeout):
                stream = await self.opener(origin.host, origin.port)
                if origin.tls:
                    assert self.ssl_context is not None
                    tls = trio.SSLStream(stream, self.ssl_context, server_hostname=origin.host)
                    await tls.do_handshake()
                    stream = tls
        except trio.TooSlowError:
            if stream is not None:
                await trio.aclose_forcefully(stream)
            raise ConnectFailed(f"no connection within {self.connect_timeout:g}s") from None
        except (OSError, trio.BrokenResourceError) as exc:
            if stream is not None:
                await trio.aclose_forcefully(stream)
            reason = exc.__cause__ or exc
            raise ConnectFailed(getattr(reason, "strerror", None) or str(reason)) from None
        conn = Connection(stream, origin.authority, self)
        if self.closed:
            await conn.aclose()
            raise ConnectFailed("the pool is closed")
        self.open.add(conn)
        return conn

    async def get(self) -> Connection:
        """An idle connection, else a new one.

        Raises:
            ConnectFailed.
        """
        now = trio.current_time()
        # kept in the order put back: the stale ones are the oldest, at the front
        while self._idle and now - self._idle[0].idle_since >= IDLE_TTL:
            await self._idle.pop(0).aclose()
        if self._idle:
            return self._idle.pop()  # the newest
        return await self.connect()

    def get_now(self) -> Connection | None:
        """The newest idle connection when it is not stale, else None (then :meth:`get`)."""
        idle = self._idle
        if idle and trio.current_time() - idle[-1].idle_since < IDLE_TTL:
            return idle.pop()
        return None

    def unget(self, conn: Connection) -> None:
        """Give back, untouched, what :meth:`get_now` gave."""
        self._idle.append(conn)

    async def hold(self, conn: Connection) -> bool:
        """Whether ``conn`` may be kept by its user for its next exchange (reusable, the pool
        open: its idle time starts now, as if :meth:`put`); else it is closed."""
        if not self.closed and conn.reusable():
            conn.idle_since = trio.current_time()
            return True
        await conn.aclose()
        return False

    async def restore(self, conn: Connection) -> None:
        """Give back unused what :meth:`hold` let its user keep: among the idle ones by its idle
        time (closed when stale, or the pool closed or full)."""
        idle = self._idle
        if (self.closed or len(idle) >= self.idle_max or conn.broken
                or trio.current_time() - conn.idle_since >= IDLE_TTL):
            await conn.aclose()
            return
        at = len(idle)
        while at and idle[at - 1].idle_since > conn.idle_since:
            at -= 1
        idle.insert(at, conn)

    async def put(self, conn: Connection) -> None:
        """Give ``conn`` back after an exchange: kept if reusable and there is room, else closed."""
        if not self.closed and len(self._idle) < self.idle_max and conn.reusable():
            conn.idle_since = trio.current_time()
            self._idle.append(conn)
        else:
            await conn.aclose()

    async def aclose(self) -> None:
        """Close every connection, those in use too (their exchanges fail)."""
        self.closed = True
        self._idle = []
        for conn in list(self.open):
            await conn.aclose()
