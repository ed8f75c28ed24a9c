"""`rlproxy status`, and the progress bars of `export`, `score --pending` and `train --steps`.

The commands run as subprocesses against a SQLite database with real rows written through the
store: two groups of two rewarded runs (one served by the base model, one by adapter v1), an
open run whose call failed, and adapter v1 recorded with step metrics. A bar must appear when
standard error is a terminal (a pseudo-terminal here) and nothing but the usual lines in a pipe.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import math
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from storage import CallRecord, ChoiceRecord, Store
from storage.grouping import SignatureGrouper
from storage.records import AdapterRecord
from tests.trainer.test_wandb_log import wandb_history

RLPROXY = [sys.executable, "-m", "proxy.cli"]
REPO = Path(__file__).resolve().parents[2]


def _call(text: str, version: int | None, group: str | None, ok: bool = True) -> CallRecord:
    now = time.time()
    answer = ChoiceRecord(
        index=0,
        message={"role": "assistant", "content": f"answer to {text}"},
        finish_reason="stop",
        completion_token_ids=[504, 3060, 2],
        completion_logprobs=[-1.5, -0.75, -0.25],
    )
    return CallRecord(
        id=os.urandom(16).hex(),
        created_at=now,
        finished_at=now + 0.01,
        model_requested="rlproxy",
        engine="local",
        request_messages=[{"role": "user", "content": text}],
        adapter_version=version,
        choices=[answer] if ok else [],
        prompt_token_ids=[1, 9690, 198, 4093],
        status="completed" if ok else "error",
        error=None if ok else "engine failed",
        explicit_group_key=group,
    )


async def _fill(data_dir: Path) -> None:
    store = await Store.open(f"sqlite+aiosqlite:///{data_dir / 'rlproxy.db'}")
    try:
        for text, version, group, reward in [
            ("one", None, "g-base", 0.2),
            ("two", None, "g-base", 0.9),
            ("three", 1, "g-v1", 0.4),
            ("four", 1, "g-v1", 0.8),
        ]:
            tid = await store.record_call(_call(text, version, group))
            await store.add_reward(tid, reward, "env")
        await store.record_call(_call("five", 1, None, ok=False))
        await store.form_groups(SignatureGrouper(min_size=2))
        now = time.time()
        path = str(data_dir / "checkpoints" / "rlproxy" / "0001")
        await store.record_adapter(AdapterRecord("rlproxy", 1, path, "loaded", now, now))
        metrics = {"loss": 0.0123, "mean_reward": 0.55}
        await store.update_adapter("rlproxy", 1, metrics=metrics, activated_at=now)
    finally:
        await store.close()


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    asyncio.run(_fill(tmp_path))
    return tmp_path


def _env(data_dir: Path, **extra: str) -> dict[str, str]:
    # A judge model is named so that `score` builds no local engine: groups whose members all
    # have explicit rewards are scored from them without a judge call.
    return {
        **os.environ,
        "RLPROXY_DATA_DIR": str(data_dir),
        "RLPROXY_JUDGE_MODEL": "openai/unused",
        **extra,
    }


def run(data_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RLPROXY, *args],
        env=_env(data_dir, **env),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def run_on_a_terminal(data_dir: Path, *args: str, **env: str) -> tuple[int, str, str]:
    """Run with standard error on a pseudo-terminal (100 columns); (code, stdout, terminal)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    proc = subprocess.Popen(
        [*RLPROXY, *args],
        env=_env(data_dir, **env),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=slave,
        text=True,
    )
    os.close(slave)
    seen: list[bytes] = []

    def read() -> None:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                return
            if not chunk:
                return
            seen.append(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    stdout, _ = proc.communicate(timeout=600)
    reader.join(timeout=30)
    os.close(master)
    return proc.returncode, stdout, b"".join(seen).decode(errors="replace")


def _bar(text: str) -> bool:
    return "100%" in text and "|" in text


# --------------------------------------------------------------------------- status


def test_status_prints_one_table_of_what_the_database_holds(data_dir: Path) -> None:
    done = run(data_dir, "status")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if line.strip()}
    assert lines["model"].endswith(
        "SmolLM2-135M-Instruct (embedded), context 8,192 tokens: too short for Claude Code's and "
        "Codex's prompts; for those, serve a base model with a longer context, e.g. "
        "RLPROXY_BASE_MODEL=Qwen/Qwen2.5-0.5B-Instruct rlproxy serve (32,768 tokens; "
        "RLPROXY_BASE_MODEL: a Hugging Face id or a local model folder)"
    )
    assert "5 stored (1 failed), 5 in the last hour" in lines["calls"]
    assert "5 (closed 4, open 1)" in lines["trajectories"]
    assert "2 (ready 2); 0 trained on" in lines["groups"]
    assert "4 explicit rewards, 0 judge scores" in lines["rewards"]
    assert "1 version (loaded 1); last activated v1" in lines["adapters"]
    assert "newest v1 (loaded)" in lines["trainer"] and "loss 0.012" in lines["trainer"]
    assert "openai/unused" in lines["judge"] and "ready 2" in lines["judge"]
    assert "0.550 ± 0.350 (n 2)" in lines["base"]
    assert "0.600 ± 0.200 (n 2)" in lines["v1"]


