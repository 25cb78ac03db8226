"""The ``memory`` connector: an in-process fake upstream, driven by a :class:`Script` (tests).

Each link is one generation of a fake MCP server that runs as tasks of :meth:`MemoryLink.run`:
it answers ``initialize``, ``ping`` and ``tools/list``, runs the script's tools (which may
sleep, send garbage, crash the upstream or ask the client something: :meth:`MemoryLink.request`)
and any other method the script names (``Script.methods``: prompts, resources, a list of its own).
A request named by ``notifications/cancelled`` is never answered (its task is cancelled; a
question it was waiting on is withdrawn).  No process, no pipe: a message is handed over as
bytes, so supervision, routing and the session above run exactly as for ``stdio``.  It is
chosen in code (``Hub(..., connectors=...)``, ``service.run(..., embed=...)``), never by config.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from gateway import errors
from gateway.backend.connector import LinkContext, LinkEnd, Receiver
from gateway.protocol import mcp

#: A tool: given the link (the upstream) and the call's arguments, returns the result or raises
#: :class:`ToolError` (answered as a JSON-RPC error).
Tool = Callable[["MemoryLink", dict[str, Any]], Awaitable[Any]]
#: A request method: given the link and the request's params, its result (or ToolError).
Method = Callable[["MemoryLink", dict[str, Any]], Awaitable[Any]]
#: A notification from the gateway: given the link and its params.
Notified = Callable[["MemoryLink", dict[str, Any]], None]


class ToolError(Exception):
    """A tool's JSON-RPC error answer."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


async def echo(link: MemoryLink, args: dict[str, Any]) -> Any:
    """The default tool: its arguments back as text."""
    return {"content": [{"type": "text", "text": json.dumps(args, sort_keys=True)}]}


@dataclass
class Script:
    """What every generation of the fake upstream does."""

    tools: dict[str, Tool] = field(default_factory=lambda: {"echo": echo})
    capabilities: dict[str, Any] = field(default_factory=lambda: {"tools": {}})
    protocol_version: str = mcp.LATEST_LEGACY
    start_delay: float = 0.0  # before it answers initialize
    lifetime: float = math.inf  # seconds after opening until it crashes with exit_code
    exit_code: int = 1
    answer_pings: bool = True  # False: health pings go unanswered
    methods: dict[str, Method] = field(default_factory=dict)  # before the built-in answers
    notifications: dict[str, Notified] = field(default_factory=dict)


class MemoryConnector:
    """Opens fake upstreams that follow ``script``; ``links`` keeps every one opened."""

    kind = "memory"
    origin = None

    def __init__(self, script: Script | None = None) -> None:
        self.script = script if script is not None else Script()
        self.links: list[MemoryLink] = []

    def refresh(self) -> None:
        pass

    async def open(self, ctx: LinkContext) -> MemoryLink:
        link = MemoryLink(ctx, self.script)
        self.links.append(link)
        return link


