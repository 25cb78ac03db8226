"""A backend's log lines reach the callers it serves, not every session that set a log level:
two bearer principals, Alice calls, Bob (no calls of his own) listens at debug.

The gateway runs in-process on virtual time (tests/memharness.py: memory backends that log what
the fixture server logs, clients on memory streams bound to their token's principal).  What a
line is routed by (the call in flight, the view, the owner) is all gateway logic, so none of
these stays on a real child; a real child's log lines are the real-server tests' concern.
"""

from __future__ import annotations

from typing import Any

import trio.testing
from helpers import Client, bearer_auth, text_of
from memharness import backend, memory_config, running, settle

Clock = trio.testing.MockClock

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


BACKENDS = (backend("fx") + backend("hid", resources=NO_RESOURCES)
            + backend("ps", sharing="per-session", resources=NO_RESOURCES))


async def test_lines_written_while_serving_alice_are_hers_idle_ones_go_to_all_who_see_it(
        autojump_clock: Clock) -> None:
    cfg = memory_config(BACKENDS, extra=AUTH + POLICY)
    with trio.fail_after(40):
        async with (running(cfg) as gw, gw.connect(token=TOKENS["alice"]) as alice,
                    gw.connect(token=TOKENS["bob"]) as bob):
            for c in (alice, bob):
                assert (await c.request("logging/setLevel", {"level": "debug"}))["result"] == {}
            # while Alice's call is in flight at fx, its lines are hers
            for n in range(3):
                r = await alice.call("fx__log", {"level": "info", "data": f"during-{n}"})
                assert text_of(r) == "ok"
            await alice.wait_for(lambda: len(logs(alice)) == 3)
            await settle()  # whatever was on its way to Bob has reached him
            assert logs(bob) == []
            # a shared backend's line with no call in flight: everyone who may see it
            assert text_of(await alice.call("fx__log", {"level": "info", "data": "idle",
                                                        "after": 0.1})) == "ok"
            await bob.wait_for(lambda: logs(bob))
            await alice.wait_for(lambda: "idle" in logs(alice))
            assert logs(bob) == ["idle"]
            assert logs(alice) == ["during-0", "during-1", "during-2", "idle"]


async def test_a_backend_hidden_from_bob_or_owned_by_alice_never_logs_to_bob(
        autojump_clock: Clock) -> None:
    cfg = memory_config(BACKENDS, extra=AUTH + POLICY)
    with trio.fail_after(40):
        async with (running(cfg) as gw, gw.connect(token=TOKENS["alice"]) as alice,
                    gw.connect(token=TOKENS["bob"]) as bob):
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
            await settle()  # whatever was on its way to Bob has reached him
            assert logs(bob) == []
            # a per-session child speaks only to its owner, also with no call in flight
            assert text_of(await alice.call("ps__log", {"level": "info", "data": "ps-after",
                                                        "after": 0.1})) == "ok"
            await alice.wait_for(lambda: "ps-after" in logs(alice))
            await settle()  # whatever was on its way to Bob has reached him
            assert logs(bob) == []
            assert logs(alice) == ["hid-during", "hid-after", "ps-after"]
