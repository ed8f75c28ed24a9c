"""RULER: an LLM judge scores the members of one group against each other, each in [0, 1].

GRPO only needs rewards that rank the attempts of a group correctly, not an absolute measure, so
one judge call sees every member of a group side by side and gives each a score relative to the
others, with an explanation (RULER, from OpenPipe's ART). The prompt shows the messages that all
members share (system prompt, task, earlier turns) once, then each member's own continuation
under a short id ("1", "2", ...); the judge answers with JSON in a strict schema, which is
validated here. A group whose members are different tasks (a cohort of one agent's one-off tasks:
`different_tasks`) gets its own prompt: each member is shown with its own task (system prompt,
first user message, tools when they differ) and scored on how well it did that task, not against
the others' tasks. A malformed or incomplete reply is retried once with the error stated; a
transport failure (timeout, HTTP 5xx, unreachable provider) is retried once as it was. A group
whose judging still fails is reported as failed, with the reason; `score_group` never raises.

    judge = LiteLLMJudge("openai/o3")
    result = await score_group(JudgeGroup(group_id, members, tools), judge)
    if result.status == "scored": ... result.scores ...

The judge is any model litellm can reach (`trainer.scoring.litellm_judge.LiteLLMJudge`), or
anything else that implements the `Judge` protocol (the local engine, a test's script).

A `JudgeGroup` is what the judge reads of a stored group (`storage.records.GroupDetail`, the
one noun for a group everywhere else): each member's messages and tools, no token ids or
rewards, and the rubric; the judge checks insert a canary member into it, which is never stored.
The scorer builds it from the stored group (`trainer.scoring.scoring`).

This module does not read or write the database, does not decide which groups are ready to be
judged, and does not decide whether RULER's score or an explicit reward wins: the scorer and
the reward policy (`trainer.scoring.rewards`) do that.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_RUBRIC = """\
- A trajectory that achieves its goal always scores clearly higher than one that does not.
- Among trajectories with the same result, the more efficient one scores higher: fewer steps, \
tool calls and tokens for the same outcome, no unproductive detours.
- Give partial credit for progress: a trajectory that got further toward the goal scores higher \
than one that got less far.
- Make the gaps between scores proportional to the gaps in quality: if one trajectory is only \
slightly better than another the difference is small; if it is much better the difference is \
large.
- Scores lie between 0 and 1 and are relative to the other trajectories of this group: what \
matters is how each one compares with the others, not an absolute standard."""


def rubric_hash(rubric: str) -> str:
    """A short, stable name for a rubric text (first 16 hex digits of its sha256)."""
    return hashlib.sha256(rubric.encode("utf-8")).hexdigest()[:16]


# ----------------------------------------------------------------------------- data


@dataclass
class JudgeMember:
    member_id: str  # opaque id from storage (a trajectory id, "callid:2", ...)
    messages: list[dict[str, Any]]  # request messages + the final assistant message
    tools: list[dict[str, Any]] | None = None  # its own tool schemas; None: the group's


@dataclass
class JudgeGroup:
    group_id: str
    members: list[JudgeMember]
    tools: list[dict[str, Any]] | None  # OpenAI tool schemas shared by the group
    rubric: str = DEFAULT_RUBRIC


@dataclass
class JudgeReply:
    """What a judge backend returns for one call."""

    content: str
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cost_usd: float | None = None


class JudgeError(Exception):
    """The judge could not be asked: timeout, HTTP error, unreachable provider."""


class JudgeReplyInvalid(Exception):
    """The judge answered, but not with one valid score per member; the message says why."""


class Judge(Protocol):
    model: str  # e.g. "openai/o3" or "local:rlproxy@base"

    async def complete(
        self, messages: list[dict[str, Any]], response_format: dict[str, Any]
    ) -> JudgeReply: ...


@dataclass
class MemberScore:
    member_id: str
    score: float  # in [0, 1]
    explanation: str


@dataclass
class JudgeResult:
    status: Literal["scored", "failed"]
    scores: list[MemberScore]  # one per member, in member order; [] when failed
    failure: str | None  # why, when failed
    judge_model: str
    rubric_hash: str
    latency_s: float  # wall time of all attempts together
    attempts: int  # judge calls made: 1 or 2 (0 for an empty group)
    prompt_tokens: int | None  # summed over attempts; None when no attempt reported any
    completion_tokens: int | None
    cost_usd: float | None


ScoreGroup = Callable[[JudgeGroup, Judge], Awaitable[JudgeResult]]
"""A way of judging a group, never raising: `score_group` (RULER, the whole episodes side by
side) or `trainer.scoring.turns.TurnScoring` (each assistant turn from what came next)."""


# ----------------------------------------------------------------------------- prompt


def short_ids(count: int) -> list[str]:
    """The ids members go by in the prompt and in the reply: "1", "2", ..."""
    return [str(i + 1) for i in range(count)]


def shared_prefix(members: list[JudgeMember]) -> int:
    """How many leading messages every member has in common (compared with ==).

    Never a member's whole conversation: each member keeps at least one message of its own to
    show, so the result is at most len(shortest member) - 1."""
    if not members:
        return 0
    limit = max(0, min(len(m.messages) for m in members) - 1)
    first = members[0].messages
    n = 0
    while n < limit and all(m.messages[n] == first[n] for m in members[1:]):
        n += 1
    return n


def task_length(messages: list[dict[str, Any]]) -> int:
    """How many leading messages make a member's task: up to and including the first user message
    (the system prompt and the request, as the task signature reads them); without a user
    message, those before the first assistant message. Never the whole conversation."""
    end = len(messages)
    for n, message in enumerate(messages):
        if message.get("role") in ("user", "assistant"):
            end = n + 1 if message["role"] == "user" else n
            break
    return min(end, max(0, len(messages) - 1))


def _task(member: JudgeMember, tools: list[dict[str, Any]] | None) -> tuple[Any, ...]:
    messages = member.messages
    return (messages[: task_length(messages)], member.tools if member.tools is not None else tools)


def different_tasks(members: list[JudgeMember], tools: list[dict[str, Any]] | None = None) -> bool:
    """Whether the members are not all one task: their task messages (`task_length`) or their
    tool schemas (a member's own, else `tools`, the group's) differ. Source "task" groups never
    are (the task signature hashes the same parts); a cohort of one agent's one-off tasks is."""
    tasks = [_task(m, tools) for m in members]
    return any(t != tasks[0] for t in tasks[1:])


