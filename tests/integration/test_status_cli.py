"""``mcp-gateway status`` against a running gateway whose admin listener needs a token: refused
without ``--token-file`` (exit 1, saying what to pass), the table with it (exit 0)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import fixture_backend, free_port, run_gateway

from gateway import cli, config
from gateway.ops import statuscmd

pytestmark = pytest.mark.system


async def test_the_command_reads_a_running_gateway_and_needs_its_token(
        tmp_path: Path, capsys: Any) -> None:
    token = "admin-secret-token"
    port = free_port()
    text = (f'[listen]\nwebsocket = "127.0.0.1:0"\n[admin]\nlisten = "127.0.0.1:{port}"\n'
            f'token_sha256 = "{hashlib.sha256(token.encode()).hexdigest()}"\n'
            + fixture_backend("fx", required=True))
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    (tmp_path / "admin.token").write_text(token + "\n")
    with trio.fail_after(20):
        async with run_gateway(config.load(text, base_dir=str(tmp_path))):  # ready: fx RUNNING
            refused = await trio.to_thread.run_sync(cli.main, ["status", "-c", str(path)])
            assert refused == statuscmd.EXIT_UNREACHABLE
            assert "pass --token-file" in capsys.readouterr().err
            ok = await trio.to_thread.run_sync(cli.main, [
                "status", "-c", str(path), "--token-file", str(tmp_path / "admin.token")])
            out = capsys.readouterr().out
    assert ok == 0, out
    assert out.startswith("mcp-gateway ") and ": ready\n" in out
    assert any(line.split()[:4] == ["fx", "(required)", "fx/0", "RUNNING"]
               for line in out.splitlines()), out
