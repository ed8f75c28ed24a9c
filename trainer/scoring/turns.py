"""Per-turn judging: each assistant turn of a member is judged from what came next.

The option beside RULER's whole-episode comparison (`trainer.scoring.ruler.score_group`), chosen
with `RLPROXY_JUDGE_MODE=turns`; after OpenClaw-RL's process reward. It suits traffic whose every
task is new: a member is judged against its own task only, never against the other members.

- A turn is one assistant message of a member (a tool call, an answer, a question back).
- The judge sees the tools, the member's task (messages up to the first user message), what came
  before the turn, the turn, and what came next: the tool results or user messages up to the
  agent's next turn, never later (no hindsight beyond the next state). It answers
  `{"explanation", "score"}` with score +1 (good), 0 (neutral) or -1 (bad).
- The last turn has nothing after it. It is judged on the final state: whether, with everything
  before it, the agent's work on its task is done and right. (Leaving it neutral would make a
  right and a wrong final answer score the same, and the final answer is where most tasks are won
  or lost.)
- Each turn is asked `votes` times (default 3, `RLPROXY_JUDGE_VOTES`); its verdict is the label
  with strictly the most votes, and neutral (0) when no label has. Three is the smallest count
  in which one stray vote is outvoted; the votes differ only as far as the judge samples (a
  greedy judge, as the local one, gives three equal votes: use 1 with it).
- A member's score is its mean verdict mapped from [-1, 1] to [0, 1]: (mean + 1) / 2, every turn
  weighing the same; a member with no assistant turn scores 0.5. The per-turn verdicts, their
  votes and one explanation each are kept in the member's stored explanation.

Every call is validated and retried once like RULER's (`trainer.scoring.ruler.ask_judge`). A vote
that still fails is dropped and the turn's other votes decide; a turn whose every vote failed, or
a judge backend that raised, fails the group with the reason. Never raises (except
CancelledError). A group costs members x turns x votes judge calls (at most `concurrency` at a
time), each with the member's conversation up to the turn.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trainer.scoring.ruler import (
    Asked,
    Judge,
    JudgeGroup,
    JudgeMember,
    JudgeReply,
    JudgeReplyInvalid,
    JudgeResult,
    MemberScore,
    ask_judge,
    load_reply_json,
    render_messages,
    rubric_hash,
    task_length,
    tool_names,
    tools_json,
)

logger = logging.getLogger(__name__)

DEFAULT_VOTES = 3
"""Judge calls per turn; the turn's verdict is their majority."""
DEFAULT_CONCURRENCY = 8
"""Judge calls of one group in flight at once."""

DEFAULT_TURN_RUBRIC = """\
- Good (+1): the turn moves the task forward correctly: the right tool with the right arguments, \
a correct and supported answer, a question the task needed. What came next bears it out (a \
useful result, the user satisfied or moving on).
- Bad (-1): the turn is wrong or wasteful: a call that fails through the agent's own fault, \
wrong arguments, repeating a step that already failed or already succeeded, an answer that is \
wrong, made up or ignores what the tools returned, a refusal without cause. What came next \
shows it (an error, the user correcting or complaining).
- Neutral (0): the turn neither helps nor hurts, or what came next does not tell.
- The agent's last message is judged on the final state: good when the task is done and the \
answer right, bad when it is wrong or leaves the task undone."""

VERDICT_NAMES = {1: "good", 0: "neutral", -1: "bad"}


# ----------------------------------------------------------------------------- prompt


def turn_positions(messages: list[dict[str, Any]]) -> list[int]:
    """The indices of a member's assistant messages: its turns, in order."""
    return [i for i, m in enumerate(messages) if m.get("role") == "assistant"]


def build_turn_messages(
    member: JudgeMember, position: int, tools: list[dict[str, Any]] | None, rubric: str
) -> list[dict[str, Any]]:
    """The judge's conversation for the turn at `member.messages[position]`: a system message
    (rubric, how to reply) and one user message (tools, task, what came before, the turn, what
    came next)."""
    messages = member.messages
    names = tool_names(messages)
    turns = turn_positions(messages)
    number = turns.index(position) + 1
    later = [p for p in turns if p > position]
    start = min(task_length(messages), position)
    parts = []
    if tools:
        parts.append(f"<tools>\nThe agent could call these tools:\n{tools_json(tools)}\n</tools>")
    task = render_messages(messages[:start], names) if start else "(no task message)"
    parts.append(f"<task>\n{task}\n</task>")
    if position > start:
        before = render_messages(messages[start:position], names)
        parts.append(f"<before>\nWhat came before the turn:\n\n{before}\n</before>")
    turn = render_messages([messages[position]], names)
    parts.append(f"<turn>\nThe agent's turn {number} of {len(turns)}:\n\n{turn}\n</turn>")
    if position == len(messages) - 1:
        after = (
            "Nothing: this was the agent's last message, the trajectory ended with it. Judge it on "
            "the final state: whether, with everything above, the agent's work on its task is "
            "done and right."
        )
    else:
        nxt = messages[position + 1 : later[0] if later else len(messages)]
        after = render_messages(nxt, names) if nxt else "Nothing before the agent's next turn."
    parts.append(f"<what_came_next>\n{after}\n</what_came_next>")
    parts.append(
        f"Judge turn {number} only. Reply with one JSON object and nothing else: "
        '{"explanation": "...", "score": 1} with score 1 (good), 0 (neutral) or -1 (bad).'
    )
    return [
        {"role": "system", "content": _system_prompt(rubric)},
        {"role": "user", "content": "\n\n".join(parts)},
    ]