def test_status_json_has_the_same_figures(data_dir: Path) -> None:
    done = run(data_dir, "status", "--json")
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    assert report["model"]["context"] == 8192
    assert report["model"]["longer_context"].startswith(
        "serve a base model with a longer context, e.g. RLPROXY_BASE_MODEL=Qwen/"
    )
    assert report["calls"] == {"total": 5, "failed": 1, "last_hour": 5}
    assert report["trajectories"] == {"closed": 4, "open": 1}
    assert report["groups"] == {"ready": 2, "trained_on": 0}
    assert report["adapters"]["last_activated"]["version"] == 1
    assert report["trainer"]["newest_version"]["metrics"]["loss"] == 0.0123
    by = {(r["version"], r["source"]): r for r in report["reward_by_version"]}
    assert by[0, "explicit"]["n"] == 2 and by[0, "explicit"]["mean"] == pytest.approx(0.55)
    assert by[1, "explicit"]["stderr"] == pytest.approx(0.2)


def test_status_names_a_base_model_that_is_set_and_gives_no_context_advice(
    data_dir: Path,
) -> None:
    done = run(data_dir, "status", RLPROXY_BASE_MODEL="Qwen/Qwen2.5-0.5B-Instruct")
    assert done.returncode == 0, done.stderr
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if line.strip()}
    assert lines["model"].split(None, 1)[1] == "Qwen/Qwen2.5-0.5B-Instruct (RLPROXY_BASE_MODEL)"
    report: dict[str, Any] = json.loads(
        run(data_dir, "status", "--json", RLPROXY_BASE_MODEL="/models/mine").stdout
    )
    assert report["model"] == {
        "base_model": "/models/mine",
        "context": None,
        "longer_context": None,
    }


def test_status_without_a_database_says_where_it_looked(tmp_path: Path) -> None:
    done = run(tmp_path / "nothing-here", "status")
    assert done.returncode == 1
    assert "no database at" in done.stderr and not done.stdout


# --------------------------------------------------------------------------- progress bars


def test_export_is_quiet_in_a_pipe_and_draws_a_bar_on_a_terminal(data_dir: Path) -> None:
    piped = run(data_dir, "export")
    assert piped.returncode == 0
    assert piped.stderr == "rlproxy export: wrote 4 trajectories\n"
    assert len(piped.stdout.splitlines()) == 4

    code, stdout, terminal = run_on_a_terminal(data_dir, "export")
    assert code == 0 and len(stdout.splitlines()) == 4  # the lines still go to stdout alone
    assert _bar(terminal) and "export" in terminal and "4/4" in terminal


def test_score_pending_is_quiet_in_a_pipe_and_draws_a_bar_on_a_terminal(
    data_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    code, stdout, terminal = run_on_a_terminal(data_dir, "score", "--pending")
    assert code == 0, terminal
    assert _bar(terminal) and "score" in terminal and "2/2" in terminal
    assert stdout.count("scored") == 4  # a row per member of the two groups

    other = tmp_path_factory.mktemp("score-pipe")
    asyncio.run(_fill(other))
    piped = run(other, "score", "--pending")
    assert piped.returncode == 0
    assert piped.stderr.splitlines() == [
        "rlproxy score: 0 trajectories grouped, 0 groups became ready"
    ]


def test_train_steps_draws_a_bar_and_logs_each_step_to_wandb_offline(
    data_dir: Path, model_data_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """One real GRPO step on the embedded model, from the rewards stored above."""
    pytest.importorskip("wandb", reason="wandb is an optional extra: pip install 'rlproxy[wandb]'")
    assert run(data_dir, "score", "--pending").returncode == 0
    wandb_dir = tmp_path_factory.mktemp("wandb")
    code, _, terminal = run_on_a_terminal(
        data_dir,
        "train",
        "--steps",
        "1",
        RLPROXY_MODEL_DIR=str(model_data_dir),
        RLPROXY_TRAINER=json.dumps({"groups_per_step": 1}),
        RLPROXY_LOG_LEVEL="WARNING",
        WANDB_PROJECT="rlproxy-test",
        WANDB_MODE="offline",
        WANDB_DIR=str(wandb_dir),
        WANDB_SILENT="true",
    )
    assert code == 0, terminal
    assert _bar(terminal) and "1/1" in terminal and "version=1" in terminal
    assert (data_dir / "checkpoints" / "rlproxy" / "0001" / "adapter_model.safetensors").is_file()
    (row,) = wandb_history(wandb_dir)
    assert row["step"] == 1 and float(row["train/version"]) == 1
    assert math.isfinite(float(row["train/loss"]))
    assert float(row["train/groups"]) == 1
