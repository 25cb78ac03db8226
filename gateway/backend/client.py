"""The gateway as the MCP client of one child: handshake, list fetching, subscriptions.

Plain functions over a :class:`~gateway.backend.child.ChildConnection`; every request they send
is gateway-internal (never part of an attribution set).

The handshake (:func:`open_child`) follows the backend's ``protocol_mode``: ``initialize`` for a
legacy child, ``server/discover`` for a modern (2026-07-28) one, which has no handshake at all:
every request to it, the gateway's own ones too, carries the modern ``_meta`` envelope
(:attr:`ChildConnection.envelope`).  The ``prefer_*`` modes fall back to the other era when the
child says it does not speak the first one; the era found is pinned on the child
(:attr:`ChildConnection.era`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

from msgspec import UNSET, Raw, UnsetType

from gateway import __version__, errors
from gateway.backend.child import ChildConnection
from gateway.protocol import era, jsonrpc, mcp
from gateway.protocol.era import Era
from gateway.protocol.mcp import declared_capabilities

#: The share of ``start_timeout`` that the first probe of a ``prefer_*`` mode may take before
#: the other era is tried (a legacy child may never answer ``server/discover``).
PROBE_SHARE = 0.5

LOGGER = logging.getLogger(__name__)

#: Pages fetched per list at most (a child that paginates forever is cut off).
MAX_PAGES = 1000

LIST_KINDS = {
    "tools": ("tools/list", "tools"),
    "prompts": ("prompts/list", "prompts"),
    "resources": ("resources/list", "resources"),
    "templates": ("resources/templates/list", "resourceTemplates"),
}


async def initialize(child: ChildConnection, *, declare: Iterable[str], client_name: str,
                     timeout: float) -> None:  # noqa: ASYNC109 - the router's call deadline (CallTimeout), not a cancel scope
    """``initialize`` (offering the newest legacy revision) and ``notifications/initialized``."""
    params = jsonrpc.encode_dict({
        "protocolVersion": mcp.LATEST_LEGACY,
        "capabilities": declared_capabilities(declare),
        "clientInfo": {"name": client_name, "version": __version__},
    })
    raw = await child.request("initialize", params, timeout=timeout, internal=True)
    result = mcp.decode_initialize_result(raw)
    if result.protocolVersion not in mcp.LEGACY_VERSIONS:
        LOGGER.warning("backend %s answered protocol %r; continuing", child.instance,
                       result.protocolVersion)
    child.protocol_version = result.protocolVersion
    child.server_capabilities = result.capabilities
    child.era = Era.LEGACY
    child.notify("notifications/initialized")


class NotModern(errors.GatewayError):
    """A child's answer to ``server/discover`` says it does not speak the modern era."""

    code = errors.BACKEND_PROTOCOL_ERROR


async def discover(child: ChildConnection, *, declare: Iterable[str], client_name: str,
                   timeout: float) -> None:  # noqa: ASYNC109 - the router's call deadline (CallTimeout), not a cancel scope
    """``server/discover`` with the modern envelope; pins the child modern when it supports
    2026-07-28.

    Raises:
        NotModern: its result names no revision the gateway speaks as a modern client.
        RemoteError: it answered an error (-32601: a legacy child); CallTimeout.
    """
    env = era.envelope(declared_capabilities(declare),
                       client_info={"name": client_name, "version": __version__})
    params = jsonrpc.encode_dict({"_meta": env})
    try:
        raw = await child.request("server/discover", params, timeout=timeout, internal=True)
    except errors.RemoteError as exc:
        # -32022 naming a revision the gateway speaks (the one it sent, when a server refuses
        # a first request for its own reasons): asked again once, at once, not after a backoff
        if exc.code != errors.UNSUPPORTED_VERSION or not era.speaks_modern(
                exc.remote_data.get("supported") if isinstance(exc.remote_data, dict) else None):
            raise
        LOGGER.info("backend %s refused %s (%s) naming it supported; asking once more",
                    child.instance, era.LATEST_MODERN, exc)
        raw = await child.request("server/discover", params, timeout=timeout, internal=True)
    result = jsonrpc.loads(raw)
    supported = result.get("supportedVersions") if isinstance(result, dict) else None
    if not era.speaks_modern(supported):
        raise NotModern(f"backend {child.backend!r} answered server/discover without a revision "
                        f"the gateway speaks (supportedVersions {supported!r}, "
                        f"wanted {era.LATEST_MODERN})")
    caps = result.get("capabilities")
    child.protocol_version = era.LATEST_MODERN
    child.server_capabilities = caps if isinstance(caps, dict) else {}
    child.era = Era.MODERN
    child.envelope = env


def _modern_refusal(exc: errors.GatewayError) -> bool:
    """An answer to ``server/discover`` that says "not modern": the child is legacy."""
    if isinstance(exc, NotModern):
        return True
    return isinstance(exc, errors.RemoteError) and not era.speaks_modern(
        exc.remote_data.get("supported") if isinstance(exc.remote_data, dict) else None)


