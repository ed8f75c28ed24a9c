"""RULER: an LLM judge scores the members of one group against each other, each in [0, 1].

GRPO only needs rewards that rank the attempts of a group correctly, not an absolute measure, so
one judge call sees every member of a group side by side and gives each a score relative to the
others, with an explanation (RULER, from OpenPipe's ART). The prompt shows the messages that all
members share (system prompt, task, earlier turns) once, then each member's own continuation
under a short id ("1", "2", ...); the judge answers with JSON in a strict schema, which is
validated here. A malformed or incomplete reply is retried once with the error stated; a
transport failure (timeout, HTTP 5xx, unreachable provider) is retried once as it was. A group
whose judging still fails is reported as failed, with the reason; `score_group` never raises.

    judge = LiteLLMJudge("openai/o3")
    result = await score_group(JudgeGroup(group_id, members, tools), judge)
    if result.status == "scored": ... result.scores ...

The judge is any model litellm can reach (`trainer.rewards.litellm_judge.LiteLLMJudge`), or anything
else that implements the `Judge` protocol (the local engine, a test's script).

This module does not read or write the database, does not decide which groups are ready to be
judged, and does not decide whether RULER's score or an explicit reward wins: storage and the
scoring loop do that.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

logger = logging.getLogger(__name__)

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


def build_judge_messages(group: JudgeGroup) -> list[dict[str, Any]]:
    """The judge's conversation: a system message (rubric, how to reply) and one user message
    (tools once, the shared prefix once, then each member's remainder under its short id)."""
    ids = short_ids(len(group.members))
    prefix = shared_prefix(group.members)
    parts = [
        f"Below are {len(ids)} trajectories: attempts by an AI agent at the same task. "
        "Score each one relative to the others, following the rubric."
    ]
    if group.tools:
        tools = json.dumps(group.tools, indent=1, ensure_ascii=False)
        parts.append(f"<tools>\nThe agent could call these tools:\n{tools}\n</tools>")
    if prefix:
        first = group.members[0].messages
        shared = _render_messages(first[:prefix], _tool_names(first))
        parts.append(
            f"<shared_context>\nEvery trajectory begins with these {prefix} messages:\n\n"
            f"{shared}\n</shared_context>"
        )
    for short, member in zip(ids, group.members, strict=True):
        own = _render_messages(member.messages[prefix:], _tool_names(member.messages))
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


def _tool_names(messages: list[dict[str, Any]]) -> dict[str, str]:
    """tool_call_id -> function name, so that tool results can say which tool answered."""
    names = {}
    for m in messages:
        for call in m.get("tool_calls") or []:
            if call.get("id"):
                names[call["id"]] = (call.get("function") or {}).get("name") or "?"
    return names


def _render_messages(messages: list[dict[str, Any]], names: dict[str, str]) -> str:
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
    text = (content or "").strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    if not text:
        raise JudgeReplyInvalid("the reply is empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise JudgeReplyInvalid(f"the reply is not valid JSON ({exc})") from exc
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
    messages = build_judge_messages(group)
    response_format = response_format_for(group)
    started = time.monotonic()
    attempts = 0
    replies: list[JudgeReply] = []

    def result(failure: str | None, parsed: list[tuple[str, float, str]]) -> JudgeResult:
        costs = [r.cost_usd for r in replies if r.cost_usd is not None]
        return JudgeResult(
            status="scored" if failure is None else "failed",
            scores=[
                MemberScore(member.member_id, score, explanation)
                for member, (_, score, explanation) in zip(group.members, parsed, strict=False)
            ],
            failure=failure,
            judge_model=judge.model,
            rubric_hash=rubric_hash(group.rubric),
            latency_s=time.monotonic() - started,
            attempts=attempts,
            prompt_tokens=_sum(r.prompt_tokens for r in replies),
            completion_tokens=_sum(r.completion_tokens for r in replies),
            cost_usd=sum(costs) if costs else None,
        )

    if not group.members:
        return result("the group has no members", [])
    problems: list[tuple[str, str]] = []  # (kind, reason) of each failed attempt
    attempt_messages = messages
    while attempts < 2:
        attempts += 1
        try:
            reply = await judge.complete(attempt_messages, response_format)
        except JudgeError as exc:
            logger.warning(
                "judge %s failed on group %s (attempt %s): %s",
                judge.model,
                group.group_id,
                attempts,
                exc,
            )
            problems.append(("judge call failed", str(exc)))
            attempt_messages = messages  # the same question again
            continue
        except Exception as exc:  # a backend's bug: report it, do not retry
            logger.exception("judge %s raised on group %s", judge.model, group.group_id)
            return result(f"judge raised {type(exc).__name__}: {exc}", [])
        replies.append(reply)
        try:
            parsed = parse_judge_reply(reply.content, ids)
        except JudgeReplyInvalid as exc:
            logger.warning(
                "judge %s replied invalidly on group %s (attempt %s): %s",
                judge.model,
                group.group_id,
                attempts,
                exc,
            )
            problems.append(("judge reply invalid", str(exc)))
            attempt_messages = [*messages, *_correction(reply.content, str(exc), ids)]
            continue
        return result(None, parsed)
    return result(_failure(problems), [])


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
