"""What Claude Code sends on the Messages API, translated without HTTP: a `role: "system"`
message inside `messages`, its own model names, and the words its context refusals come in."""

from __future__ import annotations

import pytest

from proxy.adapters.registry import Resolved, ServedModels
from proxy.chat.budget import BudgetRule, prompt_too_long
from proxy.errors import ContextLengthError, ModelNotFoundError
from proxy.protocols import messages
from proxy.protocols.messages import CountTokensRequest, MessagesRequest

ENVIRONMENT = [{"type": "text", "text": "Working directory: /tmp", "cache_control": {"type": "x"}}]


def test_a_system_message_inside_messages_stays_a_system_message_at_its_place() -> None:
    req = MessagesRequest.model_validate(
        {
            "model": "claude-opus-5-5",
            "max_tokens": 32_000,
            "system": [{"type": "text", "text": "You are Claude Code."}],
            "messages": [
                {"role": "system", "content": ENVIRONMENT},
                {"role": "user", "content": "Reply with the word hello."},
                {"role": "assistant", "content": "hello"},
                {"role": "system", "content": "The date is 2026-12-05."},
                {"role": "user", "content": "Again."},
            ],
        }
    )
    chat = messages.to_chat(req)
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "You are Claude Code."),
        ("system", "Working directory: /tmp"),
        ("user", "Reply with the word hello."),
        ("assistant", "hello"),
        ("system", "The date is 2026-12-05."),
        ("user", "Again."),
    ]
    counted = messages.to_chat(CountTokensRequest.model_validate(req.model_dump()))
    assert counted.messages == chat.messages and counted.max_tokens is None


def test_a_system_message_takes_text_blocks_only() -> None:
    req = MessagesRequest.model_validate(
        {
            "model": "rlproxy",
            "max_tokens": 4,
            "messages": [{"role": "system", "content": [{"type": "image"}]}],
        }
    )
    with pytest.raises(Exception, match="only text blocks"):
        messages.to_chat(req)


def test_claude_names_mean_the_policy_on_the_messages_api_only() -> None:
    registry = ServedModels("rlproxy", patterns={"messages": ("claude-*",)})
    registry.add_version(3)
    registry.activate(3)
    for name in ("claude-opus-5-5", "claude-sonnet-5", "claude-haiku-4-5-20251001"):
        resolved = registry.resolve(name, protocol="messages")
        assert resolved == Resolved(name, 3, follows_policy=True)
        with pytest.raises(ModelNotFoundError):
            registry.resolve(name)  # Chat Completions (and Responses) keep OpenAI's 404
    for name in ("nope", "gpt-5", "Claude-opus", "xclaude-opus"):
        with pytest.raises(ModelNotFoundError):
            registry.resolve(name, protocol="messages")
    assert "claude-opus-5-5" not in registry.model_ids()


def test_a_canary_splits_claude_named_traffic_like_the_policys() -> None:
    registry = ServedModels("rlproxy", patterns={"messages": ("claude-*",)})
    for v in (1, 2):
        registry.add_version(v)
    registry.activate(1)
    registry.start_canary(2, 0.5)
    resolved = registry.resolve("claude-opus-5-5", protocol="messages")
    versions = {registry.route(resolved, f"t:{i}").version for i in range(200)}
    assert versions == {1, 2}


def test_the_context_refusal_in_anthropics_words() -> None:
    with pytest.raises(ContextLengthError) as caught:
        BudgetRule().fit(12_505, 32_000, 8192)
    error = messages.context_error(caught.value)
    assert error.status_code == 400
    assert error.message.startswith("prompt is too long: 12505 tokens > 8191 maximum")
    assert "8192 tokens" in error.message and "RLPROXY_BASE_MODEL" in error.message
    at_least = messages.context_error(prompt_too_long(9000, 8192, at_least=True))
    assert at_least.message.startswith("prompt is too long: more than 9000 tokens")
    with pytest.raises(ContextLengthError) as caught:
        BudgetRule(mode="strict").fit(1000, 32_000, 8192)
    strict = messages.context_error(caught.value)
    assert strict.message.startswith(
        "input length and `max_tokens` exceed context limit: 1000 + 32000 > 8192"
    )


def test_an_answer_cut_by_the_context_says_so_in_its_stop_reason() -> None:
    assert messages.stop_reason("length", None, False) == "max_tokens"
    assert messages.stop_reason("length", None, False, True) == "model_context_window_exceeded"
    assert messages.stop_reason("stop", None, False, True) == "end_turn"
    assert messages.stop_reason("length", None, True, True) == "tool_use"