async def open_child(child: ChildConnection, *, mode: str, declare: Iterable[str], client_name: str,
                     timeout: float) -> None:  # noqa: ASYNC109 - the router's call deadline (CallTimeout), not a cancel scope
    """Open the child in the era its backend's ``protocol_mode`` asks for (see the module's
    docstring); the other era is tried only in a ``prefer_*`` mode and only when the child's
    answer says it does not speak the first (a probe that times out in ``prefer_modern`` counts
    as legacy, as the spec's era detection says).

    Raises:
        RemoteError, NotModern, CallTimeout: the era(s) the mode allows all failed.
    """
    declare = tuple(declare)
    if mode == "legacy_only":
        await initialize(child, declare=declare, client_name=client_name, timeout=timeout)
    elif mode == "modern_only":
        await discover(child, declare=declare, client_name=client_name, timeout=timeout)
    elif mode == "prefer_modern":
        try:
            await discover(child, declare=declare, client_name=client_name,
                           timeout=timeout * PROBE_SHARE)
        except (errors.RemoteError, NotModern, errors.CallTimeout) as exc:
            if isinstance(exc, errors.RemoteError) and not _modern_refusal(exc):
                raise  # a modern error (-32022 naming a modern version we lack): no fallback
            LOGGER.info("backend %s does not speak %s (%s); opening it with initialize",
                        child.instance, era.LATEST_MODERN, exc)
            await initialize(child, declare=declare, client_name=client_name, timeout=timeout)
    else:  # prefer_legacy
        try:
            await initialize(child, declare=declare, client_name=client_name, timeout=timeout)
        except errors.RemoteError as exc:
            if not era.refuses_legacy(exc.code, exc.remote_data):
                raise
            LOGGER.info("backend %s refused initialize (%s); trying server/discover (%s)",
                        child.instance, exc, era.LATEST_MODERN)
            await discover(child, declare=declare, client_name=client_name, timeout=timeout)


def listen_filter(child: ChildConnection, uris: list[str] | None = None) -> dict[str, Any]:
    """What ``subscriptions/listen`` asks a modern child for: the list changes it announces
    (``listChanged`` capabilities) and updates of ``uris`` (when it has
    ``resources.subscribe``); empty for a legacy child (it just sends list_changed)."""
    if child.era is not Era.MODERN:
        return {}
    caps = child.server_capabilities
    wanted: dict[str, Any] = {
        f"{kind}ListChanged": True for kind in ("tools", "prompts", "resources")
        if isinstance(caps.get(kind), dict) and caps[kind].get("listChanged")}
    resources = caps.get("resources")
    if uris and isinstance(resources, dict) and resources.get("subscribe"):
        wanted["resourceSubscriptions"] = list(uris)
    return wanted


async def listen(child: ChildConnection, wanted: dict[str, Any]) -> None:
    """``subscriptions/listen`` on a modern child, open until the child ends it (returns) or
    the caller is cancelled (the child is told with ``notifications/cancelled``)."""
    await child.request("subscriptions/listen", _params(child, {"notifications": wanted}),
                        timeout=math.inf, internal=True)


def _params(child: ChildConnection, fields: dict[str, Any] | None = None) -> Raw | UnsetType:
    """Params of a gateway-internal request: with the modern envelope for a modern child."""
    if child.envelope is not None:
        return jsonrpc.encode_dict({**(fields or {}), "_meta": child.envelope})
    return UNSET if fields is None else jsonrpc.encode_dict(fields)


async def set_level(child: ChildConnection, level: str, *, timeout: float) -> None:  # noqa: ASYNC109 - the router's call deadline (CallTimeout), not a cancel scope
    if "logging" not in child.server_capabilities or child.era is Era.MODERN:
        return  # a modern child gets the level per request (logLevel in the envelope)
    try:
        await child.request("logging/setLevel", jsonrpc.encode_dict({"level": level}),
                            timeout=timeout, internal=True)
    except errors.RemoteError as exc:
        LOGGER.info("backend %s refused logging/setLevel: %s", child.instance, exc)


async def subscribe(child: ChildConnection, uri: str, *, timeout: float,  # noqa: ASYNC109 - the router's call deadline (CallTimeout), not a cancel scope
                    method: str = "resources/subscribe") -> None:
    if child.era is Era.MODERN:  # resources/subscribe does not exist there: the listen's filter
        return
    try:
        await child.request(method, jsonrpc.encode_dict({"uri": uri}), timeout=timeout,
                            internal=True)
    except errors.RemoteError as exc:
        LOGGER.warning("backend %s refused %s %s: %s", child.instance, method, uri, exc)


async def fetch_list(child: ChildConnection, kind: str, *, timeout: float) -> list[dict[str, Any]]:  # noqa: ASYNC109 - the router's call deadline (CallTimeout), not a cancel scope
    """Every page of one list (empty when the child lacks the capability or the method)."""
    method, field = LIST_KINDS[kind]
    cap = "resources" if kind == "templates" else kind
    items: list[dict[str, Any]] = []
    if cap not in child.server_capabilities:
        return items
    cursor: str | None = None
    for _ in range(MAX_PAGES):
        params = _params(child, None if cursor is None else {"cursor": cursor})
        try:
            raw = await child.request(method, params, timeout=timeout, internal=True)
        except errors.RemoteError as exc:
            if exc.code == errors.METHOD_NOT_FOUND:
                break
            raise
        page = mcp.decode_list_page(raw)
        got = getattr(page, field)
        if got is not UNSET:
            items.extend(got)
        cursor = page.nextCursor if isinstance(page.nextCursor, str) and page.nextCursor else None
        if cursor is None:
            break
    return items
