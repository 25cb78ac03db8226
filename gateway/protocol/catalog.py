"""The merged catalog: every backend's tools, prompts and resources under one namespace.

Tools and prompts are exposed as ``<prefix><separator><name>``, made valid for strict clients
(``^[a-zA-Z0-9_-]{1,64}$``): invalid characters become ``_``, and a name too long or altered is
shortened and suffixed with a hash of the original.  The way back to ``(backend, name)`` is a
table lookup, never a split.  Collisions are resolved deterministically (config order, then
sorted names; later ones get a hash suffix) and reported in ``warnings``, or raise
:class:`CatalogConflict` under ``strict=True``.  Resources keep their URIs, routed by table.
A backend's :class:`Exposed` filters apply before the merge: what they drop is neither listed
nor routed.  Lists are paginated with the gateway's own opaque cursors.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

import msgspec

VALID_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_INVALID_CHARS = re.compile(r"[^a-zA-Z0-9_-]")
MAX_NAME = 64


class CatalogConflict(Exception):
    """Two backends expose the same name (a start-up error naming both)."""


@dataclass(frozen=True, slots=True)
class Route:
    backend: str
    name: str  # the backend's own name for the tool/prompt
    #: ``name`` as JSON, what a call forwarded to the backend carries (encoded once, here)
    wire: msgspec.Raw = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "wire", msgspec.Raw(msgspec.json.encode(self.name)))


@dataclass(frozen=True, slots=True)
class Exposure:
    """Which of a backend's items of one kind the gateway exposes: those ``include`` matches
    (empty: all) and ``exclude`` does not."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def admits(self, name: str) -> bool:
        if self.include and not any(fnmatch.fnmatchcase(name, g) for g in self.include):
            return False
        return not any(fnmatch.fnmatchcase(name, g) for g in self.exclude)


@dataclass(frozen=True, slots=True)
class Exposed:
    """A backend's exposure filters, per kind (resources: URIs and URI templates)."""

    tools: Exposure = Exposure()
    prompts: Exposure = Exposure()
    resources: Exposure = Exposure()


EVERYTHING = Exposed()


def _exposed(items: list[dict[str, Any]], field: str, exposure: Exposure) -> list[dict[str, Any]]:
    if not exposure.include and not exposure.exclude:
        return items
    return [i for i in items if isinstance(i.get(field), str) and exposure.admits(i[field])]


@dataclass(slots=True)
class BackendLists:
    tools: list[dict[str, Any]] = field(default_factory=list)
    prompts: list[dict[str, Any]] = field(default_factory=list)
    resources: list[dict[str, Any]] = field(default_factory=list)
    templates: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True)
class Catalog:
    tools: list[dict[str, Any]] = field(default_factory=list)
    prompts: list[dict[str, Any]] = field(default_factory=list)
    resources: list[dict[str, Any]] = field(default_factory=list)
    templates: list[dict[str, Any]] = field(default_factory=list)
    tool_routes: dict[str, Route] = field(default_factory=dict)
    #: a tool's name as JSON (as a client writes it, unescaped) -> (name, route): a call's name
    #: is found without decoding it
    tool_wire: dict[bytes, tuple[str, Route]] = field(default_factory=dict)
    prompt_routes: dict[str, Route] = field(default_factory=dict)
    resource_routes: dict[str, str] = field(default_factory=dict)  # uri -> backend
    template_routes: list[tuple[re.Pattern[str], str, str]] = field(default_factory=list)
    tool_defs: dict[str, dict[str, Any]] = field(default_factory=dict)  # exposed -> tool dict

    def route_resource(self, uri: str) -> str | None:
        """The backend serving ``uri``: exact URI first, then the first matching template."""
        backend = self.resource_routes.get(uri)
        if backend is not None:
            return backend
        for pattern, backend, _template in self.template_routes:
            if pattern.fullmatch(uri):
                return backend
        return None

    def route_template(self, template: str) -> str | None:
        for _pattern, backend, t in self.template_routes:
            if t == template:
                return backend
        return self.route_resource(template)


def backends_of(catalog: Catalog, tools: list[dict[str, Any]], prompts: list[dict[str, Any]],
                resources: list[dict[str, Any]], templates: list[dict[str, Any]]) -> frozenset[str]:
    """The backends that serve something of these lists (a caller's view of ``catalog``)."""
    out: set[str] = set()
    for items, field_name, route in (
            (tools, "name", lambda n: getattr(catalog.tool_routes.get(n), "backend", None)),
            (prompts, "name", lambda n: getattr(catalog.prompt_routes.get(n), "backend", None)),
            (resources, "uri", catalog.resource_routes.get),
            (templates, "uriTemplate", catalog.route_template)):
        for item in items:
            key = item.get(field_name)
            backend = route(key) if isinstance(key, str) else None
            if backend is not None:
                out.add(backend)
    return frozenset(out)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def expose_name(prefix: str, separator: str, name: str) -> str:
    """The client-facing name for a backend's tool or prompt ``name``."""
    full = f"{prefix}{separator}{name}" if prefix else name
    if VALID_NAME.fullmatch(full):
        return full
    suffix = "-" + _digest(full)
    cleaned = _INVALID_CHARS.sub("_", full) or "_"
    return cleaned[: MAX_NAME - len(suffix)] + suffix


