"""The `vllm` engine against vLLM-shaped HTTP handlers served on loopback (one real aiohttp server
per replica, `tests/fakes/vllm_wire.py`, so the engine's own HTTP client, pool and stream
reading are what run): what it sends, how it reads streams, versioned adapters, replicas set up
wrong, the chat service in front of it. Which replica takes a request (least work, failover,
session affinity): tests/proxy/test_vllm_routing.py.

The end-to-end tests with real processes are tests/e2e/test_vllm_*.py; these pin the rules that
are hard to provoke there (a replica refusing one adapter, a death between two tokens).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import llguidance
import pytest

from proxy.chat.grammar import ToolChoice, constraint_for_json_schema, constraint_for_tools
from proxy.engines.base import (
    ChoiceFinished,
    EngineError,
    EngineUnavailableError,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from proxy.engines.vllm import lark_text
from proxy.engines.vllm_replicas import ReplicaMisconfigured
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

# ----------------------------------------------------------------------------- the wire


async def test_sends_token_ids_and_reads_exact_ids_logprobs_and_top_logprobs(
    replicas: Replicas,
) -> None:
    sent: list[dict[str, Any]] = []

    def handler(req: Req) -> httpx.Response | None:
        if req.path == "/v1/completions":
            sent.append(json.loads(req.content))
            body = answer([11, 12, 13], [-0.5, -1.25, -2.0], ["He", "llo", "!"])
            return httpx.Response(200, content=body)
        return health_ok(req)

    engine = await started(await replicas(handler, (A,)))
    events = await collect(engine, request(logprobs=True, top_logprobs=1, seed=7))

    body = sent[0]
    assert body["model"] == "base" and body["prompt"] == PROMPT
    assert body["return_token_ids"] and body["return_tokens_as_token_ids"] and body["stream"]
    assert body["logprobs"] == 1 and body["seed"] == 7 and body["stop_token_ids"] == [1, 2]
    assert engine.max_context == 2048
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert [(t.token_id, t.logprob, t.text) for t in tokens] == [
        (11, -0.5, "He"),
        (12, -1.25, "llo"),
        (13, -2.0, "!"),
    ]
    assert tokens[0].top_logprobs == ((99, -0.1),)
    (fin,) = [e for e in events if isinstance(e, ChoiceFinished)]
    assert (fin.prompt_token_ids, fin.completion_token_ids) == (PROMPT, [11, 12, 13])
    assert fin.completion_logprobs == [-0.5, -1.25, -2.0]
    assert (fin.finish_reason, fin.text) == ("length", "Hello!")


async def test_logprobs_are_asked_for_even_when_the_client_did_not(replicas: Replicas) -> None:
    sent: list[dict[str, Any]] = []

    def handler(req: Req) -> httpx.Response | None:
        if req.path == "/v1/completions":
            sent.append(json.loads(req.content))
            return httpx.Response(200, content=answer([5], [-0.3], ["x"], "stop"))
        return health_ok(req)

    engine = await started(await replicas(handler, (A,)))
    events = await collect(engine, request())
    assert sent[0]["logprobs"] == 0
    assert events[-1].completion_logprobs == [-0.3]
    assert events[0].top_logprobs == ()


async def test_a_prompt_other_than_the_one_sent_fails_the_call(replicas: Replicas) -> None:
    def handler(req: Req) -> httpx.Response | None:
        if req.path == "/v1/completions":
            body = sse(chunk(0, [5], [-0.3], "x", "stop", prompt_token_ids=[9, 9]))
            return httpx.Response(200, content=body)
        return health_ok(req)

    engine = await started(await replicas(handler, (A,)))
    with pytest.raises(EngineError, match="different prompt"):
        await collect(engine, request())


async def test_an_answer_outside_the_protocol_is_an_engine_error(replicas: Replicas) -> None:
    def handler(req: Req) -> httpx.Response | None:
        if req.path == "/v1/completions":  # a choice index the request never asked for
            return httpx.Response(200, content=sse(chunk(5, [5], [-0.3], "x", "stop")))
        return health_ok(req)

    engine = await started(await replicas(handler, (A,)))
    with pytest.raises(EngineError, match="cannot read"):
        await collect(engine, request())


async def test_each_stream_is_read_to_its_end_so_its_connection_is_reused(
    replicas: Replicas,
) -> None:
    """Past `[DONE]` to the end of the body: a pooled HTTP client hands a connection back only
    once its response was read to the end, and a new connection per request delays every first
    token."""
    peers: list[Any] = []

    async def body() -> AsyncIterator[bytes]:
        yield answer([5], [-0.3], ["x"], "stop")  # its last event is `data: [DONE]`
        await asyncio.sleep(0.05)  # the body's end comes a little later, as over a network

    def handler(req: Req) -> httpx.Response | None:
        if req.path == "/v1/completions":
            peers.append(req.peer)
            return httpx.Response(200, content=body())
        return health_ok(req)

    engine = await started(await replicas(handler, (A,)))
    for _ in range(3):
        events = await collect(engine, request())
        assert events[-1].completion_token_ids == [5]
    assert len(peers) == 3 and len(set(peers)) == 1  # three streams, one connection


def test_grammars_travel_as_lark_that_llguidance_reads() -> None:
    schema = constraint_for_json_schema({"type": "object", "properties": {"a": {"type": "string"}}})
    tools = constraint_for_tools(
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        ToolChoice("required"),
    )
    for grammar in (schema, tools):
        text = lark_text(grammar)
        # what vLLM's guidance backend does with `structured_outputs.grammar`
        assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("grammar", text)) == ""
    assert lark_text(schema).startswith("start: %json {")


# ----------------------------------------------------------------------------- adapters


def lora_handler(
    loaded: dict[str, set[str]], refuse: str | None = None
) -> Callable[[Req], httpx.Response | None]:
    def handler(req: Req) -> httpx.Response | None:
        host = req.replica
        names = loaded.setdefault(host, set())
        if req.path == "/v1/load_lora_adapter":
            name = json.loads(req.content)["lora_name"]
            if host == refuse:
                info = {"message": "LoRA rank 64 is greater than max_lora_rank 16.", "code": 500}
                return httpx.Response(500, json={"error": {**info, "type": "InternalServerError"}})
            if name in names:
                msg = f"The lora adapter '{name}' has already been loaded."
                return httpx.Response(400, json={"error": {"message": msg, "code": 400}})
            names.add(name)
            return httpx.Response(200, text="Success")
        if req.path == "/v1/unload_lora_adapter":
            name = json.loads(req.content)["lora_name"]
            if name not in names:
                return httpx.Response(404, json={"error": {"message": "cannot be found"}})
            names.discard(name)
            return httpx.Response(200, text="Success")
        if req.path == "/v1/models":
            base = {"id": "base", "parent": None, "max_model_len": 2048}
            cards = [{"id": n, "parent": "base"} for n in sorted(names)]
            return httpx.Response(200, json={"data": [base, *cards]})
        if req.path == "/health":
            return httpx.Response(200)
        return None

    return handler


async def test_each_version_loads_on_every_replica_under_its_own_name(replicas: Replicas) -> None:
    loaded: dict[str, set[str]] = {}
    engine = await started(await replicas(lora_handler(loaded)))
    await engine.load_adapter("v3", "/data/checkpoints/rlproxy/0003")
    assert loaded == {A: {"rlproxy@3"}, B: {"rlproxy@3"}}
    await engine.load_adapter("v3", "/data/checkpoints/rlproxy/0003")  # again: nothing new
    await engine.unload_adapter("v3")
    assert loaded == {A: set(), B: set()}


async def test_one_refusal_fails_the_load_and_undoes_it_elsewhere(replicas: Replicas) -> None:
    loaded: dict[str, set[str]] = {}
    engine = await started(await replicas(lora_handler(loaded, refuse=B)))
    with pytest.raises(EngineError, match="max_lora_rank") as refused:
        await engine.load_adapter("v4", "/data/checkpoints/rlproxy/0004")
    assert "Fix: start vLLM with --max-lora-rank" in str(refused.value)  # issue 24
    assert loaded.get(A, set()) == set()
    with pytest.raises(EngineError, match="not loaded"):
        await collect(engine, GenerationRequest(PROMPT, SamplingParams(max_tokens=1), adapter="v4"))


async def test_unload_waits_for_the_requests_in_flight_on_that_version(replicas: Replicas) -> None:
    loaded: dict[str, set[str]] = {}
    release = asyncio.Event()
    models: list[str] = []
    base = lora_handler(loaded)

    async def slow() -> AsyncIterator[bytes]:
        v1 = "rlproxy@1"
        yield sse(chunk(0, [5], [-0.3], "x", model=v1, prompt_token_ids=PROMPT), done=False)
        await release.wait()
        yield sse(chunk(0, [6], [-0.2], "y", "length", model=v1))

    def handler(req: Req) -> httpx.Response | None:
        if req.path == "/v1/completions":
            models.append(json.loads(req.content)["model"])
            return httpx.Response(200, content=slow())
        return base(req)

    engine = await started(await replicas(handler, (A,)))
    await engine.load_adapter("v1", "/x/0001")
    req = GenerationRequest(PROMPT, SamplingParams(max_tokens=2), adapter="v1")
    stream = engine.generate(req)
    first = await stream.__anext__()
    unload = asyncio.create_task(engine.unload_adapter("v1"))
    await asyncio.sleep(0.05)
    assert not unload.done() and loaded[A] == {"rlproxy@1"}  # still serving the request
    with pytest.raises(EngineError, match="not loaded"):  # but no new one starts on it
        await collect(engine, GenerationRequest(PROMPT, SamplingParams(max_tokens=1), adapter="v1"))
    release.set()
    rest = [e async for e in stream]
    await asyncio.wait_for(unload, 5)
    assert first.token_id == 5 and rest[-1].completion_token_ids == [5, 6]
    assert models == ["rlproxy@1"] and loaded[A] == set()


async def test_a_replica_rejoins_only_after_its_adapters_are_loaded_again(
    replicas: Replicas,
) -> None:
    loaded: dict[str, set[str]] = {}
    up = {A: True, B: True}
    base = lora_handler(loaded)

    def handler(req: Req) -> httpx.Response | None:
        host = req.replica
        if not up[host]:
            raise HangUp
        return base(req)

    engine = await started(await replicas(handler))
    await engine.load_adapter("v1", "/x/0001")
    up[B] = False
    await engine.pool.check_all()
    assert [r.healthy for r in engine.pool.replicas] == [True, False]
    await engine.load_adapter("v2", "/x/0002")  # while B is away
    await engine.unload_adapter("v1")
    loaded[B] = {"rlproxy@1"}  # B comes back as it was (a network blip, not a restart)
    up[B] = True
    await engine.pool.check_all()
    assert [r.healthy for r in engine.pool.replicas] == [True, True]
    assert loaded == {A: {"rlproxy@2"}, B: {"rlproxy@2"}}


async def test_a_rejoin_leaves_what_other_rlproxy_replicas_serve_or_all_when_unknown(
    replicas: Replicas,
) -> None:
    """On a vLLM several rlproxy replicas share, a rejoin unloads only the retired adapters no
    other replica serves (`needed_elsewhere`); none when that is unknown (None, or the question
    fails), and the replica still rejoins. tests/e2e/test_vllm_shared_rejoin.py: two engines."""
    loaded: dict[str, set[str]] = {}
    up = {A: True}
    base = lora_handler(loaded)

    def handler(req: Req) -> httpx.Response | None:
        if not up[req.replica]:
            raise HangUp
        return base(req)

    answers: list[Any] = []

    async def needed_elsewhere() -> set[str] | None:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[no-any-return]

    engine = await started(await replicas(handler, (A,), needed_elsewhere=needed_elsewhere))
    for name in ("v1", "v2", "v3", "v4"):
        await engine.load_adapter(name, f"/x/{name}")

    async def blip_while_retiring(*names: str) -> None:
        up[A] = False
        await engine.pool.check_all()
        for name in names:
            await engine.unload_adapter(name)  # out of rotation: left on the vLLM for now
        up[A] = True
        await engine.pool.check_all()
        assert engine.pool.healthy()

    answers[:] = [{"v1"}]  # another replica serves v1; nobody serves v2
    await blip_while_retiring("v1", "v2")
    assert loaded[A] == {"rlproxy@1", "rlproxy@3", "rlproxy@4"}
    assert engine.pool.replicas[0].loras == {"rlproxy@3", "rlproxy@4"}
    answers[:] = [None]  # the database cannot say: nothing is unloaded
    await blip_while_retiring("v3")
    assert loaded[A] == {"rlproxy@1", "rlproxy@3", "rlproxy@4"}
    answers[:] = [RuntimeError("database down")]  # the same when asking fails
    await blip_while_retiring()
    assert loaded[A] == {"rlproxy@1", "rlproxy@3", "rlproxy@4"}
    answers[:] = [set()]  # nobody serves them any more: the next rejoin cleans up
    await blip_while_retiring()
    assert loaded[A] == {"rlproxy@4"}
    assert not answers


async def test_an_unload_leaves_what_another_rlproxy_replica_serves_by_then(
    replicas: Replicas,
) -> None:
    """The adapter manager asks `needed_elsewhere` before it unloads, but the engine then waits
    for the requests in flight, which can take minutes; another replica may load the version
    again meanwhile. The engine asks again just before the vLLM unload: a version served
    elsewhere by then stays on the vLLM (retired here: a rejoin removes it once nobody serves
    it); unknown (None) unloads nothing either."""
    loaded: dict[str, set[str]] = {}
    answers: list[set[str] | None] = []

    async def needed_elsewhere() -> set[str] | None:
        return answers.pop(0)

    engine = await started(
        await replicas(lora_handler(loaded), (A,), needed_elsewhere=needed_elsewhere)
    )
    for name in ("v1", "v2", "v3"):
        await engine.load_adapter(name, f"/x/{name}")
    answers[:] = [{"v1"}, None, set()]
    await engine.unload_adapter("v1")  # another replica serves it by now
    await engine.unload_adapter("v2")  # the database cannot say
    await engine.unload_adapter("v3")  # nobody else: gone
    assert loaded[A] == {"rlproxy@1", "rlproxy@2"}
    assert engine.pool.replicas[0].loras == set()
    assert not answers


# ----------------------------------------------------------------------------- set up wrong
# Issue 24: configuration mistakes a replica can carry, refused with the fix in the message.


def root_only_health(req: Req) -> httpx.Response | None:
    """vLLM's routes as they are: `/health` at the server's root, the API under `/v1`."""
    if req.path == "/v1/completions":
        return httpx.Response(200, content=answer([5], [-0.3], ["x"], "stop"))
    return lora_handler({})(req)


async def test_a_url_ending_in_v1_is_read_as_the_servers_root(replicas: Replicas) -> None:
    engine = await replicas(root_only_health, (A,), suffix="/v1")
    await engine.start()
    assert [r.healthy for r in engine.pool.replicas] == [True]
    assert not engine.pool.replicas[0].url.endswith("/v1")
    assert (await collect(engine, request()))[-1].completion_token_ids == [5]


def serving(root: str) -> Handler:
    def handler(req: Req) -> httpx.Response | None:
        if req.path == "/v1/models":
            card = {"id": "base", "root": root, "parent": None, "max_model_len": 2048}
            return httpx.Response(200, json={"object": "list", "data": [card]})
        return lora_handler({})(req)

    return handler


@pytest.mark.parametrize(
    "root",
    [
        "/data/models/smollm2-135m-instruct-fp32",  # the folder rlproxy reads
        "/mnt/other/smollm2-135m-instruct-fp32",  # the same folder mounted elsewhere
        "HuggingFaceTB/SmolLM2-135M-Instruct",  # the hub id RLPROXY_BASE_MODEL names
    ],
)
async def test_a_replica_serving_the_base_model_under_its_names_starts(
    replicas: Replicas, root: str
) -> None:
    names = ("HuggingFaceTB/SmolLM2-135M-Instruct", "/data/models/smollm2-135m-instruct-fp32")
    engine = await replicas(serving(root), (A,), base_models=names)
    await engine.start()
    assert engine.pool.healthy() and engine.served_root == root
    assert engine.health().detail["served_root"] == root


async def test_a_replica_serving_another_model_is_refused_at_start(replicas: Replicas) -> None:
    names = ("/data/models/smollm2-135m-instruct-fp32",)
    engine = await replicas(serving("Qwen/Qwen2.5-7B-Instruct"), (A,), base_models=names)
    with pytest.raises(ReplicaMisconfigured) as refused:
        await engine.start()
    message = str(refused.value)
    assert "'Qwen/Qwen2.5-7B-Instruct'" in message and names[0] in message
    assert "Fix: start vLLM with --model" in message and "RLPROXY_BASE_MODEL" in message


async def test_a_replica_without_runtime_lora_loading_is_refused_at_start(
    replicas: Replicas,
) -> None:
    def handler(req: Req) -> httpx.Response | None:
        if "lora_adapter" in req.path:  # no such route: FastAPI's bare 404
            return httpx.Response(404, json={"detail": "Not Found"})
        return health_ok(req)

    engine = await replicas(handler, (A, B))
    with pytest.raises(ReplicaMisconfigured) as refused:
        await engine.start()
    message = str(refused.value)
    assert "--enable-lora" in message and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in message
    assert message.count("127.0.0.1") == 2  # both replicas, each with the fix


async def test_a_replica_that_comes_up_set_up_wrong_never_joins(replicas: Replicas) -> None:
    """Started beside rlproxy, it was not up at start: it stays out, saying why."""
    up = {"ok": False}
    wrong = serving("Qwen/Qwen2.5-7B-Instruct")

    def handler(req: Req) -> httpx.Response | None:
        if not up["ok"]:
            raise HangUp
        return wrong(req)

    engine = await replicas(handler, (A,), base_models=("/data/smollm2-135m-instruct-fp32",))
    await engine.start()  # nothing up yet: starts, 503 until a replica joins
    up["ok"] = True
    await engine.pool.check_all()
    (replica,) = engine.pool.replicas
    assert not replica.healthy and "Fix:" in (replica.misconfigured or "")
    assert replica.describe()["misconfigured"] == replica.misconfigured
    await engine.stop()


async def test_a_version_is_never_answered_by_the_base_in_its_name(replicas: Replicas) -> None:
    """A replica that took the adapter but answers a request for it with its base (the name did
    not resolve there): the answer is refused and the replica leaves the rotation (it gets every
    adapter again before it rejoins); with none left, a 503. Never a base answer stored as v1."""
    base = lora_handler({})

    def handler(req: Req) -> httpx.Response | None:
        if req.path == "/v1/completions":
            return httpx.Response(200, content=answer([5], [-0.3], ["x"], "stop"))  # "m"
        return base(req)

    engine = await started(await replicas(handler, (A, B)))
    await engine.load_adapter("v1", "/x/0001")
    with pytest.raises(EngineUnavailableError) as none_left:
        await collect(engine, GenerationRequest(PROMPT, SamplingParams(max_tokens=1), adapter="v1"))
    assert not none_left.value.mid_answer
    assert [r.healthy for r in engine.pool.replicas] == [False, False]
    assert all("did not resolve" in (r.last_error or "") for r in engine.pool.replicas)


# ----------------------------------------------------------------------------- the stand-in


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({}, None),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"use_dora": True}, "DoRA"),
        ({"bias": "lora_only"}, "bias"),
        ({"r": 32}, "max_lora_rank 16"),
    ],
)
def test_the_stand_in_refuses_what_vllms_lora_loader_refuses(
    change: dict[str, Any], refusal: str | None
) -> None:
    from tests.fakes.vllm_server import FakeVLLM

    fake = FakeVLLM.__new__(FakeVLLM)
    fake.max_lora_rank = 16
    # What PEFT writes for the trainer's LoraConfig (trainer/peft_backend.py, r=8, bias none).
    config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "bias": "none"}
    config["modules_to_save"] = None
    config["use_dora"] = False
    result = fake._peft_refusal({**config, **change})
    assert result is None if refusal is None else refusal in (result or "")


# ----------------------------------------------------------------------------- the chat service


def echo_handler(gate: asyncio.Event | None = None) -> Handler:
    """Answers every completion with two tokens for the prompt it was sent; with `gate`, the
    first token waits until the gate opens (vLLM still queueing the request)."""

    async def body(prompt: list[int], n: int) -> AsyncIterator[bytes]:
        if gate is not None:
            await gate.wait()
        for i in range(n):
            yield sse(chunk(i, [5], [-0.3], "x", prompt_token_ids=prompt), done=False)
        yield sse(*(chunk(i, [6], [-0.2], "y", "length") for i in range(n)))

    def handler(req: Req) -> httpx.Response | None:
        if req.path == "/v1/completions":
            sent = json.loads(req.content)
            return httpx.Response(200, content=body(sent["prompt"], sent["n"]))
        return health_ok(req)

    return handler


def chat_request(**extra: Any) -> Any:
    from proxy.chat.record import CallInfo
    from proxy.protocols.chat import ChatCompletionRequest

    body = {"model": "rlproxy", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    return CallInfo(ChatCompletionRequest.model_validate({**body, **extra}), "req")


async def test_calls_it_served_are_stored_as_the_vllm_engines(
    replicas: Replicas, chat_tokenizer: Any
) -> None:
    from proxy.adapters.registry import ServedModels
    from proxy.chat.service import ChatService

    records: list[Any] = []

    async def record(call: Any) -> None:
        records.append(call)

    engine = await started(await replicas(echo_handler(), (A,)))
    chat = ChatService(engine, ServedModels("rlproxy"), chat_tokenizer, record=record)
    await chat.complete(await chat.prepare(chat_request()))
    async for _ in chat.stream(await chat.prepare(chat_request(stream=True))):
        pass
    assert [(r.engine, r.status) for r in records] == [("vllm", "completed")] * 2
    assert records[0].choices[0].completion_token_ids == [5, 6]


async def test_a_budget_past_vllms_context_is_fitted_before_it_is_sent(
    replicas: Replicas, chat_tokenizer: Any
) -> None:
    """The budget rule (`proxy.chat.budget`) runs before the engine: vLLM, which refuses
    `prompt + max_tokens > max_model_len`, is sent what its context (2048 here) leaves."""
    from proxy.adapters.registry import ServedModels
    from proxy.chat.service import ChatService

    sent: list[dict[str, Any]] = []
    echo = echo_handler()

    def handler(req: Req) -> httpx.Response | None:
        if req.path == "/v1/completions":
            sent.append(json.loads(req.content))
        return echo(req)

    records: list[Any] = []

    async def record(call: Any) -> None:
        records.append(call)

    engine = await started(await replicas(handler, (A,)))
    assert engine.max_context == 2048
    chat = ChatService(engine, ServedModels("rlproxy"), chat_tokenizer, record=record)
    prep = await chat.prepare(chat_request(max_tokens=32_000))
    await chat.complete(prep)
    left = 2048 - len(prep.prompt_ids)
    assert sent[0]["max_tokens"] == left
    assert records[0].params["output_budget"] == {"requested": 32_000, "used": left}


async def test_admission_counts_rows_vllm_has_not_started(
    replicas: Replicas, chat_tokenizer: Any
) -> None:
    """RLPROXY_MAX_QUEUED_ROWS bounds the rows sent to vLLM that have no token yet (waiting in
    its queue), as it bounds the local engine's queue; rows generating do not count."""
    from proxy.adapters.registry import ServedModels
    from proxy.chat.service import ChatService
    from proxy.errors import OverloadedError

    gate = asyncio.Event()
    engine = await started(await replicas(echo_handler(gate)))
    chat = ChatService(engine, ServedModels("rlproxy"), chat_tokenizer, max_queued_rows=3)
    first = asyncio.create_task(chat.complete(await chat.prepare(chat_request(n=2))))
    second = asyncio.create_task(chat.complete(await chat.prepare(chat_request())))
    for _ in range(100):
        await asyncio.sleep(0.01)
        if engine.queued_rows() == 3:
            break
    assert engine.queued_rows() == 3  # sent, across both replicas, and not started
    assert chat._admissions.rows == 0
    with pytest.raises(OverloadedError):
        await chat.prepare(chat_request())
    gate.set()
    bodies = await asyncio.gather(first, second)
    assert [len(b["choices"]) for b in bodies] == [2, 1]
    assert engine.queued_rows() == 0 and engine.health().detail["queued_rows"] == 0
    await chat.complete(await chat.prepare(chat_request(n=3)))
