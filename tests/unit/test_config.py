"""Config: every example decodes; every error names its key path; diff for reload."""

from __future__ import annotations

import glob
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway import config
from gateway.config import GatewayConfig, diff_backends, load
from gateway.core import bridge
from gateway.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = sorted(
    glob.glob(os.path.join(ROOT, "config", "**", "*.toml"), recursive=True)
    + glob.glob(os.path.join(ROOT, "packaging", "gateway.toml"))
)
BASE = "/srv/gw"


@pytest.fixture
def tmp_dir() -> Iterator[Path]:
    # Not pytest's tmp_dir: its cleanup of old numbered dirs is shared with other suites.
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


def errors_of(text: str, **kwargs: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load(text, base_dir=kwargs.pop("base_dir", BASE), **kwargs)  # type: ignore[arg-type]  # load's keywords, untyped here
    assert str(info.value) == "; ".join(info.value.errors)
    return info.value.errors


# ---- the shipped examples ---------------------------------------------------------------


def test_examples_exist() -> None:
    assert os.path.join(ROOT, "config", "gateway.toml") in EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: os.path.relpath(p, ROOT))
def test_example_configs_decode(path: str) -> None:
    with open(path, "rb") as f:
        data = f.read()
    base = os.path.dirname(path)
    cfg = load(data, base_dir=base)
    assert isinstance(cfg, GatewayConfig)
    assert cfg.base_dir == base
    assert cfg.backends, "an example without backends is not much of an example"
    for name, backend in cfg.backends.items():
        assert backend.cwd is not None and os.path.isabs(backend.cwd), name
        if "/" in backend.command:
            assert os.path.isabs(backend.command), name


def test_repo_example_paths_resolve_against_its_folder() -> None:
    base = os.path.join(ROOT, "config")
    with open(os.path.join(base, "gateway.toml"), "rb") as f:
        cfg = load(f.read(), base_dir=base)
    time_server = os.path.join(ROOT, ".deps", "venv-time", "bin", "mcp-server-time")
    assert cfg.backends["time"].command == time_server
    assert cfg.backends["time"].cwd == base  # no cwd: the config's folder
    assert cfg.backends["demo"].cwd == ROOT  # cwd = ".."
    assert cfg.backends["everything"].command == "node"  # bare names stay PATH lookups


# ---- defaults ---------------------------------------------------------------------------


def test_minimal_config_gets_defaults() -> None:
    cfg = load('[backends.a]\ncommand = "srv"\n', base_dir=BASE)
    assert cfg.gateway.separator == "__"
    assert cfg.listen.websocket == "127.0.0.1:8765"
    assert cfg.admin.listen == "127.0.0.1:9477"
    assert cfg.policy.default == "allow"
    b = cfg.backends["a"]
    assert (b.command, b.cwd, b.sharing, b.prefix) == ("srv", BASE, "shared", None)
    assert cfg.prefix_of("a") == "a"
    assert load("", base_dir=BASE).backends == {}


def test_prefix_of_empty_prefix() -> None:
    cfg = load('[backends.a]\ncommand = "srv"\nprefix = ""\n', base_dir=BASE)
    assert cfg.prefix_of("a") == ""


# ---- errors with key paths --------------------------------------------------------------


