"""Tool policy decisions (pure): allow / ask / deny by glob, and the sensitive-tool rule.

A tool is *sensitive* when it declares ``annotations.destructiveHint: true`` explicitly or its
backend lists it under ``sensitive``.  A sensitive tool is served only when a rule *names* it (a
glob in ``[policy] rules`` that matches it); the default rule does not count.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Literal

Action = Literal["allow", "ask", "deny"]


@dataclass(frozen=True, slots=True)
class Rule:
    match: str
    action: Action


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    rule: str | None  # the glob that decided, None for the default
    sensitive_unruled: bool = False  # sensitive and no rule names it: refuse


def is_sensitive(tool: dict[str, Any], backend_sensitive: list[str], original_name: str) -> bool:
    annotations = tool.get("annotations")
    if isinstance(annotations, dict) and annotations.get("destructiveHint") is True:
        return True
    return any(fnmatch.fnmatchcase(original_name, pattern) for pattern in backend_sensitive)


def decide(tool: str, rules: list[Rule], default: Action, *, sensitive: bool) -> Decision:
    for rule in rules:
        if fnmatch.fnmatchcase(tool, rule.match):
            return Decision(rule.action, rule.match)
    if sensitive:
        return Decision("deny", None, sensitive_unruled=True)
    return Decision(default, None)


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
