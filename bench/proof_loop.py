"""The machinery the learning proofs share: two servers, the practise/step/evaluate loop, a plot.

A proof (`bench/learning_proof.py`, `bench/agent_proof.py`) supplies an agent's practice round
and its held-out evaluation; this module does the rest:

- `start_servers`: the training server (`rlproxy serve` with its trainer, background scoring
  and publishing on, groups of exactly `runs` trajectories, one GRPO step per `groups_per_step`
  usable groups) and an evaluation server with no trainer and its own database, reading the
  same checkpoint folder, so held-out traffic never becomes training data;
- `run`: practice rounds until the training budget is spent (with `ahead`, the next round is
  generated while the trainer steps on the last one: one-step-off-policy, corrected by GRPO's
  ratio against the stored logprobs), each published version waited for, held-out evaluation
  of the base, every `eval_every` versions and of the last one (no practice round in flight
  during an evaluation), the gain over the base in standard errors after each, and the first
  version at +3 standard errors (training minutes with the time spent evaluating left out, and
  with it);
- `plot`: practice reward per step and the held-out measure with its standard errors.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import provenance
from servers import SERVE_ONLY, start_server

POLL_S = 0.25

Practise = Callable[[str, int], dict[str, Any]]
"""(training server URL, round number) -> the round's summary; it must hold `mean_reward` and
`usable` (groups whose runs got different rewards: the trainer skips the others)."""
Evaluate = Callable[[str, str], dict[str, Any]]
"""(evaluation server URL, model name) -> the held-out result."""


@dataclass
class Servers:
    work: Path
    train_dir: Path
    train_url: str
    eval_url: str
    procs: list[subprocess.Popen[bytes]]
    settings_env: dict[str, str]
    record: dict[str, Any] = field(default_factory=dict)
    """`bench/provenance.py`'s record, started with the servers: the commit, the command, the
    training server's settings that differ from `rlproxy serve`'s defaults, the load. A proof
    writes `provenance.finish(servers.record)` into its result file."""

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
            proc.wait(timeout=60)


def start_servers(
    model_dir: Path,
    runs: int,
    groups_per_step: int,
    lr: float,
    max_batch: int,
    prefix: str = "rlproxy-proof-",
    trainer_extra: dict[str, Any] | None = None,
    grouping_defaults: bool = False,
    train_env_extra: dict[str, str] | None = None,
) -> Servers:
    """`grouping_defaults`: leave the RLPROXY_GROUP_* settings at serve's defaults (live traffic:
    groups form as they would for any user) instead of groups of exactly `runs` runs of a task.
    `train_env_extra`: more settings for the training server only (a judge, say)."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    train_dir, eval_dir = work / "train", work / "eval"
    (train_dir / "checkpoints" / "rlproxy").mkdir(parents=True)
    eval_dir.mkdir()
    (eval_dir / "checkpoints").symlink_to(train_dir / "checkpoints")
    trainer_cfg = {"groups_per_step": groups_per_step, "learning_rate": lr, **(trainer_extra or {})}
    engine_env = {
        "RLPROXY_MAX_BATCH_SIZE": str(max_batch),
        # an evaluation sends all its requests at once: no per-caller limits
        "RLPROXY_CALLER_CONCURRENCY": "0",
        "RLPROXY_CALLER_REQUESTS_PER_MINUTE": "0",
        "RLPROXY_MAX_QUEUED_ROWS": "0",
    }
    train_env = {
        **engine_env,
        "RLPROXY_TRAIN": "true",
        "RLPROXY_SCORING": "true",
        "RLPROXY_PUBLISH_ADAPTERS": "true",
        # The proofs measure the task. Trained far enough on it (lr 6e-4, about 30 steps) a
        # version answers every prompt with a bare number, and the forgetting check holds it
        # (bench/results/forgetting_threshold.json): the proof would wait for it forever.
        "RLPROXY_FORGETTING_CHECK": "false",
        # The proofs hold out their own tasks (never practised, evaluated on the evaluation
        # server). The server's own split would keep a tenth of the practice tasks out of
        # training, and the loop, counting the groups every practice round makes, would wait
        # for versions those groups never make.
        "RLPROXY_EVAL_SHARE": "0",
        "RLPROXY_SCORING_INTERVAL_S": str(POLL_S),
        "RLPROXY_TRAIN_POLL_S": str(POLL_S),
        "RLPROXY_ADAPTER_POLL_S": str(POLL_S),
        "RLPROXY_TRAINER": json.dumps(trainer_cfg),
    }
    if not grouping_defaults:
        train_env |= {
            "RLPROXY_GROUP_MIN_SIZE": str(runs),
            "RLPROXY_GROUP_MAX_SIZE": str(runs),
            "RLPROXY_GROUP_WINDOW_S": "1e9",
        }
    train_env |= train_env_extra or {}
    print(f"working in {work}", flush=True)
    inherited = {k: v for k, v in os.environ.items() if k.startswith("RLPROXY_")}
    record = provenance.start(
        settings=provenance.settings_differing({**inherited, **SERVE_ONLY, **train_env})
    )
    train_proc, train_url = start_server(train_dir, model_dir, train_env)
    try:
        eval_proc, eval_url = start_server(eval_dir, model_dir, engine_env)  # serve only
    except Exception:
        train_proc.terminate()
        raise
    return Servers(work, train_dir, train_url, eval_url, [train_proc, eval_proc], train_env, record)


