"""A small HTTP/1.1 server connection on h11, written once for every HTTP endpoint of the gateway
(``/mcp`` and the probes on the client listener, the admin listener): request head and body read
with limits, plain responses, Server-Sent Events framing and the connection loop.

:class:`HttpConnection` serves a connection over a :class:`~gateway.transports.rawio.SocketIO`,
its requests of the common shape parsed and answered without h11
(:mod:`gateway.protocol.http1`); at its first request of any other shape it hands the bytes to an
``h11.Connection``, which serves it from then on.  :meth:`HttpConnection.next_request` reads one
whole request within its time and size bounds; every refusal is an :class:`HttpError` that
:func:`serve_connection`, the one loop and the one catch-all of every HTTP connection, answers
and then closes on.  Writing is synchronous: the bytes are framed and :class:`SocketIO` writes
them at once, holding what the socket does not take until :meth:`HttpConnection.flush`, so an
SSE event is written from whatever task produced it.  Every library error is
:class:`~gateway.errors.TransportClosed`.
"""

from __future__ import annotations

import enum
import http
import logging
import re
from collections.abc import Awaitable, Callable, Sequence

import h11
import trio

from gateway import limits
from gateway.config import host_allowed
from gateway.errors import IncompleteMessage, TransportClosed
from gateway.protocol import http1
from gateway.transports.rawio import SocketIO, stream_io

LOGGER = logging.getLogger(__name__)

#: Request line and headers; the SDK clients and curl send well under 2 KiB.
MAX_HEAD_BYTES = 16 * 1024
#: Bytes a chunk-size line and the CRLF after its data take without extensions (16 hex digits).
_CHUNK_LINE = 24
#: Data received while a response is being streamed (a pipelined request) kept at most.
MAX_PIPELINED = MAX_HEAD_BYTES
#: The header every SSE response carries besides the content type (no proxy buffering).
SSE_HEADERS = [("content-type", "text/event-stream"), ("cache-control", "no-cache"),
               ("x-accel-buffering", "no")]
_EVENT = b"event: message\ndata: "
_KEEPALIVE = b": keep-alive\n\n"
_REASONS: dict[int, bytes] = {}  # status -> reason phrase
#: A line feed without a carriage return before it (looked for from a position on).
_BARE_LF = re.compile(rb"(?<!\r)\n")

Headers = Sequence[tuple[str, str]]
#: A whole response: status, content type, body, extra headers.
Reply = tuple[int, str, bytes, list[tuple[str, str]]]
#: Bound on writing a response the peer does not read.
WRITE_TIMEOUT = 10.0


class HttpError(Exception):
    """A request refused at the HTTP level: answer ``status`` with ``body`` and close."""

    def __init__(self, status: int, text: str, body: bytes | None = None,
                 content_type: str = "text/plain; charset=utf-8") -> None:
        super().__init__(text)
        self.status = status
        self.body = body if body is not None else f"{text}\n".encode()
        self.content_type = content_type
        self.close = False  # True: the connection is closed after the answer
        self.headers: list[tuple[str, str]] = []  # sent with the answer (e.g. WWW-Authenticate)


class Request:
    """One received request: method, path, lowercased header names, the whole body.
    ``header(name)`` is the value of header ``name`` (lowercase), several joined with ``", "``
    (None: absent)."""

    __slots__ = ("body", "header", "headers", "method", "path", "target")

    header: Callable[[bytes], str | None]

    def __init__(self, method: str, target: str, headers: list[tuple[bytes, bytes]], body: bytes,
                 by_name: dict[bytes, str] | None = None) -> None:
        self.method = method
        self.path = target.split("?", 1)[0]
        self.target = target  # with its query
        self.headers = headers
        self.body = body
        if by_name is None:
            by_name = {}
            for key, value in headers:
                text = value.decode("latin-1")
                by_name[key] = f"{by_name[key]}, {text}" if key in by_name else text
        self.header = by_name.get  # a request is asked for ten or so: a plain look-up each

    @classmethod
    def of(cls, event: h11.Request, body: bytes) -> Request:
        """The request h11 parsed."""
        return cls(event.method.decode("ascii", "replace"),
                   event.target.decode("ascii", "replace"), list(event.headers), body)

    def host_in(self, hosts: frozenset[str]) -> bool:
        """Whether the ``Host`` header names this server (a loopback name or one of ``hosts``;
        a request with two is refused before): the check against DNS rebinding."""
        return host_allowed(self.header(b"host"), hosts)


