"""The local engine as RULER's judge, for when no judge model is configured.

It runs the judge prompt on the served model's base weights (`NAME@base`), greedy, with the reply
held to RULER's JSON schema by the engine's grammar, through a `ChatService` that has no call
sink: judge calls are never stored as calls, so they never become training data. A 135M model is
a placeholder judge for trying the loop out, not a useful one; the server says so when it starts.
"""

from __future__ import annotations

import copy
import logging
import uuid
from typing import Any

from proxy.chat import ChatService
from proxy.errors import APIError
from proxy.protocol import ChatCompletionRequest
from trainer.ruler import JudgeError, JudgeReply

logger = logging.getLogger(__name__)

EXPLANATION_MAX_CHARS = 160
"""Explanations are capped in the grammar: a small model otherwise rambles to max_tokens."""


class LocalJudge:
    def __init__(self, chat: ChatService, policy: str, *, tokens_per_member: int = 96) -> None:
        if chat.sink is not None:
            raise ValueError("the local judge needs a ChatService without a call sink")
        self.chat = chat
        self.base_model = f"{policy}@base"
        self.model = f"local:{self.base_model}"
        self.tokens_per_member = tokens_per_member

    async def complete(
        self, messages: list[dict[str, Any]], response_format: dict[str, Any]
    ) -> JudgeReply:
        response_format = _cap_explanations(response_format)
        members = _member_count(response_format)
        request = ChatCompletionRequest.model_validate(
            {
                "model": self.base_model,
                "messages": messages,
                "response_format": response_format,
                "temperature": 0,
                "max_tokens": 32 + self.tokens_per_member * max(members, 1),
            }
        )
        try:
            prepared = self.chat.prepare(request, f"judge_{uuid.uuid4().hex}")
            body = await self.chat.complete(prepared)
        except APIError as exc:
            raise JudgeError(f"local judge refused the request: {exc.message}") from exc
        choice = body["choices"][0]
        usage = body.get("usage") or {}
        return JudgeReply(
            content=choice["message"].get("content") or "",
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
            cost_usd=0.0,
        )


def _schema(response_format: dict[str, Any]) -> dict[str, Any] | None:
    schema = (response_format.get("json_schema") or {}).get("schema")
    return schema if isinstance(schema, dict) else None


def _member_count(response_format: dict[str, Any]) -> int:
    scores = ((_schema(response_format) or {}).get("properties") or {}).get("scores") or {}
    count = scores.get("maxItems") or scores.get("minItems") or 0
    return int(count)


def _cap_explanations(response_format: dict[str, Any]) -> dict[str, Any]:
    capped = copy.deepcopy(response_format)
    scores = ((_schema(capped) or {}).get("properties") or {}).get("scores") or {}
    explanation = ((scores.get("items") or {}).get("properties") or {}).get("explanation")
    if isinstance(explanation, dict):
        explanation.setdefault("maxLength", EXPLANATION_MAX_CHARS)
    return capped
