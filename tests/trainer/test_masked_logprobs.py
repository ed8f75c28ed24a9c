"""Turns whose logprobs an engine took after a grammar's mask reach the trainer flagged.

The call record says so (`params.logprobs_after_grammar`, written by the chat service when the
engine masks before its logprobs, as vLLM does); the group read and the loop carry it to the
training examples, where `masked_logprobs` decides the ratio's reference
(tests/trainer/test_peft_backend.py). The e2e half, a call through the vllm engine under a
grammar, is in tests/e2e/test_vllm_serving.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from storage import Store
from storage.records import LOGPROBS_AFTER_GRAMMAR
from tests.trainer.test_staleness import _loop_at_version, _scored_group


@pytest.mark.asyncio(loop_scope="session")
async def test_the_flag_reaches_the_training_examples(store: Store, tmp_path: Path) -> None:
    params = ({LOGPROBS_AFTER_GRAMMAR: True}, {})
    await _scored_group(store, "weather", None, engine="vllm", params=params)
    loop, trainer = await _loop_at_version(store, tmp_path / "ckpt", 0)
    assert await loop.step_once() is not None
    (examples,) = trainer.seen
    assert sorted(e.logprobs_masked for e in examples) == [False, True]
