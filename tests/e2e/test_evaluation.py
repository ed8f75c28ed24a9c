"""The held-out evaluation end to end: a real server, the `openai` client, the `rlproxy` command
and the dashboard in a real browser.

The server holds half of the tasks out of training (RLPROXY_EVAL_SHARE=0.5, the most it allows),
so a few tasks give both arms. Traffic has the lookup agent's shape on live traffic: every task
asked once, one system prompt, one question each, the environment's reward posted to the
trajectory. Adapter version 1 (the tests' random LoRA) is published and active before it starts.
The environment here is scripted: it rewards answers of v1 about 0.5 above the base's (the
stand-in for a trained version that got better), so the evaluation must find v1 better than the
base with an interval above 0, counting exactly the runs it should and leaving out, with the
reason, a run that pinned only some of its calls, one closed without a reward and one still open.
Held-out trajectories, rewarded like the others, must never join a group while the trained ones
do.

Then re-runs, as an agent that can run its tasks again evaluates on demand: six new tasks, each
run once pinned to `rlproxy@base` and once to `rlproxy@1`, marked held out by the client
(`X-RLProxy-Held-Out`, or `metadata.held_out`), rewarded by the same scripted environment: they
must be held out whatever the draw, paired by task, and become the headline with a paired
interval above 0.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from storage.held_out import HeldOutSplit
from tests.e2e.conftest import Server
from tests.e2e.helpers import db_rows, get_trajectory, own_server, wait_for
from tests.e2e.test_adapters import write_random_lora
from tests.e2e.test_dashboard import publish
from tests.required import missing

REPO = Path(__file__).resolve().parents[2]
SHARE = 0.5
SYSTEM = "You look up secret numbers. Answer with the number only."


def _task(i: int) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"What is the number of the code of word {i}?"},
    ]


def _tasks_by_arm(count: dict[str, int]) -> dict[str, list[int]]:
    """Task numbers for each arm (None: trained), by the split's rule: the test needs both."""
    split = HeldOutSplit(SHARE)
    found: dict[str, list[int]] = {arm: [] for arm in count}
    i = 0
    while any(len(found[a]) < n for a, n in count.items()):
        arm = str(split.arm(None, _task(i), None))
        if arm in found and len(found[arm]) < count[arm]:
            found[arm].append(i)
        i += 1
    return found


@dataclass
class Traffic:
    served: dict[str, str] = field(default_factory=dict)
    """Trajectory id -> the model its answer named."""
    arm: dict[str, str] = field(default_factory=dict)
    """Trajectory id -> "base", "policy" or "None" (trained)."""
    rewards: dict[str, float] = field(default_factory=dict)
    pinned: str = ""
    unrewarded: str = ""
    still_open: str = ""


