"""The merged catalog: namespacing, valid names, collisions, resource routing, pagination."""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.protocol.catalog import (
    MAX_NAME,
    VALID_NAME,
    BackendLists,
    CatalogConflict,
    Route,
    build_catalog,
    decode_cursor,
    encode_cursor,
    expose_name,
    page,
)


def tools(*names: str) -> BackendLists:
    return BackendLists(tools=[{"name": n, "description": f"tool {n}"} for n in names])


# ---- names ------------------------------------------------------------------------------


def test_tools_are_namespaced_and_route_back() -> None:
    lists = [("a", "a", tools("echo")), ("b", "b", tools("echo", "add"))]
    cat, warnings = build_catalog(lists, "__")
    assert warnings == []
    assert sorted(t["name"] for t in cat.tools) == ["a__echo", "b__add", "b__echo"]
    assert cat.tool_routes["a__echo"] == Route("a", "echo")
    assert cat.tool_routes["b__echo"] == Route("b", "echo")
    assert cat.tool_defs["b__add"]["description"] == "tool add"  # other fields untouched


def test_custom_separator_and_route_is_a_lookup_not_a_split() -> None:
    cat, _ = build_catalog([("srv", "my__pre", tools("x__y"))], "-")
    assert cat.tool_routes == {"my__pre-x__y": Route("srv", "x__y")}


def test_empty_prefix_keeps_names() -> None:
    cat, _ = build_catalog([("time", "", tools("get_current_time"))], "__")
    assert [t["name"] for t in cat.tools] == ["get_current_time"]
    assert cat.tool_routes["get_current_time"] == Route("time", "get_current_time")


def test_prompts_are_namespaced_too() -> None:
    lists = BackendLists(prompts=[{"name": "greet", "arguments": []}])
    cat, _ = build_catalog([("p", "p", lists)], "__")
    assert [p["name"] for p in cat.prompts] == ["p__greet"]
    assert cat.prompt_routes["p__greet"] == Route("p", "greet")


def test_input_lists_are_not_mutated() -> None:
    lists = tools("echo")
    build_catalog([("a", "a", lists)], "__")
    assert lists.tools == [{"name": "echo", "description": "tool echo"}]


@pytest.mark.parametrize(
    "name",
    [
        "do.something",
        "with space",
        "slash/name",
        "ünïcödé",
        "emoji😀",
        "x" * 64,
        "y" * 200,
        "a.b" * 40,
        ":",
    ],
)
def test_invalid_or_long_names_are_shortened_validly(name: str) -> None:
    public = expose_name("backend", "__", name)
    assert VALID_NAME.fullmatch(public)
    assert len(public) <= MAX_NAME
    assert public == expose_name("backend", "__", name)  # deterministic
    cat, _ = build_catalog([("backend", "backend", tools(name))], "__")
    assert cat.tool_routes[public] == Route("backend", name)


@settings(max_examples=60, deadline=None)
@given(
    names=st.lists(st.text(min_size=1, max_size=120), min_size=1, max_size=15, unique=True),
    prefix=st.sampled_from(["", "a", "backend-with-a-long-prefix_32chars"]),
)
def test_exposed_names_are_valid_unique_and_map_back(names: list[str], prefix: str) -> None:
    cat, _ = build_catalog([("b", prefix, tools(*names))], "__")
    exposed = [t["name"] for t in cat.tools]
    assert all(VALID_NAME.fullmatch(n) for n in exposed)
    assert len(set(exposed)) == len(exposed) == len(names)
    assert {r.name for r in cat.tool_routes.values()} == set(names)
    assert all(r.backend == "b" for r in cat.tool_routes.values())
    # Same input, same output.
    again, _ = build_catalog([("b", prefix, tools(*names))], "__")
    assert again.tool_routes == cat.tool_routes


def test_names_differing_only_in_invalid_chars_stay_distinct() -> None:
    cat, _ = build_catalog([("b", "b", tools("a.b", "a,b", "a b", "a_b"))], "__")
    assert len(cat.tool_routes) == 4
    assert cat.tool_routes["b__a_b"] == Route("b", "a_b")  # the valid one keeps its name
    assert {r.name for r in cat.tool_routes.values()} == {"a.b", "a,b", "a b", "a_b"}


