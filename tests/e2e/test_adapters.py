"""LoRA adapters on a running rlproxy: load a version, serve it by name, survive a corrupt one.

The adapter is a real PEFT LoRA for the embedded model, with random non-zero B matrices scaled
up so that its temperature-0 output visibly differs from the base model's. Versions are loaded
but never activated: the server is shared by every e2e test, and "rlproxy" must keep serving the
base model for them.
"""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from openai import AsyncOpenAI, OpenAI

PROMPT = [{"role": "user", "content": "Write a long story about a dragon."}]
TOKENS = 8


@dataclass(frozen=True)
class LoadedAdapter:
    path: Path
    base_before: str  # rlproxy@base's output before the adapter was loaded
    load_response: httpx.Response


def complete(client: OpenAI, model: str) -> str:
    r = client.chat.completions.create(
        model=model, messages=PROMPT, max_tokens=TOKENS, temperature=0, seed=0
    )
    return r.choices[0].message.content or ""


def write_random_lora(model_data_dir: Path, target: Path, *, scale: float = 3.0) -> None:
    """Save a random, clearly non-zero LoRA for the embedded model as a PEFT folder: A and B
    drawn as PEFT's `init_lora_weights=False` draws them, B times `scale`. At the default 3 every
    answer changes (to runs of spaces: the forgetting check holds it, so the suites that publish
    it turn the check off); 0.1 changes some greedy answers and passes; 0 is PEFT's fresh
    initialisation, the base exactly (bench/results/forgetting_threshold.json)."""
    from peft import LoraConfig, get_peft_model

    from proxy.engines.loader import load_model

    torch.manual_seed(0)
    base = load_model(model_data_dir, device=torch.device("cpu")).model
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        init_lora_weights=False,  # B random instead of zero: the adapter changes the output
    )
    peft_model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    peft_model.save_pretrained(str(target), safe_serialization=True)
    assert (target / "adapter_model.safetensors").is_file()
    assert (target / "adapter_config.json").is_file()


@pytest.fixture(scope="module")
def http(server):  # server: conftest.Server
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def adapter(server, client: OpenAI, http: httpx.Client, model_data_dir: Path) -> LoadedAdapter:
    base_before = complete(client, "rlproxy@base")
    path = server.data_dir / "checkpoints" / server.model_name / "0001"
    write_random_lora(model_data_dir, path)
    resp = http.post("/rl/adapters/1/load")
    return LoadedAdapter(path=path, base_before=base_before, load_response=resp)


@pytest.fixture(scope="module")
def adapter_output(adapter: LoadedAdapter, client: OpenAI) -> str:
    assert adapter.load_response.status_code == 200, adapter.load_response.text
    return complete(client, "rlproxy@1")


def test_load_and_list(adapter: LoadedAdapter, client: OpenAI, http: httpx.Client) -> None:
    assert adapter.load_response.status_code == 200, adapter.load_response.text
    assert "rlproxy@1" in [m.id for m in client.models.list().data]
    assert client.models.retrieve("rlproxy@1").id == "rlproxy@1"
    versions = {v["version"]: v for v in http.get("/rl/adapters").json()["data"]}
    assert versions[1]["loaded"] is True
    assert versions[1]["active"] is False
    # Loading again is a no-op, not an error.
    assert http.post("/rl/adapters/1/load").status_code == 200


def test_adapter_changes_output_and_base_is_unchanged(
    adapter: LoadedAdapter, adapter_output: str, client: OpenAI
) -> None:
    assert adapter_output != adapter.base_before
    assert complete(client, "rlproxy@base") == adapter.base_before
    # Loaded is not active: the policy name still serves the base model.
    assert complete(client, "rlproxy") == adapter.base_before


async def test_mixed_batch(
    adapter: LoadedAdapter, adapter_output: str, aclient: AsyncOpenAI
) -> None:
    models = ["rlproxy@1", "rlproxy@base", "rlproxy@1", "rlproxy@base"]
    results = await asyncio.gather(
        *(
            aclient.chat.completions.create(
                model=m, messages=PROMPT, max_tokens=TOKENS, temperature=0, seed=0
            )
            for m in models
        )
    )
    expected = {"rlproxy@1": adapter_output, "rlproxy@base": adapter.base_before}
    assert [(m, r.choices[0].message.content) for m, r in zip(models, results, strict=True)] == [
        (m, expected[m]) for m in models
    ]


def test_corrupt_adapter_is_rejected(
    adapter: LoadedAdapter, adapter_output: str, client: OpenAI, http: httpx.Client
) -> None:
    bad = adapter.path.parent / "0002"
    bad.mkdir()
    shutil.copy(adapter.path / "adapter_config.json", bad / "adapter_config.json")
    data = (adapter.path / "adapter_model.safetensors").read_bytes()
    (bad / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])

    resp = http.post("/rl/adapters/2/load")
    assert resp.status_code == 400, resp.text
    assert resp.headers.get("x-request-id")
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["code"], str) and error["code"]

    assert "rlproxy@2" not in [m.id for m in client.models.list().data]
    versions = {v["version"]: v for v in http.get("/rl/adapters").json()["data"]}
    assert versions[2]["loaded"] is False
    assert versions[1]["loaded"] is True
    assert complete(client, "rlproxy@1") == adapter_output


def test_missing_adapter_version(http: httpx.Client) -> None:
    resp = http.post("/rl/adapters/99/load")
    assert resp.status_code == 404, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["code"], str) and error["code"]


def test_unloaded_version_is_loaded_again_when_pinned(
    adapter: LoadedAdapter, adapter_output: str, client: OpenAI, http: httpx.Client
) -> None:
    resp = http.post("/rl/adapters/1/unload")
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"version": 1, "loaded": False, "was_loaded": True}
    assert http.post("/rl/adapters/1/unload").json()["was_loaded"] is False
    assert "rlproxy@1" not in [m.id for m in client.models.list().data]
    assert {v["version"]: v for v in http.get("/rl/adapters").json()["data"]}[1]["loaded"] is False
    # A client that pins the version gets it loaded on demand, with the same weights.
    assert complete(client, "rlproxy@1") == adapter_output
    assert {v["version"]: v for v in http.get("/rl/adapters").json()["data"]}[1]["loaded"] is True


def test_pinning_a_corrupt_version_is_model_not_found(client: OpenAI) -> None:
    import openai

    with pytest.raises(openai.NotFoundError) as info:
        complete(client, "rlproxy@2")  # the truncated folder of test_corrupt_adapter_is_rejected
    assert info.value.code == "model_not_found"
