"""Local OTLP traces receivers for the tests: OTLP/HTTP (a thread with ``http.server``) and
OTLP/gRPC (``grpcio``'s server), each decoding the exports with the OpenTelemetry protobuf
definitions (``opentelemetry-proto``)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import (
    TraceServiceServicer,
    add_TraceServiceServicer_to_server,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

KINDS = {Span.SPAN_KIND_SERVER: "server", Span.SPAN_KIND_CLIENT: "client",
         Span.SPAN_KIND_INTERNAL: "internal"}


@dataclass
class Received:
    """One span as the receiver decoded it (ids in hex, attributes as plain values)."""

    name: str
    kind: str
    trace_id: str
    span_id: str
    parent: str  # "" for a root span
    attributes: dict[str, Any]
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id)
    error: bool = False
    service: str = ""


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    return getattr(v, which) if which else None


class Receiver:
    """``with Receiver() as rx``: listens on a loopback port (``rx.url`` for the exporter);
    ``rx.spans``: every span received; ``rx.requests``: the raw exports' header dicts."""

    def __init__(self, *, status: int = 200) -> None:
        self.spans: list[Received] = []
        self.requests: list[dict[str, str]] = []
        self.status = status
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                export = ExportTraceServiceRequest()
                export.ParseFromString(body)
                receiver._add(export, dict(self.headers.items()))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(receiver.status)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _add(self, export: ExportTraceServiceRequest, headers: dict[str, str]) -> None:
        got = []
        for rs in export.resource_spans:
            service = next((_value(a.value) for a in rs.resource.attributes
                            if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Received(
                        s.name, KINDS.get(s.kind, str(s.kind)), s.trace_id.hex(), s.span_id.hex(),
                        s.parent_span_id.hex(), {a.key: _value(a.value) for a in s.attributes},
                        [(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                        s.status.code == s.status.STATUS_CODE_ERROR, service))
        with self.lock:
            self.requests.append({k.lower(): v for k, v in headers.items()})
            self.spans.extend(got)

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


class GrpcReceiver(Receiver):
    """The same over OTLP/gRPC: ``rx.url`` is ``http://127.0.0.1:PORT`` (plaintext)."""

    def __init__(self) -> None:
        import grpc

        self.spans = []
        self.requests = []
        self.lock = threading.Lock()
        receiver = self

        class Servicer(TraceServiceServicer):
            def Export(self, request: ExportTraceServiceRequest, context: Any
                       ) -> ExportTraceServiceResponse:
                receiver._add(request, dict(context.invocation_metadata()))
                return ExportTraceServiceResponse()

        self.grpc_server = grpc.server(ThreadPoolExecutor(max_workers=2))
        add_TraceServiceServicer_to_server(Servicer(), self.grpc_server)
        port = self.grpc_server.add_insecure_port("127.0.0.1:0")
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> GrpcReceiver:
        self.grpc_server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.grpc_server.stop(None)