def test_typo_is_rejected_with_its_key_path() -> None:
    text = '[backends.x]\ncommand = "srv"\nrestart = { backof_max = 3.0 }\n'
    assert errors_of(text) == ["backends.x.restart.backof_max: unknown key"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[gateway]\npage_sise = 3\n", "gateway.page_sise: unknown key"),
        ('[listen]\nwebsockett = "127.0.0.1:1"\n', "listen.websockett: unknown key"),
        ('[backends.y]\ncomand = "x"\n', "backends.y.comand: unknown key"),
        ('[backends.y]\ncommand = "x"\n[backends.y.health]\nintervall = 1.0\n',
         "backends.y.health.intervall: unknown key"),
        ('[[policy.rules]]\nmatch = "a"\naction = "allow"\nacton = "deny"\n',
         "policy.rules.0.acton: unknown key"),
        ("[gatway]\nname = 'x'\n", "gatway: unknown section"),
    ],
)
def test_unknown_keys_anywhere(text: str, expected: str) -> None:
    (error,) = errors_of(text)
    assert error.startswith(expected)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[backends.time]\ncommand = "x"\nrestart = { backoff_max = "3" }\n',
         "backends.time.restart.backoff_max: expected float, got str"),
        ('[gateway]\npage_size = "ten"\n', "gateway.page_size: expected int, got str"),
        ("[backends.a]\ncommand = 5\n", "backends.a.command: expected str, got int"),
        ('[backends.a]\ncommand = "x"\nargs = ["a", 2]\n',
         "backends.a.args.1: expected str, got int"),
        ('[backends.a]\ncommand = "x"\nenv = { A = 1 }\n',
         "backends.a.env.*: expected str, got int"),
        ('[backends.a]\ncommand = "x"\nsharing = "sometimes"\n',
         "backends.a.sharing: invalid enum value"),
        ('[backends.a]\ncommand = "x"\ndeclare = ["tasks"]\n',
         "backends.a.declare.0: invalid enum value"),
        ('[[policy.rules]]\nmatch = "a"\naction = "maybe"\n',
         "policy.rules.0.action: invalid enum value"),
        ("[backends.a]\nargs = []\n", "backends.a: set exactly one of command"),
        ("gateway = 3\n", "gateway: expected object, got int"),
        ("backends = 3\n", "backends: expected a table"),
        ("[backends]\na = 3\n", "backends.a: expected object, got int"),
        ('[backends."bad name"]\ncommand = "x"\n', "backends.bad name: backend names must match"),
    ],
)
def test_wrong_types_name_the_path(text: str, expected: str) -> None:
    (error,) = errors_of(text)
    assert error.startswith(expected), error


def test_several_errors_are_reported_at_once() -> None:
    text = """
[gateway]
page_sise = 3
[listen]
websocket = "0.0.0.0:8765"
[policy]
default = "sometimes"
[backends.a]
comand = "x"
[backends.b]
command = "x"
restart = { backoff_max = "3" }
[backends.c]
command = "fine"
[extra]
"""
    errors = errors_of(text)
    assert len(errors) == 5
    joined = "\n".join(errors)
    for part in ("gateway.page_sise", "policy.default", "backends.a.comand",
                 "backends.b.restart.backoff_max", "extra: unknown section"):
        assert part in joined


def test_semantic_errors_are_reported_together() -> None:
    text = """
[gateway]
separator = "::"
page_size = 0
[listen]
websocket = "0.0.0.0:8765"
unix_mode = "999"
[admin]
listen = "192.168.1.2:9477"
[backends.a]
command = "x"
request_timeout = 0
restart = { backoff_initial = 5.0, backoff_max = 1.0 }
roots = ["/not/a/uri"]
prefix = "bad prefix"
"""
    errors = errors_of(text)
    paths = sorted(e.split(":")[0] for e in errors)
    assert paths == sorted([
        "gateway.separator", "gateway.page_size", "listen.websocket", "listen.unix_mode",
        "admin.listen", "backends.a.request_timeout", "backends.a.restart", "backends.a.roots",
        "backends.a.prefix",
    ])


def test_remote_backend_keys() -> None:
    good = load("""
[listen]
websocket = "127.0.0.1:8765"
[backends.r]
url = "https://mcp.example.com/mcp"
ca_file = "certs/ca.pem"
[backends.r.headers]
Authorization = { file = "secrets/token", prefix = "Bearer " }
X-Key = { env = "K" }
X-Team = "blue"
""", base_dir=BASE)
    r = good.backends["r"]
    assert r.command == "" and r.ca_file == f"{BASE}/certs/ca.pem"
    assert r.headers == {"Authorization": {"file": f"{BASE}/secrets/token", "prefix": "Bearer "},
                         "X-Key": {"env": "K"}, "X-Team": "blue"}
    errors = errors_of("""
[listen]
websocket = "127.0.0.1:8765"
[backends.both]
command = "x"
url = "http://127.0.0.1:1/mcp"
[backends.neither]
args = ["a"]
[backends.bad]
url = "ftp://user@host/mcp"
ca_file = "ca.pem"
args = ["x"]
protocol_mode = "modern_only"
[backends.bad.headers]
"Bad Name" = "x"
Host = "y"
Mcp-Param-Region = "z"
X-A = { env = "A", file = "/f" }
X-B = { file = "" }
X-C = "a\\nb"
[backends.stdio]
command = "x"
headers = { X-A = "1" }
""")
    assert sorted(errors) == sorted([
        "backends.both: set exactly one of command (a program to spawn) and url (a remote "
        "Streamable HTTP server)",
        "backends.neither: set exactly one of command (a program to spawn) and url (a remote "
        "Streamable HTTP server)",
        "backends.bad.url: expected http://HOST:PORT/PATH or https://HOST/PATH without "
        "credentials, got 'ftp://user@host/mcp'",
        "backends.bad.ca_file: only for an https:// url",
        "backends.bad.args: only for a backend with a command (this one has a url)",
        "backends.bad.headers.Bad Name: not a valid header name",
        "backends.bad.headers.Host: set by the gateway itself",
        "backends.bad.headers.Mcp-Param-Region: set by the gateway itself",
        "backends.bad.headers.X-A: expected a string, { env = \"VAR\" } or { file = \"/path\", "
        "prefix = \"Bearer \" }, got keys ['env', 'file']",
        "backends.bad.headers.X-B: file must not be empty",
        "backends.bad.headers.X-C: must be printable ASCII (no CR, LF or NUL)",
        "backends.stdio.headers: only for a remote backend (url)",
    ])


