"""The MCP facts the gateway acts on: revisions, methods, capabilities, typed params.

Only the messages the gateway inspects are typed here; everything else stays Raw.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

import msgspec
from msgspec import UNSET, Raw, UnsetType

from gateway.protocol import jsonrpc

T = TypeVar("T")

#: Legacy (``initialize``-based) revisions the gateway speaks toward clients, oldest first.
LEGACY_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
LATEST_LEGACY = LEGACY_VERSIONS[-1]

LOG_LEVELS = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")
LOG_RANK = {level: rank for rank, level in enumerate(LOG_LEVELS)}

#: Methods used as metric labels; anything else is ``other`` (label values stay bounded).
KNOWN_METHODS = frozenset(
    {
        "initialize",
        "ping",
        "tools/list",
        "tools/call",
        "prompts/list",
        "prompts/get",
        "resources/list",
        "resources/templates/list",
        "resources/read",
        "resources/subscribe",
        "resources/unsubscribe",
        "completion/complete",
        "logging/setLevel",
        "elicitation/create",
        "sampling/createMessage",
        "roots/list",
        "subscriptions/listen",
    }
)


#: A method's metric label by its name (``METHOD_LABELS.get(method, "other")``: no call).
METHOD_LABELS = {method: method for method in KNOWN_METHODS}


def negotiate_version(requested: object) -> str:
    """The revision the gateway answers to a client's ``initialize``."""
    if isinstance(requested, str) and requested in LEGACY_VERSIONS:
        return requested
    return LATEST_LEGACY


class Implementation(msgspec.Struct, omit_defaults=True):
    name: str = ""
    version: str = ""


class InitializeParams(msgspec.Struct, omit_defaults=True):
    protocolVersion: str = ""
    capabilities: dict[str, Any] = msgspec.field(default_factory=dict)
    clientInfo: Implementation = msgspec.field(default_factory=Implementation)


class InitializeResult(msgspec.Struct, omit_defaults=True):
    protocolVersion: str
    capabilities: dict[str, Any] = msgspec.field(default_factory=dict)
    serverInfo: Implementation = msgspec.field(default_factory=Implementation)
    instructions: str | UnsetType = UNSET


class CancelledParams(msgspec.Struct, omit_defaults=True):
    requestId: int | str
    reason: str | UnsetType = UNSET


class ListPage(msgspec.Struct, omit_defaults=True):
    """One page of ``tools/list``-style results with the items decoded as plain dicts."""

    nextCursor: str | UnsetType | None = UNSET
    tools: list[dict[str, Any]] | UnsetType = UNSET
    prompts: list[dict[str, Any]] | UnsetType = UNSET
    resources: list[dict[str, Any]] | UnsetType = UNSET
    resourceTemplates: list[dict[str, Any]] | UnsetType = UNSET


class ClientCaps:
    """What a client declared at ``initialize``, queried by the routing code."""

    __slots__ = ("elicitation_form", "elicitation_url", "raw", "roots", "sampling")

    def __init__(self, caps: dict[str, Any]) -> None:
        self.raw = caps
        elicitation = caps.get("elicitation")
        if isinstance(elicitation, dict):
            # 2025-06-18 declared ``elicitation: {}``; 2025-11-25 says ``{}`` means form.
            self.elicitation_form = "form" in elicitation or not elicitation
            self.elicitation_url = "url" in elicitation
        else:
            self.elicitation_form = self.elicitation_url = False
        self.sampling = isinstance(caps.get("sampling"), dict)
        self.roots = isinstance(caps.get("roots"), dict)

    def allows(self, method: str, params: dict[str, Any] | None = None) -> bool:
        if method == "elicitation/create":
            mode = (params or {}).get("mode", "form")
            return self.elicitation_url if mode == "url" else self.elicitation_form
        if method == "sampling/createMessage":
            return self.sampling
        if method == "roots/list":
            return self.roots
        return False

    def has_capability(self, method: str) -> bool:
        if method == "elicitation/create":
            return self.elicitation_form or self.elicitation_url
        return self.allows(method)


#: A client that declared no capabilities (shared: a ``ClientCaps`` is never changed).
NO_CAPS = ClientCaps({})


def client_caps(caps: dict[str, Any]) -> ClientCaps:
    """What ``caps`` declare (:data:`NO_CAPS` for none)."""
    return ClientCaps(caps) if caps else NO_CAPS


_init_params = msgspec.json.Decoder(InitializeParams)
_init_result = msgspec.json.Decoder(InitializeResult)
_cancelled = msgspec.json.Decoder(CancelledParams)
_list_page = msgspec.json.Decoder(ListPage)


def _decode(decoder: msgspec.json.Decoder[T], raw: Raw | bytes) -> T:
    """``decoder.decode(raw)``; unpaired surrogate escapes (which msgspec refuses) become U+FFFD
    in what the gateway reads for itself."""
    try:
        return decoder.decode(raw)
    except msgspec.DecodeError:
        fixed = jsonrpc.replace_unpaired_surrogates(raw)
        if fixed == bytes(raw):
            raise
        return decoder.decode(fixed)


def decode_initialize_params(raw: Raw | UnsetType) -> InitializeParams:
    return _decode(_init_params, raw if raw is not UNSET else b"{}")


def decode_initialize_result(raw: Raw) -> InitializeResult:
    return _decode(_init_result, raw)


def decode_cancelled(raw: Raw | UnsetType) -> CancelledParams:
    return _decode(_cancelled, raw if raw is not UNSET else b"{}")


def decode_list_page(raw: Raw) -> ListPage:
    return _decode(_list_page, raw)


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
