"""Issue 4: the daemon under a fake systemd — notify sequence, reload, drain, activation."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio_websocket
from helpers import FIXTURE, ROOT, connect, free_port, poll, text_of
from prometheus_client.parser import text_string_to_metric_families

from gateway.procfs import group_members

pytestmark = pytest.mark.system


def backend_toml(name: str, **env: str) -> str:
    env_s = ", ".join(f'{k} = "{v}"' for k, v in env.items())
    return (f"[backends.{name}]\ncommand = {json.dumps(sys.executable)}\n"
            f"args = [{json.dumps(FIXTURE)}]\n"
            f"env = {{{env_s}}}\n")


def write_config(path: Path, ws: int, admin: int, backends: str,
                 gateway: str = "drain_grace = 10.0") -> None:
    path.write_text(f'[gateway]\ndrain_delay = 0.0\n{gateway}\n[listen]\n'
                    f'websocket = "127.0.0.1:{ws}"\nhttp = ""\n'
                    f'[admin]\nlisten = "127.0.0.1:{admin}"\n{backends}')


@pytest.fixture
def notify_socket() -> Iterator[tuple[socket.socket, str]]:
    name = f"mcpgw-test-{uuid.uuid4().hex}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name)
    s.settimeout(10)
    yield s, "@" + name
    s.close()


def start_daemon(cfg: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": ROOT, **(extra_env or {})}
    return subprocess.Popen([sys.executable, "-m", "gateway", "run", "--config", str(cfg)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen[bytes]) -> str:
    """Kill the daemon if it is still running, collect its output, release its pipes."""
    if proc.poll() is None:
        proc.kill()
    out = ""
    if proc.stdout and not proc.stdout.closed:
        out = proc.stdout.read().decode()
        proc.stdout.close()
    proc.wait()
    return out


def recv_until(sock: socket.socket, wanted: str, seen: list[str], timeout: float = 15) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        msg = sock.recv(4096).decode()
        seen.append(msg)
        if wanted in msg.split("\n"):
            return msg
    raise AssertionError(f"{wanted} not received; got {seen}")


def http(port: int, path: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


async def test_notify_sequence_reload_and_drain(tmp_path: Path,
                                                notify_socket: tuple[socket.socket, str]) -> None:
    sock, addr = notify_socket
    ws, admin = free_port(), free_port()
    cfg = tmp_path / "gw.toml"
    write_config(cfg, ws, admin, backend_toml("a"))
    proc = start_daemon(cfg, {"NOTIFY_SOCKET": addr, "WATCHDOG_USEC": "200000"})
    seen: list[str] = []
    try:
        ready = recv_until(sock, "READY=1", seen)
        assert "STATUS=serving; 1/1 backends up; 0 clients" in ready
        recv_until(sock, "WATCHDOG=1", seen)
        url = f"ws://127.0.0.1:{ws}/"
        with trio.fail_after(40):
            async with connect(url) as c:
                assert text_of(await c.call("a__echo", {"message": "before"})) == "before"
                # reload: add b, remove a — the client connection stays and keeps working
                write_config(cfg, ws, admin, backend_toml("b"))
                proc.send_signal(signal.SIGHUP)
                reloading = await trio.to_thread.run_sync(recv_until, sock, "RELOADING=1", seen)
                assert any(line.startswith("MONOTONIC_USEC=") for line in reloading.split("\n"))
                await trio.to_thread.run_sync(recv_until, sock, "READY=1", seen)
                await c.wait_for(lambda: [n for n in c.notifications
                                          if n["method"] == "notifications/tools/list_changed"])
                names = [t["name"] for t in (await c.request("tools/list"))["result"]["tools"]]
                assert "b__echo" in names and "a__echo" not in names
                assert text_of(await c.call("b__echo", {"message": "after"})) == "after"
                gone = await c.call("a__echo", {"message": "x"})
                assert gone["error"]["code"] == -32602
                # a bad config is refused and the running one kept
                cfg.write_text("[backends.b]\ncommand = 12\n")
                proc.send_signal(signal.SIGHUP)
                await trio.to_thread.run_sync(recv_until, sock, "READY=1", seen)
                assert "reload failed" in seen[-1]
                assert text_of(await c.call("b__echo", {"message": "kept"})) == "kept"
                status, metrics = await trio.to_thread.run_sync(http, admin, "/metrics")
                assert 'mcp_gateway_config_reloads_total{result="failure"} 1.0' in metrics
                assert 'mcp_gateway_config_reloads_total{result="success"} 1.0' in metrics
                assert "mcp_gateway_config_last_reload_success 0.0" in metrics
                # SIGTERM during an in-flight call: it finishes, then the daemon exits 0
                child_pid = json.loads(text_of(await c.call("b__client_info")))["pid"]
                async with trio.open_nursery() as nursery:
                    result: dict = {}

                    async def slow() -> None:
                        result.update(await c.call("b__sleep", {"seconds": 1.5,
                                                                "message": "drained"}, timeout=20))

                    nursery.start_soon(slow)
                    await call_in_flight(admin, "b")
                    proc.send_signal(signal.SIGTERM)
                    await trio.to_thread.run_sync(recv_until, sock, "STOPPING=1", seen)
                    status, _ = await trio.to_thread.run_sync(http, admin, "/readyz")
                    assert status == 503
                assert text_of(result) == "drained"
        assert proc.wait(timeout=20) == 0
        assert group_members(child_pid) == []
        with pytest.raises(ProcessLookupError):
            os.kill(child_pid, 0)
    finally:
        print(finish(proc)[-3000:])


async def test_sigterm_leaves_no_npx_style_grandchild(tmp_path: Path) -> None:
    ws, admin = free_port(), free_port()
    cfg = tmp_path / "gw.toml"
    # an npx-style wrapper: sh starts python, which starts a setsid'd grandchild
    backends = ("[backends.w]\ncommand = \"sh\"\n"
                f"args = [\"-c\", {json.dumps(f'{sys.executable} {FIXTURE}')}]\n"
                'env = { FIXTURE_SPAWN_GRANDCHILD = "1" }\n')
    write_config(cfg, ws, admin, backends)
    proc = start_daemon(cfg)
    try:
        async def running() -> str | None:
            try:
                status, body = await trio.to_thread.run_sync(http, admin, "/status")
            except OSError:
                return None
            state = json.loads(body)["backends"][0]["instances"][0]["state"]
            return body if status == 200 and state == "RUNNING" else None

        with trio.fail_after(30):
            body = await poll(running, 0.1)
        (backend,) = json.loads(body)["backends"]
        assert backend["connector"] == "stdio"  # a process: a pid, no origin
        wrapper = backend["instances"][0]["pid"]
        assert backend["instances"][0]["origin"] is None
        members = group_members(wrapper)
        assert len(members) >= 2  # sh and python share the wrapper's process group
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        out = finish(proc)
        grandchild = int(out.split("grandchild-pid ")[1].split()[0])
        assert group_members(wrapper) == []
        with pytest.raises(ProcessLookupError):
            os.kill(grandchild, 0)  # setsid'd away, still reaped via the subreaper
    finally:
        finish(proc)


async def test_socket_activation(tmp_path: Path) -> None:
    ws, admin = free_port(), free_port()
    cfg = tmp_path / "gw.toml"
    write_config(cfg, free_port(), free_port(), backend_toml("a"))
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen(  # noqa: ASYNC220 - a long-lived daemon: signalled and reaped by hand
        ["systemd-socket-activate", "-l", f"127.0.0.1:{ws}", "-l", f"127.0.0.1:{admin}",
         "--fdname=websocket:admin", "-E", "PYTHONPATH",
         sys.executable, "-m", "gateway", "run", "--config", str(cfg)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        async def activated() -> bool:  # on the first connection
            served = False
            try:
                async with connect(f"ws://127.0.0.1:{ws}/") as c:
                    assert text_of(await c.call("a__echo",
                                                {"message": "activated"})) == "activated"
                    served = True
            except* (OSError, ConnectionError, trio_websocket.HandshakeError):
                pass
            return served

        with trio.fail_after(30):
            await poll(activated, 0.2)
            status, _body = await trio.to_thread.run_sync(http, admin, "/healthz")
            assert status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        out = finish(proc)
        assert "socket activation" in out, out[-2000:]


async def test_readyz_flips_when_required_backend_goes_fatal(tmp_path: Path) -> None:
    mark = tmp_path / "started-once"
    script = f'if [ -f {mark} ]; then exit 3; fi; touch {mark}; exec {sys.executable} {FIXTURE}'
    ws, admin = free_port(), free_port()
    cfg = tmp_path / "gw.toml"
    backends = (f"[backends.r]\ncommand = \"sh\"\nargs = [\"-c\", {json.dumps(script)}]\n"
                "required = true\n"
                "restart = { backoff_initial = 0.05, backoff_max = 0.1, max_restarts = 1, window = "
                "60.0 }\n")
    write_config(cfg, ws, admin, backends)
    proc = start_daemon(cfg)
    try:
        with trio.fail_after(30):
            async def readyz(want: int) -> bool:
                try:
                    return (await trio.to_thread.run_sync(http, admin, "/readyz"))[0] == want
                except OSError:
                    return False
            await poll(lambda: readyz(200), 0.1)
            async with connect(f"ws://127.0.0.1:{ws}/") as c:
                r = await c.call("r__crash")
                assert r["error"]["data"]["reason"] == "backend_exited"
            await poll(lambda: readyz(503), 0.1)
            _status, body = await trio.to_thread.run_sync(http, admin, "/readyz")
            assert "r" in body
            _, metrics = await trio.to_thread.run_sync(http, admin, "/metrics")
            families = {f.name: f for f in text_string_to_metric_families(metrics)}
            up = [s for s in families["mcp_gateway_backend_up"].samples
                  if s.labels["backend"] == "r"]
            assert up[0].value == 0
            assert "mcp_gateway_requests" in families
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        finish(proc)


def test_required_backend_failing_at_boot_fails_start(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.toml"
    backends = ("[backends.r]\ncommand = \"false\"\nrequired = true\n"
                "restart = { backoff_initial = 0.01, backoff_max = 0.02, max_restarts = 1, window "
                "= 60.0 }\n")
    write_config(cfg, free_port(), free_port(), backends)
    proc = start_daemon(cfg)
    proc.wait(timeout=30)
    out = finish(proc).encode()
    assert proc.returncode == 1
    assert b"required backend 'r' failed to start" in out


def test_log_target_stderr_starts(tmp_path: Path, notify_socket: tuple[socket.socket, str]) -> None:
    """Issue 7: ``log_target = "stderr"`` passed check-config, then ``run`` died setting up logs."""
    sock, addr = notify_socket
    cfg = tmp_path / "gw.toml"
    write_config(cfg, free_port(), free_port(), backend_toml("a"), gateway='log_target = "stderr"')
    proc = start_daemon(cfg, {"NOTIFY_SOCKET": addr})
    try:
        recv_until(sock, "READY=1", [])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        out = finish(proc)
    assert re.search(r"^\S+ \S+ INFO gateway.service: mcp-gateway \S+ ready", out,
                     re.M), out[-2000:]


def metric(admin: int, line_start: str) -> float:
    _, text = http(admin, "/metrics")
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(line_start)]
    return values[0] if values else 0.0


async def call_in_flight(admin: int, backend: str) -> None:
    """Return once the daemon's metrics show a call in flight on ``backend`` (caller bounds it)."""
    async def in_flight() -> bool:
        return await trio.to_thread.run_sync(
            metric, admin, f'mcp_gateway_inflight_requests{{backend="{backend}"}}') >= 1

    await poll(in_flight)