def _system_prompt(rubric: str) -> str:
    return (
        "You are a careful, impartial judge of an AI agent's single turns. You are shown the "
        "agent's task, what came before one of its turns, that turn, and what came next (the tool "
        "results or the user's reply that followed it). Judge that one turn: good (+1), bad (-1) "
        "or neutral (0). What came next is your best evidence of how the turn went.\n\n"
        f"Rubric:\n{rubric}\n\n"
        "Give an explanation of a sentence or two (write it before deciding the score), then the "
        "score: 1, 0 or -1."
    )


def turn_response_format() -> dict[str, Any]:
    """OpenAI structured output: one {explanation, score} with score one of 1, 0, -1."""
    schema = {
        "type": "object",
        "properties": {
            "explanation": {"type": "string"},
            "score": {"type": "integer", "enum": [1, 0, -1]},
        },
        "required": ["explanation", "score"],
        "additionalProperties": False,
    }
    return {
        "type": "json_schema",
        "json_schema": {"name": "turn_verdict", "strict": True, "schema": schema},
    }


# ----------------------------------------------------------------------------- reply


def parse_turn_reply(content: str) -> tuple[int, str]:
    """The judge's verdict on one turn as (score, explanation); raises JudgeReplyInvalid with
    the reason otherwise. A fenced reply is accepted, and so is -1.0 for -1."""
    data = load_reply_json(content)
    if not isinstance(data, dict) or "score" not in data:
        raise JudgeReplyInvalid('the reply is not a JSON object with a "score"')
    score = data["score"]
    if isinstance(score, bool) or not isinstance(score, int | float) or score not in (1, 0, -1):
        raise JudgeReplyInvalid(f"the score is {score!r}, not one of 1, 0, -1")
    explanation = data.get("explanation")
    if not isinstance(explanation, str):
        raise JudgeReplyInvalid(f"the explanation is not a string: {explanation!r}")
    return int(score), explanation


def _correction(bad: str, reason: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        *messages,
        {"role": "assistant", "content": bad},
        {
            "role": "user",
            "content": (
                f"Your reply was invalid: {reason}. Reply again with the corrected JSON object "
                'only: {"explanation": "...", "score": 1} with score 1, 0 or -1.'
            ),
        },
    ]


# ----------------------------------------------------------------------------- votes and scores


def majority(votes: Sequence[int]) -> int:
    """The verdict with strictly the most votes; 0 (neutral) when two verdicts tie for most."""
    counts = Counter(votes).most_common()
    if not counts or (len(counts) > 1 and counts[0][1] == counts[1][1]):
        return 0
    return counts[0][0]


def score_of_verdicts(verdicts: Sequence[int]) -> float:
    """A member's score: its mean turn verdict mapped from [-1, 1] to [0, 1]; 0.5 with none."""
    if not verdicts:
        return 0.5
    return (math.fsum(verdicts) / len(verdicts) + 1) / 2


@dataclass
class TurnVerdict:
    number: int  # 1-based among the member's turns
    label: str  # what the turn did: its tool names, or "answer"
    last: bool
    votes: list[int]  # the valid votes, in the order they came
    explanation: str  # one explanation of a vote that agrees with the verdict
    failed_votes: int

    @property
    def verdict(self) -> int:
        return majority(self.votes)

    def line(self) -> str:
        votes = " ".join(f"{v:+d}" if v else "0" for v in self.votes)
        if self.failed_votes:
            s = "s" if self.failed_votes > 1 else ""
            votes += f"; {self.failed_votes} vote{s} failed"
        last = ", the last: judged on the final state" if self.last else ""
        return (
            f"turn {self.number} ({self.label}{last}): {VERDICT_NAMES[self.verdict]} ({votes}): "
            f"{self.explanation}"
        )


def explain(verdicts: list[TurnVerdict], votes: int) -> str:
    """A member's stored explanation: its score, then one line per turn."""
    values = [v.verdict for v in verdicts]
    mean = math.fsum(values) / len(values) if values else 0.0
    head = (
        f"Per-turn judge ({votes} vote{'s' if votes > 1 else ''} a turn): score "
        f"{score_of_verdicts(values):.2f} = (mean verdict {mean:+.2f} + 1) / 2"
    )
    return "\n".join([head, *(v.line() for v in verdicts)])


