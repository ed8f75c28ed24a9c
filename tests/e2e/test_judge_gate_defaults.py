"""The judge gate on its defaults tells a good judge from a coin flip, end to end.

A real server (the real local model, a real SQLite file) serves arithmetic questions from two
agents with the openai client; each call's 4 shadow samples form a group that the background
scorer judges. The judge is bench/standin_judge.py, the stand-in of known quality (a test
fixture following OpenAI's Chat Completions protocol and RULER's reply format; a capable judge
cannot run here), behind tests/e2e/fake_judge.py on loopback: it scores each member by the
arithmetic agent's true reward (examples/arithmetic_agent.py's `reward`, recomputed from the
rendered episode) with pair accuracy 0.9 under the first agent's rubric and 0.5 (a coin flip)
under the second's. The gate works per judge model and rubric, so the two are judged apart.
No environment reward is posted. Every judge-check setting is left on its default
(`RLPROXY_JUDGE_CHECKS=true` only undoes the test servers' off): the 90 % judge is held while it
is being proven, then passes and its groups (the held ones judged again) are scored; the coin
flip is held from its first group and fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from bench.standin_judge import StandinJudge, arithmetic_truth
from tests.e2e.conftest import Server
from tests.e2e.fake_judge import FakeJudge, FakeJudgeServer
from tests.e2e.helpers import own_server
from trainer.scoring.ruler import rubric_hash

GOOD_AGENT = "You add numbers. Answer with the sum."
COIN_AGENT = "You add numbers. Reply with the total."
GOOD_RUBRIC = "Score correct, complete sums higher. (rubric 90)"
COIN_RUBRIC = "Score correct, complete sums higher. (rubric 50)"
ROUND = 8  # calls per agent per round, each a group of 4 shadow samples
MAX_ROUNDS = 9  # up to 72 groups per agent; the gate decides by 60 checks of each kind


@pytest.fixture(scope="module")
def standins() -> dict[str, StandinJudge]:
    truth = arithmetic_truth()
    return {
        "(rubric 90)": StandinJudge(0.9, truth=truth, seed=1),
        "(rubric 50)": StandinJudge(0.5, truth=truth, seed=2),
    }


@pytest.fixture(scope="module")
def judge(standins: dict[str, StandinJudge]) -> Iterator[FakeJudge]:
    def by_rubric(body: dict[str, Any]) -> str:
        system = body["messages"][0]["content"]
        (marker,) = [m for m in standins if m in system]
        return standins[marker].reply(body["messages"])

    with FakeJudgeServer() as fake:
        fake.rule(by_rubric)
        yield fake


@pytest.fixture(scope="module")
def gserver(
    tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path, judge: FakeJudge
) -> Iterator[Server]:
    env = {
        "RLPROXY_SHADOW_SAMPLES": "4",
        "RLPROXY_GROUP_MIN_SIZE": "4",
        "RLPROXY_SCORING": "true",
        "RLPROXY_SCORING_INTERVAL_S": "0.25",
        "RLPROXY_JUDGE_MODEL": "openai/standin",
        "RLPROXY_JUDGE_API_BASE": judge.base_url,
        "RLPROXY_JUDGE_API_KEY_ENV": "STANDIN_KEY",
        "STANDIN_KEY": "sk-standin",
        "RLPROXY_JUDGE_RUBRICS": json.dumps(
            {f"agent:{GOOD_AGENT}": GOOD_RUBRIC, f"agent:{COIN_AGENT}": COIN_RUBRIC}
        ),
        "RLPROXY_JUDGE_CHECKS": "true",  # the test servers turn them off; all else: defaults
    }
    with own_server(tmp_path_factory.mktemp("judge-gate-defaults"), model_data_dir, env) as s:
        yield s


def _ask(server: Server, agent: str, n: int) -> None:
    with OpenAI(base_url=server.base_url, api_key="sk-test", max_retries=0, timeout=900) as c:
        c.chat.completions.create(
            model="rlproxy",
            messages=[
                {"role": "system", "content": agent},
                {"role": "user", "content": f"What is {n % 50 + 1} + {n // 50 + 3}?"},
            ],
            max_tokens=8,
            temperature=1.0,
        )


def _groups(server: Server) -> list[dict[str, Any]]:
    r = httpx.get(f"{server.url}/rl/groups", params={"source": "shadow", "limit": 500}, timeout=60)
    r.raise_for_status()
    return list(r.json()["data"])


def _judges(server: Server) -> dict[str, dict[str, Any]]:
    """/rl/judge's figures by rubric hash."""
    report = httpx.get(f"{server.url}/rl/judge", timeout=60).json()
    return {j["rubric_hash"]: j for j in report["judges"]}


