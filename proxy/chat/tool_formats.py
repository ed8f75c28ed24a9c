"""Tool-call format families: how a model writes tool calls, and how rlproxy reads them back.

A family is chosen once per model, from its chat template (`RLPROXY_TOOL_FORMAT=auto`) or by the
setting (`hermes`, `llama3_json`). Everything that depends on it goes through the family:

- `hermes`: `<tool_call>{"name": N, "arguments": {...}}</tool_call>`, one per call, after any
  text (Qwen2.5, Qwen3, Hermes; SmolLM2, which rlproxy teaches it);
- `llama3_json`: `{"name": N, "parameters": {...}}`, calls joined by `; `, as the whole answer
  (Llama 3.1 / 3.2 / 3.3).

- parsing: `parser()` / `parse_complete()` (`proxy.chat.tool_parser` for Hermes,
  `proxy.chat.tool_parser_llama3` for Llama 3.1);
- grammars: `proxy.chat.grammar` builds each family's Lark grammar (by `name`);
- prompts, only for templates that do not render tools themselves (SmolLM2's ChatML template
  ignores `tools` and `tool_calls`): `tools_block` (appended to the system prompt),
  `render_calls` (an assistant turn's calls, written as the model would write them) and
  `render_result` (a tool result's text). Templates that know tools get them untouched
  (`proxy.chat.prompt`).

Detection (`detect`) reads the template's text for the family's own markup: `<tool_call>` is
Hermes; `<|python_tag|>` or the `ipython` role is Llama 3.1; a template with neither (no tool
support at all) gets Hermes, which rlproxy then teaches through the system prompt. Mistral's
`[TOOL_CALLS]` is not supported yet: such a template is refused unless a family is set.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from proxy.chat import tool_parser, tool_parser_llama3
from proxy.chat.tool_parser import StreamParser

FormatName = Literal["hermes", "llama3_json"]

HERMES_TOOLS_PREAMBLE = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
)
HERMES_TOOLS_INSTRUCTION = (
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags, one call per line:\n"
    '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>'
)
LLAMA3_TOOLS_INSTRUCTION = (
    "You have access to the functions below. To call functions, answer with nothing but JSON: "
    '{"name": <function-name>, "parameters": <args-json-object>}, several calls joined by "; ". '
    "Otherwise answer in plain text.\n\n"
)


class UnsupportedTemplateError(ValueError):
    """The model's chat template writes tool calls in a format rlproxy cannot parse yet."""


@dataclass(frozen=True)
class ToolFormat:
    """One family; `name` is what `RLPROXY_TOOL_FORMAT` and the grammar builder know it by."""

    name: FormatName

    def parser(self, tool_names: Collection[str] | None = None) -> StreamParser:
        if self.name == "llama3_json":
            return tool_parser_llama3.Llama3JsonStreamParser(tool_names)
        return tool_parser.ToolCallStreamParser(tool_names)

    def parse_complete(
        self, text: str, tool_names: Collection[str] | None = None
    ) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, OpenAI tool calls) of a whole output; the streaming rules in one go."""
        parser = self.parser(tool_names)
        parser.feed(text)
        parser.finish()
        return parser.content, parser.tool_calls

    def tools_block(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """What a template without tool support gets appended to its system prompt (starts with
        a blank line); `tools` are already normalized ({"type": "function", "function": ...})."""
        lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        if self.name == "llama3_json":
            return "\n\n" + LLAMA3_TOOLS_INSTRUCTION + lines
        return (
            "\n\n"
            + HERMES_TOOLS_PREAMBLE
            + "<tools>\n"
            + lines
            + "\n</tools>\n\n"
            + HERMES_TOOLS_INSTRUCTION
        )

    def render_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        """An assistant turn's calls as the model writes them; each (name, arguments JSON text),
        the arguments inserted verbatim so a history looks exactly like what was generated."""
        if self.name == "llama3_json":
            return tool_parser_llama3.SEPARATOR.join(
                tool_parser_llama3.render_call(n, a) for n, a in calls
            )
        return "\n".join(render_hermes_call(n, a) for n, a in calls)

    def render_result(self, text: str, call_id: str | None, name: str | None) -> str:
        """A tool result's text for a template without tool support (its own `tool` turn)."""
        if self.name == "llama3_json":
            return text
        attrs = ""
        if call_id is not None:
            attrs += f" id={json.dumps(call_id, ensure_ascii=False)}"
        if name is not None:
            attrs += f" name={json.dumps(name, ensure_ascii=False)}"
        return f"<tool_response{attrs}>\n{text}\n</tool_response>"


HERMES = ToolFormat("hermes")
LLAMA3_JSON = ToolFormat("llama3_json")
FORMATS: dict[str, ToolFormat] = {"hermes": HERMES, "llama3_json": LLAMA3_JSON}


def render_hermes_call(name: str, arguments: str) -> str:
    """One Hermes call; `arguments` is the JSON text, inserted verbatim."""
    name_json = json.dumps(name, ensure_ascii=False)
    return f'<tool_call>{{"name": {name_json}, "arguments": {arguments}}}</tool_call>'


def detect(template: str) -> ToolFormat:
    """The family a chat template's own markup says (see the module docstring)."""
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or "ipython" in template:
        return LLAMA3_JSON
    if "[TOOL_CALLS]" in template:
        raise UnsupportedTemplateError(
            "the model's chat template writes Mistral [TOOL_CALLS], which rlproxy does not parse "
            "yet; set RLPROXY_TOOL_FORMAT=hermes or llama3_json to teach it another format"
        )
    return HERMES


def tool_format(setting: str, template: str) -> ToolFormat:
    """The family for `RLPROXY_TOOL_FORMAT` (`auto`: from the template)."""
    if setting == "auto":
        return detect(template)
    if setting not in FORMATS:
        raise ValueError(f"unknown tool format {setting!r}; use auto, {', '.join(FORMATS)}")
    return FORMATS[setting]
