"""The ``[telemetry]`` section and the tracer of ``gateway.ops.telemetry``: sampling and trust,
export drops counted, exporters by protocol (config, then ``OTEL_*``), the headers file, and no
OpenTelemetry import while telemetry is off."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import msgspec
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry, generate_latest

from gateway import config
from gateway.config import TelemetrySection
from gateway.errors import ConfigError
from gateway.ops import telemetry

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
ROOT = Path(__file__).resolve().parents[2]


class Kept(SpanExporter):
    """Keeps what it is given; ``hold`` blocks each export until set; ``fail`` fails them."""

    def __init__(self, *, fail: bool = False) -> None:
        self.spans: list[ReadableSpan] = []
        self.hold = threading.Event()
        self.hold.set()
        self.fail = fail

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.hold.wait(10)
        self.spans.extend(spans)
        return SpanExportResult.FAILURE if self.fail else SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.hold.set()


def params(meta: dict[str, str] | None = None, **extra: str) -> msgspec.Raw:
    body: dict[str, object] = dict(extra)
    if meta is not None:
        body["_meta"] = meta
    return msgspec.Raw(msgspec.json.encode(body))


def make(exporter: SpanExporter, **keys: object) -> telemetry.Telemetry:
    return telemetry.Telemetry(TelemetrySection(enabled=True, **keys),  # type: ignore[arg-type]
                               service_name="gw", exporter=exporter, environ={})


def one_call(tel: telemetry.Telemetry, principal: str | None = None) -> None:
    trace = tel.request("tools/call", params({"traceparent": PARENT}, name="fx__echo"),
                        "websocket", principal)
    trace.span("policy", 0, "allow")
    trace.call("fx", "fx")
    trace.call_done(None)
    trace.end("ok", None, "fx", "fx__echo")


@pytest.mark.parametrize(("trust", "principal", "followed"), [
    ("never", "alice", False), ("authenticated", None, False), ("authenticated", "alice", True),
    ("always", None, True)])
def test_a_sampled_parent_is_followed_only_when_trusted(trust: str, principal: str | None,
                                                        followed: bool) -> None:
    kept = Kept()
    tel = make(kept, sample_ratio=0.0, trust_parent=trust)
    one_call(tel, principal)
    tel.shutdown()
    if followed:  # the parent said sampled: the whole request is recorded under its trace
        assert {s.name for s in kept.spans} == {"tools/call fx__echo", "policy"}
        assert all(s.context.trace_id == int(PARENT[3:35], 16) for s in kept.spans)
    else:  # ratio 0 for a new trace: nothing, whatever the client asked
        assert kept.spans == []


def test_the_client_span_context_is_what_the_backend_gets() -> None:
    kept = Kept()
    tel = make(kept, trust_parent="always")
    trace = tel.request("prompts/get", params({"traceparent": PARENT, "tracestate": "a=1"},
                                              name="greet"), "unix", None)
    keys = trace.call("fx", "fx#1")
    trace.call_done(-32603)
    trace.end("error", -32603, "fx", None)
    tel.shutdown()
    call = next(s for s in kept.spans if s.kind.name == "CLIENT")
    ctx = call.context
    assert msgspec.json.decode(keys["traceparent"]) == (
        f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}")
    assert msgspec.json.decode(keys["tracestate"]) == "a=1"
    assert call.attributes is not None and call.attributes["rpc.jsonrpc.error_code"] == -32603
    assert call.attributes["mcp_gateway.instance"] == "fx#1"


@pytest.mark.parametrize("bad", ["00-zz-00f067aa0ba902b7-01", "x" * 200, "00-" + "0" * 32
                                 + "-00f067aa0ba902b7-01"])
def test_a_bad_traceparent_starts_a_new_trace(bad: str) -> None:
    kept = Kept()
    tel = make(kept, trust_parent="always")
    tel.request("tools/list", params({"traceparent": bad}), "http", None).end("ok", None, "", None)
    tel.request("tools/list", msgspec.Raw(b'{"_meta": 3}'), "http", None).end("ok", None, "", None)
    tel.shutdown()
    assert len(kept.spans) == 2 and all(s.parent is None and not s.links for s in kept.spans)


def test_a_full_queue_drops_spans_counted_and_never_blocks(
        caplog: pytest.LogCaptureFixture) -> None:
    kept = Kept()
    kept.hold.clear()  # the export thread is stuck in its first export
    tel = make(kept, max_queue=4)
    for _ in range(50):
        tel.request("ping", None, "unix", None).end("ok", None, "", None)
    assert tel.drops.queue_full >= 40  # 4 queued, at most one batch taken by the stuck export
    assert [r.getMessage() for r in caplog.records
            if r.name == telemetry.SDK_QUEUE_LOGGER] == ["Queue full, dropping Span."]
    kept.hold.set()
    tel.shutdown()
    # every span exported or counted; one the export thread made room for just as the SDK
    # logged "Queue full" is both (its check-then-append is not locked)
    assert 50 <= len(kept.spans) + tel.drops.queue_full <= 52
    registry = CollectorRegistry()
    registry.register(tel.drops)
    text = generate_latest(registry).decode()
    assert (f'mcp_gateway_telemetry_spans_dropped_total{{reason="queue_full"}} '
            f"{float(tel.drops.queue_full)}\n") in text


def test_failed_exports_count_their_spans_as_dropped() -> None:
    kept = Kept(fail=True)
    tel = make(kept)
    for _ in range(3):
        tel.request("ping", None, "unix", None).end("ok", None, "", None)
    tel.shutdown()
    assert tel.drops.export_failed == 3 and tel.drops.queue_full == 0


def test_exporters_by_protocol_config_first_then_environment(tmp_path: Path) -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as Grpc,
    )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as Http,
    )
    (tmp_path / "h").write_text("# credentials\nAuthorization: Bearer s3cret\n\nx-team: a\n")
    grpc = telemetry.exporter_of(TelemetrySection(protocol="grpc", endpoint="http://c:4317",
                                                  headers_file="h"), str(tmp_path), {})
    assert isinstance(grpc, Grpc)
    grpc.shutdown()
    http = telemetry.exporter_of(TelemetrySection(endpoint="https://c/v1/traces"), ".", {})
    assert isinstance(http, Http) and http._endpoint == "https://c/v1/traces"
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    assert isinstance(telemetry.exporter_of(TelemetrySection(), ".", env), Grpc)
    assert isinstance(telemetry.exporter_of(TelemetrySection(protocol="http/protobuf"), ".",
                                            env), Http)
    assert telemetry.read_headers_file(str(tmp_path / "h")) == {
        "authorization": "Bearer s3cret", "x-team": "a"}
    with pytest.raises(ValueError, match="not one of"):
        telemetry.protocol_of(TelemetrySection(), {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    assert telemetry.ratio_of(TelemetrySection(), {"OTEL_TRACES_SAMPLER_ARG": "0.25"}) == 0.25
    assert telemetry.ratio_of(TelemetrySection(sample_ratio=0.5),
                              {"OTEL_TRACES_SAMPLER_ARG": "0.25"}) == 0.5
    with pytest.raises(ValueError, match="not a ratio"):
        telemetry.ratio_of(TelemetrySection(), {"OTEL_TRACES_SAMPLER_ARG": "2"})


def test_a_bad_headers_file_line_names_the_line_not_the_value(tmp_path: Path) -> None:
    path = tmp_path / "h"
    path.write_text("Authorization Bearer s3cret\n")
    with pytest.raises(ValueError, match=r"h:1: expected 'name: value'") as info:
        telemetry.read_headers_file(str(path))
    assert "s3cret" not in str(info.value)
    path.write_text("x: caf\u00e9\n")
    with pytest.raises(ValueError, match="the value of x is not printable ASCII"):
        telemetry.read_headers_file(str(path))


def test_trace_headers_come_from_the_forwarded_meta() -> None:
    body = msgspec.json.encode({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
        "name": "echo", "_meta": {"traceparent": PARENT, "tracestate": "a=1"}}})
    assert telemetry.trace_headers(body) == [("traceparent", PARENT), ("tracestate", "a=1")]
    assert telemetry.trace_headers(b'{"jsonrpc":"2.0","method":"notifications/initialized"}') == []
    assert telemetry.trace_headers(b"not json") == []


def test_telemetry_keys_are_checked() -> None:
    with pytest.raises(ConfigError) as info:
        config.load('[telemetry]\nenabled = true\nsample_ratio = 1.5\nendpoint = "ftp://x"\n'
                    'max_queue = 0\ntrust_parent = "clients"\n')
    text = "\n".join(info.value.errors)
    assert "telemetry.trust_parent" in text
    with pytest.raises(ConfigError) as info:
        config.load('[telemetry]\nsample_ratio = 1.5\nendpoint = "ftp://x"\nmax_queue = 0\n')
    assert info.value.errors == [
        "telemetry.sample_ratio: must be between 0 and 1",
        "telemetry.endpoint: 'ftp://x' is not an http:// or https:// URL",
        "telemetry.max_queue: need 1 ... 1000000 spans"]
    cfg = config.load("")
    assert cfg.telemetry == TelemetrySection() and not cfg.telemetry.enabled
    changed = config.load("[telemetry]\nenabled = true\n")
    assert config.restart_only_changes(cfg, changed) == ["telemetry"]


def test_telemetry_off_imports_no_opentelemetry() -> None:
    code = ("import sys, trio\n"
            "from gateway import cli, config, service\n"
            "cfg = config.load('[telemetry]\\nenabled = false\\n')\n"
            "assert service._telemetry(cfg) is None\n"
            "bad = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)
