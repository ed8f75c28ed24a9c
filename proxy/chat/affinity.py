"""Which conversation a call belongs to, as a key an engine with several servers routes by.

    key = affinity_key(call, messages)     # "trajectory:...", "session:..." or "task:..."

Agents resend the whole history on every turn. A server with a prefix cache (vLLM's) prefills
only what is new when it saw the previous turn, so every turn of one conversation should reach
the same server (`proxy.engines.vllm_replicas.ReplicaPool.pick`). The key, first found wins:

1. the explicit trajectory id (`X-RLProxy-Trajectory`, metadata, the `rlproxy` body field, a
   Responses `previous_response_id` chain): the client said which conversation it is;
2. a session header coding agents send on every call of a session: OpenCode's
   `x-session-affinity` (meant for exactly this) and `x-session-id`, Claude Code's
   `X-Claude-Code-Session-Id`, Codex's `session-id`, pi's `session_id` on Responses;
3. the conversation's task signature (`storage.linking.task_signature`: the system prompt, the
   first user message and the tool schemas, in the linker's canonical form), the hash grouping
   already uses for repeated runs of one task. Every turn of a conversation that keeps its
   history repeats it, and conversations that start differently differ. Runs of one task (a
   group's attempts) share it, which suits a prefix cache too: they share that prefix.

A key is never stored and carries no text: headers and ids are hashed as well. Nothing here
speaks to an engine; the engine decides what a key means, and computes it only when it routes
by one (`GenerationRequest.affinity` is this function, not yet called).
"""

from __future__ import annotations

import hashlib
from typing import Any

from proxy.chat.record import CallInfo
from storage.linking import task_signature

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
    tools = [t.model_dump(exclude_none=True) for t in call.request.tools or []]
    return "task:" + task_signature(messages, tools)


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()
