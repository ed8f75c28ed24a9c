"""RULER: the judge prompt, the reply's validation, retries, and litellm against a fake judge.

The paid judge model cannot run here, so `LiteLLMJudge` is tested against a fake judge server on
loopback (tests/e2e/fake_judge.py) that speaks OpenAI's Chat Completions protocol; everything
else is driven with a scripted in-process judge.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from tests.e2e.fake_judge import COMPLETION_TOKENS, PROMPT_TOKENS, FakeJudge, FakeJudgeServer
from trainer.scoring.litellm_judge import LiteLLMJudge
from trainer.scoring.ruler import (
    DEFAULT_RUBRIC,
    JudgeError,
    JudgeGroup,
    JudgeMember,
    JudgeReply,
    JudgeReplyInvalid,
    build_judge_messages,
    parse_judge_reply,
    response_format_for,
    rubric_hash,
    score_group,
    shared_prefix,
)

SYSTEM = {"role": "system", "content": "You are a travel agent. Book what the user asks."}
TASK = {"role": "user", "content": "Book a table for two at 7 pm at Luigi's."}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "book_table",
            "description": "Reserve a restaurant table (unique tool description).",
            "parameters": {
                "type": "object",
                "properties": {"restaurant": {"type": "string"}, "time": {"type": "string"}},
                "required": ["restaurant", "time"],
            },
        },
    }
]
CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "book_table", "arguments": '{"restaurant": "Luigi\'s"}'},
        }
    ],
}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "error: time is required"}


def said(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def group_of(*tails: list[dict[str, Any]], tools: Any = TOOLS) -> JudgeGroup:
    """Members that share SYSTEM, TASK, CALL, RESULT and continue with their own tail."""
    members = [
        JudgeMember(f"trajectory-{'x' * 40}-{n}", [SYSTEM, TASK, CALL, RESULT, *tail])
        for n, tail in enumerate(tails)
    ]
    return JudgeGroup("group-1", members, tools)


def three() -> JudgeGroup:
    return group_of(
        [said("Booked Luigi's for two at 7 pm (alpha).")],
        [said("Sorry, I cannot book restaurants (bravo).")],
        [
            said("Let me retry with the time (charlie)."),
            {"role": "user", "content": "Go on."},
            said("Booked, confirmation 42 (charlie done)."),
        ],
    )


def reply_json(*entries: tuple[Any, Any, Any]) -> str:
    return json.dumps(
        {"scores": [{"trajectory_id": i, "explanation": e, "score": s} for i, s, e in entries]}
    )


VALID = reply_json(("1", 0.9, "booked"), ("2", 0.0, "refused"), ("3", 0.7, "booked late"))
SHORT = reply_json(("1", 0.9, "booked"), ("2", 0.0, "refused"))
IDS = ["1", "2", "3"]


# ----------------------------------------------------------------------------- prompt


def test_prompt_shows_the_shared_prefix_once_then_each_member_in_order() -> None:
    group = three()
    system, user = build_judge_messages(group)
    text = user["content"]
    assert system["role"] == "system" and user["role"] == "user"
    assert DEFAULT_RUBRIC in system["content"]
    for shared in (SYSTEM["content"], TASK["content"], RESULT["content"]):
        assert text.count(shared) == 1, shared
    assert text.count("book_table(") == 1  # the shared tool call, rendered with its arguments
    assert 'book_table({"restaurant": "Luigi\'s"})' in text
    assert "tool result of book_table [call_1]" in text
    tags = [text.index(f'<trajectory id="{i}">') for i in IDS]
    assert tags == sorted(tags)
    assert text.index("</shared_context>") < tags[0]
    for n, own in enumerate(["(alpha)", "(bravo)", "(charlie)"]):
        start = tags[n]
        end = tags[n + 1] if n + 1 < len(tags) else len(text)
        assert text.count(own) == 1 and start < text.index(own) < end
    charlie = [text.index(s) for s in ("(charlie)", "Go on.", "(charlie done)")]
    assert charlie == sorted(charlie)
    for member in group.members:
        assert member.member_id not in text  # members go by their short ids only


def test_prompt_shows_the_tools_once_and_none_when_there_are_none() -> None:
    text = build_judge_messages(three())[1]["content"]
    assert text.count("unique tool description") == 1
    assert text.index("<tools>") < text.index("<shared_context>")
    bare = group_of([said("a")], [said("b")], tools=None)
    assert "<tools>" not in build_judge_messages(bare)[1]["content"]


def test_prompt_without_a_shared_prefix_shows_every_member_whole() -> None:
    a = JudgeMember("a", [{"role": "user", "content": "first task"}, said("one")])
    b = JudgeMember("b", [{"role": "user", "content": "other task"}, said("two")])
    text = build_judge_messages(JudgeGroup("g", [a, b], None))[1]["content"]
    assert "<shared_context>" not in text
    assert text.index("first task") < text.index('<trajectory id="2">') < text.index("other task")


def test_custom_rubric_goes_into_the_system_message() -> None:
    group = three()
    group.rubric = "Shorter answers win."
    assert "Shorter answers win." in build_judge_messages(group)[0]["content"]
    assert rubric_hash("Shorter answers win.") != rubric_hash(DEFAULT_RUBRIC)
    assert len(rubric_hash(DEFAULT_RUBRIC)) == 16


def members(*conversations: list[dict[str, Any]]) -> list[JudgeMember]:
    return [JudgeMember(str(n), list(c)) for n, c in enumerate(conversations)]


def test_shared_prefix_edge_cases() -> None:
    u, a1, a2, t = TASK, said("one"), said("two"), RESULT
    # identical up to the last message
    assert shared_prefix(members([SYSTEM, u, a1], [SYSTEM, u, a2])) == 2
    # different from the first message on
    assert shared_prefix(members([SYSTEM, u, a1], [u, a1])) == 0
    # one member is a prefix of another: the shorter keeps its last message as its own
    assert shared_prefix(members([SYSTEM, u, a1], [SYSTEM, u, a1, t, a2])) == 2
    # identical members: never the whole conversation
    assert shared_prefix(members([SYSTEM, u, a1], [SYSTEM, u, a1])) == 2
    assert shared_prefix(members([SYSTEM, u, a1])) == 2
    assert shared_prefix(members([a1], [a1])) == 0
    assert shared_prefix(members([], [a1])) == 0
    assert shared_prefix([]) == 0
    # equality is on the dicts: a different tool call id splits the prefix
    other = {**CALL, "tool_calls": [{**CALL["tool_calls"][0], "id": "call_2"}]}
    assert shared_prefix(members([u, CALL, a1], [u, other, a1])) == 1


def test_identical_members_still_show_their_last_message() -> None:
    group = JudgeGroup(
        "g",
        members([SYSTEM, TASK, said("identical-answer")], [SYSTEM, TASK, said("identical-answer")]),
        None,
    )
    text = build_judge_messages(group)[1]["content"]
    assert text.count("identical-answer") == 2


def test_response_format_is_a_strict_schema_matching_the_group() -> None:
    fmt = response_format_for(three())
    assert fmt["type"] == "json_schema"
    assert fmt["json_schema"]["name"] == "ruler_scores" and fmt["json_schema"]["strict"] is True
    schema = fmt["json_schema"]["schema"]
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(json.loads(VALID), schema)
    for bad in (
        SHORT,
        reply_json(("1", 0.9, "a"), ("2", 0.0, "b"), ("7", 0.5, "c")),
        reply_json(("1", 1.5, "a"), ("2", 0.0, "b"), ("3", 0.5, "c")),
        '{"scores": [], "extra": 1}',
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(bad), schema)


# ----------------------------------------------------------------------------- parsing


def test_parse_returns_entries_in_member_order() -> None:
    shuffled = reply_json(("3", 0.7, "late"), ("1", 1, "best"), ("2", 0.0, "refused"))
    assert parse_judge_reply(shuffled, IDS) == [
        ("1", 1.0, "best"),
        ("2", 0.0, "refused"),
        ("3", 0.7, "late"),
    ]


@pytest.mark.parametrize(
    "content",
    [f"```json\n{VALID}\n```", f"  ```\n{VALID}\n```\n", f"```JSON {VALID}```"],
    ids=["json-fence", "bare-fence", "one-line-fence"],
)
def test_parse_accepts_a_fenced_reply(content: str) -> None:
    assert [s for _, s, _ in parse_judge_reply(content, IDS)] == [0.9, 0.0, 0.7]


def test_parse_reads_integer_ids_as_strings() -> None:
    content = reply_json((1, 0.9, "a"), (2, 0.0, "b"), (3, 0.7, "c"))
    assert [i for i, _, _ in parse_judge_reply(content, IDS)] == IDS


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("", "the reply is empty"),
        ("The first one is best.", "the reply is not valid JSON"),
        ('{"scores": [', "the reply is not valid JSON"),
        ("[1, 2, 3]", 'not a JSON object with a "scores" list'),
        ('{"ratings": []}', 'not a JSON object with a "scores" list'),
        ('{"scores": {"1": 0.5}}', 'not a JSON object with a "scores" list'),
        (SHORT, "expected 3 scores, got 2 (none for trajectory 3)"),
        (VALID.replace("]", ', {"trajectory_id": "4"}]'), "expected 3 scores, got 4"),
        (
            reply_json(("1", 0.9, "a"), ("2", 0.1, "b"), ("9", 0.5, "c")),
            "scores[2] has unknown trajectory_id '9' (expected one of 1, 2, 3)",
        ),
        (
            reply_json(("1", 0.9, "a"), ("2", 0.1, "b"), ("2", 0.5, "c")),
            "trajectory 2 is scored twice (and trajectory 3 not at all)",
        ),
        ('{"scores": [1, 2, 3]}', "scores[0] is not an object"),
        (
            json.dumps({"scores": [{"score": 1, "explanation": "x"}] * 3}),
            "scores[0] has no trajectory_id",
        ),
        (
            reply_json(("1", "high", "a"), ("2", 0.1, "b"), ("3", 0.5, "c")),
            "the score of trajectory 1 is not a number: 'high'",
        ),
        (
            reply_json(("1", True, "a"), ("2", 0.1, "b"), ("3", 0.5, "c")),
            "the score of trajectory 1 is not a number: True",
        ),
        (
            reply_json(("1", None, "a"), ("2", 0.1, "b"), ("3", 0.5, "c")),
            "the score of trajectory 1 is not a number: None",
        ),
        (
            reply_json(("1", 0.9, "a"), ("2", float("nan"), "b"), ("3", 0.5, "c")),
            "the score of trajectory 2 is NaN",
        ),
        (
            reply_json(("1", 0.9, "a"), ("2", 0.1, "b"), ("3", 1.5, "c")),
            "the score of trajectory 3 is 1.5, outside [0, 1]",
        ),
        (
            reply_json(("1", -0.1, "a"), ("2", 0.1, "b"), ("3", 0.5, "c")),
            "the score of trajectory 1 is -0.1, outside [0, 1]",
        ),
        (
            reply_json(("1", 0.9, 42), ("2", 0.1, "b"), ("3", 0.5, "c")),
            "the explanation of trajectory 1 is not a string: 42",
        ),
    ],
    ids=[
        "empty",
        "prose",
        "truncated",
        "list",
        "no-scores-key",
        "scores-not-list",
        "too-few",
        "too-many",
        "unknown-id",
        "duplicate-id",
        "entry-not-object",
        "no-id",
        "score-string",
        "score-bool",
        "score-null",
        "score-nan",
        "score-above-1",
        "score-below-0",
        "explanation-not-string",
    ],
)
def test_parse_rejects_invalid_replies_with_a_precise_reason(content: str, reason: str) -> None:
    with pytest.raises(JudgeReplyInvalid) as info:
        parse_judge_reply(content, IDS)
    assert reason in str(info.value)


# ----------------------------------------------------------------------------- score_group


class ScriptedJudge:
    """A judge backend that plays a script: each step is a reply's content or an exception."""

    model = "scripted/judge"

    def __init__(self, *steps: str | BaseException) -> None:
        self.steps = list(steps)
        self.calls: list[list[dict[str, Any]]] = []
        self.formats: list[dict[str, Any]] = []

    async def complete(
        self, messages: list[dict[str, Any]], response_format: dict[str, Any]
    ) -> JudgeReply:
        self.calls.append(messages)
        self.formats.append(response_format)
        step = self.steps.pop(0)
        if isinstance(step, BaseException):
            raise step
        return JudgeReply(step, prompt_tokens=100, completion_tokens=10, cost_usd=0.25)


