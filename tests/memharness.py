"""The whole gateway in-process on virtual time: ``service.run`` with its backends on scripted
memory connectors and its clients attached as memory streams; no socket, no child process.

Run tests on ``trio.testing.MockClock(autojump_threshold=0)`` (the ``autojump_clock`` fixture).
:func:`running` yields a :class:`Harness` once the daemon is ready and stops it (the real drain)
on exit; :meth:`Harness.connect` gives a :class:`helpers.Client` over a memory stream (bound,
with ``token``, to the principal the daemon's authenticator finds for it).  Waiting
is on the bus (:meth:`Harness.until` re-checks a condition at every event), on a client's own
messages (``Client.wait_for``), or for quiescence (:func:`settle`: every task blocked, so
nothing more is on its way); :func:`elapse` lets virtual time pass.  :func:`fixture_script` is
the memory twin of ``tests/fixtures/fixture_server.py`` (its tools, prompts, resources).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import msgspec
import trio
import trio.testing
import trio_websocket
from helpers import Client, MemoryStream, memory_stream_pair

from gateway import config, errors, service
from gateway.auth.principal import Principal
from gateway.backend.connector import Connector
from gateway.backend.memory import MemoryConnector, MemoryLink, Script, ToolError
from gateway.config import BackendConfig, GatewayConfig
from gateway.core import connection
from gateway.core.connection import MessageStream
from gateway.hub import Hub
from gateway.ops.metrics import GatewayMetrics
from gateway.protocol import jsonrpc

#: Every harness test's hard cap, in virtual seconds.
CAP = 3600.0


def memory_config(backends: str, *, gateway: str = "", extra: str = "") -> GatewayConfig:
    """A config with ``backends`` (TOML tables; ``command`` is never run) and no listener: the
    harness attaches its clients itself."""
    cfg = config.load(f"""
[gateway]
{gateway}
[listen]
websocket = "127.0.0.1:0"
http = "127.0.0.1:0"
[admin]
listen = ""
{extra}
{backends}
""")
    return msgspec.structs.replace(cfg, listen=msgspec.structs.replace(cfg.listen, websocket=None,
                                                                       http=None))


def backend(name: str, **extra: Any) -> str:
    """A [backends.NAME] table for a memory backend (like ``helpers.fixture_backend``)."""
    lines = [f"[backends.{name}]", 'command = "memory"']
    for key, value in extra.items():
        inline = isinstance(value, str) and value.startswith("{")
        lines.append(f"{key} = {value if inline else json.dumps(value)}")
    return "\n".join(lines) + "\n"


class MemorySocket:
    """A client's end of a memory stream with the WebSocket calls :class:`helpers.Client` uses."""

    def __init__(self, stream: MemoryStream) -> None:
        self.stream = stream

    async def send_message(self, message: str | bytes) -> None:
        try:
            await self.stream.send(message.encode() if isinstance(message, str) else message)
        except errors.TransportClosed as exc:
            raise trio_websocket.ConnectionClosed(None) from exc

    async def get_message(self) -> str:
        try:
            data = await self.stream.receive()
        except errors.TransportClosed as exc:
            raise trio_websocket.ConnectionClosed(None) from exc
        assert isinstance(data, bytes)
        return data.decode("utf-8")


class Owner:
    """Stands in for a client session (what the backend layer sees of one), for tests that
    drive a backend without the core."""

    def __init__(self) -> None:
        self.closed = trio.Event()

    def send(self, data: bytes, route: jsonrpc.Route | None = None) -> bool:
        return True

    def cancel_request(self, req: Any, outcome: Any, reason: str) -> None:
        pass


