"""``mcp-gateway status``: the table drawn from a ``/status`` document and the exit code's rule
(pure; the command against a running gateway is in tests/integration/test_status_cli.py)."""

from __future__ import annotations

from typing import Any

from gateway.ops import statuscmd

DOC: dict[str, Any] = {
    "version": "1.2.3", "ready": False, "draining": False, "stopping": False,
    "connections": {"websocket": 2, "http": 1}, "client_requests_in_flight": 3,
    "pending_server_requests": 1,
    "listeners": [{"name": "http", "address": "0.0.0.0:8766", "loopback": False, "tls": True,
                   "auth_configured": True, "behind_proxy": False}],
    "backends": [
        {"name": "search", "required": True, "connector": "http", "instances": [
            {"name": "search/0", "state": "BACKOFF", "pid": None, "restarts": 4, "uptime": None,
             "inflight": 0, "origin": "https://search.example:443",
             "last_error": "connect: [Errno 111] Connection refused", "last_exit": None}]},
        {"name": "time", "required": False, "connector": "stdio", "instances": [
            {"name": "time/0", "state": "RUNNING", "pid": 4242, "restarts": 0,
             "uptime": 3725.0, "inflight": 2, "draining": True, "last_exit": None}]},
    ],
}


def test_the_table_names_each_instance_where_it_runs_and_what_went_wrong() -> None:
    lines = statuscmd.render(DOC)
    assert lines[0] == "mcp-gateway 1.2.3: not ready"
    assert lines[1] == "  listener http 0.0.0.0:8766 (tls, auth)"
    assert lines[2] == ("  connections: http 1, websocket 2; requests in flight 3; "
                        "pending server requests 1")
    header, search, time = lines[3:6]
    assert header.split() == ["BACKEND", "INSTANCE", "STATE", "WHERE", "RESTARTS", "UPTIME",
                              "INFLIGHT", "LAST", "ERROR"]
    assert search.split()[:7] == ["search", "(required)", "search/0", "BACKOFF",
                                  "https://search.example:443", "4", "-"]
    assert search.endswith("connect: [Errno 111] Connection refused")
    assert time.split() == ["time", "time/0", "RUNNING", "draining", "pid", "4242", "0", "1h02m",
                            "2"]
    assert lines[-1] == "required backend(s) not running: search"
    assert statuscmd.required_down(DOC) == ["search"]


def test_a_wildcard_admin_listener_is_reached_on_loopback() -> None:
    assert statuscmd.admin_address("0.0.0.0:9477") == ("127.0.0.1", 9477)
    assert statuscmd.admin_address("[::]:9477") == ("::1", 9477)
    assert statuscmd.admin_address("10.0.0.5:9000") == ("10.0.0.5", 9000)


def test_a_multi_line_error_shows_on_one_line_its_line_breaks_as_spaces() -> None:
    doc = {"backends": [{"name": "b", "instances": [
        {"name": "b/0", "state": "FATAL", "last_error": "spawn failed:\n  No such file\r\n"}]}]}
    row = statuscmd.render(doc)[-1]
    assert row.endswith("spawn failed: No such file")