def _settle(server: Server, asked: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        groups = _groups(server)
        if len(groups) >= asked and all(g["status"] in ("scored", "held") for g in groups):
            return groups
        time.sleep(0.5)
    pytest.fail(f"groups not judged in time: {[g['status'] for g in _groups(server)]}")


def test_on_the_defaults_a_90_percent_judge_trains_and_a_coin_flip_is_held(
    gserver: Server, judge: FakeJudge, standins: dict[str, StandinJudge]
) -> None:
    good_hash, coin_hash = rubric_hash(GOOD_RUBRIC), rubric_hash(COIN_RUBRIC)
    asked = 0
    for r in range(MAX_ROUNDS):
        asks = [(GOOD_AGENT, 100 * r + i) for i in range(ROUND)]
        asks += [(COIN_AGENT, 100 * r + 50 + i) for i in range(ROUND)]
        with ThreadPoolExecutor(max_workers=len(asks)) as pool:
            list(pool.map(lambda a: _ask(gserver, *a), asks))
        asked += len(asks)
        _settle(gserver, asked)
        figures = _judges(gserver)
        good, coin = figures[good_hash], figures[coin_hash]
        verdicts = {good["canary"]["verdict"], good["self_agreement"]["verdict"]}
        if "undecided" not in verdicts and coin["gate"]["reason"].startswith("judge failed"):
            break
    figures = _judges(gserver)
    good, coin = figures[good_hash], figures[coin_hash]

    # The 90 % judge passed both kinds on the defaults, and its held groups were judged again.
    assert good["canary"]["verdict"] == "pass", good
    assert good["self_agreement"]["verdict"] == "pass", good
    assert good["gate"]["decision"] == "train" and good["gate"]["reason"] is None
    assert good["canary"]["outcomes"]["above"] + good["canary"]["outcomes"]["flat"] < (
        good["canary"]["checks"] / 3
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        mine = [g for g in _groups(gserver) if g["rubric_hash"] == good_hash]
        if all(g["status"] == "scored" for g in mine):
            break
        time.sleep(0.5)
    assert mine and all(g["status"] == "scored" for g in mine), [g["status"] for g in mine]
    assert all(g["hold_reason"] is None for g in mine)

    # The coin flip failed and every one of its groups is held: nothing of it trains.
    assert coin["gate"]["decision"] == "held", coin
    assert coin["gate"]["reason"].startswith("judge failed its checks")
    held = [g for g in _groups(gserver) if g["rubric_hash"] == coin_hash]
    assert held and all(g["status"] == "held" for g in held)
    reasons = [g["hold_reason"] or "" for g in held]
    # Its first groups were held while it was being proven, saying how far the proof had got.
    assert any(r.startswith("judge not proven yet, being proven: canaries:") for r in reasons)
    assert any(r.startswith("judge failed its checks") for r in reasons)

    # The stand-ins were asked, and informed as often as their pair accuracy says.
    assert standins["(rubric 90)"].stats["informed"] > standins["(rubric 90)"].stats["blind"]
    assert standins["(rubric 50)"].stats["informed"] == 0

    # `rlproxy status` says the same, one line per judge and rubric.
    env = {**os.environ, "RLPROXY_DATA_DIR": str(gserver.data_dir)}
    done = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "status"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    gates = [line for line in done.stdout.splitlines() if line.startswith("judge gate")]
    assert f"openai/standin (rubric {good_hash}): trains, its checks pass" in "\n".join(gates)
    assert f"openai/standin (rubric {coin_hash}): HELD, judge failed its checks: " in "\n".join(
        gates
    )
