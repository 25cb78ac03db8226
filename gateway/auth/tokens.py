"""Static bearer tokens (pure): the SHA-256 fingerprint of a presented token compared in constant
time against every configured one, and the tokens file's syntax and permission rule.

Theory of operation: the gateway never stores a token, only its hex SHA-256 (``[[auth.bearer]]
token_sha256`` or a line ``principal:sha256hex[:group,group]`` of ``auth.tokens_file``).  A
presented token is hashed once and compared with :func:`hmac.compare_digest` against *every*
entry (no early exit), so neither the comparison nor the number of comparisons tells an
attacker how close a guess came or which entry matched.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import stat
from dataclasses import dataclass

#: A token longer than this is refused before it is hashed (a header is at most 16 KiB anyway).
MAX_TOKEN = 4096
_HEX64 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9_.@+-]{1,128}")
#: Mode bits a tokens file must not have: group/other read, write or execute.
FORBIDDEN_MODE = 0o077


@dataclass(frozen=True, slots=True)
class BearerEntry:
    principal: str
    token_sha256: str = ""  # lowercase hex
    groups: frozenset[str] = frozenset()


def sha256_hex(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()


def valid_hash(value: str) -> bool:
    return _HEX64.fullmatch(value) is not None


def valid_name(value: str) -> bool:
    """A principal or group name as config and tokens files write it."""
    return _NAME.fullmatch(value) is not None


class BearerTable:
    """The configured tokens by fingerprint (see the module docstring for the comparison)."""

    def __init__(self, entries: list[BearerEntry]) -> None:
        self.entries = tuple(entries)

    def __len__(self) -> int:
        return len(self.entries)

    def match(self, token: str) -> BearerEntry | None:
        """The entry whose token this is, or None."""
        if not token or len(token) > MAX_TOKEN:
            return None
        digest = sha256_hex(token)
        found = None
        for entry in self.entries:  # every entry, whatever matched: the time does not depend on it
            if hmac.compare_digest(digest, entry.token_sha256) and found is None:
                found = entry
        return found

    def holds(self, entry: BearerEntry) -> bool:
        """Whether ``entry`` (principal, token and groups) is still configured (reload)."""
        return entry in self.entries


def parse_tokens_file(text: str, source: str) -> list[BearerEntry]:
    """The entries of a tokens file: ``principal:sha256hex[:group,group]`` per line; blank lines
    and lines starting with ``#`` are skipped.

    Raises:
        ValueError: every bad line, named ``source:LINE`` (the line itself is never echoed: it
            may hold a token pasted by mistake).
    """
    entries: list[BearerEntry] = []
    problems: list[str] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(":")
        if len(parts) not in (2, 3):
            problems.append(f"{source}:{n}: expected principal:sha256hex[:group,group]")
            continue
        name, digest = parts[0].strip(), parts[1].strip().lower()
        groups = [g.strip() for g in parts[2].split(",") if g.strip()] if len(parts) == 3 else []
        if not valid_name(name):
            problems.append(f"{source}:{n}: the principal must match [A-Za-z0-9_.@+-]{{1,128}}")
        elif not valid_hash(digest):
            problems.append(f"{source}:{n}: the second field must be the hex SHA-256 of the token "
                            "(64 hex digits), not the token")
        elif not all(valid_name(g) for g in groups):
            problems.append(f"{source}:{n}: group names must match [A-Za-z0-9_.@+-]{{1,128}}")
        else:
            entries.append(BearerEntry(name, digest, frozenset(groups)))
    if problems:
        raise ValueError("; ".join(problems))
    return entries


def file_problem(mode: int, owner: int, gateway_uid: int) -> str | None:
    """Why a tokens file with ``st_mode`` ``mode`` owned by uid ``owner`` must not be used (None:
    it may): a regular file, owned by root or by the gateway's user, with no group/other bits."""
    if not stat.S_ISREG(mode):
        return "not a regular file"
    if owner not in (0, gateway_uid):
        return (f"owned by uid {owner}; it must be owned by root or by the gateway's user (uid "
                f"{gateway_uid})")
    if mode & FORBIDDEN_MODE:
        return (f"mode {stat.S_IMODE(mode):04o} lets others read or change it; "
                "chmod 0600 (or 0400) it")
    return None
