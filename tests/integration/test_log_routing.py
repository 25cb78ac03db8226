"""A backend's log lines reach the callers it serves, not every session that set a log level:
two bearer principals, Alice calls, Bob (no calls of his own) listens at debug."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from helpers import Client, bearer_auth, connect, fixture_backend, make_config, run_gateway, text_of

pytestmark = pytest.mark.system

TOKENS = {"alice": "alice-log-token-1", "bob": "bob-log-token-2"}
AUTH = bearer_auth(TOKENS)
# Bob's view holds nothing of the backend "hid"
POLICY = """
[policy]
rules = [
  { match = "hid__*", action = "deny", principal = "bob" },
  { kind = "prompt", match = "hid__*", action = "deny", principal = "bob" },
]
"""
NO_RESOURCES = '{ exclude = ["*"] }'  # the fixtures' URIs would collide; fx keeps them


def logs(c: Client) -> list[Any]:
    return [n["params"]["data"] for n in c.notifications if n["method"] == "notifications/message"]


async def settled(*clients: Client) -> None:
    """Each client has received whatever was sent to it before this (a ping answered after)."""
    for c in clients:
        assert "result" in await c.request("ping")


BACKENDS = (fixture_backend("fx") + fixture_backend("hid", resources=NO_RESOURCES)
            + fixture_backend("ps", sharing="per-session", resources=NO_RESOURCES))


async def test_lines_written_while_serving_alice_are_hers_idle_ones_go_to_all_who_see_it() -> None:
    cfg = make_config(BACKENDS, extra=AUTH + POLICY)
    with trio.fail_after(40):
        async with (run_gateway(cfg) as gw, connect(gw.url, token=TOKENS["alice"]) as alice,
                    connect(gw.url, token=TOKENS["bob"]) as bob):
            for c in (alice, bob):
                assert (await c.request("logging/setLevel", {"level": "debug"}))["result"] == {}
            # while Alice's call is in flight at fx, its lines are hers
            for n in range(3):
                r = await alice.call("fx__log", {"level": "info", "data": f"during-{n}"})
                assert text_of(r) == "ok"
            await alice.wait_for(lambda: len(logs(alice)) == 3)
            await settled(bob)
            assert logs(bob) == []
            # a shared backend's line with no call in flight: everyone who may see it
            assert text_of(await alice.call("fx__log", {"level": "info", "data": "idle",
                                                        "after": 0.1})) == "ok"
            await bob.wait_for(lambda: logs(bob))
            await alice.wait_for(lambda: "idle" in logs(alice))
            assert logs(bob) == ["idle"]
            assert logs(alice) == ["during-0", "during-1", "during-2", "idle"]


async def test_a_backend_hidden_from_bob_or_owned_by_alice_never_logs_to_bob() -> None:
    cfg = make_config(BACKENDS, extra=AUTH + POLICY)
    with trio.fail_after(40):
        async with (run_gateway(cfg) as gw, connect(gw.url, token=TOKENS["alice"]) as alice,
                    connect(gw.url, token=TOKENS["bob"]) as bob):
            for c in (alice, bob):
                assert (await c.request("logging/setLevel", {"level": "debug"}))["result"] == {}
            tools = [t["name"] for t in (await bob.request("tools/list"))["result"]["tools"]]
            assert "ps__log" in tools and not [t for t in tools if t.startswith("hid__")]
            # from a backend Bob's policy hides: never to Bob, in flight or not
            r = await alice.call("hid__log", {"level": "info", "data": "hid-during"})
            assert text_of(r) == "ok"
            assert text_of(await alice.call("hid__log", {"level": "info", "data": "hid-after",
                                                         "after": 0.1})) == "ok"
            await alice.wait_for(lambda: "hid-after" in logs(alice))
            await settled(bob)
            assert logs(bob) == []
            # a per-session child speaks only to its owner, also with no call in flight
            assert text_of(await alice.call("ps__log", {"level": "info", "data": "ps-after",
                                                        "after": 0.1})) == "ok"
            await alice.wait_for(lambda: "ps-after" in logs(alice))
            await settled(bob)
            assert logs(bob) == []
            assert logs(alice) == ["hid-during", "hid-after", "ps-after"]
