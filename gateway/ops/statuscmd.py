"""``mcp-gateway status``: the running daemon's ``/status``, read from the admin listener its
config names, as a table for people (``--json``: the document as served, for scripts).

:func:`render` is pure (the document in, lines out); :func:`fetch` is the one HTTP GET.  The
exit code says whether the daemon is fit to serve: 0 when every ``required`` backend has a
RUNNING instance, :data:`EXIT_REQUIRED_DOWN` when one has none, :data:`EXIT_UNREACHABLE`
when ``/status`` could not be read (connection refused, 401/403, not JSON).
"""

from __future__ import annotations

import http.client
import json
import threading
from typing import Any
from urllib.parse import quote

EXIT_UNREACHABLE = 1
EXIT_REQUIRED_DOWN = 2
#: The most bytes of ``/status`` read (a gateway with thousands of instances stays far under).
MAX_BODY = 16 * 2**20
#: Seconds the whole GET may take (connect, head and body), however slowly bytes come.
TIMEOUT = 5.0


class StatusUnavailable(Exception):
    """``/status`` could not be read; the message says why, for the operator."""


def admin_address(listen: str) -> tuple[str, int]:
    """Where to reach an admin listener bound to ``listen`` (``host:port``; a wildcard host is
    reached on loopback)."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return host, int(port)


def authorize(host: str, port: int, backend: str, token: str | None = None) -> tuple[int, str]:
    """``POST /authorize/BACKEND`` at the admin listener: its status and text (the URL), without
    control characters.

    Raises:
        StatusUnavailable: not reachable, or no answer within :data:`TIMEOUT`.
    """
    headers = {"Host": "localhost", "Content-Length": "0"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    status, body = _exchange(host, port, "POST", "/authorize/" + quote(backend, safe=""),
                             headers)
    return status, _text(body[:MAX_BODY].decode("utf-8", "replace").strip())


def fetch(host: str, port: int, token: str | None = None) -> dict[str, Any]:
    """GET ``/status`` from ``host:port``.

    Raises:
        StatusUnavailable: not reachable, refused (401/403/421), or not a JSON object.
    """
    headers = {"Host": "localhost", "Accept": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    status, body = _exchange(host, port, "GET", "/status", headers)
    if status in (401, 403):
        hint = ("pass --token-file (admin.token_sha256 is set)" if token is None
                else "the token in --token-file is not the one admin.token_sha256 names")
        raise StatusUnavailable(f"/status refused ({status}): {hint}")
    if status != 200:
        raise StatusUnavailable(f"/status answered {status}: "
                                f"{body[:200].decode(errors='replace').strip()}")
    if len(body) > MAX_BODY:
        raise StatusUnavailable(f"/status is over {MAX_BODY} bytes")
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested too deep to decode
        doc = None
    if not isinstance(doc, dict) or not isinstance(doc.get("backends"), list):
        raise StatusUnavailable("/status did not answer a gateway status document")
    return doc


def _exchange(host: str, port: int, method: str, path: str, headers: dict[str, str]
              ) -> tuple[int, bytes]:
    """One request to the admin listener: its status and body (at most :data:`MAX_BODY` + 1
    bytes), all within :data:`TIMEOUT`.

    Raises:
        StatusUnavailable: not reachable, or no answer in time.
    """
    conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT)
    expired = threading.Event()

    def expire() -> None:  # a socket timeout bounds each read, not an answer dripping forever
        expired.set()
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(2)  # SHUT_RDWR: the blocked read returns
            except OSError:
                pass

    timer = threading.Timer(TIMEOUT, expire)
    timer.daemon = True
    try:
        conn.connect()
        timer.start()
        conn.request(method, path, headers=headers)
        response = conn.getresponse()
        body = response.read(MAX_BODY + 1)
    except (OSError, http.client.HTTPException) as exc:
        if expired.is_set():
            raise StatusUnavailable(f"admin listener {host}:{port}: no answer within "
                                    f"{TIMEOUT:g}s") from None
        raise StatusUnavailable(f"admin listener {host}:{port}: {exc}") from None
    finally:
        timer.cancel()
        conn.close()
    if expired.is_set():
        raise StatusUnavailable(f"admin listener {host}:{port}: no answer within {TIMEOUT:g}s")
    return response.status, body


def _dicts(value: Any) -> list[dict[str, Any]]:
    """The objects in ``value`` if it is a list (a document of another shape shows less, not a
    traceback)."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _text(value: Any) -> str:
    """``value`` as text without control characters (no escape sequence reaches the
    terminal)."""
    return "".join(c if c.isprintable() else "?" for c in str(value))


def required_down(doc: dict[str, Any]) -> list[str]:
    """The ``required`` backends with no RUNNING instance."""
    return [_text(b.get("name", "?")) for b in _dicts(doc.get("backends"))
            if b.get("required") and not any(i.get("state") == "RUNNING"
                                             for i in _dicts(b.get("instances")))]


def _duration(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool):
        return "-"
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows]


def _clip(text: str, width: int = 60) -> str:
    """``text`` on one line (its whitespace runs one space), printable, at most ``width``."""
    text = _text(" ".join(text.split()))
    return text if len(text) <= width else text[:width - 1] + "…"


def render(doc: dict[str, Any]) -> list[str]:
    """``/status`` as lines of text: the daemon, its listeners and connections, then one row
    per backend instance."""
    state = ("stopping" if doc.get("stopping") else "draining" if doc.get("draining")
             else "ready" if doc.get("ready") else "not ready")
    lines = [f"mcp-gateway {_text(doc.get('version', '?'))}: {state}"]
    for listener in _dicts(doc.get("listeners")):
        guards = [g for g, on in (("tls", listener.get("tls")),
                                  ("auth", listener.get("auth_configured")),
                                  ("behind proxy", listener.get("behind_proxy"))) if on]
        lines.append(f"  listener {_text(listener.get('name', '?'))} "
                     f"{_text(listener.get('address', '?'))}"
                     + (f" ({', '.join(guards)})" if guards else ""))
    conns = doc.get("connections")
    conns = conns if isinstance(conns, dict) else {}
    lines.append("  connections: " + (", ".join(f"{_text(t)} {_text(n)}"
                                                for t, n in sorted(conns.items())) or "none")
                 + f"; requests in flight {_text(doc.get('client_requests_in_flight', 0))}"
                 + f"; pending server requests {_text(doc.get('pending_server_requests', 0))}")
    rows = [["BACKEND", "INSTANCE", "STATE", "WHERE", "RESTARTS", "UPTIME", "INFLIGHT",
             "LAST ERROR"]]
    for b in _dicts(doc.get("backends")):
        name = _text(b.get("name", "?")) + (" (required)" if b.get("required") else "")
        for i in _dicts(b.get("instances")) or [{}]:
            where = (f"pid {i['pid']}" if i.get("pid") is not None
                     else i.get("origin") or b.get("connector", "-"))
            error = i.get("last_error") or i.get("last_exit") or ""
            rows.append([name, _text(i.get("name", "-")), _text(i.get("state", "-"))
                         + (" draining" if i.get("draining") else ""), _text(where),
                         _text(i.get("restarts", 0)), _duration(i.get("uptime")),
                         _text(i.get("inflight", 0)), _clip(str(error))])
            name = ""
    lines.extend(_table(rows))
    down = required_down(doc)
    if down:
        lines.append("required backend(s) not running: " + ", ".join(down))
    return lines
