"""The one telemetry object serving wires in: calls, rewards and scored groups go in, metrics,
spans and Langfuse scores come out.

    async with open_telemetry(settings, metrics, os.environ) as telemetry:
        chat = ChatService(..., record=telemetry.recorder(store.record_call))
        scorer.on_scored = telemetry.group_scored
        telemetry.reward_added(trajectory_id, reward_id, 0.8, "env", None)

The hook is the record sink: a call is recorded once (`proxy.chat.record.call_record`, then
`Store.record_call`, which answers with its trajectory id), and once that commit is done the
call is counted and, with a destination configured, becomes a span timed by the record itself.
What runs here per call is a few counter updates and, with tracing, building one span and
queueing it; exporting happens on the exporters' threads. A failure here is logged and counted
(`rlproxy_telemetry_errors_total`) and never reaches the call.

Where things go is read from the standard variables: `OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (and the other `OTEL_EXPORTER_OTLP_*`, `OTEL_BSP_*`) for
an OpenTelemetry collector, `LANGFUSE_PUBLIC_KEY`/`LANGFUSE_SECRET_KEY`/`LANGFUSE_HOST` for
Langfuse. With neither, no tracer is built.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from proxy.adapters.registry import version_id
from proxy.settings import Settings
from proxy.telemetry.genai import LOCAL_PROVIDER, call_attributes, span_name
from proxy.telemetry.ids import span_hex, trace_hex
from proxy.telemetry.langfuse import LangfuseConfig, LangfuseScores, score
from proxy.telemetry.metrics import Metrics
from storage.records import CallRecord, GroupDetail, JudgeOutcome

if TYPE_CHECKING:
    from proxy.telemetry.tracing import Tracing

logger = logging.getLogger(__name__)

Sink = Callable[[CallRecord], Awaitable[str]]
"""`Store.record_call`: stores a call, answers its trajectory id once committed."""

CAPTURE_VARIABLE = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"


class Telemetry:
    def __init__(
        self,
        metrics: Metrics,
        *,
        policy: str,
        upstream_targets: Mapping[str, str] | None = None,
        tracing: Tracing | None = None,
        scores: LangfuseScores | None = None,
        capture: bool = False,
    ) -> None:
        self.metrics = metrics
        self.policy = policy
        self.upstream_targets = dict(upstream_targets or {})
        """Upstream served name -> litellm target (`openai/gpt-4o-mini`)."""
        self.tracing = tracing
        self.scores = scores
        self.capture = capture

    def recorder(self, sink: Sink) -> Sink:
        """`sink`, then this call's telemetry once the call is committed."""

        async def record(record: CallRecord) -> str:
            trajectory_id = await sink(record)
            self.call_recorded(record, trajectory_id)
            return trajectory_id

        return record

    def call_recorded(self, record: CallRecord, trajectory_id: str) -> None:
        try:
            self.metrics.observe_call(record)
            if self.tracing is not None:
                self._span(record, trajectory_id)
        except Exception:
            self._failed("call")

    def reward_added(
        self,
        trajectory_id: str,
        reward_id: int,
        reward: float,
        source: str,
        explanation: str | None,
    ) -> None:
        """An explicit reward was committed: counted, and a Langfuse score on its trace."""
        try:
            self.metrics.rewards.inc()
            if self.scores is not None:
                self.scores.add(
                    score(
                        name="reward",
                        value=reward,
                        trace_id=trace_hex(trajectory_id),
                        key=f"reward:{trajectory_id}:{reward_id}",
                        comment=explanation,
                        metadata={"source": source, "trajectory_id": trajectory_id},
                    )
                )
        except Exception:
            self._failed("reward")

    def group_scored(self, group: GroupDetail, outcome: JudgeOutcome) -> None:
        """A group's judging was committed (the scorer's listener): judge metrics, and each
        RULER score with its explanation as a Langfuse score on its member's trace (on the
        call's own observation for a member that is one answer at a turn). Shadow samples the
        client never saw have no trace to go on and are not sent."""
        try:
            self.metrics.observe_judge(outcome)
            if self.scores is None or outcome.status != "scored":
                return  # a failed run leaves the scores of an earlier run, already sent
            for m in group.members:
                if m.ruler is None or not m.returned:
                    continue
                self.scores.add(
                    score(
                        name="ruler",
                        value=m.ruler.score,
                        trace_id=trace_hex(m.trajectory_id),
                        observation_id=span_hex(m.call_id) if m.call_id else None,
                        key=f"ruler:{group.id}:{m.member_id}:{m.ruler.created_at}",
                        comment=m.ruler.explanation,
                        metadata={
                            "group_id": group.id,
                            "judge_model": m.ruler.judge_model,
                            "rubric_hash": m.ruler.rubric_hash,
                            "trajectory_id": m.trajectory_id,
                        },
                        at=m.ruler.created_at or None,
                    )
                )
        except Exception:
            self._failed("group")

    def _span(self, record: CallRecord, trajectory_id: str) -> None:
        assert self.tracing is not None
        target = self.upstream_targets.get(record.model_requested)
        if record.engine == "upstream" and target is not None:
            provider, _, model = target.partition("/")
            provider, response_model = (provider, model) if model else ("litellm", target)
        else:
            provider = LOCAL_PROVIDER
            response_model = version_id(self.policy, record.adapter_version)
        attrs = call_attributes(
            record,
            trajectory_id,
            provider=provider,
            response_model=response_model,
            capture=self.capture,
            langfuse="langfuse" in self.tracing.destinations,
        )
        self.tracing.emit(
            span_name(record),
            attrs,
            start_s=record.created_at,
            end_s=record.finished_at,
            trace_key=trajectory_id,
            span_key=record.id,
            client=record.engine == "upstream",
            error=record.status == "error",
        )

    def _failed(self, where: str) -> None:
        logger.exception("telemetry failed on a %s (the %s itself is unaffected)", where, where)
        self.metrics.telemetry_errors.labels(where).inc()


