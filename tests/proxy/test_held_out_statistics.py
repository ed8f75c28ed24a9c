"""The held-out evaluation's statistics on hand-made numbers (proxy/adapters/evaluation.py)."""

from __future__ import annotations

import math

import pytest

from proxy.adapters.evaluation import (
    Arm,
    Run,
    classify,
    compare_versions,
    evaluate_runs,
    t_interval,
    welch,
)
from storage.held_out_runs import HeldOutRun, ServedBy


def test_welch_interval_by_hand() -> None:
    # a: mean 2.5, var 5/3; b: mean 5, var 20/3; n = 4 each.
    # var of the difference = 5/12 + 20/12 = 25/12; Welch-Satterthwaite df =
    # (25/12)^2 / ((5/12)^2/3 + (20/12)^2/3) = 4.41 -> 4; t(0.975, 4) = 2.776445.
    iv = welch([1, 2, 3, 4], [2, 4, 6, 8])
    assert iv is not None
    assert iv.estimate == pytest.approx(-2.5)
    assert iv.df == 4
    half = 2.776445 * math.sqrt(25 / 12)
    assert iv.low == pytest.approx(-2.5 - half, abs=1e-5)
    assert iv.high == pytest.approx(-2.5 + half, abs=1e-5)
    assert iv.verdict == "not shown"


def test_verdicts_follow_the_interval() -> None:
    better = welch([0.9, 1.0, 0.8, 1.0, 0.9], [0.1, 0.0, 0.2, 0.1, 0.0])
    worse = welch([0.1, 0.0, 0.2, 0.1, 0.0], [0.9, 1.0, 0.8, 1.0, 0.9])
    assert better is not None and better.verdict == "better" and better.low > 0
    assert worse is not None and worse.verdict == "worse" and worse.high < 0


def test_too_few_runs_have_no_interval() -> None:
    assert welch([1.0], [0.0, 1.0]) is None
    assert welch([1.0, 0.0], []) is None


def test_equal_rewards_everywhere_give_a_point_interval() -> None:
    iv = welch([1.0, 1.0, 1.0], [0.0, 0.0])
    assert iv is not None and (iv.low, iv.estimate, iv.high) == (1.0, 1.0, 1.0)
    assert iv.verdict == "better"


def test_a_difference_of_differences_adds_the_four_variances() -> None:
    arms = [Arm.of([1, 2, 3]), Arm.of([0, 1, 2]), Arm.of([2, 4, 6]), Arm.of([1, 1, 4])]
    iv = t_interval(0.5, arms)
    assert iv is not None
    variances = [1 / 3, 1 / 3, 4 / 3, 1]
    total = sum(variances)
    df = total**2 / sum(v**2 / 2 for v in variances)  # every arm has n - 1 = 2
    assert iv.df == math.floor(df)
    assert iv.high - iv.estimate == pytest.approx(iv.estimate - iv.low)
    assert iv.high - iv.low > 2 * 1.96 * math.sqrt(total)  # t is wider than normal


def _run(tid: str, at: float, version: int, reward: float) -> Run:
    return Run(tid, at, version, reward)


def test_a_version_is_compared_with_the_base_runs_of_its_own_hours() -> None:
    runs = [
        # base before v1 served: not v1's control
        _run("b0", 0, 0, 0.0),
        _run("b1", 1, 0, 0.0),
        # v1's hours: 10..20
        _run("v1a", 10, 1, 0.6),
        _run("b2", 12, 0, 0.4),
        _run("v1b", 15, 1, 0.8),
        _run("b3", 18, 0, 0.2),
        _run("v1c", 20, 1, 0.7),
        # v2's hours: 30..40
        _run("v2a", 30, 2, 1.0),
        _run("b4", 31, 0, 0.3),
        _run("v2b", 40, 2, 0.9),
        _run("b5", 35, 0, 0.5),
    ]
    v1, v2 = compare_versions(runs)
    assert (v1.version, v1.since, v1.until) == (1, 10, 20)
    assert v1.base.n == 2 and v1.base.mean == pytest.approx(0.3)
    assert v1.runs.n == 3 and v1.runs.mean == pytest.approx(0.7)
    assert v1.vs_base is not None and v1.vs_base.estimate == pytest.approx(0.4)
    assert v1.previous is None and v1.vs_previous is None
    assert v2.base.n == 2 and v2.base.mean == pytest.approx(0.4)
    assert v2.vs_base is not None and v2.vs_base.estimate == pytest.approx(0.55)
    assert v2.previous == 1
    assert v2.vs_previous is not None and v2.vs_previous.estimate == pytest.approx(0.15)


