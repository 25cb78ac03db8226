"""Per-principal credentials files: the principal → file-name rule (pure, property-tested:
it never leaves the folder and kinds never collide), ``KEY=VALUE`` parsing, the file checks
(missing, mode, not a regular file, a symlink, too large), the token source reading a changed
file again, and the config's key-path errors and fd budget for the new keys."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway import config, limits
from gateway.auth.principal import Principal
from gateway.backend import credentials
from gateway.backend.credentials import (
    MAX_TOKEN_FILE,
    CredentialsUnavailable,
    TokenFiles,
    parse_env,
    principal_file_name,
    read_env_file,
)
from gateway.errors import ConfigError

VIAS = st.sampled_from(["bearer", "oauth", "peer", "none", ""])
NAMES = st.one_of(st.text(max_size=140), st.from_regex(r"[A-Za-z0-9._-]{1,130}", fullmatch=True))


@given(VIAS, NAMES, VIAS, NAMES)
def test_a_file_name_stays_in_its_folder_and_is_nobody_elses(via: str, name: str, via2: str,
                                                             name2: str) -> None:
    got = principal_file_name(via, name)
    ok = (via in ("bearer", "oauth", "peer") and 1 <= len(name) <= 128
          and re.fullmatch(r"[A-Za-z0-9._-]+", name) is not None and not name.startswith("."))
    assert (got is not None) == ok
    if got is not None:
        assert got == f"{via}-{name}" and "/" not in got and got not in (".", "..")
        assert not got.startswith(".")
        if principal_file_name(via2, name2) == got:
            assert (via2, name2) == (via, name)


def test_the_rule_by_example() -> None:
    assert principal_file_name("bearer", "alice") == "bearer-alice"
    assert principal_file_name("oauth", "alice") == "oauth-alice"
    assert principal_file_name("peer", "svc.deploy_1") == "peer-svc.deploy_1"
    for name in ("../x", ".hidden", "a/b", "alice@example.com", "", "x" * 129, "a b", "é"):
        assert principal_file_name("bearer", name) is None, name
    assert principal_file_name("none", "alice") is None


def test_env_files_lines_and_checks(tmp_path: Path) -> None:
    assert parse_env("# c\n\nA=1\nexport B = two words\nC='q'\nD=\"x=y\"\nE=\n") == {
        "A": "1", "B": " two words", "C": "q", "D": "x=y", "E": ""}
    for bad, why in (("A", "line 1 is not KEY=VALUE"), ("1A=x", "line 1 is not KEY=VALUE"),
                     ("A=1\nB-C=2", "line 2 is not KEY=VALUE")):
        with pytest.raises(ValueError, match=why):
            parse_env(bad)
    with pytest.raises(ValueError, match="more than 256 variables"):
        parse_env("".join(f"V{i}=x\n" for i in range(257)))
    alice = Principal("alice", via="bearer")
    template = str(tmp_path / "{principal}.env")
    path = tmp_path / "bearer-alice.env"

    def refused() -> str:
        with pytest.raises(CredentialsUnavailable) as info:
            read_env_file(template, alice)
        assert not info.value.retryable
        return info.value.detail

    assert "bearer-alice.env does not exist" in refused()
    path.write_text("K=v\n")
    for mode in (0o640, 0o604, 0o620):
        path.chmod(mode)
        assert f"mode {mode:04o} gives group or others access" in refused()
    path.chmod(0o600)
    assert read_env_file(template, alice) == {"K": "v"}
    path.write_text("not an assignment\n")
    assert "line 1 is not KEY=VALUE" in refused()
    path.unlink()
    target = tmp_path / "elsewhere"
    target.write_text("K=v\n")
    target.chmod(0o600)
    path.symlink_to(target)
    assert "cannot read environment file" in refused()  # O_NOFOLLOW
    path.unlink()
    os.mkfifo(path, 0o600)
    assert "not a regular file" in refused()
    path.unlink()
    path.write_text("K=" + "x" * credentials.MAX_ENV_FILE)
    path.chmod(0o600)
    assert f"larger than {credentials.MAX_ENV_FILE} bytes" in refused()
    with pytest.raises(CredentialsUnavailable, match="cannot name a credentials file"):
        read_env_file(template, Principal("a@b", via="bearer"))


async def test_token_files_read_a_changed_file_again_and_forget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[str] = []  # every read of a file (the real one, counted)
    real = credentials.read_private

    def counted(path: str, max_bytes: int, what: str) -> bytes:
        reads.append(path)
        return real(path, max_bytes, what)

    monkeypatch.setattr(credentials, "read_private", counted)
    source = TokenFiles(str(tmp_path / "{principal}.token"))
    alice, bob = Principal("alice", via="oauth"), Principal("alice", via="bearer")
    path = tmp_path / "oauth-alice.token"
    path.write_text("tok-1\n")
    path.chmod(0o600)
    assert await source.headers(alice) == [("authorization", "Bearer tok-1")]
    with pytest.raises(CredentialsUnavailable, match=r"bearer-alice\.token does not exist"):
        await source.headers(bob)  # the bearer principal "alice" is someone else
    path.write_text("tok-2-longer\n")
    assert await source.headers(alice) == [("authorization", "Bearer tok-2-longer")]
    count = len(reads)  # unchanged: the held token, no read; forgotten: read again
    assert await source.headers(alice) == [("authorization", "Bearer tok-2-longer")]
    assert len(reads) == count
    source.forget(alice.key)
    assert await source.headers(alice) == [("authorization", "Bearer tok-2-longer")]
    assert len(reads) == count + 1
    path.write_text("two words\n")
    with pytest.raises(CredentialsUnavailable, match="not one line of printable ASCII"):
        await source.headers(alice)
    path.write_text("x" * (MAX_TOKEN_FILE + 1))
    with pytest.raises(CredentialsUnavailable, match="larger than"):
        await source.headers(alice)


def _errors(backends: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        config.load('[listen]\nwebsocket = "127.0.0.1:0"\n' + backends, base_dir="/etc/gw")
    return info.value.errors


def test_config_keys_and_key_path_errors() -> None:
    cfg = config.load("""