def capture_content(settings: Settings, environ: Mapping[str, str]) -> bool:
    """RLPROXY_TELEMETRY_CAPTURE_CONTENT, or OpenTelemetry's own switch for GenAI content."""
    value = environ.get(CAPTURE_VARIABLE, "").strip().lower()
    return settings.telemetry.capture_content or value in (
        "true",
        "1",
        "span_only",
        "span_and_event",
    )


def otlp_configured(environ: Mapping[str, str]) -> bool:
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


@asynccontextmanager
async def open_telemetry(
    settings: Settings, metrics: Metrics, environ: Mapping[str, str]
) -> AsyncIterator[Telemetry]:
    """Telemetry for a serving runtime; exporters flushed and stopped on exit."""
    langfuse = LangfuseConfig.from_env(environ)
    tracing: Tracing | None = None
    if otlp_configured(environ) or langfuse is not None:
        tracing = _tracing(settings, metrics, environ, langfuse)
    scores = None
    if langfuse is not None:
        scores = LangfuseScores(langfuse, count=metrics.count_scores)
        scores.start()
        logger.info("Langfuse: traces and scores go to %s", langfuse.host)
    telemetry = Telemetry(
        metrics,
        policy=settings.model_name,
        upstream_targets={name: t.model for name, t in settings.upstream_models.items()},
        tracing=tracing,
        scores=scores,
        capture=capture_content(settings, environ),
    )
    try:
        yield telemetry
    finally:
        if scores is not None:
            await scores.close()
        if tracing is not None:
            tracing.close()


def _tracing(
    settings: Settings,
    metrics: Metrics,
    environ: Mapping[str, str],
    langfuse: LangfuseConfig | None,
) -> Tracing:
    from proxy.telemetry.tracing import Destination, Tracing

    destinations = []
    if otlp_configured(environ):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        # Endpoint, headers, timeout, compression: the OTEL_EXPORTER_OTLP_* variables.
        destinations.append(Destination("otlp", OTLPSpanExporter()))
        logger.info(
            "OpenTelemetry: chat spans go to %s",
            environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
        )
    if langfuse is not None:
        destinations.append(Destination("langfuse", langfuse.span_exporter()))
    return Tracing(
        destinations,
        count=metrics.count_spans,
        service_name=environ.get("OTEL_SERVICE_NAME") or "rlproxy",
    )