async def test_valid_reply_scores_every_member_in_order() -> None:
    group, judge = three(), ScriptedJudge(VALID)
    result = await score_group(group, judge)
    assert result.status == "scored" and result.failure is None
    assert [(s.member_id, s.score, s.explanation) for s in result.scores] == [
        (group.members[0].member_id, 0.9, "booked"),
        (group.members[1].member_id, 0.0, "refused"),
        (group.members[2].member_id, 0.7, "booked late"),
    ]
    assert result.attempts == 1
    assert (result.prompt_tokens, result.completion_tokens, result.cost_usd) == (100, 10, 0.25)
    assert result.judge_model == "scripted/judge"
    assert result.rubric_hash == rubric_hash(DEFAULT_RUBRIC)
    assert result.latency_s >= 0
    assert judge.calls == [build_judge_messages(group)]
    assert judge.formats == [response_format_for(group)]


async def test_invalid_reply_is_retried_once_with_the_error_stated() -> None:
    group, judge = three(), ScriptedJudge(SHORT, VALID)
    result = await score_group(group, judge)
    assert result.status == "scored" and result.attempts == 2
    assert [s.score for s in result.scores] == [0.9, 0.0, 0.7]
    assert (result.prompt_tokens, result.completion_tokens, result.cost_usd) == (200, 20, 0.5)
    original = build_judge_messages(group)
    retry = judge.calls[1]
    assert retry[:2] == original
    assert retry[2] == {"role": "assistant", "content": SHORT}
    assert retry[3]["role"] == "user"
    assert "expected 3 scores, got 2" in retry[3]["content"]


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (SHORT, "expected 3 scores, got 2"),
        (reply_json(("1", 0.9, "a"), ("2", 0.1, "b"), ("4", 0.5, "c")), "unknown trajectory_id"),
        ("{'scores': oops", "not valid JSON"),
        (reply_json(("1", 0.9, "a"), ("2", 7, "b"), ("3", 0.5, "c")), "outside [0, 1]"),
    ],
    ids=["wrong-count", "unknown-id", "malformed-json", "out-of-range"],
)
async def test_invalid_reply_twice_fails_with_the_reason(bad: str, reason: str) -> None:
    judge = ScriptedJudge(bad, bad)
    result = await score_group(three(), judge)
    assert result.status == "failed" and result.scores == [] and result.attempts == 2
    assert result.failure is not None
    assert result.failure.startswith("judge reply invalid twice: ")
    assert reason in result.failure
    assert result.prompt_tokens == 200  # failed calls cost tokens too


