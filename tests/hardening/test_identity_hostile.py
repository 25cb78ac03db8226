"""Who the caller is, attacked on the real daemon: ``auth.tokens_file`` replaced by something
malformed and the daemon told to reload (SIGHUP), and the unix socket's peer principal
(``SO_PEERCRED``) for peers running as other users, one without a passwd entry.

A malformed tokens file must fail the reload with one clear log line (naming the file and the
problem, never a token) while the old tokens keep working and the new ones do not; a FIFO in
its place must not freeze the daemon.  The unix peer's principal and groups must be what README
says (`[policy]` rule keys ``principal`` and ``group``): the user's login name, ``uid:N``
without a passwd entry; the user's groups plus the process's own gid (``gid:N`` unnamed)."""

from __future__ import annotations

import grp
import hashlib
import json
import os
import pwd
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio
from helpers import connect, fixture_backend, text_of, ws_upgrade
from invariants import Daemon, DaemonSlot, baseline, check

pytestmark = pytest.mark.system

TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789"}
PASTED = "carol-pasted-token-0123456789"  # a token pasted in place of its hash: never logged
RELOAD_BOUND = 5.0  # seconds for a reload's outcome to be logged
NOBODY = pwd.getpwnam("nobody") if "nobody" in {p.pw_name for p in pwd.getpwall()} else None
NOBODY_GROUP = grp.getgrgid(NOBODY.pw_gid).gr_name if NOBODY is not None else "nogroup"
STRANGER = (54321, 54322)  # uid, gid: no passwd or group entry on the test machine


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def line(name: str) -> str:
    return f"{name}:{sha(TOKENS[name])}:dev\n"


# Deny rules (the default allows) naming unix peers by principal or group: which tool each
# peer is refused tells which principal and groups the daemon gave it.
RULES = [
    ("principal", "root", "fx__sleep"),
    ("principal", "nobody", "fx__progress"),
    ("principal", f"uid:{STRANGER[0]}", "fx__big"),
    ("principal", "uid:65534", "fx__log"),  # nobody has a passwd entry: never uid:65534
    ("group", NOBODY_GROUP, "fx__client_info"),  # nobody's group (passwd)
    ("group", f"gid:{STRANGER[1]}", "fx__stderr"),  # the stranger's process gid, unnamed
    ("group", "gid:54329", "fx__roots"),  # a process gid beyond the user's own groups
]
CALLS = {"fx__sleep": {"seconds": 0}, "fx__progress": {"steps": 1}, "fx__big": {"size": 1},
         "fx__log": {"level": "info", "data": "x"}, "fx__client_info": {},
         "fx__stderr": {"lines": []}, "fx__roots": {}, "fx__echo": {"message": "x"}}


class IdentityDaemon(Daemon):
    """The hardening daemon with ``auth.tokens_file`` (alice), deny rules naming unix peers, and
    its unix socket in a directory every user may enter (mode 0666)."""

    token = TOKENS["alice"]

    def write_config(self, backends: str) -> None:
        self.tokens_path = self.workdir / "tokens"
        if not self.tokens_path.exists():
            self.write_tokens(line("alice"))
            self.shared = tempfile.mkdtemp(prefix="gw-peer-")  # the workdir's parents are 0700
            os.chmod(self.shared, 0o755)
            self.unix_path = os.path.join(self.shared, "gw.sock")
        rules = "".join(f'[[policy.rules]]\n{key} = "{value}"\nmatch = "{tool}"\naction = "deny"\n'
                        for key, value, tool in RULES)
        super().write_config(f'[auth]\ntokens_file = "{self.tokens_path}"\n{rules}{backends}')
        text = self.config_path.read_text()
        self.config_path.write_text(text.replace("[listen]\n", '[listen]\nunix_mode = "0666"\n'))

    def clear_tokens(self) -> None:
        """Remove whatever is at the tokens file's path."""
        path = self.tokens_path
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink(missing_ok=True)

    def write_tokens(self, text: str | bytes, mode: int = 0o600) -> None:
        if self.tokens_path.is_dir() and not self.tokens_path.is_symlink():
            self.clear_tokens()
        tmp = self.workdir / "tokens.new"
        tmp.write_bytes(text.encode() if isinstance(text, str) else text)
        tmp.chmod(mode)
        os.replace(tmp, self.tokens_path)

    async def reload(self) -> str:
        """SIGHUP; the line that logs the reload's outcome ("" when none came within
        RELOAD_BOUND: the daemon is stuck)."""
        seen = len(self.lines)
        self.proc.send_signal(signal.SIGHUP)
        with trio.move_on_after(RELOAD_BOUND):
            return await self.line_until(
                lambda text: "reload failed" in text or "reload done" in text, seen)
        return ""


