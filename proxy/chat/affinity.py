"""Which conversation a call belongs to, as a key an engine with several servers routes by.

    key = affinity_key(call, messages)     # "trajectory:...", "session:..." or "opening:..."

Agents resend the whole history on every turn. A server with a prefix cache (vLLM's) prefills
only what is new when it saw the previous turn, so every turn of one conversation should reach
the same server (`proxy.engines.vllm_replicas.ReplicaPool.pick`). The key, first found wins:

1. the explicit trajectory id (`X-RLProxy-Trajectory`, metadata, the `rlproxy` body field, a
   Responses `previous_response_id` chain): the client said which conversation it is;
2. a session header coding agents send on every call of a session: OpenCode's
   `x-session-affinity` (meant for exactly this) and `x-session-id`, Claude Code's
   `X-Claude-Code-Session-Id`, Codex's `session-id`, pi's `session_id` on Responses;
3. the conversation's opening: a hash of the messages before the first assistant message (the
   system prompt and the first user message, as the client sends them). It is the same on
   every turn of a conversation that keeps its history, and different for conversations that
   start differently. Runs of one task (a group's attempts) share it, which suits a prefix
   cache too: they share that prefix.

A key is never stored and carries no text: headers and ids are hashed as well. Nothing here
speaks to an engine; the engine decides what a key means (`GenerationRequest.affinity`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from proxy.chat.record import CallInfo

SESSION_HEADERS = (
    "x-session-affinity",  # OpenCode
    "x-claude-code-session-id",  # Claude Code
    "session-id",  # Codex
    "session_id",  # pi (Responses)
    "x-session-id",  # OpenCode
)
"""Session headers, lower case, in the order they are looked for."""


def affinity_key(call: CallInfo, messages: list[dict[str, Any]]) -> str:
    """The key that keeps `call`'s conversation on one server (see the module docstring)."""
    trajectory = call.explicit_trajectory_id
    if trajectory:
        return "trajectory:" + _digest(trajectory)
    for header in SESSION_HEADERS:
        value = call.headers.get(header)
        if value:
            return "session:" + _digest(f"{header}={value}")
    opening = []
    for message in messages:
        if message.get("role") == "assistant":
            break
        opening.append(message)
    return "opening:" + _digest(json.dumps(opening, ensure_ascii=False, sort_keys=True))


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()
