"""SIGKILL `rlproxy train` in the middle of a step, restart it: it resumes from the last complete
checkpoint, and nothing half-written is ever a version.

The database is a real SQLite file with two scored groups of real token ids (the tokenizer's ids
for real prompts and answers). `rlproxy train --steps 1` makes version 1; a second trainer is
killed with SIGKILL once its step has started; a stray half-written folder is left beside the
versions; a restarted trainer resumes from the newest complete version, makes version 2 from the
other group if the kill came before it was complete, and stops.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from storage import CallRecord, ChoiceRecord, Store
from storage.grouping import SignatureGrouper
from storage.records import JudgeOutcome
from trainer import checkpoints

pytestmark = pytest.mark.asyncio(loop_scope="session")
REPO = Path(__file__).resolve().parents[2]


async def _scored_groups(db_url: str, tokenizer: Any, logprob_step: float = 0.0) -> list[str]:
    """Two groups of four rewarded answers, scored; the i-th answer's stored logprobs are
    -1 - i x `logprob_step`."""
    store = await Store.open(db_url)
    try:
        for key, question in (("g1", "Name a color."), ("g2", "Name a fruit.")):
            for i, answer in enumerate(["Red", "Blue is nice", "Green", "I like yellow"]):
                messages = [{"role": "user", "content": question}]
                text = tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=False
                )
                prompt = tokenizer.encode(text, add_special_tokens=False)
                completion = [*tokenizer.encode(answer, add_special_tokens=False), 2]
                now = time.time()
                record = CallRecord(
                    id=f"{key}-{i}",
                    created_at=now,
                    finished_at=now + 0.1,
                    model_requested="rlproxy",
                    engine="local",
                    request_messages=messages,
                    prompt_token_ids=list(prompt),
                    explicit_trajectory_id=f"{key}-t{i}",
                    explicit_group_key=key,
                    choices=[
                        ChoiceRecord(
                            index=0,
                            message={"role": "assistant", "content": answer},
                            finish_reason="stop",
                            completion_token_ids=completion,
                            completion_logprobs=[-1.0 - logprob_step * i] * len(completion),
                        )
                    ],
                )
                tid = await store.record_call(record)
                await store.add_reward(tid, float(i) / 3, "env")
        ready = (await store.form_groups(SignatureGrouper(min_size=4))).ready
        assert len(ready) == 2
        for group_id in ready:
            assert await store.claim_group(group_id) == group_id
            await store.finish_scoring(
                group_id, JudgeOutcome(status="scored", scores=[], judge_model="explicit")
            )
        return ready
    finally:
        await store.close()


def _train(data_dir: Path, model_dir: Path, *args: str) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "RLPROXY_DATA_DIR": str(data_dir),
        "RLPROXY_MODEL_DIR": str(model_dir),
        "RLPROXY_TRAIN_POLL_S": "0.5",
        "RLPROXY_TRAINER": json.dumps({"groups_per_step": 1}),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "train", *args],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


async def _trained_steps(db_url: str) -> dict[str, int | None]:
    store = await Store.open(db_url)
    try:
        page = await store.list_groups()
        return {g.key: g.trained_step for g in page.items}
    finally:
        await store.close()


async def test_sigkill_mid_step_then_resume(
    tmp_path: Path, model_data_dir: Path, tokenizer: Any
) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    db_url = f"sqlite+aiosqlite:///{data_dir / 'rlproxy.db'}"
    await _scored_groups(db_url, tokenizer)
    root = data_dir / "checkpoints" / "rlproxy"

    first = _train(data_dir, model_data_dir, "--steps", "1")
    out, _ = first.communicate(timeout=600)
    assert first.returncode == 0, out
    assert checkpoints.list_versions(root) == [1]
    assert sorted((await _trained_steps(db_url)).values(), key=str) == [1, None]

    victim = _train(data_dir, model_data_dir)
    assert victim.stdout is not None
    log = []
    for line in victim.stdout:
        log.append(line)
        if "step 2: training on" in line:
            break
    else:
        pytest.fail("the second trainer never started step 2:\n" + "".join(log))
    time.sleep(0.3)  # inside the forward/backward of step 2
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    victim.stdout.close()

    # Whatever the kill interrupted, every numbered folder is a complete, loadable version.
    for version in checkpoints.list_versions(root):
        checkpoints.validate_adapter(checkpoints.version_dir(root, version))
    stray = root / ".tmp-0002-deadbeef"  # as a kill during a checkpoint write would leave it
    stray.mkdir(exist_ok=True)
    (stray / "adapter_model.safetensors").write_bytes(b"\x00" * 10)
    assert checkpoints.latest_checkpoint(root) == checkpoints.version_dir(
        root, max(checkpoints.list_versions(root))
    )

    resumed_from = max(checkpoints.list_versions(root))
    # Restart: train the missing step if the kill landed before version 2 was complete,
    # otherwise only resume (which also clears what an interrupted write left).
    steps = "1" if resumed_from == 1 else "0"
    third = _train(data_dir, model_data_dir, "--steps", steps)
    out, _ = third.communicate(timeout=600)
    assert third.returncode == 0, out
    assert f"resumes after step {resumed_from}" in out
    assert checkpoints.list_versions(root) == [1, 2]
    assert not stray.exists()  # cleared when the restarted trainer resumed
    state = checkpoints.read_trainer_state(checkpoints.version_dir(root, 2))
    assert state["step"] == 2
    assert checkpoints.read_optimizer_state(checkpoints.version_dir(root, 2))
    assert sorted((await _trained_steps(db_url)).values()) == [1, 2]
