"""The gateway's MCP client session with one running child (one process generation).

Theory of operation: the gateway never sends a client's request id to a child.  Every request
gets a gateway id from a per-child counter; ``pending`` maps it to a :class:`PendingCall` that
the child's reply completes.  ``pending`` is also the instance's *attribution set*: a call stays
in it until the child's reply arrives, also after the caller gave up (``abandoned``), so a
server→client request is attributed only while provably one connection's calls are open.
Abandoned entries are never dropped by guessing: the instance either *recycles* a child that
leaves one unanswered past ``cancel_grace`` (when attribution matters for it: no new calls, the
ones in flight end, then a restart that is not a failure) or purges them with
:meth:`ChildConnection.purge_abandoned` (when it does not).  Gateway-internal requests
(initialize, list refresh, ping, subscribe) are marked ``internal`` and never count.

Progress tokens are rewritten to gateway-unique tokens and mapped back.  When the child dies,
:meth:`ChildConnection.fail_all` completes every pending call with :class:`BackendExited` at once.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import trio
from msgspec import UNSET, Raw, UnsetType

from gateway import errors
from gateway.events import BackendProtocolError, EventBus
from gateway.limits import Account, ByteBudget
from gateway.protocol import jsonrpc, wire
from gateway.protocol.framing import HEAD, LineFramer, Oversize, OversizeEnd
from gateway.protocol.mcp import decode_cancelled

if TYPE_CHECKING:
    from gateway.session import ClientSession

LOGGER = logging.getLogger(__name__)


_tokens = itertools.count(1)


class PendingCall:
    __slots__ = (
        "abandoned_at", "client_token", "done", "error", "gid", "internal", "method",
        "hard_deadline", "on_progress", "owner", "paused", "remaining", "result", "scope", "started",
        "token",
    )  # fmt: skip

    def __init__(self, gid: int, method: str, owner: ClientSession | None, internal: bool) -> None:
        self.gid = gid
        self.method = method
        self.owner = owner
        self.internal = internal
        self.done = trio.Event()
        self.result: Raw | None = None
        self.error: errors.GatewayError | None = None
        self.token: str | None = None
        self.client_token: Any = None
        self.on_progress: Callable[[Any, dict[str, Raw]], None] | None = None
        self.started = trio.current_time()
        self.abandoned_at: float | None = None
        self.scope: trio.CancelScope | None = None
        self.paused = 0  # prompts pending for this call: its timeout is paused meanwhile
        self.remaining: float | None = None
        self.hard_deadline = float("inf")  # the timeout never extends past this

    def complete(self, result: Raw | None, error: errors.GatewayError | None) -> None:
        if not self.done.is_set():
            self.result, self.error = result, error
            self.done.set()

    def pause(self) -> None:
        """A prompt tied to this call began: stop its timeout clock (the hard maximum stays)."""
        self.paused += 1
        if self.paused == 1 and self.scope is not None:
            self.remaining = max(0.0, self.scope.deadline - trio.current_time())
            self.scope.deadline = self.hard_deadline

    def resume(self) -> None:
        self.paused = max(0, self.paused - 1)
        if self.paused == 0 and self.scope is not None and self.remaining is not None:
            self.scope.deadline = min(trio.current_time() + self.remaining, self.hard_deadline)
            self.remaining = None


class ChildHandlers(Protocol):
    """What the owner of a child connection does with traffic that is not a reply."""

    def on_notification(self, child: ChildConnection, method: str, params: Raw | UnsetType) -> None: ...

    def on_request(self, child: ChildConnection, id: int | str, method: str, params: Raw | UnsetType) -> None: ...

    def on_cancelled(self, child: ChildConnection, request_id: int | str) -> None: ...


class ChildConnection:
    def __init__(
        self,
        *,
        backend: str,
        instance: str,
        generation: int,
        send_stream: trio.abc.SendStream,
        receive_stream: trio.abc.ReceiveStream,
        handlers: ChildHandlers,
        bus: EventBus,
        max_line: int,
        max_depth: int = jsonrpc.MAX_DEPTH,
        buffers: Account | None = None,
        max_queued: int = sys.maxsize,
    ) -> None:
        self.backend = backend
        self.instance = instance
        self.generation = generation
        self._send_stream = send_stream
        self._receive_stream = receive_stream
        self._handlers = handlers
        self._bus = bus
        self._max_line = max_line
        self._max_depth = max_depth
        self._max_queued = max_queued
        self._oversize_head = b""  # first bytes of the oversize line being discarded
        self._outbox: list[tuple[bytes, int | None]] = []  # (bytes to write, gateway id)
        # The outbox's bytes (queued or being written) on the daemon-wide budget; closed, and
        # so released, when the outbox is dropped (stdin broken, fail_all).
        self.buffers = buffers if buffers is not None else ByteBudget(sys.maxsize).open(instance)
        self._outbox_ready = trio.Event()
        self._writing = False
        # A real pipe (trio FdStream, non-blocking) can be written to directly when idle.
        self._fd = send_stream.fileno() if isinstance(send_stream, trio.lowlevel.FdStream) else None
        self._ids = itertools.count(1)
        self.pending: dict[int, PendingCall] = {}
        self._by_token: dict[str, PendingCall] = {}
        self.closed: errors.GatewayError | None = None
        self.protocol_version: str | None = None
        self.server_capabilities: dict[str, Any] = {}
        self.on_settled: Callable[[], None] | None = None  # a pending entry left the set

    # ---- writing ----------------------------------------------------------------------------

    def post(self, line: bytes, gid: int | None = None) -> None:
        """Send one message to the child's stdin without blocking.

        When nothing is queued and the pipe has room, the line is written right here (no task
        switch); otherwise it is queued for :meth:`write_loop`, which keeps the order.

        A request (``gid`` given) that would take the queue past ``max_queued`` bytes is refused
        instead: a child that stops reading its stdin must not hold the daemon's byte budget.

        Raises:
            NotDelivered: the child's stdin is already known to be gone.
            Overloaded: a request, and the child's write queue is full.
        """
        if self.closed is not None:
            raise errors.NotDelivered(self.closed.message, **self.closed.data)
        data = line + b"\n"
        written = 0
        if self._fd is not None and not self._outbox and not self._writing:
            try:
                written = os.write(self._fd, data)
            except BlockingIOError:
                written = 0
            except OSError:
                self.closed = self.exited_error("the backend's stdin is closed")
                raise errors.NotDelivered(self.closed.message, **self.closed.data) from None
            if written == len(data):
                return
            data = data[written:]
        if gid is not None and not written and self.buffers.held + len(data) > self._max_queued:
            raise errors.Overloaded(
                f"backend {self.backend!r} is not reading its input: {self.buffers.held} bytes "
                "already wait to be written to it (outbound_bytes)", backend=self.backend,
                limit=self._max_queued)
        self._outbox.append((data, gid))
        self.buffers.charge(len(data))
        self._outbox_ready.set()

    async def send(self, line: bytes) -> None:
        """Queue one message (async form of :meth:`post`, a checkpoint for callers)."""
        self.post(line)
        await trio.lowlevel.checkpoint()

    async def write_loop(self) -> None:
        """Write queued messages to the child, batching whatever piled up into one write.

        If stdin breaks, the calls whose requests were in the failed write get
        :class:`~gateway.errors.NotDelivered` (the child never read them: safe to retry).
        """
        while True:
            if not self._outbox:
                self._outbox_ready = trio.Event()
                await self._outbox_ready.wait()
            batch, self._outbox = self._outbox, []
            self._writing = True
            try:
                chunk = b"".join([line for line, _ in batch])
                await self._send_stream.send_all(chunk)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                error = self.exited_error("the backend's stdin is closed")
                if self.closed is None:
                    self.closed = error
                for _line, gid in batch + self._outbox:
                    call = self.pending.pop(gid, None) if gid is not None else None
                    if call is not None:
                        call.complete(None, errors.NotDelivered(error.message, **error.data))
                self._outbox = []
                self.buffers.close()
                return
            finally:
                self._writing = False
            self.buffers.release(len(chunk))

    def exited_error(self, detail: str) -> errors.GatewayError:
        return errors.BackendExited(
            f"backend {self.backend!r} exited: {detail}", backend=self.backend, retryable=True
        )

    async def notify(self, method: str, params: Raw | UnsetType = UNSET) -> None:
        await self.send(jsonrpc.encode_notification(method, params))

    async def respond(self, id: int | str, result: Raw) -> None:
        try:
            await self.send(jsonrpc.encode_result(id, result))
        except errors.BackendExited:
            LOGGER.debug("backend %s gone before its request %r was answered", self.instance, id)

    async def respond_error(self, id: int | str, code: int, message: str, data: Any = None) -> None:
        try:
            await self.send(jsonrpc.encode_error(id, code, message, data))
        except errors.BackendExited:
            LOGGER.debug("backend %s gone before its request %r was answered", self.instance, id)

    # ---- requests ---------------------------------------------------------------------------

    async def request(
        self,
        method: str,
        params: Raw | UnsetType = UNSET,
        *,
        timeout: float,
        hard_timeout: float | None = None,
        owner: ClientSession | None = None,
        internal: bool = False,
        progress: tuple[Any, Callable[[Any, dict[str, Raw]], None]] | None = None,
        rewrite: Callable[[str | None], Raw | UnsetType] | None = None,
        on_sent: Callable[[PendingCall], Awaitable[None] | None] | None = None,
    ) -> Raw:
        """Send a request to the child and wait for its reply.

        Args:
            timeout: seconds until the gateway gives up (paused while a prompt is pending).
            hard_timeout: the most the call may take even with pauses (default: no maximum).
            owner: the client session the call belongs to (None for gateway-internal calls).
            progress: ``(client_token, callback)`` when the client asked for progress.
            rewrite: builds the final params given the gateway progress token (or None).

        Raises:
            CallTimeout, BackendExited, RemoteError.  On cancellation or timeout the child is
            sent ``notifications/cancelled`` and a late reply is dropped.
        """
        gid = next(self._ids)
        call = PendingCall(gid, method, owner, internal)
        if hard_timeout is not None:
            call.hard_deadline = trio.current_time() + hard_timeout
        token = None
        if progress is not None:
            token = f"gw-{next(_tokens)}"
            call.token, (call.client_token, call.on_progress) = token, progress
            self._by_token[token] = call
        if rewrite is not None:
            params = rewrite(token)
        self.pending[gid] = call  # before the write: the reply may race the end of send()
        sent = False
        try:
            try:
                self.post(jsonrpc.encode_request(gid, method, params), gid)
            except (errors.NotDelivered, errors.Overloaded):
                self.pending.pop(gid, None)
                raise
            sent = True
            with trio.move_on_after(timeout) as scope:
                call.scope = scope
                await call.done.wait()
            call.scope = None
            if not call.done.is_set():
                raise errors.CallTimeout(
                    f"backend {self.backend!r} did not answer {method} within {timeout:g}s",
                    backend=self.backend,
                )
            if call.error is not None:
                raise call.error
            assert call.result is not None
            return call.result
        finally:
            if token is not None:
                self._by_token.pop(token, None)
            if call.done.is_set() or not sent:
                # Answered, or never written: the child has no such call to attribute or cancel.
                self.pending.pop(gid, None)
            else:
                call.abandoned_at = trio.current_time()
                with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                    await self._cancel_at_child(gid)

    async def _cancel_at_child(self, gid: int) -> None:
        if self.closed is not None or gid not in self.pending:
            return
        try:
            await self.notify(
                "notifications/cancelled",
                jsonrpc.encode_dict({"requestId": gid, "reason": "cancelled by the gateway"}),
            )
        except errors.BackendExited:
            pass

    def attribution(self) -> set[ClientSession]:
        """The client sessions with calls in this child's attribution set (internal calls never)."""
        return {c.owner for c in self.pending.values() if not c.internal and c.owner is not None}

    def oldest_abandoned(self, *, clients_only: bool = False) -> float | None:
        """When the oldest still-unanswered abandoned call was given up (None: there is none);
        ``clients_only``: among clients' calls only (internal ones never count for attribution)."""
        times = [c.abandoned_at for c in self.pending.values()
                 if c.abandoned_at is not None and not (clients_only and c.internal)]
        return min(times) if times else None

    def calls_in_flight(self) -> int:
        """Clients' calls whose callers still wait for them (not internal, not abandoned)."""
        return sum(1 for c in self.pending.values() if not c.internal and c.abandoned_at is None)

    def purge_abandoned(self, before: float, *, internal_only: bool = False) -> int:
        """Forget abandoned calls given up before ``before`` (only internal ones if asked)."""
        stale = [gid for gid, c in self.pending.items() if c.abandoned_at is not None and c.abandoned_at < before
                 and (c.internal or not internal_only)]
        for gid in stale:
            del self.pending[gid]
        if stale and self.on_settled is not None:
            self.on_settled()
        return len(stale)

    def calls_of(self, owner: ClientSession) -> list[PendingCall]:
        """``owner``'s calls still waited for (abandoned ones are over for the owner)."""
        return [c for c in self.pending.values()
                if c.owner is owner and not c.done.is_set() and c.abandoned_at is None]

    def fail_all(self, error: errors.GatewayError) -> None:
        """The child is gone: complete every pending call with ``error`` now."""
        if self.closed is None:
            self.closed = error
        for call in self.pending.values():
            call.complete(None, error)
        self.pending.clear()
        self._by_token.clear()
        self._outbox = []  # nobody will read it: dropped with its bytes
        self.buffers.close()

    # ---- reading ----------------------------------------------------------------------------

    async def read_loop(self) -> None:
        """Read the child's stdout until EOF; returns when the child closed it."""
        framer = LineFramer(self._max_line, report_end=True)
        while True:
            try:
                data = await self._receive_stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                return
            if not data:
                return
            for frame in framer.feed(data):
                if isinstance(frame, Oversize):
                    self._on_oversize(frame)
                elif isinstance(frame, OversizeEnd):
                    self._on_oversize_end(frame)
                else:
                    self._dispatch(frame)

    def _on_oversize(self, frame: Oversize) -> None:
        """A line crossed the limit: it is dropped; if its first bytes show a reply's id, that
        call fails now, else the line's last bytes are looked at when it ends."""
        LOGGER.warning("backend %s: dropping a line of more than %d bytes (max_message_bytes)",
                       self.instance, self._max_line)
        self._protocol_error("oversize")
        gid = wire.reply_id_hint(frame.head)
        if gid is None:
            self._oversize_head = frame.head
        else:
            self._fail_reply(gid, self._too_large())

    def _on_oversize_end(self, frame: OversizeEnd) -> None:
        head, self._oversize_head = self._oversize_head, b""
        if head:
            self._fail_reply(wire.reply_id_hint(head, frame.tail), self._too_large())

    def _too_large(self) -> errors.GatewayError:
        return errors.ResponseTooLarge(
            f"backend {self.backend!r} answered with more than {self._max_line} bytes "
            "(max_message_bytes)", backend=self.backend, limit=self._max_line)

    def _fail_reply(self, gid: int | None, error: errors.GatewayError) -> None:
        """A reply the gateway will not pass on: its call (if it is one) fails now."""
        call = self.pending.pop(gid, None) if gid is not None else None
        if call is None:
            return
        if call.abandoned_at is not None:
            if self.on_settled is not None:
                self.on_settled()
            return
        call.complete(None, error)

    def _protocol_error(self, kind: str) -> None:
        self._bus.emit(BackendProtocolError(self.backend, self.instance, kind))

    def _dispatch(self, line: bytes) -> None:
        if line.startswith(b"\xef\xbb\xbf"):  # a byte order mark: JSON parsers may ignore it
            line = line[3:]
        try:
            env = jsonrpc.decode(line, self._max_depth)
            kind = jsonrpc.classify(env)
        except errors.GatewayError as exc:
            self._on_undecodable(line, exc)
            return
        if kind in ("response", "error"):
            self._on_reply(env)
        elif kind == "notification":
            assert isinstance(env.method, str)
            if env.method == "notifications/progress":
                self._on_progress(env.params)
            elif env.method == "notifications/cancelled":
                try:
                    request_id = decode_cancelled(env.params).requestId
                except (msgspec.ValidationError, msgspec.DecodeError):
                    self._protocol_error("invalid_message")
                    return
                self._handlers.on_cancelled(self, request_id)
            else:
                self._handlers.on_notification(self, env.method, env.params)
        else:
            assert isinstance(env.method, str) and isinstance(env.id, int | str)
            self._handlers.on_request(self, env.id, env.method, env.params)

    def _on_undecodable(self, line: bytes, exc: errors.GatewayError) -> None:
        """A line that is not a message the gateway can pass on: logged and counted.  When the
        line shows a reply's id (read from its first or last bytes: it may not decode at all),
        that call fails now with -32009 instead of waiting for its timeout."""
        if exc.reason in ("invalid_utf8", "too_deep"):
            kind = exc.reason
        else:
            kind = "not_json" if isinstance(exc, errors.ParseError) else "invalid_message"
        LOGGER.warning("backend %s sent a line that is not a valid message (%s: %s): %.200r",
                       self.instance, kind, exc.message, line)
        self._protocol_error(kind)
        self._fail_reply(wire.reply_id_hint(line[:HEAD], line[-HEAD:]), errors.BackendProtocolError(
            f"backend {self.backend!r} sent a reply that cannot be passed on: {exc.message}",
            backend=self.backend, detail=kind))

    def _on_reply(self, env: jsonrpc.Envelope) -> None:
        call = self.pending.get(env.id) if isinstance(env.id, int) else None
        if call is None:
            LOGGER.warning("backend %s answered unknown request id %.100r", self.instance, env.id)
            self._protocol_error("unknown_response")
            return
        del self.pending[call.gid]
        if call.abandoned_at is not None:
            LOGGER.debug("backend %s: dropped late reply to abandoned call %d", self.instance, call.gid)
            if self.on_settled is not None:
                self.on_settled()
            return
        if env.error is not UNSET:
            e = env.error
            call.complete(None, errors.RemoteError(e.code, e.message, None if e.data is UNSET else e.data))
        else:
            assert isinstance(env.result, Raw)
            call.complete(env.result, None)

    def _on_progress(self, params: Raw | UnsetType) -> None:
        try:
            fields = jsonrpc.params_dict(params)
            key = jsonrpc.loads(fields["progressToken"])
        except (KeyError, errors.InvalidRequest, msgspec.DecodeError):
            self._protocol_error("invalid_message")
            return
        call = self._by_token.get(key) if isinstance(key, str) else None
        if call is None or call.on_progress is None or call.done.is_set():
            return  # progress for an unknown or finished token: dropped
        call.on_progress(call.client_token, fields)  # already decoded: the callback re-encodes once