@pytest.fixture(scope="module")
def eserver(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Iterator[Server]:
    env = {
        "RLPROXY_EVAL_SHARE": str(SHARE),
        "RLPROXY_PUBLISH_ADAPTERS": "true",
        "RLPROXY_ADAPTER_POLL_S": "0.5",
        "RLPROXY_ROLLOUT": "false",  # v1 serves at once
        "RLPROXY_FORGETTING_CHECK": "false",  # the random LoRA would be held (test_forgetting)
        # Groups form with no judge: each task is asked once, so trained runs go to a cohort.
        "RLPROXY_SCORING_INTERVAL_S": "0.5",
        "RLPROXY_GROUP_ALONE_S": "0",
        "RLPROXY_GROUP_MIN_SIZE": "2",
    }
    with own_server(tmp_path_factory.mktemp("eval-data"), model_data_dir, env) as server:
        yield server


def _ask(client: OpenAI, tid: str, i: int, model: str = "rlproxy") -> str:
    answer = client.chat.completions.create(
        model=model,
        messages=_task(i),  # type: ignore[arg-type]
        max_tokens=4,
        temperature=1.0,
        extra_headers={"X-RLProxy-Trajectory": tid},
    )
    return answer.model


def _reward(server: Server, tid: str, value: float) -> None:
    r = httpx.post(
        f"{server.url}/rl/trajectories/{tid}/reward",
        json={"reward": value, "source": "env"},
        timeout=30,
    )
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def traffic(
    eserver: Server, tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path
) -> Traffic:
    lora = tmp_path_factory.mktemp("eval-lora") / "lora"
    write_random_lora(model_data_dir, lora)
    publish(lora, eserver.data_dir, [1])
    wait_for(
        lambda: httpx.get(f"{eserver.url}/health", timeout=30).json()["active_version"] == 1,
        180,
        "v1 to serve",
    )
    tasks = _tasks_by_arm({"base": 7, "policy": 9, "None": 4})
    t = Traffic()
    # One after another, policy-arm runs first and last: the base's runs fall inside v1's
    # hours, so all of them are its control. A base-arm task asked twice stays in its arm.
    order = [("policy", tasks["policy"][0])]
    for b, p in zip(tasks["base"][:6], tasks["policy"][1:7], strict=True):
        order += [("base", b), ("policy", p)]
    order.insert(5, ("base", tasks["base"][0]))  # the repeat
    order += [("None", i) for i in tasks["None"]]
    with OpenAI(base_url=eserver.base_url, api_key="sk-test", max_retries=0, timeout=300) as c:
        for n, (arm, i) in enumerate(order):
            tid = f"eval-{n}-{arm}-{i}"
            t.served[tid], t.arm[tid] = _ask(c, tid, i), arm
            served_by_v1 = t.served[tid] == "rlproxy@1"
            t.rewards[tid] = (0.7 if served_by_v1 else 0.2) + 0.05 * (n % 3)
        t.pinned = "eval-pinned"  # a pinned first call, then one for the policy name
        t.served[t.pinned] = _ask(c, t.pinned, tasks["base"][6], model="rlproxy@1")
        _ask(c, t.pinned, tasks["base"][6])
        t.arm[t.pinned], t.rewards[t.pinned] = "base", 1.0
        t.unrewarded, t.still_open = "eval-unrewarded", "eval-open"
        for tid, i in ((t.unrewarded, tasks["policy"][7]), (t.still_open, tasks["policy"][8])):
            t.served[tid], t.arm[tid] = _ask(c, tid, i), "policy"
    for tid, value in t.rewards.items():
        _reward(eserver, tid, value)
    r = httpx.post(f"{eserver.url}/rl/trajectories/{t.unrewarded}/end", timeout=30)
    assert r.status_code == 200, r.text
    return t


def test_held_out_tasks_are_marked_and_their_base_arm_is_served_by_the_base(
    eserver: Server, traffic: Traffic
) -> None:
    for tid, arm in traffic.arm.items():
        assert get_trajectory(eserver, tid)["held_out"] is (arm != "None"), tid
        if tid == traffic.pinned:
            expected = "rlproxy@1"  # a pin is served as asked (its first call)
        else:
            expected = "rlproxy@base" if arm == "base" else "rlproxy@1"
        assert traffic.served[tid] == expected, (tid, arm)


def test_a_rewarded_held_out_trajectory_never_joins_a_group(
    eserver: Server, traffic: Traffic
) -> None:
    def grouped() -> set[str]:
        rows = db_rows(eserver.data_dir, "SELECT DISTINCT trajectory_id FROM group_members")
        return {r["trajectory_id"] for r in rows}

    trained = {tid for tid, arm in traffic.arm.items() if arm == "None"}
    wait_for(lambda: trained <= grouped(), 120, "the trained runs to form groups")
    time.sleep(2)  # a few more grouping passes
    held = {tid for tid, arm in traffic.arm.items() if arm != "None"}
    assert grouped() & held == set()


def _expected(traffic: Traffic) -> tuple[int, int]:
    counted = [
        tid
        for tid, arm in traffic.arm.items()
        if arm != "None" and tid not in (traffic.pinned, traffic.unrewarded, traffic.still_open)
    ]
    v1 = sum(traffic.served[tid] == "rlproxy@1" for tid in counted)
    return v1, len(counted) - v1


def test_the_evaluation_shows_the_version_better_than_the_base_with_its_interval(
    eserver: Server, traffic: Traffic
) -> None:
    v1, base = _expected(traffic)
    assert (v1, base) == (7, 7)
    report = httpx.get(f"{eserver.url}/rl/eval", timeout=60).json()
    assert report["evaluated"] == {"base": base, "1": v1}
    assert report["left_out"] == {
        "upstream": 0,
        "pinned": 1,
        "several_versions": 0,
        "open": 1,
        "no_reward": 1,
    }
    (version,) = report["versions"]
    assert version["version"] == 1 and version["base"]["n"] == base
    assert version["vs_base"]["estimate"] == pytest.approx(0.5, abs=0.05)
    head = report["headline"]
    assert head["verdict"] == "better" and head["version"] == 1
    assert head["interval"]["low"] > 0
    assert head["line"].startswith("v1 vs base on held-out tasks: +0.5")
    assert head["line"].endswith(f"(n={v1} vs {base}): better")


def _rlproxy(server: Server, *args: str) -> str:
    env = {**os.environ, "RLPROXY_DATA_DIR": str(server.data_dir), "RLPROXY_EVAL_SHARE": "0.5"}
    done = subprocess.run(
        [sys.executable, "-m", "proxy.cli", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_rlproxy_eval_and_status_print_the_same_line(eserver: Server, traffic: Traffic) -> None:
    line = httpx.get(f"{eserver.url}/rl/eval", timeout=60).json()["headline"]["line"]
    as_json = json.loads(_rlproxy(eserver, "eval", "--json"))
    assert as_json["headline"]["line"] == line
    table = _rlproxy(eserver, "eval")
    assert f"is it getting better? {line}" in table
    assert "1  some of its calls pinned a version" in table
    assert "v1 " in table and "better" in table
    status = _rlproxy(eserver, "status")
    assert f"better?       {line}" in status


def test_the_dashboard_shows_whether_it_is_getting_better(
    eserver: Server, traffic: Traffic
) -> None:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        missing("no Chromium", "the dashboard's browser tests need Debian's `chromium` package")
    from playwright.sync_api import sync_playwright

    line = httpx.get(f"{eserver.url}/rl/eval", timeout=60).json()["headline"]["line"]
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=binary)
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{eserver.url}/dashboard#/overview")
            card = page.wait_for_selector("#better", timeout=30_000)
            assert card is not None
            text = card.inner_text()
            assert "better" in text.splitlines()[1].lower()
            assert line in text
            assert errors == []
        finally:
            browser.close()


RERUN_TASKS = 6


@pytest.fixture(scope="module")
def reruns(eserver: Server, traffic: Traffic) -> dict[str, tuple[int, float]]:
    """Trajectory id -> (version re-run, reward): each new task on the base and on v1."""
    done: dict[str, tuple[int, float]] = {}
    with OpenAI(base_url=eserver.base_url, api_key="sk-test", max_retries=0, timeout=300) as c:
        for i in range(RERUN_TASKS):
            task = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"What is the number of the code of re-run {i}?"},
            ]
            for version, model in ((0, "rlproxy@base"), (1, "rlproxy@1")):
                tid = f"rerun-{i}-{version}"
                headers = {"X-RLProxy-Trajectory": tid}
                metadata = None
                if i == 0:  # the marker in the body's metadata
                    metadata = {"held_out": "true"}
                else:
                    headers["X-RLProxy-Held-Out"] = "true"
                answer = c.chat.completions.create(
                    model=model,
                    messages=task,  # type: ignore[arg-type]
                    max_tokens=4,
                    temperature=1.0,
                    extra_headers=headers,
                    **({"metadata": metadata} if metadata else {}),
                )
                assert answer.model == model
                reward = (0.8 if version else 0.2) + 0.05 * (i % 3) * (1 if version else -1)
                done[tid] = (version, reward)
    for tid, (_, value) in done.items():
        _reward(eserver, tid, value)
    return done