def build_judge_messages(group: JudgeGroup) -> list[dict[str, Any]]:
    """The judge's conversation: a system message (rubric, how to reply) and one user message
    (tools once, the shared prefix once, then each member's remainder under its short id).
    Members of different tasks: each shown whole with its own task (`_different_tasks_prompt`)."""
    if different_tasks(group.members, group.tools):
        return _different_tasks_prompt(group)
    ids = short_ids(len(group.members))
    prefix = shared_prefix(group.members)
    parts = [
        f"Below are {len(ids)} trajectories: attempts by an AI agent at the same task. "
        "Score each one relative to the others, following the rubric."
    ]
    if group.tools:
        parts.append(
            f"<tools>\nThe agent could call these tools:\n{tools_json(group.tools)}\n</tools>"
        )
    if prefix:
        first = group.members[0].messages
        shared = render_messages(first[:prefix], tool_names(first))
        parts.append(
            f"<shared_context>\nEvery trajectory begins with these {prefix} messages:\n\n"
            f"{shared}\n</shared_context>"
        )
    for short, member in zip(ids, group.members, strict=True):
        own = render_messages(member.messages[prefix:], tool_names(member.messages))
        lead = "continues the shared context with:\n\n" if prefix else ""
        parts.append(f'<trajectory id="{short}">\n{lead}{own}\n</trajectory>')
    parts.append(
        f"Reply with one JSON object and nothing else: {_reply_shape(ids)} "
        f"with exactly one entry for each trajectory ({', '.join(ids)}), in that order."
    )
    return [
        {"role": "system", "content": _system_prompt(group.rubric)},
        {"role": "user", "content": "\n\n".join(parts)},
    ]


