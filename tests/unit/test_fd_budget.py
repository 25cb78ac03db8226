"""The file-descriptor budget: what the daemon needs besides client connections, and how
``max_connections`` is fitted into the open-files limit (pure arithmetic)."""

from __future__ import annotations

import pytest

from gateway import config, limits
from gateway.backend import http
from gateway.errors import ConfigError
from gateway.limits import DEFAULT_MAX_CONNECTIONS, fd_reserve, fit_connections


def test_the_reserve_counts_children_listeners_admin_and_refusals() -> None:
    base = limits.FD_FIXED + limits.ADMIN_CONNECTIONS + limits.REFUSING_MAX
    assert fd_reserve(children=0, tcp_listeners=0, unix_listeners=0) == base == 64 + 32 + 64
    assert fd_reserve(children=3, tcp_listeners=3, unix_listeners=1) == base + 3 * 8 + 3 * 2 + 1
    assert limits.max_children("per-session", 1, 16) == 17  # the probe besides 16 owned
    assert limits.max_children("affine", 4, 16) == 4
    assert limits.max_children("shared", 1, 16) == 1


def test_the_reserve_of_a_config() -> None:
    cfg = config.load("""
[listen]
websocket = "127.0.0.1:0"
http = "127.0.0.1:0"
unix = "/tmp/x.sock"
[backends.a]
command = "a"
sharing = "per-session"
max_sessions = 10
[backends.b]
command = "b"
sharing = "affine"
instances = 3
[backends.c]
url = "http://127.0.0.1:9/mcp"
instances = 2
[backends.d]
url = "http://127.0.0.1:9/mcp"
instances = 3
max_connections = 40
""")
    assert config.fd_reserve(cfg) == fd_reserve(
        children=14, tcp_listeners=3, unix_listeners=1,
        remote_connections=2 * limits.REMOTE_CONNECTIONS + 3 * 40) == 160 + 112 + 152 + 7
    assert cfg.gateway.max_connections is None  # not set: the default, fitted at start


def test_the_default_fits_or_is_lowered_with_a_warning_naming_both_numbers() -> None:
    assert fit_connections(None, 524288, 200) == limits.ConnectionsFit(DEFAULT_MAX_CONNECTIONS)
    assert fit_connections(None, 4096 + 200, 200).max_connections == 4096
    fit = fit_connections(None, 1024, 166)
    assert fit.max_connections == 1024 - 166 and fit.refusal is None
    assert (fit.warning is not None and "4096" in fit.warning and "858" in fit.warning
            and "1024" in fit.warning)


def test_an_explicit_value_that_does_not_fit_is_refused_naming_both_numbers() -> None:
    assert fit_connections(800, 1024, 166) == limits.ConnectionsFit(800)
    fit = fit_connections(1000, 1024, 166)
    assert fit.refusal is not None and fit.warning is None
    assert "max_connections = 1000" in fit.refusal and "1024" in fit.refusal
    # what to raise it to, or lower to
    assert "1166" in fit.refusal and "at most 858" in fit.refusal
    no_room = fit_connections(None, 100, 166)  # not one connection fits: refused even by default
    assert no_room.refusal is not None and "100" in no_room.refusal


def test_a_remotes_max_connections_is_bounded_and_refused_on_a_command_backend() -> None:
    bad = """
[backends.few]
url = "http://127.0.0.1:9/mcp"
max_connections = 4
[backends.many]
url = "http://127.0.0.1:9/mcp"
max_connections = 1025
[backends.child]
command = "x"
max_connections = 16
"""
    with pytest.raises(ConfigError) as info:
        config.load(bad)
    bounds = "must be between 5 (one call's answer stream beside the GET stream, the DELETE "
    assert sorted(info.value.errors) == [
        "backends.child.max_connections: only for a remote backend (url)",
        f"backends.few.max_connections: {bounds}and 2 for notifications) and 1024",
        f"backends.many.max_connections: {bounds}and 2 for notifications) and 1024"]
    edge = config.load('[backends.r]\nurl = "http://127.0.0.1:9/mcp"\nmax_connections = 5\n')
    assert http.HttpConnector(edge.backends["r"]).request_streams == 1
    assert http.HttpConnector(config.load('[backends.r]\nurl = "http://127.0.0.1:9/mcp"\n')
                              .backends["r"]).request_streams == http.REQUEST_STREAMS == 12
