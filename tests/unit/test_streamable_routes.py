"""An HTTP session picks the stream of an outgoing message by the core's routing hint: the
bytes are not parsed for it (a message sent without one is)."""

from __future__ import annotations

from typing import Any

from gateway.protocol.jsonrpc import Goes
from gateway.transports.streamable import HttpSession, Sink


class Conn:
    """What a Sink writes to, recorded."""

    def __init__(self) -> None:
        self.wrote: list[tuple[str, Any]] = []

    def respond(self, status: int, body: bytes, *_: Any) -> bool:
        self.wrote.append(("respond", body))
        return True

    def respond_json(self, status: int, body: bytes, session_id: str = "") -> bool:
        return self.respond(status, body)

    def start_events(self, headers: Any = ()) -> bool:
        self.wrote.append(("start", None))
        return True

    def event(self, message: bytes, event_id: bytes | None = None) -> bool:
        self.wrote.append(("event", message))
        return True

    def end_events(self) -> bool:
        self.wrote.append(("end", None))
        return True


def post(session: HttpSession, request_id: int, token: str | None = None) -> Conn:
    conn = Conn()
    sink = Sink(conn, session.id, request_id)  # type: ignore[arg-type]  # a fake HTTP connection
    sink.token = token
    session.open_post(sink)
    return conn


async def test_hinted_messages_go_by_their_hint_unparsed() -> None:
    session = HttpSession(60.0)
    one, two = post(session, 1, token="t"), post(session, 2)
    # not JSON at all: only the hint can route these
    assert session.write_nowait([b"progress of 1"], (Goes.PROGRESS, "t"))
    assert session.write_nowait([b"answer to 2"], (Goes.ANSWER, 2))
    assert session.write_nowait([b"answer to 1"], (Goes.ANSWER, 1))
    assert two.wrote == [("respond", b"answer to 2")]
    assert one.wrote == [("start", None), ("event", b"progress of 1"), ("event", b"answer to 1"),
                         ("end", None)]


async def test_an_unhinted_message_is_parsed_for_its_route() -> None:
    session = HttpSession(60.0)
    one, two = post(session, 1), post(session, 2)
    assert session.write_nowait([b'{"jsonrpc":"2.0","id":2,"result":{}}'])
    assert two.wrote == [("respond", b'{"jsonrpc":"2.0","id":2,"result":{}}')]
    assert one.wrote == []


async def test_an_unrelated_notification_waits_for_the_get_stream() -> None:
    session = HttpSession(60.0)
    one = post(session, 1)
    session.write_nowait([b"list changed"], (Goes.UNRELATED, None))
    assert one.wrote == []  # parked until a GET stream opens
    get = Conn()
    session.open_get(Sink(get, session.id))  # type: ignore[arg-type]  # a fake HTTP connection
    assert get.wrote == [("start", None), ("event", b"list changed")]
