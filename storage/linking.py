"""Trajectory linking policy: which trajectory a chat call belongs to.

Agents resend the whole conversation on every call, so a call continues a trajectory when its
messages begin with that trajectory's last request plus the assistant message that answered
it. Messages are compared in canonical form, so key order, whitespace and `null`-vs-absent
fields do not split a trajectory:

- role ("developer" counts as "system"); text content (a string, or the text parts of a list
  joined) stripped and with whitespace runs collapsed; non-text parts (images, audio) as
  sorted-key JSON;
- tool calls as (name, arguments parsed as JSON and re-dumped with sorted keys); the legacy
  `function_call` counts as a tool call; tool messages keep their `tool_call_id`;
- everything else (ids of tool calls, `refusal`, `annotations`, reasoning fields) is ignored
  (tool-call ids are the second key, below, never part of the chain).

Hashes chain message by message, h_i = sha256(h_{i-1} | canonical(m_i)), so the hash of every
prefix of a request costs one pass over it. For a call the linker computes the hash of every
prefix that ends with an assistant message; the store looks up open trajectories whose
`next_prefix_hash` is among them; the longest matching prefix wins (the most recently updated
trajectory on a tie).

Tool-call ids are a second key, for a client that rewrites a tool call before sending it back.
OpenCode answers a call cut by `max_tokens` (arguments `{"file`, not JSON) by resending it under
the same id as a call of its `invalid` tool with new arguments, followed by the tool's error:

    stored turn:  [system, user]                  -> answer: read_file({"file)  id call_7Qx
    next request: [system, user, invalid({"tool": "read_file", ...}) id call_7Qx,
                   tool(tool_call_id call_7Qx, "invalid arguments")]

The canonical answer changed, so the chain finds nothing. A stored answer whose tool calls all
carry ids therefore also gives its trajectory `next_tool_call_hash` = sha256(the hash of that
call's request | "tool_call_ids:" | the answer's ids, sorted); any other answer gives None. For
a call, every assistant message of its request whose tool calls all carry ids gives the same
hash of the chain of the messages before it and its ids (`LinkKeys.tool_call_hashes`, each with
the length of the prefix through that message). A trajectory matches when one of them equals its
`next_tool_call_hash`: the messages before the rewritten turn are exactly (canonically, and under
the same API key, since the chain is seeded per key) the request the trajectory's last answer
was given to, and the turn carries exactly that answer's ids (in any order; its names,
arguments and text may differ). Ids are never the only evidence: two conversations that both
number their calls `call_0` differ before them and stay apart. Only the last answer's ids count,
as only its chain hash does. The longest match wins, whichever key it came by; at equal length
the chain wins (an answer echoed unchanged matches both ways, and an exact echo of one run beats
a newer run of the same request whose answer had the same ids); among equals the most recently
updated, as for the chain.

A coding agent's session is the last key, for an agent that rewrites its own history.
Claude Code compacts a long conversation: a summarisation call (its history and "respond with
text only"), then the session goes on from a rewritten history, [the summary, files re-read as
`<system-reminder>` text, the new message], which neither the chain nor the ids find. The call's
session lane (`CallRecord.session_lane`, computed by the proxy from the agent's session header and
its agent or thread id: `proxy.chat.sessions`) names where it came from; it is hashed with the
owner like the chain (`LinkKeys.session_lane`), so lanes of two API keys never meet. Only when
none of the keys above finds a trajectory, a call with a lane:

- joins the most recently updated open trajectory of its lane with the same `agent_signature`
  (the same agent: its system prompt with the volatile parts masked, and its tool names), as a
  turn whose history was rewritten (`LinkDecision.history_rewritten`, stored on the call: where
  the turn's messages stop continuing the turn before);
- otherwise opens a new trajectory whose parent is the trajectory of the agent that started it:
  for a side call (no tools) in a lane whose newest trajectory is another agent's, that one
  (OpenCode's title call: same session, another system prompt, no tools); else the newest of
  its parent lane (a Claude Code sub-agent's: the lane of the agent whose Task tool started
  it). `lanes` holds those two, whatever their status. Only a call without tools takes a
  parent in its own lane: calls are linked when they end, and a title ends before the first
  answer of the agent beside it, which must not become the title's child. The same agent
  after its trajectory closed starts a new episode (a sub-agent's again under its parent lane).

    main lane "s":      [sys, user "fix it"] ... turn 7: [sys, user "CRITICAL: ...summarise"]
                        turn 8: [sys, user "<summary>", user "<system-reminder>", user "go on"]
                                 -> same trajectory, turn 8 history_rewritten
    lane "s/agent-a":   [sub-agent sys, user "find the tests"]  -> new, parent = the main one

Retries do not fork. A call whose request equals the trajectory's last request is the same turn
when the client says it is a retry (`x-stainless-retry-count` > 0) or when it started after that
call finished and within `retry_window_s` of it. Requiring "started after it finished" keeps two
identical requests that overlap in time (parallel rollouts of the same task) apart; an attempt
whose client disconnected counts as finished up to `DISCONNECT_GRACE_S` earlier than stamped,
since the server only notices the closed connection after the client has gone (and resent).
A call that did not complete (error, client gone) and started before the trajectory's last call
with the same request is an earlier attempt recorded late ("stale"): it goes to that turn,
superseded.

Explicit ids win: a call with `explicit_trajectory_id` appends to that trajectory (reopening it
if it was closed: the agent said where the call belongs) or creates it. Closed trajectories are
never continued implicitly; the store only offers open ones.

The same canonical chain names a conversation outside storage too: `opening_hash` (the chain
of the messages through the first assistant message, which every later turn repeats) is the key
a canary rollout draws a conversation's adapter version by (`proxy.adapters.registry`), so
"this call continues that conversation" has one definition. `task_signature` is a different
fact, "the same task": every run of one task shares it (grouping's key, and the replica
affinity of `proxy.chat.affinity`, where runs of one task sharing a server is the point).
`agent_signature` is coarser still: one agent across its tasks.

This module is pure: no I/O, no SQL. The store (`storage.write_ops`) calls `PrefixLinker` inside
its write transaction, with the open trajectories the call's hashes point at; the rule decides,
and the store writes what it decided.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import takewhile
from typing import Any

from storage.records import CallRecord, LinkDecision, LinkKeys, TrajectoryState

_SEED = hashlib.sha256(b"rlproxy-link-v1").hexdigest()

DISCONNECT_GRACE_S = 2.0
"""How long before a disconnected attempt was stamped finished its resend may start and still be
a retry: the server notices a closed connection (and cancels the generation) a moment after the
client left, and a client that timed out resends at once."""
_TEXT_PART_TYPES = {"text", "input_text", "output_text"}


def normalise_text(text: str) -> str:
    """Strip and collapse every run of whitespace to one space."""
    return " ".join(text.split())


def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _canonical_arguments(arguments: Any) -> str:
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        arguments = {}  # no arguments: "", null and "{}" are the same call
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return normalise_text(arguments)
    return _canonical_json(arguments)


def _canonical_content(content: Any) -> tuple[str, list[str]]:
    """(normalised text, canonical non-text parts)."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return normalise_text(content), []
    texts: list[str] = []
    media: list[str] = []
    for part in content if isinstance(content, list) else [content]:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") in _TEXT_PART_TYPES:
            texts.append(str(part.get("text") or ""))
        else:
            media.append(_canonical_json(part))
    return normalise_text(" ".join(texts)), media


