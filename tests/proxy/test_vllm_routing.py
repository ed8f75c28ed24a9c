"""Which vLLM replica takes a request (`proxy.engines.vllm_replicas.ReplicaPool.pick`), driven
through the `vllm` engine against vLLM-shaped handlers on loopback (`tests/fakes/vllm_wire.py`):
least outstanding work, replicas that fail, session affinity (every turn of a conversation on
one replica, the key computed only when it chooses), vLLM's prefix cache counters, and the chat
service keeping a conversation on one replica.

The rest of the engine (the wire, adapters, set-up mistakes): tests/proxy/test_vllm_engine.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from proxy.chat.service import _api_error
from proxy.engines.base import (
    ChoiceFinished,
    EngineUnavailableError,
    GenerationRequest,
    SamplingParams,
)
from proxy.errors import BadGatewayError, EngineUnreachableError
from tests.fakes.loopback_http import Handler, HangUp, Req
from tests.fakes.vllm_wire import (
    PROMPT,
    A,
    B,
    Replicas,
    answer,
    chunk,
    collect,
    health_ok,
    request,
    sse,
    started,
)

# ----------------------------------------------------------------------------- replicas


async def test_least_outstanding_work_and_a_refused_connection_goes_elsewhere(
    replicas: Replicas,
) -> None:
    served: list[str] = []

    def handler(req: Req) -> httpx.Response | None:
        if req.path == "/v1/completions":
            host = req.replica
            if host == A:
                raise HangUp  # before any answer: the connection dropped
            served.append(host)
            return httpx.Response(200, content=answer([5], [-0.3], ["x"], "stop"))
        return health_ok(req)

    engine = await started(await replicas(handler, affinity=False))
    engine.pool.replicas[1].outstanding = 10  # B is busier: A is picked first
    events = await collect(engine, request())
    assert served == [B] and isinstance(events[-1], ChoiceFinished)
    assert not engine.pool.replicas[0].healthy  # out of rotation until its probe answers
    assert engine.pool.replicas[1].outstanding == 10  # what the request owed was given back


async def test_a_replica_dying_mid_answer_is_a_502_and_none_left_a_503(replicas: Replicas) -> None:
    async def dying() -> AsyncIterator[bytes]:
        yield sse(chunk(0, [5], [-0.3], "x", prompt_token_ids=PROMPT), done=False)
        raise HangUp

    def handler(req: Req) -> httpx.Response | None:
        if req.path == "/v1/completions":
            return httpx.Response(200, content=dying())
        return health_ok(req)

    engine = await started(await replicas(handler, (A,)))
    events: list[Any] = []
    with pytest.raises(EngineUnavailableError) as died:
        async for event in engine.generate(request()):
            events.append(event)
    assert len(events) == 1 and died.value.mid_answer
    assert isinstance(_api_error(died.value), BadGatewayError)
    assert _api_error(died.value).status_code == 502
    with pytest.raises(EngineUnavailableError) as none_left:
        await collect(engine, request())
    assert not none_left.value.mid_answer
    assert _api_error(none_left.value).status_code == 503
    assert isinstance(_api_error(none_left.value), EngineUnreachableError)


# ----------------------------------------------------------------------------- affinity

C = "http://c:8000"


def recording_handler(served: list[tuple[str, list[int]]]) -> Handler:
    """Answers every completion with one token for the prompt it was sent, noting which replica
    served which prompt."""

    def handler(req: Req) -> httpx.Response | None:
        if req.path == "/v1/completions":
            prompt = json.loads(req.content)["prompt"]
            served.append((req.replica, prompt))
            return httpx.Response(
                200, content=sse(chunk(0, [5], [-0.3], "x", "stop", prompt_token_ids=prompt))
            )
        return health_ok(req)

    return handler


def turn(key: str | None, prompt: list[int] = PROMPT) -> GenerationRequest:
    affinity = None if key is None else lambda: key
    return GenerationRequest(
        prompt, SamplingParams(max_tokens=1), request_id="r", affinity=affinity
    )


async def test_every_turn_of_a_conversation_goes_to_one_replica_and_conversations_spread(
    replicas: Replicas,
) -> None:
    served: list[tuple[str, list[int]]] = []
    engine = await started(await replicas(recording_handler(served), (A, B, C)))
    keys = [f"session:{k}" for k in range(24)]
    for _ in range(3):  # three turns of every conversation, interleaved
        for key in keys:
            await collect(engine, turn(key))
    by_key = [{served[t * len(keys) + k][0] for t in range(3)} for k in range(len(keys))]
    assert all(len(replicas_of_key) == 1 for replicas_of_key in by_key)
    used = {next(iter(s)) for s in by_key}
    assert used == {A, B, C}  # 24 keys over 3 replicas: each gets some
    assert engine.pool.routed == {"affinity": 72, "spilled": 0, "least_busy": 0}


async def test_a_replica_leaving_moves_only_its_own_conversations(replicas: Replicas) -> None:
    served: list[tuple[str, list[int]]] = []
    engine = await started(await replicas(recording_handler(served), (A, B, C)))
    keys = [f"trajectory:{k}" for k in range(24)]
    for key in keys:
        await collect(engine, turn(key))
    before = [host for host, _ in served]
    engine.pool.mark_down(engine.pool.replicas[2], "gone")  # C leaves
    served.clear()
    for key in keys:
        await collect(engine, turn(key))
    after = [host for host, _ in served]
    assert C not in after
    # Keys whose replica stayed keep it; only C's keys moved.
    assert all(b == a for b, a in zip(before, after, strict=True) if b != C)
    assert any(b == C for b in before)


async def test_a_busy_replica_passes_its_conversation_to_the_least_busy_one(
    replicas: Replicas,
) -> None:
    served: list[tuple[str, list[int]]] = []
    engine = await started(await replicas(recording_handler(served), (A, B), affinity_slack=2))
    await collect(engine, turn("session:x"))
    names = [A, B]
    at_home = names.index(served[0][0])
    home, elsewhere = engine.pool.replicas[at_home], names[1 - at_home]
    home.in_flight = 2  # within the slack: the conversation stays home
    await collect(engine, turn("session:x"))
    home.in_flight = 3  # past it: the least busy replica takes this turn
    await collect(engine, turn("session:x"))
    assert [host for host, _ in served] == [names[at_home], names[at_home], elsewhere]
    assert engine.pool.routed == {"affinity": 2, "spilled": 1, "least_busy": 0}


async def test_without_a_key_the_first_prompt_tokens_choose_and_affinity_off_is_least_work(
    replicas: Replicas,
) -> None:
    from proxy.engines.vllm import AFFINITY_BLOCK

    served: list[tuple[str, list[int]]] = []
    engine = await started(await replicas(recording_handler(served), (A, B, C)))
    for opening in range(8):
        head = [opening + 10] * AFFINITY_BLOCK
        for tail in ([7], [7, 8, 9], [7, 8, 9, 10, 11]):  # a conversation's growing prompt
            await collect(engine, turn(None, head + tail))
    homes = [{host for host, _ in served[3 * k : 3 * k + 3]} for k in range(8)]
    assert all(len(h) == 1 for h in homes) and len(set().union(*homes)) > 1

    served.clear()
    off = await started(await replicas(recording_handler(served), (A, B), affinity=False))
    off.pool.replicas[0].outstanding = 10  # A owes more: B takes every request
    for key in ("session:1", "session:2", "session:3"):
        await collect(off, turn(key))
    assert [host for host, _ in served] == [B, B, B]
    assert off.pool.routed["least_busy"] == 3


async def test_the_key_is_computed_only_where_it_chooses_the_replica(
    replicas: Replicas,
) -> None:
    """The chat service hands the engine a function, not a key: with one replica, or affinity
    off, nothing is hashed."""
    asked: list[str] = []

    def key() -> str:
        asked.append("session:x")
        return "session:x"

    served: list[tuple[str, list[int]]] = []
    keyed = GenerationRequest(PROMPT, SamplingParams(max_tokens=1), request_id="r", affinity=key)
    one = await started(await replicas(recording_handler(served), (A,)))
    off = await started(await replicas(recording_handler(served), (A, B), affinity=False))
    await collect(one, keyed)
    await collect(off, keyed)
    assert len(served) == 2 and asked == []
    assert one.pool.routed["affinity"] == 1  # its only replica is the key's, whatever the key
    two = await started(await replicas(recording_handler(served), (A, B)))
    await collect(two, keyed)
    assert asked == ["session:x"] and two.pool.routed["affinity"] == 1


VLLM_METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="base"} 3000.0
vllm:prefix_cache_queries_total{engine="1",model_name="base"} 1000.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="base"} 1.7649e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="base"} 2400.0
vllm:prefix_cache_hits_total{engine="1",model_name="base"} 600.0
# HELP vllm:external_prefix_cache_hits_total External prefix cache hits.
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="base"} 99.0
"""