def test_remote_url_without_a_host_refused() -> None:
    (error,) = errors_of('[backends.r]\nurl = "http://:80/mcp"\n')
    assert error == "backends.r.url: no host name or address in 'http://:80/mcp'"


def test_invalid_toml() -> None:
    (error,) = errors_of("[gateway\n")
    assert error.startswith("not valid TOML")


# ---- listeners --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "addr", ["0.0.0.0:8765", "192.168.0.10:8765", "[::]:8765", "example.com:8765"]
)
def test_non_loopback_websocket_refused(addr: str) -> None:
    (error,) = errors_of(f'[listen]\nwebsocket = "{addr}"\n')
    assert error.startswith("listen.websocket:") and "loopback" in error


def test_http_listener_keys() -> None:
    """Issue 9: listen.http defaults to loopback, must stay loopback, "" switches it off."""
    cfg = load("", base_dir=BASE)
    assert cfg.listen.http == "127.0.0.1:8766" and cfg.listen.http_max_sessions == 1024
    assert load('[listen]\nhttp = ""\n', base_dir=BASE).listen.http is None
    (error,) = errors_of('[listen]\nhttp = "0.0.0.0:8766"\n')
    assert error.startswith("listen.http:") and "loopback" in error
    assert errors_of('[listen]\nhttp_session_idle_timeout = 0.0\nhttp_max_sessions = 0\n') == [
        "listen.http_session_idle_timeout: must be positive",
        "listen.http_max_sessions: must be at least 1"]


@pytest.mark.parametrize("addr", ["127.0.0.1:0", "127.0.0.2:1", "[::1]:8765", "localhost:8765"])
def test_loopback_websocket_accepted(addr: str) -> None:
    assert load(f'[listen]\nwebsocket = "{addr}"\n', base_dir=BASE).listen.websocket == addr


@pytest.mark.parametrize("addr", ["8765", ":8765", "127.0.0.1:x", "127.0.0.1:70000"])
def test_malformed_listen_address(addr: str) -> None:
    (error,) = errors_of(f'[listen]\nwebsocket = "{addr}"\n')
    assert error.startswith("listen.websocket:")


def test_admin_non_loopback_refused_unless_allowed() -> None:
    (error,) = errors_of('[admin]\nlisten = "0.0.0.0:9477"\n')
    assert error.startswith("admin.listen:") and "allow_non_loopback" in error
    cfg = load('[admin]\nlisten = "0.0.0.0:9477"\nallow_non_loopback = true\n', base_dir=BASE)
    assert cfg.admin.listen == "0.0.0.0:9477"


def test_allow_non_loopback_does_not_open_the_client_listener() -> None:
    text = '[listen]\nwebsocket = "0.0.0.0:1"\n[admin]\nallow_non_loopback = true\n'
    (error,) = errors_of(text)
    assert error.startswith("listen.websocket:")


# ---- paths ------------------------------------------------------------------------------


def test_relative_command_with_slash_and_cwd_resolved_against_base_dir() -> None:
    text = """
[backends.a]
command = "./bin/server"
cwd = "work"
[backends.b]
command = "../tools/srv"
[backends.c]
command = "/usr/bin/env"
cwd = "/tmp"
[backends.d]
command = "python3"
"""
    cfg = load(text, base_dir=BASE)
    a, b, c, d = (cfg.backends[n] for n in "abcd")
    assert (a.command, a.cwd) == ("/srv/gw/bin/server", "/srv/gw/work")
    assert (b.command, b.cwd) == ("/srv/tools/srv", "/srv/gw")
    assert (c.command, c.cwd) == ("/usr/bin/env", "/tmp")
    assert (d.command, d.cwd) == ("python3", "/srv/gw")  # bare name: PATH at spawn time


