"""Prompt rendering with the embedded model's own template (SmolLM2's ChatML, which knows no
tools): identical to the tokenizer's template for plain chats; tools, calls and results in the
Hermes family's prompt, exactly as rlproxy wrote it by hand before templates."""

from __future__ import annotations

import json

import pytest

from proxy.chat.prompt import ChatFormatError, ChatTemplate, UnsupportedContentError
from proxy.chat.tool_formats import HERMES

DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def render(tokenizer):
    return ChatTemplate.for_tokenizer(tokenizer).render


def test_the_embedded_template_is_read_as_toolless_hermes(tokenizer) -> None:
    template = ChatTemplate.for_tokenizer(tokenizer)
    assert template.tool_format.name == "hermes"
    assert not template.renders_tools and not template.renders_calls
    assert template.default_system == DEFAULT_SYSTEM_PROMPT


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

PLAIN_CHATS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi!"}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?\nThink."},
    ],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Arr."},
        {"role": "system", "content": "Now be polite."},
        {"role": "user", "content": "Bye"},
    ],
    [{"role": "user", "content": ""}],
]


@pytest.mark.parametrize("messages", PLAIN_CHATS)
def test_plain_chat_equals_tokenizer_template(render, tokenizer, messages) -> None:
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert render(messages, None) == expected
    assert render(messages, []) == expected


def test_developer_is_system_and_text_parts_are_joined(render, tokenizer) -> None:
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Rule one."}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    plain = [{"role": "system", "content": "Rule one."}, {"role": "user", "content": "a\nb"}]
    expected = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    assert render(messages, None) == expected


def test_non_text_parts_are_rejected_with_a_value_error(render) -> None:
    messages = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}],
        }
    ]
    with pytest.raises(UnsupportedContentError, match="image_url") as info:
        render(messages, None)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "messages",
    [[], [{"role": "wizard", "content": "x"}], [{"role": "user", "content": 5}]],
)
def test_bad_messages_raise(render, messages) -> None:
    with pytest.raises(ChatFormatError):
        render(messages, None)


def test_tools_block_goes_into_the_default_system_prompt(render) -> None:
    prompt = render([{"role": "user", "content": "Weather in Paris?"}], [WEATHER])
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n" + DEFAULT_SYSTEM_PROMPT + "\n\n# Tools")
    block = system.split("<tools>\n")[1].split("\n</tools>")[0]
    assert json.loads(block) == WEATHER
    assert '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>' in (
        system
    )
    assert prompt.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_tools_block_follows_a_given_system_prompt(render) -> None:
    prompt = render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}], [WEATHER]
    )
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert DEFAULT_SYSTEM_PROMPT not in prompt


def test_tool_without_parameters_shows_an_empty_object_schema(render) -> None:
    tool = {"type": "function", "function": {"name": "now"}}
    prompt = render([{"role": "user", "content": "x"}], [tool])
    assert '{"type": "function", "function": {"name": "now", "parameters": {"type": "object", ' in (
        prompt
    )


def test_assistant_tool_calls_and_results_round_trip(render) -> None:
    args = '{"city": "Paris"}'
    messages = [
        {"role": "user", "content": "Weather in Paris and the time?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": args},
                },
                {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": ""}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C, cloudy"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "9:00"}]},
    ]
    prompt = render(messages, [WEATHER])
    assistant = prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert assistant == (
        "Checking.\n"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    )
    # What the parser reads back from that turn is what the client sent.
    content, calls = HERMES.parse_complete(assistant)
    assert content == "Checking."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", args),
        ("now", "{}"),
    ]
    assert (
        '<|im_start|>tool\n<tool_response id="call_1" name="get_weather">\n18C, cloudy\n'
        "</tool_response><|im_end|>\n"
        '<|im_start|>tool\n<tool_response id="call_2" name="now">\n9:00\n'
        "</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in prompt


def test_assistant_with_only_tool_calls_has_no_leading_newline(render) -> None:
    messages = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "unknown", "content": "r"},
    ]
    prompt = render(messages, None)
    assert (
        '<|im_start|>assistant\n<tool_call>{"name": "f", "arguments": {}}</tool_call><|im_end|>'
        in (prompt)
    )
    # An id that no assistant turn made: the name is left out, the id kept.
    assert '<tool_response id="unknown">\nr\n</tool_response>' in prompt
