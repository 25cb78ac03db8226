"""Policy decisions (pure): allow / ask / deny per caller, and the sensitive-tool rule.

A :class:`Rule` applies to one kind of item (a tool or prompt by namespaced name, a resource by
URI or template) and may be narrowed to callers by principal, group, transport and scopes; the
first rule that matches decides (:func:`decide`).  A caller lacking a rule's scopes skips it,
and a denial that follows names those scopes (``insufficient_scope``: step-up).  A *sensitive*
tool (``destructiveHint: true``, or listed under the backend's ``sensitive``) is served only
when a rule naming it matched.  A caller's lists show exactly what it may call (:func:`visible`).
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote

Action = Literal["allow", "ask", "deny"]
Kind = Literal["tool", "prompt", "resource"]


@dataclass(frozen=True, slots=True)
class Rule:
    match: str
    action: Action
    kind: Kind = "tool"
    principal: str | None = None  # glob on the principal's name
    group: str | None = None
    transport: str | None = None  # "http" | "ws" | "unix"
    scopes: frozenset[str] = frozenset()

    @property
    def per_caller(self) -> bool:
        """Whether this rule can decide differently for different callers."""
        return bool(self.principal is not None or self.group is not None
                    or self.transport is not None or self.scopes)


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is calling, as far as policy cares (hashable: the key of a per-caller view)."""

    transport: str = ""  # "http" | "ws" | "unix" ("" for an in-process caller)
    principal: str | None = None  # None: not authenticated
    groups: frozenset[str] = frozenset()
    scopes: frozenset[str] = frozenset()


ANONYMOUS = Caller()


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    rule: str | None  # the glob that decided, None for the default
    sensitive_unruled: bool = False  # sensitive and no rule names it: refuse
    scopes: tuple[str, ...] = ()  # denied, but a rule would let it in with these scopes


def climbs(uri: str) -> bool:
    """Whether ``uri`` has a dot segment (``.`` or ``..``, also percent-encoded) in its path: a
    backend resolving it could land outside what a glob on the URI allowed
    (``file:///srv/docs/../../etc/passwd`` matches ``file:///srv/docs/*``)."""
    return any(seg in (".", "..") for seg in unquote(uri).replace("\\", "/").split("/"))


def is_sensitive(tool: dict[str, Any], backend_sensitive: list[str], original_name: str) -> bool:
    annotations = tool.get("annotations")
    if isinstance(annotations, dict) and annotations.get("destructiveHint") is True:
        return True
    return any(fnmatch.fnmatchcase(original_name, pattern) for pattern in backend_sensitive)


def _caller_matches(rule: Rule, caller: Caller) -> bool:
    """Every condition of ``rule`` on the caller but its scopes holds."""
    if rule.transport is not None and rule.transport != caller.transport:
        return False
    if rule.principal is not None or rule.group is not None or rule.scopes:
        if caller.principal is None:
            return False
        if rule.principal is not None and not fnmatch.fnmatchcase(caller.principal, rule.principal):
            return False
        if rule.group is not None and rule.group not in caller.groups:
            return False
    return True


def decide(name: str, rules: list[Rule], default: Action, *, sensitive: bool,
           caller: Caller = ANONYMOUS, kind: Kind = "tool") -> Decision:
    """The decision for ``caller`` on the item ``name`` of ``kind``.

    Rules are read in order and the first that matches decides.  A caller without a principal
    never matches a rule naming a principal, a group or scopes.  A rule whose other conditions
    match but whose scopes the caller lacks is skipped; a denial after it carries its scopes.
    When no rule matches, ``default`` decides for tools (a sensitive tool is denied) and
    prompts and resources are allowed."""
    step_up: tuple[str, ...] = ()
    decided: Decision | None = None
    for rule in rules:
        if rule.kind != kind or not fnmatch.fnmatchcase(name, rule.match):
            continue
        if not _caller_matches(rule, caller):
            continue
        if not rule.scopes <= caller.scopes:
            if not step_up and rule.action != "deny":
                step_up = tuple(sorted(rule.scopes))
            continue
        decided = Decision(rule.action, rule.match)
        break
    if decided is None:
        if sensitive and kind == "tool":
            decided = Decision("deny", None, sensitive_unruled=True)
        else:
            decided = Decision(default if kind == "tool" else "allow", None)
    if decided.action == "deny" and step_up:
        return Decision("deny", decided.rule, decided.sensitive_unruled, step_up)
    return decided