class IdentitySlot(DaemonSlot):
    def __init__(self, workdir: Path, backends: str) -> None:
        super().__init__(workdir, backends, daemon_type=IdentityDaemon)
        self.shared: list[str] = []  # the daemons' socket directories, removed at the end

    def get(self) -> Daemon:
        daemon = super().get()
        assert isinstance(daemon, IdentityDaemon)
        if daemon.shared not in self.shared:
            self.shared.append(daemon.shared)
        return daemon


@pytest.fixture(scope="module")
def slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonSlot]:
    s = IdentitySlot(tmp_path_factory.mktemp("identity"), fixture_backend("fx"))
    yield s
    s.close()
    for path in s.shared:
        shutil.rmtree(path, ignore_errors=True)


async def upgrade_status(port: int, token: str) -> int:
    """The status of a WebSocket upgrade carrying ``token``."""
    return (await ws_upgrade(port, token))[0]


def malformations(d: IdentityDaemon) -> dict[str, Callable[[], None]]:
    """Ways to replace the tokens file with something that must not be used; each would drop
    alice and admit bob if it were read."""
    path = d.tokens_path

    def other(make: Callable[[], None]) -> Callable[[], None]:
        def replace() -> None:
            d.clear_tokens()
            make()
        return replace

    target = d.workdir / "tokens.target"
    target.write_text(line("bob"))
    target.chmod(0o600)
    return {
        "a pasted token": lambda: d.write_tokens(line("bob") + f"carol:{PASTED}\n"),
        "too many fields": lambda: d.write_tokens(line("bob") + "dave:a:b:c\n"),
        "a bad principal": lambda: d.write_tokens(line("bob") + f"bad name:{sha('x')}\n"),
        "not UTF-8": lambda: d.write_tokens(line("bob").encode() + b"\xff\xfe\n"),
        "a NUL byte": lambda: d.write_tokens(line("bob") + "\0\n"),
        "mode 0644": lambda: d.write_tokens(line("bob"), 0o644),
        "over 1 MiB": lambda: d.write_tokens(line("bob") + "#" * (1 << 20) + "\n"),
        "removed": other(lambda: None),
        "a directory": other(lambda: path.mkdir()),
        "a symlink": other(lambda: path.symlink_to(target)),
        "a FIFO": other(lambda: os.mkfifo(path, 0o600)),
    }


async def test_a_malformed_tokens_file_fails_the_reload_and_the_old_tokens_stay(
        daemon: Daemon) -> None:
    """Each malformed replacement, then SIGHUP: ``reload failed, keeping the running config:
    auth.tokens_file: …`` within RELOAD_BOUND (no token in it), alice's open connection goes
    on, a new one with her token is accepted, bob's token is refused.  A good file then drops
    alice (her connection closed) and admits bob; restoring her ends the scenario."""
    assert isinstance(daemon, IdentityDaemon)
    base, mark = await baseline(daemon), len(daemon.lines)
    port = daemon.ws_port
    try:
        async with daemon.client("websocket") as alice:
            for name, replace in malformations(daemon).items():
                replace()
                start = trio.current_time()
                outcome = await daemon.reload()
                took = trio.current_time() - start
                assert "reload failed, keeping the running config: auth.tokens_file: " in outcome, \
                    (name, outcome)
                assert str(daemon.tokens_path) in outcome and took < RELOAD_BOUND, (name, took)
                assert await upgrade_status(port, TOKENS["alice"]) == 101, name
                assert await upgrade_status(port, TOKENS["bob"]) == 401, name
                assert text_of(await alice.call("fx__echo", {"message": name})) == name
            daemon.write_tokens(line("bob"))
            assert "reload done" in await daemon.reload()
            assert await upgrade_status(port, TOKENS["alice"]) == 401
            assert await upgrade_status(port, TOKENS["bob"]) == 101
            with trio.fail_after(5):
                while not alice.closed:
                    await alice._changed.wait()
            assert alice.ws.closed is not None and alice.ws.closed.code == 1008
    finally:
        daemon.write_tokens(line("alice"))
        restored = await daemon.reload()
    assert "reload done" in restored, restored
    assert not any(PASTED in text for text in daemon.lines)
    failures = [text for text in daemon.failures(mark) if "reload failed" not in text]
    assert not failures, failures
    await check(daemon, base)


