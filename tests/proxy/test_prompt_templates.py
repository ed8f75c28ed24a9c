"""Prompts through other families' chat templates (Qwen2.5-style, Llama 3.1-style), the family
each template selects, and the override setting."""

from __future__ import annotations

import json

import pytest

from proxy.chat.prompt import ChatFormatError, ChatTemplate, NoChatTemplateError
from proxy.chat.tool_formats import UnsupportedTemplateError
from tests.tiny_models import tiny_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


HISTORY = [
    {
        "role": "developer",
        "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}],
    },
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [_call("call_1", "get_weather", '{"city":"Paris"}')],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18C"}]},
]


@pytest.fixture(scope="module")
def embedded_dir(model_data_dir):
    from proxy.engines.loader import ensure_fp32_cache

    return ensure_fp32_cache(model_data_dir)


@pytest.fixture(scope="module")
def qwen(embedded_dir) -> ChatTemplate:
    return ChatTemplate.for_tokenizer(tiny_tokenizer(embedded_dir, "qwen2"))


@pytest.fixture(scope="module")
def llama(embedded_dir) -> ChatTemplate:
    return ChatTemplate.for_tokenizer(tiny_tokenizer(embedded_dir, "llama3"))


def test_a_qwen_style_template_gets_tools_and_calls_itself(qwen: ChatTemplate) -> None:
    assert qwen.tool_format.name == "hermes"
    assert qwen.renders_tools and qwen.renders_calls
    prompt = qwen.render(HISTORY, [WEATHER])
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe\nbrief.\n\n# Tools")  # developer is system
    assert json.loads(system.split("<tools>\n")[1].split("\n</tools>")[0]) == WEATHER
    # The call's arguments are handed over as an object and written by the template's tojson.
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in prompt
    # What the family's parser reads back from the template's own call is the call.
    turn = prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls = qwen.tool_format.parse_complete(turn)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]


def test_a_qwen_style_template_keeps_its_own_default_system_prompt(qwen: ChatTemplate) -> None:
    assert (
        qwen.default_system
        == "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    )
    prompt = qwen.render([{"role": "user", "content": "hi"}], [WEATHER])
    assert prompt.startswith("<|im_start|>system\n" + qwen.default_system + "\n\n# Tools")


def test_a_llama_style_template_selects_llama3_json(llama: ChatTemplate) -> None:
    assert llama.tool_format.name == "llama3_json"
    assert llama.renders_tools and llama.renders_calls
    prompt = llama.render(HISTORY, [WEATHER])
    assert prompt.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")
    assert "Be\nbrief.<|eot_id|>" in prompt
    user = prompt.split("<|start_header_id|>user<|end_header_id|>\n\n")[1].split("<|eot_id|>")[0]
    assert '"name": "get_weather"' in user and user.endswith("Weather in Paris?")
    call = prompt.split("<|start_header_id|>assistant<|end_header_id|>\n\n")[1].split("<|eom_id|>")[
        0
    ]
    assert call == '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
    _, calls = llama.tool_format.parse_complete(call)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    assert prompt.endswith(
        "<|start_header_id|>ipython<|end_header_id|>\n\n18C<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_a_template_that_refuses_the_messages_is_a_format_error(llama: ChatTemplate) -> None:
    two_calls = {
        "role": "assistant",
        "content": None,
        "tool_calls": [_call("a", "get_weather", "{}"), _call("b", "get_weather", "{}")],
    }
    with pytest.raises(ChatFormatError, match="single tool-calls"):
        llama.render([{"role": "user", "content": "x"}, two_calls], [WEATHER])


def test_the_setting_overrides_the_family_of_a_toolless_template(tokenizer) -> None:
    template = ChatTemplate.for_tokenizer(tokenizer, "llama3_json")
    messages = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [_call("a", "get_weather", '{"city": "A"}'), _call("b", "f", "")],
        },
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
    ]
    prompt = template.render(messages, [WEATHER])
    system = prompt.split("<|im_end|>")[0]
    assert '{"name": <function-name>, "parameters": <args-json-object>}' in system
    assert json.loads(system.splitlines()[-1]) == WEATHER
    assert (
        '<|im_start|>assistant\n{"name": "get_weather", "parameters": {"city": "A"}}; '
        '{"name": "f", "parameters": {}}<|im_end|>\n<|im_start|>tool\nsunny<|im_end|>\n'
    ) in prompt


def test_mistral_markup_is_refused_unless_a_family_is_set(tokenizer) -> None:
    class Mistralish:
        chat_template = (
            "{% for m in messages %}[INST]{{ m.content }}[/INST][TOOL_CALLS]{% endfor %}"
        )

    with pytest.raises(UnsupportedTemplateError, match="RLPROXY_TOOL_FORMAT"):
        ChatTemplate.for_tokenizer(Mistralish())


def test_a_tokenizer_without_a_template_is_refused() -> None:
    class Bare:
        chat_template = None

    with pytest.raises(NoChatTemplateError, match="chat template"):
        ChatTemplate.for_tokenizer(Bare())


REASONING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SENT_BACK = [
    {"role": "user", "content": "Say hello."},
    {"role": "assistant", "content": "hello", "reasoning_content": "One word."},
    {"role": "user", "content": "Again."},
]


def test_reasoning_sent_back_reaches_only_a_template_with_a_place_for_it(
    embedded_dir, tokenizer
) -> None:
    """A thinking block's or reasoning item's text, kept as the turn's `reasoning_content`: a
    template that reads it (Qwen3's) renders it; SmolLM2's has no place for it and
    renders the prompt it would without it."""
    smol = ChatTemplate.for_tokenizer(tokenizer)
    assert smol.reasoning_key is None
    plain = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in SENT_BACK]
    assert smol.render(SENT_BACK, None) == smol.render(plain, None)
    assert "One word." not in smol.render(SENT_BACK, None)

    reasoning = tiny_tokenizer(embedded_dir, "qwen2")
    reasoning.chat_template = REASONING_TEMPLATE
    thinks = ChatTemplate.for_tokenizer(reasoning)
    assert thinks.reasoning_key == "reasoning_content"
    assert "<|im_start|>assistant\n<think>One word.</think>hello<|im_end|>" in thinks.render(
        SENT_BACK, None
    )
