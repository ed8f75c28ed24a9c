"""Folding a tool-call parser's events as a streaming client would, for the parser tests."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from proxy.chat.tool_parser import Event, TextDelta, ToolCallStart


def collect(events: Iterable[Event]) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a stream of events: the text deltas joined, each call's argument
    fragments concatenated; content is None when there are calls and no text (OpenAI's shape)."""
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for ev in events:
        if isinstance(ev, TextDelta):
            text.append(ev.text)
        elif isinstance(ev, ToolCallStart):
            calls.append(
                {"id": ev.id, "type": "function", "function": {"name": ev.name, "arguments": ""}}
            )
        else:
            calls[ev.index]["function"]["arguments"] += ev.fragment
    content = "".join(text)
    return (content if content or not calls else None), calls
