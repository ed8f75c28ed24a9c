"""Turns whose logprobs an engine took after a grammar's mask reach the trainer flagged.

The call record says so (`params.logprobs_after_grammar`, written by the chat service when the
engine masks before its logprobs, as vLLM does); the group read and the loop carry it to the
training examples, where `masked_logprobs` decides the ratio's reference
(tests/trainer/test_peft_backend.py). The e2e half, a call through the vllm engine under a
grammar, is in tests/e2e/test_vllm_serving.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from storage import CallRecord, ChoiceRecord, Store
from storage.grouping import SignatureGrouper
from storage.records import LOGPROBS_AFTER_GRAMMAR, JudgeOutcome
from tests.trainer.test_staleness import RecordingTrainer, store  # noqa: F401 (a fixture)
from trainer.config import TrainerConfig
from trainer.loop import TrainingLoop


@pytest.mark.asyncio(loop_scope="session")
async def test_the_flag_reaches_the_training_examples(store: Store, tmp_path: Path) -> None:  # noqa: F811
    for i, masked in enumerate((True, False)):
        now = time.time()
        tid = await store.record_call(
            CallRecord(
                id=f"call-{i}",
                created_at=now,
                finished_at=now + 0.1,
                model_requested="rlproxy",
                engine="vllm",
                request_messages=[{"role": "user", "content": "Weather in Oslo?"}],
                params={LOGPROBS_AFTER_GRAMMAR: True} if masked else {},
                prompt_token_ids=[1, 2, 3],
                explicit_trajectory_id=f"t{i}",
                explicit_group_key="g",
                choices=[
                    ChoiceRecord(
                        index=0,
                        message={"role": "assistant", "content": "x"},
                        finish_reason="stop",
                        completion_token_ids=[4, 5],
                        completion_logprobs=[-0.5, -0.5],
                    )
                ],
            )
        )
        await store.add_reward(tid, float(i), "env")
    (group_id,) = (await store.form_groups(SignatureGrouper(min_size=2))).ready
    assert await store.claim_group(group_id) == group_id
    await store.finish_scoring(
        group_id, JudgeOutcome(status="scored", scores=[], judge_model="explicit")
    )
    trainer = RecordingTrainer(TrainerConfig(groups_per_step=1))
    loop = TrainingLoop(store, trainer, tmp_path / "ckpt", policy="rlproxy")  # type: ignore[arg-type]
    assert await loop.step_once() is not None
    (examples,) = trainer.seen
    assert sorted(e.logprobs_masked for e in examples) == [False, True]