class _Out(enum.Enum):
    """Where a connection served without h11 is in its response."""

    IDLE = enum.auto()  # no request being answered
    DUE = enum.auto()  # a request read, nothing of its response written yet
    STREAMING = enum.auto()  # a chunked (SSE) response's head written, its end not yet
    DONE = enum.auto()  # the response written whole: the next request may come
    CLOSING = enum.auto()  # the response said ``connection: close``, or a write was refused


class HttpConnection:
    """One accepted TCP (or TLS) connection served as HTTP/1.1 (keep-alive; one request at a
    time).  ``h11`` is None while every request was of the common shape."""

    def __init__(self, stream: trio.abc.Stream, max_body: int, *, max_head: int = MAX_HEAD_BYTES,
                 request_timeout: float = limits.INCOMPLETE_MESSAGE_TIMEOUT,
                 head_timeout: float | None = None, opened: float | None = None) -> None:
        self.io = stream_io(stream)  # a TLS connection's SSLStream: through the stream
        self.h11: h11.Connection | None = None
        self.max_head = max_head
        self.max_body = max_body
        self.request_timeout = request_timeout
        self.head_timeout = limits.HEAD_TIMEOUT if head_timeout is None else head_timeout
        # the first request's head is due head_timeout after this (the accept, by default now)
        self._first_head_by: float | None = (trio.current_time() if opened is None
                                             else opened) + self.head_timeout
        self.closed = False
        self._head = False  # the request being answered is a HEAD: its response has no body
        self._buf = b""  # received and not yet parsed (without h11)
        self._out = _Out.IDLE
        # header values an endpoint judged acceptable on this connection (a client sends the
        # same ones with every request): judged again only when they change
        self.passed: dict[str, str] = {}
        self._sid = ""  # the latest valid Mcp-Session-Id answered, and its header line
        self._sid_line = b""

    # ---- reading ----------------------------------------------------------------------------

    async def next_request(self, idle_timeout: float) -> Request | None:
        """The next whole request, or None when the peer closed, stayed idle too long, or sent
        nothing of its first request within ``head_timeout`` of the accept.

        A later request's head is due ``head_timeout`` after its first byte, head and body
        together ``request_timeout`` after it (slow loris: 408).  The head must fit in
        ``max_head`` bytes however it arrives, and so must a chunked body's extensions and
        trailers (431); the body must fit in ``max_body`` bytes, refused by ``Content-Length``
        before it is read or as soon as a chunked body passes it (413).  ``Transfer-Encoding``
        with ``Content-Length`` is refused (400, RFC 9112 §6.1: request smuggling).

        Raises:
            HttpError: the request is refused (431, 413, 408, 400); close after answering.
            TransportClosed: the connection broke mid-request.
        """
        if self.h11 is not None:
            return await self._next_h11(idle_timeout)
        if self._out is not _Out.DONE and self._out is not _Out.IDLE:
            return None  # the last response was not finished: nothing more on this connection
        self._out = _Out.IDLE
        head_by, self._first_head_by = self._first_head_by, None  # None: from its first byte
        whole_by: float | None = None  # head and body due (from the first byte on)
        buf = self._buf
        if buf:
            now = trio.current_time()
            whole_by = now + self.request_timeout
            if head_by is None:
                head_by = now + self.head_timeout
        scanned = 0  # bytes of buf looked at: each is looked at once however the head arrives
        while (end := buf.find(b"\r\n\r\n", max(0, scanned - 3))) < 0:
            # h11's to answer: too big, a bare LF (h11 ends a head there), or a first byte
            # below 0x21 (h11 refuses it at once: a TLS client on the plain port, say)
            if buf and (len(buf) > self.max_head or buf[0] < 0x21
                        or _BARE_LF.search(buf, scanned) is not None):
                return await self._to_h11(idle_timeout, head_by, whole_by)
            scanned = len(buf)
            try:
                if whole_by is None:  # nothing of this request yet: the idle wait
                    with trio.move_on_at(head_by if head_by is not None
                                         else trio.current_time() + idle_timeout):
                        buf = self._buf = await self.io.read()
                        now = trio.current_time()
                        whole_by = now + self.request_timeout
                        if head_by is None:
                            head_by = now + self.head_timeout
                        continue
                    return None  # idle, or no first byte in time: closed without a word
                assert head_by is not None  # set with whole_by
                buf = self._buf = buf + await self.io.read(min(head_by, whole_by))
            except IncompleteMessage:
                raise HttpError(408, "request head not completed in time") from None
            except TransportClosed:
                if not buf:
                    return None
                raise
        head = http1.parse_head(buf[:end + 2]) if end + 4 <= self.max_head else None
        if head is None:  # not of the common shape, or too big: h11's to answer
            return await self._to_h11(idle_timeout, head_by, whole_by)
        if head.length > self.max_body:
            raise HttpError(413, f"request body of {head.length} bytes; at most {self.max_body} "
                                 "(gateway.max_message_bytes)")
        start = end + 4
        stop = start + head.length
        if len(buf) < stop:
            assert whole_by is not None  # the head came
            parts, have = [buf], len(buf)
            while have < stop:
                try:
                    data = await self.io.read(whole_by)
                except IncompleteMessage:
                    raise HttpError(408, "request not completed in time") from None
                parts.append(data)
                have += len(data)
            buf = b"".join(parts)
        self._buf = buf[stop:]
        self._out = _Out.DUE
        return Request(head.method, head.target, head.fields, buf[start:stop], head.by_name)

    async def _to_h11(self, idle_timeout: float, head_by: float | None,
                      whole_by: float | None) -> Request | None:
        """From now on h11 serves this connection, starting with the bytes received so far."""
        conn = self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=self.max_head)
        conn.receive_data(self._buf)
        self._buf = b""
        return await self._next_h11(idle_timeout, head_by, whole_by, started=True)

    async def _next_h11(self, idle_timeout: float, head_by: float | None = None,
                        whole_by: float | None = None, *, started: bool = False) -> Request | None:
        """:meth:`next_request` by h11 (``started``: h11 was just given what was received of
        this request, which is due by ``head_by`` and ``whole_by``)."""
        conn = self.h11
        assert conn is not None
        if not started:
            if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                conn.start_next_cycle()
            elif conn.our_state is not h11.IDLE:
                return None
            head_by, self._first_head_by = self._first_head_by, None
        self._head = False
        fed = len(conn.trailing_data[0])  # bytes of this request received so far (pipelined)
        total = fed  # … of the whole request, body and framing too (fed stops at the head)
        head_bytes = 0
        chunks = 0
        if fed and whole_by is None:
            whole_by = trio.current_time() + self.request_timeout
            if head_by is None:
                head_by = trio.current_time() + self.head_timeout
        head: h11.Request | None = None
        body: list[bytes] = []
        size = 0
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise HttpError(exc.error_status_hint,
                                http.HTTPStatus(exc.error_status_hint).phrase.lower()) from None
            if event is h11.NEED_DATA:
                try:
                    if whole_by is None:  # nothing of this request yet: the idle wait
                        with trio.move_on_at(head_by if head_by is not None
                                             else trio.current_time() + idle_timeout):
                            data = await self.io.read()
                            conn.receive_data(data)
                            fed += len(data)
                            total += len(data)
                            whole_by = trio.current_time() + self.request_timeout
                            if head_by is None:
                                head_by = trio.current_time() + self.head_timeout
                            continue
                        return None  # idle, or no first byte in time: closed without a word
                    assert head_by is not None  # set with whole_by
                    data = await self.io.read(whole_by if head is not None
                                              else min(head_by, whole_by))
                    conn.receive_data(data)
                    total += len(data)
                    if head is None:
                        fed += len(data)
                except IncompleteMessage:
                    raise HttpError(408, "request not completed in time" if head is not None
                                    else "request head not completed in time") from None
                except TransportClosed:
                    if head is None and not conn.trailing_data[0]:
                        return None
                    raise
            elif isinstance(event, h11.Request):
                # h11 bounds a head that arrives in pieces (max_incomplete_event_size); one that
                # arrives whole in a read is measured here: what it took of the bytes fed
                head_bytes = fed - len(conn.trailing_data[0])
                if head_bytes > self.max_head:
                    raise HttpError(431, f"request head over {self.max_head} bytes")
                head = event
                self._head = event.method == b"HEAD"
                names = {name for name, _ in event.headers}
                if b"transfer-encoding" in names and b"content-length" in names:
                    raise HttpError(400, "both Transfer-Encoding and Content-Length (RFC 9112 6.1)")
                length = _content_length(event)
                if length is not None and length > self.max_body:
                    raise HttpError(413, f"request body of {length} bytes; at most {self.max_body} "
                                         "(gateway.max_message_bytes)")
                if conn.they_are_waiting_for_100_continue:
                    self._write(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
            elif isinstance(event, h11.Data):
                chunks += event.chunk_start
                size += len(event.data)
                if size > self.max_body:
                    raise HttpError(413, f"request body over {self.max_body} bytes "
                                         "(gateway.max_message_bytes)")
                body.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                # a chunked body's framing: chunk-size lines (their extensions) and trailer
                # fields, bounded like the head however they arrive (h11 bounds them in pieces)
                framing = total - len(conn.trailing_data[0]) - head_bytes - size
                if framing > self.max_head + _CHUNK_LINE * chunks:
                    raise HttpError(431, "chunk extensions and trailer fields over "
                                         f"{self.max_head} bytes")
                return Request.of(head, b"".join(body))
            elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                return None

    async def watch(self) -> None:
        """Read while a response is streamed, until the peer closes (raises TransportClosed)
        or the caller cancels; bytes of a pipelined request are kept for :meth:`next_request`."""
        while True:
            data = await self.io.read()
            kept = len(self._buf) if self.h11 is None else len(self.h11.trailing_data[0])
            if kept + len(data) > MAX_PIPELINED:
                raise TransportClosed("too much pipelined data while streaming a response")
            self._keep(data)

    async def read_ahead(self) -> None:
        """One read (at most ``READ_SIZE`` bytes), kept for :meth:`next_request`: the next
        request's bytes, read while the last one's answer is on its way (raises
        TransportClosed when the peer closed)."""
        self._keep(await self.io.read())

    def _keep(self, data: bytes) -> None:
        if self.h11 is None:
            self._buf += data
        else:
            self.h11.receive_data(data)

    @property
    def reads_ahead(self) -> bool:
        """Whether :meth:`read_ahead` may wait for the next request while a response is due:
        a write goes to the socket at once (a plain socket; TLS holds every write until
        :meth:`flush`) and nothing of a next request is kept already (pipelined)."""
        return isinstance(self.io, SocketIO) and not (
            self._buf if self.h11 is None else self.h11.trailing_data[0])

    # ---- writing (synchronous; True when nothing is held) -----------------------------------

    def _write(self, data: bytes) -> bool:
        return self.io.write([data])

    def _send(self, *events: h11.Event) -> bool:
        assert self.h11 is not None
        try:
            data = b"".join(self.h11.send(e) or b"" for e in events)
        except h11.LocalProtocolError as exc:
            raise TransportClosed(f"HTTP state: {exc}") from None
        return self._write(data)

    def _lean_head(self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]],
                   then: _Out) -> bytes:
        """A response head written without h11 (the state it leaves: ``then``); refused like
        h11 refuses it (TransportClosed) when no response is due or a header is invalid."""
        if self._out is not _Out.DUE and self._out is not _Out.IDLE:
            self._out = _Out.CLOSING
            raise TransportClosed("HTTP state: no response is due")
        data = http1.response_head(status, reason, headers)
        if data is None:
            self._out = _Out.CLOSING
            raise TransportClosed("HTTP state: an invalid response header")
        self._out = then
        return data

    def respond(self, status: int, body: bytes = b"", content_type: str | None = None,
                headers: Headers = (), *, close: bool = False) -> bool:
        """A whole response with ``Content-Length`` (to a HEAD request: without the body)."""
        hdrs = list(headers)
        if content_type is not None:
            hdrs.append(("content-type", content_type))
        hdrs.append(("content-length", str(len(body))))
        if close:
            hdrs.append(("connection", "close"))
        reason = http.HTTPStatus(status).phrase
        if self.h11 is None:
            fields = [(n.encode("ascii"), v.encode("ascii")) for n, v in hdrs]
            ends = _Out.CLOSING if close or _says_close(fields) else _Out.DONE
            return self._write(self._lean_head(status, reason.encode("ascii"), fields, ends)
                               + body)
        head = h11.Response(status_code=status, headers=hdrs, reason=reason)
        if body and not self._head:
            return self._send(head, h11.Data(data=body), h11.EndOfMessage())
        return self._send(head, h11.EndOfMessage())

    def respond_json(self, status: int, body: bytes, session_id: str = "") -> bool:
        """:meth:`respond` with a JSON ``body`` (and ``Mcp-Session-Id``: ``session_id``, when
        given), the answer to nearly every POST: its head written straight from a template
        when h11 does not serve the connection (its few headers are made valid here)."""
        if session_id and session_id != self._sid and session_id.isascii() \
                and session_id.isprintable():  # (a session's every answer: judged once)
            self._sid = session_id
            self._sid_line = b"mcp-session-id: %s\r\n" % session_id.encode("ascii")
        if self.h11 is not None or (session_id and session_id != self._sid):
            headers = [("mcp-session-id", session_id)] if session_id else []
            return self.respond(status, body, "application/json", headers)
        if self._out is not _Out.DUE and self._out is not _Out.IDLE:
            self._out = _Out.CLOSING
            raise TransportClosed("HTTP state: no response is due")
        reason = _REASONS.get(status)
        if reason is None:
            reason = _REASONS[status] = http.HTTPStatus(status).phrase.encode("ascii")
        self._out = _Out.DONE
        sid = self._sid_line if session_id else b""
        return self._write(b"HTTP/1.1 %d %s\r\n%scontent-type: application/json\r\n"
                           b"content-length: %d\r\n\r\n%s" % (status, reason, sid, len(body), body))

    def start_events(self, headers: Headers = ()) -> bool:
        """A 200 ``text/event-stream`` response head (chunked: it ends with :meth:`end_events`)."""
        if self.h11 is None:
            fields = [(n.encode("ascii"), v.encode("ascii"))
                      for n, v in (*SSE_HEADERS, *headers) if n.lower() != "content-length"]
            fields.append((b"Transfer-Encoding", b"chunked"))  # as h11 writes it
            return self._write(self._lean_head(200, b"", fields, _Out.STREAMING))
        return self._send(h11.Response(status_code=200, headers=[*SSE_HEADERS, *headers]))

    def _data(self, data: bytes) -> bool:
        """A piece of the chunked body being streamed."""
        if self.h11 is None:
            if self._out is not _Out.STREAMING:
                self._out = _Out.CLOSING
                raise TransportClosed("HTTP state: no response body is being streamed")
            return self._write(http1.chunk(data))
        return self._send(h11.Data(data=data))

    def event(self, message: bytes, event_id: bytes | None = None) -> bool:
        """One SSE ``message`` event carrying ``message`` (a JSON text, so a CR or LF in it can
        only be whitespace between tokens: each becomes a new ``data:`` line, still valid JSON),
        with id ``event_id`` when given (visible ASCII, no newline)."""
        if b"\n" in message or b"\r" in message:
            message = b"\ndata: ".join(message.replace(b"\r\n",
                                                       b"\n").replace(b"\r", b"\n").split(b"\n"))
        if event_id is None:
            return self._data(_EVENT + message + b"\n\n")
        return self._data(b"id: " + event_id + b"\n" + _EVENT + message + b"\n\n")

    def priming_event(self, event_id: bytes) -> bool:
        """An event with an id and empty data (2025-11-25): the client has an id to resume
        from before the first message; clients dispatch no message for it."""
        return self._data(b"id: " + event_id + b"\ndata:\n\n")

    def keepalive(self) -> bool:
        """An SSE comment, so that idle streams are not cut by proxies (and a gone peer shows)."""
        return self._data(_KEEPALIVE)

    def end_events(self) -> bool:
        if self.h11 is None:
            if self._out is not _Out.STREAMING:
                self._out = _Out.CLOSING
                raise TransportClosed("HTTP state: no response body is being streamed")
            self._out = _Out.DONE
            return self._write(http1.LAST_CHUNK)
        return self._send(h11.EndOfMessage())

    async def flush(self) -> None:
        await self.io.flush()

    @property
    def reusable(self) -> bool:
        """The exchange is over on both sides and the connection may carry another request."""
        if self.closed:
            return False
        if self.h11 is None:
            return self._out is _Out.DONE
        return self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE

    async def aclose(self) -> None:
        self.closed = True
        await self.io.aclose()