PEER = r"""
import json, os, socket, sys
uid, gid, path, calls = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
if uid:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
s = socket.socket(socket.AF_UNIX)
s.settimeout(10)
s.connect(path)
f = s.makefile("rwb")
def send(msg):
    f.write(json.dumps(msg).encode() + b"\n")
    f.flush()
send({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {"protocolVersion":
      "2025-11-25", "capabilities": {}, "clientInfo": {"name": "peer", "version": "0"}}})
f.readline()
send({"jsonrpc": "2.0", "method": "notifications/initialized"})
for i, (tool, args) in enumerate(calls.items(), 1):
    send({"jsonrpc": "2.0", "id": i, "method": "tools/call",
          "params": {"name": tool, "arguments": args}})
names, out = list(calls), {}
while len(out) < len(names):
    msg = json.loads(f.readline())
    if isinstance(msg.get("id"), int) and msg["id"] > 0:
        out[names[msg["id"] - 1]] = (msg.get("error") or {}).get("code", 0)
print(json.dumps(out))
"""


async def denied_tools(daemon: Daemon, uid: int, gid: int) -> set[str]:
    """The tools a unix peer running as ``uid``/``gid`` (no supplementary groups of its own:
    the daemon asks the group database) is denied (-32005)."""
    with trio.fail_after(15):
        done = await trio.run_process(
            [sys.executable, "-I", "-c", PEER, str(uid), str(gid), daemon.unix_path,
             json.dumps(CALLS)], capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr.decode()
    codes = json.loads(done.stdout)
    assert set(codes.values()) <= {0, -32005}, codes
    return {tool for tool, code in codes.items() if code == -32005}


@pytest.mark.skipif(os.geteuid() != 0 or NOBODY is None,  # CI: root; base-passwd has nobody
                    reason="needs root (to connect as other users) and a user nobody")
async def test_the_unix_peer_principal_is_the_documented_one(daemon: Daemon) -> None:
    """Peers as root, as nobody (passwd group nogroup), as nobody with another process gid,
    and as a uid and gid with no entry at all: each is denied exactly the tools whose rules
    name its principal (login name, else ``uid:N``) or one of its groups (the user's groups
    and the process's gid, ``gid:N`` when unnamed).  The bearer-token WebSocket client
    (principal alice) is denied none of them."""
    assert NOBODY is not None
    base, mark = await baseline(daemon), len(daemon.lines)
    assert await denied_tools(daemon, 0, 0) == {"fx__sleep"}
    assert await denied_tools(daemon, NOBODY.pw_uid, NOBODY.pw_gid) == \
        {"fx__progress", "fx__client_info"}
    assert await denied_tools(daemon, NOBODY.pw_uid, 54329) == \
        {"fx__progress", "fx__client_info", "fx__roots"}
    assert await denied_tools(daemon, *STRANGER) == {"fx__big", "fx__stderr"}
    async with connect(daemon.url, token=daemon.token) as c:
        for tool, args in CALLS.items():
            assert "result" in await c.call(tool, args), tool
    await check(daemon, base)
    assert not daemon.failures(mark), daemon.failures(mark)
