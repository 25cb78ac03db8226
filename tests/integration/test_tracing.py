"""OpenTelemetry traces end to end: a real daemon exports over OTLP/HTTP to a local receiver
that decodes the protobuf; each kind of backend (a legacy stdio child, a modern one, a remote
over HTTP) gets the trace context of the gateway's client span."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import httpx
import pytest
import trio
from fixtures.remote_server import RemoteServer
from helpers import (
    ROOT,
    connect,
    fixture_backend,
    free_port,
    make_config,
    metric,
    run_gateway,
    text_of,
)
from otlputil import GrpcReceiver, Received, Receiver

pytestmark = [pytest.mark.system, pytest.mark.filterwarnings("ignore::ResourceWarning")]

MODERN_FIXTURE = os.path.join(ROOT, "tests", "fixtures", "modern_server.py")
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
V = "2026-07-28"
MODERN_META = {"io.modelcontextprotocol/protocolVersion": V,
               "io.modelcontextprotocol/clientCapabilities": {}}


def telemetry(url: str, **keys: Any) -> str:
    lines = ["[telemetry]", "enabled = true", f'endpoint = "{url}"',
             *(f"{k} = {json.dumps(v)}" for k, v in keys.items())]
    return "\n".join(lines) + "\n"


def backends(transcript: str, remote_port: int) -> str:
    return (fixture_backend("fx", env={"FIXTURE_TRANSCRIPT": transcript})
            + "[backends.mo]\n"
            f"command = {json.dumps(sys.executable)}\n"
            f"args = [{json.dumps(MODERN_FIXTURE)}]\n"
            'protocol_mode = "modern_only"\n'
            "[backends.ev]\n"
            f'url = "http://127.0.0.1:{remote_port}/mcp"\n'
            "start_timeout = 10.0\n"
            '[[policy.rules]]\nmatch = "fx__*"\naction = "allow"\n')


def traceparent(trace_id: str, span_id: str, flags: str = "01") -> str:
    return f"00-{trace_id}-{span_id}-{flags}"


def context_of(header: str) -> tuple[str, str, bool]:
    """(trace id, span id, sampled) of a ``traceparent``."""
    version, trace_id, span_id, flags = header.split("-")
    assert version == "00"
    return trace_id, span_id, bool(int(flags, 16) & 1)


def forwarded_meta(transcript: str, tool: str) -> dict[str, Any]:
    """The ``_meta`` of the tools/call the legacy child read from its stdin."""
    with open(transcript) as f:
        lines = [json.loads(line) for line in f if line.startswith("{")]
    calls = [m for m in lines if m.get("method") == "tools/call"
             and m.get("params", {}).get("name") == tool]
    assert len(calls) == 1, lines
    meta: dict[str, Any] = calls[0]["params"]["_meta"]
    return meta


def only(spans: list[Received], **want: Any) -> Received:
    got = [s for s in spans if all(getattr(s, k) == v for k, v in want.items())]
    assert len(got) == 1, (want, spans)
    return got[0]


async def test_one_call_traced_across_the_gateway_into_each_kind_of_backend(
        tmp_path: Any) -> None:
    transcript = str(tmp_path / "fx.jsonl")
    remote = RemoteServer()
    with Receiver() as rx:
        async with trio.open_nursery() as nursery:
            await nursery.start(remote.serve)
            cfg = make_config(backends(transcript, remote.port),
                              extra=telemetry(rx.url, trust_parent="always"))
            with trio.fail_after(30):
                async with run_gateway(cfg) as gw:
                    async with connect(gw.url) as c:
                        r = await c.request("tools/call", {
                            "name": "fx__echo", "arguments": {"message": "hi"},
                            "_meta": {"traceparent": traceparent(CLIENT_TRACE, CLIENT_SPAN),
                                      "tracestate": "vendor=abc"}})
                        assert text_of(r) == "hi"
                        shown = json.loads(text_of(await c.call("mo__show_meta")))
                        assert text_of(await c.call("ev__echo", {"n": 1})) == '{"n": 1}'
                    async with httpx.AsyncClient() as h:  # a modern POST: context in a header
                        r2 = await h.post(gw.http_url, headers={
                            "accept": "application/json, text/event-stream",
                            "content-type": "application/json", "mcp-protocol-version": V,
                            "mcp-method": "tools/list",
                            "traceparent": traceparent("ab" * 16, "cd" * 8)},
                            json={"jsonrpc": "2.0", "id": 7, "method": "tools/list",
                                  "params": {"_meta": MODERN_META}})
                        assert r2.status_code == 200, r2.text
            nursery.cancel_scope.cancel()
        spans = list(rx.spans)  # the daemon's stop flushed the export queue

    # The legacy stdio call: the server span is a child of the client's span (trusted).
    server = only(spans, kind="server", name="tools/call fx__echo")
    assert (server.trace_id, server.parent) == (CLIENT_TRACE, CLIENT_SPAN)
    assert server.service == "mcp-gateway"
    assert server.attributes["mcp.method.name"] == "tools/call"
    assert server.attributes["gen_ai.tool.name"] == "fx__echo"
    assert server.attributes["mcp_gateway.backend"] == "fx"
    assert server.attributes["mcp_gateway.outcome"] == "ok"
    assert server.attributes["network.transport"] == "websocket"
    assert not server.error
    policy = only(spans, name="policy", trace_id=CLIENT_TRACE)
    assert policy.parent == server.span_id and policy.attributes["mcp_gateway.outcome"] == "allow"
    call = only(spans, kind="client", trace_id=CLIENT_TRACE)
    assert call.parent == server.span_id
    assert call.attributes["mcp_gateway.backend"] == "fx"
    meta = forwarded_meta(transcript, "echo")
    assert meta["traceparent"] == traceparent(CLIENT_TRACE, call.span_id)
    assert meta["tracestate"] == "vendor=abc"

    # The modern stdio child: its own request's _meta carries its client span's context.
    mo = only(spans, kind="server", name="tools/call mo__show_meta")
    assert mo.parent == "" and mo.trace_id != CLIENT_TRACE  # no context given: a new trace
    mo_call = only(spans, kind="client", trace_id=mo.trace_id)
    assert context_of(shown["traceparent"]) == (mo.trace_id, mo_call.span_id, True)
    assert shown["io.modelcontextprotocol/protocolVersion"] == V  # the envelope is still there

    # The remote: the trace context as HTTP headers of the POST (and in _meta).
    ev = only(spans, kind="server", name="tools/call ev__echo")
    ev_call = only(spans, kind="client", trace_id=ev.trace_id)
    posts = [s for s in remote.seen if s.method == "POST" and s.body.get("method") == "tools/call"]
    assert len(posts) == 1
    assert context_of(posts[0].headers["traceparent"]) == (ev.trace_id, ev_call.span_id, True)
    assert posts[0].body["params"]["_meta"]["traceparent"] == posts[0].headers["traceparent"]

    # /mcp: the traceparent header is the parent of a request without one in _meta.
    listed = only(spans, kind="server", name="tools/list", trace_id="ab" * 16)
    assert listed.parent == "cd" * 8 and listed.attributes["network.transport"] == "http"


async def test_an_untrusted_parent_is_only_linked_and_cannot_force_sampling(
        tmp_path: Any) -> None:
    transcript = str(tmp_path / "fx.jsonl")
    with Receiver() as rx:
        cfg = make_config(fixture_backend("fx", env={"FIXTURE_TRANSCRIPT": transcript}),
                          extra=telemetry(rx.url, sample_ratio=0.0))  # trust_parent: never
        with trio.fail_after(30):
            async with run_gateway(cfg) as gw, connect(gw.url) as c:
                for tool in ("echo", "progress"):
                    r = await c.request("tools/call", {
                        "name": f"fx__{tool}", "arguments": {"message": "m", "steps": 1},
                        "_meta": {"traceparent": traceparent(CLIENT_TRACE, CLIENT_SPAN),
                                  "tracestate": "vendor=abc"}})
                    assert "result" in r, r
        spans = list(rx.spans)
    assert spans == []  # the client said "sampled"; the gateway samples nothing at ratio 0
    meta = forwarded_meta(transcript, "echo")
    trace_id, span_id, sampled = context_of(meta["traceparent"])  # the gateway's own context
    assert trace_id != CLIENT_TRACE and span_id != CLIENT_SPAN and not sampled
    assert "tracestate" not in meta


async def test_an_untrusted_parent_becomes_a_link_of_a_new_trace(tmp_path: Any) -> None:
    with Receiver() as rx:
        cfg = make_config(fixture_backend("fx"), extra=telemetry(rx.url))  # ratio 1, never
        with trio.fail_after(30):
            async with run_gateway(cfg) as gw, connect(gw.url) as c:
                r = await c.request("tools/call", {
                    "name": "fx__echo", "arguments": {"message": "m"},
                    "_meta": {"traceparent": traceparent(CLIENT_TRACE, CLIENT_SPAN, "00")}})
                assert text_of(r) == "m"
                r = await c.call("fx__nope")
                assert r["error"]["code"] == -32602
                for reason in ("queue_full", "export_failed"):
                    assert await metric(gw.bound.admin_port,
                                        "mcp_gateway_telemetry_spans_dropped_total",
                                        reason=reason) == 0
        spans = list(rx.spans)
    server = only(spans, kind="server", name="tools/call fx__echo")
    assert server.trace_id != CLIENT_TRACE and server.parent == ""
    assert server.links == [(CLIENT_TRACE, CLIENT_SPAN)]
    failed = only(spans, kind="server", name="tools/call fx__nope")
    assert failed.error and failed.attributes["rpc.jsonrpc.error_code"] == -32602
    assert failed.attributes["mcp_gateway.outcome"] == "error"


async def test_a_consent_prompt_and_the_wait_for_an_instance_are_spans_of_the_call() -> None:
    policy = '[[policy.rules]]\nmatch = "fx__echo"\naction = "ask"\n'
    with Receiver() as rx:
        cfg = make_config(fixture_backend("fx") + policy, extra=telemetry(rx.url))
        with trio.fail_after(30):
            async with run_gateway(cfg) as gw, connect(
                    gw.url, capabilities={"elicitation": {"form": {}}}) as c:
                out: dict[str, Any] = {}

                async def call() -> None:
                    out.update(await c.call("fx__echo", {"message": "m"}))

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(call)
                    prompt = await c.wait_for(lambda: c.requests and c.requests[-1])
                    assert prompt["method"] == "elicitation/create"
                    await c.send({"jsonrpc": "2.0", "id": prompt["id"], "result": {
                        "action": "accept", "content": {"approve": True}}})
                assert text_of(out) == "m"
        spans = list(rx.spans)
    server = only(spans, kind="server", name="tools/call fx__echo")
    children = {s.name: s for s in spans if s.parent == server.span_id}
    assert set(children) == {"policy", "consent", "wait", "tools/call fx__echo"}
    assert children["policy"].attributes["mcp_gateway.outcome"] == "ask"
    assert children["consent"].attributes["mcp_gateway.outcome"] == "ok"
    assert children["tools/call fx__echo"].kind == "client"


async def test_export_over_grpc_with_headers_from_a_file(tmp_path: Any) -> None:
    (tmp_path / "otlp.headers").write_text("# the collector's credentials\nx-api-key: s3cret\n")
    with GrpcReceiver() as rx:
        cfg = make_config(fixture_backend("fx"), extra=telemetry(
            rx.url, protocol="grpc", headers_file=str(tmp_path / "otlp.headers")))
        with trio.fail_after(30):
            async with run_gateway(cfg) as gw, connect(gw.url) as c:
                assert text_of(await c.call("fx__echo", {"message": "m"})) == "m"
        spans = list(rx.spans)
        requests = list(rx.requests)
    server = only(spans, kind="server", name="tools/call fx__echo")
    assert only(spans, kind="client").parent == server.span_id
    assert requests and all(r["x-api-key"] == "s3cret" for r in requests)


async def test_a_modern_remote_gets_the_client_span_context_as_headers(tmp_path: Any) -> None:
    from test_remote_modern import recorded, sdk_server
    from test_remote_modern import remote as modern_remote

    port, record = free_port(), str(tmp_path / "seen.jsonl")
    with Receiver() as rx:
        cfg = make_config(modern_remote("rm", port, "modern_only"), extra=telemetry(rx.url))
        with trio.fail_after(60):
            async with sdk_server(port, record), run_gateway(cfg) as gw, connect(gw.url) as c:
                assert text_of(await c.call("rm__echo", {"message": "hi"})) == "hi"
        spans = list(rx.spans)
    server = only(spans, kind="server", name="tools/call rm__echo")
    call = only(spans, kind="client", trace_id=server.trace_id)
    posts = [r for r in recorded(record) if r["headers"].get("mcp-method") == "tools/call"]
    assert len(posts) == 1
    assert context_of(posts[0]["headers"]["traceparent"]) == (server.trace_id, call.span_id, True)
