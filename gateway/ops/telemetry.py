"""OpenTelemetry traces of client requests, exported over OTLP (the ``otel`` extra).

Imported by the service only when ``[telemetry] enabled``.  :class:`Telemetry` is the core's
:class:`~gateway.core.tracing.Tracer`: a server span per request, child spans the core reports,
and a client span per backend call whose W3C context the core puts into the forwarded
request's ``_meta`` (and :func:`trace_headers` into a remote's HTTP headers).  An incoming
context becomes the parent only when ``trust_parent`` trusts the caller; else it is a link.
Spans are exported by the SDK's ``BatchSpanProcessor`` in its own thread, its queue bounded;
spans it drops (queue full, failed export) are counted in
``mcp_gateway_telemetry_spans_dropped_total``.  Keys the config leaves unset fall back to the
standard ``OTEL_*`` environment variables.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence

import msgspec
from msgspec import Raw
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway import __version__
from gateway.config import TelemetrySection, header_value_ok, read_regular
from gateway.core import tracing

LOGGER = logging.getLogger(__name__)

PROTOCOLS = ("http/protobuf", "grpc")
#: The SDK logs a record per span its full queue drops (counted, then silenced, here).
SDK_QUEUE_LOGGER = "opentelemetry.sdk._shared_internal"
MAX_HEADERS_FILE = 64 * 1024
MAX_ATTRIBUTE = 256  # characters of a client-given value kept in an attribute or a span name
MAX_TRACEPARENT = 128
MAX_TRACESTATE = 512  # W3C: 32 members of at most 256 characters; more is not propagated
_PROPAGATOR = TraceContextTextMapPropagator()
#: A W3C tracestate member; the SDK logs (unthrottled, CR LF and all) one that is not.
_MEMBER = re.compile(r"(?:[a-z][_0-9a-z\-*/]{0,255}"
                     r"|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13})"
                     r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")


class _Meta(msgspec.Struct):
    traceparent: str | None = None
    tracestate: str | None = None


class _Params(msgspec.Struct):
    meta: _Meta | None = msgspec.field(default=None, name="_meta")
    name: str | None = None
    uri: str | None = None


class _Message(msgspec.Struct):
    params: _Params | None = None


_PARAMS = msgspec.json.Decoder(_Params)
_MESSAGE = msgspec.json.Decoder(_Message)


class Drops(logging.Filter, Collector):
    """Spans dropped: ``queue_full`` (counted from the SDK's log record, logged the first time
    only; the SDK logs before it appends, unlocked, so a span the export thread made room for
    in that instant is counted and still exported: an upper bound) and ``export_failed`` (by
    :class:`_Counted`, in the export thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.queue_full = 0
        self.export_failed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("Queue full"):
            self.queue_full += 1
            return self.queue_full == 1  # the first one is logged, the rest only counted
        return True

    def collect(self) -> Iterable[Metric]:
        fam = CounterMetricFamily("mcp_gateway_telemetry_spans_dropped_total",
                                  "Spans not exported (queue full, export failed).",
                                  labels=["reason"])
        fam.add_metric(["queue_full"], self.queue_full)
        fam.add_metric(["export_failed"], self.export_failed)
        yield fam


class _Counted(SpanExporter):
    """An exporter whose failed batches are counted as dropped."""

    def __init__(self, inner: SpanExporter, drops: Drops) -> None:
        self._inner = inner
        self._drops = drops

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self._inner.export(spans)
        except Exception as exc:  # the export thread must go on
            LOGGER.warning("telemetry: export failed: %s", exc)
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            self._drops.export_failed += len(spans)
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


def read_headers_file(path: str) -> dict[str, str]:
    """Export headers from ``path``: lines ``name: value``; blank lines and ``#`` comments
    skipped.

    Raises:
        ValueError: unreadable, or a line that is not a header (no value is ever shown).
    """
    try:
        text = read_regular(path, MAX_HEADERS_FILE).decode()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"telemetry.headers_file {path}: {exc}") from None
    headers: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition(":")
        name, value = name.strip().lower(), value.strip()
        if not sep or not name or not all(c.isalnum() or c in "-_." for c in name):
            raise ValueError(f"telemetry.headers_file {path}:{n}: expected 'name: value'")
        if not header_value_ok(value):
            raise ValueError(f"telemetry.headers_file {path}:{n}: the value of {name} is not "
                             "printable ASCII")
        headers[name] = value
    return headers