async def test_judge_error_is_retried_once_with_the_same_messages() -> None:
    group, judge = three(), ScriptedJudge(JudgeError("judge timed out after 1 s"), VALID)
    result = await score_group(group, judge)
    assert result.status == "scored" and result.attempts == 2
    assert judge.calls == [build_judge_messages(group)] * 2
    assert result.prompt_tokens == 100  # only the reply that came reported usage


async def test_judge_error_twice_fails_with_both_reasons() -> None:
    judge = ScriptedJudge(JudgeError("timed out"), JudgeError("answered HTTP 500"))
    result = await score_group(three(), judge)
    assert result.status == "failed" and result.attempts == 2
    assert result.failure == "judge call failed twice: timed out; then answered HTTP 500"
    assert result.prompt_tokens is None and result.cost_usd is None


async def test_invalid_reply_then_judge_error_names_both() -> None:
    result = await score_group(three(), ScriptedJudge(SHORT, JudgeError("HTTP 502")))
    assert result.status == "failed"
    assert result.failure == (
        "judge reply invalid: expected 3 scores, got 2 (none for trajectory 3); "
        "then judge call failed: HTTP 502"
    )


async def test_unexpected_exception_fails_without_retry(caplog: pytest.LogCaptureFixture) -> None:
    judge = ScriptedJudge(RuntimeError("backend bug"), VALID)
    result = await score_group(three(), judge)
    assert result.status == "failed" and result.attempts == 1 and len(judge.calls) == 1
    assert result.failure == "judge raised RuntimeError: backend bug"
    assert any(r.exc_info for r in caplog.records if r.name == "trainer.scoring.ruler")