def _different_tasks_prompt(group: JudgeGroup) -> list[dict[str, Any]]:
    """Each member under its short id with its own task first (messages up to the first user
    message, and its tools when the members' tools differ), then the rest of its conversation;
    nothing factored out, so no member's task is read as another's."""
    ids = short_ids(len(group.members))
    own_tools = [m.tools if m.tools is not None else group.tools for m in group.members]
    shared_tools = own_tools[0] if all(t == own_tools[0] for t in own_tools) else None
    parts = [
        f"Below are {len(ids)} trajectories of an AI agent, each at a different task. Each "
        "trajectory shows its own task first (the agent's instructions and the user's request), "
        "then what the agent did. Score each one on how well it did its own task, following the "
        "rubric; never judge a trajectory by another trajectory's task."
    ]
    if shared_tools:
        parts.append(
            f"<tools>\nThe agent could call these tools:\n{tools_json(shared_tools)}\n</tools>"
        )
    for short, member, tools in zip(ids, group.members, own_tools, strict=True):
        messages = member.messages
        names = tool_names(messages)
        n = task_length(messages)
        task = [render_messages(messages[:n], names)] if n else []
        if tools and shared_tools is None:
            task.append(
                f"<tools>\nThe agent could call these tools:\n{tools_json(tools)}\n</tools>"
            )
        rest = render_messages(messages[n:], names)
        parts.append(
            f'<trajectory id="{short}">\n<task>\n'
            + ("\n\n".join(task) or "(no task message)")
            + f"\n</task>\n\n{rest}\n</trajectory>"
        )
    parts.append(
        f"Reply with one JSON object and nothing else: {_reply_shape(ids)} "
        f"with exactly one entry for each trajectory ({', '.join(ids)}), in that order."
    )
    return [
        {"role": "system", "content": _different_tasks_system_prompt(group.rubric)},
        {"role": "user", "content": "\n\n".join(parts)},
    ]


def _different_tasks_system_prompt(rubric: str) -> str:
    return (
        "You are a careful, impartial judge of AI agents. You are shown several trajectories of "
        "an agent, each at a different task, each with its own task. Score every trajectory on "
        "how well it did what its own task asked, not against the other trajectories' tasks.\n\n"
        f"Rubric:\n{rubric}\n\n"
        "Where the rubric compares trajectories, compare how well each did its own task: one "
        "that fully did what its own user asked scores higher than one that did not do its own "
        "task, whatever the tasks are; a harder task does not by itself earn a lower score.\n\n"
        "For each trajectory give its id as shown (trajectory_id), an explanation of a sentence "
        "or two saying what it did well or badly at its own task (write it before deciding the "
        "score), and a score, a number from 0 to 1."
    )


def tools_json(tools: list[dict[str, Any]]) -> str:
    return json.dumps(tools, indent=1, ensure_ascii=False)


def _system_prompt(rubric: str) -> str:
    return (
        "You are a careful, impartial judge of AI agents. You are shown several trajectories, "
        "each an attempt by an agent at the same task, and you score every trajectory relative "
        "to the others.\n\n"
        f"Rubric:\n{rubric}\n\n"
        "For each trajectory give its id as shown (trajectory_id), an explanation of a sentence "
        "or two saying what it did well or badly compared with the others (write it before "
        "deciding the score), and a score, a number from 0 to 1."
    )


def _reply_shape(ids: list[str]) -> str:
    return (
        '{"scores": [{"trajectory_id": "' + ids[0] + '", "explanation": "...", "score": 0.0}, ...]}'
        if ids
        else '{"scores": []}'
    )


def tool_names(messages: list[dict[str, Any]]) -> dict[str, str]:
    """tool_call_id -> function name, so that tool results can say which tool answered."""
    names = {}
    for m in messages:
        for call in m.get("tool_calls") or []:
            if call.get("id"):
                names[call["id"]] = (call.get("function") or {}).get("name") or "?"
    return names


def render_messages(messages: list[dict[str, Any]], names: dict[str, str]) -> str:
    return "\n\n".join(_render_message(m, names) for m in messages)


def _render_message(message: dict[str, Any], names: dict[str, str]) -> str:
    role = str(message.get("role") or "unknown")
    head = role
    if role == "tool":
        call_id = message.get("tool_call_id")
        name = names.get(call_id or "") or message.get("name")
        head = (
            "tool result" + (f" of {name}" if name else "") + (f" [{call_id}]" if call_id else "")
        )
    elif message.get("name"):
        head = f"{role} ({message['name']})"
    lines = [f"[{head}]"]
    text = _text(message.get("content"))
    if text:
        lines.append(text)
    if message.get("refusal"):
        lines.append(f"(refused) {message['refusal']}")
    calls = list(message.get("tool_calls") or [])
    if message.get("function_call"):  # the legacy single call
        calls.append({"function": message["function_call"]})
    for call in calls:
        fn = call.get("function") or {}
        tag = f" [{call['id']}]" if call.get("id") else ""
        lines.append(f"tool call{tag}: {fn.get('name')}({fn.get('arguments') or ''})")
    if len(lines) == 1:
        lines.append("(empty)")
    return "\n".join(lines)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                out.append(str(part.get("text") or ""))
            elif isinstance(part, dict):
                out.append(f"[{part.get('type') or 'part'}]")  # an image, audio, a file
            else:
                out.append(str(part))
        return "\n".join(out)
    return json.dumps(content, ensure_ascii=False)


