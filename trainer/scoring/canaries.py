"""Canaries: one synthetic member, made from a real one and no better than it, slipped into a
group before it is judged.

A canary is built on one real member of the group, its *source*, and the judge is checked
pairwise: it must not score the canary above its source. The kinds:

    declined   the default: the source's task (its messages up to and including the first user
               message), then one refusal to do it, and nothing else: no tool call, no answer
    empty      the source's conversation with an empty final answer (no text, no tool call)
    refusal    the source's conversation with a refusal as its final answer
    copied     the source's conversation with the final answer of a different task
    truncated  the source's conversation with its own final answer cut in half

Only `declined` is no better than its source under every task's own standard that rlproxy has
met: declining the task is the least any attempt does. The four that change only the final
answer assume that the final words are what is judged, and that an empty or cut answer is worse;
a task whose reward ignores the final words (the lookup agent's: its tool calls decide) makes
them equal to their source, and a reward that pays for brevity (the arithmetic agent's: an empty
reply earns 0.1, a wordy wrong one 0) makes them better. They stay for
`RLPROXY_JUDGE_CANARY_KINDS`, for a judge whose rubric says a complete answer matters.

Kinds rotate in the configured order; a kind that cannot be made for a group (no other task seen
yet, an answer too short to cut) is skipped for the next. The canary goes by an id that looks
like any member's (32 hex digits, as trajectory ids) at a random position, and the judge prompt
names every member by its position ("1", "2", ...) anyway.

A canary exists only in memory, for the one judge call: it is never written as a group member,
its score is never written as a member's score, so no read of the trainer can ever return it.
`trainer.scoring.judge_checks` records how the judge placed it (`JudgeCheckRecord`).
"""

from __future__ import annotations

import copy
import random
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from trainer.scoring.ruler import JudgeMember

CanaryKind = Literal["declined", "empty", "refusal", "copied", "truncated"]
KINDS: tuple[CanaryKind, ...] = ("declined", "empty", "refusal", "copied", "truncated")
DEFAULT_KINDS: tuple[CanaryKind, ...] = ("declined",)
"""The kinds drawn unless `RLPROXY_JUDGE_CANARY_KINDS` says otherwise (the module docstring says
why only this one)."""
REFUSAL = "I'm sorry, but I can't help with that request."
MIN_CUT_CHARS = 8
"""An answer shorter than this is not cut in half (half of "42" is not clearly worse)."""


@dataclass
class Canary:
    kind: CanaryKind
    member: JudgeMember
    position: int  # its index among the members the judge sees
    source_id: str  # the member_id of the real member it was made from


def final_text(messages: list[dict[str, Any]]) -> str:
    """The text of the last assistant message ("" when it has none)."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return "\n".join(
                    str(p.get("text") or "")
                    for p in content
                    if isinstance(p, dict) and p.get("type") == "text"
                )
            return ""
    return ""


def make_canary(
    members: list[JudgeMember],
    kind: CanaryKind,
    rng: random.Random,
    other_answer: str | None = None,
) -> JudgeMember | None:
    """A canary of `kind` built on a random member, or None when that kind cannot be made.

    `other_answer`: the final answer of a different task (needed for "copied")."""
    made = _make(members, kind, rng, other_answer)
    return None if made is None else made[0]


def _make(
    members: list[JudgeMember],
    kind: CanaryKind,
    rng: random.Random,
    other_answer: str | None,
) -> tuple[JudgeMember, str] | None:
    """`make_canary`'s canary and the id of the member it was made from (its source)."""
    candidates = [m for m in members if m.messages and m.messages[-1].get("role") == "assistant"]
    if kind == "declined":
        candidates = [m for m in members if _first_user(m.messages) is not None]
    if not candidates:
        return None
    base = rng.choice(candidates)
    if kind == "declined":
        first = _first_user(base.messages) or 0  # never None: the candidates have one
        task = copy.deepcopy(base.messages[: first + 1])
        task.append({"role": "assistant", "content": REFUSAL})
        return JudgeMember(uuid.uuid4().hex, task, copy.deepcopy(base.tools)), base.member_id
    answer = final_text(base.messages)
    if kind == "empty":
        text = ""
    elif kind == "refusal":
        text = REFUSAL
    elif kind == "copied":
        if not other_answer or other_answer.strip() == answer.strip():
            return None
        text = other_answer
    else:
        if len(answer) < MIN_CUT_CHARS:
            return None
        text = answer[: len(answer) // 2]
    messages = copy.deepcopy(base.messages[:-1])
    messages.append({"role": "assistant", "content": text})
    return JudgeMember(uuid.uuid4().hex, messages, copy.deepcopy(base.tools)), base.member_id


def _first_user(messages: list[dict[str, Any]]) -> int | None:
    return next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)


def insert_canary(
    members: list[JudgeMember],
    kinds: list[CanaryKind],
    rng: random.Random,
    other_answer: str | None = None,
) -> Canary | None:
    """Try `kinds` in order; the first canary that can be made, with a random position among
    `len(members) + 1`. None when no kind fits this group."""
    for kind in kinds:
        made = _make(members, kind, rng, other_answer)
        if made is not None:
            return Canary(kind, made[0], rng.randrange(len(members) + 1), made[1])
    return None