def adapters(url: str) -> dict[int, dict[str, Any]]:
    data = httpx.get(f"{url}/rl/adapters", timeout=30).json()["data"]
    return {int(a["version"]): a for a in data}


def wait_for_version(url: str, version: int, timeout_s: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        a = adapters(url).get(version)
        if a is not None and a.get("status") == "loaded":
            return a
        time.sleep(POLL_S)
    return None


def model_for(eval_url: str, version: int | None) -> str:
    """The model name that reaches `version` on the evaluation server (loaded first)."""
    if version is None:
        return "rlproxy@base"
    r = httpx.post(f"{eval_url}/rl/adapters/{version}/load", timeout=120)
    r.raise_for_status()
    return f"rlproxy@{version}"


@dataclass
class Run:
    """What `run` measured."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    version: int = 0
    wall_s: float = 0.0
    eval_s: float = 0.0
    to_3se: dict[str, Any] | None = None
    stalls: list[int] = field(default_factory=list)
    """Versions that did not appear within `run`'s `stalled_s` (practice went on without them)."""


def run(
    servers: Servers,
    practise: Practise,
    evaluate: Evaluate,
    *,
    minutes: float,
    groups_per_step: int,
    eval_every: int,
    ahead: int,
    score: str = "mean_reward",
    stderr: str = "stderr",
    describe: Callable[[dict[str, Any]], str] = lambda p: f"practice reward {p['mean_reward']:.3f}",
    step_fields: Callable[[dict[str, Any]], dict[str, Any]] = lambda p: {},
    stop: Callable[[dict[str, Any]], bool] = lambda e: False,
    finish: Callable[[str], None] = lambda url: None,
    stalled_s: float | None = None,
) -> Run:
    """Practise, step, evaluate (see the module's text). `ahead`: 0 waits for every version the
    last round's groups make before practising again (on-policy), 1 practises the next round
    while the trainer steps, K > 1 also lets the trainer fall up to K - 1 versions behind the
    groups practised (traffic that does not wait for training, sampled by older versions).
    `score` and `stderr` name the held-out measure in `evaluate`'s result that the gain is
    counted in; `stop` ends the run early after an evaluation; `finish` reads what it needs from
    the training server (its URL) before the servers stop, whether the run ended or failed. A
    version the counted groups should make that has not appeared after 900 s is an error; with
    `stalled_s`, one missing for that long is given up (`Run.stalls`) and practice goes on, as
    live traffic would: for a judge whose gate may hold groups, or a trainer that drops stale
    groups after they were counted."""
    out = Run()
    started = 0.0
    # a proof stopped with SIGTERM (kill, nohup'd runs) still stops its servers and trainer
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    def held_out(version: int | None) -> None:
        began = time.monotonic()
        result = evaluate(servers.eval_url, model_for(servers.eval_url, version))
        result["version"] = version or 0
        if version is None:
            out.evals.append(result)
            return
        result["train_minutes"] = (began - started - out.eval_s) / 60
        result["wall_minutes"] = (began - started) / 60
        out.eval_s += time.monotonic() - began
        base = out.evals[0]
        se = math.hypot(base[stderr], result[stderr])
        result["gain_in_standard_errors"] = (result[score] - base[score]) / se if se else None
        result["load_average"] = os.getloadavg()[0]
        out.evals.append(result)
        gain = result["gain_in_standard_errors"] or 0
        print(
            f"  gain {gain:+.1f} s.e. after {result['train_minutes']:.1f} min of training "
            f"({result['wall_minutes']:.1f} min with evaluations), load "
            f"{result['load_average']:.1f}",
            flush=True,
        )
        if out.to_3se is None and gain >= 3:
            out.to_3se = {
                "version": version,
                "train_minutes": result["train_minutes"],
                "wall_minutes": result["wall_minutes"],
            }

    pool = ThreadPoolExecutor(1)
    try:
        held_out(None)
        started = time.monotonic()
        rounds, usable, dropped = 0, 0, 0
        pending: Future[dict[str, Any]] | None = None
        while time.monotonic() - started - out.eval_s < minutes * 60:  # evaluations aside
            if pending is None:
                pending = pool.submit(practise, servers.train_url, rounds)
                rounds += 1
            practice = pending.result()
            pending = None
            # The trainer steps once per `groups_per_step` usable groups (a group whose runs all
            # got the same reward has no signal and is skipped): count them instead of waiting.
            usable += practice["usable"]
            # the version this round's groups make (less the groups the trainer dropped as too
            # stale, as its last step reported), less the versions the trainer may lag by
            target = (usable - dropped) // groups_per_step - max(0, int(ahead) - 1)
            due = any(v % eval_every == 0 for v in range(out.version + 1, target + 1))
            if ahead and not due:
                pending = pool.submit(practise, servers.train_url, rounds)
                rounds += 1
            while out.version < target:
                published = wait_for_version(
                    servers.train_url, out.version + 1, timeout_s=stalled_s or 900
                )
                if published is None and stalled_s is not None:
                    # Live traffic does not wait for training: forget the groups counted for
                    # this version (held by the gate, or dropped as stale) and practise on.
                    out.stalls.append(out.version + 1)
                    usable = dropped + (out.version + max(0, int(ahead) - 1)) * groups_per_step
                    print(
                        f"version {out.version + 1} did not appear in {stalled_s:g} s: "
                        "practising on",
                        flush=True,
                    )
                    break
                if published is None:
                    raise RuntimeError(
                        f"version {out.version + 1} never appeared; see {servers.train_dir}"
                    )
                out.version += 1
                metrics = published.get("metrics") or {}
                dropped = int(metrics.get("stale_dropped_total") or dropped)
                target = (usable - dropped) // groups_per_step - max(0, int(ahead) - 1)
                out.steps.append(
                    {
                        "version": out.version,
                        "elapsed_s": time.monotonic() - started,
                        "train_reward": metrics.get("mean_reward", practice["mean_reward"]),
                        "loss": metrics.get("loss"),
                        "step_seconds": metrics.get("step_seconds"),
                        "skipped_groups": metrics.get("skipped_groups"),
                        "staleness_max": metrics.get("staleness_max"),
                        "staleness_mean": metrics.get("staleness_mean"),
                        "stale_dropped": metrics.get("stale_dropped"),
                    }
                    | step_fields(practice)
                )
                print(
                    f"step {out.version:3d}  {out.steps[-1]['elapsed_s']:6.0f} s  "
                    f"{describe(practice)}  step {metrics.get('step_seconds') or 0:.1f} s  "
                    f"load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
                if out.version % eval_every == 0:
                    held_out(out.version)
            if len(out.evals) > 1 and stop(out.evals[-1]):
                break
        if pending is not None:
            pending.result()
        out.wall_s = time.monotonic() - started
        if out.version and out.evals[-1]["version"] != out.version:
            held_out(out.version)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        try:
            finish(servers.train_url)
        finally:
            servers.stop()
    return out


def plot(
    path: Path,
    steps: list[dict[str, Any]],
    evals: list[dict[str, Any]],
    title: str,
    score: str = "mean_reward",
    stderr: str = "stderr",
    score_label: str = "held-out reward (± 1 s.e.)",
    ylabel: str = "reward",
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        [s["version"] for s in steps],
        [s["train_reward"] for s in steps],
        ".-",
        color="tab:blue",
        alpha=0.6,
        label="practice reward (mean of the step's groups)",
    )
    ax.errorbar(
        [e["version"] for e in evals],
        [e[score] for e in evals],
        yerr=[e[stderr] for e in evals],
        fmt="o-",
        color="tab:red",
        capsize=3,
        label=score_label,
    )
    ax.set_xlabel("training step (adapter version)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