def response_format_for(group: JudgeGroup) -> dict[str, Any]:
    """OpenAI structured output: exactly one {trajectory_id, explanation, score} per member."""
    ids = short_ids(len(group.members))
    entry = {
        "type": "object",
        "properties": {
            "trajectory_id": {"type": "string", "enum": ids},
            "explanation": {"type": "string"},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["trajectory_id", "explanation", "score"],
        "additionalProperties": False,
    }
    schema = {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": entry,
                "minItems": len(ids),
                "maxItems": len(ids),
            }
        },
        "required": ["scores"],
        "additionalProperties": False,
    }
    return {
        "type": "json_schema",
        "json_schema": {"name": "ruler_scores", "strict": True, "schema": schema},
    }


# ----------------------------------------------------------------------------- reply

_FENCE = re.compile(r"^```[a-zA-Z]*[ \t]*\n?(.*?)\n?```$", re.DOTALL)


def parse_judge_reply(content: str, ids: list[str]) -> list[tuple[str, float, str]]:
    """The judge's reply as (id, score, explanation) in the order of `ids` (the short ids the
    prompt used, in member order). Raises JudgeReplyInvalid with the reason otherwise.

    A reply wrapped in a ``` fence is accepted; an integer id (1 for "1") is read as its string."""
    data = load_reply_json(content)
    if not isinstance(data, dict) or not isinstance(data.get("scores"), list):
        raise JudgeReplyInvalid('the reply is not a JSON object with a "scores" list')
    entries = data["scores"]
    if len(entries) != len(ids):
        seen = {_entry_id(e) for e in entries}
        missing = [i for i in ids if i not in seen]
        detail = f" (none for trajectory {', '.join(missing)})" if missing else ""
        raise JudgeReplyInvalid(f"expected {len(ids)} scores, got {len(entries)}{detail}")
    known = set(ids)
    found: dict[str, tuple[float, str]] = {}
    for n, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise JudgeReplyInvalid(f"scores[{n}] is not an object")
        tid = _entry_id(entry)
        if tid is None:
            raise JudgeReplyInvalid(f"scores[{n}] has no trajectory_id")
        if tid not in known:
            raise JudgeReplyInvalid(
                f"scores[{n}] has unknown trajectory_id {tid!r} (expected one of {', '.join(ids)})"
            )
        if tid in found:
            missing = [i for i in ids if i not in {_entry_id(e) for e in entries}]
            raise JudgeReplyInvalid(
                f"trajectory {tid} is scored twice"
                + (f" (and trajectory {', '.join(missing)} not at all)" if missing else "")
            )
        score = entry.get("score")
        if isinstance(score, bool) or not isinstance(score, int | float):
            raise JudgeReplyInvalid(f"the score of trajectory {tid} is not a number: {score!r}")
        if math.isnan(score):
            raise JudgeReplyInvalid(f"the score of trajectory {tid} is NaN")
        if not 0 <= score <= 1:
            raise JudgeReplyInvalid(f"the score of trajectory {tid} is {score}, outside [0, 1]")
        explanation = entry.get("explanation")
        if not isinstance(explanation, str):
            raise JudgeReplyInvalid(
                f"the explanation of trajectory {tid} is not a string: {explanation!r}"
            )
        found[tid] = (float(score), explanation)
    # As many entries as ids, each a known id, none twice: every id has its score.
    return [(i, *found[i]) for i in ids]


def load_reply_json(content: str) -> Any:
    """The JSON value of a judge's reply, which may be wrapped in a ``` fence; raises
    JudgeReplyInvalid when it is empty or not JSON."""
    text = (content or "").strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    if not text:
        raise JudgeReplyInvalid("the reply is empty")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise JudgeReplyInvalid(f"the reply is not valid JSON ({exc})") from exc


def _entry_id(entry: Any) -> str | None:
    if not isinstance(entry, dict):
        return None
    value = entry.get("trajectory_id")
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value if isinstance(value, str) else None


# ----------------------------------------------------------------------------- scoring


async def score_group(group: JudgeGroup, judge: Judge) -> JudgeResult:
    """Judge one group: one call, at most one retry. Never raises (except CancelledError)."""
    ids = short_ids(len(group.members))
    started = time.monotonic()
    if not group.members:
        return _result(group, judge, started, Asked(None, [], 0, "the group has no members"), [])
    messages = build_judge_messages(group)
    asked = await ask_judge(
        judge,
        messages,
        response_format_for(group),
        lambda content: parse_judge_reply(content, ids),
        lambda bad, reason: [*messages, *_correction(bad, reason, ids)],
        f"group {group.group_id}",
    )
    return _result(group, judge, started, asked, asked.parsed or [])


