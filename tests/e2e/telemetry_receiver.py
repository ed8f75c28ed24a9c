"""A collector on loopback for the telemetry tests: OTLP/HTTP traces and Langfuse's public API.

The real receivers (an OpenTelemetry collector, a Langfuse server with its Postgres, ClickHouse,
Redis and MinIO) cannot run here. This fake follows their documented protocols and records what
arrives:

- OTLP/HTTP (https://opentelemetry.io/docs/specs/otlp/#otlphttp): `POST /v1/traces` with an
  `ExportTraceServiceRequest`, binary protobuf (`application/x-protobuf`) or its JSON mapping
  (`application/json`: ids as hex strings, enums as numbers), optionally gzip-encoded;
  answered 200 with an empty `ExportTraceServiceResponse` in the request's encoding. Decoded
  with the protocol's own messages (`opentelemetry-proto`).
- Langfuse (https://langfuse.com/integrations/native/opentelemetry,
  https://api.reference.langfuse.com): the same OTLP request at `POST /api/public/otel/v1/traces`
  and `POST /api/public/scores` with a JSON list of scores (what the langfuse 5 SDK sends; each
  one is checked against the SDK's own `CreateScoreRequest` model), both with HTTP Basic auth
  public key : secret key (401 otherwise); scores are answered 202 `{"message": "Accepted"}`.

    with TelemetryReceiver(public_key="pk", secret_key="sk") as rx:
        ... rx.url, rx.spans("otlp"), rx.scores, rx.wait_for(lambda: ..., timeout_s=60)
"""

from __future__ import annotations

import base64
import gzip
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

T = TypeVar("T")


@dataclass
class ReceivedSpan:
    destination: str
    """"otlp" (/v1/traces) or "langfuse" (/api/public/otel/v1/traces)."""
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int
    start_ns: int
    end_ns: int
    status_code: int
    attributes: dict[str, Any]
    resource: dict[str, Any]


@dataclass
class _Record:
    spans: list[ReceivedSpan] = field(default_factory=list)
    scores: list[dict[str, Any]] = field(default_factory=list)
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    """(path, content type, headers) of every request."""
    unauthorized: int = 0


class TelemetryReceiver:
    def __init__(self, *, public_key: str = "pk-lf-test", secret_key: str = "sk-lf-test") -> None:
        self.public_key, self.secret_key = public_key, secret_key
        self._record = _Record()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> TelemetryReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    # --- what arrived ---------------------------------------------------------------------

    def spans(self, destination: str | None = None) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self._record.spans if destination in (None, s.destination)]

    @property
    def scores(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._record.scores)

    @property
    def requests(self) -> list[tuple[str, str, dict[str, str]]]:
        with self._lock:
            return list(self._record.requests)

    @property
    def unauthorized(self) -> int:
        with self._lock:
            return self._record.unauthorized

    def wait_for(self, found: Callable[[], T | None], *, timeout_s: float = 60.0) -> T:
        """Poll `found` until it returns something truthy; fail with a message at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = found()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"nothing matching arrived within {timeout_s:g} s; received "
                    f"{len(self.spans())} spans and {len(self.scores)} scores"
                )
            time.sleep(0.1)

    # --- the server -----------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                ctype = (self.headers.get("content-type") or "").split(";")[0].strip()
                with receiver._lock:
                    receiver._record.requests.append((self.path, ctype, dict(self.headers)))
                if self.path == "/v1/traces":
                    self._traces("otlp", body, ctype)
                elif not receiver._authorized(self.headers.get("authorization")):
                    with receiver._lock:
                        receiver._record.unauthorized += 1
                    self._reply(401, "application/json", b'{"message": "Unauthorized"}')
                elif self.path == "/api/public/otel/v1/traces":
                    self._traces("langfuse", body, ctype)
                elif self.path == "/api/public/scores":
                    scores = _checked_scores(json.loads(body))
                    with receiver._lock:
                        receiver._record.scores += scores
                    self._reply(202, "application/json", b'{"message": "Accepted"}')
                else:
                    self._reply(404, "application/json", b'{"message": "Not found"}')

            def _traces(self, destination: str, body: bytes, ctype: str) -> None:
                if ctype == "application/json":
                    spans = _json_spans(destination, json.loads(body))
                    reply = b"{}"
                else:
                    request = ExportTraceServiceRequest()
                    request.ParseFromString(body)
                    spans = _proto_spans(destination, request)
                    reply = b""  # an empty ExportTraceServiceResponse
                with receiver._lock:
                    receiver._record.spans += spans
                self._reply(200, ctype or "application/x-protobuf", reply)

            def _reply(self, status: int, ctype: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler

    def _authorized(self, header: str | None) -> bool:
        token = base64.b64encode(f"{self.public_key}:{self.secret_key}".encode()).decode()
        return header == f"Basic {token}"


def _checked_scores(body: Any) -> list[dict[str, Any]]:
    """Each score as the Langfuse SDK's own API model accepts it (raises on a bad one)."""
    from langfuse.api.scores.types.create_score_request import CreateScoreRequest

    assert isinstance(body, list), f"POST /api/public/scores takes a JSON list, got {body!r}"
    for item in body:
        CreateScoreRequest.model_validate(item)
    return body


def _proto_spans(destination: str, request: ExportTraceServiceRequest) -> list[ReceivedSpan]:
    out = []
    for rs in request.resource_spans:
        resource = {a.key: _proto_value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    ReceivedSpan(
                        destination=destination,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        name=s.name,
                        kind=s.kind,
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        status_code=s.status.code,
                        attributes={a.key: _proto_value(a.value) for a in s.attributes},
                        resource=resource,
                    )
                )
    return out


def _proto_value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_proto_value(x) for x in v.array_value.values)
    if kind == "kvlist_value":
        return {kv.key: _proto_value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _json_spans(destination: str, body: dict[str, Any]) -> list[ReceivedSpan]:
    """OTLP/JSON: camelCase fields, hex ids, 64-bit integers as strings."""
    out = []
    for rs in body.get("resourceSpans", []):
        resource = _json_attributes(rs.get("resource", {}).get("attributes", []))
        for ss in rs.get("scopeSpans", []):
            for s in ss.get("spans", []):
                out.append(
                    ReceivedSpan(
                        destination=destination,
                        trace_id=s["traceId"].lower(),
                        span_id=s["spanId"].lower(),
                        parent_span_id=s.get("parentSpanId", "").lower(),
                        name=s["name"],
                        kind=int(s.get("kind", 0)),
                        start_ns=int(s["startTimeUnixNano"]),
                        end_ns=int(s["endTimeUnixNano"]),
                        status_code=int(s.get("status", {}).get("code", 0)),
                        attributes=_json_attributes(s.get("attributes", [])),
                        resource=resource,
                    )
                )
    return out


def _json_attributes(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {a["key"]: _json_value(a.get("value", {})) for a in items}


def _json_value(v: dict[str, Any]) -> Any:
    if "stringValue" in v:
        return v["stringValue"]
    if "boolValue" in v:
        return bool(v["boolValue"])
    if "intValue" in v:
        return int(v["intValue"])
    if "doubleValue" in v:
        return float(v["doubleValue"])
    if "arrayValue" in v:
        return tuple(_json_value(x) for x in v["arrayValue"].get("values", []))
    if "kvlistValue" in v:
        return _json_attributes(v["kvlistValue"].get("values", []))
    return None
