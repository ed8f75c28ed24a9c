"""The served model as RULER's judge, for when no judge model is configured.

It runs the judge prompt on the served model's base weights (`NAME@base`), greedy, through a
`complete` function the serving side hands in: a chat-completions request as a dict in, the
response body out, never stored as a call (judge calls never become training data). The reply is
held by the engine's grammar to a keyed form of RULER's schema,
`{"scores": {"1": {"explanation", "score": 0..10}, ...}}`, in which every member id appears
exactly once by construction and a score cannot run on, and is handed back to RULER in its list
form (scores divided by 10). (A small model asked for the list form repeats or skips ids; an
object with required keys cannot.) A 135M model is a placeholder judge for trying the loop out,
not a useful one; the server says so when it starts.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from trainer.scoring.ruler import JudgeError, JudgeReply

logger = logging.getLogger(__name__)

ChatComplete = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
"""A chat-completions request body in, the response body out; raises when it is refused."""

EXPLANATION_MAX_CHARS = 160
"""Explanations are capped in the grammar: a small model otherwise rambles to max_tokens."""

EXPLANATION_PATTERN = rf"^[ !#-\[\]-~]{{0,{EXPLANATION_MAX_CHARS}}}$"
"""Printable ASCII without `"` and `\\`: no escapes, no multi-byte characters, so every
character of a reply is one byte and a reply never takes more tokens than it has bytes."""


class LocalJudge:
    def __init__(self, complete: ChatComplete, policy: str) -> None:
        self._complete = complete
        self.base_model = f"{policy}@base"
        self.model = f"local:{self.base_model}"

    async def complete(
        self, messages: list[dict[str, Any]], response_format: dict[str, Any]
    ) -> JudgeReply:
        ids = _member_ids(response_format)
        request = {
            "model": self.base_model,
            "messages": messages,
            "response_format": _keyed_format(ids) if ids else response_format,
            "temperature": 0,
            "max_tokens": reply_budget(ids),
        }
        try:
            body = await self._complete(request)
        except Exception as exc:
            raise JudgeError(f"local judge refused the request: {exc}") from exc
        choice = body["choices"][0]
        usage = body.get("usage") or {}
        content = choice["message"].get("content") or ""
        return JudgeReply(
            content=_as_list_form(content) if ids else content,
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
            cost_usd=0.0,
        )


def _member_ids(response_format: dict[str, Any]) -> list[str]:
    """The member ids RULER's schema allows (the enum of `trajectory_id`)."""
    schema = (response_format.get("json_schema") or {}).get("schema") or {}
    scores = (schema.get("properties") or {}).get("scores") or {}
    entry = ((scores.get("items") or {}).get("properties") or {}).get("trajectory_id") or {}
    return [str(i) for i in entry.get("enum") or []]


def reply_budget(ids: list[str]) -> int:
    """Tokens enough for the longest reply the keyed grammar allows, so that no reply is cut.

    Every character the grammar allows is ASCII and every token carries at least one byte, so
    the longest reply's length in bytes bounds its tokens (one more for EOS); `json.dumps` lays it
    out as the grammar does. With no ids (a schema that is not RULER's), one member's budget."""
    longest = {"explanation": "x" * EXPLANATION_MAX_CHARS, "score": 10}
    reply = {"scores": {i: longest for i in ids or ["1"]}}
    return len(json.dumps(reply)) + 1


def _keyed_format(ids: list[str]) -> dict[str, Any]:
    entry = {
        "type": "object",
        "properties": {
            "explanation": {"type": "string", "pattern": EXPLANATION_PATTERN},
            # An integer 0..10 (divided by 10 below): a free JSON number lets a small model
            # write decimals until max_tokens.
            "score": {"type": "integer", "minimum": 0, "maximum": 10},
        },
        "required": ["explanation", "score"],
        "additionalProperties": False,
    }
    scores = {
        "type": "object",
        "properties": {i: entry for i in ids},
        "required": ids,
        "additionalProperties": False,
    }
    schema = {
        "type": "object",
        "properties": {"scores": scores},
        "required": ["scores"],
        "additionalProperties": False,
    }
    return {"type": "json_schema", "json_schema": {"name": "ruler_scores", "schema": schema}}


def _as_list_form(content: str) -> str:
    """`{"scores": {"1": {...}}}` -> `{"scores": [{"trajectory_id": "1", ...}]}`; else as is."""
    try:
        scores = json.loads(content)["scores"]
        entries = [
            {"trajectory_id": k, "explanation": v["explanation"], "score": v["score"] / 10}
            for k, v in scores.items()
        ]
    except (ValueError, KeyError, TypeError, AttributeError):
        return content  # RULER reports what is wrong with it
    return json.dumps({"scores": entries})
