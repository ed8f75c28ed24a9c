"""How calls become `CallRecord`s (`proxy.chat.record`, the one builder for every engine):
explicit ids, key ids, retry counts, the upstream service's records.

Pure functions only (no server, no database): the end-to-end tests check the stored rows.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from proxy.chat.record import CallInfo, RequestDump, call_record, explicit_id, retry_count
from proxy.chat.upstream import NO_TOKEN_IDS, StreamAccumulator
from proxy.engines.upstream import UpstreamEngine, to_api_error
from proxy.errors import ServerError
from proxy.protocols.chat import ChatCompletionRequest
from proxy.settings import Settings, UpstreamTarget
from storage.api_keys import client_ref


def test_explicit_id_header_wins_then_metadata_then_body() -> None:
    headers = {"x-rlproxy-trajectory": "from-header", "x-rlproxy-group": "g-header"}
    meta = {"trajectory_id": "from-meta", "group_id": "g-meta"}
    body = {"trajectory_id": "from-body"}
    assert explicit_id(headers, meta, body, "trajectory") == "from-header"
    assert explicit_id({}, meta, body, "trajectory") == "from-meta"
    assert explicit_id({}, None, body, "trajectory") == "from-body"
    assert explicit_id({}, None, None, "trajectory") is None
    assert explicit_id(headers, meta, None, "group") == "g-header"
    assert explicit_id({}, meta, None, "group") == "g-meta"


def test_client_ref_is_stable_salted_and_not_the_key() -> None:
    a = client_ref("salt-1", "sk-secret")
    assert a == client_ref("salt-1", "sk-secret")
    assert "sk-secret" not in a and a.startswith("client_") and len(a) == len("client_") + 32
    assert client_ref("salt-1", "sk-other") != a
    # Another installation names the same token differently: the name cannot be looked up in a
    # table of hashes of known keys.
    assert client_ref("salt-2", "sk-secret") != a


def _request(**kw: object) -> ChatCompletionRequest:
    body = {"model": "teacher", "messages": [{"role": "user", "content": "hi"}], **kw}
    return ChatCompletionRequest.model_validate(body)


def test_upstream_record_has_no_token_ids_and_says_so() -> None:
    req = _request(metadata={"trajectory_id": "t-1"}, temperature=0.2, stream=True)
    headers = {"Authorization": "Bearer sk-client", "X-Stainless-Retry-Count": "2"}
    rec = call_record(
        CallInfo(req, "req_1", headers, client_ref="client_abc", owner="k1"),
        engine="upstream",
        status="completed",
        token_ids_note=NO_TOKEN_IDS,
    )
    assert rec.engine == "upstream" and rec.token_ids_note == NO_TOKEN_IDS
    assert rec.prompt_token_ids is None
    assert rec.explicit_trajectory_id == "t-1" and rec.retry_count == 2
    assert rec.api_key_id == "client_abc" and rec.owner_key_id == "k1"
    assert rec.params["temperature"] == 0.2 and "messages" not in rec.params
    assert rec.stream and rec.request_id == "req_1"


def test_stream_accumulator_reassembles_text_and_tool_calls() -> None:
    acc = StreamAccumulator()

    def raw(delta: dict, finish: str | None = None, index: int = 0) -> dict:
        return {"choices": [{"index": index, "delta": delta, "finish_reason": finish}]}

    out, _ = acc.add(raw({"role": "assistant", "content": "", "tool_calls": None}))
    assert out[0]["delta"] == {"role": "assistant", "content": ""}
    acc.add(raw({"content": "Let me check."}))
    head = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f"}}
    out, _ = acc.add(raw({"tool_calls": [head]}))
    assert out[0]["delta"]["tool_calls"][0]["id"] == "call_1"
    part = {"index": 0, "id": None, "type": "function", "function": {"arguments": '{"a":'}}
    out, _ = acc.add(raw({"tool_calls": [part]}))
    assert "id" not in out[0]["delta"]["tool_calls"][0]
    acc.add(raw({"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]}))
    acc.add(raw({}, "tool_calls"))
    _, usage = acc.add({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}})
    assert usage == {"prompt_tokens": 3, "completion_tokens": 4}
    [choice] = acc.choices()
    assert choice.finish_reason == "tool_calls"
    assert choice.completion_token_ids is None
    assert choice.message["content"] == "Let me check."
    assert choice.message["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    ]


@pytest.mark.parametrize(
    ("header", "count"), [("-1", 0), ("-99", 0), ("abc", 0), ("", 0), ("0", 0), ("3", 3)]
)
def test_a_bad_retry_header_is_no_retry(header: str, count: int) -> None:
    """The store refuses negative retry counts; a client's header must never reach it as one.
    (`call_record` is the one builder both chat services use; the e2e test in
    tests/e2e/test_trajectories.py sends the header to a real server.)"""
    call = CallInfo(_request(), "req_1", {"X-Stainless-Retry-Count": header})
    assert call_record(call, engine="local", status="completed").retry_count == count
    assert retry_count(header) == count


def _status_error(cls: type[openai.APIStatusError], status: int, body: dict) -> Exception:
    request = httpx.Request("POST", "http://provider/v1/chat/completions")
    response = httpx.Response(status, request=request, json={"error": body})
    return cls("provider said no", response=response, body=body)


def test_provider_errors_keep_4xx_and_map_failures_to_5xx() -> None:
    bad = {"message": "bad messages", "type": "invalid_request_error", "param": "messages"}
    err = to_api_error(_status_error(openai.BadRequestError, 400, {**bad, "code": "x"}))
    assert (err.status_code, err.message, err.param, err.code) == (
        400,
        "bad messages",
        "messages",
        "x",
    )
    limited = to_api_error(_status_error(openai.RateLimitError, 429, {"message": "slow down"}))
    assert limited.status_code == 429 and limited.type == "rate_limit_error"
    request = httpx.Request("POST", "http://provider/v1/chat/completions")
    down = to_api_error(openai.APIConnectionError(request=request))
    assert down.status_code == 502 and down.code == "upstream_unreachable"
    slow = to_api_error(openai.APITimeoutError(request=request))
    assert slow.status_code == 504 and slow.type == "server_error"
    busy = to_api_error(_status_error(openai.InternalServerError, 503, {"message": "busy"}))
    assert busy.status_code == 503
    broken = to_api_error(_status_error(openai.InternalServerError, 500, {"message": "oops"}))
    assert broken.status_code == 502 and broken.type == "server_error"


def test_missing_server_key_is_a_server_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_SUCH_KEY_FOR_TEST", raising=False)
    engine = UpstreamEngine(
        {"teacher": UpstreamTarget(model="openai/x", api_key_env="NO_SUCH_KEY_FOR_TEST")}
    )
    with pytest.raises(ServerError, match="NO_SUCH_KEY_FOR_TEST"):
        engine._kwargs(_request())


def test_upstream_kwargs_forward_openai_fields_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_PROVIDER_KEY", "sk-server")
    target = UpstreamTarget(
        model="openai/x", api_base="http://p/v1", api_key_env="TEST_PROVIDER_KEY"
    )
    engine = UpstreamEngine({"teacher": target})
    kw = engine._kwargs(
        _request(temperature=0.1, metadata={"trajectory_id": "t"}, rlproxy={}, some_new_field=1)
    )
    assert kw["model"] == "openai/x" and kw["api_base"] == "http://p/v1"
    assert kw["api_key"] == "sk-server" and kw["temperature"] == 0.1
    assert not {"metadata", "rlproxy", "some_new_field", "stream"} & set(kw)


def test_settings_refuse_upstream_names_that_clash() -> None:
    with pytest.raises(ValueError, match="alias"):
        Settings(upstream_models={"gpt-4o-mini": {"model": "openai/gpt-4o-mini"}})
    with pytest.raises(ValueError, match="policy"):
        Settings(upstream_models={"rlproxy@3": {"model": "openai/x"}})
    ok = Settings(upstream_models={"openai/gpt-4o-mini": {"model": "openai/gpt-4o-mini"}})
    assert ok.upstream_models["openai/gpt-4o-mini"].model == "openai/gpt-4o-mini"


def test_unknown_top_level_fields_are_not_stored() -> None:
    req = _request(temperature=0.3, api_key="sk-in-the-body", junk="x" * 100_000)
    params = call_record(CallInfo(req, "req_1"), engine="local", status="completed").params
    assert params == {"temperature": 0.3}


def test_the_request_dumped_once_stores_what_each_part_dumped_alone_gives() -> None:
    """`RequestDump` is one `model_dump` of the whole request; the stored messages, tools and
    params are what dumping each part on its own gives (aliases such as `response_format`'s
    `schema` by their wire name, nulls left out, unknown top-level fields not stored)."""
    tool = {
        "type": "function",
        "function": {"name": "f", "description": None, "parameters": {"type": "object"}},
        "x-extra": 1,
    }
    req = _request(
        messages=[
            {"role": "system", "content": "s", "name": None},
            {"role": "user", "content": [{"type": "text", "text": "hi"}], "x-part": {"a": [1]}},
        ],
        tools=[tool],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "n", "schema": {"type": "object"}, "strict": None},
        },
        temperature=0.5,
        metadata={"trajectory_id": "t"},
        junk={"deep": [1]},
    )
    dumped = RequestDump.of(req)
    assert dumped.messages == [m.model_dump(exclude_none=True) for m in req.messages]
    assert dumped.tools == [t.model_dump(exclude_none=True) for t in req.tools or []]
    assert dumped.params == req.model_dump(
        exclude_none=True, by_alias=True, exclude={"messages", "tools", "model", "junk"}
    )
    assert dumped.params["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert "junk" in dumped.fields and "junk" not in dumped.params
    record = call_record(CallInfo(req, "req_1"), engine="local", status="completed")
    assert record.request_messages == dumped.messages and record.tools == dumped.tools
    assert record.params == dumped.params
    assert RequestDump.of(_request(tools=[])).tools is None  # no tools, as before
