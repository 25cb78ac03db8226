"""Per-principal upstream credentials: the seam, the file-name rule, and the file sources.

A per-principal backend runs one instance per authenticated principal.  Its upstream
identity comes from a :class:`PrincipalCredentials` source (a remote's headers, asked before
every request) or, for a stdio child, from that principal's ``env_files`` file.  A principal
names its file by :func:`principal_file_name`: ``bearer-``, ``oauth-`` or ``peer-`` and the
name, which may hold only ``[A-Za-z0-9._-]`` and may not begin with a dot (so it cannot leave
the folder, and principals of different kinds cannot collide).  A file is read only when it
is a regular file with no permission bits for group or others, and at most a bounded size.
"""

from __future__ import annotations

import os
import re
import stat
from typing import Protocol

from gateway import errors
from gateway.auth.principal import Principal
from gateway.config import read_regular

#: ``env_files``: the largest file read (bytes), and the most variables taken from it.
MAX_ENV_FILE = 64 * 1024
MAX_ENV_VARS = 256
#: ``token_files``: the largest token file read (bytes).
MAX_TOKEN_FILE = 16 * 1024

#: A principal's kind → its file-name prefix (kinds not listed have no files).
PREFIXES = {"bearer": "bearer-", "oauth": "oauth-", "peer": "peer-"}
_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TOKEN = re.compile(r"[\x21-\x7e]+")


class CredentialsUnavailable(Exception):
    """No upstream credentials for this principal now: ``detail`` says why (never a secret);
    ``retryable``: trying again later may work; ``url``: where the caller can authorize."""

    def __init__(self, detail: str, retryable: bool, url: str | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.retryable = retryable
        self.url = url


class PrincipalCredentials(Protocol):
    """Where a per-principal remote's upstream identity comes from."""

    kind: str  # "token_files" | "token_exchange" | "authorization_code"

    async def headers(self, principal: Principal) -> list[tuple[str, str]]:
        """The headers for a request on ``principal``'s session.

        Raises:
            CredentialsUnavailable: none now (``retryable``; ``url``: where to authorize).
        """
        ...

    def forget(self, principal_key: str) -> None:
        """Drop what is cached for that principal (its instance stopped or it was removed)."""
        ...

    def refresh(self) -> None:
        """A reload kept the backend: what the source read once from files (a ``ca_file``) is
        read again at its next use."""
        ...

    def step_up(self, principal: Principal, challenge: str | None) -> None:
        """The remote answered ``principal``'s request 403 with ``challenge`` (its
        ``WWW-Authenticate``): nothing when the source can do nothing about it (the 403 goes
        to the caller).

        Raises:
            CredentialsUnavailable: the principal can get more scope by authorizing (``url``).
        """
        ...


def call_error(exc: CredentialsUnavailable, backend: str) -> errors.GatewayError:
    """What a call of the principal gets: -32001 ``retryable`` when trying later may work,
    else -32005 (with ``data.url`` when the caller can authorize there)."""
    if exc.retryable:
        return errors.BackendUnavailable(
            f"backend {backend!r}: no upstream credentials for this principal now: {exc.detail}",
            backend=backend, retryable=True)
    if exc.url is not None:
        return errors.Denied(f"backend {backend!r}: {exc.detail}", backend=backend, url=exc.url,
                             reason="authorization_required")
    return errors.Denied(f"backend {backend!r}: {exc.detail}", backend=backend)


def principal_file_name(via: str, name: str) -> str | None:
    """The file name (without folder or suffix) of the principal ``name`` authenticated by
    ``via``, or None when it has none: an unknown kind, or a name with characters outside
    ``[A-Za-z0-9._-]``, empty, longer than 128 or beginning with a dot (pure)."""
    prefix = PREFIXES.get(via)
    if prefix is None or not _NAME.fullmatch(name) or name.startswith("."):
        return None
    return prefix + name


def principal_path(template: str, principal: Principal) -> str:
    """``template`` with ``{principal}`` replaced by the principal's file name.

    Raises:
        CredentialsUnavailable: the principal's name cannot name a file (not retryable).
    """
    name = principal_file_name(principal.via, principal.name)
    if name is None:
        raise CredentialsUnavailable(
            f"principal {principal.name!r} ({principal.via}) cannot name a credentials file "
            "(only [A-Za-z0-9._-], no leading dot)", retryable=False)
    return template.replace("{principal}", name)


def owner_only(st: os.stat_result) -> str | None:
    """Why a file of secrets is refused (its mode lets group or others in; None: fine)."""
    if st.st_mode & 0o077:
        return (f"its mode {stat.S_IMODE(st.st_mode):04o} gives group or others access "
                "(chmod 600 it)")
    return None


def read_private(path: str, max_bytes: int, what: str) -> bytes:
    """The bytes of a principal's credentials file (a regular file, private to its owner).

    Raises:
        CredentialsUnavailable: missing, unreadable, refused (not retryable; the path named,
            never the contents).
    """
    try:
        return read_regular(path, max_bytes, flags=os.O_NOFOLLOW, problem=owner_only)
    except FileNotFoundError:
        raise CredentialsUnavailable(f"no {what} for this principal ({path} does not exist)",
                                     retryable=False) from None
    except OSError as exc:
        raise CredentialsUnavailable(f"cannot read {what} {path}: {exc.strerror or exc}",
                                     retryable=False) from None
    except ValueError as exc:
        raise CredentialsUnavailable(f"{what} {path} refused: {exc}", retryable=False) from None


def parse_env(text: str) -> dict[str, str]:
    """``KEY=VALUE`` lines (blank lines and ``#`` comments skipped; the value taken as written,
    one pair of surrounding quotes removed) (pure).

    Raises:
        ValueError: a line that is not an assignment of a valid name, or too many of them.
    """
    env: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.removeprefix("export ").partition("=")
        key = key.strip()
        if not sep or not _ENV_KEY.fullmatch(key):
            raise ValueError(f"line {number} is not KEY=VALUE")
        if "\x00" in value:
            raise ValueError(f"line {number} holds a NUL")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key] = value
        if len(env) > MAX_ENV_VARS:
            raise ValueError(f"more than {MAX_ENV_VARS} variables")
    return env