def _canonical_tool_calls(message: dict[str, Any]) -> list[list[str]]:
    calls = list(message.get("tool_calls") or [])
    if message.get("function_call"):
        calls.append({"function": message["function_call"]})
    out = []
    for call in calls:
        fn = call.get("function") or {}
        out.append([str(fn.get("name") or ""), _canonical_arguments(fn.get("arguments"))])
    return out


def canonical_message(message: dict[str, Any]) -> dict[str, Any]:
    """The parts of a message that decide whether two messages are 'the same'."""
    role = message.get("role") or "assistant"
    if role == "developer":
        role = "system"
    text, media = _canonical_content(message.get("content"))
    out: dict[str, Any] = {"role": role, "content": text}
    if media:
        out["media"] = media
    tool_calls = _canonical_tool_calls(message)
    if tool_calls:
        out["tool_calls"] = tool_calls
    if message.get("tool_call_id") is not None:
        out["tool_call_id"] = str(message["tool_call_id"])
    return out


def _chain(previous: str, message: dict[str, Any]) -> str:
    c = canonical_message(message)
    key = [c["role"], c["content"], c.get("media"), c.get("tool_calls"), c.get("tool_call_id")]
    data = previous + "\n" + json.dumps(key, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(data.encode()).hexdigest()


def _tool_call_ids(message: dict[str, Any]) -> list[str] | None:
    """The ids of an assistant message's tool calls, sorted; None unless it makes calls and
    every one has an id (the legacy `function_call` has none)."""
    ids: list[str] = []
    for call in message.get("tool_calls") or []:
        call_id = call.get("id") if isinstance(call, dict) else None
        if not isinstance(call_id, str) or not call_id:
            return None
        ids.append(call_id)
    return sorted(ids) or None


def _tool_call_hash(before: str, ids: list[str]) -> str:
    """The second key: the chain of the messages before an assistant turn, and its call ids."""
    data = before + "\ntool_call_ids:" + json.dumps(ids, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(data.encode()).hexdigest()


def _owner_seed(owner: str | None) -> str:
    """The chain's start: one per API key, so equal messages of two keys never hash equal and
    a call can only ever link to its own key's trajectories (no query needs an owner filter)."""
    if owner is None:
        return _SEED
    return hashlib.sha256(f"{_SEED}\nowner:{owner}".encode()).hexdigest()


def _hashes(
    messages: Sequence[dict[str, Any]], owner: str | None = None
) -> tuple[str, dict[str, int], dict[str, int]]:
    """(hash of all messages, {hash of each assistant-ending prefix: its length}, {tool-call
    hash of each assistant message whose calls all have ids: the same length}), one pass."""
    prefixes: dict[str, int] = {}
    tool_calls: dict[str, int] = {}
    h = _owner_seed(owner)
    for i, m in enumerate(messages):
        before, h = h, _chain(h, m)
        if m.get("role") == "assistant":
            prefixes[h] = i + 1
            ids = _tool_call_ids(m)
            if ids is not None:
                tool_calls[_tool_call_hash(before, ids)] = i + 1
    return h, prefixes, tool_calls


def _lane_hash(owner: str | None, lane: str | None) -> str | None:
    """A session lane as stored: hashed with the owner's seed (never the header's value)."""
    if lane is None:
        return None
    return hashlib.sha256(f"{_owner_seed(owner)}\nlane:{lane}".encode()).hexdigest()


def opening_hash(messages: Sequence[dict[str, Any]]) -> str | None:
    """The chained hash of `messages` up to and including the first assistant message: what
    every turn of one conversation repeats, in the linker's canonical form, so a client's own
    shape of an answer (no `refusal`, other call ids, re-dumped arguments) keys as the answer
    the server gave. The unkeyed chain: the shortest of `PrefixLinker.keys`' prefix hashes for
    a call without an owner. None while there is no assistant message (a first turn)."""
    h = _SEED
    for m in messages:
        h = _chain(h, m)
        if m.get("role") == "assistant":
            return h
    return None


def task_signature(messages: Sequence[dict[str, Any]], tools: Sequence[Any] | None) -> str:
    """Hash of the system prompt(s), the first user message and the tool schemas: "the same
    task", which every run of it shares (not "the same conversation": see `opening_hash`)."""
    head: list[dict[str, Any]] = []
    for m in messages:
        head.append(canonical_message(m))
        if m.get("role") == "user":
            break
    schemas = sorted(_canonical_json(t) for t in tools or [])
    return hashlib.sha256(_canonical_json([head, schemas]).encode()).hexdigest()


# What changes from one session of the same agent to the next inside its system prompt: coding
# agents write the date, the working directory, their version and git state into it
# (Claude Code, Codex, OpenCode, pi all do). Masked before hashing, so the agent keeps one key.
_VOLATILE = [
    # Claude Code's billing line: `cc_version=2.1.332.822;`, its suffix changing call to call.
    (re.compile(r"cc_version=[^;\s]*"), "cc_version=<v>"),
    (re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.@~+-]+){2,}[\\/]?"), "<path>"),  # /home/u/x, C:\x\y
    (re.compile(r"\b(?=[0-9a-fA-F-]*\d)[0-9a-fA-F]{7,}(?:-[0-9a-fA-F]{4,})*\b"), "<hex>"),  # ids
    (re.compile(r"\d+"), "0"),  # dates, times, versions, counts
    (re.compile(r"\s+"), " "),
]


@lru_cache(maxsize=32)
def _stable_text(text: str) -> str:
    """`text` with its volatile parts masked. Cached: every call of a session repeats its system
    prompt (tens of kilobytes for a coding agent, about 2 ms of regular expressions each), and
    linking runs inside the writer's transaction."""
    for pattern, replacement in _VOLATILE:
        text = pattern.sub(replacement, text)
    return text.strip()


def _tool_name(tool: Any) -> str:
    if isinstance(tool, dict):
        function = tool.get("function")
        if isinstance(function, dict) and function.get("name"):
            return str(function["name"])
        if tool.get("name"):
            return str(tool["name"])
        return str(tool.get("type") or "")
    return str(tool)


def agent_signature(messages: Sequence[dict[str, Any]], tools: Sequence[Any] | None) -> str:
    """Hash of what stays the same across one agent's tasks: its system prompt (the system and
    developer messages before the first other message) with the volatile parts masked (numbers,
    paths, hex ids, Claude Code's billing-line version) and the *names* of its tools.

    Tool descriptions and parameter schemas are left out on purpose: agents put task-specific
    values in them (an enum of the task's choices), and the same agent must keep one key. So are
    system messages inside the conversation: Claude Code writes its environment there, and after
    a compaction a note on deferred tools; the agent is the same."""
    head = [
        _stable_text(canonical_message(m)["content"])
        for m in takewhile(lambda m: m.get("role") in ("system", "developer"), messages)
    ]
    names = sorted({_tool_name(t) for t in tools or []})
    return hashlib.sha256(_canonical_json([head, names]).encode()).hexdigest()


@dataclass
class PrefixLinker:
    """Links calls by explicit id, retry detection, then the longest assistant-ending prefix
    (by the chain, or by a rewritten turn's tool-call ids), then the session lane."""

    retry_window_s: float = 10.0
    """A same-request call that starts within this many seconds after the last call finished
    is a retry of it, unless that call completed (then it is a new sample of the same task).
    0 disables the time rule (the retry-count header still counts)."""

    def __post_init__(self) -> None:
        if self.retry_window_s < 0:
            raise ValueError("retry_window_s must be >= 0 (0 disables the time rule)")

    def keys(self, record: CallRecord) -> LinkKeys:
        messages = record.request_messages
        request_hash, prefix_hashes, tool_call_hashes = _hashes(messages, record.owner_key_id)
        next_prefix_hash = next_tool_call_hash = None
        if record.status == "completed" and record.choices:
            answer = {"role": "assistant", **record.choices[0].message}
            next_prefix_hash = _chain(request_hash, answer)
            ids = _tool_call_ids(answer)
            if ids is not None:
                next_tool_call_hash = _tool_call_hash(request_hash, ids)
        lane = _lane_hash(record.owner_key_id, record.session_lane)
        return LinkKeys(
            prefix_hashes=prefix_hashes,
            request_hash=request_hash,
            next_prefix_hash=next_prefix_hash,
            task_signature=task_signature(messages, record.tools),
            tool_call_hashes=tool_call_hashes,
            next_tool_call_hash=next_tool_call_hash,
            session_lane=lane,
            parent_lane=_lane_hash(record.owner_key_id, record.parent_lane) if lane else None,
            agent_signature=agent_signature(messages, record.tools) if lane else None,
        )

    def _same_turn(self, record: CallRecord, keys: LinkKeys, t: TrajectoryState) -> str | None:
        """ "retry"/"stale" when `record` repeats `t`'s last request; None otherwise."""
        if t.last_call_id is None or keys.request_hash != t.last_request_hash:
            return None
        if t.last_call_created_at is not None and record.created_at < t.last_call_created_at:
            # Started before the standing call: a late-recorded earlier attempt only if it
            # failed; two completed overlapping calls are parallel rollouts, not retries.
            return "stale" if record.status != "completed" else None
        if record.retry_count > 0:
            return "retry"
        if t.last_call_status == "completed":
            return None  # the client got its answer: asking again is a new run, not a retry
        if self.retry_window_s > 0 and t.last_call_finished_at is not None:
            gap = record.created_at - t.last_call_finished_at
            # A client that gave up left before the server noticed and stamped the attempt
            # finished; its resend may start in between.
            earliest = -DISCONNECT_GRACE_S if t.last_call_status == "client_disconnected" else 0
            if earliest <= gap <= self.retry_window_s:
                return "retry"
        return None

    def choose(
        self,
        record: CallRecord,
        keys: LinkKeys,
        explicit: TrajectoryState | None,
        candidates: Sequence[TrajectoryState],
        lanes: Sequence[TrajectoryState] = (),
    ) -> LinkDecision:
        """Where `record` goes. `candidates`: the open trajectories its keys point at (its
        prefix, tool-call and request hashes, its lane with its agent signature); `lanes`: the
        newest trajectory, of any status, of its lane and of its parent lane."""
        if record.explicit_trajectory_id is not None:
            if explicit is None:
                return LinkDecision("new", record.explicit_trajectory_id)
            same = self._same_turn(record, keys, explicit)
            if same is not None:
                return LinkDecision(same, explicit.id, explicit.last_call_id)  # type: ignore[arg-type]
            return LinkDecision("append", explicit.id)

        repeats = [(t, s) for t in candidates if (s := self._same_turn(record, keys, t))]
        if repeats:
            t, same = max(repeats, key=lambda ts: (ts[0].updated_at, ts[0].id))
            return LinkDecision(same, t.id, t.last_call_id)  # type: ignore[arg-type]

        chained = max(
            (t for t in candidates if t.next_prefix_hash in keys.prefix_hashes),
            key=lambda t: (keys.prefix_hashes[t.next_prefix_hash or ""], t.updated_at, t.id),
            default=None,
        )
        by_ids = max(
            (t for t in candidates if t.next_tool_call_hash in keys.tool_call_hashes),
            key=lambda t: (keys.tool_call_hashes[t.next_tool_call_hash or ""], t.updated_at, t.id),
            default=None,
        )
        if by_ids is not None and (
            chained is None
            or keys.tool_call_hashes[by_ids.next_tool_call_hash or ""]
            > keys.prefix_hashes[chained.next_prefix_hash or ""]
        ):
            return LinkDecision("append", by_ids.id)  # a rewritten tool call; see the module
        if chained is not None:
            return LinkDecision("append", chained.id)
        return self._by_lane(record, keys, candidates, lanes)

    def _by_lane(
        self,
        record: CallRecord,
        keys: LinkKeys,
        candidates: Sequence[TrajectoryState],
        lanes: Sequence[TrajectoryState],
    ) -> LinkDecision:
        """The session lane's rule, when nothing else matched; see the module."""
        if keys.session_lane is None:
            return LinkDecision("new")
        same_agent = max(
            (
                t
                for t in candidates
                if t.status == "open"
                and t.session_lane == keys.session_lane
                and t.agent_signature == keys.agent_signature
            ),
            key=lambda t: (t.updated_at, t.id),
            default=None,
        )
        if same_agent is not None:
            return LinkDecision("append", same_agent.id, history_rewritten=True)

        def newest(lane: str | None) -> TrajectoryState | None:
            in_lane = (t for t in lanes if lane is not None and t.session_lane == lane)
            return max(in_lane, key=lambda t: (t.updated_at, t.id), default=None)

        own = newest(keys.session_lane)
        if own is not None and own.agent_signature != keys.agent_signature and not record.tools:
            return LinkDecision("new", parent_trajectory_id=own.id)  # a side call of that agent
        parent = newest(keys.parent_lane)
        return LinkDecision("new", parent_trajectory_id=parent.id if parent else None)