async def test_sighup_burst_while_a_reload_drains_coalesces(
        tmp_path: Path, notify_socket: tuple[socket.socket, str]) -> None:
    """Issue 7: 30 SIGHUPs while a reload drains a slow call used to overflow the control channel
    and kill the daemon.  Now they coalesce into at most one more reload."""
    sock, addr = notify_socket
    ws, admin = free_port(), free_port()
    cfg = tmp_path / "gw.toml"
    write_config(cfg, ws, admin, backend_toml("a") + backend_toml("b"))
    proc = start_daemon(cfg, {"NOTIFY_SOCKET": addr})
    seen: list[str] = []
    try:
        recv_until(sock, "READY=1", seen)
        with trio.fail_after(40):
            async with connect(f"ws://127.0.0.1:{ws}/") as c, trio.open_nursery() as nursery:
                result: dict = {}

                async def slow() -> None:
                    result.update(await c.call("a__sleep", {"seconds": 2.0, "message": "drained"},
                                               timeout=20))

                nursery.start_soon(slow)
                await call_in_flight(admin, "a")
                write_config(cfg, ws, admin, backend_toml("b"))  # removing a drains the slow call
                proc.send_signal(signal.SIGHUP)
                await trio.to_thread.run_sync(recv_until, sock, "RELOADING=1", seen)
                for _ in range(30):
                    proc.send_signal(signal.SIGHUP)
                    # the daemon answered after it: this signal was taken, not merged with the next
                    await trio.to_thread.run_sync(http, admin, "/healthz")
                await trio.to_thread.run_sync(recv_until, sock, "READY=1", seen)  # the first reload
                assert proc.poll() is None
                await trio.to_thread.run_sync(recv_until, sock, "RELOADING=1", seen)  # one more
                await trio.to_thread.run_sync(recv_until, sock, "READY=1", seen)
                assert text_of(await c.call("b__echo", {"message": "served"})) == "served"
            assert text_of(result) == "drained"
        proc.send_signal(signal.SIGTERM)
        recv_until(sock, "STOPPING=1", seen)
        assert proc.wait(timeout=20) == 0
        reloads = [m for m in seen if "RELOADING=1" in m.split("\n")]
        assert len(reloads) == 2, seen
    finally:
        print(finish(proc)[-3000:])


