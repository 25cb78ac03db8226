"""``subscriptions/listen`` (2026-07-28): what a listen asks for and what it is sent (pure).

Theory of operation (mcp-spec-digest §6.1, §10.13-14).  A modern client opts in to server
notifications with one long-lived request, ``subscriptions/listen``, whose
``params.notifications`` names the kinds it wants (:class:`Filter`): ``toolsListChanged``,
``promptsListChanged``, ``resourcesListChanged`` and ``resourceSubscriptions`` (URIs).  The
first message of its stream is ``notifications/subscriptions/acknowledged`` with the subset the
server honours (:func:`acknowledged`); every later one is a notification of a kind it asked for.
Each carries ``_meta["io.modelcontextprotocol/subscriptionId"]`` = the listen request's id
(:func:`tagged`), so several listens can share one connection.  It ends when the client closes
the stream (HTTP) or cancels the request (a byte stream), or when the server tears it down: a
normal result then (:func:`closing_result`).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from msgspec import UNSET, Raw, UnsetType

from gateway import errors
from gateway.protocol import jsonrpc

SUBSCRIPTION_ID_KEY = "io.modelcontextprotocol/subscriptionId"
ACKNOWLEDGED = "notifications/subscriptions/acknowledged"
#: The list kinds of the catalog, by their flag in ``params.notifications``.
LIST_FLAGS = {"toolsListChanged": "tools", "promptsListChanged": "prompts",
              "resourcesListChanged": "resources"}
#: URIs one listen may subscribe to (each holds an upstream subscription while it listens).
MAX_URIS = 256
MAX_URI_CHARS = 4096

RequestId = int | str


@dataclass(frozen=True, slots=True)
class Filter:
    """What one listen asked for: catalog kinds (``"tools"``, ``"prompts"``, ``"resources"``)
    and resource URIs."""

    kinds: frozenset[str] = frozenset()
    uris: tuple[str, ...] = ()

    def wants_uri(self, uri: str) -> bool:
        """Whether ``uri`` is one of its URIs or below one (a sub-resource)."""
        return any(uri_matches(sub, uri) for sub in self.uris)


def uri_matches(subscribed: str, uri: str) -> bool:
    """An update of ``uri`` concerns a subscription to ``subscribed``: the same URI or a
    sub-resource of it."""
    return uri == subscribed or uri.startswith(subscribed.rstrip("/") + "/")


def parse_filter(params: dict[str, Raw]) -> Filter:
    """``params.notifications`` of a listen request.

    Raises:
        InvalidParams: missing, not an object, a flag not a boolean, URIs not a list of strings,
            or more than :data:`MAX_URIS` of them.
    """
    raw = params.get("notifications")
    try:
        wanted = jsonrpc.loads(raw) if raw is not None else None
    except msgspec.DecodeError:
        wanted = None
    if not isinstance(wanted, dict):
        raise errors.InvalidParams("subscriptions/listen: params.notifications must be an object")
    kinds = set()
    for flag, kind in LIST_FLAGS.items():
        value = wanted.get(flag, False)
        if not isinstance(value, bool):
            raise errors.InvalidParams(
                f"subscriptions/listen: notifications.{flag} must be a boolean")
        if value:
            kinds.add(kind)
    uris = wanted.get("resourceSubscriptions", [])
    if not isinstance(uris, list) or not all(isinstance(u, str) and u for u in uris):
        raise errors.InvalidParams(
            "subscriptions/listen: notifications.resourceSubscriptions must be a list of URIs")
    if len(uris) > MAX_URIS or any(len(u) > MAX_URI_CHARS for u in uris):
        raise errors.InvalidParams(
            f"subscriptions/listen: at most {MAX_URIS} resourceSubscriptions of at most "
            f"{MAX_URI_CHARS} characters each", limit=MAX_URIS)
    return Filter(frozenset(kinds), tuple(dict.fromkeys(uris)))


def _tag(sub_id: RequestId) -> dict[str, RequestId]:
    return {SUBSCRIPTION_ID_KEY: sub_id}


def acknowledged(honoured: Filter, sub_id: RequestId) -> bytes:
    """The first message of a listen's stream: the subset of its filter the server honours."""
    notifications: dict[str, object] = {flag: True for flag, kind in LIST_FLAGS.items()
                                        if kind in honoured.kinds}
    if honoured.uris:
        notifications["resourceSubscriptions"] = list(honoured.uris)
    return jsonrpc.encode_notification(ACKNOWLEDGED, jsonrpc.encode_dict(
        {"notifications": notifications, "_meta": _tag(sub_id)}))


def tagged(method: str, params: Raw | UnsetType, sub_id: RequestId) -> bytes:
    """``method`` with ``params`` (passed through) for the listen ``sub_id``: its
    ``_meta`` gains the subscription id."""
    fields: dict[str, Raw] = {}
    if params is not UNSET:
        try:
            fields = jsonrpc.raw_dict(params)
        except (msgspec.DecodeError, msgspec.ValidationError):
            fields = {}
    meta: dict[str, Raw] = {}
    if "_meta" in fields:
        try:
            meta = jsonrpc.raw_dict(fields["_meta"])
        except (msgspec.DecodeError, msgspec.ValidationError):
            meta = {}
    meta[SUBSCRIPTION_ID_KEY] = Raw(msgspec.json.encode(sub_id))
    fields["_meta"] = jsonrpc.encode_dict(meta)
    return jsonrpc.encode_notification(method, jsonrpc.encode_dict(fields))


def closing_result(sub_id: RequestId) -> Raw:
    """The result that ends a listen the server tears down (drain)."""
    return jsonrpc.encode_dict({"resultType": "complete", "_meta": _tag(sub_id)})
