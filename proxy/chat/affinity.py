"""Which conversation a call belongs to, as a key an engine with several servers routes by.

    key = affinity_key(call, dumped)       # "trajectory:...", "cache:...", "session:..." or
                                           # "task:..."

Agents resend the whole history on every turn. A server with a prefix cache (vLLM's) prefills
only what is new when it saw the previous turn, so every turn of one conversation should reach
the same server (`proxy.engines.vllm_replicas.ReplicaPool.pick`). The key, first found wins:

1. the explicit trajectory id (`X-RLProxy-Trajectory`, metadata, the `rlproxy` body field, a
   Responses `previous_response_id` chain): the client said which conversation it is;
2. the request's `prompt_cache_key` (OpenAI's, on Chat Completions and the Responses API; Codex
   sends its conversation's id, pi its session's): a routing hint by definition, "requests that
   share it share a prefix", which is this key's purpose. It comes before the session headers
   because the client chose it for this: one session may hold several conversations (Codex's
   sub-agents each have their own thread and key), and a key names one;
3. a session header coding agents send on every call of a session: OpenCode's
   `x-session-affinity` (meant for exactly this) and `x-session-id`, Claude Code's
   `X-Claude-Code-Session-Id`, Codex's `session-id`, pi's `session_id` on Responses
   (`proxy.chat.sessions.SESSION_HEADERS`, which names the call's session lane for linking too);
4. the conversation's task signature (`storage.linking.task_signature`: the system prompt, the
   first user message and the tool schemas, in the linker's canonical form), the hash grouping
   already uses for repeated runs of one task. Every turn of a conversation that keeps its
   history repeats it, and conversations that start differently differ. Runs of one task (a
   group's attempts) share it, which suits a prefix cache too: they share that prefix.

This is not the canary's conversation key (`proxy.adapters.registry.conversation_key`), though
both start from the explicit trajectory id: that one must tell two runs of one task apart (each
draws its version on its own) and keys a conversation by its opening through the first answer
(`storage.linking.opening_hash`); this one wants runs of one task together, and a session
header is as good as an id to it.

A key is never stored and carries no text: headers and ids are hashed as well. Nothing here
speaks to an engine; the engine decides what a key means, and computes it only when it routes
by one (`GenerationRequest.affinity` is this function, not yet called).
"""

from __future__ import annotations

import hashlib

from proxy.chat.record import CallInfo, RequestDump
from proxy.chat.sessions import SESSION_HEADERS
from storage.linking import task_signature


def affinity_key(call: CallInfo, dumped: RequestDump) -> str:
    """The key that keeps `call`'s conversation on one server (see the module docstring);
    `dumped` is `call.request` as validation dumped it."""
    trajectory = call.explicit_trajectory_id
    if trajectory:
        return "trajectory:" + _digest(trajectory)
    if call.request.prompt_cache_key:
        return "cache:" + _digest(call.request.prompt_cache_key)
    for header in SESSION_HEADERS:
        value = call.headers.get(header)
        if value:
            return "session:" + _digest(f"{header}={value}")
    return "task:" + task_signature(dumped.messages, dumped.tools)


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()
