"""The whole loop on a real server: traffic, explicit rewards, a GRPO step, a served new version.

`rlproxy serve` runs with its trainer process, background scoring and publishing on. An agent
that knows nothing of rlproxy runs one task four times and rewards each response by its
completion id. The group is scored from those rewards (no judge call), the trainer makes one
step on the real model, writes version 1, and the server publishes it: `rlproxy@1` appears in
/v1/models and its output differs from `rlproxy@base`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI
from safetensors.torch import load_file

from tests.e2e.conftest import Server
from tests.e2e.helpers import db_rows, own_server, wait_for

PROMPT = [
    {"role": "system", "content": "Reply with one word."},
    {"role": "user", "content": "Name a planet."},
]


@pytest.fixture(scope="module")
def tserver(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Iterator[Server]:
    env = {
        "RLPROXY_TRAIN": "true",
        "RLPROXY_PUBLISH_ADAPTERS": "true",
        "RLPROXY_ROLLOUT": "false",  # each version serves at once (the guard: test_rollout.py)
        "RLPROXY_SCORING": "true",
        "RLPROXY_SCORING_INTERVAL_S": "1",
        "RLPROXY_TRAIN_POLL_S": "1",
        "RLPROXY_ADAPTER_POLL_S": "1",
        "RLPROXY_GROUP_MIN_SIZE": "4",
        "RLPROXY_TRAINER": json.dumps({"groups_per_step": 1, "micro_batch_size": 4}),
    }
    with own_server(tmp_path_factory.mktemp("train-data"), model_data_dir, env) as server:
        yield server


def test_one_step_trains_and_the_new_version_serves(tserver: Server) -> None:
    with OpenAI(base_url=tserver.base_url, api_key="sk-test", max_retries=0, timeout=120) as c:
        for reward in (0.0, 0.25, 0.75, 1.0):
            answer = c.chat.completions.create(
                model="rlproxy", messages=PROMPT, max_tokens=8, temperature=1.0
            )
            r = httpx.post(
                f"{tserver.url}/rl/trajectories/{answer.id}/reward",
                json={"reward": reward, "source": "env"},
            )
            assert r.status_code == 200, r.text

        def published() -> bool:
            # Listed once loaded; serving the policy name only after the forgetting check.
            health = httpx.get(f"{tserver.url}/health", timeout=30).json()
            return health["active_version"] == 1

        wait_for(published, 300, "rlproxy serving version 1 (see trainer.log)")
        assert "rlproxy@1" in [m.id for m in c.models.list().data]

        def logprobs(model: str) -> list[float]:
            out = c.chat.completions.create(
                model=model, messages=PROMPT, max_tokens=4, temperature=0, logprobs=True
            )
            assert out.choices[0].logprobs is not None
            return [t.logprob for t in out.choices[0].logprobs.content or []]

        base, trained = logprobs("rlproxy@base"), logprobs("rlproxy@1")
        assert base != trained
        # the policy name flipped to version 1: its logprobs are version 1's, to float
        # tolerance (the repeated prompt is served from the prefix cache: only its last token
        # is prefilled again, which moves the last float digits)
        policy = logprobs("rlproxy")
        assert policy == pytest.approx(trained, abs=1e-4)
        assert policy != pytest.approx(base, abs=1e-4)

    weights = load_file(
        str(tserver.data_dir / "checkpoints" / "rlproxy" / "0001" / "adapter_model.safetensors")
    )
    lora_b = [t for k, t in weights.items() if "lora_B" in k]
    assert lora_b and any(torch.count_nonzero(t) > 0 for t in lora_b)  # B starts at zero

    adapters = httpx.get(f"{tserver.url}/rl/adapters", timeout=30).json()["data"]
    (v1,) = [a for a in adapters if a["version"] == 1]
    assert v1["status"] == "loaded" and v1["active"] and v1["activated_at"]
    assert v1["metrics"]["groups"] == 1 and v1["metrics"]["tokens"] > 0
    (group,) = db_rows(
        tserver.data_dir, "SELECT status, trained_step FROM groups WHERE source='task'"
    )
    assert (group["status"], group["trained_step"]) == ("scored", 1)


def test_responses_api_runs_train_the_next_version(tserver: Server) -> None:
    """The same loop through the Responses API: four runs of one task, rewarded by their
    `resp_...` ids, train the next version, and the next response comes from it."""
    with OpenAI(base_url=tserver.base_url, api_key="sk-test", max_retries=0, timeout=120) as c:
        active = max(a["version"] for a in httpx.get(f"{tserver.url}/rl/adapters").json()["data"])
        for reward in (0.0, 0.25, 0.75, 1.0):
            response = c.responses.create(
                model="rlproxy",
                instructions="Reply with one word.",
                input="Name a colour.",
                max_output_tokens=8,
                temperature=1.0,
            )
            r = httpx.post(
                f"{tserver.url}/rl/trajectories/{response.id}/reward",
                json={"reward": reward, "source": "env"},
            )
            assert r.status_code == 200, r.text
        nxt = f"rlproxy@{active + 1}"
        wait_for(lambda: nxt in [m.id for m in c.models.list().data], 300, f"{nxt} published")
        wait_for(
            lambda: any(
                a["active"] and a["version"] == active + 1
                for a in httpx.get(f"{tserver.url}/rl/adapters").json()["data"]
            ),
            120,
            f"{nxt} active",
        )
        after = c.responses.create(model="rlproxy", input="Name a colour.", max_output_tokens=4)
    (row,) = db_rows(
        tserver.data_dir,
        "SELECT adapter_version, protocol FROM calls WHERE completion_id = ?",
        (after.id,),
    )
    assert (row["adapter_version"], row["protocol"]) == (active + 1, "responses")
    groups = db_rows(
        tserver.data_dir,
        "SELECT status, trained_step FROM groups WHERE trained_step = ?",
        (active + 1,),
    )
    assert groups and all(g["status"] == "scored" for g in groups)