def read_env_file(template: str, principal: Principal) -> dict[str, str]:
    """The environment of ``principal``'s stdio child from its ``env_files`` file.

    Raises:
        CredentialsUnavailable: no file name, no file, refused or not KEY=VALUE lines.
    """
    path = principal_path(template, principal)
    raw = read_private(path, MAX_ENV_FILE, "environment file")
    try:
        return parse_env(raw.decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise CredentialsUnavailable(f"environment file {path}: {exc}", retryable=False) from None


class TokenFiles:
    """``token_files``: each principal's upstream access token in a file of its own, sent as
    ``Authorization: Bearer``; read again when the file changes (its inode, size, mtime or
    ctime: a chmod too, so its mode is checked again)."""

    kind = "token_files"

    def __init__(self, template: str) -> None:
        self.template = template
        # principal key → ((inode, size, mtime_ns, ctime_ns), token)
        self._cache: dict[str, tuple[tuple[int, int, int, int], str]] = {}

    async def headers(self, principal: Principal) -> list[tuple[str, str]]:
        path = principal_path(self.template, principal)
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            st = None
        key = principal.key
        held = self._cache.get(key)
        mark = ((st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) if st is not None
                else None)
        if held is not None and held[0] == mark:
            return [("authorization", f"Bearer {held[1]}")]
        self._cache.pop(key, None)
        raw = read_private(path, MAX_TOKEN_FILE, "token file")
        try:
            token = raw.decode().strip()
        except UnicodeDecodeError:
            token = ""
        if not _TOKEN.fullmatch(token):
            raise CredentialsUnavailable(f"token file {path}: not one line of printable ASCII",
                                         retryable=False)
        if mark is not None:
            self._cache[key] = (mark, token)
        return [("authorization", f"Bearer {token}")]

    def forget(self, principal_key: str) -> None:
        self._cache.pop(principal_key, None)

    def refresh(self) -> None:
        """(Each file is read again when it changes anyway.)"""

    def step_up(self, principal: Principal, challenge: str | None) -> None:
        """(A token file gets no more scope: the 403 goes to the caller.)"""

