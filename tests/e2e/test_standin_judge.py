"""The stand-in judge (bench/standin_judge.py), a fixture of known quality, is what it says: its
measured pair accuracy is the one it was given, at small and large reward gaps alike; it answers
RULER's request, as rlproxy's own client sends it, in RULER's reply format; and it recomputes the
lookup agent's and the arithmetic agent's rewards from the rendered episode as each agent's
environment computes them."""

from __future__ import annotations

import copy
import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.standin_judge import (
    StandinJudge,
    StandinJudgeServer,
    arithmetic_truth,
    lookup_truth,
    noisy_scores,
    pair_accuracy_of,
)
from trainer.scoring.litellm_judge import LiteLLMJudge
from trainer.scoring.ruler import JudgeGroup, JudgeMember, build_judge_messages, score_group

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import arithmetic_agent
import lookup_agent

LEVELS = [0.0, 0.1, 0.5, 1.0]  # gaps from 0.1 (0 against 0.1) to 1.0 (0 against 1)


@pytest.mark.parametrize("p", [0.5, 0.75, 0.9, 1.0])
def test_pairs_are_ordered_correctly_with_the_given_probability_at_any_gap(p: float) -> None:
    rng = random.Random(f"pairs-{p}")
    right = total = 0
    by_gap: dict[str, list[int]] = {"small": [0, 0], "large": [0, 0]}
    for _ in range(6000):
        rewards = [rng.choice(LEVELS) for _ in range(4)]
        scores, _ = noisy_scores(rewards, p, rng)
        r, t = pair_accuracy_of(rewards, scores)
        right, total = right + r, total + t
        for i in range(4):
            for j in range(i + 1, 4):
                gap = abs(rewards[i] - rewards[j])
                if gap == 0.1 or gap >= 0.9:
                    kind = by_gap["small" if gap == 0.1 else "large"]
                    kind[0] += (rewards[i] - rewards[j]) * (scores[i] - scores[j]) > 0
                    kind[1] += 1
    assert total > 25000
    assert right / total == pytest.approx(p, abs=0.015)
    for kind, (r, t) in by_gap.items():
        assert t > 2000 and r / t == pytest.approx(p, abs=0.03), kind


def test_the_pair_accuracy_must_lie_between_a_coin_flip_and_the_truth() -> None:
    for bad in (0.4, 1.1):
        with pytest.raises(ValueError, match="pair_accuracy"):
            StandinJudge(bad)
        with pytest.raises(ValueError, match="pair_accuracy"):
            noisy_scores([0.0, 1.0], bad, random.Random(0))


def test_its_replies_to_rulers_prompts_hold_the_pair_accuracy() -> None:
    """The same measurement through the whole reply path: RULER's prompt in, RULER's JSON out."""
    judge = StandinJudge(0.8, seed=7)
    rng = random.Random("replies")
    right = total = 0
    for g in range(1500):
        rewards = [rng.choice(LEVELS) for _ in range(4)]
        markers = [f"[g{g}-m{n}]" for n in range(4)]
        judge.posted.fragments.update(zip(markers, rewards, strict=True))
        group = JudgeGroup("g", [member(n, "Q?", m) for n, m in enumerate(markers)], None)
        reply = json.loads(judge.reply(build_judge_messages(group)))
        r, t = pair_accuracy_of(rewards, [e["score"] for e in reply["scores"]])
        right, total = right + r, total + t
    assert right / total == pytest.approx(0.8, abs=0.03)
    assert judge.stats["informed"] + judge.stats["blind"] == 1500


# ----------------------------------------------------------------------------- over HTTP

SYSTEM = {"role": "system", "content": "Answer the question."}


def member(n: int, question: str, marker: str) -> JudgeMember:
    messages = [SYSTEM, {"role": "user", "content": question}]
    return JudgeMember(f"m{n}", [*messages, {"role": "assistant", "content": f"ok {marker}"}])


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, StandinJudge]]:
    judge = StandinJudge(1.0, seed=1)
    with StandinJudgeServer(judge) as url:
        yield url, judge


