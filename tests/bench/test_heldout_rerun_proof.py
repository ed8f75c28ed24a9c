"""The held-out re-run proof's traffic and its result file's name (bench/heldout_rerun_proof.py):
live traffic asks every task once, practice traffic repeats words, and a judge run's file says
which judge. The proof itself runs for an hour on a real server: it is not run here."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "examples"))

import arithmetic_agent  # noqa: E402
import heldout_rerun_proof as proof  # noqa: E402
import lookup_agent  # noqa: E402
import provenance  # noqa: E402


def args(**changes: object) -> argparse.Namespace:
    base = {"agent": "lookup", "traffic": "practice", "reward": "env", "pair_accuracy": 0.9}
    base |= {"tasks": 4, "runs": 8}
    return argparse.Namespace(seed=0, **(base | changes))


def test_practice_traffic_asks_each_round_its_words_runs_times() -> None:
    tasks = proof.round_tasks(args(), 0)
    assert len(tasks) == 32 and len(set(tasks)) == 4
    assert all(tasks.count(t) == 8 for t in set(tasks))
    assert not set(tasks) & set(lookup_agent.held_out())


def test_live_traffic_never_asks_a_task_twice() -> None:
    proof.ASKED.clear()
    proof.REPEATED.clear()
    rounds = [proof.round_tasks(args(traffic="live"), r) for r in range(5)]
    seen = [(lookup_agent.question_text(t), *lookup_agent.choices_of(t)) for r in rounds for t in r]
    assert len(seen) == 160 and len(set(seen)) == 160
    assert len(proof.ASKED) == 160 and proof.REPEATED == []
    held_out_words = {lookup_agent.word_of(t) for t in lookup_agent.held_out()}
    assert not {lookup_agent.word_of(t) for r in rounds for t in r} & held_out_words
    proof.round_tasks(args(traffic="live"), 0)  # the first round again: every task a repeat
    assert len(proof.REPEATED) == 32


def test_the_arithmetic_agents_live_questions_are_fresh_and_never_held_out() -> None:
    proof.ASKED.clear()
    proof.REPEATED.clear()
    rounds = [proof.round_tasks(args(agent="arithmetic", traffic="live"), r) for r in range(10)]
    asked = [t for r in rounds for t in r]
    assert len(asked) == 320 and len(set(asked)) == 320 and proof.REPEATED == []
    held = {f"{a}+{b}" for a, b in arithmetic_agent.held_out()}
    assert not set(asked) & held
    practice = proof.round_tasks(args(agent="arithmetic"), 0)
    assert len(set(practice)) == 4 and not set(practice) & held


def test_a_judge_runs_file_names_its_judge_and_records_the_settings() -> None:
    assert proof.result_name(args()) == "heldout_rerun_0.json"
    assert proof.result_name(args(traffic="live")) == "heldout_rerun_live_env_0.json"
    named = proof.result_name(args(traffic="live", reward="judge", pair_accuracy=0.5))
    assert named == "heldout_rerun_live_judge50_0.json"
    named = proof.result_name(args(agent="arithmetic", reward="judge"))
    assert named == "heldout_rerun_arithmetic_practice_judge90_0.json"
    judge = {
        "RLPROXY_JUDGE_MODEL": "openai/standin",
        "RLPROXY_JUDGE_API_BASE": "http://127.0.0.1:9/v1",
        "RLPROXY_JUDGE_API_KEY_ENV": "STANDIN_KEY",
    }
    differing = provenance.settings_differing(judge)
    assert differing["judge.model"] == "openai/standin"
    assert not any(k.startswith(("trainer.", "rollout.", "group")) for k in differing)


def test_a_chosen_setting_is_refused_unless_it_is_one_and_named_in_the_file() -> None:
    chosen = proof.chosen_settings(["RLPROXY_SHADOW_SAMPLES=4"])
    assert chosen == {"RLPROXY_SHADOW_SAMPLES": "4"}
    for bad in ("SHADOW_SAMPLES=4", "RLPROXY_SHADOW_SAMPLES", "RLPROXY_DATA_DIR=/tmp/x"):
        try:
            proof.chosen_settings([bad])
        except ValueError as exc:
            assert "RLPROXY_<NAME>=VALUE" in str(exc)
        else:
            raise AssertionError(f"{bad!r} was taken")
    named = proof.result_name(args(settings=chosen))
    assert named == "heldout_rerun_practice_env_shadow_samples4_0.json"
    named = proof.result_name(args(agent="arithmetic", reward="judge", settings=chosen))
    assert named == "heldout_rerun_arithmetic_practice_judge90_shadow_samples4_0.json"
    differing = provenance.settings_differing(chosen)
    assert differing == {"groups.shadow_samples": 4}


def test_an_evaluation_past_the_held_out_words_re_runs_variants_of_them() -> None:
    tasks = proof.held_out_tasks("lookup", 250)
    assert tasks[:100] == lookup_agent.held_out()
    assert len(tasks) == 250 and len(set(tasks)) == 250
    words = {lookup_agent.word_of(t) for t in tasks}
    assert words == set(lookup_agent.held_out())  # still words never practised
    assert not words & set(lookup_agent.practice_tasks())
    # each variant is a task of its own: its own secret code and listed words
    asked = {(lookup_agent.answer_of(t), *lookup_agent.choices_of(t)) for t in tasks}
    assert len(asked) == 250
    assert proof.held_out_tasks("lookup", 10) == lookup_agent.held_out()[:10]
    arithmetic = [f"{a}+{b}" for a, b in arithmetic_agent.held_out()]
    assert proof.held_out_tasks("arithmetic", 100) == arithmetic
    with pytest.raises(ValueError, match="100 held-out tasks, not 101"):
        proof.held_out_tasks("arithmetic", 101)


def test_the_scripts_pairing_leaves_out_a_task_either_side_did_not_finish() -> None:
    """An episode that failed has no reward (`rerun` leaves it out); it is not paired as 0."""
    base = {"rewards": {"a": 0.0, "b": 1.0, "c": 0.5}}
    version = {"rewards": {"a": 1.0, "c": 1.0, "d": 1.0}}  # b failed; d: the base's failed
    paired = proof.paired_by_script(base, version)
    assert paired["tasks"] == 2
    assert paired["reward_difference"] == 0.75
    assert paired["success_difference"] == 1.0
