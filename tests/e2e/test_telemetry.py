"""Telemetry through a real server: `/metrics` after real traffic, every chat call as a GenAI
span at an OTLP/HTTP collector, each trajectory one trace and one Langfuse session, rewards and
RULER scores as Langfuse scores, and a dead collector that serving never notices.

The collector and Langfuse are `tests/e2e/telemetry_receiver.py` (a fake that follows the OTLP
and Langfuse protocols and is itself checked against the real Langfuse SDK in
`tests/proxy/test_telemetry_parts.py`); the judge is `tests/e2e/fake_judge.py`, so RULER's
scores are known in advance. Arrivals are awaited by polling with a deadline, never by timing.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import Server
from tests.e2e.fake_judge import FakeJudge, FakeJudgeServer
from tests.e2e.helpers import db_rows, own_server
from tests.e2e.telemetry_receiver import TelemetryReceiver
from tests.e2e.test_adapters import write_random_lora

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def receiver() -> Iterator[TelemetryReceiver]:
    with TelemetryReceiver(public_key="pk-lf-rlproxy", secret_key="sk-lf-rlproxy") as rx:
        yield rx


@pytest.fixture(scope="module")
def judge() -> Iterator[FakeJudge]:
    with FakeJudgeServer() as fake:
        yield fake


@pytest.fixture(scope="module")
def tserver(
    tmp_path_factory: pytest.TempPathFactory,
    model_data_dir: Path,
    receiver: TelemetryReceiver,
    judge: FakeJudge,
) -> Iterator[Server]:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,  # the exporter appends /v1/traces
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "LANGFUSE_PUBLIC_KEY": receiver.public_key,
        "LANGFUSE_SECRET_KEY": receiver.secret_key,
        "LANGFUSE_HOST": receiver.url,
        "RLPROXY_TELEMETRY_CAPTURE_CONTENT": "true",
        "RLPROXY_METRICS_CACHE_S": "0",
        "RLPROXY_SCORING": "true",
        "RLPROXY_SCORING_INTERVAL_S": "0.5",
        "RLPROXY_GROUP_MIN_SIZE": "2",
        "RLPROXY_JUDGE_MODEL": "openai/judge",
        "RLPROXY_JUDGE_API_BASE": judge.base_url,
        "RLPROXY_JUDGE_API_KEY_ENV": "FAKE_JUDGE_KEY",
        "FAKE_JUDGE_KEY": "sk-judge",
        "RLPROXY_JUDGE_TIMEOUT_S": "30",
    }
    with own_server(tmp_path_factory.mktemp("telemetry-data"), model_data_dir, env) as server:
        yield server


@pytest.fixture(scope="module")
def client(tserver: Server) -> Iterator[OpenAI]:
    with OpenAI(base_url=tserver.base_url, api_key="sk-test", max_retries=0, timeout=300) as c:
        yield c


def _ask(client: OpenAI, question: str, history: list[dict[str, Any]] | None = None, **kw: Any):
    messages = [
        {"role": "system", "content": "Answer in one word."},
        *(history or []),
        {"role": "user", "content": question},
    ]
    return client.chat.completions.create(
        model="rlproxy", messages=messages, max_tokens=5, temperature=0.8, **kw
    )


def _trajectory(server: Server, completion_id: str) -> str:
    r = httpx.get(f"{server.url}/rl/trajectories/{completion_id}", timeout=30)
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def _scrape(server: Server) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    r = httpx.get(f"{server.url}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def _get(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str):
    return samples.get((name, frozenset(labels.items())), 0.0)


# --------------------------------------------------------------------------- /metrics


def test_metrics_move_with_a_200_and_a_400(tserver: Server, client: OpenAI) -> None:
    before = _scrape(tserver)
    done = _ask(client, f"Name a fruit ({uuid.uuid4().hex[:6]}).")
    with pytest.raises(openai.BadRequestError):
        _ask(client, "Name a tree.", n=100)  # over RLPROXY_MAX_N: a 400 before any token
    after = _scrape(tserver)

    def moved(name: str, **labels: str) -> float:
        return _get(after, name, **labels) - _get(before, name, **labels)

    chat = {"route": CHAT, "method": "POST"}
    assert moved("rlproxy_http_requests_total", **chat, status="200", model="rlproxy") == 1
    assert moved("rlproxy_http_requests_total", **chat, status="400", model="rlproxy") == 1
    assert moved("rlproxy_http_request_duration_seconds_count", **chat) == 2
    local = {"model": "rlproxy", "engine": "local"}
    calls = {**local, "protocol": "chat"}
    assert moved("rlproxy_chat_calls_total", **calls, status="completed") == 1
    assert moved("rlproxy_chat_calls_total", **calls, status="error") == 0  # the 400 is no call
    assert done.usage is not None
    assert moved("rlproxy_chat_prompt_tokens_total", **local) == done.usage.prompt_tokens
    assert moved("rlproxy_chat_completion_tokens_total", **local) == done.usage.completion_tokens
    assert moved("rlproxy_chat_call_duration_seconds_count", **local) == 1
    assert moved("rlproxy_chat_time_to_first_token_seconds_count", **local) == 1
    assert moved("rlproxy_engine_tokens_total") >= done.usage.completion_tokens
    assert moved("rlproxy_store_commit_duration_seconds_count") >= 1
    assert _get(after, "rlproxy_trajectories", status="open") >= 1
    assert _get(after, "rlproxy_store_writable") == 1
    assert _get(after, "rlproxy_adapter_active_version") == 0
    assert b"Name a fruit" not in httpx.get(f"{tserver.url}/metrics").content


def test_calls_are_counted_by_protocol(tserver: Server, client: OpenAI) -> None:
    before = _scrape(tserver)
    client.responses.create(model="rlproxy", input="Name a fruit.", max_output_tokens=2)
    httpx.post(
        f"{tserver.url}/v1/messages",
        json={"model": "rlproxy", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
        timeout=120,
    ).raise_for_status()
    after = _scrape(tserver)
    for protocol in ("responses", "messages"):
        labels = {"model": "rlproxy", "engine": "local", "status": "completed"}
        key = ("rlproxy_chat_calls_total", frozenset({**labels, "protocol": protocol}.items()))
        assert after.get(key, 0.0) - before.get(key, 0.0) == 1, protocol


def test_an_activated_adapter_moves_the_version_gauge(
    tserver: Server, model_data_dir: Path
) -> None:
    write_random_lora(model_data_dir, tserver.data_dir / "checkpoints" / "rlproxy" / "0001")
    before = _scrape(tserver)
    try:
        r = httpx.post(f"{tserver.url}/rl/adapters/1/activate", timeout=120)
        assert r.status_code == 200, r.text
        after = _scrape(tserver)
        assert _get(after, "rlproxy_adapter_active_version") == 1
        assert _get(after, "rlproxy_adapter_loaded_versions") == 1
        swaps = "rlproxy_adapter_swaps_total"
        assert _get(after, swaps) - _get(before, swaps) == 1
    finally:
        httpx.post(f"{tserver.url}/rl/adapters/0/activate", timeout=120)


# --------------------------------------------------------------------------- spans


def test_every_call_is_a_genai_span_and_a_trajectory_is_one_trace(
    tserver: Server, client: OpenAI, receiver: TelemetryReceiver
) -> None:
    tag = uuid.uuid4().hex[:6]
    first = _ask(client, f"Name a color ({tag}).")
    history = [
        {"role": "user", "content": f"Name a color ({tag})."},
        {"role": "assistant", "content": first.choices[0].message.content},
    ]
    second = _ask(client, "And another?", history=history)
    other = _ask(
        client, f"Name a city ({tag}).", stream=True, stream_options={"include_usage": True}
    )
    other_id = next(iter(other)).id
    for _ in other:
        pass
    tid, tid_other = _trajectory(tserver, first.id), _trajectory(tserver, other_id)
    assert _trajectory(tserver, second.id) == tid != tid_other

    ids = {first.id, second.id, other_id}

    def ours(destination: str) -> list[Any] | None:
        spans = [
            s for s in receiver.spans(destination) if s.attributes.get("gen_ai.response.id") in ids
        ]
        return spans if len(spans) == 3 else None

    spans = {s.attributes["gen_ai.response.id"]: s for s in receiver.wait_for(lambda: ours("otlp"))}
    span = spans[first.id]
    a = span.attributes
    assert span.name == "chat rlproxy" and span.parent_span_id == "" and span.end_ns > span.start_ns
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "rlproxy"
    assert a["gen_ai.request.model"] == "rlproxy"
    assert a["gen_ai.response.model"] == "rlproxy@base"
    assert a["gen_ai.response.finish_reasons"] == (first.choices[0].finish_reason,)
    assert first.usage is not None
    assert a["gen_ai.usage.input_tokens"] == first.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == first.usage.completion_tokens
    assert a["gen_ai.conversation.id"] == tid
    assert a["gen_ai.request.temperature"] == 0.8 and a["gen_ai.request.max_tokens"] == 5
    assert a["rlproxy.adapter_version"] == 0 and a["rlproxy.engine"] == "local"
    assert a["rlproxy.time_to_first_token_s"] > 0
    (call,) = db_rows(tserver.data_dir, "SELECT * FROM calls WHERE completion_id = ?", (first.id,))
    assert a["rlproxy.call_id"] == call["id"]
    assert span.start_ns == int(call["created_at"] * 1e9)
    # Capture is on in this server: the messages, in the conventions' parts format.
    assert json.loads(a["gen_ai.input.messages"])[-1]["parts"][0]["content"].startswith("Name a")
    output = json.loads(a["gen_ai.output.messages"])
    assert output[0]["parts"][0]["content"] == first.choices[0].message.content

    # One trace per trajectory: its id is the trajectory's.
    assert spans[first.id].trace_id == spans[second.id].trace_id == tid
    assert spans[other_id].trace_id == tid_other
    assert spans[other_id].attributes["rlproxy.stream"] is True

    # Langfuse gets the same spans: a generation each, the trajectory as session and trace.
    lf = {
        s.attributes["gen_ai.response.id"]: s for s in receiver.wait_for(lambda: ours("langfuse"))
    }
    assert lf[second.id].trace_id == tid and lf[second.id].attributes["session.id"] == tid
    assert lf[second.id].attributes["langfuse.observation.type"] == "generation"
    assert json.loads(lf[second.id].attributes["langfuse.observation.input"])[-1] == {
        "role": "user",
        "content": "And another?",
    }
    assert receiver.unauthorized == 0


# --------------------------------------------------------------------------- Langfuse scores


def test_a_reward_is_a_langfuse_score_on_its_trace(
    tserver: Server, client: OpenAI, receiver: TelemetryReceiver
) -> None:
    done = _ask(client, f"Name a bird ({uuid.uuid4().hex[:6]}).")
    r = httpx.post(
        f"{tserver.url}/rl/trajectories/{done.id}/reward",
        json={"reward": 0.75, "source": "env", "explanation": "close enough"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    tid = r.json()["trajectory_id"]
    (score,) = receiver.wait_for(
        lambda: [s for s in receiver.scores if s["traceId"] == tid and s["name"] == "reward"]
    )
    assert score["value"] == 0.75 and score["comment"] == "close enough"
    assert score["metadata"]["source"] == "env" and score["dataType"] == "NUMERIC"


def test_ruler_scores_reach_langfuse_with_their_explanations(
    tserver: Server, client: OpenAI, receiver: TelemetryReceiver, judge: FakeJudge
) -> None:
    before = _scrape(tserver)
    judge.reset()
    judge.reply(
        json.dumps(
            {
                "scores": [
                    {"trajectory_id": "1", "explanation": "terse and right", "score": 0.9},
                    {"trajectory_id": "2", "explanation": "rambles", "score": 0.2},
                ]
            }
        )
    )
    key = f"tel-{uuid.uuid4().hex[:8]}"
    tids = []
    for question in ("Pick a letter.", "Pick a digit."):
        done = _ask(client, question, extra_headers={"X-RLProxy-Group": key})
        tids.append(_trajectory(tserver, done.id))
        assert httpx.post(f"{tserver.url}/rl/trajectories/{tids[-1]}/end").status_code == 200

    def ruler_scores() -> list[dict[str, Any]] | None:
        sent = [s for s in receiver.scores if s["name"] == "ruler" and s["traceId"] in tids]
        return sent if len(sent) == 2 else None

    scores = receiver.wait_for(ruler_scores)
    groups = httpx.get(f"{tserver.url}/rl/groups", params={"source": "explicit"}).json()["data"]
    (group,) = [g for g in groups if g["key"] == key]
    members = httpx.get(f"{tserver.url}/rl/groups/{group['id']}").json()["members"]
    by_trace = {s["traceId"]: s for s in scores}
    assert {m["ruler"]["score"] for m in members} == {0.9, 0.2}
    for m in members:
        sent = by_trace[m["trajectory_id"]]
        assert sent["value"] == m["ruler"]["score"]
        assert sent["comment"] == m["ruler"]["explanation"]
        assert sent["metadata"]["group_id"] == group["id"]
    after = _scrape(tserver)
    labels = {"judge": "openai/judge"}
    assert (
        _get(after, "rlproxy_judge_groups_total", **labels, status="scored")
        - _get(before, "rlproxy_judge_groups_total", **labels, status="scored")
        == 1
    )
    assert _get(after, "rlproxy_judge_duration_seconds_count", **labels) >= 1
    assert _get(after, "rlproxy_langfuse_scores_total", outcome="failed") == 0


# --------------------------------------------------------------------------- a dead collector


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_dead_collector_leaves_serving_alone(
    tmp_path: Path, model_data_dir: Path, pool: ThreadPoolExecutor
) -> None:
    dead = f"http://127.0.0.1:{_closed_port()}"
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{dead}/v1/traces",
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "1",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_BSP_MAX_QUEUE_SIZE": "2",
        "LANGFUSE_PUBLIC_KEY": "pk",
        "LANGFUSE_SECRET_KEY": "sk",
        "LANGFUSE_HOST": dead,
        "LANGFUSE_TIMEOUT": "1",
    }
    with own_server(tmp_path / "data", model_data_dir, env) as server:
        with OpenAI(base_url=server.base_url, api_key="sk", max_retries=0, timeout=300) as c:
            questions = [f"Count to {i} ({uuid.uuid4().hex[:6]})." for i in range(4)]
            answers = list(pool.map(lambda q: _ask(c, q), questions))
        assert all(a.choices[0].finish_reason for a in answers)
        stored = db_rows(server.data_dir, "SELECT completion_id FROM calls")
        assert {r["completion_id"] for r in stored} == {a.id for a in answers}
        r = httpx.post(f"{server.url}/rl/trajectories/{answers[0].id}/reward", json={"reward": 1})
        assert r.status_code == 200

        def lost() -> float:
            m = _scrape(server)
            return sum(
                _get(m, "rlproxy_telemetry_spans_total", destination="otlp", outcome=o)
                for o in ("dropped_queue_full", "export_failed")
            )

        assert httpx.get(f"{server.url}/health").status_code == 200
        assert _wait(lambda: lost() == len(answers)), "every span is counted as lost"


def _wait(check: Any, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False