def litellm(url: str) -> LiteLLMJudge:
    return LiteLLMJudge("openai/standin", api_base=url, api_key="sk-test", timeout_s=30)


@pytest.mark.parametrize("tasks", ["same", "different"])
async def test_it_answers_rulers_request_with_the_posted_true_rewards(
    server: tuple[str, StandinJudge], tasks: str
) -> None:
    url, judge = server
    truth = {"[nonce-a]": 0.2, "[nonce-b]": 0.9, "[nonce-c]": 0.5}
    base = url.removesuffix("/v1")
    async with httpx.AsyncClient() as http:
        assert (await http.delete(f"{base}/truth")).status_code == 200
        posted = await http.post(f"{base}/truth", json={"fragments": truth})
        assert posted.json() == {"fragments": 3}
        bad = await http.post(f"{base}/truth", json={"fragments": {"x": "high"}})
        assert bad.status_code == 400
    questions = ["Q?"] * 3 if tasks == "same" else ["Q1?", "Q2?", "Q3?"]
    group = JudgeGroup(
        "g", [member(n, q, m) for n, (q, m) in enumerate(zip(questions, truth, strict=True))], None
    )
    assert ("<shared_context>" in build_judge_messages(group)[1]["content"]) == (tasks == "same")
    before = judge.stats["requests"]
    result = await score_group(group, litellm(url))
    assert result.status == "scored", result.failure
    assert [s.score for s in result.scores] == [0.2, 0.9, 0.5]
    assert "from its true reward; true reward 0.9" in result.scores[1].explanation
    assert judge.stats["requests"] == before + 1 and result.prompt_tokens


async def test_an_unknown_member_gets_the_unknown_reward_and_a_turn_request_is_refused(
    server: tuple[str, StandinJudge],
) -> None:
    url, judge = server
    group = JudgeGroup("g", [member(0, "Q?", "[nonce-a]"), member(1, "Q?", "[no-truth]")], None)
    unknown = judge.stats["unknown"]
    result = await score_group(group, litellm(url))
    assert [s.score for s in result.scores] == [0.2, 0.0]
    assert "true reward unknown" in result.scores[1].explanation
    assert judge.stats["unknown"] == unknown + 1
    async with httpx.AsyncClient() as http:
        refused = await http.post(
            f"{url}/chat/completions",
            json={"model": "standin", "messages": [{"role": "user", "content": "<turn>x</turn>"}]},
        )
    assert refused.status_code == 400 and "not a RULER group request" in refused.text


# ----------------------------------------------------------------------------- the lookup agent


def call(call_id: str, name: str, argument: str, value: str) -> dict[str, Any]:
    arguments = json.dumps({argument: value}, separators=(",", ":"))  # as the SDK sends them
    function = {"name": name, "arguments": arguments}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call_id, "type": "function", "function": function}],
    }


