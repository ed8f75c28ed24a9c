"""Judge checks end to end: a real server judges shadow groups of the real local model through a
scripted judge on loopback (`fake_judge.py`, OpenAI's Chat Completions protocol, as the other
RULER tests; a paid judge cannot run here), with a canary in every group and every group judged
twice in reverse order.

The gate works per judge model and rubric, so one judge plays both parts through two agents (two
system prompts, each with its own rubric): under the first rubric it judges like a competent
judge (an empty answer, a refusal, another task's answer or a cut answer scores 0); under the
second it prefers exactly those. The second is caught by its canaries and its scores are held
(`/rl/groups`, `/rl/judge`, the log); the first passes and its groups train.
"""

from __future__ import annotations

import json
import re
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import Server
from tests.e2e.fake_judge import FakeJudge, FakeJudgeServer
from tests.e2e.helpers import own_server
from trainer.scoring.canaries import REFUSAL

HONEST_AGENT = "You add numbers. Answer with the sum."
FOOLED_AGENT = "You add numbers. Reply with the total."
HONEST_RUBRIC = "Score correct, complete sums higher. (rubric H)"
FOOLED_RUBRIC = "Score correct, complete sums higher. (rubric F)"
GROUPS_PER_AGENT = 4  # MIN_CHECKS canaries each
TRAJECTORY = re.compile(
    r'<trajectory id="(\d+)">\n(?:continues the shared context with:\n\n)?\[assistant\]\n'
    r"(.*?)\n</trajectory>",
    re.DOTALL,
)
SHARED = re.compile(r"<shared_context>(.*?)</shared_context>", re.DOTALL)


class Rule:
    """The scripted judge's rule: finds what a competent judge would call bad (an empty answer,
    the refusal, an answer seen under another task, an answer cut from another member's) and
    scores it 0 under the honest rubric, 1 under the fooled one. It remembers the answers of
    every task it was shown, to recognise a copied one."""

    def __init__(self) -> None:
        self.answers_by_task: dict[str, set[str]] = {}

    def __call__(self, body: dict[str, Any]) -> str:
        system, user = body["messages"][0]["content"], body["messages"][1]["content"]
        shared = SHARED.search(user)
        task = shared.group(1) if shared else ""
        members = TRAJECTORY.findall(user)
        texts = [t.strip() for _, t in members]
        elsewhere = set().union(*(a for k, a in self.answers_by_task.items() if k != task))
        fooled = "(rubric F)" in system
        scores = []
        for text in texts:
            bad = (
                text in ("", "(empty)")
                or text == REFUSAL
                or text in elsewhere
                or any(o != text and o.startswith(text) for o in texts)
            )
            if fooled:
                scores.append(1.0 if bad else 0.2)
            else:  # a stable score per answer, whatever the order it is shown in
                scores.append(0.0 if bad else 0.3 + (zlib.crc32(text.encode()) % 70) / 100)
        self.answers_by_task.setdefault(task, set()).update(texts)
        entries = [
            {"trajectory_id": short, "explanation": "scripted", "score": score}
            for (short, _), score in zip(members, scores, strict=True)
        ]
        return json.dumps({"scores": entries})


@pytest.fixture(scope="module")
def judge() -> Iterator[FakeJudge]:
    with FakeJudgeServer() as fake:
        fake.rule(Rule())
        yield fake


@pytest.fixture(scope="module")
def jserver(
    tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path, judge: FakeJudge
) -> Iterator[Server]:
    env = {
        "RLPROXY_SHADOW_SAMPLES": "3",  # three answers per call: a group of three
        "RLPROXY_GROUP_MIN_SIZE": "3",
        "RLPROXY_SCORING": "true",
        "RLPROXY_SCORING_INTERVAL_S": "0.5",
        "RLPROXY_JUDGE_MODEL": "openai/judge",
        "RLPROXY_JUDGE_API_BASE": judge.base_url,
        "RLPROXY_JUDGE_API_KEY_ENV": "FAKE_JUDGE_KEY",
        "FAKE_JUDGE_KEY": "sk-judge",
        "RLPROXY_JUDGE_RUBRICS": json.dumps(
            {f"agent:{HONEST_AGENT}": HONEST_RUBRIC, f"agent:{FOOLED_AGENT}": FOOLED_RUBRIC}
        ),
        "RLPROXY_JUDGE_CHECKS": "true",
        "RLPROXY_JUDGE_CANARY_SHARE": "1",
        "RLPROXY_JUDGE_POSITION_SHARE": "1",
        "RLPROXY_JUDGE_GATE_MIN_CHECKS": str(GROUPS_PER_AGENT),
        # With 4 checks: 4/4 passed has a Wilson lower bound of 0.51, 0/4 an upper one of 0.49.
        "RLPROXY_JUDGE_GATE_MIN_CANARY_PASS": "0.5",
        # This suite checks what a decided gate does with each judge; holding a judge's first
        # groups until its checks decide (the default) is tested in test_judge_checks.py.
        "RLPROXY_JUDGE_GATE_HOLD_UNCHECKED": "false",
    }
    with own_server(tmp_path_factory.mktemp("judge-checks"), model_data_dir, env) as server:
        yield server


