"""Boot guards: a client listener off loopback refuses to start unless authentication
is configured, the wire is encrypted (TLS here or at a proxy) and resource reads have a rule;
every refusal names the keys to set, at load, in ``check-config`` and on the address a socket
is really bound to."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import trio
from tlsutil import make_certs

from gateway import cli, config
from gateway.errors import ConfigError
from gateway.transports import listeners as ls

BEARER = '[[auth.bearer]]\nprincipal = "alice"\ntoken_sha256 = "' + "ab" * 32 + '"\n'
BACKEND = '[backends.fx]\ncommand = "true"\n'
READ_RULE = '[[policy.rules]]\nkind = "resource"\nmatch = "file:///srv/docs/*"\naction = "allow"\n'


def errors_of(text: str, **kw: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        config.load(text, base_dir="/", **kw)  # type: ignore[arg-type]  # load's keywords, untyped here
    return info.value.errors


async def test_boot_guards_refuse_and_name_the_keys(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    off = '[listen]\nhttp = "0.0.0.0:8766"\nwebsocket = "192.0.2.7:8765"\n'
    # 1. no authentication configured (and nothing else): both listeners, every key named
    errs = errors_of(off)
    assert [e.split(":")[0] for e in errs] == ["listen.websocket", "listen.http"]
    for key in ("[[auth.bearer]]", "auth.tokens_file", "[auth.oauth]", "listen.tls_cert",
                "listen.tls_key", "listen.behind_proxy", "listen.public_url"):
        assert key in errs[1], (key, errs[1])
    # 2. authentication, but the token would travel in clear
    (err,) = errors_of(off.replace("websocket", "#") + BEARER)
    assert err.startswith("listen.http: '0.0.0.0' is not a loopback address")
    assert ("listen.tls_cert" in err and "listen.behind_proxy = true" in err
            and "[[auth.bearer]]" not in err)
    # 3. behind_proxy without public_url, and a public_url that is not https
    (err,) = errors_of(off.replace("websocket", "#") + "behind_proxy = true\n" + BEARER)
    assert err.startswith("listen.behind_proxy: needs listen.public_url")
    (err,) = errors_of('[listen]\npublic_url = "http://gw.example.com/mcp"\n')
    assert err.startswith("listen.public_url:") and "https" in err
    # 4. the read rule: a backend that may serve resources needs one off loopback
    proxied = (off.replace("websocket", "#") + 'behind_proxy = true\npublic_url = "https://GW.example.com/mcp"\n'
               + BEARER)
    (err,) = errors_of(proxied + BACKEND)
    assert err.startswith("listen.http:") and '[[policy.rules]] with kind = "resource"' in err \
        and 'action = "allow"' in err
    cfg = config.load(proxied + READ_RULE + BACKEND, base_dir="/")
    # serves none
    config.load(proxied + BACKEND + 'resources = { exclude = ["*"] }\n', base_dir="/")
    assert config.resource_url(cfg) == "https://GW.example.com/mcp"
    assert config.client_allowed_hosts(cfg) == ["gw.example.com"]
    assert config.client_allowed_origins(cfg) == ["https://gw.example.com"]
    assert config.resource_url(config.load("", base_dir="/")) is None
    # loopback needs none of it; the unix socket is never "off loopback"
    config.load(BACKEND + '[listen]\nunix = "/run/x.sock"\n', base_dir="/")
    # TLS keys: both or neither, readable files, loaded by check-config; the admin token's shape
    certs = make_certs(tmp_path)
    tls = f'tls_cert = "{certs.cert}"\ntls_key = "{certs.key}"\n'
    errs = errors_of(f'[listen]\ntls_cert = "{certs.cert}"\n[admin]\ntoken_sha256 = "xyz"\n')
    assert (errs[0].startswith("listen.tls_cert, listen.tls_key: set both")
            and errs[1].startswith("admin.token_sha256:"))
    (err,) = errors_of(f'[listen]\ntls_cert = "{tmp_path}/none.pem"\ntls_key = "{certs.key}"\n',
                       check_commands=True)
    assert err == f"listen.tls_cert: '{tmp_path}/none.pem' is not a readable file"
    good = tmp_path / "good.toml"
    good.write_text(off.replace("websocket", "#") + tls + BEARER + READ_RULE)
    assert cli.main(["check-config", str(good)]) == 0
    (tmp_path / "other").mkdir()
    other = make_certs(tmp_path / "other", ("other",))  # a key that does not match the certificate
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[listen]\ntls_cert = "{certs.cert}"\ntls_key = "{other.key}"\n')
    capsys.readouterr()
    assert cli.main(["check-config", str(bad)]) == 1
    assert "listen.tls_cert / listen.tls_key: cannot load" in capsys.readouterr().err
    refused = tmp_path / "refused.toml"
    refused.write_text(off)
    assert cli.main(["check-config", str(refused)]) == 1
    out = capsys.readouterr().err
    assert "listen.http: '0.0.0.0' is not a loopback address" in out and "[[auth.bearer]]" in out
    # the same rule on the address a socket is really bound to (systemd hands over sockets)
    sock = trio.socket.from_stdlib_socket(socket.create_server(("0.0.0.0", 0)))
    listener = trio.SocketListener(sock)
    try:
        with pytest.raises(ls.ListenerError,
                           match=r"http socket from systemd: bound to 0\.0\.0\.0.*tls_cert"):
            ls.check_loopback(listener, "http socket from systemd",
                              config.client_exposure_problems(config.load(BEARER, base_dir="/")))
        ls.check_loopback(listener, "http socket from systemd", [])
    finally:
        sock.close()
