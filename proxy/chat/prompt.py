"""Rendering OpenAI chat messages (and tools) into the prompt string the model completes.

The format is SmolLM2's ChatML, extended with Hermes-style tool calling. Without tools, and with
string contents and the roles system/user/assistant only, the result is exactly what the
tokenizer's own chat template gives (including its default system prompt when the first message
is not a system message). The format, in full:

    <|im_start|>system
    {system prompt: first system/developer message, else the default}{tools block}<|im_end|>
    <|im_start|>user
    {text}<|im_end|>
    <|im_start|>assistant
    {text}
    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>
    <tool_call>{"name": "get_time", "arguments": {}}</tool_call><|im_end|>
    <|im_start|>tool
    <tool_response id="call_abc" name="get_weather">
    {tool result text}
    </tool_response><|im_end|>
    <|im_start|>assistant
    (the model continues here)

- Default system prompt: "You are a helpful AI assistant named SmolLM, trained by Hugging Face".
- `developer` messages are rendered as `system`. A system message that is not the first message
  stays a system turn where it is.
- Tools block (only when tools are given): appended to the system prompt after a blank line:

      # Tools

      You may call one or more functions to assist with the user query.

      You are provided with function signatures within <tools></tools> XML tags:
      <tools>
      {"type": "function", "function": {"name": ..., "description": ..., "parameters": ...}}
      (one line per tool)
      </tools>

      For each function call, return a json object with function name and arguments within
      <tool_call></tool_call> XML tags, one call per line:
      <tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>

  (the last instruction is one line in the prompt).
- An assistant turn with tool calls: its text (if any), a newline, then one
  `<tool_call>{"name": N, "arguments": A}</tool_call>` per call, joined by newlines; `A` is the
  call's `arguments` string verbatim, so a history looks exactly like what the model produced.
- A tool result: its own `tool` turn, the content wrapped in `<tool_response>` with the call's id
  and the tool's name (looked up from the assistant turn that made the call), so the model sees
  which call it answers.
- Content may be a string or a list of `{"type": "text", "text": ...}` parts (joined with
  newlines); any other part type (images, audio, files) raises `UnsupportedContentError`.

`proxy.chat.tool_parser` parses the model's output in this format; `proxy.chat.grammar`
enforces it. This module only builds strings: it does not tokenize, and it does not escape
`<|im_start|>` or `<|im_end|>` inside message text (neither does the tokenizer's template).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

TOOLS_PREAMBLE = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
)
TOOLS_INSTRUCTION = (
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags, one call per line:\n"
    '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>'
)


class ChatFormatError(ValueError):
    """The messages or tools cannot be rendered (the server answers 400)."""


class UnsupportedContentError(ChatFormatError):
    """A content part of a type this text-only model cannot take (image, audio, file)."""


def render_prompt(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
) -> str:
    """The prompt for `messages` (and `tools`), ending with `<|im_start|>assistant\\n`."""
    if not messages:
        raise ChatFormatError("messages must contain at least one message")
    tool_block = render_tools_block(tools) if tools else ""
    call_names: dict[str, str] = {}  # tool_call_id -> tool name, from assistant turns
    parts: list[str] = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if i == 0 and role not in ("system", "developer"):
            parts.append(_turn("system", DEFAULT_SYSTEM_PROMPT + tool_block))
        if role in ("system", "developer"):
            text = _text(message, i)
            parts.append(_turn("system", text + tool_block if i == 0 else text))
        elif role == "user":
            parts.append(_turn("user", _text(message, i)))
        elif role == "assistant":
            parts.append(_turn("assistant", _assistant_text(message, i, call_names)))
        elif role in ("tool", "function"):
            parts.append(_turn("tool", _tool_result_text(message, i, call_names)))
        else:
            raise ChatFormatError(f"messages[{i}]: unknown role {role!r}")
    parts.append(f"{IM_START}assistant\n")
    return "".join(parts)


def render_tools_block(tools: Sequence[Mapping[str, Any]]) -> str:
    """The text appended to the system prompt when tools are offered (starts with a blank line)."""
    lines = [
        json.dumps(normalize_tool(tool, i), ensure_ascii=False) for i, tool in enumerate(tools)
    ]
    return (
        "\n\n"
        + TOOLS_PREAMBLE
        + "<tools>\n"
        + "\n".join(lines)
        + "\n</tools>\n\n"
        + TOOLS_INSTRUCTION
    )


def render_tool_call(name: str, arguments: str) -> str:
    """One call as the model writes it; `arguments` is the JSON text, inserted verbatim."""
    name_json = json.dumps(name, ensure_ascii=False)
    return f'<tool_call>{{"name": {name_json}, "arguments": {arguments}}}</tool_call>'


def normalize_tool(tool: Mapping[str, Any], index: int = 0) -> dict[str, Any]:
    """An OpenAI tool in the one shape the prompt shows: {"type": "function", "function": {...}}."""
    if tool.get("type", "function") != "function" or not isinstance(tool.get("function"), Mapping):
        raise ChatFormatError(f"tools[{index}]: only tools of type 'function' are supported")
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ChatFormatError(f"tools[{index}].function.name must be a non-empty string")
    out: dict[str, Any] = {"name": name}
    if fn.get("description"):
        out["description"] = fn["description"]
    out["parameters"] = tool_parameters(tool)
    return {"type": "function", "function": out}


def tool_parameters(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A tool's parameter schema; OpenAI reads a missing one as 'takes no arguments'."""
    params = tool["function"].get("parameters")
    if params is None:
        return {"type": "object", "properties": {}}
    if not isinstance(params, Mapping):
        raise ChatFormatError(
            f"tool {tool['function'].get('name')!r}: parameters must be an object"
        )
    return dict(params)


def _turn(role: str, text: str) -> str:
    return f"{IM_START}{role}\n{text}{IM_END}\n"


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence):
        raise ChatFormatError(f"{where}.content must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise UnsupportedContentError(
                f"{where}.content[{j}]: content parts of type {kind!r} are not supported by "
                "this model; only 'text' parts are"
            )
    return "\n".join(texts)


def _text(message: Mapping[str, Any], i: int) -> str:
    return _content_text(message.get("content"), f"messages[{i}]")


def _assistant_text(message: Mapping[str, Any], i: int, call_names: dict[str, str]) -> str:
    text = _text(message, i)
    calls = message.get("tool_calls") or []
    rendered = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ChatFormatError(f"messages[{i}].tool_calls[{j}] needs function.name")
        arguments = fn.get("arguments")
        if isinstance(arguments, Mapping):  # lenient: some clients send an object
            arguments = json.dumps(arguments, ensure_ascii=False)
        elif not isinstance(arguments, str) or not arguments.strip():
            arguments = "{}"
        if isinstance(call.get("id"), str):
            call_names[call["id"]] = fn["name"]
        rendered.append(render_tool_call(fn["name"], arguments))
    if not rendered:
        return text
    return (text + "\n" if text else "") + "\n".join(rendered)


def _tool_result_text(message: Mapping[str, Any], i: int, call_names: dict[str, str]) -> str:
    call_id = message.get("tool_call_id")
    # `function` messages (deprecated) carry the name themselves.
    name = message.get("name") or (call_names.get(call_id) if isinstance(call_id, str) else None)
    attrs = ""
    if isinstance(call_id, str):
        attrs += f" id={json.dumps(call_id, ensure_ascii=False)}"
    if isinstance(name, str):
        attrs += f" name={json.dumps(name, ensure_ascii=False)}"
    return f"<tool_response{attrs}>\n{_text(message, i)}\n</tool_response>"
