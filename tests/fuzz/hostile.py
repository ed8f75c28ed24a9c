"""A corpus of hostile requests against rlproxy's HTTP surface, and how to send one.

What it is: data. Each `Hostile` is one request a careless or malicious client could send: odd
numbers, odd text, odd shapes and odd sizes, on the chat route and on the /rl routes. The rule
the tests hold every entry to is the same: never a 5xx (a client's own bad input is a 4xx or is
served), and no harm to the requests decoding beside it. Where a limit is still being added a 200
is fine; the status is not pinned unless the entry says so (`expect`).

What it is not: a test. `tests/fuzz/test_hostile_corpus.py` sends every entry, alone and all at
once beside innocent requests; `tests/e2e/test_hostile_neighbours.py` sends the quick ones (`QUICK`)
in the default suite; `bench/soak.py` keeps a few of its own.

An entry whose path holds `{completion}` is sent with the id of a completion that exists.
`known_5xx` marks an entry that still gets a 5xx, with the reason: its own test is a strict
xfail, so that it flips (and asks for the mark to go) when the bug is fixed.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
E400 = frozenset({400})
HI = [{"role": "user", "content": "Hi"}]
LIMIT_BYTES = 8 * 2**20  # the server's default RLPROXY_MAX_BODY_BYTES


@dataclass(frozen=True)
class Hostile:
    """One hostile request. `body` is sent as JSON (NaN allowed), `raw` as bytes as they are."""

    name: str
    body: Any = None
    raw: bytes | None = None
    method: str = "POST"
    path: str = CHAT
    headers: dict[str, str | bytes] = field(default_factory=dict)
    chunked: bool = False  # send `raw` without a content-length, in 1 MiB chunks
    heavy: bool = False  # seconds of CPU or megabytes on the wire: not in the default suite
    expect: frozenset[int] | None = None  # the status, where the server already pins it
    known_5xx: str | None = None

    def content(self) -> bytes | None:
        if self.raw is not None:
            return self.raw
        if self.body is None:
            return None
        return json.dumps(self.body, allow_nan=True).encode()


def send(base_url: str, entry: Hostile, completion_id: str = "") -> httpx.Response:
    """Send `entry` (its `{completion}` filled in) and read the whole response, streams too.

    Each on a connection of its own: after a 500 the server closes the connection it answered
    on, and a request that had been queued on it would fail with a reset instead."""
    path = entry.path.replace("{completion}", completion_id)
    content: bytes | Iterator[bytes] | None = entry.content()
    if entry.chunked and isinstance(content, bytes):
        data = content
        content = (data[i : i + 2**20] for i in range(0, len(data), 2**20))
    headers = {"content-type": "application/json", **entry.headers}
    with httpx.Client(base_url=base_url, timeout=300) as client:
        request = client.build_request(entry.method, path, content=content, headers=headers)
        response = client.send(request, stream=True)
        try:
            response.read()
        finally:
            response.close()
    return response


def _chat(**fields: Any) -> dict[str, Any]:
    # max_tokens 4: a body the server serves answers at once.
    return {"model": "rlproxy", "messages": HI, "max_tokens": 4, **fields}


def _raw_chat(extra: str = "", messages: str = '[{"role": "user", "content": "Hi"}]') -> bytes:
    return f'{{"model": "rlproxy", "max_tokens": 4, "messages": {messages}{extra}}}'.encode()


def _responses(**fields: Any) -> dict[str, Any]:
    return {"model": "rlproxy", "input": "Hi", "max_output_tokens": 4, **fields}


def _messages(**fields: Any) -> dict[str, Any]:
    return {"model": "rlproxy", "messages": HI, "max_tokens": 4, **fields}


def _tool(name: str, parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _nested(depth: int, open_: str = '{"a": ', close: str = "}") -> str:
    return open_ * depth + "1" + close * depth


SELF_REFERENCE = {"type": "object", "properties": {"me": {"$ref": "#"}}}
ENDLESS = {**SELF_REFERENCE, "required": ["me"]}  # no finite value is valid
ARGS = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
OVER_LIMIT = b'{"model": "rlproxy", "messages": [{"role": "user", "content": "'
OVER_LIMIT += b"x" * (LIMIT_BYTES + 2**20) + b'"}]}'


def _reward(name: str, raw: bytes, known_5xx: str | None = None) -> Hostile:
    return Hostile(name, raw=raw, path="/rl/trajectories/{completion}/reward", known_5xx=known_5xx)


def _get(name: str, path: str, expect: frozenset[int] | None = None) -> Hostile:
    return Hostile(name, method="GET", path=path, expect=expect)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


CORPUS: list[Hostile] = [
    # --- numbers where they do not belong ------------------------------------------------
    Hostile("temperature 1e-45", _chat(temperature=1e-45)),
    Hostile("temperature and top_p 5e-324", _chat(temperature=5e-324, top_p=5e-324)),
    # top_p below float32's range: it cut every token (found by schemathesis, fixed in sampling)
    Hostile("top_p 5e-324", _chat(top_p=5e-324)),
    Hostile("seed 2**64", _chat(seed=2**64), expect=frozenset({400})),
    Hostile("seed -(2**63)-1", _chat(seed=-(2**63) - 1), expect=frozenset({400})),
    Hostile("seed of 5000 digits", raw=_raw_chat(', "seed": 1' + "0" * 5000)),
    Hostile("max_tokens a string", _chat(max_tokens="5")),
    Hostile("max_tokens a float", _chat(max_tokens=5.0)),
    Hostile("max_tokens -1", _chat(max_tokens=-1), expect=frozenset({400})),
    # A budget past the context is cut to what the context leaves (proxy/chat/budget.py), however
    # large: served, never a 5xx.
    Hostile("max_tokens 10**30", _chat(max_tokens=10**30), expect=frozenset({200})),
    Hostile("max_completion_tokens 2**63", _chat(max_completion_tokens=2**63)),
    Hostile("n 0", _chat(n=0), expect=frozenset({400})),
    Hostile("n 1000", _chat(n=1000), expect=frozenset({400})),
    Hostile("n a string", _chat(n="2")),
    Hostile("temperature NaN", _chat(temperature=float("nan"))),
    Hostile("temperature Infinity", _chat(temperature=float("inf"))),
    Hostile("top_p NaN", _chat(top_p=float("nan"))),
    Hostile("penalties NaN", _chat(presence_penalty=float("nan"), frequency_penalty=-2)),
    Hostile("top_logprobs 20 with n 8", _chat(n=8, logprobs=True, top_logprobs=20)),
    Hostile("top_logprobs 2**40", _chat(logprobs=True, top_logprobs=2**40)),
    Hostile("logit_bias odd keys", _chat(logit_bias={str(10**30): 100, "-1": -1e308, "x": 1})),
    Hostile("x-stainless-retry-count -1", _chat(), headers={"x-stainless-retry-count": "-1"}),
    Hostile("x-stainless-retry-count 1e23", _chat(), headers={"x-stainless-retry-count": "1e23"}),
    Hostile(
        "x-stainless-retry-count 5000 digits",
        _chat(),
        headers={"x-stainless-retry-count": "9" * 5000},
    ),
    # --- text that is not text ------------------------------------------------------------
    Hostile(
        "lone surrogate in content",
        raw=_raw_chat(messages='[{"role": "user", "content": "a\\ud800b"}]'),
        expect=frozenset({400}),
    ),
    Hostile(
        "lone surrogate in a content part",
        raw=_raw_chat(
            messages='[{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]'
        ),
    ),
    Hostile("lone surrogate in user", raw=_raw_chat(', "user": "\\ud800"')),
    Hostile(
        "lone surrogate in metadata",
        raw=_raw_chat(', "metadata": {"k": "\\ud800"}'),
    ),
    Hostile(
        "lone surrogate as trajectory id",
        raw=_raw_chat(', "rlproxy": {"trajectory_id": "a\\ud800"}'),
    ),
    Hostile("lone surrogate in stop", raw=_raw_chat(', "stop": ["\\ud800"]')),
    Hostile(
        "lone surrogate in a message name",
        raw=_raw_chat(messages='[{"role": "user", "content": "Hi", "name": "\\ud800"}]'),
    ),
    Hostile(
        "lone surrogate streamed",
        raw=_raw_chat(', "stream": true, "user": "\\ud800"'),
    ),
    Hostile(
        "NUL in content and model",
        _chat(model="rlproxy\x00", messages=[{"role": "user", "content": "a\x00b"}]),
    ),
    Hostile(
        "invalid UTF-8 bytes",
        raw=_raw_chat(messages='[{"role": "user", "content": "X"}]').replace(b"X", b"\xff\xfe\xc3"),
    ),
    Hostile("model rlproxy@²", _chat(model="rlproxy@\u00b2"), expect=frozenset({404})),
    Hostile(
        "model rlproxy@ + 5000 digits",
        _chat(model="rlproxy@" + "9" * 5000),
        expect=frozenset({404}),
    ),
    Hostile("model empty", _chat(model=""), expect=frozenset({404})),
    Hostile(
        "trajectory header of odd bytes",
        _chat(),
        headers={"x-rlproxy-trajectory": b"\xff\xfe" + b"t" * 8000},
    ),
    Hostile(
        "trajectory id not a string",
        _chat(metadata={"trajectory_id": {"a": [1]}}, rlproxy={"group_id": [1, 2]}),
    ),
    # --- bodies that are not JSON, or too much of it ---------------------------------------
    Hostile("malformed JSON", raw=b'{"model": "rlproxy", "messages": [', expect=frozenset({400})),
    Hostile("empty body", raw=b"", expect=frozenset({400})),
    Hostile("JSON array body", raw=b"[1, 2]", expect=frozenset({400})),
    Hostile("NaN at the top", raw=b"NaN", expect=frozenset({400})),
    Hostile(
        "10k nested objects",
        raw=_raw_chat(', "metadata": ' + _nested(10_000)),
        expect=frozenset({400}),
    ),
    Hostile(
        "10k nested arrays",
        raw=_raw_chat(', "junk": ' + _nested(10_000, "[", "]")),
        expect=frozenset({400}),
    ),
    Hostile(
        "900 nested objects in metadata",
        raw=_raw_chat(', "metadata": ' + _nested(900)),
    ),
    Hostile(
        "900 nested objects in a content part",
        raw=_raw_chat(
            messages='[{"role": "user", "content": [{"type": "text", "text": "Hi", "x": '
            + _nested(900)
            + "}]}]"
        ),
    ),
    Hostile(
        "900 nested arrays in an unknown field",
        raw=_raw_chat(', "junk": ' + _nested(900, "[", "]")),
    ),
    Hostile(
        "900 nested objects as tool parameters",
        raw=_raw_chat(
            ', "tools": [{"type": "function", "function": {"name": "f", "parameters": '
            + _nested(900)
            + "}}]"
        ),
        expect=frozenset({400}),
    ),
    Hostile(
        "900 nested objects as a response schema",
        raw=_raw_chat(
            ', "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": '
            + _nested(900)
            + "}}"
        ),
        expect=frozenset({400}),
    ),
    Hostile("body over the limit", raw=OVER_LIMIT, heavy=True, expect=frozenset({413})),
    Hostile(
        "body over the limit, chunked",
        raw=OVER_LIMIT,
        chunked=True,
        heavy=True,
        expect=frozenset({413}),
    ),
    Hostile("5 MB junk field", _chat(junk="j" * 5_000_000), heavy=True),
    Hostile(
        "5 MB message",
        _chat(messages=[{"role": "user", "content": "hello world " * 400_000}]),
        heavy=True,
        expect=frozenset({400}),
    ),
    # --- shapes --------------------------------------------------------------------------------
    Hostile("empty messages", _chat(messages=[]), expect=frozenset({400})),
    Hostile("messages not a list", _chat(messages="Hi"), expect=frozenset({400})),
    Hostile(
        "unknown role",
        _chat(messages=[{"role": "wizard", "content": "Hi"}]),
        expect=frozenset({400}),
    ),
    Hostile("role missing", _chat(messages=[{"content": "Hi"}]), expect=frozenset({400})),
    Hostile(
        "tool message without an id",
        _chat(messages=[*HI, {"role": "tool", "content": "5"}]),
        expect=frozenset({400}),
    ),
    Hostile(
        "tool answers to calls that never were",
        _chat(messages=[*HI, {"role": "tool", "tool_call_id": "nope", "content": "5"}]),
    ),
    Hostile(
        "assistant repeats one call id three times",
        _chat(
            messages=[
                *HI,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{"}}
                    ]
                    * 3,
                },
                {"role": "tool", "tool_call_id": "a", "content": "x"},
            ]
        ),
    ),
    Hostile(
        "content parts of no type", _chat(messages=[{"role": "user", "content": [{}, {"text": 5}]}])
    ),
    Hostile(
        "10k messages", _chat(messages=[{"role": "user", "content": "a"}] * 10_000), heavy=True
    ),
    Hostile("100 stop strings", _chat(stop=[f"s{i}" for i in range(100)])),
    Hostile("empty stop strings", _chat(stop=["", ""])),
    Hostile("stop a number", _chat(stop=5), expect=frozenset({400})),
    Hostile(
        "500 tools",
        _chat(tools=[_tool(f"t{i}", ARGS) for i in range(500)], tool_choice="required"),
        heavy=True,
    ),
    Hostile(
        "two tools of one name",
        _chat(tools=[_tool("f", ARGS), _tool("f", ARGS)], tool_choice="required"),
        expect=frozenset({400}),
    ),
    Hostile(
        "tool_choice names no tool",
        _chat(tools=[_tool("f", ARGS)], tool_choice={"type": "function", "function": {}}),
        expect=frozenset({400}),
    ),
    Hostile("tool_choice without tools", _chat(tool_choice="required"), expect=frozenset({400})),
    Hostile(
        "tool parameters a list",
        _chat(tools=[_tool("f", [1, 2])], tool_choice="required"),
        expect=frozenset({400}),
    ),
    Hostile(
        "self-referential tool schema, required",
        _chat(max_tokens=12, tools=[_tool("f", SELF_REFERENCE)], tool_choice="required"),
    ),
    Hostile(
        "self-referential tool schema, streamed",
        _chat(
            max_tokens=12, stream=True, tools=[_tool("f", SELF_REFERENCE)], tool_choice="required"
        ),
    ),
    Hostile(
        "endless tool schema, required",
        _chat(tools=[_tool("f", ENDLESS)], tool_choice="required"),
    ),
    Hostile(
        "endless response schema",
        _chat(
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": ENDLESS}}
        ),
    ),
    Hostile(
        "endless response schema, streamed",
        _chat(
            stream=True,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": ENDLESS},
            },
        ),
        # A stream's status is sent before the first token: the failure is an error event.
    ),
    Hostile(
        "regex too big to run",
        _chat(
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "string", "pattern": "^(a{1000}){1000}$"},
                },
            }
        ),
    ),
    Hostile(
        "schema with a remote $ref",
        _chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"$ref": "http://127.0.0.1:9/x.json"}},
            }
        ),
        expect=frozenset({400}),
    ),
    Hostile(
        "schema minLength 10**18",
        _chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "minLength": 10**18}},
            }
        ),
    ),
    Hostile("response_format xml", _chat(response_format={"type": "xml"}), expect=frozenset({400})),
    Hostile(
        "stream_options without stream",
        _chat(stream_options={"include_usage": True}),
        expect=frozenset({400}),
    ),
    Hostile("user an object", _chat(user={"a": 1}), expect=frozenset({400})),
    # --- the /rl routes --------------------------------------------------------------------------
    _get(
        "trajectories: cursor of huge numbers",
        "/rl/trajectories?cursor=" + _b64(b"[" + b"9" * 300 + b', "x"]'),
    ),
    _get(
        "trajectories: cursor 1e308",
        "/rl/trajectories?cursor=" + _b64(b'[1e308, "' + b"f" * 32 + b'"]'),
    ),
    _get(
        "trajectories: cursor 1e999",
        "/rl/trajectories?cursor=" + _b64(b'[1e999, "x"]'),
        expect=frozenset({400}),
    ),
    _get(
        "trajectories: cursor 5000 digits",
        "/rl/trajectories?cursor=" + "9" * 5000,
        expect=frozenset({400}),
    ),
    _get("trajectories: limit 10**30", f"/rl/trajectories?limit={10**30}", expect=frozenset({400})),
    _get("trajectories: since 1e309, until NaN", "/rl/trajectories?since=1e309&until=nan"),
    _get("trajectories: filters of odd bytes", "/rl/trajectories?model=%ED%A0%80&group_key=%FF%FE"),
    _get(
        "trajectories: id of 10k characters",
        "/rl/trajectories/" + "x" * 10_000,
        expect=frozenset({404}),
    ),
    _get(
        "trajectories: completion id of 5000 digits",
        "/rl/trajectories/chatcmpl-" + "9" * 5000,
        expect=frozenset({404}),
    ),
    _get(
        "groups: cursor of huge numbers",
        "/rl/groups?cursor=" + _b64(b"[" + b"9" * 300 + b", " + b"9" * 300 + b"]"),
    ),
    _get("groups: cursor -1e308", "/rl/groups?cursor=" + _b64(b'[-1e308, "x"]')),
    _get(
        "groups: cursor nested 5000 deep",
        "/rl/groups?cursor=" + _b64(b"[" * 5000 + b"]" * 5000),
        expect=frozenset({400}),
    ),
    _get("groups: id of odd bytes", "/rl/groups/%FF%FE", expect=frozenset({404})),
    _get("models: odd bytes", "/v1/models/%FF%FE", expect=frozenset({404})),
    _reward("reward 1e308", b'{"reward": 1e308}'),
    _reward("reward NaN", b'{"reward": NaN}'),
    _reward("reward -Infinity", b'{"reward": -Infinity}'),
    _reward("reward 1e999", b'{"reward": 1e999}'),
    _reward("reward of 400 digits", b'{"reward": ' + b"9" * 400 + b"}"),
    _reward("reward of 5000 digits", b'{"reward": ' + b"9" * 5000 + b"}"),
    _reward("reward a word", b'{"reward": "high"}'),
    _reward("reward a list", b'{"reward": [1]}'),
    _reward("reward an operator", b'{"reward": {"$gt": 0}}'),
    _reward("reward true", b'{"reward": true}'),
    _reward("reward of an empty source", b'{"reward": 0.5, "source": ""}'),
    _reward(
        "reward explained with a lone surrogate",
        b'{"reward": 0.5, "explanation": "\\ud800"}',
    ),
    _reward("reward from a lone surrogate", b'{"reward": 0.5, "source": "\\udfff"}'),
    Hostile(
        "reward of an unknown trajectory",
        raw=b'{"reward": 1}',
        path="/rl/trajectories/" + "x" * 5000 + "/reward",
        expect=frozenset({404}),
    ),
    Hostile(
        "end of an unknown trajectory",
        raw=b"",
        path="/rl/trajectories/nope/end",
        expect=frozenset({404}),
    ),
    Hostile(
        "score an unknown group",
        raw=b"",
        path="/rl/groups/" + "9" * 5000 + "/score",
        expect=frozenset({404}),
    ),
    Hostile("load adapter 10**30", raw=b"", path=f"/rl/adapters/{10**30}/load"),
    Hostile("activate adapter -1", raw=b"", path="/rl/adapters/-1/activate"),
    Hostile(
        "unload adapter of 5000 digits", raw=b"", path="/rl/adapters/" + "9" * 5000 + "/unload"
    ),
    # --- the Responses API ---------------------------------------------------------------
    Hostile("responses: input null", _responses(input=None), path=RESPONSES, expect=E400),
    Hostile("responses: input a number", _responses(input=5), path=RESPONSES, expect=E400),
    Hostile("responses: empty input list", _responses(input=[]), path=RESPONSES, expect=E400),
    Hostile("responses: an item a string", _responses(input=["hi"]), path=RESPONSES, expect=E400),
    Hostile(
        "responses: content parts of numbers",
        _responses(input=[{"role": "user", "content": [1, 2]}]),
        path=RESPONSES,
        expect=E400,
    ),
    Hostile(
        "responses: function_call_output of an object",
        _responses(input=[{"type": "function_call_output", "call_id": "c", "output": {"a": 1}}]),
        path=RESPONSES,
        expect=E400,
    ),
    Hostile(
        "responses: 5000 function calls",
        _responses(
            input=[
                {"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"}
                for i in range(5000)
            ]
        ),
        path=RESPONSES,
    ),
    Hostile(
        "responses: previous_response_id of 5000 chars",
        _responses(previous_response_id="resp_" + "x" * 5000),
        path=RESPONSES,
        expect=frozenset({404}),
    ),
    Hostile(
        "responses: previous_response_id a chat id",
        _responses(previous_response_id="chatcmpl-req_0"),
        path=RESPONSES,
        expect=frozenset({404}),
    ),
    Hostile(
        "responses: text.format bogus",
        _responses(text={"format": {"type": "x"}}),
        path=RESPONSES,
        expect=E400,
    ),
    Hostile(
        "responses: json_schema endless",
        _responses(text={"format": {"type": "json_schema", "name": "e", "schema": ENDLESS}}),
        path=RESPONSES,
    ),
    Hostile("responses: tools not a list", _responses(tools={"a": 1}), path=RESPONSES, expect=E400),
    Hostile(
        "responses: tool_choice bogus",
        _responses(tool_choice={"type": "x"}),
        path=RESPONSES,
        expect=E400,
    ),
    Hostile(  # cut to what the context leaves, as on Chat Completions
        "responses: max_output_tokens 10**30",
        _responses(max_output_tokens=10**30),
        path=RESPONSES,
        expect=frozenset({200}),
    ),
    Hostile("responses: temperature NaN", _responses(temperature=float("nan")), path=RESPONSES),
    Hostile(
        "responses: top_logprobs 2**40", _responses(top_logprobs=2**40), path=RESPONSES, expect=E400
    ),
    Hostile("responses: streamed", _responses(stream=True), path=RESPONSES),
    _get("responses: GET a 5000-char id", "/v1/responses/resp_" + "x" * 5000, frozenset({404})),
    _get("responses: input_items limit 0", "/v1/responses/resp_x/input_items?limit=0", E400),
    Hostile(
        "responses: DELETE unknown",
        method="DELETE",
        path="/v1/responses/resp_nope",
        expect=frozenset({404}),
    ),
    # --- Anthropic Messages ---------------------------------------------------------------
    Hostile(
        "messages: no max_tokens", {"model": "rlproxy", "messages": HI}, path=MESSAGES, expect=E400
    ),
    Hostile(  # cut to what the context leaves, as on Chat Completions
        "messages: max_tokens 10**30",
        _messages(max_tokens=10**30),
        path=MESSAGES,
        expect=frozenset({200}),
    ),
    Hostile(
        "messages: role system",  # accepted: Claude Code sends system messages inside messages
        _messages(messages=[{"role": "system", "content": "x"}]),
        path=MESSAGES,
        expect=frozenset({200}),
    ),
    Hostile(
        "messages: block without type",
        _messages(messages=[{"role": "user", "content": [{"text": "x"}]}]),
        path=MESSAGES,
        expect=E400,
    ),
    Hostile(
        "messages: tool_use in a user turn",
        _messages(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                }
            ]
        ),
        path=MESSAGES,
        expect=E400,
    ),
    Hostile(
        "messages: tool_result of an object",
        _messages(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t", "content": {"a": 1}}],
                }
            ]
        ),
        path=MESSAGES,
        expect=E400,
    ),
    Hostile(
        "messages: tool_use input a string",
        _messages(
            messages=[
                {"role": "user", "content": "x"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "zz"}],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}],
                },
            ]
        ),
        path=MESSAGES,
    ),
    Hostile(
        "messages: tool without schema",
        _messages(tools=[{"name": "f"}]),
        path=MESSAGES,
        expect=E400,
    ),
    Hostile(
        "messages: tool_choice tool without name",
        _messages(tools=[{"name": "f", "input_schema": ARGS}], tool_choice={"type": "tool"}),
        path=MESSAGES,
        expect=E400,
    ),
    Hostile("messages: system of numbers", _messages(system=[1, 2]), path=MESSAGES, expect=E400),
    Hostile("messages: top_k 0", _messages(top_k=0), path=MESSAGES, expect=E400),
    Hostile("messages: top_k 2**40", _messages(top_k=2**40), path=MESSAGES),
    Hostile(
        "messages: stop_sequences 50",
        _messages(stop_sequences=["a"] * 50),
        path=MESSAGES,
        expect=E400,
    ),
    Hostile(
        "messages: image of bad base64",
        _messages(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "!!"},
                        }
                    ],
                }
            ]
        ),
        path=MESSAGES,
    ),
    Hostile("messages: streamed", _messages(stream=True), path=MESSAGES),
    Hostile(
        "messages: bad x-api-key",
        _messages(),
        path=MESSAGES,
        headers={"x-api-key": "rlp-" + "z" * 5000},
    ),
    Hostile(
        "messages: count_tokens without messages",
        {"model": "rlproxy"},
        path=MESSAGES + "/count_tokens",
        expect=E400,
    ),
]

# The default suite's share, seconds in all: what is refused before the model (a pinned 4xx),
# and the served entries about sampling numbers and retry headers.
SERVED_QUICKLY = {
    "temperature 1e-45",
    "top_p 5e-324",
    "x-stainless-retry-count -1",
    "x-stainless-retry-count 1e23",
}
QUICK = [
    h
    for h in CORPUS
    if not h.heavy
    and not h.known_5xx
    and (h.name in SERVED_QUICKLY or (h.expect is not None and min(h.expect) >= 400))
]

# Innocent requests sent beside the corpus: greedy, short, each its own prompt.
INNOCENT_PROMPTS = [
    "Name a colour.",
    "Say hello to Ada.",
    "What is 2 + 2?",
    "Count from one to five.",
    "Name a fruit.",
    "Give me a word that rhymes with cat.",
]