def _says_close(fields: list[tuple[bytes, bytes]]) -> bool:
    """Whether response header ``fields`` end the connection (``connection: close``)."""
    return any(name.lower() == b"connection"
               and b"close" in (t.strip().lower() for t in value.split(b","))
               for name, value in fields)


async def serve_connection(
    conn: HttpConnection,
    handle: Callable[[HttpConnection, Request], Awaitable[None]],
    *,
    idle_timeout: float,
    name: str,
    error_headers: Callable[[HttpError], Headers] = lambda exc: (),
    write_timeout: float = WRITE_TIMEOUT,
) -> None:
    """Serve ``conn`` request after request until the peer leaves, stays idle ``idle_timeout``
    seconds, or the connection cannot carry another request.

    ``handle`` answers one request (it may raise :class:`HttpError`, answered here with its
    status and ``error_headers(exc)``); a refusal of the request itself (head, body, timing)
    closes the connection after its answer: the rest of the byte stream cannot be trusted.
    What a peer does not read within ``write_timeout`` ends the connection.

    Error handling:
        The one catch-all of an HTTP connection: a broken connection ends it quietly, anything
        else is logged (under ``name``) and the connection closed.
    """
    try:
        while True:
            try:
                try:
                    req = await conn.next_request(idle_timeout)
                except HttpError as exc:
                    exc.close = True
                    raise
                if req is None:
                    return
                await handle(conn, req)
            except HttpError as exc:
                LOGGER.debug("%s: %d %s", name, exc.status, exc)
                conn.respond(exc.status, exc.body, exc.content_type,
                             [*error_headers(exc), *exc.headers], close=exc.close)
            if conn.io.held:  # what the socket did not take at once
                with trio.move_on_after(write_timeout) as scope:
                    await conn.flush()
                if scope.cancelled_caught:
                    return
            if not conn.reusable:
                return
    except TransportClosed:
        return
    except Exception:  # the one catch-all per HTTP connection
        LOGGER.exception("%s: connection failed", name)
    finally:
        conn.io.close_writes()  # the fd is closed after this: nothing may write to it any more


def _content_length(event: h11.Request) -> int | None:
    for name, value in event.headers:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
