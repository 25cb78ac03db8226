"""``mcp-gateway connect http(s)://HOST:PORT/mcp``: the stdio bridge as a Streamable HTTP client
of either shape, decided per message.

Legacy (the client starts with ``initialize``): ``initialize`` is POSTed alone, its answer
brings the session id and protocol version sent on every later request, a GET stream carries
the server's messages that belong to no request, and the session is DELETEd when stdin or that
stream closes.  Modern (a request whose ``_meta`` names a version, ``server/discover``, and what
follows): POSTed without a session, with ``MCP-Protocol-Version``, ``Mcp-Method`` and
``Mcp-Name``; cancelling such a request closes its POST.  Every message is POSTed on its own
connection (h11, no pool), concurrently; only the JSON-RPC messages of a JSON or SSE answer go
to stdout.  A request whose POST ends without its answer is answered -32603 with the reason,
unless the client cancelled it: a stdio client waits for every answer it is due.
"""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import h11
import msgspec
import trio

from gateway.errors import INTERNAL_ERROR, MessageTooLarge, TransportClosed
from gateway.protocol import era, jsonrpc, mcpheaders, subscriptions
from gateway.protocol.sse import EventTooLarge, SseDecoder
from gateway.transports.lines import LineStream

LOGGER = logging.getLogger("gateway.bridge")

_JSON = "application/json"
_SSE = "text/event-stream"
_DELETE_TIMEOUT = 5.0


@dataclass
class _Response:
    status: int
    headers: dict[str, str]
    _chunks: AsyncIterator[bytes]

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";")[0].strip().lower()

    async def body(self, limit: int) -> bytes:
        data = bytearray()
        async for chunk in self._chunks:
            data += chunk
            if len(data) > limit:
                raise MessageTooLarge(len(data), limit)
        return bytes(data)

    async def events(self, limit: int) -> AsyncIterator[bytes]:
        """The data of each SSE event (:class:`~gateway.protocol.sse.SseDecoder`)."""
        decoder = SseDecoder(limit)
        async for chunk in self._chunks:
            try:
                events = decoder.feed(chunk)
            except EventTooLarge as exc:
                raise MessageTooLarge(exc.size, limit) from None
            for data in events:
                yield data


@dataclass(slots=True)
class _Post:
    """A request POSTed and not answered yet."""

    scope: trio.CancelScope | None = None  # a modern request's: cancelling it closes its POST
    cancelled: bool = False  # the client cancelled it: no answer is due


class _HttpClient:
    def __init__(self, url: str, ssl_context: ssl.SSLContext | None = None) -> None:
        parts = urlsplit(url)
        self._tls = parts.scheme == "https"
        # made once (loading the system CAs costs more than a local POST), not per request
        self._ssl_context = ssl_context or (ssl.create_default_context() if self._tls else None)
        if not parts.hostname:
            raise OSError(f"no host in {url!r}")
        self._host = parts.hostname
        self._port = parts.port or (443 if self._tls else 80)
        self._authority = parts.netloc.rpartition("@")[2]
        self._target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")

    @asynccontextmanager
    async def request(self, method: str, headers: dict[str, str],
                      body: bytes = b"") -> AsyncIterator[_Response]:
        stream: trio.abc.Stream = await trio.open_tcp_stream(self._host, self._port)
        if self._tls:
            assert self._ssl_context is not None
            tls = trio.SSLStream(stream, self._ssl_context, server_hostname=self._host)
            try:
                await tls.do_handshake()
            except trio.BrokenResourceError as exc:  # e.g. a certificate the system CAs refuse
                await trio.aclose_forcefully(stream)
                raise OSError(f"TLS with {self._authority}: {exc.__cause__ or exc}") from None
            stream = tls
        async with stream:
            conn = h11.Connection(h11.CLIENT)
            head = [("host", self._authority), ("connection", "close"), *headers.items()]
            if body or method == "POST":
                head.append(("content-length", str(len(body))))
            out = conn.send(h11.Request(method=method, target=self._target, headers=head))
            if body:
                out += conn.send(h11.Data(data=body))
            out += conn.send(h11.EndOfMessage())
            try:
                await stream.send_all(out)
            except trio.BrokenResourceError as exc:
                raise _broken(exc) from None

            async def next_event() -> Any:
                while True:
                    event = conn.next_event()
                    if event is not h11.NEED_DATA:
                        return event
                    conn.receive_data(await _receive(stream))

            while isinstance(event := await next_event(), h11.InformationalResponse):
                pass
            if not isinstance(event, h11.Response):
                raise OSError(f"{method}: the connection closed before an answer")

            async def chunks() -> AsyncGenerator[bytes, None]:
                while isinstance(e := await next_event(), h11.Data):
                    yield bytes(e.data)

            async with aclosing(chunks()) as received:
                yield _Response(event.status_code,
                                {k.decode().lower(): v.decode("latin-1") for k, v in event.headers},
                                received)


