"""Which coding-agent session, and which agent of it, a call came from: its session lane.

    lane = session_lane(call.headers)      # SessionLane(lane, parent), or None

Coding agents send a session header on every call of a session, first found wins
(`SESSION_HEADERS`, which the replica affinity of `proxy.chat.affinity` reads too):

- Claude Code: `X-Claude-Code-Session-Id`, the same after `--continue`. A sub-agent's calls (its
  Agent/Task tool) carry the session's header and `x-claude-code-agent-id`; a nested sub-agent's
  also `x-claude-code-parent-agent-id`. The main agent sends no agent id.
- Codex: `session-id`, and `thread-id` (its sub-agents run in threads of their own).
- OpenCode: `x-session-affinity` and `x-session-id` (its title call carries them too).
- pi: `session_id` on the Responses API.

The lane is the session plus the agent or thread id (`AGENT_HEADERS`); the parent lane is the
lane of the agent that started this one: the parent agent id's, or, for a Claude Code sub-agent
without one, the main agent's (the session without an agent id). Codex names no parent thread,
so its threads have none.

What the lanes mean is decided in `storage.linking` (a rewritten history continues its lane's
trajectory; a sub-agent's trajectory records its parent); this module only names them. A lane
carries no header's text: values are digested here, and the store hashes the lane again with
the API key's seed, so lanes of two keys never meet.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

SESSION_HEADERS = (
    "x-session-affinity",  # OpenCode
    "x-claude-code-session-id",  # Claude Code
    "session-id",  # Codex
    "session_id",  # pi (Responses)
    "x-session-id",  # OpenCode
)
"""Session headers, lower case, in the order they are looked for."""

AGENT_HEADERS = (
    "x-claude-code-agent-id",  # Claude Code: a sub-agent (the main agent sends none)
    "thread-id",  # Codex: a thread (each sub-agent runs in its own)
)
"""Which agent of the session sent the call, lower case, first found wins."""

PARENT_AGENT_HEADER = "x-claude-code-parent-agent-id"
"""Claude Code: the sub-agent that started this (nested) sub-agent."""


@dataclass(frozen=True)
class SessionLane:
    """`CallRecord.session_lane` and `CallRecord.parent_lane`."""

    lane: str
    parent: str | None = None


def session_lane(headers: Mapping[str, str]) -> SessionLane | None:
    """The lane of a call with these headers (names in lower case, as `CallInfo` keeps them);
    None without a session header."""
    session = next(((h, headers[h]) for h in SESSION_HEADERS if headers.get(h)), None)
    if session is None:
        return None
    main = "session:" + _digest("=".join(session))
    agent = next(((h, headers[h]) for h in AGENT_HEADERS if headers.get(h)), None)
    if agent is None:
        return SessionLane(main)
    lane = f"{main}/agent:{_digest('='.join(agent))}"
    if agent[0] != "x-claude-code-agent-id":
        return SessionLane(lane)  # a Codex thread: no parent named
    parent_agent = headers.get(PARENT_AGENT_HEADER)
    if parent_agent:
        return SessionLane(lane, f"{main}/agent:{_digest(f'{agent[0]}={parent_agent}')}")
    return SessionLane(lane, main)


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()
