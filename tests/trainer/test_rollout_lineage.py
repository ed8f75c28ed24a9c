"""The trainer leaves the weights of a version serving rolled back (canary rollout): it goes back
to the newest version whose lineage is clean, or to fresh LoRA weights, and keeps counting
versions. Real PEFT trainer on the embedded model, real SQLite store."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from storage import Store
from storage.records import AdapterRecord
from trainer import checkpoints
from trainer.config import TrainerConfig
from trainer.loop import TrainingLoop
from trainer.peft_backend import PeftTrainer

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture(scope="module")
def trainer(model_data_dir: Path) -> PeftTrainer:
    from proxy.engines.loader import ensure_fp32_cache

    return PeftTrainer(ensure_fp32_cache(model_data_dir), TrainerConfig(), device="cpu")


def _nudge(trainer: PeftTrainer, seed: int) -> None:
    """Move the LoRA weights as a step would (a different place for each seed)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.01)


def _weights(trainer: PeftTrainer) -> dict[str, torch.Tensor]:
    return trainer.adapter_state()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


async def _record(store: Store, version: int, **changes: object) -> None:
    now = time.time()
    await store.record_adapter(AdapterRecord("rlproxy", version, "p", "written", now, now))
    if changes:
        await store.update_adapter("rlproxy", version, **changes)


async def test_rolled_back_weights_are_left_for_the_newest_clean_version(
    store: Store, trainer: PeftTrainer, tmp_path: Path
) -> None:
    root = tmp_path / "checkpoints"
    trainer.reset_adapter()
    fresh = _weights(trainer)
    trainer.step = 0
    for version, parent in ((1, 0), (2, 1)):
        _nudge(trainer, version)
        trainer.step = version
        trainer.save(root, {"parent": parent})
    v1 = checkpoints.read_adapter_state(checkpoints.version_dir(root, 1))
    v2 = _weights(trainer)
    assert not _same(v1, v2) and not _same(fresh, v1)
    loop = TrainingLoop(store, trainer, root, policy="rlproxy")
    loop.weights_version = 2

    await _record(store, 1, status="loaded", activated_at=time.time())
    await _record(store, 2, status="loaded")
    await loop.leave_rolled_back()  # nothing was rolled back: nothing changes
    assert _same(_weights(trainer), v2) and loop.weights_version == 2

    await store.update_adapter(
        "rlproxy", 2, status="rejected", rollout={"state": "rolled_back", "decisions": []}
    )
    await loop.leave_rolled_back()
    assert loop.weights_version == 1
    assert _same(_weights(trainer), v1)
    assert trainer.step == 2  # the next version is 3: numbers never go back

    await store.update_adapter(
        "rlproxy", 1, status="rejected", rollout={"state": "rolled_back", "decisions": []}
    )
    await loop.leave_rolled_back()
    assert loop.weights_version == 0
    assert _same(_weights(trainer), fresh)
    assert trainer.step == 2
    trainer.step = 0
