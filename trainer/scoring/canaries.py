"""Canaries: one synthetic member, known to be bad, slipped into a group before it is judged.

A canary copies a real member's conversation and replaces its final answer with one that cannot
be better than the real answers of the group:

    empty      an empty final answer (no text, no tool call)
    refusal    a refusal to do the task
    copied     the final answer of a different task, judged earlier
    truncated  the real member's own final answer cut in half

Kinds rotate in that order; a kind that cannot be made for a group (no other task seen yet, an
answer too short to cut) is skipped for the next. The canary goes by an id that looks like any
member's (32 hex digits, as trajectory ids) at a random position, and the judge prompt names every
member by its position ("1", "2", ...) anyway.

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

CanaryKind = Literal["empty", "refusal", "copied", "truncated"]
KINDS: tuple[CanaryKind, ...] = ("empty", "refusal", "copied", "truncated")
REFUSAL = "I'm sorry, but I can't help with that request."
MIN_CUT_CHARS = 8
"""An answer shorter than this is not cut in half (half of "42" is not clearly worse)."""


@dataclass
class Canary:
    kind: CanaryKind
    member: JudgeMember
    position: int  # its index among the members the judge sees


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
    candidates = [m for m in members if m.messages and m.messages[-1].get("role") == "assistant"]
    if not candidates:
        return None
    base = rng.choice(candidates)
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
    return JudgeMember(uuid.uuid4().hex, messages, copy.deepcopy(base.tools))


def insert_canary(
    members: list[JudgeMember],
    kinds: list[CanaryKind],
    rng: random.Random,
    other_answer: str | None = None,
) -> Canary | None:
    """Try `kinds` in order; the first canary that can be made, with a random position among
    `len(members) + 1`. None when no kind fits this group."""
    for kind in kinds:
        member = make_canary(members, kind, rng, other_answer)
        if member is not None:
            return Canary(kind, member, rng.randrange(len(members) + 1))
    return None