class Harness:
    """The daemon's embedding (:class:`gateway.service.Embedding`): memory connectors by backend
    name, the attached clients, and what a test reads (hub, bus, metrics)."""

    def __init__(self, scripts: dict[str, Script],
                 connectors: dict[str, Connector] | None = None) -> None:
        self.scripts = scripts
        self.given = connectors or {}  # a test's own connectors, by backend name
        self.connectors: dict[str, MemoryConnector] = {}
        self.events: list[Any] = []
        self._hub: Hub | None = None
        self._metrics: GatewayMetrics | None = None
        self._attach: Callable[[MessageStream, Principal | None], None] | None = None
        self._changed = trio.Event()
        self.control = service.Control()
        self.bound = service.Bound()  # the listeners the config asked for (none by default)
        self.draining = trio.Event()  # set when the drain begins (it closes the listeners)

    # ---- the embedding ----------------------------------------------------------------------

    def connector(self, name: str, cfg: BackendConfig) -> Connector:
        if name in self.given:
            return self.given[name]
        if name not in self.connectors:
            self.connectors[name] = MemoryConnector(self.scripts.get(name) or fixture_script())
        return self.connectors[name]

    async def serve(self, hub: Hub, metrics: GatewayMetrics,
                    handler: Callable[[MessageStream], Awaitable[None]],
                    handler_nursery: trio.Nursery, *,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._hub, self._metrics = hub, metrics
        hub.bus.subscribe(self._on_event)

        def attach(stream: MessageStream, principal: Principal | None) -> None:
            if principal is None:
                handler_nursery.start_soon(handler, stream)
                return

            def bind(session: Any) -> None:  # what a listener does once it has authenticated
                session.principal = principal
            handler_nursery.start_soon(partial(connection.serve, hub, stream, "memory",
                                               bind=bind))

        self._attach = attach
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            self._attach = None  # closed by the drain: nothing more is accepted
            self.draining.set()

    def _on_event(self, event: Any) -> None:
        self.events.append(event)
        self._changed.set()
        self._changed = trio.Event()

    # ---- what tests use ---------------------------------------------------------------------

    @property
    def hub(self) -> Hub:
        assert self._hub is not None
        return self._hub

    def links(self, name: str) -> list[MemoryLink]:
        """Every generation of backend ``name``'s fake upstream, oldest first."""
        return self.connectors[name].links

    def link(self, name: str) -> MemoryLink:
        """The newest generation of backend ``name``."""
        return self.connectors[name].links[-1]

    def status(self) -> dict[str, Any]:
        """What ``/status`` shows, as its JSON would decode."""
        return dataclasses.asdict(self.hub.status())

    def instance(self, name: str, index: int = 0) -> dict[str, Any]:
        (b,) = [b for b in self.status()["backends"] if b["name"] == name]
        return dict(b["instances"][index])

    def metrics_text(self) -> str:
        assert self._metrics is not None
        return self._metrics.exposition(None)[0].decode()

    def metric(self, name: str, **labels: str) -> float:
        """One sample of ``/metrics`` (0 when absent)."""
        want = sorted(f'{k}="{v}"' for k, v in labels.items())
        for line in self.metrics_text().splitlines():
            sample, _, value = line.rpartition(" ")
            got = sample.partition("{")[2].rstrip("}")
            if sample.split("{")[0] == name and sorted(got.split(",") if got else []) == want:
                return float(value)
        return 0.0

    async def until(self, predicate: Callable[[], Any]) -> Any:
        """Wait until ``predicate()`` is true, checking it at every bus event; its value."""
        while not (got := predicate()):
            await self._changed.wait()
        return got

    async def principal(self, token: str) -> Principal:
        """Who the daemon's authenticator says the bearer ``token`` is (as a listener would)."""
        assert self.hub.authn is not None
        found = await self.hub.authn.authenticate(f"Bearer {token}")
        assert found is not None, "authentication is not configured"
        return found

    def attach(self, principal: Principal | None = None) -> MemorySocket:
        """A new connection over a memory stream (transport ``memory``): the client's end;
        bound to ``principal`` when given (see :meth:`principal`)."""
        assert self._attach is not None, "the gateway accepts no connection now"
        mine, theirs = memory_stream_pair()
        self._attach(theirs, principal)
        return MemorySocket(mine)

    @asynccontextmanager
    async def connect(self, *, initialize: bool = True, capabilities: dict[str, Any] | None = None,
                      version: str = "2025-11-25",
                      token: str | None = None) -> AsyncIterator[Client]:
        """A client attached over a memory stream (as ``token``'s principal when given),
        initialized unless told not to; closed (EOF) on exit."""
        socket = self.attach(None if token is None else await self.principal(token))
        client = Client(socket)  # type: ignore[arg-type]  # duck-types the WebSocket
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client._reader)
            if initialize:
                await client.initialize(capabilities, version)
            try:
                yield client
            finally:
                nursery.cancel_scope.cancel()
                with trio.CancelScope(shield=True):
                    await socket.stream.aclose()


