"""The data-parallel trainer: `rlproxy train` under torchrun with 2 CPU ranks (gloo) makes the
same version 1 from the same groups as one process.

The database is a real SQLite file with two scored groups of real token ids (8 turns), copied
so that both runs start from the same state. One run is `rlproxy train --steps 1`, the other
`torchrun --standalone --nproc-per-node 2 -m proxy.cli train --steps 1`; each writes version 1
from both groups (groups_per_step 2). The LoRA weights of the two versions must agree within
TOLERANCE (max |delta|, against an update whose own max is reported): the two ranks sum the
gradients of their halves of the batch, which equals the full batch's gradient up to float32
rounding. Only rank 0 wrote: one version folder, the groups marked used once.

`rlproxy serve`'s supervisor starts the same torchrun with RLPROXY_TRAINER_PROCESSES=2 (the
real supervisor class and a real torchrun child, in the slow run: `make test-slow`): its ranks
train version 1 and stop with it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from proxy.settings import Settings
from proxy.trainer_child import TrainerProcess
from storage import Store
from tests.trainer.test_trainer_crash import _scored_groups
from trainer import checkpoints
from trainer.distributed import lora_checksum, shard

REPO = Path(__file__).resolve().parents[2]

TOLERANCE = 1e-6
"""Max |delta| allowed between the LoRA weights of the two runs' version 1: 1 % of the update
itself, which is about learning_rate (1e-4) per weight (AdamW's first step is about
lr * sign(g)). The two runs differ only by the float32 rounding of the summed gradient;
measured here: 5.6e-10. Both runs take about 30 s of CPU (a minute of wall time on the loaded
2-core machine), so the test is in the default run."""

RESUMED_TOLERANCE = 1e-5
"""The bound on version 2, made by a resumed run (rank 1 got version 1 from rank 0): 10 % of one
update. Looser than version 1's: in the second step the LoRA A matrices move for the first time
(their gradient is zero while B is), and AdamW's first move of a weight is about lr whatever its
gradient's size, so the float rounding of a gradient entry near zero shows in full. Measured:
2.6e-6."""


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


async def _trained_steps(db_url: str) -> list[int | None]:
    store = await Store.open(db_url)
    try:
        return sorted(g.trained_step for g in (await store.list_groups()).items)  # type: ignore[type-var]
    finally:
        await store.close()


def _train(data_dir: Path, model_dir: Path, ranks: int, groups_per_step: int = 2) -> str:
    # the rate TOLERANCE is measured against (the trainer's default is larger)
    trainer = {"groups_per_step": groups_per_step, "micro_batch_size": 2, "learning_rate": 1e-4}
    env = {
        **os.environ,
        "RLPROXY_DATA_DIR": str(data_dir),
        "RLPROXY_MODEL_DIR": str(model_dir),
        "RLPROXY_TRAIN_POLL_S": "0.5",
        "RLPROXY_TRAIN_THREADS": "1",
        "RLPROXY_TRAINER": json.dumps(trainer),
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
    await _scored_groups(f"sqlite+aiosqlite:///{one / 'rlproxy.db'}", tokenizer, logprob_step=0.1)
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


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_resumed_ranks_start_from_rank_0s_checkpoint(
    tmp_path: Path, model_data_dir: Path, tokenizer: Any
) -> None:
    """Two runs of one step each (one group a step): the second resumes from version 1, which
    rank 0 loads and sends to rank 1; version 2 matches one process's version 2."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    await _scored_groups(f"sqlite+aiosqlite:///{one / 'rlproxy.db'}", tokenizer, logprob_step=0.1)
    two.mkdir()
    shutil.copy(one / "rlproxy.db", two / "rlproxy.db")
    for _ in range(2):
        _train(one, model_data_dir, 1, groups_per_step=1)
        out = _train(two, model_data_dir, 2, groups_per_step=1)
    assert "resumes after step 1" in out, out
    # rank 1 took version 1's weights from rank 0 (not its own fresh LoRA)
    v1 = checkpoints.read_adapter_state(checkpoints.version_dir(two / "checkpoints/rlproxy", 1))
    took = [
        float(line.rsplit("|w| ", 1)[1].rstrip(")"))
        for line in out.splitlines()
        if "rank 1 took rank 0's weights at step 1" in line
    ]
    assert took and took[-1] == pytest.approx(lora_checksum(v1), rel=1e-6), out
    root_one, root_two = (d / "checkpoints" / "rlproxy" for d in (one, two))
    assert checkpoints.list_versions(root_one) == checkpoints.list_versions(root_two) == [1, 2]
    single = checkpoints.read_adapter_state(checkpoints.version_dir(root_one, 2))
    parallel = checkpoints.read_adapter_state(checkpoints.version_dir(root_two, 2))
    delta = max(float((single[k] - parallel[k]).abs().max()) for k in single)
    moved = max(float(v.abs().max()) for v in single.values())
    print(f"version 2: max |delta| between 1 and 2 ranks {delta:.3g}, max |weight| {moved:.3g}")
    assert delta <= RESUMED_TOLERANCE, (delta, moved)