def test_long_names_with_a_common_head_stay_distinct() -> None:
    head = "n" * 80
    cat, _ = build_catalog([("b", "b", tools(head + "1", head + "2"))], "__")
    assert len(cat.tool_routes) == 2
    assert {r.name for r in cat.tool_routes.values()} == {head + "1", head + "2"}


def test_items_without_a_name_or_duplicated_are_skipped_with_a_warning() -> None:
    lists = BackendLists(
        tools=[{"name": "ok"}, {"description": "nameless"}, {"name": 3}, {"name": "ok"}]
    )
    cat, warnings = build_catalog([("b", "b", lists)], "__")
    assert list(cat.tool_routes) == ["b__ok"]
    assert len(warnings) == 3


# ---- collisions -------------------------------------------------------------------------


def colliding() -> list[tuple[str, str, BackendLists]]:
    # Both backends share the prefix "x": both expose "x__echo".
    return [("first", "x", tools("echo", "only_first")), ("second", "x", tools("echo"))]


def test_strict_collision_names_both_backends() -> None:
    with pytest.raises(CatalogConflict) as info:
        build_catalog(colliding(), "__", strict=True)
    text = str(info.value)
    assert "'first'" in text and "'second'" in text and "x__echo" in text


def test_strict_collision_via_empty_prefix() -> None:
    lists = [("a", "", tools("b__t")), ("b", "b", tools("t"))]
    with pytest.raises(CatalogConflict) as info:
        build_catalog(lists, "__", strict=True)
    assert "backend 'a'" in str(info.value) and "backend 'b'" in str(info.value)


def test_non_strict_collision_first_in_config_order_keeps_the_name() -> None:
    cat, warnings = build_catalog(colliding(), "__")
    assert cat.tool_routes["x__echo"] == Route("first", "echo")
    renamed = [n for n, r in cat.tool_routes.items() if r == Route("second", "echo")]
    assert len(renamed) == 1 and renamed[0] != "x__echo"
    assert VALID_NAME.fullmatch(renamed[0])
    assert len(warnings) == 1
    assert "'first'" in warnings[0] and "'second'" in warnings[0] and renamed[0] in warnings[0]


def test_non_strict_collision_is_deterministic_and_independent_of_item_order() -> None:
    names_a = ["echo", "add", "sub", "zeta", "y" * 90]
    names_b = ["echo", "sub", "other", "y" * 90]
    reference, ref_warnings = build_catalog(
        [("a", "x", tools(*names_a)), ("b", "x", tools(*names_b))], "__"
    )
    rng = random.Random(1234)
    for _ in range(10):
        rng.shuffle(names_a)
        rng.shuffle(names_b)
        lists = [("a", "x", tools(*names_a)), ("b", "x", tools(*names_b))]
        cat, warnings = build_catalog(lists, "__")
        assert cat.tool_routes == reference.tool_routes
        assert [t["name"] for t in cat.tools] == [t["name"] for t in reference.tools]
        assert warnings == ref_warnings
    # Every backend tool is still reachable, under a unique valid name.
    assert len(reference.tool_routes) == len(names_a) + len(names_b)
    assert all(VALID_NAME.fullmatch(n) for n in reference.tool_routes)


def test_collision_in_prompts_is_resolved_too() -> None:
    a = BackendLists(prompts=[{"name": "p"}])
    b = BackendLists(prompts=[{"name": "p"}])
    cat, warnings = build_catalog([("a", "s", a), ("b", "s", b)], "__")
    assert cat.prompt_routes["s__p"] == Route("a", "p")
    assert len(cat.prompt_routes) == 2 and len(warnings) == 1
    with pytest.raises(CatalogConflict):
        build_catalog([("a", "s", a), ("b", "s", b)], "__", strict=True)


# ---- resources --------------------------------------------------------------------------


