"""The guard on `rlproxy serve`'s defaults, through a real server and the `openai` client: a new
version goes on canary with no setting turned on, and the harm it can do is bounded by its call
budget even when no evidence ever comes (no rewards posted, no judge scores: scoring is off here,
as it is for a team with no rewards and an untrusted judge, whose scores the judge gate holds).

- At its call budget (RLPROXY_ROLLOUT_MAX_CALLS) the canary is paused: new conversations get
  the active version (here the base model), and the pause is recorded.
- Paused, with no evidence for RLPROXY_ROLLOUT_EVIDENCE_WAIT_S, it is rolled back and rejected,
  saying why (nothing showed it is not harmful); the base keeps serving everything.
- A version provably close to the active one on the traffic it served (`proxy.adapters.
  closeness`: a LoRA scaled down to almost nothing) is promoted at once, with no reward: the
  bound and its figures are in its rollout record. The word-salad LoRA measures far from it and
  waits for rewards.

The promote and roll-back decisions on evidence: tests/e2e/test_rollout.py (a scripted judge);
the test's arithmetic: tests/proxy/test_rollout_stats.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from tests.e2e.conftest import Server
from tests.e2e.helpers import own_server
from tests.e2e.test_adapters import write_random_lora
from tests.e2e.test_rollout import _adapter, _adapter_in, _call, _listing, _publish, _wait

BUDGET = 3


@pytest.fixture(scope="module")
def gserver(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Iterator[Server]:
    env = {
        "RLPROXY_PUBLISH_ADAPTERS": "true",
        "RLPROXY_ADAPTER_POLL_S": "0.5",
        # the random LoRA is word salad by the forgetting check's measure (test_forgetting.py)
        "RLPROXY_FORGETTING_CHECK": "false",
        "RLPROXY_ROLLOUT_MAX_CALLS": str(BUDGET),
        "RLPROXY_ROLLOUT_EVIDENCE_WAIT_S": "3",
    }
    with own_server(tmp_path_factory.mktemp("guard-data"), model_data_dir, env) as server:
        yield server


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Path:
    path = tmp_path_factory.mktemp("lora") / "lora"
    write_random_lora(model_data_dir, path)
    return path


def test_with_no_evidence_a_canary_is_paused_at_its_budget_then_rolled_back(
    gserver: Server, lora: Path
) -> None:
    listing = _listing(gserver)
    assert listing["rollout"]["enabled"] is True  # the default
    assert listing["rollout"]["test"]["max_calls"] == BUDGET
    _publish(gserver, lora, 1, parent=0)
    _wait(gserver, "canary of version 1", lambda d: d["rollout"]["canary"] == 1)

    with OpenAI(base_url=gserver.base_url, api_key="sk-test", max_retries=0, timeout=300) as c:
        served: list[int] = []
        # each call a new conversation; the canary draws about a quarter of them
        while served.count(1) < BUDGET:
            served.append(_call(c, gserver, "budget")[1])
            assert len(served) < 80, served
        listing = _wait(
            gserver,
            "version 1 paused at its budget",
            lambda d: (_adapter_in(d, 1).get("rollout") or {}).get("paused_at") is not None,
        )
        v1 = _adapter_in(listing, 1)
        assert v1["rollout"]["paused_after_calls"] >= BUDGET
        assert listing["rollout"]["canary"] == 1  # still on trial, waiting for evidence
        # paused: new conversations get the active version (the base) only
        after = [_call(c, gserver, "paused")[1] for _ in range(8)]
        assert after == [0] * 8
        # no evidence came: rolled back once the wait is over
        _wait(
            gserver, "version 1 rejected", lambda d: _adapter_in(d, 1).get("status") == "rejected"
        )
        v1 = _adapter(gserver, 1)
        assert v1["rollout"]["state"] == "rolled_back"
        reason = v1["rollout"]["decisions"][-1]["reason"]
        assert "no evidence after its budget" in reason, reason
        assert "rolled back" in v1["error"]
        assert _listing(gserver)["rollout"]["canary"] is None
        assert [_call(c, gserver, "end")[1] for _ in range(4)] == [0] * 4


def test_a_version_close_to_the_active_one_is_promoted_at_once(
    gserver: Server, tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path
) -> None:
    # the base served every call of the test above (temperature 1): episodes to measure on
    close = tmp_path_factory.mktemp("close") / "lora"
    write_random_lora(model_data_dir, close, scale=0.02)
    _publish(gserver, close, 2, parent=0)
    listing = _wait(
        gserver,
        "version 2 promoted",
        lambda d: (_adapter_in(d, 2).get("rollout") or {}).get("state") == "promoted",
    )
    v2 = _adapter_in(listing, 2)
    assert v2["active"] is True
    rollout = v2["rollout"]
    assert rollout["state"] == "promoted"
    assert "close to the base model" in rollout["decisions"][-1]["reason"]
    closeness = rollout["closeness"]
    assert closeness["verdict"] == "close" and closeness["episodes"] >= 4
    assert 0.0 < closeness["bound"] <= closeness["budget"] == 0.1
    assert rollout["drift"] == pytest.approx(closeness["bound"], abs=1e-6)
    with OpenAI(base_url=gserver.base_url, api_key="sk-test", max_retries=0, timeout=300) as c:
        # version 2 serves; the watch sends a tenth of the conversations to the base
        after = [_call(c, gserver, "after")[1] for _ in range(8)]
        assert set(after) <= {0, 2} and after.count(2) >= 2, after


def test_a_version_far_from_the_active_one_waits_for_rewards(gserver: Server, lora: Path) -> None:
    # version 2 served the last four calls above, whole: episodes to measure the word salad on
    _publish(gserver, lora, 3, parent=2)
    listing = _wait(
        gserver,
        "version 3 measured",
        lambda d: ((_adapter_in(d, 3).get("rollout") or {}).get("closeness") or {}).get("verdict"),
    )
    v3 = _adapter_in(listing, 3)
    closeness = v3["rollout"]["closeness"]
    assert closeness["verdict"] == "not close enough: the reward test decides"
    assert closeness["bound"] > 0.5 and closeness["drift_before"] == pytest.approx(
        _adapter(gserver, 2)["rollout"]["drift"]
    )
    assert v3["rollout"]["state"] == "canary" and listing["rollout"]["canary"] == 3