def _held(
    tid: str,
    served: list[tuple[int, str, str]],
    reward: float | None,
    status: str = "closed",
    at: float = 0.0,
) -> HeldOutRun:
    return HeldOutRun(tid, at, status, tuple(ServedBy(*s) for s in served), reward)


def test_the_denominator_says_what_was_left_out_and_why() -> None:
    runs = [
        _held("ok-base", [(0, "local", "rlproxy")], 1.0),
        _held("ok-v3", [(3, "vllm", "gpt-4o-mini")], 0.5),
        _held("upstream", [(0, "upstream", "gpt-4o")], 1.0),
        _held("pinned", [(3, "local", "rlproxy@3")], 1.0),
        _held("pinned-base", [(0, "local", "rlproxy@base")], 1.0),
        _held("swapped", [(2, "local", "rlproxy"), (3, "local", "rlproxy")], 1.0),
        _held("running", [(3, "local", "rlproxy")], None, status="open"),
        _held("silent", [(3, "local", "rlproxy")], None),
    ]
    runs.append(_held("half-pinned", [(3, "local", "rlproxy"), (3, "local", "rlproxy@3")], 1.0))
    counted, reruns, left_out = classify(runs, "rlproxy", "explicit")
    assert [(r.trajectory_id, r.version, r.reward) for r in counted] == [
        ("ok-base", 0, 1.0),
        ("ok-v3", 3, 0.5),
    ]
    # every call pinned to one version: a re-run, counted apart and paired by task
    assert [(r.trajectory_id, r.version) for r in reruns] == [("pinned", 3), ("pinned-base", 0)]
    assert left_out == {
        "upstream": 1,
        "pinned": 1,
        "several_versions": 1,
        "open": 1,
        "no_reward": 1,
    }


def test_the_headline_names_the_newest_version_with_an_interval() -> None:
    base = [0, 0.2, 0, 0]
    runs = [_held(f"b{i}", [(0, "local", "rlproxy")], r, at=i) for i, r in enumerate(base)]
    runs += [_held(f"a{i}", [(1, "local", "rlproxy")], 1.0, at=i) for i in range(4)]
    runs += [_held("z", [(2, "local", "rlproxy")], 1.0, at=5)]  # v2: one run, no interval
    ev = evaluate_runs(runs, policy="rlproxy", reward_policy="explicit", share=0.1)
    assert ev.evaluated == {"base": 4, "1": 4, "2": 1}
    assert ev.headline.version == 1
    assert ev.headline.line.startswith("v1 vs base on held-out tasks: +0.950 [")
    assert ev.headline.line.endswith("(n=4 vs 4): better")
    assert ev.to_json()["headline"]["interval"]["verdict"] == "better"


def test_headlines_without_an_interval() -> None:
    none = evaluate_runs([], policy="p", reward_policy="explicit", share=0.0)
    assert none.headline.verdict == "off"
    base_only = [_held("b", [(0, "local", "p")], 1.0)]
    ev = evaluate_runs(base_only, policy="p", reward_policy="explicit", share=0.1)
    assert ev.headline.verdict == "no evidence"
    assert ev.headline.line == (
        "no version has served rewarded held-out tasks yet (1 base run rewarded)"
    )
    few = [*base_only, _held("v", [(4, "local", "p")], 1.0)]
    ev = evaluate_runs(few, policy="p", reward_policy="explicit", share=0.1)
    assert ev.headline.verdict == "too few runs" and ev.headline.version == 4


def _rerun(tid: str, task: str, version: int, reward: float | None) -> HeldOutRun:
    pin = "rlproxy@base" if version == 0 else f"rlproxy@{version}"
    served = (ServedBy(version, "local", pin),)
    return HeldOutRun(tid, 0.0, "closed", served, reward, task_signature=task)