def resources_catalog():
    demo = BackendLists(
        resources=[{"uri": "demo://static/1", "name": "one"}],
        templates=[{"uriTemplate": "demo://x/{id}", "name": "x"}],
    )
    files = BackendLists(
        resources=[{"uri": "demo://static/1", "name": "dup"}, {"uri": "file:///etc/motd"}],
        templates=[{"uriTemplate": "file:///{+path}", "name": "files"}],
    )
    return build_catalog([("demo", "demo", demo), ("files", "files", files)], "__")


def test_resources_route_by_exact_uri_first_in_config_order() -> None:
    cat, warnings = resources_catalog()
    assert cat.route_resource("demo://static/1") == "demo"
    assert cat.route_resource("file:///etc/motd") == "files"
    assert [r["uri"] for r in cat.resources] == ["demo://static/1", "file:///etc/motd"]
    assert len(warnings) == 1 and "demo://static/1" in warnings[0]


def test_simple_template_matches_one_segment() -> None:
    cat, _ = resources_catalog()
    assert cat.route_resource("demo://x/7") == "demo"
    assert cat.route_resource("demo://x/abc-def") == "demo"
    assert cat.route_resource("demo://x/7/8") is None
    assert cat.route_resource("demo://y/7") is None
    assert cat.route_resource("demo://x/7?q=1") is None


def test_reserved_expansion_matches_slashes() -> None:
    cat, _ = resources_catalog()
    assert cat.route_resource("file:///a/b/c.txt") == "files"
    assert cat.route_resource("file:///") == "files"


def test_template_metacharacters_are_literal() -> None:
    lists = BackendLists(templates=[{"uriTemplate": "q://a.b/{id}+x"}])
    cat, _ = build_catalog([("q", "q", lists)], "__")
    assert cat.route_resource("q://a.b/1+x") == "q"
    assert cat.route_resource("q://aXb/1+x") is None
    assert cat.route_resource("q://a.b/1x") is None


def test_route_template_by_its_text() -> None:
    cat, _ = resources_catalog()
    assert cat.route_template("demo://x/{id}") == "demo"
    assert cat.route_template("file:///{+path}") == "files"
    assert cat.route_template("nope://{x}") is None
    assert [t["uriTemplate"] for t in cat.templates] == ["demo://x/{id}", "file:///{+path}"]


def test_unknown_uri_is_unrouted() -> None:
    cat, _ = resources_catalog()
    assert cat.route_resource("other://thing") is None


# ---- pagination -------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 9, 10, 11, 25])
@pytest.mark.parametrize("size", [1, 3, 10])
def test_pages_cover_the_list_exactly_once(n: int, size: int) -> None:
    items = [{"name": f"t{i}"} for i in range(n)]
    seen: list[dict[str, str]] = []
    cursor: str | None = None
    pages = 0
    while True:
        result = page("tools", items, cursor, size)
        assert result is not None
        chunk, cursor = result
        assert len(chunk) <= size
        seen.extend(chunk)
        pages += 1
        assert pages <= n + 1
        if cursor is None:
            break
        assert re.fullmatch(r"[A-Za-z0-9_-]+", cursor)  # opaque, URL-safe
    assert seen == items


@pytest.mark.parametrize(
    "cursor",
    [
        encode_cursor("prompts", 1),  # another kind
        "garbage!!",
        "",
        "%%%",
        encode_cursor("tools", 11),  # beyond the list
        encode_cursor("tools", -1),
        encode_cursor("tools", 0)[:-1] + "~",
        "dG9vbHM6eA",  # "tools:x"
        "//79",  # not UTF-8
    ],
)
def test_invalid_cursors(cursor: str) -> None:
    items = [{"name": str(i)} for i in range(10)]
    assert page("tools", items, cursor, 3) is None


def test_cursor_roundtrip_and_end_of_list() -> None:
    assert decode_cursor("tools", encode_cursor("tools", 4), 10) == 4
    assert decode_cursor("tools", encode_cursor("tools", 10), 10) == 10  # end: empty page
    assert decode_cursor("tools", encode_cursor("tools", 11), 10) is None
    assert decode_cursor("tools", encode_cursor("resources", 4), 10) is None
    assert page("tools", [{"name": "a"}], encode_cursor("tools", 1), 5) == ([], None)