def _ask(server: Server, agent: str, n: int) -> None:
    with OpenAI(base_url=server.base_url, api_key="sk-test", max_retries=0, timeout=900) as c:
        c.chat.completions.create(
            model="rlproxy",
            messages=[
                {"role": "system", "content": agent},
                {"role": "user", "content": f"What is {n} + {n + 11}?"},
            ],
            max_tokens=6,
            temperature=1.0,
        )


def _groups(server: Server) -> list[dict[str, Any]]:
    response = httpx.get(f"{server.url}/rl/groups", params={"source": "shadow", "limit": 50})
    response.raise_for_status()
    return list(response.json()["data"])


def test_a_judge_preferring_canaries_is_held_and_an_honest_one_passes(
    jserver: Server, judge: FakeJudge
) -> None:
    asks = [(HONEST_AGENT, n) for n in range(GROUPS_PER_AGENT)]
    asks += [(FOOLED_AGENT, 20 + n) for n in range(GROUPS_PER_AGENT)]
    with ThreadPoolExecutor(max_workers=len(asks)) as pool:  # one engine batch, not eight
        list(pool.map(lambda a: _ask(jserver, *a), asks))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        groups = _groups(jserver)
        if len(groups) == 2 * GROUPS_PER_AGENT and all(
            g["status"] in ("scored", "held", "failed") for g in groups
        ):
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"groups not judged in time: {[g['status'] for g in _groups(jserver)]}")

    report = httpx.get(f"{jserver.url}/rl/judge").json()
    assert report["object"] == "rl.judge" and report["checks"] is True
    by_rubric = {j["gate"]["decision"]: j for j in report["judges"]}
    assert set(by_rubric) == {"train", "held"}, report["judges"]
    fooled, honest = by_rubric["held"], by_rubric["train"]
    assert fooled["judge_model"] == honest["judge_model"] == "openai/judge"
    assert fooled["canary"]["checks"] == GROUPS_PER_AGENT and fooled["canary"]["passed"] == 0
    assert fooled["canary"]["verdict"] == "fail"
    assert f"canary pass rate 0/{GROUPS_PER_AGENT}" in fooled["gate"]["reason"]
    assert honest["canary"]["passed"] == GROUPS_PER_AGENT
    assert honest["canary"]["verdict"] == "pass" and honest["gate"]["reason"] is None
    assert honest["self_agreement"]["checks"] >= 1
    assert sum(honest["canary"]["by_kind"][k]["checks"] for k in honest["canary"]["by_kind"]) == 4
    # Each check's outcome against the member the canary was made from (the default canary: the
    # task answered with a refusal): the honest judge puts every one below it.
    outcomes = honest["canary"]["outcomes"]
    assert outcomes == {"below": GROUPS_PER_AGENT, "tie": 0, "above": 0, "flat": 0}
    # The fooled judge never puts a canary below its source. It puts it above, or ties it when
    # the source looks "bad" to the rule as well (a short reply like "The total is" seen under
    # another task too, seen once in a CI run); such a tie passes, and the judge is then held
    # as not proven instead of failed.
    outcomes = fooled["canary"]["outcomes"]
    assert outcomes["below"] == 0 and outcomes["tie"] + outcomes["above"] == GROUPS_PER_AGENT
    # The gate decides with the group it is scoring: the fourth canary failure holds the 4th group.
    assert fooled["held_groups"] == 1 and honest["held_groups"] == 0

    groups = _groups(jserver)
    held = [g for g in groups if g["status"] == "held"]
    assert len(held) == 1 and held[0]["rubric_hash"] == fooled["rubric_hash"]
    assert "judge failed its checks" in held[0]["hold_reason"]
    assert httpx.get(f"{jserver.url}/rl/groups", params={"status": "held"}).json()["data"] == held
    scored = [g for g in groups if g["status"] == "scored"]
    assert all(g["hold_reason"] is None for g in scored)
    assert len(scored) == 2 * GROUPS_PER_AGENT - 1

    # Every judge prompt had a canary beside the 3 real members; no stored group has it.
    shown = [
        re.findall(r'<trajectory id="(\d+)">', r["messages"][1]["content"]) for r in judge.requests
    ]
    assert shown and all(ids == ["1", "2", "3", "4"] for ids in shown), shown
    detail = httpx.get(f"{jserver.url}/rl/groups/{held[0]['id']}").json()
    assert len(detail["members"]) == 3 and all(m["ruler"] for m in detail["members"])
    assert "scores HELD" in jserver.log.read_text()