async def test_vllms_prefix_cache_counters_show_in_health_summed_over_replicas(
    replicas: Replicas,
) -> None:
    def handler(req: Req) -> httpx.Response | None:
        if req.path == "/metrics":  # B answers none: a replica not read yet counts nothing
            return httpx.Response(200, text=VLLM_METRICS) if req.replica == A else None
        return health_ok(req)

    engine = await started(await replicas(handler, (A, B)))
    detail = engine.health().detail
    assert detail["prefix_cache"] == {"query_tokens": 4000, "hit_tokens": 3000, "hit_rate": 0.75}
    assert (detail["prefix_cache_query_tokens"], detail["prefix_cache_hit_tokens"]) == (4000, 3000)
    by_url = {r["url"]: r["prefix_cache"] for r in detail["replicas"]}
    assert by_url[engine.pool.replicas[0].url]["hit_rate"] == 0.75
    assert by_url[engine.pool.replicas[1].url] is None


async def test_the_chat_service_keeps_a_conversation_on_one_replica(
    replicas: Replicas, chat_tokenizer: Any
) -> None:
    from proxy.adapters.registry import ServedModels
    from proxy.chat.record import CallInfo
    from proxy.chat.service import ChatService
    from proxy.protocols.chat import ChatCompletionRequest

    served: list[tuple[str, list[int]]] = []
    engine = await started(await replicas(recording_handler(served), (A, B, C)))
    chat = ChatService(engine, ServedModels("rlproxy"), chat_tokenizer)
    homes = []
    # Eight conversations of two turns, no ids, no headers (all eight on one of three replicas
    # by chance: 3 / 3**8, 0.05 %; the replicas' URLs, so their ranks, change every run).
    for agent in range(8):
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"Task {agent}."}]
        for t in range(2):
            body = {"model": "rlproxy", "messages": messages, "max_tokens": 1}
            request = ChatCompletionRequest.model_validate(body)
            answer_ = await chat.complete(await chat.prepare(CallInfo(request, f"r{agent}{t}")))
            messages = [
                *messages,
                answer_["choices"][0]["message"],
                {"role": "user", "content": f"Go on ({t})."},
            ]
        homes.append({host for host, _ in served[-2:]})
    assert all(len(h) == 1 for h in homes)
    assert len(set().union(*homes)) > 1