def names(name: str, rules: list[Rule], kind: Kind = "tool") -> bool:
    """Whether some rule of ``kind`` names ``name`` (for some caller): a sensitive tool no rule
    names cannot be served to anybody (a boot error)."""
    return any(rule.kind == kind and fnmatch.fnmatchcase(name, rule.match) for rule in rules)


def literal_prefix(glob: str) -> str:
    """What every name ``glob`` matches starts with: its characters before the first wildcard."""
    for i, ch in enumerate(glob):
        if ch in "*?[":
            return glob[:i]
    return glob


class RuleIndex:
    """The rules whose glob matches a name, found without trying every glob: each rule is filed
    under its kind and :func:`literal_prefix`, and a name is looked up by its own prefixes of
    the lengths filed, so a name costs one lookup per distinct prefix length, not one glob per
    rule."""

    def __init__(self, rules: list[Rule]) -> None:
        self._rules = rules
        self._filed: dict[tuple[Kind, str], list[int]] = {}
        lengths: dict[Kind, set[int]] = {}
        for i, rule in enumerate(rules):
            prefix = literal_prefix(rule.match)
            self._filed.setdefault((rule.kind, prefix), []).append(i)
            lengths.setdefault(rule.kind, set()).add(len(prefix))
        self._lengths = {kind: sorted(n) for kind, n in lengths.items()}

    def naming(self, name: str, kind: Kind) -> list[Rule]:
        """The rules of ``kind`` whose glob matches ``name``, in their order."""
        found: list[int] = []
        for n in self._lengths.get(kind, ()):
            if n > len(name):
                break
            found += self._filed.get((kind, name[:n]), ())
        found.sort()
        return [self._rules[i] for i in found if fnmatch.fnmatchcase(name, self._rules[i].match)]


def visible(name: str, rules: list[Rule], default: Action, *, sensitive: bool,
            caller: Caller, kind: Kind) -> bool:
    """Whether ``caller`` sees ``name`` in its lists: it may call it (allow, or ask)."""
    return decide(name, rules, default, sensitive=sensitive, caller=caller,
                  kind=kind).action != "deny"


def consent_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "approve": {"type": "boolean", "title": "Run this tool?", "default": False},
        },
        "required": ["approve"],
    }


def consent_granted(answer: Any) -> bool:
    """Only ``accept`` with ``approve: true`` is consent; everything else is a refusal."""
    if not isinstance(answer, dict) or answer.get("action") != "accept":
        return False
    content = answer.get("content")
    return isinstance(content, dict) and content.get("approve") is True


def suggested_rules(tools: list[str]) -> str:
    """A TOML snippet naming each of ``tools`` in a ``[[policy.rules]]`` table (``ask``): appended
    to a config, it parses and the gateway starts.  Comment lines show the inline form for a
    config whose ``[policy]`` already holds ``rules = [...]``."""
    out: list[str] = []
    for tool in tools:
        name = json.dumps(tool)  # a TOML basic string (names are ASCII letters, digits, _ and -)
        out += ["[[policy.rules]]", f"match = {name}",
                'action = "ask"  # or "allow" / "deny"', ""]
    out.append("# or, inside an existing `rules = [...]` array of [policy]:")
    out += [f'#   {{ match = {json.dumps(tool)}, action = "ask" }},' for tool in tools]
    return "\n".join(out) + "\n"