@asynccontextmanager
async def running(cfg: GatewayConfig, scripts: dict[str, Script] | None = None,
                  connectors: dict[str, Connector] | None = None) -> AsyncIterator[Harness]:
    """Run the daemon on ``cfg`` (each backend on ``connectors[name]``, else on
    ``scripts[name]``, else :func:`fixture_script`)
    until the block ends, then stop it (drain, backends stopped) within :data:`CAP`.  A ``cfg``
    with listeners (not :func:`memory_config`) binds them: ``Harness.bound`` says where."""
    harness = Harness(scripts or {}, connectors)
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            harness.bound = await nursery.start(partial(service.run, cfg, control=harness.control,
                                                        embed=harness))
            try:
                yield harness
            finally:
                harness.control.stop()


async def settle() -> None:
    """Return once every task is blocked: whatever the gateway was doing has been done, and
    nothing more arrives until virtual time moves (what a test checks for absence)."""
    await trio.testing.wait_all_tasks_blocked()


async def elapse(seconds: float) -> None:
    """Let ``seconds`` of virtual time pass (instant on the MockClock)."""
    await trio.sleep(seconds)  # virtual-time: the harness runs on the MockClock


def notes(c: Client, method: str) -> list[dict[str, Any]]:
    return [m for m in c.notifications if m["method"] == method]


# ---- the memory twin of tests/fixtures/fixture_server.py ------------------------------------

_SERIALS = itertools.count(1)
STATIC = ("fixture://static/a", "fixture://static/b")
TEMPLATE, ITEM_PREFIX = "fixture://item/{id}", "fixture://item/"
LEVELS = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")
CAPABILITIES = {"tools": {"listChanged": True}, "prompts": {"listChanged": True},
                "resources": {"subscribe": True, "listChanged": True},
                "logging": {}, "completions": {}}


def text(value: str, is_error: bool = False) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": value}], **({"isError": True} if is_error else {})}


def _extra(link: MemoryLink) -> dict[str, bool]:
    extra: dict[str, bool] = link.state.setdefault(
        "extra", {"tools": False, "prompts": False, "resources": False})
    return extra


def serial(link: MemoryLink) -> int:
    """This generation's number (what ``client_info`` calls ``pid``): new at every restart."""
    number: int = link.state.setdefault("serial", next(_SERIALS))
    return number


async def _ask(link: MemoryLink, method: str, params: dict[str, Any], what: str) -> Any:
    """A server→client request; an error answer ends the call with an isError result."""
    reply = await link.request(method, params)
    if "error" in reply:
        err = reply["error"] or {}
        raise _Abort({**text(f"{what} error {err.get('code')}: {err.get('message')}", True),
                      "structuredContent": {"error": err}})
    return reply.get("result") or {}


class _Abort(Exception):
    def __init__(self, result: dict[str, Any]) -> None:
        super().__init__("aborted")
        self.result = result


Call = Callable[[MemoryLink, dict[str, Any], dict[str, Any]], Awaitable[dict[str, Any]]]


