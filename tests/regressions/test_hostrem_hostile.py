"""A hostile token endpoint and remote against a remote backend's client side: the real token
source and ``http`` link on trio memory streams (the in-process servers of the fixtures), on
the MockClock."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing
from fixtures.token_server import Answer, Net

from gateway import config
from gateway.backend import oauth

AS = "http://127.0.0.1:9000"
URL = "http://localhost:8080/mcp"


def _source(tmp_path: Any) -> oauth.TokenSource:
    (tmp_path / "secret").write_text("s3cr3t\n")
    text = (f'[backends.r]\nurl = "{URL}"\n[backends.r.oauth]\nclient_id = "c"\n'
            f'token_url = "{AS}/token"\nclient_secret = {{ file = "secret" }}\n')
    cfg = config.load(text, base_dir=str(tmp_path)).backends["r"]
    assert cfg.oauth is not None
    return oauth.TokenSource("r", URL, cfg.oauth)


@pytest.mark.parametrize("lifetime", [b"1e300", b"Infinity", b"NaN", b"100000000000000000000",
                                      b"1" + b"0" * 400])
async def test_a_token_lifetime_past_any_date_is_refused_and_status_still_answers(
        autojump_clock: trio.testing.MockClock, tmp_path: Any, lifetime: bytes) -> None:
    issued: list[int] = []

    def token_endpoint(method: str, target: str, headers: dict[str, str], body: bytes
                       ) -> Answer:
        issued.append(1)
        return 200, [("content-type", "application/json")], (
            b'{"access_token": "tok", "token_type": "Bearer", "expires_in": %s}' % lifetime)

    source = _source(tmp_path)
    async with trio.open_nursery() as nursery:
        net = Net(nursery, {"127.0.0.1:9000": token_endpoint})
        source._opener = net.open
        try:
            await source.fresh()
        except oauth.TokenFailed as exc:
            assert "expires_in" in exc.detail
        else:  # kept: then as a token valid for good, not one fetched again at every request
            await source.fresh()
            await source.fresh()
            assert len(issued) == 1
        json.dumps(source.status())  # /status shows it: no OverflowError, no ValueError
        nursery.cancel_scope.cancel()