def _merge_named(
    kind: str,
    items_by_backend: list[tuple[str, str, list[dict[str, Any]]]],
    separator: str,
    strict: bool,
    warnings: list[str],
) -> tuple[list[dict[str, Any]], dict[str, Route]]:
    exposed: list[dict[str, Any]] = []
    routes: dict[str, Route] = {}
    for backend, prefix, items in items_by_backend:
        seen_here: set[str] = set()
        for item in sorted(items, key=lambda i: str(i.get("name", ""))):
            name = item.get("name")
            if not isinstance(name, str) or not name or name in seen_here:
                warnings.append(f"backend {backend!r}: skipped {kind} with a missing or duplicate "
                                "name")
                continue
            seen_here.add(name)
            public = expose_name(prefix, separator, name)
            if public in routes:
                other = routes[public]
                message = (
                    f"{kind} name {public!r} of backend {backend!r} ({name!r}) collides with "
                    f"backend {other.backend!r} ({other.name!r})"
                )
                if strict and other.backend != backend:
                    raise CatalogConflict(
                        message + "; give one of them a distinct `prefix` in its [backends.*] table"
                    )
                n = 1
                candidate = public
                while candidate in routes:
                    suffix = f"-{_digest(f'{backend}/{name}/{n}')}"
                    candidate = public[: MAX_NAME - len(suffix)] + suffix
                    n += 1
                warnings.append(f"{message}; exposed as {candidate!r}")
                public = candidate
            routes[public] = Route(backend, name)
            exposed.append({**item, "name": public})
    return exposed, routes


def template_regex(template: str) -> re.Pattern[str]:
    """A regex matching the URIs an RFC 6570 template (levels 1–3, roughly) can produce."""
    out: list[str] = []
    pos = 0
    for m in re.finditer(r"\{([^}]*)\}", template):
        out.append(re.escape(template[pos : m.start()]))
        expr = m.group(1)
        if expr[:1] in ("+", "#"):
            out.append(".*")
        elif expr[:1] in ("?", "&"):
            out.append(r"(?:[?&].*)?")
        else:
            out.append(r"[^/?#]*")
        pos = m.end()
    out.append(re.escape(template[pos:]))
    return re.compile("".join(out))


def build_catalog(
    lists: list[tuple[str, str, BackendLists]],
    separator: str,
    *,
    strict: bool = False,
    exposed: dict[str, Exposed] | None = None,
) -> tuple[Catalog, list[str]]:
    """Merge backends' lists, given in config order as ``(backend, prefix, lists)``, each
    filtered by its backend's ``exposed`` filters first (none given: everything).

    Returns the catalog and human-readable warnings about resolved collisions.

    Raises:
        CatalogConflict: ``strict`` and two backends expose the same tool or prompt name.
    """
    warnings: list[str] = []
    if exposed:
        lists = [(b, p, _filtered(bl, exposed.get(b, EVERYTHING))) for b, p, bl in lists]
    cat = Catalog()
    cat.tools, cat.tool_routes = _merge_named(
        "tool", [(b, p, bl.tools) for b, p, bl in lists], separator, strict, warnings
    )
    cat.prompts, cat.prompt_routes = _merge_named(
        "prompt", [(b, p, bl.prompts) for b, p, bl in lists], separator, strict, warnings
    )
    cat.tool_wire = {msgspec.json.encode(n): (n, r) for n, r in cat.tool_routes.items()}
    cat.tool_defs = {t["name"]: t for t in cat.tools}
    for backend, _prefix, bl in lists:
        for res in bl.resources:
            uri = res.get("uri")
            if not isinstance(uri, str):
                continue
            if uri in cat.resource_routes:
                warnings.append(
                    f"resource {uri!r} of backend {backend!r} is also served by "
                    f"{cat.resource_routes[uri]!r}; the first one in config order wins"
                )
                continue
            cat.resource_routes[uri] = backend
            cat.resources.append(res)
        for tmpl in bl.templates:
            t = tmpl.get("uriTemplate")
            if not isinstance(t, str):
                continue
            cat.template_routes.append((template_regex(t), backend, t))
            cat.templates.append(tmpl)
    return cat, warnings


def _filtered(bl: BackendLists, exposed: Exposed) -> BackendLists:
    if exposed == EVERYTHING:
        return bl
    return BackendLists(_exposed(bl.tools, "name", exposed.tools),
                        _exposed(bl.prompts, "name", exposed.prompts),
                        _exposed(bl.resources, "uri", exposed.resources),
                        _exposed(bl.templates, "uriTemplate", exposed.resources))


# ---- pagination -----------------------------------------------------------------------------


def encode_cursor(kind: str, offset: int) -> str:
    return base64.urlsafe_b64encode(f"{kind}:{offset}".encode()).decode().rstrip("=")


def decode_cursor(kind: str, cursor: str, length: int) -> int | None:
    """The offset a cursor points at, or None when the cursor is not one of ours for ``kind``."""
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        k, _, off = text.partition(":")
        offset = int(off)
    except (ValueError, UnicodeDecodeError):
        return None
    if k != kind or not 0 <= offset <= length:
        return None
    return offset


def page(
    kind: str, items: list[dict[str, Any]], cursor: str | None, size: int
) -> tuple[list[dict[str, Any]], str | None] | None:
    """One page of ``items`` and the next cursor; None when ``cursor`` is invalid."""
    offset = 0
    if cursor is not None:
        decoded = decode_cursor(kind, cursor, len(items))
        if decoded is None:
            return None
        offset = decoded
    chunk = items[offset : offset + size]
    nxt = offset + size
    return chunk, (encode_cursor(kind, nxt) if nxt < len(items) else None)