async def test_sigterm_during_a_reload_drain_stops_at_once_and_answers_cut_off_calls(
        tmp_path: Path, notify_socket: tuple[socket.socket, str]) -> None:
    """Issue 7: SIGTERM while a reload drains used to wait for the reload (``/readyz`` 200, new
    connections served); a call still running at the end of ``drain_grace`` got only a close."""
    sock, addr = notify_socket
    ws, admin = free_port(), free_port()
    cfg = tmp_path / "gw.toml"
    write_config(cfg, ws, admin, backend_toml("a") + backend_toml("b"), gateway="drain_grace = 4.0")
    proc = start_daemon(cfg, {"NOTIFY_SOCKET": addr})
    seen: list[str] = []
    url = f"ws://127.0.0.1:{ws}/"
    try:
        recv_until(sock, "READY=1", seen)
        with trio.fail_after(40):
            async with connect(url) as c:
                child_pid = json.loads(text_of(await c.call("a__client_info")))["pid"]
                await c.send({"jsonrpc": "2.0", "id": "slow", "method": "tools/call",
                              "params": {"name": "a__sleep", "arguments": {"seconds": 60}}})
                await call_in_flight(admin, "a")
                write_config(cfg, ws, admin, backend_toml("b"), gateway="drain_grace = 4.0")
                proc.send_signal(signal.SIGHUP)  # the reload drains a: up to 4 s
                await trio.to_thread.run_sync(recv_until, sock, "RELOADING=1", seen)
                proc.send_signal(signal.SIGTERM)
                stopping_by = time.monotonic() + 2.0  # well before the reload's drain could end
                await trio.to_thread.run_sync(recv_until, sock, "STOPPING=1", seen, 2.0)
                status, body = await trio.to_thread.run_sync(http, admin, "/readyz")
                assert status == 503 and "draining" in body
                # a new request on a live connection: refused at once, safe to send elsewhere
                refused = await c.call("b__echo", {"message": "late"})
                assert refused["error"]["code"] == -32005
                assert refused["error"]["data"] == {"reason": "shutdown", "retryable": True}
                with pytest.raises(ConnectionRefusedError):  # the listener no longer accepts
                    socket.create_connection(("127.0.0.1", ws), timeout=2).close()
                assert time.monotonic() < stopping_by + 1.0
                # the slow call outlives drain_grace: answered -32005 shutdown, not retryable
                cut = await c.response("slow")
                assert cut["error"]["code"] == -32005
                assert cut["error"]["data"] == {"reason": "shutdown", "retryable": False}
                with trio.fail_after(5):  # then the daemon closes the connection
                    while not c.closed:
                        await c._changed.wait()
        assert proc.wait(timeout=20) == 0
        assert not [m for m in seen if "READY=1" in m.split("\n")][1:]  # the reload never finished
        assert group_members(child_pid) == []
        with pytest.raises(ProcessLookupError):
            os.kill(child_pid, 0)
    finally:
        print(finish(proc)[-3000:])


