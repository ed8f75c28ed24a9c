"""Chat calls as OpenTelemetry spans, exported over OTLP/HTTP in the background.

    tracing = Tracing([Destination("otlp", OTLPSpanExporter())], count=metrics.count_spans)
    tracing.emit(name, attrs, start_s=..., end_s=..., trace_key=trajectory_id, span_key=call_id)
    tracing.close()

Built only when a destination is configured (`proxy.telemetry.telemetry.open_telemetry`): with
none, no tracer provider exists and no OpenTelemetry SDK module is imported.

One trace per trajectory: a span's trace id is the trajectory's and its span id the call's
(`proxy.telemetry.ids`), so every call of a trajectory lands in one trace, and a score can name
the call it is about. Spans are made after the call is committed, with the record's own start
and end times, and ended at once; they are never the serving path's business.

Each destination has its own `BatchSpanProcessor` with a bounded queue (`OTEL_BSP_MAX_QUEUE_SIZE`,
default 2048): a span that finds it full is dropped and counted ("dropped_queue_full"), a batch
the collector refuses or never answers is counted ("export_failed"), so a slow or dead collector
costs spans, never a response. The provider is this object's own, never OpenTelemetry's global
one: several apps (and tests) live side by side in one process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import SpanKind, Status, StatusCode

from proxy.telemetry.ids import span_id_of, trace_id_of

logger = logging.getLogger(__name__)

SpanCounter = Callable[[str, str, int], None]
"""`count(destination, outcome, n)`: outcome is "exported", "dropped_queue_full" or
"export_failed"."""

TRACER_NAME = "rlproxy"


@dataclass(frozen=True)
class Destination:
    name: str
    """"otlp" or "langfuse": the label of its span counts."""
    exporter: SpanExporter


class Tracing:
    def __init__(
        self,
        destinations: Sequence[Destination],
        *,
        count: SpanCounter,
        service_name: str = "rlproxy",
    ) -> None:
        self._ids = _ChosenIds()
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": service_name}), id_generator=self._ids
        )
        queue = _env_int("OTEL_BSP_MAX_QUEUE_SIZE", 2048)
        batch = min(_env_int("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512), queue)
        for d in destinations:
            self.provider.add_span_processor(
                BoundedSpanProcessor(d.name, d.exporter, count, max_queue_size=queue, batch=batch)
            )
        self._tracer = self.provider.get_tracer(TRACER_NAME)
        self.destinations = [d.name for d in destinations]

    def emit(
        self,
        name: str,
        attributes: dict[str, Any],
        *,
        start_s: float,
        end_s: float,
        trace_key: str,
        span_key: str,
        client: bool = False,
        error: bool = False,
    ) -> None:
        """One finished span, timed by the caller (epoch seconds). Never blocks: it is queued.

        `client`: the model ran elsewhere (an upstream provider), so the span is a CLIENT span;
        the embedded model's calls are INTERNAL, as the conventions ask for in-process models."""
        kind = SpanKind.CLIENT if client else SpanKind.INTERNAL
        with self._ids.chosen(trace_id_of(trace_key), span_id_of(span_key)):
            span = self._tracer.start_span(
                name, kind=kind, attributes=attributes, start_time=int(start_s * 1e9)
            )
        if error:
            span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=int(end_s * 1e9))

    def flush(self, timeout_s: float = 5.0) -> bool:
        return self.provider.force_flush(int(timeout_s * 1000))

    def close(self) -> None:
        """Export what is queued (each exporter gives up at its own timeout), then stop."""
        self.provider.shutdown()


class _ChosenIds(IdGenerator):
    """The ids of the span being started, when `emit` chose them; random ids otherwise."""

    def __init__(self) -> None:
        self._random = RandomIdGenerator()
        self._chosen: ContextVar[tuple[int, int] | None] = ContextVar("chosen_ids", default=None)

    @contextlib.contextmanager
    def chosen(self, trace_id: int, span_id: int) -> Iterator[None]:
        token = self._chosen.set((trace_id, span_id))
        try:
            yield
        finally:
            self._chosen.reset(token)

    def generate_trace_id(self) -> int:
        chosen = self._chosen.get()
        return chosen[0] if chosen else self._random.generate_trace_id()

    def generate_span_id(self) -> int:
        chosen = self._chosen.get()
        return chosen[1] if chosen else self._random.generate_span_id()


class BoundedSpanProcessor(BatchSpanProcessor):
    """A `BatchSpanProcessor` that counts what it loses.

    `pending` is every span accepted and not yet handed to the exporter. A span that would make
    it exceed `max_queue_size` is dropped here and counted, so the queue below never overflows
    (it would drop silently). The exporter is wrapped to count exported and failed spans.
    """

    def __init__(
        self,
        destination: str,
        exporter: SpanExporter,
        count: SpanCounter,
        *,
        max_queue_size: int,
        batch: int,
    ) -> None:
        self.destination = destination
        self._count = count
        self._max = max_queue_size
        self._pending = 0
        self._lock = threading.Lock()
        super().__init__(
            _CountingExporter(exporter, self),
            max_queue_size=max_queue_size,
            max_export_batch_size=batch,
        )

    def on_end(self, span: ReadableSpan) -> None:
        with self._lock:
            full = self._pending >= self._max
            if not full:
                self._pending += 1
        if full:
            self._count(self.destination, "dropped_queue_full", 1)
            return
        super().on_end(span)

    def _taken(self, n: int) -> None:
        with self._lock:
            self._pending -= n


class _CountingExporter(SpanExporter):
    def __init__(self, inner: SpanExporter, processor: BoundedSpanProcessor) -> None:
        self.inner = inner
        self.processor = processor

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.processor._taken(len(spans))
        name = self.processor.destination
        try:
            result = self.inner.export(spans)
        except Exception:
            logger.exception("exporting %d spans to %s failed", len(spans), name)
            result = SpanExportResult.FAILURE
        if result == SpanExportResult.SUCCESS:
            self.processor._count(name, "exported", len(spans))
        else:
            self.processor._count(name, "export_failed", len(spans))
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    try:
        value = int(raw) if raw else default
    except ValueError:
        logger.warning("%s=%r is not an integer; using %d", name, raw, default)
        return default
    return value if value > 0 else default
