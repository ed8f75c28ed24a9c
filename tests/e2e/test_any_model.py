"""Any base model: tiny models of two other families, built from configs in the test (random
weights, the embedded tokenizer, a Qwen2.5-style or Llama 3.1-style chat template; nothing is
downloaded), served through RLPROXY_BASE_MODEL by a real `rlproxy serve` on loopback and called
with the openai SDK: tools, `n`, logprobs, JSON output and streaming, on the wire.

Random weights write garbage, so every assertion about content is on grammar-forced output
(tool_choice required or named, json_schema) with schemas that end in a few tokens (enums,
booleans, one-digit integers). The Llama 3.1-style server runs by default, the Qwen2.5-style one
under `make test-slow` (each server start costs most of this module's time).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from openai import OpenAI

from tests.e2e.conftest import Server
from tests.e2e.helpers import db_rows, own_server, stored_prompts
from tests.tiny_models import build_tiny_model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}}},
    },
}
TOOLS = [WEATHER, TIME]
ANSWER = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["ok", "n"],
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# What each family's template writes into the prompt, so the stored prompt says which one ran.
MARKERS = {
    "qwen2": "You are Qwen, created by Alibaba Cloud.",
    "llama3": "<|start_header_id|>user<|end_header_id|>",
}


# Llama 3.1 (the family unlike the embedded model's) runs in the default suite; the Qwen2.5-style
# server, a second `rlproxy serve` start, runs with `make test-slow`.
@pytest.fixture(scope="module", params=["llama3", pytest.param("qwen2", marks=pytest.mark.slow)])
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def tiny_server(
    family: str, tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path
) -> Iterator[Server]:
    from proxy.engines.loader import ensure_fp32_cache

    root = tmp_path_factory.mktemp(f"tiny-{family}")
    folder = build_tiny_model(root / "model", ensure_fp32_cache(model_data_dir), family)  # type: ignore[arg-type]
    env = {"RLPROXY_BASE_MODEL": str(folder), "RLPROXY_MAX_BATCH_SIZE": "8"}
    with own_server(root / "data", root / "cache", env) as server:
        yield server


@pytest.fixture(scope="module")
def client(tiny_server: Server) -> Iterator[OpenAI]:
    with OpenAI(base_url=tiny_server.base_url, api_key="sk-test", max_retries=0, timeout=120) as c:
        yield c


def _args(call) -> dict:
    return json.loads(call.function.arguments)


def test_the_served_name_stays_and_the_prompt_is_the_models_own(
    client: OpenAI, tiny_server: Server, family: str
) -> None:
    assert "rlproxy" in {m.id for m in client.models.list().data}
    done = client.chat.completions.create(
        model="rlproxy", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60
    )
    data_dir = tiny_server.data_dir
    rows = db_rows(data_dir, "SELECT id FROM calls WHERE id = ?", (done.id,)) or db_rows(
        data_dir, "SELECT id FROM calls ORDER BY recorded_at DESC LIMIT 1"
    )
    prompt_ids = stored_prompts(data_dir, [rows[0]["id"]])[rows[0]["id"]].token_ids
    assert prompt_ids is not None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_server.data_dir.parent / "model"))
    prompt = tokenizer.decode(prompt_ids)
    assert MARKERS[family] in prompt
    assert '"get_weather"' in prompt  # the tools went through the template
    assert done.usage is not None and done.usage.prompt_tokens == len(prompt_ids)


def test_a_named_tool_is_called_with_valid_arguments(client: OpenAI) -> None:
    done = client.chat.completions.create(
        model="rlproxy",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
    )
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(_args(call), WEATHER["function"]["parameters"])


def test_required_calls_stream_as_openai_deltas(client: OpenAI) -> None:
    stream = client.chat.completions.create(
        model="rlproxy",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        stream=True,
        stream_options={"include_usage": True},
    )
    calls: dict[int, dict] = {}
    finish, usage = None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": "", "id": None})
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls"
    (call,) = calls.values()
    assert call["id"].startswith("call_")
    name = call["name"]
    assert name in ("get_weather", "get_time")
    params = WEATHER if name == "get_weather" else TIME
    jsonschema.validate(json.loads(call["arguments"]), params["function"]["parameters"])
    assert usage is not None and usage.completion_tokens > 0


def test_n_choices_with_logprobs_follow_the_json_schema(client: OpenAI) -> None:
    done = client.chat.completions.create(
        model="rlproxy",
        messages=[{"role": "user", "content": "Answer as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}},
        n=2,
        logprobs=True,
        top_logprobs=2,
        max_tokens=60,
    )
    assert len(done.choices) == 2
    tokens = 0
    for choice in done.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), ANSWER)
        entries = choice.logprobs.content if choice.logprobs else None
        assert entries and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
        assert "".join(e.token for e in entries).startswith("{")
        tokens += len(entries)
    assert done.usage is not None
    # Every sampled token has its logprob entry (the stop token included).
    assert tokens == done.usage.completion_tokens


def test_json_output_streams(client: OpenAI) -> None:
    stream = client.chat.completions.create(
        model="rlproxy",
        messages=[{"role": "user", "content": "Answer as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}},
        max_tokens=60,
        stream=True,
    )
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), ANSWER)


def test_a_tool_history_with_ids_and_parts_is_accepted(client: OpenAI) -> None:
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18C"}]},
    ]
    done = client.chat.completions.create(
        model="rlproxy",
        messages=messages,  # type: ignore[arg-type]
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=60,
    )
    (call,) = done.choices[0].message.tool_calls or []
    assert call.function.name == "get_time"
    jsonschema.validate(_args(call), TIME["function"]["parameters"])