def protocol_of(cfg: TelemetrySection, environ: Mapping[str, str]) -> str:
    """The export protocol: the config's, else ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, else
    ``OTEL_EXPORTER_OTLP_PROTOCOL``, else http/protobuf."""
    protocol = (cfg.protocol or environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
    if protocol not in PROTOCOLS:
        raise ValueError(f"telemetry: OTLP protocol {protocol!r} is not one of "
                         f"{', '.join(PROTOCOLS)}")
    return protocol


def ratio_of(cfg: TelemetrySection, environ: Mapping[str, str]) -> float:
    """The sampling ratio of new traces: the config's, else ``OTEL_TRACES_SAMPLER_ARG``, else
    1.0."""
    if cfg.sample_ratio is not None:
        return cfg.sample_ratio
    arg = environ.get("OTEL_TRACES_SAMPLER_ARG")
    if not arg:
        return 1.0
    try:
        ratio = float(arg)
    except ValueError:
        ratio = -1.0
    if not 0 <= ratio <= 1:
        raise ValueError(f"telemetry: OTEL_TRACES_SAMPLER_ARG {arg!r} is not a ratio in 0 ... 1")
    return ratio


def exporter_of(cfg: TelemetrySection, base_dir: str,
                environ: Mapping[str, str] = os.environ) -> SpanExporter:
    """The OTLP exporter the config (then the environment) describes."""
    headers = None
    if cfg.headers_file:
        headers = read_headers_file(os.path.join(base_dir, cfg.headers_file)) or None
    if protocol_of(cfg, environ) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )
        return GrpcExporter(endpoint=cfg.endpoint, headers=headers)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )
    return HttpExporter(endpoint=cfg.endpoint, headers=headers)


def _bounded(value: str | None) -> str | None:
    return None if value is None else value[:MAX_ATTRIBUTE]