def test_check_commands_reports_missing_command(tmp_dir: Path) -> None:
    tool = tmp_dir / "bin" / "srv"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    (tmp_dir / "data").write_text("not a dir")
    text = """
[backends.ok]
command = "./bin/srv"
[backends.missing]
command = "./bin/nope"
[backends.nopath]
command = "no-such-command-for-the-gateway-tests"
[backends.notdir]
command = "./bin/srv"
cwd = "data"
"""
    base = str(tmp_dir)
    cfg = load(text, base_dir=base)  # without the check: fine
    assert cfg.backends["ok"].command == str(tool)
    errors = errors_of(text, base_dir=base, check_commands=True)
    assert len(errors) == 3, errors
    assert errors[0].startswith("backends.missing.command:") and "not found" in errors[0]
    assert errors[1].startswith("backends.nopath.command:")
    assert errors[2].startswith("backends.notdir.cwd:")


def test_check_commands_uses_the_backend_path(tmp_dir: Path) -> None:
    tool = tmp_dir / "my-server"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    text = f'[backends.a]\ncommand = "my-server"\nenv = {{ PATH = "{tmp_dir}" }}\n'
    cfg = load(text, base_dir=str(tmp_dir), check_commands=True)
    assert config.resolve_command(cfg.backends["a"]) == str(tool)


# ---- reload diff ------------------------------------------------------------------------


def test_diff_backends() -> None:
    old = load(
        '[backends.keep]\ncommand = "a"\n[backends.gone]\ncommand = "b"\n'
        '[backends.edit]\ncommand = "c"\n',
        base_dir=BASE,
    )
    new = load(
        '[backends.keep]\ncommand = "a"\n[backends.edit]\ncommand = "c"\nargs = ["-v"]\n'
        '[backends.fresh]\ncommand = "d"\n',
        base_dir=BASE,
    )
    assert diff_backends(old, new) == (["fresh"], ["gone"], ["edit"])
    assert diff_backends(old, old) == ([], [], [])
    assert diff_backends(new, old) == (["gone"], ["fresh"], ["edit"])


def test_diff_sees_nested_and_resolved_changes() -> None:
    text = '[backends.a]\ncommand = "./srv"\n'
    old = load(text, base_dir="/one")
    assert diff_backends(old, load(text, base_dir="/one")) == ([], [], [])
    assert diff_backends(old, load(text, base_dir="/two")) == ([], [], ["a"])  # path moved
    nested = load(text + "restart = { max_restarts = 9 }\n", base_dir="/one")
    assert diff_backends(old, nested) == ([], [], ["a"])


def test_auth_limits_hold_per_principal_caps() -> None:
    cfg = load('[[auth.limits]]\nprincipal = "ci-*"\nmax_sessions = 2\nmax_parked_flows = 1\n')
    (lim,) = cfg.auth.limits
    assert lim.caps == (("max_sessions", 2), ("max_parked_flows", 1))  # the others: defaults
    with pytest.raises(ConfigError) as err:
        load('[[auth.limits]]\nprincipal = "x"\nmax_listens = 0\nmax_connections = -1\n')
    assert sorted(err.value.errors) == ["auth.limits[0].max_connections: must be at least 1",
                                        "auth.limits[0].max_listens: must be at least 1"]
    with pytest.raises(ConfigError, match=r"auth.limits\[0\]: set max_inflight, calls_per_second"):
        load('[[auth.limits]]\nprincipal = "x"\n')


def test_shared_park_limit_defaults_to_30_seconds_and_is_bounded() -> None:
    cfg = load("", base_dir=BASE)
    assert cfg.gateway.shared_park_limit == 30.0 and cfg.gateway.state_ttl == 300.0
    assert load("[gateway]\nshared_park_limit = 5\n",
                base_dir=BASE).gateway.shared_park_limit == 5.0
    for bad in ("0", "-1", "3601"):
        assert errors_of(f"[gateway]\nshared_park_limit = {bad}\n") == [
            "gateway.shared_park_limit: must be positive and at most 3600 seconds"]


def test_an_unusable_state_key_file_is_one_config_error(tmp_dir: Path) -> None:
    path = tmp_dir / "missing" / "state.key"  # its folder does not exist: cannot be created
    cfg = load(f'[gateway]\nstate_key_file = "{path}"\n', base_dir=BASE)
    with pytest.raises(ConfigError) as err:
        bridge.from_config(cfg.gateway)
    (problem,) = err.value.errors
    assert problem.startswith("gateway.state_key_file: ") and str(path) in problem