async def _receive(stream: trio.abc.Stream) -> bytes:
    try:
        return bytes(await stream.receive_some(65536))
    except trio.BrokenResourceError as exc:  # a reset: as any other failed exchange (OSError)
        raise _broken(exc) from None


def _broken(exc: trio.BrokenResourceError) -> OSError:
    return ConnectionError(f"the connection broke: {exc.__cause__ or exc}")


class HttpBridge:
    def __init__(self, url: str, local: LineStream, max_message: int, *, token: str | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self._http = _HttpClient(url, ssl_context)
        self._token = token
        self._local = local
        self._limit = 2 * max_message
        self._session: str | None = None
        self._version: str | None = None
        self._modern: str | None = None  # the version of the client's last modern request
        self._inflight: dict[str, _Post] = {}  # requests POSTed and not answered, by JSON id
        self._out_send, self._out_recv = trio.open_memory_channel[bytes](64)
        self.failed: list[str] = []
        self._done = trio.CancelScope()

    def _headers(self, accept: str) -> dict[str, str]:
        headers = {"accept": accept}
        if self._token:
            headers["authorization"] = f"Bearer {self._token}"
        if self._session:
            headers["mcp-session-id"] = self._session
        if self._version:
            headers["mcp-protocol-version"] = self._version
        return headers

    def _modern_headers(self, version: str, method: str, params: dict[str, Any]) -> dict[str, str]:
        """A 2026-07-28 POST's headers: no session, the routing headers from the body."""
        headers = {"accept": f"{_JSON}, {_SSE}", "content-type": _JSON,
                   **dict(mcpheaders.request_headers(method, version, params))}
        if self._token:
            headers["authorization"] = f"Bearer {self._token}"
        return headers

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as outer:
                outer.start_soon(self._writer, outer.cancel_scope)
                async with trio.open_nursery() as nursery:
                    self._done = nursery.cancel_scope
                    await self._reader(nursery)
                    nursery.cancel_scope.cancel()
                # what is already answered still goes out, within a bound
                self._out_send.close()
                outer.cancel_scope.deadline = trio.current_time() + _DELETE_TIMEOUT
        finally:
            if self._session:
                with trio.move_on_after(_DELETE_TIMEOUT) as scope:
                    scope.shield = True
                    try:
                        async with self._http.request("DELETE", self._headers(_JSON)):
                            pass
                    except (OSError, h11.ProtocolError):
                        pass

    def _fail(self, exc: MessageTooLarge) -> None:
        self.failed.append(f"{exc} (--max-message-bytes)")
        self._done.cancel()

    async def _writer(self, everything: trio.CancelScope) -> None:
        """The one writer of stdout: JSON-RPC messages only, one per line."""
        try:
            async for message in self._out_recv:
                line = _stdout_line(message)
                if line is not None:
                    await self._local.send(line)
        except (TransportClosed, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        everything.cancel()

    async def _reader(self, nursery: trio.Nursery) -> None:
        """stdin → POSTs; the first ``initialize`` is answered before anything else is sent."""
        while True:
            try:
                message = await self._local.receive()
            except TransportClosed:
                return
            except MessageTooLarge as exc:
                self._fail(exc)
                return
            obj = _parse(message)
            method = obj.get("method") if isinstance(obj, dict) else None
            # the id of a request (none of a notification or a response), from this one parse
            request_id = obj.get("id") if isinstance(obj, dict) and "method" in obj else None
            if method == "notifications/cancelled" and isinstance(obj.get("params"), dict):
                post = self._inflight.get(_key(obj["params"].get("requestId")))
                if post is not None:  # its POST may end without an answer now
                    post.cancelled = True
            if self._session is None and method == "initialize":
                await self._post(message, request_id, initialize=True)
                if self._session:
                    nursery.start_soon(self._get_stream)
            elif not (isinstance(method, str)
                      and self._modern_message(nursery, message, obj, method)):
                nursery.start_soon(self._post, message, request_id)

    def _modern_message(self, nursery: trio.Nursery, message: bytes, obj: dict[str, Any],
                        method: str) -> bool:
        """Send ``message`` the 2026-07-28 way if it is of that era; False if it is not."""
        raw = obj.get("params")
        params: dict[str, Any] = raw if isinstance(raw, dict) else {}
        version = _modern_version(params)
        if version is not None:
            self._modern = version
        elif method == "server/discover" and self._modern is None:
            self._modern = era.LATEST_MODERN
        pinned = self._modern if self._session is None else None  # the client's era, modern
        if "id" in obj:  # a request
            if method == "server/discover":
                version = version or pinned or era.LATEST_MODERN
            version = version or pinned
            if version is None:
                return False
            headers = self._modern_headers(version, method, params)
            nursery.start_soon(self._post_modern, message, obj["id"], method, headers)
            return True
        if method == "notifications/cancelled":
            post = self._inflight.get(_key(params.get("requestId")))
            if post is not None and post.scope is not None:  # the cancellation is closing the
                post.scope.cancel()  # request's stream, nothing else
                post.scope = None
                return True
            if pinned:  # a request already answered, or unknown: nothing to close
                return True
        if pinned is None:
            return False
        headers = self._modern_headers(pinned, method, params)
        nursery.start_soon(self._exchange, message, None, headers, self._emit)
        return True

    async def _post_modern(self, message: bytes, request_id: Any, method: str,
                           headers: dict[str, str]) -> None:
        """A modern request's POST, closed when the client cancels it; a listen cancelled
        before its result gets the closing result."""
        listen = method == "subscriptions/listen"
        answered = False

        async def emit(data: bytes, reply: _Reply | None) -> None:
            nonlocal answered
            if listen and not answered:  # its notifications, then its result
                answered = reply is not None and reply.method is msgspec.UNSET
            await self._out_send.send(data)

        scope = trio.CancelScope()
        with scope:
            await self._exchange(message, request_id, headers, emit, scope=scope)
        if scope.cancel_called and listen and not answered:
            closing = subscriptions.closing_result(request_id)
            await self._out_send.send(jsonrpc.encode_result(request_id, closing))

    async def _emit(self, message: bytes, reply: _Reply | None) -> None:
        await self._out_send.send(message)

    async def _emit_initialize(self, message: bytes, reply: _Reply | None) -> None:
        try:
            self._version = json.loads(message)["result"]["protocolVersion"]
        except (ValueError, KeyError, TypeError):
            pass
        await self._out_send.send(message)

    async def _post(self, message: bytes, request_id: Any, initialize: bool = False) -> None:
        headers = self._headers(f"{_JSON}, {_SSE}")
        headers["content-type"] = _JSON
        emit = self._emit_initialize if initialize else self._emit
        await self._exchange(message, request_id, headers, emit, initialize)

    async def _exchange(self, message: bytes, request_id: Any, headers: dict[str, str],
                        emit: Callable[[bytes, _Reply | None], Awaitable[None]],
                        initialize: bool = False, *, scope: trio.CancelScope | None = None) -> None:
        """POST ``message`` (a request when ``request_id`` is not None); its answer (JSON, or
        SSE event by event) goes to ``emit``, with what :func:`_reply` read of it.  A request
        whose exchange ends without its answer (an error status, a body that is not one, a
        stream that ended or broke first) is answered with an error, unless the client
        cancelled it: a stdio client waits for every answer it is due.  ``scope``: a modern
        request's, which its cancellation cancels (its POST closes)."""
        key = _key(request_id)
        answered = request_id is None  # a notification or a response: nothing is due
        post = None
        if not answered:
            post = self._inflight[key] = _Post(scope)

        async def deliver(data: bytes) -> None:
            nonlocal answered
            reply = _reply(data)
            answered = answered or _answers(reply, request_id)
            await emit(data, reply)

        try:
            async with self._http.request("POST", headers, message) as r:
                if initialize and r.status == 200:
                    self._session = r.headers.get("mcp-session-id")
                status = r.status
                if r.status == 200 and r.content_type == _SSE:
                    async for data in r.events(self._limit):
                        await deliver(data)
                    body = b"the event stream ended without an answer"
                else:
                    body = await r.body(self._limit)
                    if r.status == 200 and r.content_type == _JSON:
                        await deliver(body)
                    elif r.status == 200:
                        body = f"{r.content_type or 'no content type'}, not JSON or SSE".encode()
        except MessageTooLarge as exc:
            self._fail(exc)
            return
        except (OSError, h11.ProtocolError) as exc:
            if initialize:  # the gateway is not there: the bridge ends with the error
                self.failed.append(f"initialize: {exc or type(exc).__name__}")
                self._done.cancel()
                return
            status, body = 0, str(exc).encode()
        finally:
            cancelled = post is not None and post.cancelled
            if post is not None and self._inflight.get(key) is post:
                del self._inflight[key]
        if not cancelled and (not answered or status >= 300):  # a notification's: the error
            await self._http_error(request_id, status, body)

    async def _http_error(self, request_id: Any, status: int, body: bytes) -> None:
        """The gateway's JSON-RPC error when an error status's body is one; else one made for
        the request (none for a notification)."""
        answer = _parse(body) if status >= 300 else None
        if isinstance(answer, dict) and answer.get("jsonrpc") == "2.0" and "error" in answer:
            await self._out_send.send(body)
            return
        if request_id is not None:
            text = body.decode("utf-8", "replace")[:200]
            await self._out_send.send(jsonrpc.encode_error(
                request_id, INTERNAL_ERROR, f"HTTP {status}: {text}" if status else text))

    async def _get_stream(self) -> None:
        """The server's messages that belong to no request; when the gateway closes it, the
        bridge ends (a 405 only means the server has no GET stream)."""
        try:
            async with self._http.request("GET", self._headers(_SSE)) as r:
                if r.status != 200 or r.content_type != _SSE:
                    return
                async for data in r.events(self._limit):
                    await self._out_send.send(data)
        except MessageTooLarge as exc:
            self._fail(exc)
        except (OSError, h11.ProtocolError):
            pass
        self._done.cancel()


def _stdout_line(message: bytes) -> bytes | None:
    """``message`` as one stdout line, or None when it is not a JSON-RPC message (nothing, or
    not a JSON object or array in UTF-8); one spread over several lines is re-encoded on one."""
    message = message.strip()
    if not message.startswith((b"{", b"[")) or not _valid_json(message):
        if message:
            LOGGER.warning("not a JSON-RPC message, not written to stdout: %.80r", message)
        return None
    if b"\n" in message or b"\r" in message:
        obj = _parse(message)
        if not isinstance(obj, dict | list):
            LOGGER.warning("not a JSON-RPC message, not written to stdout: %.80r", message)
            return None
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
    return message


def _valid_json(message: bytes) -> bool:
    try:
        msgspec.json.decode(message, type=msgspec.Raw)  # the syntax, without building it
        message.decode("utf-8")  # which that does not check
    except (msgspec.DecodeError, UnicodeDecodeError):
        return False
    return True


class _Reply(msgspec.Struct):
    """What the bridge reads of a message on its way to stdout: its result or error left as
    raw bytes (an empty one: absent), so a large answer is not built into objects."""

    id: Any = None
    method: Any = msgspec.UNSET
    result: msgspec.Raw = msgspec.Raw()
    error: msgspec.Raw = msgspec.Raw()


_reply_decoder = msgspec.json.Decoder(_Reply)


def _reply(message: bytes) -> _Reply | None:
    """``message``'s id, method and whether it has a result or error; None: not a JSON object."""
    try:
        return _reply_decoder.decode(message)
    except msgspec.DecodeError:  # a ValidationError too
        return None


def _answers(reply: _Reply | None, request_id: Any) -> bool:
    """Whether ``reply`` (a message as :func:`_reply` read it) is the response (result or
    error) to request ``request_id``."""
    return (reply is not None and reply.method is msgspec.UNSET
            and bool(reply.result or reply.error)
            and type(reply.id) is type(request_id) and reply.id == request_id)


def _modern_version(params: dict[str, Any]) -> str | None:
    """The protocol version a request's ``_meta`` names (a 2026-07-28 request), or None."""
    meta = params.get("_meta")
    version = meta.get(era.VERSION_KEY) if isinstance(meta, dict) else None
    return version if isinstance(version, str) else None


def _key(request_id: Any) -> str:
    """A request id as a key that tells ``1`` from ``"1"``."""
    return json.dumps(request_id)


def _parse(message: bytes) -> Any:
    try:
        return json.loads(message)
    except ValueError:
        return None

