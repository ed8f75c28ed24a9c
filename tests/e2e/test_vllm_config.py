"""rlproxy with the vllm engine in front of replicas set up wrong: each mistake of issue 24 is
accepted or refused with the fix in the message, never a server that quietly cannot work.

The replica is the stand-in (`tests/fakes/vllm_server.py`, the real embedded model behind vLLM's
protocol), started before rlproxy so that rlproxy's start meets it. The faults need the stand-in
because a real vLLM would have to be started wrong on purpose, or cannot show the fault at all
(the last one); they are its flags: `--root` (started on another model), `--no-runtime-lora`
(no LoRA routes), `--loras-serve-base` (an adapter name that does not resolve, the base
answering in its place). The engine's rules behind them are in tests/proxy/test_vllm_engine.py.

Slow (`make test-slow`, about a minute): CI checks the engine's rules behind each fault against
vLLM-shaped handlers (tests/proxy/test_vllm_engine.py) and a real vLLM refusing a rank over its
`--max-lora-rank` (tests/vllm_real, `make test-vllm`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from openai import APIStatusError, OpenAI

from tests.e2e.conftest import Server, free_port, start_server, stop_server
from tests.e2e.helpers import db_rows
from tests.e2e.test_adapters import write_random_lora
from tests.e2e.test_hotswap import _publish, _wait_status
from tests.fakes.stack import FakeReplica

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Path:
    """A rank-8 LoRA for the embedded model (the trainer's default rank)."""
    folder = tmp_path_factory.mktemp("lora") / "r8"
    write_random_lora(model_data_dir, folder)
    return folder


@contextmanager
def replica(folder: Path, model_dir: Path, *faults: str, rank: int = 16) -> Iterator[FakeReplica]:
    fake = FakeReplica(free_port(), model_dir, folder / "replica", rank, faults)
    fake.start()
    try:
        fake.wait()
        yield fake
    finally:
        fake.stop()


@contextmanager
def rlproxy(data_dir: Path, model_dir: Path, url: str, **extra: str) -> Iterator[Server]:
    env = {"RLPROXY_ENGINE": "vllm", "RLPROXY_VLLM_URLS": json.dumps([url]), **extra}
    env["RLPROXY_VLLM_HEALTH_INTERVAL_S"] = "0.5"
    proc, base, log = start_server(data_dir, model_dir, env)
    try:
        yield Server(url=base, data_dir=data_dir, model_name="rlproxy", log=log)
    finally:
        stop_server(proc)


def test_a_url_ending_in_v1_serves_and_an_adapter_over_the_max_rank_says_the_fix(
    tmp_path: Path, model_data_dir: Path, lora_dir: Path
) -> None:
    """`.../v1`, as users write OpenAI base URLs, is the server's root; a version whose rank is
    over the replica's --max-lora-rank is rejected with the flag to set."""
    with replica(tmp_path, model_data_dir, rank=4) as fake:
        publish = {
            "RLPROXY_PUBLISH_ADAPTERS": "true",
            "RLPROXY_ROLLOUT": "false",  # each version serves at once
            "RLPROXY_ADAPTER_POLL_S": "0.5",
        }
        with rlproxy(tmp_path, model_data_dir, fake.url + "/v1/", **publish) as server:
            health = httpx.get(f"{server.url}/health", timeout=30).json()
            assert health["status"] == "ok"
            (state,) = health["engine"]["replicas"]
            assert state["url"] == fake.url and state["healthy"]
            assert health["engine"]["served_root"] == str(
                model_data_dir / "models" / "smollm2-135m-instruct-fp32"
            )
            with OpenAI(base_url=server.base_url, api_key="sk-test", max_retries=0) as client:
                answer = client.chat.completions.create(model="rlproxy", messages=ASK, max_tokens=4)
            assert answer.choices[0].message.content is not None

            _publish(lora_dir, server.data_dir / "checkpoints" / "rlproxy", 1)
            rejected = _wait_status(server, 1, "rejected")
            assert "LoRA rank 8 is greater than max_lora_rank 4" in rejected["error"]
            assert "Fix: start vLLM with --max-lora-rank" in rejected["error"]


@pytest.mark.parametrize(
    ("fault", "fix"),
    [
        (("--root", "Qwen/Qwen2.5-7B-Instruct"), "Fix: start vLLM with --model"),
        (("--no-runtime-lora",), "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"),
    ],
    ids=["another-model", "no-runtime-lora"],
)
def test_a_replica_set_up_wrong_is_refused_at_start_with_the_fix(
    tmp_path: Path, model_data_dir: Path, fault: tuple[str, ...], fix: str
) -> None:
    with (
        replica(tmp_path, model_data_dir, *fault) as fake,
        pytest.raises(RuntimeError, match="server exited") as refused,
        rlproxy(tmp_path, model_data_dir, fake.url),
    ):
        pass
    assert fix in str(refused.value) and fake.url in str(refused.value)


def test_the_policy_is_never_served_by_the_base_when_its_adapter_does_not_resolve(
    tmp_path: Path, model_data_dir: Path, lora_dir: Path
) -> None:
    """Version 1 is active; the replica answers requests for `rlproxy@1` with its base. The
    client gets a 503, and no answer is stored as version 1's (training would learn nothing)."""
    _publish(lora_dir, tmp_path / "checkpoints" / "rlproxy", 1)
    with replica(tmp_path, model_data_dir, "--loras-serve-base") as fake:
        publish = {"RLPROXY_PUBLISH_ADAPTERS": "true", "RLPROXY_ROLLOUT": "false"}
        with rlproxy(tmp_path, model_data_dir, fake.url, **publish) as server:
            assert httpx.get(f"{server.url}/health", timeout=30).json()["active_version"] == 1
            with (
                OpenAI(base_url=server.base_url, api_key="sk-test", max_retries=0) as client,
                pytest.raises(APIStatusError) as failed,
            ):
                client.chat.completions.create(model="rlproxy", messages=ASK, max_tokens=4)
            assert failed.value.status_code == 503
            assert "did not resolve" in server.log.read_text()
            stored = db_rows(server.data_dir, "SELECT status, adapter_version FROM calls")
            assert stored and all(row["status"] != "completed" for row in stored)