class MemoryLink:
    """One generation of the fake upstream: the gateway's side of the link and the fake's."""

    kind = "memory"
    pid = None

    def __init__(self, ctx: LinkContext, script: Script) -> None:
        self._ctx = ctx
        self.script = script
        self.buffers = ctx.buffers  # nothing is ever queued: messages are handed over at once
        self.max_queued = ctx.max_queued
        self.closed: errors.GatewayError | None = None
        self.last_error: str | None = None
        self.received: list[dict[str, Any]] = []  # every message the gateway sent, decoded
        self.returncode: int | None = None
        self._inbox: list[dict[str, Any]] = []
        self._inbox_ready = trio.Event()
        self._receiver: Receiver | None = None
        self._scope = trio.CancelScope()
        self._ids = itertools.count(1)
        self._asked: dict[int, trio.MemorySendChannel[dict[str, Any]]] = {}
        self._running: dict[str, trio.CancelScope] = {}  # requests being answered, by id
        self.state: dict[str, Any] = {}  # this generation's own state, for the script
        self._nursery: trio.Nursery | None = None

    @property
    def origin(self) -> str:
        return f"memory:{self._ctx.backend}"

    # ---- the gateway's side -----------------------------------------------------------------

    def send(self, data: bytes, gid: int | None = None) -> None:
        if self.closed is not None:
            raise errors.NotDelivered(self.closed.message, **self.closed.data)
        message = json.loads(data)
        self.received.append(message)
        self._inbox.append(message)
        self._inbox_ready.set()

    def fits(self, size: int) -> bool:
        return True

    def fail(self, error: errors.GatewayError) -> None:
        if self.closed is None:
            self.closed = error
        self.buffers.close()

    async def run(self, receiver: Receiver) -> None:
        """Serve as the fake upstream until it crashes (``receiver.ended()``) or is cancelled."""
        self._receiver = receiver
        if self.returncode is not None:  # crashed before it ran
            receiver.ended()
        with self._scope:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                with trio.move_on_after(self.script.lifetime):
                    while True:
                        if not self._inbox:
                            self._inbox_ready = trio.Event()
                            await self._inbox_ready.wait()
                        batch, self._inbox = self._inbox, []
                        for message in batch:
                            self._take(message, nursery)
                self.crash(self.script.exit_code)
        await trio.sleep_forever()  # ended: the instance closes the link

    async def close(self) -> LinkEnd:
        if self.returncode is None:
            self.returncode = 0  # stopped: a fake upstream always exits cleanly
            self._scope.cancel()
        rc = self.returncode
        return LinkEnd(f"exit code {rc}", crashed=rc != 0, returncode=rc)

    # ---- the fake upstream's side -----------------------------------------------------------

    def crash(self, code: int = 1) -> None:
        """The upstream exits now with ``code``: nothing more is read or answered."""
        if self.returncode is not None:
            return
        self.returncode = code
        self.last_error = f"exit code {code}"
        self.closed = errors.BackendExited(f"backend {self._ctx.backend!r} exited",
                                           backend=self._ctx.backend, retryable=True)
        self._scope.cancel()
        if self._receiver is not None:
            self._receiver.ended()

    def start_soon(self, work: Callable[[], Awaitable[object]]) -> None:
        """Run ``work`` beside the requests (it ends with this generation)."""
        assert self._nursery is not None, "the link is not running"
        self._nursery.start_soon(work)

    def send_raw(self, line: bytes) -> None:
        """Hand the gateway one message as bytes (garbage included)."""
        if self.returncode is None and self._receiver is not None:
            self._receiver.message(line)

    def send_message(self, message: dict[str, Any]) -> None:
        self.send_raw(json.dumps({"jsonrpc": "2.0", **message}).encode())

    def notify(self, method: str, params: dict[str, Any] | None = None) -> None:
        self.send_message({"method": method, **({} if params is None else {"params": params})})

    async def request(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Ask the client something (a server→client request); its reply, decoded."""
        rid = next(self._ids)
        send, receive = trio.open_memory_channel[dict[str, Any]](1)
        self._asked[rid] = send
        self.send_message({"id": f"s{rid}", "method": method, "params": params or {}})
        try:
            return await receive.receive()
        except trio.Cancelled:  # the call that asked was cancelled (or the upstream crashed)
            self.notify("notifications/cancelled", {"requestId": f"s{rid}"})
            raise
        finally:
            del self._asked[rid]

    def _take(self, message: dict[str, Any], nursery: trio.Nursery) -> None:
        method = message.get("method")
        if method is None:  # a reply to one of our requests
            rid = str(message.get("id", ""))
            channel = self._asked.get(int(rid[1:])) if rid[1:].isdigit() else None
            if channel is not None:
                channel.send_nowait(message)
            return
        params = message.get("params") or {}
        if "id" in message:
            scope = self._running[json.dumps(message["id"])] = trio.CancelScope()
            nursery.start_soon(self._answer, message, scope)
            return
        if method == "notifications/cancelled":
            cancelled = self._running.get(json.dumps(params.get("requestId")))
            if cancelled is not None:
                cancelled.cancel()
        notified = self.script.notifications.get(method)
        if notified is not None:
            notified(self, params)

    async def _answer(self, message: dict[str, Any], scope: trio.CancelScope) -> None:
        method, rid = message["method"], message["id"]
        params = message.get("params") or {}
        try:
            with scope:
                try:
                    result = await self._result(method, params)
                except ToolError as exc:
                    self.send_message({"id": rid, "error": {"code": exc.code,
                                                            "message": str(exc)}})
                    return
                if result is not None:
                    self.send_message({"id": rid, "result": result})
        finally:
            self._running.pop(json.dumps(rid), None)

    async def _result(self, method: str, params: dict[str, Any]) -> Any:
        script = self.script
        if method in script.methods:
            return await script.methods[method](self, params)
        if method == "initialize":
            await trio.sleep(script.start_delay)
            return {"protocolVersion": script.protocol_version,
                    "capabilities": script.capabilities,
                    "serverInfo": {"name": "memory", "version": "1"}}
        if method == "ping":
            return {} if script.answer_pings else None
        if method == "tools/list":
            return {"tools": [{"name": name, "inputSchema": {"type": "object"}}
                              for name in script.tools]}
        if method == "tools/call":
            tool = script.tools.get(params.get("name", ""))
            if tool is None:
                raise ToolError(errors.INVALID_PARAMS, f"unknown tool {params.get('name')!r}")
            return await tool(self, params.get("arguments") or {})
        raise ToolError(errors.METHOD_NOT_FOUND, f"method {method!r} not found")