def test_reruns_pair_by_task_with_a_paired_t_interval() -> None:
    base = {"t1": [0.0], "t2": [0.0], "t3": [1.0], "t4": [0.0, 0.0]}
    v2 = {"t1": [1.0], "t2": [0.0, 0.0], "t3": [1.0], "t4": [1.0], "t5": [1.0]}
    runs = [_rerun(f"b-{t}-{i}", t, 0, r) for t, rs in base.items() for i, r in enumerate(rs)]
    runs += [_rerun(f"v-{t}-{i}", t, 2, r) for t, rs in v2.items() for i, r in enumerate(rs)]
    runs.append(_rerun("open-one", "t1", 2, None))  # no reward: left out, not paired
    ev = evaluate_runs(runs, policy="rlproxy", reward_policy="explicit", share=0.1)
    assert ev.rerun_counts == {"base": 5, "2": 6}
    assert ev.evaluated == {} and ev.left_out["no_reward"] == 1
    [r] = ev.reruns
    # pairs t1..t4 (t5 was not run on the base); per task means, differences 1, 0, 0, 1
    assert (r.version, r.tasks, r.unpaired_tasks, r.runs, r.base_runs) == (2, 4, 1, 6, 5)
    assert r.mean == pytest.approx(0.75) and r.base_mean == pytest.approx(0.25)
    half = 3.182446 * math.sqrt(1 / 3) / 2  # t(0.975, 3) * sd / sqrt(n)
    assert r.vs_base is not None and r.vs_base.df == 3
    assert r.vs_base.estimate == pytest.approx(0.5)
    assert (r.vs_base.low, r.vs_base.high) == (
        pytest.approx(0.5 - half, abs=1e-5),
        pytest.approx(0.5 + half, abs=1e-5),
    )
    assert ev.headline.version == 2 and ev.headline.verdict == "not shown"
    assert ev.headline.line.startswith("v2 vs base, re-run on 4 held-out tasks (paired): +0.500 [")
    assert ev.to_json()["reruns"][0]["vs_base"]["verdict"] == "not shown"


def test_a_rerun_win_is_the_headline_when_it_is_the_newest_version() -> None:
    runs = [_rerun(f"b{i}", f"t{i}", 0, 0.0) for i in range(6)]
    runs += [_rerun(f"v{i}", f"t{i}", 3, 1.0 if i else 0.0) for i in range(6)]
    drawn = [_held(f"d{i}", [(2, "local", "rlproxy")], 1.0, at=i) for i in range(3)]
    drawn += [_held(f"db{i}", [(0, "local", "rlproxy")], 0.0, at=i) for i in range(3)]
    ev = evaluate_runs(runs + drawn, policy="rlproxy", reward_policy="explicit", share=0.1)
    assert ev.versions[0].version == 2  # the drawn arms' newest is older than the re-runs'
    assert ev.headline.version == 3 and ev.headline.verdict == "better"
    few = evaluate_runs(
        [_rerun("b", "t", 0, 0.0), _rerun("v", "t", 5, 1.0)],
        policy="rlproxy",
        reward_policy="explicit",
        share=0.0,
    )
    assert few.headline.verdict == "too few runs"
    assert "too few tasks re-run on both" in few.headline.line


def test_pairs_that_all_differ_the_same_need_a_sign_test_worth_of_them() -> None:
    from proxy.adapters.evaluation import paired_interval

    assert paired_interval([1.0] * 5) is None  # 2 * 0.5**5 = 0.0625: not below 0.05
    six = paired_interval([1.0] * 6)  # 0.031
    assert six is not None and (six.low, six.high, six.verdict) == (1.0, 1.0, "better")
    same = paired_interval([0.0, 0.0])
    assert same is not None and same.verdict == "not shown"


def test_base_reruns_alone_are_not_called_off() -> None:
    ev = evaluate_runs(
        [_rerun("b", "t", 0, 0.5)], policy="rlproxy", reward_policy="explicit", share=0.0
    )
    assert ev.headline.verdict == "no evidence"
    assert ev.headline.line.endswith("(0 base runs rewarded, 1 base re-run)")