def result(call_id: str, text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def lookup_episodes() -> list[tuple[list[dict[str, Any]], lookup_agent.Episode]]:
    """Rendered-as-stored conversations of the lookup agent, each with the Episode its tools
    would have recorded (whose reward the environment computes)."""
    task = lookup_agent.practice_tasks()[0]
    code = lookup_agent.code_of(task)
    number = lookup_agent.number_of(code)
    other = next(
        w
        for w in lookup_agent.practice_tasks()
        if w not in (task, code) and lookup_agent.number_of(w) != number
    )
    head = [
        {"role": "system", "content": lookup_agent.INSTRUCTIONS},
        {"role": "user", "content": lookup_agent.question_text(task)},
    ]
    find = [call("c1", "find", "word", task), result("c1", code)]
    out = []

    def add(turns: list[dict[str, Any]], found: list[str], got: list[str]) -> None:
        final = str(lookup_agent.number_of(got[0])) if got else ""
        episode = lookup_agent.Episode(task, found=found, got=got, final_output=final)
        out.append(([*head, *turns], episode))

    add([*find, call("c2", "get", "code", code)], [task], [code])  # right: 1.0
    add([*find, call("c2", "get", "code", other)], [task], [other])  # wrong code: 0.1
    detour = [call("c0", "find", "word", other), result("c0", lookup_agent.code_of(other))]
    add([*detour, *find, call("c2", "get", "code", code)], [other, task], [code])  # 1.0
    add([*detour, call("c2", "get", "code", code)], [other], [code])  # never found: 0.0
    add([*find, call("c3", "find", "word", task)], [task, task], [])  # no get: 0.1
    return out


@pytest.mark.parametrize("shape", ["same task", "different tasks"])
def test_the_lookup_truth_is_the_lookup_agents_reward(shape: str) -> None:
    episodes = lookup_episodes()
    expected = [lookup_agent.reward(e) for _, e in episodes]
    assert sorted(set(expected)) == [0.0, 0.1, 1.0]
    members = [JudgeMember(f"m{n}", m) for n, (m, _) in enumerate(episodes)]
    if shape == "different tasks":  # each with its own tool schemas, as live tasks have
        for n, m in enumerate(members):
            m.tools = [{"type": "function", "function": {"name": "find", "description": f"#{n}"}}]
    # a canary (judge checks): the right episode with its last turn emptied
    canary = JudgeMember("canary", copy.deepcopy(episodes[0][0][:-1]))
    canary.messages.append({"role": "assistant", "content": ""})
    members.append(canary)
    expected.append(0.1)  # find(word) was called, no get
    group = JudgeGroup("g", members, None)
    prompt = build_judge_messages(group)
    assert ("<task>" in prompt[1]["content"]) == (shape == "different tasks")
    judge = StandinJudge(1.0, truth=lookup_truth())
    reply = json.loads(judge.reply(prompt))
    assert [e["score"] for e in reply["scores"]] == expected
    assert judge.stats["unknown"] == 0


# ----------------------------------------------------------------------------- the arithmetic agent

REPLIES = [
    "25",  # the right number alone: 1.0
    "25.",  # with a trailing period: 1.0
    "24",  # a wrong number alone: 0.25
    "11 + 14 = 25",  # the right number inside text
    "11 + 14 = 25\n\nJust a number",
    "The magazine publishes The Amazing SpTrans",  # anything else, long: 0
    "one-one equals eight.",  # anything else, short
    "",  # empty (a canary's answer): 0.1
    "I'm sorry, but I can't help with that request.",  # a refusal canary
]


@pytest.mark.parametrize("shape", ["same task", "different tasks"])
def test_the_arithmetic_truth_is_the_arithmetic_agents_reward(shape: str) -> None:
    """Each member as the agent stores it (its question, the model's reply), through RULER's
    prompt for a same-task group (the question in the shared context) and for a cohort of
    different questions (each member shown whole with its own task)."""
    pairs = [(11, 14)] * len(REPLIES) if shape == "same task" else [(11, 14 + n) for n in range(9)]
    members, expected = [], []
    for n, ((a, b), reply) in enumerate(zip(pairs, REPLIES, strict=True)):
        reply = reply.replace("25", str(a + b))  # the right number of this member's question
        messages = [
            {"role": "user", "content": arithmetic_agent.question_text(a, b)},
            {"role": "assistant", "content": reply},
        ]
        members.append(JudgeMember(f"m{n}", messages))
        expected.append(arithmetic_agent.reward(reply, a + b))
    assert len(set(expected)) >= 6  # every branch of the reward, several brevities
    prompt = build_judge_messages(JudgeGroup("g", members, None))
    assert ("<shared_context>" in prompt[1]["content"]) == (shape == "same task")
    assert ("<task>" in prompt[1]["content"]) == (shape == "different tasks")
    judge = StandinJudge(1.0, truth=arithmetic_truth())
    reply = json.loads(judge.reply(prompt))
    assert [e["score"] for e in reply["scores"]] == [round(r, 6) for r in expected]
    assert judge.stats["unknown"] == 0