def _result(
    group: JudgeGroup,
    judge: Judge,
    started: float,
    asked: Asked[Any],
    parsed: list[tuple[str, float, str]],
) -> JudgeResult:
    replies = asked.replies
    costs = [r.cost_usd for r in replies if r.cost_usd is not None]
    return JudgeResult(
        status="scored" if asked.failure is None else "failed",
        scores=[
            MemberScore(member.member_id, score, explanation)
            for member, (_, score, explanation) in zip(group.members, parsed, strict=False)
        ],
        failure=asked.failure,
        judge_model=judge.model,
        rubric_hash=rubric_hash(group.rubric),
        latency_s=time.monotonic() - started,
        attempts=asked.attempts,
        prompt_tokens=_sum(r.prompt_tokens for r in replies),
        completion_tokens=_sum(r.completion_tokens for r in replies),
        cost_usd=sum(costs) if costs else None,
    )


@dataclass
class Asked(Generic[T]):
    """What asking the judge one question came to (`ask_judge`)."""

    parsed: T | None  # the validated reply; None when the question failed
    replies: list[JudgeReply]  # every reply received (valid or not), for tokens and cost
    attempts: int  # calls made: 1 or 2
    failure: str | None  # why it failed (both attempts, or a backend that raised)
    bug: bool = False  # the backend raised something other than JudgeError (not retried)


async def ask_judge(
    judge: Judge,
    messages: list[dict[str, Any]],
    response_format: dict[str, Any],
    parse: Callable[[str], T],
    correct: Callable[[str, str], list[dict[str, Any]]],
    about: str,
) -> Asked[T]:
    """Ask one question, validate the reply with `parse` (which raises JudgeReplyInvalid), and
    retry once: an invalid reply with the conversation `correct(reply, reason)` builds (the bad
    reply and the error stated), a failed call (JudgeError) with the same messages. A backend
    that raises anything else is a bug: reported, not retried. Never raises (except
    CancelledError); `about` names the question in the log ("group g1")."""
    replies: list[JudgeReply] = []
    problems: list[tuple[str, str]] = []  # (kind, reason) of each failed attempt
    attempt_messages = messages
    attempts = 0
    while attempts < 2:
        attempts += 1
        try:
            reply = await judge.complete(attempt_messages, response_format)
        except JudgeError as exc:
            logger.warning(
                "judge %s failed on %s (attempt %s): %s", judge.model, about, attempts, exc
            )
            problems.append(("judge call failed", str(exc)))
            attempt_messages = messages  # the same question again
            continue
        except Exception as exc:  # a backend's bug: report it, do not retry
            logger.exception("judge %s raised on %s", judge.model, about)
            failure = f"judge raised {type(exc).__name__}: {exc}"
            return Asked(None, replies, attempts, failure, bug=True)
        replies.append(reply)
        try:
            parsed = parse(reply.content)
        except JudgeReplyInvalid as exc:
            logger.warning(
                "judge %s replied invalidly on %s (attempt %s): %s",
                judge.model,
                about,
                attempts,
                exc,
            )
            problems.append(("judge reply invalid", str(exc)))
            attempt_messages = correct(reply.content, str(exc))
            continue
        return Asked(parsed, replies, attempts, None)
    return Asked(None, replies, attempts, _failure(problems))


def _correction(bad: str, reason: str, ids: list[str]) -> list[dict[str, Any]]:
    return [
        {"role": "assistant", "content": bad},
        {
            "role": "user",
            "content": (
                f"Your reply was invalid: {reason}. Reply again with the corrected JSON object "
                f"only: {_reply_shape(ids)} with exactly one entry for each trajectory "
                f"({', '.join(ids)}), each with a trajectory_id, an explanation and a score "
                "from 0 to 1."
            ),
        },
    ]


def _failure(problems: list[tuple[str, str]]) -> str:
    (kind1, msg1), (kind2, msg2) = problems
    if kind1 == kind2:
        return f"{kind1} twice: {msg2}" if msg1 == msg2 else f"{kind1} twice: {msg1}; then {msg2}"
    return f"{kind1}: {msg1}; then {kind2}: {msg2}"


def _sum(values: Iterable[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None
