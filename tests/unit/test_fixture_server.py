"""Quick self-tests of tests/fixtures/fixture_server.py (plain subprocess, no trio, no gateway)."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "fixture_server.py"
TIMEOUT = 5.0


class Server:
    """The fixture as a child process; stdout lines are read by a thread into a queue."""

    def __init__(self, **env):
        self.proc = subprocess.Popen(
            [sys.executable, str(FIXTURE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, **env},
        )
        self.lines = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def send(self, msg):
        self.send_raw(json.dumps(msg).encode() + b"\n")

    def send_raw(self, data):
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def recv(self, timeout=TIMEOUT):
        line = self.lines.get(timeout=timeout)
        assert line is not None, "fixture closed stdout"
        assert line.endswith(b"\n") and b"\n" not in line[:-1]
        return json.loads(line)

    def request(self, rid, method, params=None, collect=None):
        """Send a request, return its response; other messages are appended to `collect`."""
        self.send({"jsonrpc": "2.0", "id": rid, "method": method, "params": params or {}})
        while True:
            msg = self.recv()
            if msg.get("id") == rid and "method" not in msg:
                return msg
            assert collect is not None, f"unexpected message {msg}"
            collect.append(msg)

    def initialize(self, version="2025-11-25"):
        caps = {"elicitation": {}, "sampling": {}, "roots": {"listChanged": True}}
        params = {"protocolVersion": version, "capabilities": caps,
                  "clientInfo": {"name": "test", "version": "0"}}
        resp = self.request(0, "initialize", params)
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return resp["result"]

    def call(self, rid, name, arguments=None, meta=None):
        params = {"name": name, "arguments": arguments or {}}
        if meta:
            params["_meta"] = meta
        self.send({"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": params})

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(TIMEOUT)
        self.reader.join(TIMEOUT)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except BrokenPipeError:
                pass


@pytest.fixture
def server():
    srv = Server()
    yield srv
    srv.close()


def text_of(resp):
    return resp["result"]["content"][0]["text"]


def test_initialize_and_tools_list(server):
    result = server.initialize("2025-06-18")
    assert result["protocolVersion"] == "2025-06-18"
    assert result["serverInfo"] == {"name": "fixture", "version": "1.0"}
    assert result["capabilities"]["tools"] == {"listChanged": True}
    assert result["capabilities"]["resources"] == {"subscribe": True, "listChanged": True}
    tools = server.request(1, "tools/list")["result"]["tools"]
    names = [t["name"] for t in tools]
    for name in ("echo", "progress", "sleep", "crash", "elicit", "sample", "roots", "big"):
        assert name in names
    assert all(t["inputSchema"]["type"] == "object" for t in tools)
    assert "nextCursor" not in server.request(2, "tools/list")["result"]


def test_unknown_version_and_pagination():
    srv = Server(FIXTURE_PAGE_SIZE="4")
    try:
        assert srv.initialize("1999-01-01")["protocolVersion"] == "2025-11-25"
        names, cursor, rid = [], None, 1
        while True:
            result = srv.request(rid, "tools/list", {"cursor": cursor} if cursor else {})["result"]
            assert len(result["tools"]) <= 4
            names += [t["name"] for t in result["tools"]]
            cursor, rid = result.get("nextCursor"), rid + 1
            if cursor is None:
                break
        assert rid > 3 and len(names) == len(set(names)) and "echo" in names
        assert srv.request(99, "tools/list", {"cursor": "bogus"})["error"]["code"] == -32602
    finally:
        srv.close()


def test_echo_roundtrip(server):
    server.initialize()
    server.call(7, "echo", {"message": "héllo\nworld"})
    resp = server.recv()
    assert resp["id"] == 7
    assert resp["result"]["content"] == [{"type": "text", "text": "héllo\nworld"}]
    assert resp["result"]["structuredContent"] == {"message": "héllo\nworld"}
    assert server.request(8, "bogus/method")["error"]["code"] == -32601


def test_progress_before_result(server):
    server.initialize()
    server.call(3, "progress", {"steps": 3}, meta={"progressToken": "tok"})
    msgs = [server.recv() for _ in range(4)]
    assert [m.get("method") for m in msgs[:3]] == ["notifications/progress"] * 3
    assert [m["params"] for m in msgs[:3]] == [
        {"progressToken": "tok", "progress": i, "total": 3} for i in (1, 2, 3)
    ]
    assert msgs[3]["id"] == 3 and text_of(msgs[3]) == "done"


def test_elicit_roundtrip_and_error(server):
    server.initialize()
    server.call(4, "elicit", {"message": "name?"})
    req = server.recv()
    assert req["method"] == "elicitation/create" and req["id"] == "srv-1"
    assert req["params"]["message"] == "name?"
    assert req["params"]["requestedSchema"]["required"] == ["answer"]
    answer = {"action": "accept", "content": {"answer": "42"}}
    server.send({"jsonrpc": "2.0", "id": "srv-1", "result": answer})
    resp = server.recv()
    assert resp["id"] == 4 and "isError" not in resp["result"]
    assert json.loads(text_of(resp)) == {**answer, "message": "name?"}

    server.call(5, "elicit", {"message": "again?"})
    req = server.recv()
    assert req["id"] == "srv-2"
    server.send({"jsonrpc": "2.0", "id": "srv-2", "error": {"code": -32601, "message": "nope"}})
    resp = server.recv()
    assert resp["result"]["isError"] is True
    assert text_of(resp) == "elicitation error -32601: nope"


def test_cancelled_elicit_cancels_its_request(server):
    server.initialize()
    server.call(6, "elicit", {"message": "?"})
    sid = server.recv()["id"]
    server.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 6}})
    msg = server.recv()
    assert msg["method"] == "notifications/cancelled" and msg["params"] == {"requestId": sid}
    assert server.request(7, "ping") == {"jsonrpc": "2.0", "id": 7, "result": {}}
    with pytest.raises(queue.Empty):
        server.recv(timeout=0.3)


def test_cancelled_sleep_sends_no_response(server):
    server.initialize()
    server.call(5, "sleep", {"seconds": 30})
    server.call(6, "sleep", {"seconds": 0.05, "message": "short"})
    assert text_of(server.recv()) == "short"  # the slow call does not block others
    server.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 5}})
    assert server.request(7, "ping")["result"] == {}
    with pytest.raises(queue.Empty):
        server.recv(timeout=0.5)


def test_malformed_line(server):
    server.send_raw(b"{not json\n")
    assert server.recv() == {
        "jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": "Parse error"}
    }
    assert server.request(1, "ping")["result"] == {}


def test_exits_on_stdin_eof(server):
    server.initialize()
    server.proc.stdin.close()
    assert server.proc.wait(TIMEOUT) == 0


def test_exits_on_sigterm(server):
    server.initialize()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(TIMEOUT) == 0