def _label(message: dict[str, Any]) -> str:
    calls = [(c.get("function") or {}).get("name") or "?" for c in message.get("tool_calls") or []]
    return ", ".join(calls) if calls else "answer"


# ----------------------------------------------------------------------------- scoring


class _GroupFailed(Exception):
    """A turn could not be judged: the group fails with this reason."""


@dataclass
class TurnScoring:
    """Judges a group turn by turn; a `trainer.scoring.ruler.ScoreGroup`."""

    votes: int = DEFAULT_VOTES
    concurrency: int = DEFAULT_CONCURRENCY

    def __post_init__(self) -> None:
        if self.votes < 1:
            raise ValueError(f"votes must be at least 1 (judge calls per turn), not {self.votes}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, not {self.concurrency}")

    async def __call__(self, group: JudgeGroup, judge: Judge) -> JudgeResult:
        """Judge every turn of every member; never raises (except CancelledError)."""
        started = time.monotonic()
        asked: list[Asked[tuple[int, str]]] = []
        verdicts: dict[tuple[int, int], TurnVerdict] = {}  # (member index, turn number)
        limit = asyncio.Semaphore(self.concurrency)

        async def vote(messages: list[dict[str, Any]], about: str) -> Asked[tuple[int, str]]:
            async with limit:
                answer = await ask_judge(
                    judge,
                    messages,
                    turn_response_format(),
                    parse_turn_reply,
                    lambda bad, reason: _correction(bad, reason, messages),
                    about,
                )
            asked.append(answer)
            return answer

        async def judge_turn(index: int, member: JudgeMember, position: int) -> None:
            tools = member.tools if member.tools is not None else group.tools
            messages = build_turn_messages(member, position, tools, group.rubric)
            turns = turn_positions(member.messages)
            number = turns.index(position) + 1
            where = f"trajectory {index + 1}, turn {number}"
            about = f"group {group.group_id}, {where}"
            answers = await asyncio.gather(*(vote(messages, about) for _ in range(self.votes)))
            bug = next((a for a in answers if a.bug), None)
            if bug is not None:
                raise _GroupFailed(f"{where}: {bug.failure}")
            valid = [a.parsed for a in answers if a.parsed is not None]
            if not valid:
                raise _GroupFailed(f"{where}: every vote failed: {answers[0].failure}")
            decided = majority([score for score, _ in valid])
            why = next((e for s, e in valid if s == decided), valid[0][1])
            verdicts[(index, number)] = TurnVerdict(
                number=number,
                label=_label(member.messages[position]),
                last=position == len(member.messages) - 1,
                votes=[score for score, _ in valid],
                explanation=why,
                failed_votes=len(answers) - len(valid),
            )

        def result(failure: str | None, scores: list[MemberScore]) -> JudgeResult:
            replies: list[JudgeReply] = [r for a in asked for r in a.replies]
            costs = [r.cost_usd for r in replies if r.cost_usd is not None]
            return JudgeResult(
                status="scored" if failure is None else "failed",
                scores=scores,
                failure=failure,
                judge_model=judge.model,
                rubric_hash=rubric_hash(group.rubric),
                latency_s=time.monotonic() - started,
                attempts=sum(a.attempts for a in asked),
                prompt_tokens=_sum([r.prompt_tokens for r in replies]),
                completion_tokens=_sum([r.completion_tokens for r in replies]),
                cost_usd=math.fsum(costs) if costs else None,
            )

        if not group.members:
            return result("the group has no members", [])
        tasks: list[asyncio.Task[None]] = []
        failures: list[str] = []
        try:
            async with asyncio.TaskGroup() as tg:
                for index, member in enumerate(group.members):
                    for position in turn_positions(member.messages):
                        tasks.append(tg.create_task(judge_turn(index, member, position)))
        except* _GroupFailed as failed:
            failures += [str(e) for e in failed.exceptions]
        except* Exception as raised:  # a bug here: reported as the group's failure
            logger.error("per-turn judging of group %s raised", group.group_id, exc_info=raised)
            failures += [
                f"per-turn judging raised {type(e).__name__}: {e}" for e in raised.exceptions
            ]
        if failures:
            logger.warning("per-turn judging of group %s failed: %s", group.group_id, failures[0])
            return result(failures[0], [])
        if any(t.cancelled() for t in tasks):
            raise asyncio.CancelledError  # a judge call was cancelled (a backend shutting down)
        scores = []
        for index, member in enumerate(group.members):
            mine = [
                verdicts[(index, n)] for n in range(1, len(turn_positions(member.messages)) + 1)
            ]
            score = score_of_verdicts([v.verdict for v in mine])
            scores.append(MemberScore(member.member_id, score, explain(mine, self.votes)))
        return result(None, scores)


def _sum(values: list[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None
