"""The data-parallel trainer: `rlproxy train` under torchrun with 2 CPU ranks (gloo) makes the
same version 1 from the same groups as one process.

The database is a real SQLite file with two scored groups of real token ids (8 turns), copied
so that both runs start from the same state. One run is `rlproxy train --steps 1`, the other
`torchrun --standalone --nproc-per-node 2 -m proxy.cli train --steps 1`; each writes version 1
from both groups (groups_per_step 2). The LoRA weights of the two versions must agree within
TOLERANCE (max |delta|, against an update whose own max is reported): the two ranks sum the
gradients of their halves of the batch, which equals the full batch's gradient up to float32
rounding. Only rank 0 wrote: one version folder, the groups marked used once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from storage import CallRecord, ChoiceRecord, Store
from storage.grouping import SignatureGrouper
from storage.records import JudgeOutcome
from trainer import checkpoints
from trainer.distributed import shard

REPO = Path(__file__).resolve().parents[2]

TOLERANCE = 1e-6
"""Max |delta| allowed between the LoRA weights of the two runs' version 1: 1 % of the update
itself, which is about learning_rate (1e-4) per weight (AdamW's first step is about
lr * sign(g)). The two runs differ only by the float32 rounding of the summed gradient;
measured here: 5.6e-10. Both runs take about 30 s of CPU (a minute of wall time on the loaded
2-core machine), so the test is in the default run."""


def test_shard_splits_by_tokens_contiguously() -> None:
    lengths = [10, 10, 10, 10, 40]
    parts = [shard(lengths, 2, r) for r in range(2)]
    assert parts == [slice(0, 4), slice(4, 5)]  # 40 tokens each
    rows = list(range(len(lengths)))
    assert [i for p in parts for i in rows[p]] == rows  # every row once, in order
    assert [shard(lengths, 1, 0)] == [slice(0, 5)]
    three = [shard([5, 5], 3, r) for r in range(3)]
    assert sum(len(range(5)[p]) for p in three) <= 2 and three[0].start == 0
    assert [i for p in three for i in [0, 1][p]] == [0, 1]  # fewer rows than ranks: some idle
    with pytest.raises(ValueError):
        shard(lengths, 2, 2)


async def _scored_groups(db_url: str, tokenizer: Any) -> None:
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
                            completion_logprobs=[-1.0 - 0.1 * i] * len(completion),
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
    finally:
        await store.close()


async def _trained_steps(db_url: str) -> list[int | None]:
    store = await Store.open(db_url)
    try:
        return sorted(g.trained_step for g in (await store.list_groups()).items)  # type: ignore[type-var]
    finally:
        await store.close()


def _train(data_dir: Path, model_dir: Path, ranks: int) -> str:
    env = {
        **os.environ,
        "RLPROXY_DATA_DIR": str(data_dir),
        "RLPROXY_MODEL_DIR": str(model_dir),
        "RLPROXY_TRAIN_POLL_S": "0.5",
        "RLPROXY_TRAIN_THREADS": "1",
        "RLPROXY_TRAINER": json.dumps({"groups_per_step": 2, "micro_batch_size": 2}),
    }
    if ranks == 1:
        command = [sys.executable, "-m", "proxy.cli", "train", "--steps", "1"]
    else:
        command = [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
            *("--nproc-per-node", str(ranks), "-m", "proxy.cli", "train", "--steps", "1"),
        ]
    done = subprocess.run(
        command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600, check=False
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    return out


@pytest.mark.asyncio(loop_scope="session")
async def test_two_cpu_ranks_make_the_same_update_as_one(
    tmp_path: Path, model_data_dir: Path, tokenizer: Any
) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    await _scored_groups(f"sqlite+aiosqlite:///{one / 'rlproxy.db'}", tokenizer)
    two.mkdir()
    shutil.copy(one / "rlproxy.db", two / "rlproxy.db")

    _train(one, model_data_dir, 1)
    out = _train(two, model_data_dir, 2)
    assert "rank 0 of 2" in out and "rank 1 of 2" in out, out
    assert "rank 1 stops after 1 steps" in out, out

    root_one, root_two = (d / "checkpoints" / "rlproxy" for d in (one, two))
    assert checkpoints.list_versions(root_one) == checkpoints.list_versions(root_two) == [1]
    for d in (one, two):
        assert await _trained_steps(f"sqlite+aiosqlite:///{d / 'rlproxy.db'}") == [1, 1]
    single = checkpoints.read_adapter_state(checkpoints.version_dir(root_one, 1))
    parallel = checkpoints.read_adapter_state(checkpoints.version_dir(root_two, 1))
    assert single.keys() == parallel.keys()
    delta = max(float((single[k] - parallel[k]).abs().max()) for k in single)
    # the update itself: version 1 against the fresh LoRA (B starts at zero)
    moved = max(float(v.abs().max()) for k, v in single.items() if "lora_B" in k)
    print(f"max |delta| between 1 and 2 ranks: {delta:.3g}; max |update| of lora_B: {moved:.3g}")
    assert moved > 0
    assert delta <= TOLERANCE, (delta, moved)
    state_one, state_two = (
        checkpoints.read_trainer_state(checkpoints.version_dir(r, 1)) for r in (root_one, root_two)
    )
    m1, m2 = state_one["metrics"], state_two["metrics"]
    assert m1["turns"] == m2["turns"] == 8 and m1["tokens"] == m2["tokens"]
    assert m2["loss"] == pytest.approx(m1["loss"], abs=1e-6)
    assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-4)
    opt_one = checkpoints.read_optimizer_state(checkpoints.version_dir(root_one, 1))
    opt_two = checkpoints.read_optimizer_state(checkpoints.version_dir(root_two, 1))
    assert max(float((opt_one[k].float() - opt_two[k].float()).abs().max()) for k in opt_one) < (
        1e-6
    )
    assert torch.isfinite(torch.cat([v.flatten() for v in parallel.values()])).all()
