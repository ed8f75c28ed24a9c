"""Parsing Llama 3.1-style JSON tool calls out of model text, incrementally for streaming.

The format (Meta's Llama 3.1 JSON tool calling; vLLM's `llama3_json` parser reads the same,
`vllm/tool_parsers/llama_tool_parser.py`): when the model calls tools its whole answer is one or
more JSON objects, separated by `;`, optionally preceded by `<|python_tag|>`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "parameters": {}}

(`"arguments"` is accepted in place of `"parameters"`). An answer whose first non-blank
character is anything else is plain content. `Llama3JsonStreamParser` follows the same rules and
emits the same events as the Hermes parser (`proxy.chat.tool_parser`), so that any split of a
text into deltas gives what `ToolFormat.parse_complete` gives:

- The arguments end where their JSON value ends, found by following the JSON (strings and
  escapes included), so a `}` or `;` inside a string value never ends a call. Argument fragments
  stream as they arrive; nothing needs holding back.
- A header that cannot become `{"name": <string>, "parameters": ` (or names a tool outside
  `tool_names`) makes the rest of the output content, as it stands.
- A call after the first is held whole until it ends, so that an exact repeat of an earlier call
  can be dropped (as the Hermes parser does). A call cut short (`max_tokens`) keeps the arguments
  it has; an unfinished header at the very end is dropped (the markup is not content).

This module only sees text; it knows nothing of tokens, grammars or HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from proxy.chat.tool_parser import (
    _WS,
    Event,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallStart,
    canonical_args,
    match_header,
    new_call_id,
)

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = "; "  # between parallel calls, as rlproxy's grammar writes them

# `{"name": <string>, "parameters"|"arguments": ` (either key, as vLLM's llama3_json reads).
_HEADER_ITEMS = ("{", '"name"', ":", None, ",", ('"parameters"', '"arguments"'), ":")


class _JsonValueEnd:
    """Follows one JSON value character by character and says where it ends."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False
        self.primitive = False

    def feed(self, text: str) -> int | None:
        """The index in `text` just past the value's end, or None if it goes on."""
        for i, ch in enumerate(text):
            if not self.started:
                if ch in _WS:
                    continue
                self.started = True
                if ch in "{[":
                    self.depth = 1
                elif ch == '"':
                    self.in_string = True
                else:
                    self.primitive = True
                continue
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
                continue
            if self.primitive:
                if ch in _WS or ch in ",}]":
                    return i
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


class Llama3JsonStreamParser:
    """Splits streamed model text into content deltas and tool call events (Llama 3.1 JSON).

    Same interface as `proxy.chat.tool_parser.ToolCallStreamParser`: feed every text delta,
    then call `finish()` once."""

    def __init__(self, tool_names: Collection[str] | None = None) -> None:
        self._tool_names = set(tool_names) if tool_names is not None else None
        self._buf = ""
        # "start": before the first non-blank character; "header", "args", "close" (the call's
        # own "}"), "between" (separators after a call), "text" (the rest is content).
        self._state = "start"
        self._value: _JsonValueEnd | None = None
        self._held: tuple[str, str] | None = None  # (name, args so far) of a later call
        self._index = -1
        self.tool_calls: list[dict[str, Any]] = []
        self.content_parts: list[str] = []

    @property
    def content(self) -> str | None:
        text = "".join(self.content_parts)
        return text if text or not self.tool_calls else None

    def feed(self, text_delta: str) -> list[Event]:
        self._buf += text_delta
        return self._process(final=False)

    def finish(self) -> list[Event]:
        events = self._process(final=True)
        if self._state == "start" or (self._state == "text" and self._buf):
            events += self._text(self._buf)
        elif self._state == "args" and self._held is not None:
            name, args = self._held
            events.append(self._start(name))
            events.append(self._args(args + self._buf))
        elif self._state == "args" and self._buf:
            events.append(self._args(self._buf))
        # "header": an unfinished header at the end is dropped; "close"/"between": markup.
        self._buf = ""
        return events

    # -- internals --

    def _text(self, text: str) -> list[Event]:
        if not text:
            return []
        self.content_parts.append(text)
        return [TextDelta(text)]

    def _start(self, name: str) -> ToolCallStart:
        self._index += 1
        call_id = new_call_id()
        self.tool_calls.append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
        )
        return ToolCallStart(self._index, call_id, name)

    def _args(self, fragment: str) -> ToolCallArgsDelta:
        self.tool_calls[self._index]["function"]["arguments"] += fragment
        return ToolCallArgsDelta(self._index, fragment)

    def _is_repeat(self, name: str, arguments: str) -> bool:
        key = (name, canonical_args(arguments))
        return any(
            (c["function"]["name"], canonical_args(c["function"]["arguments"])) == key
            for c in self.tool_calls
        )

    def _process(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            if self._state == "text":
                events += self._text(self._buf)
                self._buf = ""
                return events
            if self._state == "start":
                stripped = self._buf.lstrip(_WS)
                if not stripped:
                    return events
                if stripped.startswith(PYTHON_TAG):
                    self._buf = stripped[len(PYTHON_TAG) :]
                    continue
                if PYTHON_TAG.startswith(stripped) and not final:
                    return events  # maybe the tag, not complete yet
                if stripped[0] != "{":
                    self._state = "text"
                    continue
                self._buf = stripped
                self._state = "header"
                continue
            if self._state == "between":
                stripped = self._buf.lstrip(_WS + ";")
                if not stripped:
                    self._buf = ""
                    return events
                self._buf = stripped
                self._state = "header" if stripped[0] == "{" else "text"
                continue
            if self._state == "header":
                header = match_header(self._buf, _HEADER_ITEMS)
                if header is None:
                    return events  # finish() drops an unfinished header
                if header is False or (
                    self._tool_names is not None and header[1] not in self._tool_names
                ):
                    self._state = "text"  # not a call: the rest is content
                    continue
                end, name = header
                self._buf = self._buf[end:].lstrip(_WS)
                self._value = _JsonValueEnd()
                if self.tool_calls:
                    self._held = (name, "")
                else:
                    events.append(self._start(name))
                self._state = "args"
                continue
            if self._state == "args":
                assert self._value is not None
                if not self._value.started:  # blanks before the value are not arguments
                    self._buf = self._buf.lstrip(_WS)
                value_end = self._value.feed(self._buf)
                piece = self._buf if value_end is None else self._buf[:value_end]
                self._buf = "" if value_end is None else self._buf[value_end:]
                if self._held is not None:
                    self._held = (self._held[0], self._held[1] + piece)
                elif piece:
                    events.append(self._args(piece))
                if value_end is None:
                    return events
                if self._held is not None:
                    name, args = self._held
                    self._held = None
                    if not self._is_repeat(name, args):
                        events.append(self._start(name))
                        events.append(self._args(args))
                self._state = "close"
                continue
            # self._state == "close": blanks, then the call object's own "}"
            stripped = self._buf.lstrip(_WS)
            if not stripped:
                self._buf = ""
                return events
            if stripped[0] == "}":
                self._buf = stripped[1:]
                self._state = "between"
            else:
                self._buf = stripped
                self._state = "text"  # unexpected markup after a call: content


def render_call(name: str, arguments: str) -> str:
    """One call as the model writes it; `arguments` is the JSON text, inserted verbatim."""
    return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "parameters": {arguments}}}'
