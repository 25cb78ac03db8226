"""Hostile tests of per-principal backends: what one principal's instance says, lists or is
told never reaches another principal (resource subscriptions and their updates, list changes,
URL-mode elicitation completions, the catalog), a principal over ``max_sessions`` costs no
upstream token, a token file's mode is checked again after a chmod, and ``/status`` names
whose instance it is by the principal's bounded label."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import (
    backend_in,
    bearer_auth,
    connect,
    fixture_backend,
    make_config,
    private,
    run_gateway,
    text_of,
)
from memharness import Owner, backend, memory_config, running, settle

from gateway import errors
from gateway.auth.principal import Principal
from gateway.backend.credentials import CredentialsUnavailable, TokenFiles
from gateway.backend.memory import MemoryLink, Script

pytestmark = pytest.mark.system

TOKENS = {"alice": "alice-inbound-1", "bob": "bob-inbound-2"}


def per_principal(tmp_path: Path) -> str:
    private(tmp_path / "bearer-alice.env", "WHO=alice\n")
    private(tmp_path / "bearer-bob.env", "WHO=bob\n")
    return fixture_backend("fx", sharing="per-principal", max_sessions=4,
                           env_files=str(tmp_path / "{principal}.env"))


def updates(c: Any) -> list[str]:
    return [n["params"]["uri"] for n in c.notifications
            if n["method"] == "notifications/resources/updated"]


async def subscriptions(c: Any) -> list[str]:
    info: list[str] = json.loads(text_of(await c.call("fx__client_info")))["subscriptions"]
    return info


async def test_subscriptions_and_updates_stay_with_their_principal(tmp_path: Path) -> None:
    """A principal's subscription goes to its own child alone (never another principal's, nor
    the probe), is let go upstream when that principal's last session lets go, and its
    child's ``resources/updated`` reaches that principal's sessions alone; a child's list
    change reaches nobody (the catalog is the probe's)."""
    cfg = make_config(per_principal(tmp_path), extra=bearer_auth(TOKENS))
    with trio.fail_after(30):
        async with (run_gateway(cfg) as gw,
                    connect(gw.url, token=TOKENS["alice"]) as a,
                    connect(gw.url, token=TOKENS["bob"]) as b):
            assert text_of(await b.call("fx__getenv", {"name": "WHO"})) == "bob"
            shared, secret = "fixture://static/a", "fixture://static/b"
            for c, uri in ((b, shared), (a, shared), (a, secret)):
                assert "result" in await c.request("resources/subscribe", {"uri": uri})
            assert text_of(await a.call("fx__getenv", {"name": "WHO"})) == "alice"
            assert await subscriptions(b) == [shared]  # never alice's URI
            assert await subscriptions(a) == [shared, secret]
            # alice's child says the shared URI changed: alice hears it, bob does not
            assert text_of(await a.call("fx__update_resource", {"uri": shared})) == "ok"
            await a.wait_for(lambda: updates(a))
            await b.request("ping")
            await b.call("fx__client_info")  # (anything queued for bob before is in)
            assert updates(a) == [shared] and updates(b) == []
            # alice lets go of the shared URI: her child is told, though bob still holds it
            assert "result" in await a.request("resources/unsubscribe", {"uri": shared})
            assert await subscriptions(a) == [secret]
            assert await subscriptions(b) == [shared]
            # a per-principal child's list change: neither principal is told, the catalog stays
            assert text_of(await a.call("fx__notify_list_changed", {"kind": "tools"})) == "ok"
            await a.request("ping")
            await b.request("ping")
            changed = [n for c in (a, b) for n in c.notifications
                       if n["method"].endswith("/list_changed")]
            assert changed == []
            tools = (await b.request("tools/list"))["result"]["tools"]
            assert "fx__extra_tool" not in {t["name"] for t in tools}


async def test_status_names_a_per_principal_instance_by_its_label(tmp_path: Path) -> None:
    cfg = make_config(per_principal(tmp_path), extra=bearer_auth(TOKENS))
    with trio.fail_after(30):
        async with (run_gateway(cfg) as gw,
                    connect(gw.url, token=TOKENS["alice"]) as a):
            assert text_of(await a.call("fx__getenv", {"name": "WHO"})) == "alice"
            st = await gw.status_until(lambda s: len(backend_in(s, "fx")["instances"]) == 2)
            owners = {i["name"]: i["owner"] for i in backend_in(st, "fx")["instances"]}
            assert owners == {"fx/0": None, "fx/p1": "alice"}


async def test_an_elicitation_completion_reaches_the_principal_whose_child_asked(
        tmp_path: Path) -> None:
    """Two principals' children pick the same URL-mode ``elicitationId``: each child's
    completion goes to its own principal's session, never to the other's."""
    cfg = make_config(per_principal(tmp_path), extra=bearer_auth(TOKENS))
    caps = {"elicitation": {"form": {}, "url": {}}}
    with trio.fail_after(30):
        async with (run_gateway(cfg) as gw,
                    connect(gw.url, token=TOKENS["alice"], capabilities=caps) as a,
                    connect(gw.url, token=TOKENS["bob"], capabilities=caps) as b):
            for c, who in ((a, "alice"), (b, "bob")):
                await c.send({"jsonrpc": "2.0", "id": 900, "method": "tools/call", "params": {
                    "name": "fx__elicit", "arguments": {
                        "message": "sign in", "url": f"https://idp.example/{who}",
                        "elicitation_id": "e1"}}})
                asked = await c.wait_for(lambda c=c: c.requests)
                assert asked[0]["params"]["url"] == f"https://idp.example/{who}"
                await c.send({"jsonrpc": "2.0", "id": asked[0]["id"],
                              "result": {"action": "accept"}})
                assert "result" in await c.response(900)
            assert text_of(await a.call("fx__complete_elicitation", {"id": "e1"})) == "ok"
            await b.request("ping")

            def completed(c: Any) -> list[Any]:
                return [n for n in c.notifications
                        if n["method"] == "notifications/elicitation/complete"]

            await a.wait_for(lambda: completed(a), timeout=5)
            assert completed(b) == []
            assert text_of(await b.call("fx__complete_elicitation", {"id": "e1"})) == "ok"
            await b.wait_for(lambda: completed(b), timeout=5)
            assert len(completed(a)) == 1


async def test_a_token_file_made_group_readable_is_refused_though_its_content_is_unchanged(
        tmp_path: Path) -> None:
    """The token file's mode is checked at each use: a chmod (which leaves its inode, size
    and mtime alone) is seen, not hidden by the cached token."""
    path = tmp_path / "bearer-alice.token"
    private(path, "tok-alice\n")
    source = TokenFiles(str(tmp_path / "{principal}.token"))
    alice = Principal("alice", via="bearer", label="alice")
    assert await source.headers(alice) == [("authorization", "Bearer tok-alice")]
    path.chmod(0o640)
    with pytest.raises(CredentialsUnavailable, match="mode 0640"):
        await source.headers(alice)
    path.chmod(0o600)
    assert await source.headers(alice) == [("authorization", "Bearer tok-alice")]


class Recording:
    """A credential source that records whom it was asked for and told to forget."""

    kind = "token_exchange"

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.forgotten: list[str] = []

    async def headers(self, principal: Principal) -> list[tuple[str, str]]:
        self.asked.append(principal.key)
        return [("authorization", f"Bearer for-{principal.name}")]

    def forget(self, principal_key: str) -> None:
        self.forgotten.append(principal_key)


async def test_a_principal_over_max_sessions_gets_no_upstream_token(
        autojump_clock: trio.testing.MockClock) -> None:
    """A principal refused by ``max_sessions`` is refused before its upstream credentials are
    asked for (no token exchanged, none cached for it); the principal holding the one instance
    goes on."""
    cfg = memory_config(backend("fx", sharing="per-principal", max_sessions=1))
    async with running(cfg) as h:
        await settle()
        fx = h.hub.backends["fx"]
        source = fx.credentials = Recording()
        alice = Principal("alice", via="oauth", token="a")
        inst, _ = await fx.acquire(Owner(), principal=alice)
        for _ in range(3):
            with pytest.raises(errors.Overloaded, match="max_sessions"):
                await fx.acquire(Owner(), principal=Principal("carol", via="oauth", token="c"))
        assert source.asked == ["oauth:alice"]
        again, _ = await fx.acquire(Owner(), principal=alice)
        assert again is inst


async def test_a_principals_lists_never_become_everyones_catalog(
        autojump_clock: trio.testing.MockClock) -> None:
    """The backend's lists (every caller's catalog) come from the probe alone: a principal's
    instance ready before the probe (slow, or failing with the backend's own identity, as after
    a reload restarted the backend while the old catalog still routes calls) does not set them."""
    first: list[MemoryLink] = []

    async def tools_list(link: MemoryLink, params: dict[str, Any]) -> Any:
        first.append(first[0] if first else link)
        if link is first[0]:
            await trio.sleep_forever()  # the probe never lists
        return {"tools": [{"name": "alices_own", "inputSchema": {"type": "object"}}]}

    cfg = memory_config(backend("fx", sharing="per-principal", start_timeout=5.0))
    async with running(cfg, {"fx": Script(methods={"tools/list": tools_list})}) as h:
        fx = h.hub.backends["fx"]
        inst, _ = await fx.acquire(Owner(), principal=Principal("alice", via="bearer"))
        assert [t["name"] for t in inst.lists.tools] == ["alices_own"]
        await settle()
        assert not fx.lists.tools and not fx.lists_ready.is_set()
        assert "fx__alices_own" not in h.hub.catalog.tool_routes
