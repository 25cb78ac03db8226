"""The gateway as the MCP client of one child: handshake, list fetching, subscriptions.

Plain functions over a :class:`~gateway.backend.child.ChildConnection`; every request they send
is gateway-internal (never part of an attribution set).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from msgspec import UNSET, Raw, UnsetType

from gateway import __version__, errors
from gateway.backend.child import ChildConnection
from gateway.protocol import jsonrpc, mcp

LOGGER = logging.getLogger(__name__)

#: Pages fetched per list at most (a child that paginates forever is cut off).
MAX_PAGES = 1000

LIST_KINDS = {
    "tools": ("tools/list", "tools"),
    "prompts": ("prompts/list", "prompts"),
    "resources": ("resources/list", "resources"),
    "templates": ("resources/templates/list", "resourceTemplates"),
}


def declared_capabilities(declare: Iterable[str]) -> dict[str, Any]:
    """The client capabilities the gateway declares to a child (what it can route)."""
    declare = set(declare)
    caps: dict[str, Any] = {}
    if "roots" in declare:
        caps["roots"] = {"listChanged": False}
    if "sampling" in declare:
        caps["sampling"] = {}
    if "elicitation" in declare:
        caps["elicitation"] = {"form": {}, "url": {}}
    return caps


async def initialize(child: ChildConnection, *, declare: Iterable[str], client_name: str,
                     timeout: float) -> None:
    """``initialize`` (offering the newest legacy revision) and ``notifications/initialized``."""
    params = jsonrpc.encode_dict({
        "protocolVersion": mcp.LATEST_LEGACY,
        "capabilities": declared_capabilities(declare),
        "clientInfo": {"name": client_name, "version": __version__},
    })
    raw = await child.request("initialize", params, timeout=timeout, internal=True)
    result = mcp.decode_initialize_result(raw)
    if result.protocolVersion not in mcp.LEGACY_VERSIONS:
        LOGGER.warning("backend %s answered protocol %r; continuing", child.instance, result.protocolVersion)
    child.protocol_version = result.protocolVersion
    child.server_capabilities = result.capabilities
    child.notify("notifications/initialized")


async def set_level(child: ChildConnection, level: str, *, timeout: float) -> None:
    if "logging" not in child.server_capabilities:
        return
    try:
        await child.request("logging/setLevel", jsonrpc.encode_dict({"level": level}),
                            timeout=timeout, internal=True)
    except errors.RemoteError as exc:
        LOGGER.info("backend %s refused logging/setLevel: %s", child.instance, exc)


async def subscribe(child: ChildConnection, uri: str, *, timeout: float,
                    method: str = "resources/subscribe") -> None:
    try:
        await child.request(method, jsonrpc.encode_dict({"uri": uri}), timeout=timeout, internal=True)
    except errors.RemoteError as exc:
        LOGGER.warning("backend %s refused %s %s: %s", child.instance, method, uri, exc)


async def fetch_list(child: ChildConnection, kind: str, *, timeout: float) -> list[dict[str, Any]]:
    """Every page of one list (empty when the child lacks the capability or the method)."""
    method, field = LIST_KINDS[kind]
    cap = "resources" if kind == "templates" else kind
    items: list[dict[str, Any]] = []
    if cap not in child.server_capabilities:
        return items
    cursor: str | None = None
    for _ in range(MAX_PAGES):
        params: Raw | UnsetType = UNSET if cursor is None else jsonrpc.encode_dict({"cursor": cursor})
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
