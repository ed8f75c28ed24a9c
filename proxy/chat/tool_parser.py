"""Parsing Hermes-style tool calls out of model text, incrementally for streaming.

The Hermes family (`proxy.chat.tool_formats`: Qwen2.5/3 templates, and SmolLM2, which rlproxy
teaches it through the system prompt); `proxy.chat.grammar` enforces it when a grammar is on. The
other family's parser, `proxy.chat.tool_parser_llama3`, emits the same events and follows the same
`StreamParser` protocol:

    optional text<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>
    <tool_call>{"name": "get_time", "arguments": {}}</tool_call>

`ToolCallStreamParser` turns text deltas into events (`TextDelta`, `ToolCallStart`,
`ToolCallArgsDelta`) and, once finished, holds the whole output's `content` and `tool_calls` in
OpenAI's shape (`ToolFormat.parse_complete` feeds a whole text at once). The rules are the same
however the text arrives, so any split of a text into deltas yields the same content and calls
as the whole text:

- Text that might be the start of `<tool_call>` is held back until it is known not to be; a
  partial tag never leaks into the content. Whitespace right before `<tool_call>` and right after
  `</tool_call>` is dropped (the separators between text and calls are not content).
- A call is recognised once its header `{"name": "<name>", "arguments":` is complete (any JSON
  whitespace around the tokens is accepted); `ToolCallStart` comes out then. From then on it is
  committed: argument fragments stream as they arrive, holding back only what might be the
  closing `}` + `</tool_call>`, so the fragments concatenate to the arguments string. A call cut
  short (`max_tokens`) keeps the arguments it has, which may then be invalid JSON, as OpenAI does
  for `finish_reason: length`.
- Anything after `<tool_call>` that cannot become a valid header (unconstrained output, or a name
  outside `tool_names` when that is given) is plain text, tag included. Nothing here raises on
  model output. One exception: an unfinished tag or header at the very end of the output, right
  after a complete call, is dropped: it is the next call, cut short by `max_tokens`.

This module knows nothing about tokens, grammars or HTTP; it only sees text.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal, Protocol

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"

_WS = " \t\n\r"
_ID_ALPHABET = string.ascii_letters + string.digits
# The header of a call, in order: "{", "name", ":", a JSON string, ",", "arguments", ":".
# None stands for the JSON string (the tool's name); JSON whitespace is allowed between items.
_HEADER_ITEMS: tuple[str | tuple[str, ...] | None, ...] = (
    "{",
    '"name"',
    ":",
    None,
    ",",
    '"arguments"',
    ":",
)
_JSON_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\.)*"')
# What ends a call's arguments: whitespace, the call object's own "}", whitespace, the tag.
_CALL_END = re.compile(r"[ \t\n\r]*(?:\}[ \t\n\r]*)?" + re.escape(CLOSE_TAG))


def new_call_id() -> str:
    """An OpenAI-style tool call id: `call_` + 24 random alphanumerics."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgsDelta:
    index: int
    fragment: str


Event = TextDelta | ToolCallStart | ToolCallArgsDelta


