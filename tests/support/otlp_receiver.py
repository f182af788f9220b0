"""Real OTLP trace receivers for tests, on loopback: ``OTLPReceiver``, an aiohttp app that decodes
what exporters POST to ``/v1/traces`` (``ExportTraceServiceRequest``, protobuf, optionally gzip),
over TLS when given a server ``SSLContext``; and ``GrpcOTLPReceiver``, the OTLP/gRPC trace service
(``opentelemetry-proto``'s ``TraceService``, on ``grpcio``). Both keep every span as a plain
``Span`` and the headers (gRPC: metadata) of every export.
"""

from __future__ import annotations

import asyncio
import gzip
import ssl
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which else None


@dataclass
class Span:
    name: str
    trace_id: str                 # 32 hex digits
    span_id: str                  # 16 hex digits
    parent_id: str                # "" for a root
    kind: str
    service: str
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any], int]]     # (name, attributes, time ns)
    status: str
    start_ns: int
    end_ns: int
    instance: str = ""            # the resource's service.instance.id

    def event(self, name: str) -> dict[str, Any] | None:
        return next((attrs for n, attrs, _ in self.events if n == name), None)

    def is_parent_of(self, traceparent: str) -> bool:
        """Whether ``traceparent`` names this span as the (sampled) parent."""
        version, trace_id, parent_id, flags = traceparent.split("-")
        return (version, trace_id, parent_id) == ("00", self.trace_id, self.span_id) and int(flags, 16) & 1 == 1


def decode(req: ExportTraceServiceRequest) -> list[Span]:
    spans = []
    for rs in req.resource_spans:
        res = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(Span(
                    name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                    parent_id=s.parent_span_id.hex(), kind=KINDS.get(s.kind, str(s.kind)),
                    service=str(res.get("service.name", "")),
                    attributes={kv.key: _value(kv.value) for kv in s.attributes},
                    events=[(e.name, {kv.key: _value(kv.value) for kv in e.attributes}, e.time_unix_nano)
                            for e in s.events],
                    status=STATUS.get(s.status.code, str(s.status.code)),
                    start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                    instance=str(res.get("service.instance.id", ""))))
    return spans


@dataclass
class OTLPReceiver:
    """Start with ``await start()``; ``url`` is the traces endpoint (https:// with ``ssl``, a server
    context). ``fail_with`` set to a status makes every export fail with it (the spans are not
    kept). ``headers``: each export's request headers, names lower-cased."""

    spans: list[Span] = field(default_factory=list)
    exports: int = 0
    fail_with: int | None = None
    url: str = ""
    ssl: ssl.SSLContext | None = None
    headers: list[dict[str, str]] = field(default_factory=list)
    _runner: web.AppRunner | None = None

    async def start(self) -> OTLPReceiver:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", self._export)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self.ssl)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"{'https' if self.ssl else 'http'}://127.0.0.1:{port}/v1/traces"
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _export(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        # aiohttp undoes a gzip Content-Encoding itself (the header stays, as sent)
        if request.headers.get("Content-Encoding") == "gzip" and raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        self.exports += 1
        if self.fail_with is not None:
            return web.Response(status=self.fail_with)
        self.spans.extend(decode(ExportTraceServiceRequest.FromString(raw)))
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    # -- queries -------------------------------------------------------------------------------

    def trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.spans if s.trace_id == trace_id]

    def named(self, name: str, service: str | None = None) -> list[Span]:
        return [s for s in self.spans if s.name == name and (service is None or s.service == service)]

    def children(self, parent: Span) -> list[Span]:
        return sorted((s for s in self.spans if s.parent_id == parent.span_id and s.trace_id == parent.trace_id),
                      key=lambda s: s.start_ns)

    async def wait_for(self, predicate, timeout: float = 10.0) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate(self):
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True


class GrpcOTLPReceiver(OTLPReceiver):
    """The OTLP/gRPC trace service on loopback (needs ``grpcio``). ``url`` is the exporter's
    endpoint: ``http://127.0.0.1:PORT``, or ``https://...`` with ``tls`` (a server key and
    certificate, PEM bytes); ``client_ca`` (PEM bytes): clients must present a certificate that CA
    signed. ``headers``: each export's metadata."""

    def __init__(self, tls: tuple[bytes, bytes] | None = None, client_ca: bytes | None = None) -> None:
        super().__init__()
        self.tls = tls
        self.client_ca = client_ca
        self._server: Any = None

    async def start(self) -> GrpcOTLPReceiver:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            async def Export(self, request: ExportTraceServiceRequest, context: Any) -> ExportTraceServiceResponse:
                receiver.headers.append({k.lower(): v for k, v in context.invocation_metadata()})
                receiver.exports += 1
                receiver.spans.extend(decode(request))
                return ExportTraceServiceResponse()

        self._server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._server)
        if self.tls:
            creds = grpc.ssl_server_credentials([self.tls], root_certificates=self.client_ca,
                                                require_client_auth=self.client_ca is not None)
            port = self._server.add_secure_port("127.0.0.1:0", creds)
        else:
            port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{port}"
        return self

    async def close(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
