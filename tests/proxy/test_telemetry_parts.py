"""Telemetry without a server: a call's GenAI attributes, its span as a collector receives it,
the export queue's losses, /metrics' figures on a real SQLite store, and the test receiver
checked against the real Langfuse SDK (so the end-to-end tests' fake speaks Langfuse's protocol).

The end-to-end tests (`tests/e2e/test_telemetry.py`) run the same paths through a real server.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from prometheus_client.parser import text_string_to_metric_families

from proxy.engines.base import EngineHealth
from proxy.telemetry.genai import call_attributes, input_messages
from proxy.telemetry.ids import span_hex, trace_hex, trace_id_of
from proxy.telemetry.metrics import Metrics, Sources
from proxy.telemetry.telemetry import Telemetry
from proxy.telemetry.tracing import BoundedSpanProcessor, Destination, Tracing
from storage import CallRecord, ChoiceRecord, Store
from storage.records import AdapterRecord
from tests.e2e.telemetry_receiver import TelemetryReceiver


def _record(**kw: Any) -> CallRecord:
    now = time.time()
    base: dict[str, Any] = dict(
        id=uuid.uuid4().hex,
        created_at=now - 0.5,
        finished_at=now,
        model_requested="gpt-4o-mini",
        engine="local",
        request_messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi!"},
        ],
        completion_id="chatcmpl-abc",
        params={"temperature": 0.7, "max_tokens": 16, "stop": "\n", "n": 1},
        choices=[
            ChoiceRecord(
                0, {"role": "assistant", "content": "Hello."}, "stop", [1, 2], [-0.1, -0.2]
            )
        ],
        prompt_token_ids=[5, 6, 7],
        latency_s=0.5,
        adapter_version=3,
        time_to_first_token_s=0.125,
    )
    base.update(kw)
    return CallRecord(**base)


# --------------------------------------------------------------------------- attributes


def test_a_call_has_the_genai_attributes_and_no_text_by_default() -> None:
    attrs = call_attributes(
        _record(), "t" * 32, provider="rlproxy", response_model="rlproxy@3", capture=False
    )
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.provider.name"] == "rlproxy"
    assert attrs["gen_ai.request.model"] == "gpt-4o-mini"
    assert attrs["gen_ai.response.model"] == "rlproxy@3"
    assert attrs["gen_ai.response.id"] == "chatcmpl-abc"
    assert attrs["gen_ai.response.finish_reasons"] == ("stop",)
    assert attrs["gen_ai.usage.input_tokens"] == 3 and attrs["gen_ai.usage.output_tokens"] == 2
    assert attrs["gen_ai.conversation.id"] == "t" * 32
    assert attrs["gen_ai.request.temperature"] == 0.7
    assert attrs["gen_ai.request.max_tokens"] == 16
    assert attrs["gen_ai.request.stop_sequences"] == ("\n",)
    assert "gen_ai.request.choice.count" not in attrs  # n == 1 is the default
    assert attrs["rlproxy.adapter_version"] == 3 and attrs["rlproxy.engine"] == "local"
    assert attrs["rlproxy.time_to_first_token_s"] == 0.125
    assert not [k for k in attrs if "messages" in k or k.startswith("langfuse.")]


def test_capture_puts_messages_in_the_conventions_parts_format() -> None:
    tool_turn = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ]
    assert input_messages(tool_turn) == [
        {"role": "user", "parts": [{"type": "text", "content": "Weather?"}]},
        {
            "role": "assistant",
            "parts": [
                {
                    "type": "tool_call",
                    "id": "call_1",
                    "name": "weather",
                    "arguments": {"city": "Oslo"},
                }
            ],
        },
        {
            "role": "tool",
            "parts": [{"type": "tool_call_response", "id": "call_1", "response": "rain"}],
        },
    ]
    attrs = call_attributes(
        _record(), "t1", provider="rlproxy", response_model="x", capture=True, langfuse=True
    )
    assert json.loads(str(attrs["gen_ai.output.messages"])) == [
        {
            "role": "assistant",
            "parts": [{"type": "text", "content": "Hello."}],
            "finish_reason": "stop",
        }
    ]
    assert json.loads(str(attrs["langfuse.observation.input"]))[1]["content"] == "Hi!"
    assert attrs["session.id"] == "t1" and attrs["langfuse.observation.type"] == "generation"


def test_trace_ids_come_from_trajectory_ids() -> None:
    tid = uuid.uuid4().hex
    assert trace_hex(tid) == tid  # rlproxy's own ids are already 128-bit hex
    assert trace_id_of("my-episode-7") == trace_id_of("my-episode-7") != trace_id_of("other")
    assert len(trace_hex("my-episode-7")) == 32
    call = uuid.uuid4().hex
    assert span_hex(call) == call[:16]


# --------------------------------------------------------------------------- spans out


@pytest.fixture
def receiver() -> Iterator[TelemetryReceiver]:
    with TelemetryReceiver() as rx:
        yield rx


def test_recorded_calls_reach_the_collector_one_trace_per_trajectory(
    receiver: TelemetryReceiver,
) -> None:
    metrics = Metrics()
    exporter = OTLPSpanExporter(endpoint=f"{receiver.url}/v1/traces")
    tracing = Tracing([Destination("otlp", exporter)], count=metrics.count_spans)
    telemetry = Telemetry(
        metrics,
        policy="rlproxy",
        upstream_targets={"teacher": "anthropic/claude-x"},
        tracing=tracing,
    )
    tid, rec = uuid.uuid4().hex, _record()
    telemetry.call_recorded(rec, tid)
    telemetry.call_recorded(_record(), tid)  # the same trajectory: the same trace
    upstream = _record(engine="upstream", model_requested="teacher", status="error", choices=[])
    telemetry.call_recorded(upstream, "episode-7")  # an id the client chose
    assert tracing.flush()
    spans = receiver.wait_for(
        lambda: receiver.spans("otlp") if len(receiver.spans()) == 3 else None
    )
    by_id = {s.span_id: s for s in spans}
    first, other = by_id[span_hex(rec.id)], by_id[span_hex(upstream.id)]
    assert first.name == "chat gpt-4o-mini" and first.parent_span_id == ""
    assert [s.trace_id for s in spans].count(tid) == 2
    assert first.start_ns == int(rec.created_at * 1e9)
    assert first.end_ns == int(rec.finished_at * 1e9)
    assert first.attributes["gen_ai.response.model"] == "rlproxy@3"
    assert first.kind == 1 and first.resource["service.name"] == "rlproxy"  # INTERNAL
    # An upstream call: the provider's name and model, a CLIENT span, an error status.
    assert other.trace_id == trace_hex("episode-7") != tid
    assert other.attributes["gen_ai.provider.name"] == "anthropic"
    assert other.attributes["gen_ai.response.model"] == "claude-x"
    assert other.attributes["error.type"] == "error"
    assert other.kind == 3 and other.status_code == 2  # CLIENT, ERROR
    tracing.close()
    exported = _value(
        metrics, "rlproxy_telemetry_spans_total", destination="otlp", outcome="exported"
    )
    assert exported == 3


@dataclass
class _BlockingExporter(SpanExporter):
    """A collector that hangs until released (a slow one)."""

    release: threading.Event = field(default_factory=threading.Event)
    exported: int = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.release.wait(30)
        self.exported += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.release.set()


def test_a_full_export_queue_drops_spans_and_counts_them() -> None:
    metrics, slow = Metrics(), _BlockingExporter()
    tracing = Tracing([], count=metrics.count_spans)
    tracing.provider.add_span_processor(
        BoundedSpanProcessor("otlp", slow, metrics.count_spans, max_queue_size=2, batch=2)
    )
    started = time.perf_counter()
    for _ in range(10):
        tracing.emit("chat x", {}, start_s=1.0, end_s=2.0, trace_key="t", span_key=uuid.uuid4().hex)
    assert time.perf_counter() - started < 1.0  # emitting never waits on the collector
    slow.release.set()
    tracing.flush()
    dropped = _value(
        metrics, "rlproxy_telemetry_spans_total", destination="otlp", outcome="dropped_queue_full"
    )
    assert dropped >= 6  # at most 2 queued + 2 in the blocked export
    assert dropped + slow.exported == 10
    tracing.close()


def test_a_dead_collector_counts_failed_exports() -> None:
    metrics = Metrics()
    exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{_closed_port()}/v1/traces", timeout=1)
    tracing = Tracing([Destination("otlp", exporter)], count=metrics.count_spans)
    tracing.emit("chat x", {}, start_s=1.0, end_s=2.0, trace_key="t", span_key=uuid.uuid4().hex)
    tracing.flush(timeout_s=10)
    tracing.close()
    assert (
        _value(
            metrics, "rlproxy_telemetry_spans_total", destination="otlp", outcome="export_failed"
        )
        == 1
    )


# --------------------------------------------------------------------------- /metrics


def test_each_metrics_object_has_its_own_registry() -> None:
    a, b = Metrics(), Metrics()  # two apps in one process: no duplicate-timeseries error
    a.observe_call(_record(status="error"))
    assert (
        _value(a, "rlproxy_chat_calls_total", model="gpt-4o-mini", engine="local", status="error")
        == 1
    )
    assert (
        _value(b, "rlproxy_chat_calls_total", model="gpt-4o-mini", engine="local", status="error")
        == 0
    )


def test_client_model_names_are_bounded_label_values() -> None:
    m = Metrics()
    labels = {m.model_label(f"junk-{i}") for i in range(200)}
    assert "other" in labels and len(labels) == 65


@dataclass
class _Engine:
    detail: dict[str, Any]

    def health(self) -> EngineHealth:
        return EngineHealth(ok=True, detail=self.detail)


@dataclass
class _Registry:
    policy: str = "rlproxy"
    active: int | None = 2

    def loaded_versions(self) -> list[int]:
        return [1, 2]


@dataclass
class _Adapters:
    swaps: int = 2


async def test_state_figures_read_the_store_and_the_trainers_newest_step(tmp_path: Path) -> None:
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")
    try:
        metrics = Metrics()
        store.observe_commits(metrics.observe_commit)
        closed = await store.record_call(
            _record(request_messages=[{"role": "user", "content": "a"}])
        )
        await store.record_call(_record(request_messages=[{"role": "user", "content": "b"}]))
        await store.end_trajectory(closed)
        for version, loss in ((1, 0.5), (2, 0.25)):
            await store.record_adapter(
                AdapterRecord(
                    "rlproxy",
                    version,
                    "p",
                    "written",
                    time.time(),
                    time.time(),
                    metrics={
                        "loss": loss,
                        "mean_reward": 0.4,
                        "tokens_per_s": 180.0,
                        "step_seconds": 9.5,
                        "staleness_max": 2,
                        "groups_trained_total": 4 * version,
                        "stale_dropped_total": 2 * version,
                        "stale_downweighted_total": 0,
                        "too_long": 1,
                        "too_long_total": 3 * version,
                        "stale_samples_dropped_total": 5 * version,
                    },
                )
            )
        engine = _Engine(
            {
                "running_rows": 3,
                "queued_rows": 1,
                "waiting_requests": 1,
                "steps": 7,
                "tokens": 40,
                "prefill_rows_shared": 5,
            }
        )
        sources: Any = Sources(store, engine, _Registry(), _Adapters())  # type: ignore[arg-type]
        metrics.watch(sources, cache_s=60)
        await metrics.render()
        assert _value(metrics, "rlproxy_trajectories", status="open") == 1
        assert _value(metrics, "rlproxy_trajectories", status="closed") == 1  # every status
        assert _value(metrics, "rlproxy_groups", status="ready") == 0
        assert _value(metrics, "rlproxy_trainer_version") == 2
        assert _value(metrics, "rlproxy_trainer_loss") == 0.25
        assert _value(metrics, "rlproxy_trainer_tokens_per_second") == 180.0
        assert _value(metrics, "rlproxy_trainer_staleness_max") == 2
        assert _value(metrics, "rlproxy_trainer_groups_trained_total") == 8
        assert _value(metrics, "rlproxy_trainer_stale_groups_total", action="dropped") == 4
        assert _value(metrics, "rlproxy_trainer_stale_groups_total", action="downweighted") == 0
        assert _value(metrics, "rlproxy_trainer_stale_dropped_share") == pytest.approx(4 / 12)
        assert _value(metrics, "rlproxy_trainer_turns_too_long") == 1
        assert _value(metrics, "rlproxy_trainer_turns_too_long_total") == 6
        assert _value(metrics, "rlproxy_trainer_stale_samples_dropped_total") == 10
        assert _value(metrics, "rlproxy_adapter_active_version") == 2
        assert _value(metrics, "rlproxy_adapter_swaps_total") == 2
        assert _value(metrics, "rlproxy_engine_running_rows") == 3
        assert _value(metrics, "rlproxy_engine_tokens_total") == 40
        assert _value(metrics, "rlproxy_engine_prefill_rows_shared_total") == 5
        assert _value(metrics, "rlproxy_store_writable") == 1
        assert _value(metrics, "rlproxy_store_commit_batch_size_count") >= 5
        # Cached: a new open trajectory shows only after `cache_s`.
        await store.record_call(_record(request_messages=[{"role": "user", "content": "c"}]))
        await metrics.render()
        assert _value(metrics, "rlproxy_trajectories", status="open") == 1
    finally:
        await store.close()


async def test_http_requests_are_labelled_by_route_template_even_when_refused() -> None:
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from proxy.api.http_metrics import HttpMetricsMiddleware

    class RefuseSecrets:  # answers before routing, as the auth middleware does
        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and scope["path"].endswith("/secret"):
                await JSONResponse({}, status_code=401)(scope, receive, send)
            else:
                await self.app(scope, receive, send)

    metrics, app = Metrics(), FastAPI()

    @app.get("/rl/trajectories/{trajectory_id}")
    async def one(trajectory_id: str) -> dict[str, str]:
        return {"id": trajectory_id}

    app.add_middleware(RefuseSecrets)
    app.add_middleware(HttpMetricsMiddleware, metrics=metrics)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.get("/rl/trajectories/abc")).status_code == 200
        assert (await c.get("/rl/trajectories/secret")).status_code == 401
        assert (await c.get("/nowhere")).status_code == 404
    route = "/rl/trajectories/{trajectory_id}"
    for status in ("200", "401"):
        labels = dict(route=route, method="GET", status=status, model="")
        assert _value(metrics, "rlproxy_http_requests_total", **labels) == 1
    labels = dict(route="unmatched", method="GET", status="404", model="")
    assert _value(metrics, "rlproxy_http_requests_total", **labels) == 1


def test_metrics_scrape_auth_is_a_setting() -> None:
    from proxy.api.auth import required_scope

    assert required_scope("GET", "/metrics") == "open"
    assert required_scope("GET", "/metrics", "admin") == "admin"
    assert required_scope("GET", "/rl/trajectories", "admin") == "inference"


# --------------------------------------------------------------------------- the receiver


def test_the_receiver_accepts_what_the_langfuse_sdk_sends(receiver: TelemetryReceiver) -> None:
    """The real SDK against the fake: same paths, auth, encodings and score bodies."""
    from langfuse import Langfuse
    from opentelemetry.sdk.trace import TracerProvider

    lf = Langfuse(
        public_key=receiver.public_key,
        secret_key=receiver.secret_key,
        host=receiver.url,
        tracer_provider=TracerProvider(),  # never OpenTelemetry's global provider
    )
    trace_id = uuid.uuid4().hex
    generation = lf.start_observation(
        trace_context={"trace_id": trace_id}, name="chat", as_type="generation", model="m"
    )
    generation.end()
    lf.create_score(name="reward", value=0.5, trace_id=trace_id, comment="why")
    lf.flush()
    spans = receiver.wait_for(lambda: receiver.spans("langfuse"))
    (score,) = receiver.wait_for(lambda: receiver.scores)
    assert spans[0].trace_id == trace_id
    assert score["traceId"] == trace_id and score["value"] == 0.5 and score["comment"] == "why"
    assert receiver.unauthorized == 0
    lf.shutdown()


def test_the_receiver_decodes_otlp_json(receiver: TelemetryReceiver) -> None:
    body = {
        "resourceSpans": [
            {
                "resource": {
                    "attributes": [{"key": "service.name", "value": {"stringValue": "x"}}]
                },
                "scopeSpans": [
                    {
                        "spans": [
                            {
                                "traceId": "5B8EFFF798038103D269B633813FC60C",
                                "spanId": "EEE19B7EC3C1B174",
                                "name": "chat m",
                                "kind": 3,
                                "startTimeUnixNano": "1544712660000000000",
                                "endTimeUnixNano": "1544712661000000000",
                                "attributes": [
                                    {
                                        "key": "gen_ai.usage.input_tokens",
                                        "value": {"intValue": "12"},
                                    },
                                    {
                                        "key": "gen_ai.response.finish_reasons",
                                        "value": {
                                            "arrayValue": {"values": [{"stringValue": "stop"}]}
                                        },
                                    },
                                ],
                            }
                        ]
                    }
                ],
            }
        ]
    }
    r = httpx.post(f"{receiver.url}/v1/traces", json=body)
    assert r.status_code == 200
    (span,) = receiver.spans("otlp")
    assert span.trace_id == "5b8efff798038103d269b633813fc60c"
    assert span.attributes == {
        "gen_ai.usage.input_tokens": 12,
        "gen_ai.response.finish_reasons": ("stop",),
    }


# --------------------------------------------------------------------------- helpers


def _value(metrics: Metrics, name: str, **labels: str) -> float:
    """One sample of the rendered registry (0 when absent)."""
    from prometheus_client import generate_latest

    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