def test_reruns_marked_held_out_pair_by_task_and_become_the_headline(
    eserver: Server, traffic: Traffic, reruns: dict[str, tuple[int, float]]
) -> None:
    for tid in reruns:
        assert get_trajectory(eserver, tid)["held_out"] is True, tid  # whatever the draw
    report = httpx.get(f"{eserver.url}/rl/eval", timeout=60).json()
    # the run that pinned only its first call is not a re-run (test above)
    assert report["reruns_evaluated"] == {"base": RERUN_TASKS, "1": RERUN_TASKS}
    (r,) = report["reruns"]
    assert (r["version"], r["tasks"], r["unpaired_tasks"]) == (1, RERUN_TASKS, 0)
    wins = [reruns[f"rerun-{i}-1"][1] - reruns[f"rerun-{i}-0"][1] for i in range(RERUN_TASKS)]
    assert r["vs_base"]["estimate"] == pytest.approx(sum(wins) / len(wins))
    assert r["vs_base"]["df"] == RERUN_TASKS - 1 and r["vs_base"]["low"] > 0
    head = report["headline"]
    assert head["verdict"] == "better" and head["version"] == 1
    assert head["line"].startswith(
        f"v1 vs base, re-run on {RERUN_TASKS} held-out tasks (paired): +0."
    )
    # the drawn arms' comparison is unchanged beside it
    assert report["versions"][0]["vs_base"]["verdict"] == "better"
    table = _rlproxy(eserver, "eval")
    assert "re-runs pinned to a version, paired by task with the base's:" in table
    assert f"is it getting better? {head['line']}" in table


def test_a_marked_call_that_joins_a_trajectory_holds_the_whole_trajectory_out(
    eserver: Server, reruns: dict[str, tuple[int, float]]
) -> None:
    """After the re-runs' test: this trajectory stays open and unrewarded (left out, `open`)."""
    tid = "joined-late"
    split = HeldOutSplit(SHARE)
    task = next(  # a task that trains by the draw
        t for i in range(100) if split.arm(None, t := _task(10_000 + i), None) is None
    )
    with OpenAI(base_url=eserver.base_url, api_key="sk-test", max_retries=0, timeout=300) as c:
        for marked in (False, True):
            headers = {"X-RLProxy-Trajectory": tid}
            if marked:
                headers["X-RLProxy-Held-Out"] = "yes"
            c.chat.completions.create(
                model="rlproxy",
                messages=task,  # type: ignore[arg-type]
                max_tokens=4,
                extra_headers=headers,
            )
            assert get_trajectory(eserver, tid)["held_out"] is marked