def _context_keys(ctx: trace.SpanContext) -> dict[str, Raw]:
    keys = {"traceparent": Raw(msgspec.json.encode(
        f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"))}
    if ctx.trace_state:
        keys["tracestate"] = Raw(msgspec.json.encode(ctx.trace_state.to_header()))
    return keys


def _tracestate_ok(state: str) -> bool:
    """Whether every member of ``state`` is of the W3C form (empty ones allowed)."""
    return all(not member or _MEMBER.fullmatch(member)
               for member in (m.strip(" \t") for m in state.split(",")))


class RequestTrace:
    """One request's spans (see :class:`gateway.core.tracing.RequestTrace`)."""

    __slots__ = ("_call", "_ctx", "_name", "_span", "_tracer")

    def __init__(self, tracer: trace.Tracer, span: trace.Span, name: str) -> None:
        self._tracer = tracer
        self._span = span
        self._ctx = trace.set_span_in_context(span, Context())
        self._name = name
        self._call: trace.Span | None = None

    @property
    def span_context(self) -> trace.SpanContext:
        return self._span.get_span_context()

    def span(self, name: str, start_ns: int, outcome: str) -> None:
        child = self._tracer.start_span(name, self._ctx, start_time=start_ns,
                                        attributes={"mcp_gateway.outcome": outcome})
        if outcome not in ("ok", "allow", "ask"):
            child.set_status(Status(StatusCode.ERROR, outcome))
        child.end()

    def call(self, backend: str, instance: str) -> dict[str, Raw]:
        self.call_done(None)  # one at a time
        call = self._call = self._tracer.start_span(
            self._name, self._ctx, kind=SpanKind.CLIENT,
            attributes={"mcp_gateway.backend": backend, "mcp_gateway.instance": instance})
        return _context_keys(call.get_span_context())

    def call_done(self, code: int | None) -> None:
        call, self._call = self._call, None
        if call is None:
            return
        if code is not None:
            call.set_attribute("rpc.jsonrpc.error_code", code)
            call.set_status(Status(StatusCode.ERROR))
        call.end()

    def end(self, outcome: str, code: int | None, backend: str, tool: str | None) -> None:
        self.call_done(None)
        span = self._span
        if span.is_recording():
            span.set_attribute("mcp_gateway.outcome", outcome)
            if backend:
                span.set_attribute("mcp_gateway.backend", backend)
            if tool is not None:
                span.set_attribute("gen_ai.tool.name", tool[:MAX_ATTRIBUTE])
            if code is not None:
                span.set_attribute("rpc.jsonrpc.error_code", code)
                span.set_status(Status(StatusCode.ERROR))
        span.end()


class Telemetry:
    """The tracer of the daemon, its export pipeline and its drop counts.

    Args:
        cfg: the ``[telemetry]`` section.
        service_name: ``service.name`` unless ``OTEL_SERVICE_NAME`` says otherwise.
        exporter: where spans go (default: :func:`exporter_of` the config).
    """

    def __init__(self, cfg: TelemetrySection, *, service_name: str, base_dir: str = ".",
                 exporter: SpanExporter | None = None,
                 environ: Mapping[str, str] = os.environ) -> None:
        self.trust = cfg.trust_parent
        attributes: dict[str, str] = {"service.version": __version__}
        if not environ.get("OTEL_SERVICE_NAME"):
            attributes["service.name"] = service_name
        self.drops = Drops()
        self.exporter = exporter or exporter_of(cfg, base_dir, environ)
        sampler = ParentBased(TraceIdRatioBased(ratio_of(cfg, environ)))
        self.provider = TracerProvider(resource=Resource.create(attributes), sampler=sampler,
                                       shutdown_on_exit=False)  # the service shuts it down
        queue = cfg.max_queue
        self.processor = BatchSpanProcessor(
            _Counted(self.exporter, self.drops), max_queue_size=queue,
            max_export_batch_size=None if queue is None else min(queue, 512))
        self.provider.add_span_processor(self.processor)
        # first: the SDK's own filter there passes one record in 20 s of the same message
        logging.getLogger(SDK_QUEUE_LOGGER).filters.insert(0, self.drops)
        self._tracer = self.provider.get_tracer("mcp-gateway", __version__)

    def request(self, method: str, params: Raw | None, transport: str,
                principal: str | None) -> RequestTrace:
        got = None
        if params is not None:
            try:
                got = _PARAMS.decode(params)
            except (msgspec.DecodeError, msgspec.ValidationError):
                got = None  # not ours to refuse: the core decides on the request
        target = None if got is None else _bounded(got.name or got.uri)
        name = method if target is None else f"{method} {target}"
        attributes: dict[str, str] = {"mcp.method.name": method, "network.transport": transport}
        if principal is not None:
            attributes["mcp_gateway.principal"] = principal[:MAX_ATTRIBUTE]
        if got is not None and got.uri is not None:
            attributes["mcp.resource.uri"] = got.uri[:MAX_ATTRIBUTE]
        parent = self._incoming(None if got is None else got.meta)
        ctx, links = Context(), None
        if parent is not None:
            if self.trust == "always" or (self.trust == "authenticated"
                                          and principal is not None):
                ctx = parent
            else:  # not the parent: an untrusted client cannot make the gateway sample
                links = [Link(trace.get_current_span(parent).get_span_context())]
        span = self._tracer.start_span(name, ctx, kind=SpanKind.SERVER, attributes=attributes,
                                       links=links)
        return RequestTrace(self._tracer, span, name)

    def _incoming(self, meta: _Meta | None) -> Context | None:
        """The caller's trace context: its request's ``_meta``, else the /mcp headers."""
        if meta is not None and meta.traceparent is not None:
            parent, state = meta.traceparent, meta.tracestate
        else:
            headers = tracing.http_context.get()
            if headers is None:
                return None
            parent, state = headers
        if len(parent) > MAX_TRACEPARENT:
            return None
        carrier = {"traceparent": parent}
        if state is not None and len(state) <= MAX_TRACESTATE and _tracestate_ok(state):
            carrier["tracestate"] = state
        ctx = _PROPAGATOR.extract(carrier, Context())
        if not trace.get_current_span(ctx).get_span_context().is_valid:
            return None
        return ctx

    @staticmethod
    def message_headers(data: bytes) -> list[tuple[str, str]]:
        """The trace context headers of a message POSTed to a remote (:func:`trace_headers`)."""
        return trace_headers(data)

    def shutdown(self) -> None:
        """Export what is queued (bounded by the exporter's timeout) and stop; blocking."""
        try:
            self.provider.shutdown()
        finally:
            logging.getLogger(SDK_QUEUE_LOGGER).removeFilter(self.drops)


def trace_headers(data: bytes) -> list[tuple[str, str]]:
    """The ``traceparent``/``tracestate`` headers for a request POSTed to a remote backend:
    the context the gateway put into its ``_meta``."""
    try:
        meta = _MESSAGE.decode(data).params
    except (msgspec.DecodeError, msgspec.ValidationError):
        return []
    if meta is None or meta.meta is None or meta.meta.traceparent is None:
        return []
    out = [("traceparent", meta.meta.traceparent)]
    if meta.meta.tracestate:
        out.append(("tracestate", meta.meta.tracestate))
    return out
