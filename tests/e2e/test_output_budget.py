"""Output budgets that fit, on the three protocols, with their own SDKs against a real rlproxy.

Coding agents ask for budgets far past a small model's context (Claude Code 32,000, OpenCode
32,000, pi 16,384 tokens on an 8,192-token model): each is cut to what the context leaves after
the prompt instead of refused, the answer says so (`X-RLProxy-Output-Budget`, Anthropic's
`model_context_window_exceeded`), and the stored call keeps the budget asked for and the one
used. A prompt that alone fills the context is each protocol's 400, and `count_tokens` counts it.

A prompt that leaves exactly `LEFT` tokens makes the cut visible in a few tokens (its 8k-token
prefill is the cost: the three protocols ask it at once, so it is prefilled once); the budgets
of the other tests end early by a grammar (an enum), so nothing here generates long.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import openai
import pytest
from openai import OpenAI

from proxy.settings import EMBEDDED_CONTEXT
from tests.e2e.conftest import Server
from tests.e2e.helpers import db_rows

CONTEXT = EMBEDDED_CONTEXT  # 8,192: what `rlproxy status` says without loading the model
FIX = (  # the one line every refusal ends with on the embedded model
    "serve a base model with a longer context, e.g. RLPROXY_BASE_MODEL=Qwen/Qwen2.5-0.5B-Instruct "
    "rlproxy serve (32,768 tokens; RLPROXY_BASE_MODEL: a Hugging Face id or a local model folder)"
)
LEFT = 3
HEADER = "x-rlproxy-output-budget"
ENUM = {  # an answer the grammar ends after a few tokens, whatever the budget
    "type": "object",
    "properties": {"word": {"type": "string", "enum": ["hello"]}},
    "required": ["word"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def claude(server: Server):
    with anthropic.Anthropic(base_url=server.url, api_key="sk-test", max_retries=0) as c:
        yield c


def stored_params(server: Server, completion_id: str) -> dict[str, Any]:
    [row] = db_rows(
        server.data_dir, "SELECT params FROM calls WHERE completion_id = ?", (completion_id,)
    )
    return json.loads(row["params"])


@pytest.fixture(scope="module")
def near_full(claude: anthropic.Anthropic) -> list[dict[str, str]]:
    """One user message whose prompt leaves exactly LEFT tokens of the context (counted by
    `count_tokens`, which renders as the three protocols do for a lone user message)."""
    words = 8000
    for _ in range(4):
        messages = [{"role": "user", "content": "word " * words}]
        tokens = claude.messages.count_tokens(model="rlproxy", messages=messages).input_tokens
        if tokens == CONTEXT - LEFT:
            return messages
        words += CONTEXT - LEFT - tokens
    raise AssertionError(f"no prompt of {CONTEXT - LEFT} tokens found")


@pytest.fixture(scope="module")
def cut(
    client: OpenAI,
    claude: anthropic.Anthropic,
    near_full: list[dict[str, str]],
    pool: ThreadPoolExecutor,
) -> dict[str, Any]:
    """The near-full prompt asked on the three protocols at once, each with a coding agent's
    budget: one engine batch, and the prompt (the same on the three) is prefilled once."""

    def chat() -> Any:
        return client.chat.completions.with_raw_response.create(
            model="rlproxy",
            messages=near_full,  # type: ignore[arg-type]
            max_tokens=32_000,
            temperature=0,
        )

    def message() -> Any:
        return claude.messages.with_raw_response.create(
            model="rlproxy",
            max_tokens=32_000,
            messages=near_full,  # type: ignore[arg-type]
            extra_body={"temperature": 0},
            timeout=600,  # given, the SDK does not ask a 32,000-token budget to stream
        )

    def response() -> Any:
        with client.responses.with_streaming_response.create(
            model="rlproxy",
            input=near_full[0]["content"],
            max_output_tokens=16_384,
            temperature=0,
            stream=True,
        ) as raw:
            return raw.headers, list(raw.parse())

    futures = {name: pool.submit(f) for name, f in [("chat", chat), ("messages", message)]}
    futures["responses"] = pool.submit(response)
    return {name: future.result() for name, future in futures.items()}


def test_chat_max_tokens_past_the_context_is_cut_to_what_it_leaves(
    cut: dict[str, Any], server: Server
) -> None:
    raw = cut["chat"]
    reply = raw.parse()
    assert raw.headers[HEADER] == f"used={LEFT}; requested=32000"
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == LEFT
    params = stored_params(server, reply.id)
    assert params["max_tokens"] == 32_000
    assert params["output_budget"] == {"requested": 32_000, "used": LEFT}


def test_messages_max_tokens_past_the_context_ends_at_the_context_window(
    cut: dict[str, Any], server: Server
) -> None:
    raw = cut["messages"]
    message = raw.parse()
    assert raw.headers[HEADER] == f"used={LEFT}; requested=32000"
    assert message.stop_reason == "model_context_window_exceeded"
    assert message.usage.output_tokens == LEFT
    assert stored_params(server, message.id)["output_budget"] == {"requested": 32_000, "used": LEFT}


def test_responses_stream_past_the_context_is_incomplete_and_says_its_budget(
    cut: dict[str, Any], server: Server
) -> None:
    headers, events = cut["responses"]
    assert headers[HEADER] == f"used={LEFT}; requested=16384"
    [done] = [e for e in events if e.type == "response.incomplete"]
    assert done.response.max_output_tokens == 16_384  # echoed as asked, as OpenAI does
    assert done.response.usage is not None and done.response.usage.output_tokens == LEFT
    assert stored_params(server, done.response.id)["output_budget"]["used"] == LEFT


def test_no_budget_on_the_embedded_model_is_its_documented_default(
    client: OpenAI, server: Server
) -> None:
    raw = client.responses.with_raw_response.create(
        model="rlproxy",
        input="Say hello.",
        text={"format": {"type": "json_schema", "name": "word", "schema": ENUM}},
    )
    response = raw.parse()
    assert raw.headers[HEADER] == "used=512; requested=none"  # RLPROXY_DEFAULT_MAX_TOKENS
    assert response.max_output_tokens is None
    assert stored_params(server, response.id)["output_budget"] == {"requested": None, "used": 512}


def test_a_budget_that_fits_is_used_as_asked(client: OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="rlproxy", messages=[{"role": "user", "content": "Hi!"}], max_completion_tokens=2
    )
    assert raw.headers[HEADER] == "used=2; requested=2"


# ----------------------------------------------------------------------------- too long


LONG = [{"role": "user", "content": "word " * 9000}]


def test_count_tokens_counts_a_prompt_longer_than_the_context(
    claude: anthropic.Anthropic,
) -> None:
    assert claude.messages.count_tokens(model="rlproxy", messages=LONG).input_tokens > CONTEXT


def test_a_prompt_past_the_context_is_anthropics_prompt_is_too_long(
    claude: anthropic.Anthropic,
) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(
            model="claude-opus-5-5",
            max_tokens=32_000,
            messages=LONG,  # type: ignore[arg-type]
            timeout=300,
        )
    message = caught.value.body["error"]["message"]  # type: ignore[index]
    assert message.startswith("prompt is too long: ")
    assert f"> {CONTEXT - 1} maximum" in message
    assert message.endswith(f"; shorten the conversation, or {FIX}")


@pytest.mark.parametrize("route", ["chat/completions", "responses"])
def test_a_prompt_past_the_context_is_openais_context_length_exceeded(
    server: Server, route: str
) -> None:
    body: dict[str, Any] = {"model": "rlproxy", "max_tokens": 16}
    if route == "responses":
        body = {"model": "rlproxy", "input": LONG[0]["content"], "max_output_tokens": 16}
    else:
        body["messages"] = LONG
    r = httpx.post(f"{server.base_url}/{route}", json=body, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert f"maximum context length is {CONTEXT} tokens" in error["message"]
    assert error["message"].endswith(f"Please reduce the length of the messages, or {FIX}.")
    assert error["type"] == "invalid_request_error" and error["param"] == "messages"


def test_the_openai_sdk_raises_its_own_error(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="rlproxy", messages=LONG)  # type: ignore[arg-type]
    assert caught.value.code == "context_length_exceeded"
