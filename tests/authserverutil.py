"""The tests' authorization server (``fixtures/auth_server.py``, Authlib) as a process.

``async with auth_server("--client", "gw:secret") as srv`` starts it on free ports (its first
stdout line names them) and kills it on exit; ``srv.issuer`` is its issuer URL, and its admin
endpoints are methods: ``issued()`` (every token it issued), ``mint(sub, aud)`` (an inbound JWT
for the gateway), ``revoke``, ``down``/``up``, ``configure``.  Admin calls run in a thread
(urllib): they do not depend on trio's clock, so a test may run on a MockClock.
``authorizing_remote(...)`` is that server beside a recording remote (``fixtures/remote_server``)
whose protected-resource metadata names it.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio
from fixtures.remote_server import RemoteServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = os.path.join(ROOT, ".deps", "venv-authserver", "bin", "python")
SERVER = os.path.join(ROOT, "tests", "fixtures", "auth_server.py")


@dataclass
class AuthServer:
    issuer: str
    admin: str
    process: trio.Process

    @property
    def token_url(self) -> str:
        return f"{self.issuer}/token"

    async def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        def go() -> Any:
            data = None if body is None else json.dumps(body).encode()
            req = urllib.request.Request(self.admin + path, data=data, method=method)
            with urllib.request.urlopen(req, timeout=10) as answer:
                return json.loads(answer.read())
        return await trio.to_thread.run_sync(go)

    async def issued(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = await self.call("GET", "/issued")
        return result

    async def mint(self, sub: str, aud: str, lifetime: int = 3600, scope: str = "") -> str:
        answer = await self.call("POST", "/mint", {"sub": sub, "aud": aud,
                                                   "lifetime": lifetime, "scope": scope})
        return str(answer["access_token"])

    async def revoke(self, refresh_token: str) -> None:
        await self.call("POST", "/revoke", {"refresh_token": refresh_token})

    async def down(self, mode: str = "503") -> None:
        await self.call("POST", "/down", {"mode": mode})

    async def up(self) -> None:
        await self.call("POST", "/up", {})

    async def configure(self, **settings: Any) -> None:
        await self.call("POST", "/config", settings)


@asynccontextmanager
async def auth_server(*args: str) -> AsyncIterator[AuthServer]:
    """The server started with ``args`` (see its docstring), once it listens."""
    proc = await trio.lowlevel.open_process([PYTHON, SERVER, *args], stdout=subprocess.PIPE,
                                            stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        line = b""
        while not line.endswith(b"\n"):
            chunk = await proc.stdout.receive_some(4096)
            if not chunk:
                raise RuntimeError(f"{SERVER} exited before it listened")
            line += chunk
        ports = json.loads(line)
        yield AuthServer(ports["issuer"], ports["admin"], proc)
    finally:
        if proc.returncode is None:
            proc.kill()
        with trio.CancelScope(shield=True):
            await proc.wait()


@asynccontextmanager
async def authorizing_remote(*args: str) -> AsyncIterator[tuple[AuthServer, RemoteServer, str]]:
    """``(srv, remote, url)``: the server started with ``args`` and a recording remote serving
    at ``url`` whose protected-resource metadata names ``url`` and ``srv.issuer``."""
    async with trio.open_nursery() as nursery, auth_server(*args) as srv:
        remote = RemoteServer()
        await nursery.start(remote.serve)
        url = f"http://127.0.0.1:{remote.port}/mcp"
        remote.resource_metadata = {"authorization_servers": [srv.issuer], "resource": url}
        yield srv, remote, url
        nursery.cancel_scope.cancel()