async def test_lame_duck_serves_through_drain_delay_until_a_second_sigterm(
        tmp_path: Path, notify_socket: tuple[socket.socket, str]) -> None:
    """Issue 11: SIGTERM turns ``/readyz`` 503 at once (admin and http listener) while every
    listener keeps serving for ``drain_delay`` (a load balancer takes the replica out of
    rotation meanwhile); a second SIGTERM ends the wait and the drain refuses new requests."""
    sock, addr = notify_socket
    ws, admin, port = free_port(), free_port(), free_port()
    cfg = tmp_path / "gw.toml"
    write_config(cfg, ws, admin, backend_toml("a"), gateway="drain_delay = 60.0")
    cfg.write_text(cfg.read_text().replace('http = ""', f'http = "127.0.0.1:{port}"')
                   .replace("drain_delay = 0.0\n", ""))
    proc = start_daemon(cfg, {"NOTIFY_SOCKET": addr})
    seen: list[str] = []
    url = f"ws://127.0.0.1:{ws}/"
    try:
        recv_until(sock, "READY=1", seen)
        with trio.fail_after(30):
            async with connect(url) as c:
                proc.send_signal(signal.SIGTERM)
                await trio.to_thread.run_sync(recv_until, sock, "STOPPING=1", seen)
                for probe_port in (admin, port):
                    status, body = await trio.to_thread.run_sync(http, probe_port, "/readyz")
                    assert status == 503 and "stopping" in body, body
                proc.send_signal(signal.SIGHUP)  # not applied: the daemon is going down
                assert text_of(await c.call("a__echo", {"message": "still"})) == "still"
                async with connect(url) as late:  # the listener still accepts and serves
                    assert text_of(await late.call("a__echo", {"message": "new"})) == "new"
                assert proc.poll() is None
                # holds the drain open
                await c.send({"jsonrpc": "2.0", "id": "slow", "method": "tools/call",
                              "params": {"name": "a__sleep",
                                         "arguments": {"seconds": 1.5, "message": "slept"}}})
                await call_in_flight(admin, "a")
                proc.send_signal(signal.SIGTERM)  # asked again: the drain begins now
                while True:  # the drain refuses a new request (retryable) once it has begun
                    r = await c.call("a__echo", {"message": "late"})
                    if "error" in r:
                        break
                assert r["error"]["code"] == -32005
                assert r["error"]["data"] == {"reason": "shutdown", "retryable": True}
                assert text_of(await c.response("slow")) == "slept"
                with trio.fail_after(5):
                    while not c.closed:
                        await c._changed.wait()
                assert c.ws.closed is not None and c.ws.closed.code == 1012
        assert proc.wait(timeout=20) == 0
        sock.settimeout(0.2)
        with pytest.raises((TimeoutError, AssertionError)):  # after STOPPING=1: no reload, no READY
            recv_until(sock, "RELOADING=1", seen, 0.5)
        assert not [m for m in seen if "RELOADING=1" in m.split("\n")
                    or "READY=1" in m.split("\n")][1:]
    finally:
        print(finish(proc)[-3000:])
