"""Rendering OpenAI chat messages (and tools) into the prompt string, with the model's own chat
template, as vLLM and transformers do (`tokenizer.apply_chat_template(messages, tools=...,
add_generation_prompt=True)`).

`ChatTemplate.for_tokenizer(tokenizer, tool_format)` reads the template once; `render(messages,
tools)` gives the prompt text (tokenized by the caller with `add_special_tokens=False`: the
template writes its own BOS). Before the template sees them, messages are put in the one shape
templates expect:

- `developer` is `system` (templates do not know it); `function` (deprecated) is `tool`.
- Content is a string: a list of `text` (or `refusal`) parts is joined with newlines; any other
  part (image, audio, file) raises `UnsupportedContentError` (this is a text-only model).
- Assistant `tool_calls` carry their `arguments` parsed into an object (templates write them
  with `tojson`; transformers' convention); arguments that are not JSON stay a string.
- A tool result carries `tool_call_id` and the tool's `name` (looked up from the assistant turn
  that made the call).
- An assistant's `reasoning_content` (the reasoning a client sent back: an Anthropic thinking
  block's text, a Responses reasoning item's) reaches the template only when the template has a
  place for it: it reads `reasoning_content` (Qwen3's) or `message.thinking` (gpt-oss's), and
  gets it under that name. Any other template never sees it, so the prompt is what it would be
  without it: the stored turn keeps it, the model is not shown text it has no markup for.

A template that does not render tools (it never mentions `tools`, like SmolLM2's ChatML template
in its GGUF) would drop them silently. For such a template rlproxy writes the tool-call family's
own prompt (`proxy.chat.tool_formats`) into the messages instead, which the template then renders
as text:

- the tools block is appended to the first system message, or, when the first message is not a
  system message, to the template's own default system prompt (found by rendering the template
  with and without a system message), given as an explicit system message;
- assistant tool calls become text in the assistant turn (its text, a newline, the calls as the
  model writes them, arguments verbatim), unless the template renders `tool_calls` itself;
- a tool result's text is wrapped by the family (Hermes: `<tool_response id=... name=...>`), so
  the model sees which call it answers.

For SmolLM2 this is exactly the prompt rlproxy wrote by hand before: ChatML with the Hermes tools
block in the system prompt. This module builds strings; it does not tokenize, and it does not
escape special tokens inside message text (neither do the templates).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jinja2

from proxy.chat.tool_formats import HERMES, ToolFormat
from proxy.chat.tool_formats import tool_format as pick_tool_format

logger = logging.getLogger(__name__)


class ChatFormatError(ValueError):
    """The messages or tools cannot be rendered (the server answers 400)."""


class UnsupportedContentError(ChatFormatError):
    """A content part of a type this text-only model cannot take (image, audio, file)."""


class NoChatTemplateError(ValueError):
    """The model has no chat template (a base model): rlproxy cannot serve it as a chat model."""


_PROBE_USER = "\x00rlproxy-user\x00"
_PROBE_SYSTEM = "\x00rlproxy-system\x00"


@dataclass
class ChatTemplate:
    """A tokenizer's chat template plus the tool-call family that goes with it."""

    tokenizer: Any
    tool_format: ToolFormat = HERMES
    renders_tools: bool = field(init=False)
    renders_calls: bool = field(init=False)
    reasoning_key: str | None = field(init=False)
    """The name under which the template reads an assistant's reasoning, if it does."""
    default_system: str | None = field(init=False)

    def __post_init__(self) -> None:
        source = template_source(self.tokenizer)
        self.renders_tools = re.search(r"\btools\b", source.replace("tool_calls", "")) is not None
        self.renders_calls = "tool_calls" in source
        self.reasoning_key = reasoning_key(source)
        self.default_system = self._find_default_system()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, tool_format: str = "auto") -> ChatTemplate:
        """The template of `tokenizer` with the family `tool_format` names (`auto`: detected
        from the template's markup)."""
        fmt = pick_tool_format(tool_format, template_source(tokenizer, with_tools=True))
        template = cls(tokenizer, fmt)
        logger.info(
            "chat template: tools %s, tool calls %s, tool-call format %s",
            "rendered by the template" if template.renders_tools else "taught by rlproxy",
            "rendered by the template" if template.renders_calls else "written by rlproxy",
            fmt.name,
        )
        return template

    def render(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
    ) -> str:
        """The prompt for `messages` (and `tools`), ending with the assistant's turn opening."""
        if not messages:
            raise ChatFormatError("messages must contain at least one message")
        normalized_tools = [normalize_tool(t, i) for i, t in enumerate(tools or [])]
        chat = self._messages(messages)
        kwargs: dict[str, Any] = {}
        if normalized_tools and self.renders_tools:
            kwargs["tools"] = normalized_tools
        elif normalized_tools:
            block = self.tool_format.tools_block(normalized_tools)
            if chat[0]["role"] == "system":
                chat[0] = {**chat[0], "content": chat[0]["content"] + block}
            else:
                system = self.default_system
                content = system + block if system else block.lstrip("\n")
                chat.insert(0, {"role": "system", "content": content})
        try:
            text = self.tokenizer.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=True, **kwargs
            )
        except jinja2.TemplateError as exc:  # the template's own raise_exception, or its bug
            raise ChatFormatError(f"the model's chat template refused the messages: {exc}") from exc
        return str(text)

    # -- internals --

    def _messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        call_names: dict[str, str] = {}  # tool_call_id -> tool name, from assistant turns
        out: list[dict[str, Any]] = []
        for i, message in enumerate(messages):
            role = message.get("role")
            if role in ("system", "developer"):
                out.append({"role": "system", "content": _text(message, i)})
            elif role == "user":
                out.append({"role": "user", "content": _text(message, i)})
            elif role == "assistant":
                out.append(self._assistant(message, i, call_names))
            elif role in ("tool", "function"):
                out.append(self._tool_result(message, i, call_names))
            else:
                raise ChatFormatError(f"messages[{i}]: unknown role {role!r}")
        return out

    def _assistant(
        self, message: Mapping[str, Any], i: int, call_names: dict[str, str]
    ) -> dict[str, Any]:
        text = _text(message, i)
        calls = []
        for j, call in enumerate(message.get("tool_calls") or []):
            fn = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                raise ChatFormatError(f"messages[{i}].tool_calls[{j}] needs function.name")
            arguments = fn.get("arguments")
            if isinstance(arguments, Mapping):  # lenient: some clients send an object
                arguments = json.dumps(arguments, ensure_ascii=False)
            elif not isinstance(arguments, str) or not arguments.strip():
                arguments = "{}"
            call_id = call.get("id") if isinstance(call.get("id"), str) else None
            if call_id is not None:
                call_names[call_id] = fn["name"]
            calls.append((call_id, fn["name"], arguments))
        out: dict[str, Any] = {"role": "assistant", "content": text}
        reasoning = message.get("reasoning_content")
        if self.reasoning_key is not None and isinstance(reasoning, str) and reasoning:
            out[self.reasoning_key] = reasoning
        if not calls:
            return out
        if not self.renders_calls:
            rendered = self.tool_format.render_calls([(n, a) for _, n, a in calls])
            return {**out, "content": (text + "\n" if text else "") + rendered}
        out["tool_calls"] = [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": _arguments_value(arguments)},
            }
            for call_id, name, arguments in calls
        ]
        return out

    def _tool_result(
        self, message: Mapping[str, Any], i: int, call_names: dict[str, str]
    ) -> dict[str, Any]:
        raw_id = message.get("tool_call_id")
        call_id = raw_id if isinstance(raw_id, str) else None
        # `function` messages (deprecated) carry the name themselves.
        name = message.get("name") or (call_names.get(call_id) if call_id else None)
        name = name if isinstance(name, str) else None
        text = _text(message, i)
        if not self.renders_calls:
            return {"role": "tool", "content": self.tool_format.render_result(text, call_id, name)}
        out: dict[str, Any] = {"role": "tool", "content": text}
        if call_id is not None:
            out["tool_call_id"] = call_id
        if name is not None:
            out["name"] = name
        return out

    def _find_default_system(self) -> str | None:
        """The system prompt the template writes when the messages bring none (None: it writes
        none). Found by rendering one user message with and without a system message."""
        try:
            bare = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": _PROBE_USER}], tokenize=False
            )
            with_system = self.tokenizer.apply_chat_template(
                [
                    {"role": "system", "content": _PROBE_SYSTEM},
                    {"role": "user", "content": _PROBE_USER},
                ],
                tokenize=False,
            )
        except Exception:  # a template that insists on its own shapes: no default to reuse
            return None
        # with a system message: BEFORE + system text + AFTER; without: BEFORE + default + AFTER
        before, _, after = str(with_system).partition(_PROBE_SYSTEM)
        bare = str(bare)
        if not after or len(bare) < len(before) + len(after):
            return None
        if not (bare.startswith(before) and bare.endswith(after)):
            return None
        return bare[len(before) : len(bare) - len(after)] or None


def template_source(tokenizer: Any, with_tools: bool = False) -> str:
    """The chat template's Jinja text (the `tool_use` one of a template set, when tools are
    given and it has one, as transformers picks); raises NoChatTemplateError when there is none."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        key = "tool_use" if with_tools and "tool_use" in template else "default"
        template = template.get(key)
    if not isinstance(template, str) or not template:
        raise NoChatTemplateError(
            "the model has no chat template (tokenizer_config.json or chat_template.jinja); "
            "rlproxy serves chat models only"
        )
    return template


def reasoning_key(source: str) -> str | None:
    """The name under which a chat template reads an assistant's reasoning: `reasoning_content`
    (Qwen3), `thinking` (gpt-oss: `message.thinking`), or None (it has no place
    for it: SmolLM2's, Qwen2.5's, Llama 3.1's)."""
    if "reasoning_content" in source:
        return "reasoning_content"
    if re.search(r"\bmessage\.thinking\b|\bmessage\[['\"]thinking['\"]\]", source):
        return "thinking"
    return None


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


def _arguments_value(arguments: str) -> Any:
    """Arguments as templates expect them: the parsed object (a string if not JSON)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


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