class StreamParser(Protocol):
    """What every tool-call format's parser offers (`proxy.chat.tool_formats` picks one)."""

    tool_calls: list[dict[str, Any]]

    def feed(self, text_delta: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...

    @property
    def content(self) -> str | None: ...


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


HeaderItem = str | tuple[str, ...] | None


def match_header(
    buf: str, items: tuple[HeaderItem, ...] = _HEADER_ITEMS
) -> tuple[int, str] | Literal[False] | None:
    """Match a call header (`items`, in order) at the start of `buf`: each item a literal, a tuple
    of literals any of which may stand there, or None for the JSON string naming the tool; JSON
    whitespace is allowed between items. The Hermes header by default (the text right after
    `<tool_call>`); `proxy.chat.tool_parser_llama3` passes its own.

    Returns (end, name) when complete, `end` being where the arguments begin; None while `buf`
    could still grow into a header; False when it never can.
    """
    pos = 0
    name = ""
    for item in items:
        while pos < len(buf) and buf[pos] in _WS:
            pos += 1
        if pos == len(buf):
            return None
        if item is None:
            m = _JSON_STRING.match(buf, pos)
            if m is None:
                # Incomplete string (no closing quote yet) or not a string at all.
                if buf[pos] != '"' or "\n" in buf[pos:]:
                    return False
                return None
            try:
                name = json.loads(m.group())
            except ValueError:
                return False
            pos = m.end()
            continue
        for option in (item,) if isinstance(item, str) else item:
            chunk = buf[pos : pos + len(option)]
            if option.startswith(chunk):
                if len(chunk) < len(option):
                    return None
                pos += len(option)
                break
        else:
            return False
    return pos, name


def _in_string(text: str, start: bool = False) -> bool:
    """Whether the end of `text` is inside a JSON string, `start` saying whether its beginning
    was (backslash escapes followed; text outside strings is not checked)."""
    inside, escaped = start, False
    for ch in text:
        if not inside:
            inside = ch == '"'
        elif escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            inside = False
    return inside


def _call_end(before: str, buf: str) -> re.Match[str] | None:
    """The first end of a call in `buf` that is not inside a JSON string of the arguments
    (`before`: the arguments' text that precedes `buf`). A `</tool_call>` inside a string value
    is part of the value; the grammar allows it."""
    inside = _in_string(before)
    pos = 0
    for m in _CALL_END.finditer(buf):
        inside = _in_string(buf[pos : m.start()], inside)
        if not inside:
            return m
        inside = _in_string(m.group(), inside)
        pos = m.end()
    return None


def _args_holdback(buf: str) -> int:
    """Index in `buf` from which the text might still be part of `}` + `</tool_call>`."""
    for start in range(len(buf)):
        if buf[start] not in _WS and buf[start] != "}" and buf[start] != "<":
            continue
        rest = buf[start:]
        # `rest` is a prefix of some string matching _CALL_END?
        i = 0
        while i < len(rest) and rest[i] in _WS:
            i += 1
        if i < len(rest) and rest[i] == "}":
            i += 1
            while i < len(rest) and rest[i] in _WS:
                i += 1
        if CLOSE_TAG.startswith(rest[i:]):
            return start
    return len(buf)


class ToolCallStreamParser:
    """Splits streamed model text into content deltas and tool call events.

    `tool_names`, when given, restricts which names count as calls; a header naming another tool
    is plain text. Feed every text delta, then call `finish()` once.
    """

    def __init__(self, tool_names: Collection[str] | None = None) -> None:
        self._tool_names = set(tool_names) if tool_names is not None else None
        self._buf = ""  # text not yet turned into events
        self._state = "text"  # "text" | "header" | "args" | "held"
        self._after_call = False  # drop whitespace that follows a complete call
        self._ws_before_tag = ""  # given back if the tag turns out not to start a call
        self._text_since_call = False  # any content emitted since the last complete call
        self._index = -1  # index of the current (or last) call
        self._held_name = ""  # name of a later call being held back (state "held")
        self.tool_calls: list[dict[str, Any]] = []  # the calls so far, in OpenAI's shape
        self.content_parts: list[str] = []

    def feed(self, text_delta: str) -> list[Event]:
        self._buf += text_delta
        return self._process(final=False)

    def finish(self) -> list[Event]:
        events = self._process(final=True)
        # A final pass leaves the state "text" or "args" (an unfinished header became text).
        # (A call cut by max_tokens before its `</tool_call>` may end with the brace that
        # closes the call object: `_cut_arguments` leaves it out.)
        if self._state == "held":
            args = _cut_arguments("", self._buf.lstrip(_WS))
            if not self._is_repeat(self._held_name, args):
                events.append(self._start_call(self._held_name))
                if args.strip(_WS):
                    events.append(self._emit_args(args))
        elif self._state == "args" and self._buf:
            sent = self.tool_calls[self._index]["function"]["arguments"]
            rest = _cut_arguments(sent, self._buf)
            if rest:
                events.append(self._emit_args(rest))
        elif not (self._right_after_call() and OPEN_TAG.startswith(self._buf)):
            # (else: the output ends inside the next call's tag, cut by max_tokens)
            events += self._emit_text(self._buf)
        self._buf = ""
        self._state = "text"
        return events

    @property
    def content(self) -> str | None:
        text = "".join(self.content_parts)
        return text if text or not self.tool_calls else None

    # -- internals --

    def _right_after_call(self) -> bool:
        return bool(self.tool_calls) and not self._text_since_call

    def _emit_text(self, text: str) -> list[Event]:
        if not text:
            return []
        self._text_since_call = True
        self.content_parts.append(text)
        return [TextDelta(text)]

    def _start_call(self, name: str) -> ToolCallStart:
        self._index += 1
        call_id = new_call_id()
        self.tool_calls.append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
        )
        return ToolCallStart(self._index, call_id, name)

    def _is_repeat(self, name: str, arguments: str) -> bool:
        key = (name, canonical_args(arguments))
        return any(
            (c["function"]["name"], canonical_args(c["function"]["arguments"])) == key
            for c in self.tool_calls
        )

    def _emit_args(self, fragment: str) -> ToolCallArgsDelta:
        self.tool_calls[self._index]["function"]["arguments"] += fragment
        return ToolCallArgsDelta(self._index, fragment)

    def _process(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            if self._state == "text":
                if self._after_call:
                    stripped = self._buf.lstrip(_WS)
                    if not stripped:
                        self._buf = ""
                        return events
                    self._buf = stripped
                    self._after_call = False
                at = self._buf.find(OPEN_TAG)
                if at >= 0:
                    before = self._buf[:at].rstrip(_WS)
                    events += self._emit_text(before)
                    self._ws_before_tag = self._buf[len(before) : at]
                    self._buf = self._buf[at + len(OPEN_TAG) :]
                    self._state = "header"
                    continue
                if final:
                    return events  # finish() emits the rest
                # Hold back a possible partial tag and the whitespace run before it.
                keep = len(self._buf) - _partial_suffix(self._buf, OPEN_TAG)
                keep = len(self._buf[:keep].rstrip(_WS))
                events += self._emit_text(self._buf[:keep])
                self._buf = self._buf[keep:]
                return events
            if self._state == "header":
                header = match_header(self._buf)
                if header is None and final:
                    # The output ends inside a call's header (cut by max_tokens): there is no
                    # call to return, and the markup is not content.
                    self._buf = ""
                    self._state = "text"
                    return events
                if header is None:
                    return events
                if header is False or (
                    self._tool_names is not None and header[1] not in self._tool_names
                ):
                    # Not a call: the tag is text; rescan what followed it as text.
                    events += self._emit_text(self._ws_before_tag + OPEN_TAG)
                    self._state = "text"
                    continue
                end, name = header
                self._buf = self._buf[end:]
                if self.tool_calls:
                    # A later call is held back whole until it ends, so that an exact repeat of
                    # an earlier call (the small model loops on them) can be dropped.
                    self._held_name = name
                    self._state = "held"
                    continue
                events.append(self._start_call(name))
                self._state = "args"
                continue
            if self._state == "held":
                m = _call_end("", self._buf)
                if m is None:
                    return events  # finish() emits a cut-off call as it is
                args = self._buf[: m.start()].lstrip(_WS)
                self._buf = self._buf[m.end() :]
                self._state = "text"
                self._after_call = True
                self._text_since_call = False
                if not self._is_repeat(self._held_name, args):
                    events.append(self._start_call(self._held_name))
                    events.append(self._emit_args(args))
                continue
            # self._state == "args"
            if not self.tool_calls[self._index]["function"]["arguments"]:
                # Whitespace between the header and the arguments is not part of them.
                self._buf = self._buf.lstrip(_WS)
            m = _call_end(self.tool_calls[self._index]["function"]["arguments"], self._buf)
            if m is not None:
                if m.start():
                    events.append(self._emit_args(self._buf[: m.start()]))
                self._buf = self._buf[m.end() :]
                self._state = "text"
                self._after_call = True
                self._text_since_call = False
                continue
            if final:
                return events  # finish() emits the rest
            keep = _args_holdback(self._buf)
            if keep:
                events.append(self._emit_args(self._buf[:keep]))
                self._buf = self._buf[keep:]
            return events


def _cut_arguments(sent: str, rest: str) -> str:
    """What of `rest` ends a call's arguments (`sent`: those already emitted) when the output
    stopped before `</tool_call>`: all of it, but the last `}` when that brace closes the call
    object, not the arguments (the arguments parse without it and not with it)."""
    whole = (sent + rest).rstrip(_WS)
    if whole.endswith("}") and not _parses(whole):
        inner = whole[:-1].rstrip(_WS)
        if len(inner) >= len(sent) and _parses(inner):
            return inner[len(sent) :]
    return rest


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def canonical_args(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True)
    except ValueError:
        return arguments