async def test_cancellation_is_not_swallowed() -> None:
    with pytest.raises(asyncio.CancelledError):
        await score_group(three(), ScriptedJudge(asyncio.CancelledError()))


async def test_empty_group_fails_without_calling_the_judge() -> None:
    judge = ScriptedJudge()
    result = await score_group(JudgeGroup("g", [], None), judge)
    assert result.status == "failed" and result.attempts == 0 and judge.calls == []


# ----------------------------------------------------------------------------- litellm


@pytest.fixture(scope="module")
def judge_server() -> Iterator[FakeJudge]:
    with FakeJudgeServer() as fake:
        yield fake


@pytest.fixture
def fake(judge_server: FakeJudge) -> Iterator[FakeJudge]:
    judge_server.reset()
    yield judge_server
    assert judge_server.pending == 0, "the test scripted replies the judge never asked for"


def litellm_judge(fake: FakeJudge, timeout_s: float = 2.0) -> LiteLLMJudge:
    return LiteLLMJudge(
        "openai/judge", api_base=fake.base_url, api_key="sk-test", timeout_s=timeout_s
    )


async def test_litellm_valid_reply(fake: FakeJudge) -> None:
    group = three()
    fake.reply(f"```json\n{VALID}\n```")
    result = await score_group(group, litellm_judge(fake))
    assert result.status == "scored", result.failure
    assert [s.score for s in result.scores] == [0.9, 0.0, 0.7]
    assert (result.prompt_tokens, result.completion_tokens) == (PROMPT_TOKENS, COMPLETION_TOKENS)
    assert result.cost_usd is None  # "judge" has no price in litellm's map
    assert result.judge_model == "openai/judge"
    (body,) = fake.requests
    assert body["model"] == "judge"
    assert body["messages"] == build_judge_messages(group)
    assert body["response_format"] == response_format_for(group)  # passed through as given
    assert "temperature" not in body


