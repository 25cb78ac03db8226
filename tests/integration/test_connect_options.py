"""``mcp-gateway connect`` options and refusals, the bridge run as a subprocess: ``--ca-file``
trusts a private CA for https:// and wss://; a WebSocket upgrade refused with 401 is reported as
such, with the option that sends a token."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import HTTP_INIT, ROOT, fixture_backend, make_config, run_gateway
from tlsutil import make_certs

from gateway import config

pytestmark = [pytest.mark.system, pytest.mark.filterwarnings("ignore::ResourceWarning")]

CALL = {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
        "params": {"name": "fx__echo", "arguments": {"message": "over TLS"}}}
INITIALIZED = {"jsonrpc": "2.0", "method": "notifications/initialized"}


def _connect(url: str, *options: str) -> tuple[int, list[Any], str]:
    """Run the bridge on ``url``: initialize, call fx__echo, close stdin; its exit code, the
    messages it wrote and its stderr."""
    env = {k: v for k, v in os.environ.items() if k != "SSL_CERT_FILE"}
    env["PYTHONPATH"] = ROOT
    lines = b"".join(json.dumps(m).encode() + b"\n" for m in (HTTP_INIT, INITIALIZED))
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "connect", url, *options], cwd=ROOT,
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    out: list[Any] = []
    try:
        proc.stdin.write(lines)
        proc.stdin.flush()
        if raw := proc.stdout.readline():
            out.append(json.loads(raw))
            proc.stdin.write(json.dumps(CALL).encode() + b"\n")
            proc.stdin.flush()
            if raw := proc.stdout.readline():
                out.append(json.loads(raw))
        proc.stdin.close()
    except BrokenPipeError:  # the bridge gave up at once
        pass
    code = proc.wait(timeout=20)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    return code, out, err


async def test_ca_file_trusts_a_private_ca_for_https_and_wss(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    cfg = config.load(f"""[listen]\nwebsocket = "127.0.0.1:0"\nhttp = "127.0.0.1:0"
tls_cert = "{certs.cert}"\ntls_key = "{certs.key}"\n[admin]\nlisten = "127.0.0.1:0"\n"""
                      + fixture_backend(), base_dir=ROOT)
    async with run_gateway(cfg) as gw:
        https = f"https://localhost:{gw.bound.http_port}/mcp"
        for url in (https, f"wss://localhost:{gw.bound.websocket_port}/"):
            code, out, err = await trio.to_thread.run_sync(_connect, url, "--ca-file",
                                                           str(certs.ca))
            assert code == 0, (url, out, err)
            assert out[-1]["result"]["content"][0]["text"] == "over TLS", (url, out, err)
            # the system CAs do not know it: refused, saying why
            code, out, err = await trio.to_thread.run_sync(_connect, url)
            assert code == 1 and "CERTIFICATE_VERIFY_FAILED" in err, (url, out, err)
        code, out, err = await trio.to_thread.run_sync(_connect, https, "--ca-file",
                                                       str(tmp_path / "missing.pem"))
        assert code == 1 and out == [] and err.startswith("mcp-gateway connect: --ca-file: "), err


async def test_a_websocket_upgrade_refused_with_401_says_http_401_and_the_option() -> None:
    digest = hashlib.sha256(b"secret").hexdigest()
    bearer = f'[[auth.bearer]]\nprincipal = "alice"\ntoken_sha256 = "{digest}"\n'
    async with run_gateway(make_config(fixture_backend(), extra=bearer)) as gw:
        code, out, err = await trio.to_thread.run_sync(_connect, gw.url)
    assert code == 1 and out == []
    assert err.startswith(f"mcp-gateway connect: {gw.url}: HTTP 401: "), err
    assert err.rstrip().endswith("(use --token-file)") and "(b'" not in err, err
