"""What clients send beside the prompt, translated without HTTP: the reasoning an earlier turn
showed is kept as its `reasoning_content`, and each protocol's `ignored_fields` names exactly the
fields that have no effect here (`X-RLProxy-Ignored-Fields`), by path, never by value."""

from __future__ import annotations

from typing import Any

from proxy.chat.record import CallInfo
from proxy.chat.upstream import for_provider
from proxy.protocols import messages, responses
from proxy.protocols.chat import MAX_NAMED, ChatCompletionRequest, ignored_fields
from proxy.protocols.messages import MessagesRequest
from proxy.protocols.responses import ResponsesRequest

HELLO = [{"role": "user", "content": "Say hello."}]
THINKING = {"type": "thinking", "thinking": "One word.", "signature": "EqQBsig"}


def chat(**body: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "rlproxy", "messages": HELLO, **body})


def anthropic(**body: Any) -> MessagesRequest:
    return MessagesRequest.model_validate(
        {"model": "claude-opus-5-5", "max_tokens": 4, "messages": HELLO, **body}
    )


def openai_responses(**body: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "rlproxy", "input": "Say hello.", **body})


# ----------------------------------------------------------------------------- Chat Completions


def test_chat_names_what_asks_for_something_it_does_not_do() -> None:
    assert ignored_fields(chat()) == ()
    honoured = chat(
        metadata={"trajectory_id": "t"},
        user="u",
        prompt_cache_key="k",
        store=True,
        service_tier="auto",
        modalities=["text"],
        reasoning_effort="none",
        stream_options=None,
    )
    assert ignored_fields(honoured) == ()
    assert ignored_fields(
        chat(store=False, service_tier="flex", reasoning_effort="high", logit_bias={"50": 1})
    ) == ("logit_bias", "reasoning_effort", "service_tier", "store")
    assert ignored_fields(chat(modalities=["text", "audio"], audio={"voice": "x"})) == (
        "audio",
        "modalities",
    )


def test_unknown_fields_are_named_never_their_values_nor_odd_names() -> None:
    req = chat(**{"safety_identifier": "sk-secret", "bad name\r\nX-Evil: 1": 1, "z" * 65: 1})
    assert ignored_fields(req) == ("safety_identifier",)
    many = chat(**{f"f{i:02d}": i for i in range(MAX_NAMED + 3)})
    named = ignored_fields(many)
    assert len(named) == MAX_NAMED + 1 and named[-1] == "+3 more"


# ----------------------------------------------------------------------------- Messages


def test_claude_codes_fields_are_named_but_cache_control_and_metadata() -> None:
    cached = {"type": "ephemeral"}
    req = anthropic(
        system=[{"type": "text", "text": "You are Claude Code.", "cache_control": cached}],
        tools=[
            {"name": "Bash", "input_schema": {"type": "object"}, "cache_control": cached},
            {"name": "Later", "input_schema": {"type": "object"}, "defer_loading": True},
        ],
        thinking={"type": "adaptive", "display": "omitted"},
        output_config={"effort": "medium"},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        metadata={"user_id": "{}"},
        service_tier="standard_only",
        cache_control=cached,
    )
    assert messages.ignored_fields(req) == (
        "context_management",
        "output_config.effort",
        "thinking",
        "tools.defer_loading",
    )
    assert messages.ignored_fields(anthropic(thinking={"type": "disabled"})) == ()


def test_a_thinking_block_is_kept_as_the_turns_reasoning_and_a_redacted_one_is_named() -> None:
    history = [
        *HELLO,
        {
            "role": "assistant",
            "content": [
                THINKING,
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "thinking", "thinking": "Then call a tool.", "signature": "s2"},
                {"type": "text", "text": "hello"},
                {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]},
    ]
    req = anthropic(messages=history)
    answer = messages.to_chat(req).messages[1]
    assert answer.reasoning_content == "One word.\n\nThen call a tool."
    assert answer.content == "hello" and answer.tool_calls
    assert messages.ignored_fields(req) == ("messages.content.redacted_thinking",)
    plain = messages.to_chat(anthropic(messages=[*HELLO, {"role": "assistant", "content": "hi"}]))
    assert plain.messages[1].reasoning_content is None


# ----------------------------------------------------------------------------- Responses


def test_codexs_fields_are_named_but_prompt_cache_key_store_and_logprobs() -> None:
    req = openai_responses(
        reasoning={"summary": "auto", "effort": None},
        include=["reasoning.encrypted_content", "message.output_text.logprobs"],
        prompt_cache_key="thread-1",
        store=False,
        client_metadata={"thread_id": "t"},
        truncation="disabled",
        service_tier="default",
        text={"verbosity": "medium"},
    )
    assert responses.ignored_fields(req) == (
        "client_metadata",
        "include[reasoning.encrypted_content]",
        "reasoning.summary",
    )
    core, _ = responses.to_chat(req)
    assert core.prompt_cache_key == "thread-1"
    others = openai_responses(truncation="auto", text={"verbosity": "low"}, reasoning={"x y": 1})
    assert responses.ignored_fields(others) == ("text.verbosity", "truncation")


def reasoning(summary: str, content: str | None = None) -> dict[str, Any]:
    item: dict[str, Any] = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [{"type": "summary_text", "text": summary}],
        "encrypted_content": "gAAAAB-opaque",
    }
    if content is not None:
        item["content"] = [{"type": "reasoning_text", "text": content}]
    return item


def test_a_reasoning_items_text_joins_the_answer_after_it() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "run", "arguments": "{}"}
    items = [
        {"role": "user", "content": "Go."},
        reasoning("Plan."),
        {"type": "message", "role": "assistant", "content": "Running."},
        reasoning("Summary.", content="The reasoning itself."),
        call,
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        reasoning("Then call again."),
        {**call, "call_id": "c2"},
    ]
    out = responses.input_messages(items)
    assert [m["role"] for m in out] == ["user", "assistant", "tool", "assistant"]
    assert out[1]["reasoning_content"] == "Plan.\n\nThe reasoning itself."
    assert [c["id"] for c in out[1]["tool_calls"]] == ["c1"]
    assert out[3]["reasoning_content"] == "Then call again."
    req = openai_responses(input=items)
    assert responses.ignored_fields(req) == ("input.reasoning.encrypted_content",)


def test_reasoning_no_answer_follows_is_dropped_and_named() -> None:
    items = [{"role": "user", "content": "Go."}, reasoning("Lost."), HELLO[0], reasoning("End.")]
    out = responses.input_messages(items)
    assert all("reasoning_content" not in m for m in out)
    assert responses.ignored_fields(openai_responses(input=items)) == (
        "input.reasoning",
        "input.reasoning.encrypted_content",
    )


# ----------------------------------------------------------------------------- upstream


def test_a_translated_calls_reasoning_is_stored_not_sent_upstream() -> None:
    history = [*HELLO, {"role": "assistant", "content": [THINKING, {"type": "text", "text": "hi"}]}]
    translated = messages.to_chat(anthropic(messages=[*history, HELLO[0]]))
    call = CallInfo(translated, "req_1", protocol="messages")
    sent = for_provider(call)
    assert sent.messages[1].reasoning_content is None and sent.messages[1].content == "hi"
    assert call.request.messages[1].reasoning_content == "One word."  # what is stored
    own = chat(messages=[*HELLO, {"role": "assistant", "content": "hi", "reasoning_content": "x"}])
    assert for_provider(CallInfo(own, "req_2")) is own  # a chat client's own: as sent