async def t_echo(link: MemoryLink, args: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    return {**text(args["message"]), "structuredContent": {"message": args["message"]}}


async def t_progress(link: MemoryLink, args: dict[str, Any],
                     meta: dict[str, Any]) -> dict[str, Any]:
    steps, delay = int(args["steps"]), float(args.get("delay", 0.01))
    token = meta.get("progressToken")
    for i in range(1, steps + 1):
        await trio.sleep(delay)  # virtual-time: a scripted tool's pace
        if token is not None:
            link.notify("notifications/progress", {"progressToken": token, "progress": i,
                                                   "total": steps})
    return text(args.get("message", "done"))


async def t_sleep(link: MemoryLink, args: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    await trio.sleep(float(args["seconds"]))  # virtual-time: a scripted tool's pace
    return text(args.get("message", "slept"))


async def t_crash(link: MemoryLink, args: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    link.crash(int(args.get("code") or 1))
    await trio.sleep_forever()
    raise AssertionError("unreachable")


async def t_elicit(link: MemoryLink, args: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    await trio.sleep(float(args.get("delay", 0)))  # virtual-time: a scripted tool's pace
    params: dict[str, Any] = {"message": args["message"], "requestedSchema": {
        "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}
    if "nonce" in args:
        params["_meta"] = {"fixture/nonce": args["nonce"]}
    result = await _ask(link, "elicitation/create", params, "elicitation")
    out = {"action": result.get("action"), "content": result.get("content"),
           "message": args["message"]}
    if "nonce" in args:
        out["nonce"] = args["nonce"]
    return text(json.dumps(out))


async def t_sample(link: MemoryLink, args: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    params = {"messages": [{"role": "user", "content": {"type": "text", "text": args["prompt"]}}],
              "maxTokens": 100, "includeContext": "thisServer"}
    return text(json.dumps(await _ask(link, "sampling/createMessage", params, "sampling")))


async def t_roots(link: MemoryLink, args: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    return text(json.dumps(await _ask(link, "roots/list", {}, "roots")))


async def t_notify_list_changed(link: MemoryLink, args: dict[str, Any],
                                meta: dict[str, Any]) -> dict[str, Any]:
    kind, extra = args["kind"], _extra(link)
    if kind not in extra:
        return text(f"invalid kind: {kind!r}", True)
    extra[kind] = not extra[kind]
    link.notify(f"notifications/{kind}/list_changed")
    return text("ok")


async def t_update_resource(link: MemoryLink, args: dict[str, Any],
                            meta: dict[str, Any]) -> dict[str, Any]:
    link.notify("notifications/resources/updated", {"uri": args["uri"]})
    return text("ok")


async def t_log(link: MemoryLink, args: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    params = {"level": args["level"], "logger": "fixture", "data": args["data"]}
    if "after" in args:
        async def later() -> None:
            await trio.sleep(float(args["after"]))  # virtual-time: a scripted tool's pace
            link.notify("notifications/message", params)
        link.start_soon(later)
    else:
        link.notify("notifications/message", params)
    return text("ok")


async def t_client_info(link: MemoryLink, args: dict[str, Any],
                        meta: dict[str, Any]) -> dict[str, Any]:
    init = next(m for m in link.received if m.get("method") == "initialize")
    info = {"capabilities": init["params"].get("capabilities") or {},
            "protocolVersion": link.script.protocol_version,
            "logLevel": link.state.get("log_level"),
            "subscriptions": sorted(link.state.get("subscriptions", set())),
            "pid": serial(link)}
    return text(json.dumps(info))


async def t_big(link: MemoryLink, args: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    return text("x" * int(args["size"]))


async def t_extra_tool(link: MemoryLink, args: dict[str, Any],
                       meta: dict[str, Any]) -> dict[str, Any]:
    return text("extra")


TOOLS: dict[str, Call] = {
    "echo": t_echo, "progress": t_progress, "sleep": t_sleep, "crash": t_crash,
    "elicit": t_elicit, "sample": t_sample, "roots": t_roots,
    "notify_list_changed": t_notify_list_changed, "update_resource": t_update_resource,
    "log": t_log, "client_info": t_client_info, "big": t_big, "extra_tool": t_extra_tool,
}  # fmt: skip


def _tool_names(link: MemoryLink) -> list[str]:
    return [n for n in TOOLS if n != "extra_tool" or _extra(link)["tools"]]


async def m_tools_list(link: MemoryLink, params: dict[str, Any]) -> Any:
    return {"tools": [{"name": n, "inputSchema": {"type": "object"}} for n in _tool_names(link)]}


async def m_tools_call(link: MemoryLink, params: dict[str, Any]) -> Any:
    name = params.get("name", "")
    if name not in _tool_names(link):
        raise ToolError(errors.INVALID_PARAMS, f"Unknown tool: {name!r}")
    try:
        return await TOOLS[name](link, params.get("arguments") or {}, params.get("_meta") or {})
    except _Abort as abort:
        return abort.result


async def m_prompts_list(link: MemoryLink, params: dict[str, Any]) -> Any:
    prompts: list[dict[str, Any]] = [
        {"name": "greet", "description": "Greet someone.",
         "arguments": [{"name": "name", "description": "Who to greet", "required": True}]},
        {"name": "plain", "description": "A prompt without arguments."}]
    if _extra(link)["prompts"]:
        prompts.append({"name": "extra_prompt", "description": "Extra prompt."})
    return {"prompts": prompts}


async def m_prompts_get(link: MemoryLink, params: dict[str, Any]) -> Any:
    name, args = params.get("name"), params.get("arguments") or {}
    if name == "greet":
        if not isinstance(args.get("name"), str):
            raise ToolError(errors.INVALID_PARAMS, "Missing required argument: name")
        said = f"Hello, {args['name']}!"
    elif name == "plain":
        said = "This is a plain prompt."
    elif name == "extra_prompt" and _extra(link)["prompts"]:
        said = "This is the extra prompt."
    else:
        raise ToolError(errors.INVALID_PARAMS, f"Unknown prompt: {name!r}")
    return {"messages": [{"role": "user", "content": {"type": "text", "text": said}}]}


def _uris(link: MemoryLink) -> list[str]:
    return [*STATIC, *(["fixture://extra"] if _extra(link)["resources"] else [])]


async def m_resources_list(link: MemoryLink, params: dict[str, Any]) -> Any:
    return {"resources": [{"uri": uri, "name": uri.rsplit("/", 1)[-1], "mimeType": "text/plain"}
                          for uri in _uris(link)]}


async def m_templates_list(link: MemoryLink, params: dict[str, Any]) -> Any:
    return {"resourceTemplates": [{"uriTemplate": TEMPLATE, "name": "item",
                                   "mimeType": "text/plain"}]}


async def m_resources_read(link: MemoryLink, params: dict[str, Any]) -> Any:
    uri = params.get("uri")
    if uri in _uris(link):
        said = f"content of {uri}"
    elif isinstance(uri, str) and uri.startswith(ITEM_PREFIX) and uri != ITEM_PREFIX:
        said = f"item {uri[len(ITEM_PREFIX):]}"
    else:
        raise ToolError(-32002, "Resource not found")
    return {"contents": [{"uri": uri, "mimeType": "text/plain", "text": said}]}


async def m_subscribe(link: MemoryLink, params: dict[str, Any], subscribe: bool = True) -> Any:
    if not isinstance(params.get("uri"), str):
        raise ToolError(errors.INVALID_PARAMS, "uri must be a string")
    subscriptions: set[str] = link.state.setdefault("subscriptions", set())
    (subscriptions.add if subscribe else subscriptions.discard)(params["uri"])
    return {}


async def m_unsubscribe(link: MemoryLink, params: dict[str, Any]) -> Any:
    return await m_subscribe(link, params, subscribe=False)


async def m_set_level(link: MemoryLink, params: dict[str, Any]) -> Any:
    if params.get("level") not in LEVELS:
        raise ToolError(errors.INVALID_PARAMS, f"Invalid log level: {params.get('level')!r}")
    link.state["log_level"] = params["level"]
    return {}


async def m_complete(link: MemoryLink, params: dict[str, Any]) -> Any:
    ref, arg = params.get("ref") or {}, params.get("argument") or {}
    values: list[str] = []
    if ref == {"type": "ref/prompt", "name": "greet"} and arg.get("name") == "name":
        values = ["Alice", "Bob"]
    elif ref == {"type": "ref/resource", "uri": TEMPLATE} and arg.get("name") == "id":
        values = ["1", "2", "3"]
    values = [v for v in values if v.startswith(str(arg.get("value", "")))]
    return {"completion": {"values": values, "total": len(values), "hasMore": False}}


def fixture_script(**script: Any) -> Script:
    """A :class:`Script` doing what the fixture server does (``script``: other Script fields,
    e.g. ``answer_pings=False``, ``start_delay``)."""
    return Script(capabilities=CAPABILITIES, methods={
        "tools/list": m_tools_list, "tools/call": m_tools_call,
        "prompts/list": m_prompts_list, "prompts/get": m_prompts_get,
        "resources/list": m_resources_list, "resources/templates/list": m_templates_list,
        "resources/read": m_resources_read, "resources/subscribe": m_subscribe,
        "resources/unsubscribe": m_unsubscribe, "logging/setLevel": m_set_level,
        "completion/complete": m_complete}, **script)


def sent(link: MemoryLink, method: str) -> list[dict[str, Any]]:
    """Every ``method`` message the gateway sent this generation (the memory wire tap)."""
    return [m for m in link.received if m.get("method") == method]