@pytest.mark.parametrize("rank,error", [(0, "RuntimeError"), (1, "ValueError")])
@pytest.mark.asyncio(loop_scope="session")
async def test_a_rank_failing_mid_step_stops_every_rank(
    tmp_path: Path, model_data_dir: Path, tokenizer: Any, rank: int, error: str
) -> None:
    """One rank's first micro-batch raises (what CUDA running out of memory on one GPU looks
    like; injected by tests/trainer/fail_once_on_rank0.py, as CPUs cannot provoke it) after the
    step's examples went out, while the other rank goes on to the gradient all-reduce. The
    ranks no longer agree on the next collective: the failing rank must exit with the error
    (torchrun then stops the other and the supervisor restarts both). Before, rank 0 tried the
    step again (the loop runs without --steps here, so it is the loop that retries), pairing its
    next broadcast with rank 1's pending all-reduce; rank 1 took a ValueError for a refusal
    every rank shares and went back to waiting for a command while rank 0 sat in the
    all-reduce. Both waited for ever."""
    data = tmp_path / "data"
    data.mkdir()
    await _scored_groups(f"sqlite+aiosqlite:///{data / 'rlproxy.db'}", tokenizer, logprob_step=0.1)
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "RLPROXY_DATA_DIR": str(data),
        "RLPROXY_MODEL_DIR": str(model_data_dir),
        "RLPROXY_TRAIN_POLL_S": "0.5",
        "RLPROXY_TRAIN_THREADS": "1",
        "RLPROXY_TRAINER": json.dumps({"groups_per_step": 2, "micro_batch_size": 2}),
        "FAIL_RANK": str(rank),
        "FAIL_ERROR": error,
    }
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"),
        *("2", str(REPO / "tests" / "trainer" / "fail_once_on_rank0.py"), "train"),
    ]
    proc = subprocess.Popen(
        command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out, _ = proc.communicate(timeout=300)  # a hang detector: the run takes about a minute
    except subprocess.TimeoutExpired:
        for pid in [*_children(proc.pid), proc.pid]:  # the ranks run in sessions of their own
            os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        pytest.fail(f"the ranks hung after rank {rank} failed mid-step:\n{out[-6000:]}")
    assert proc.returncode != 0, out[-6000:]
    assert f"injected on rank {rank}: out of memory" in out, out[-6000:]
    assert f"OutOfStep: rank {rank} of 2 failed inside a data-parallel step" in out, out[-6000:]
    assert "trying again" not in out and "step refused" not in out, out[-6000:]
    assert checkpoints.list_versions(data / "checkpoints" / "rlproxy") == []
    store = await Store.open(f"sqlite+aiosqlite:///{data / 'rlproxy.db'}")
    try:  # both groups wait for the restarted trainer
        assert [g.trained_step for g in (await store.list_groups()).items] == [None, None]
    finally:
        await store.close()


def test_the_supervisor_runs_torchrun_for_several_processes(tmp_path: Path) -> None:
    one = TrainerProcess(Settings(data_dir=tmp_path)).command()
    assert one[1:] == ["-m", "proxy.cli", "train"]
    two = TrainerProcess(Settings(data_dir=tmp_path, trainer={"processes": 2})).command()
    assert two[1:] == [
        *("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
        *("-m", "proxy.cli", "train"),
    ]
    mine = ["nice", "rlproxy", "train"]
    assert (
        TrainerProcess(
            Settings(data_dir=tmp_path, trainer={"processes": 2, "command": mine})
        ).command()
        == mine
    )


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_serve_supervisor_starts_the_trainer_data_parallel(
    tmp_path: Path, model_data_dir: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    await _scored_groups(f"sqlite+aiosqlite:///{data / 'rlproxy.db'}", tokenizer, logprob_step=0.1)
    monkeypatch.setenv("RLPROXY_TRAIN_POLL_S", "0.5")  # the child gets this environment
    monkeypatch.setenv("RLPROXY_TRAINER", json.dumps({"groups_per_step": 2}))
    settings = Settings(
        data_dir=data, model_dir=model_data_dir, trainer={"processes": 2, "threads": 1}
    )
    supervisor = TrainerProcess(settings)
    supervisor.start()
    root = data / "checkpoints" / "rlproxy"
    ranks: list[int] = []
    try:
        async with asyncio.timeout(600):
            while not checkpoints.list_versions(root):
                status = supervisor.status()
                assert status["restarts"] == 0, status  # the ranks did not exit on their own
                if status["pid"] and not ranks:
                    ranks = _children(status["pid"])  # torchrun's children: the two ranks
                await asyncio.sleep(0.5)
        ranks = ranks or _children(supervisor.status()["pid"])
        assert len(ranks) == 2
    finally:
        await supervisor.stop()
    assert checkpoints.list_versions(root) == [1]
    assert supervisor.proc is not None and supervisor.proc.returncode is not None
    for pid in ranks:
        assert (
            not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
        )
    log = (data / "trainer.log").read_text()
    assert "rank 0 of 2" in log and "rank 1 of 2" in log, log[-3000:]