async def test_litellm_wrong_count_twice_fails_and_sums_tokens(fake: FakeJudge) -> None:
    fake.reply(SHORT).reply(SHORT)
    result = await score_group(three(), litellm_judge(fake))
    assert result.status == "failed", result
    assert result.failure == (
        "judge reply invalid twice: expected 3 scores, got 2 (none for trajectory 3)"
    )
    assert (result.prompt_tokens, result.completion_tokens) == (
        2 * PROMPT_TOKENS,
        2 * COMPLETION_TOKENS,
    )
    retry = fake.requests[1]["messages"]
    assert retry[-2] == {"role": "assistant", "content": SHORT}
    assert "expected 3 scores, got 2" in retry[-1]["content"]


async def test_litellm_unknown_id_then_valid(fake: FakeJudge) -> None:
    fake.reply(reply_json(("1", 0.9, "a"), ("2", 0.1, "b"), ("x", 0.5, "c"))).reply(VALID)
    result = await score_group(three(), litellm_judge(fake))
    assert result.status == "scored" and result.attempts == 2
    assert "unknown trajectory_id 'x'" in fake.requests[1]["messages"][-1]["content"]


async def test_litellm_malformed_json_twice(fake: FakeJudge) -> None:
    fake.reply("I think the first one is best.").reply('{"scores": [')
    result = await score_group(three(), litellm_judge(fake))
    assert result.status == "failed"
    assert result.failure is not None and "not valid JSON" in result.failure


async def test_litellm_timeout_then_valid(fake: FakeJudge) -> None:
    fake.delay(5, VALID).reply(VALID)
    result = await score_group(three(), litellm_judge(fake, timeout_s=1))
    assert result.status == "scored" and result.attempts == 2
    assert 1 <= result.latency_s < 4
    assert result.prompt_tokens == PROMPT_TOKENS  # the timed-out call reported nothing


async def test_litellm_timeout_then_500_fails_naming_both(fake: FakeJudge) -> None:
    fake.delay(5, VALID).status(500, "The judge fell over.")
    result = await score_group(three(), litellm_judge(fake, timeout_s=1))
    assert result.status == "failed" and result.attempts == 2
    assert result.failure is not None
    assert result.failure.startswith(
        "judge call failed twice: judge openai/judge timed out after 1 s; "
        "then judge openai/judge answered HTTP 500"
    )
    assert "The judge fell over." in result.failure
    assert len(fake.requests) == 2  # litellm itself did not retry


async def test_litellm_500_then_valid(fake: FakeJudge) -> None:
    fake.status(500).reply(VALID)
    result = await score_group(three(), litellm_judge(fake))
    assert result.status == "scored" and result.attempts == 2


async def test_litellm_provider_4xx_is_a_judge_error(fake: FakeJudge) -> None:
    fake.status(400, "response_format is not supported").status(400, "still not")
    result = await score_group(three(), litellm_judge(fake))
    assert result.status == "failed"
    assert result.failure is not None and "answered HTTP 400" in result.failure
    assert "response_format is not supported" in result.failure


async def test_litellm_reply_without_usage_has_no_token_counts(fake: FakeJudge) -> None:
    fake.reply(VALID, usage=False)
    result = await score_group(three(), litellm_judge(fake))
    assert result.status == "scored"
    assert (result.prompt_tokens, result.completion_tokens) == (None, None)


async def test_litellm_unreachable_judge() -> None:
    with FakeJudgeServer() as gone:
        port = gone.port
    judge = LiteLLMJudge(
        "openai/judge", api_base=f"http://127.0.0.1:{port}/v1", api_key="sk-test", timeout_s=2
    )
    with pytest.raises(JudgeError, match="is unreachable"):
        await judge.complete([{"role": "user", "content": "hi"}], {"type": "text"})


async def test_litellm_passes_temperature_only_when_set(fake: FakeJudge) -> None:
    fake.reply(VALID)
    judge = LiteLLMJudge("openai/judge", api_base=fake.base_url, api_key="k", temperature=0.2)
    await score_group(three(), judge)
    assert fake.requests[0]["temperature"] == 0.2