[listen]
websocket = "127.0.0.1:0"
[backends.s]
command = "x"
sharing = "per-principal"
max_sessions = 5
env_files = "secrets/{principal}.env"
[backends.r]
url = "https://mcp.example.com/mcp"
credentials = "per-principal"
token_files = "/etc/up/{principal}.token"
max_sessions = 3
""", base_dir="/etc/gw")
    assert cfg.backends["s"].env_files == "/etc/gw/secrets/{principal}.env"
    assert cfg.backends["r"].per_principal and cfg.backends["r"].owned_sharing == "per-principal"
    tcp = sum(a is not None for a in (cfg.listen.websocket, cfg.listen.http, cfg.admin.listen))
    assert config.fd_reserve(cfg) == limits.fd_reserve(
        children=6, tcp_listeners=tcp, unix_listeners=0,
        remote_connections=4 * limits.REMOTE_CONNECTIONS)
    errors = _errors("""
[backends.a]
command = "x"
env_files = "/s/{principal}.env"
[backends.b]
command = "x"
sharing = "per-principal"
env_files = "/s/{principal}/x.env"
[backends.c]
url = "https://h/mcp"
env_files = "/s/p.env"
credentials = "per-principal"
[backends.d]
command = "x"
credentials = "per-principal"
token_files = "/t/{principal}.token"
[backends.e]
url = "https://h/mcp"
token_files = "/t/{principal}{principal}"
[backends.f]
url = "https://h/mcp"
credentials = "per-principal"
sharing = "affine"
token_files = "/t/{principal}.token"
oauth = { token_url = "https://h/token", client_id = "c", client_secret = { env = "S" } }
""")
    assert sorted(errors) == sorted([
        'backends.a.env_files: only with sharing = "per-principal"',
        "backends.b.env_files: the file name (not a folder) must contain {principal} once",
        "backends.c.env_files: only for a backend with a command (this one has a url)",
        "backends.c.env_files: the file name (not a folder) must contain {principal} once",
        'backends.c.credentials: "per-principal" needs a source: set token_files, '
        '[token_exchange] or [oauth] grant = "authorization_code"',
        "backends.d.credentials: only for a remote backend (url)",
        'backends.e.token_files: only with credentials = "per-principal"',
        "backends.e.token_files: the file name (not a folder) must contain {principal} once",
        'backends.f.sharing: credentials = "per-principal" runs an upstream session per '
        'principal; use sharing = "per-principal" (or leave it out)',
        "backends.f.oauth: the backend's own token is not used with "
        'credentials = "per-principal" (each principal authorizes with '
        'grant = "authorization_code"); remove one',
    ])
