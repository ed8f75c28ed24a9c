"""The proof of the canary rollout: a harmful adapter version is rolled back by itself, a good one
is promoted, on the arithmetic task (examples/arithmetic_agent.py), with the numbers behind both.

1. Practice (a server serving the base model, no trainer): the agent asks `--questions`
   practice questions `--runs` times each, `--practice-rounds` times, and reports the
   environment's reward for every answer; rlproxy groups the runs of each question.
2. Two adapters are trained from that same practice with `rlproxy train` (the real GRPO loop):
   - harmful: the same groups with every reward inverted (1 - r), `--harmful-lr`;
   - good: the true rewards, `--good-lr`.
3. The rollout server (RLPROXY_ROLLOUT=true, share 0.5, publisher on, no trainer, explicit rewards
   decide: the agent's environment is the reward here, so the 135M local judge's noise plays
   no part) gets the harmful version in its checkpoint folder. The agent keeps practising
   (true rewards) on new questions; each question's runs form a group that mixes both versions.
   The script counts the calls until the rollout decides. Then the good version (trained from
   fresh weights) goes in, and the same again.

Prints each decision with its figures (groups, mean paired difference, bounds, t critical), the
calls the canary took, and the wall time. Not a test: it prints, it asserts nothing.

    .venv/bin/python bench/canary_rollout_proof.py
    .venv/bin/python bench/canary_rollout_proof.py --questions 2 --runs 4 --practice-rounds 2 \
        --steps 2 --groups-per-step 1 --min-groups 3 --max-groups 6 --max-rounds 4

Runtime: the small run (second line) took 19 minutes on the 2-core machine under a load average
near 20 (other engineers' tests); the defaults need about 4 times its calls and were not run to
the end there. What it printed is in the README's Canary rollout section.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
AGENT = REPO / "examples" / "arithmetic_agent.py"
sys.path.insert(0, str(REPO))

from servers import start_server, stop  # noqa: E402


def agent(url: str, *args: str) -> dict[str, Any]:
    env = {**os.environ, "OPENAI_BASE_URL": f"{url}/v1", "OPENAI_API_KEY": "sk-agent"}
    done = subprocess.run(
        [sys.executable, str(AGENT), *args], env=env, capture_output=True, text=True, check=True
    )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def group_env(runs: int) -> dict[str, str]:
    return {
        "RLPROXY_SCORING": "true",
        "RLPROXY_SCORING_INTERVAL_S": "1",
        "RLPROXY_GROUP_MIN_SIZE": str(runs),
        "RLPROXY_GROUP_MAX_SIZE": str(runs),
        "RLPROXY_GROUP_WINDOW_S": "1e9",
        "RLPROXY_TRAJECTORY_IDLE_TIMEOUT_S": "1e9",
    }


def practise(url: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    return agent(
        url,
        "train",
        "--questions",
        str(args.questions),
        "--runs",
        str(args.runs),
        "--seed",
        str(seed),
    )


def wait_scored(data_dir: Path, timeout_s: float = 120) -> None:
    """Until no group is forming, ready or being scored (explicit rewards score at once)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = query(
            data_dir,
            "SELECT count(*) FROM groups WHERE status IN ('forming', 'ready', 'scoring') "
            "AND member_count >= 2",
        )[0][0]
        if not busy:
            return
        time.sleep(1)


def query(data_dir: Path, sql: str) -> list[tuple[Any, ...]]:
    uri = f"file:{data_dir / 'rlproxy.db'}?mode=ro"
    with sqlite3.connect(uri, uri=True, timeout=30) as conn:
        return conn.execute(sql).fetchall()


def copy_data(source: Path, target: Path, invert: bool) -> None:
    """The practice database as the trainer's input (rewards inverted for the harmful one)."""
    target.mkdir(parents=True)
    with (
        sqlite3.connect(source / "rlproxy.db") as src,
        sqlite3.connect(target / "rlproxy.db") as dst,
    ):
        src.backup(dst)
        if invert:
            dst.execute("UPDATE rewards SET reward = 1.0 - reward")
            dst.execute("UPDATE scores SET score = 1.0 - score")
        dst.commit()


def usable_groups(data_dir: Path) -> int:
    """Scored groups whose runs did not all get the same reward (GRPO skips the others)."""
    rows = query(
        data_dir,
        "SELECT gm.group_id, r.reward FROM group_members gm JOIN groups g ON g.id = gm.group_id "
        "JOIN rewards r ON r.trajectory_id = gm.trajectory_id WHERE g.status = 'scored'",
    )
    rewards: dict[str, set[float]] = {}
    for group_id, reward in rows:
        rewards.setdefault(group_id, set()).add(round(reward, 6))
    return sum(len(r) > 1 for r in rewards.values())


def train(data_dir: Path, model_dir: Path, steps: int, lr: float, groups: int) -> Path:
    env = {
        **os.environ,
        "RLPROXY_DATA_DIR": str(data_dir),
        "RLPROXY_MODEL_DIR": str(model_dir),
        "RLPROXY_TRAINER": json.dumps({"learning_rate": lr, "groups_per_step": groups}),
        "RLPROXY_TRAIN_POLL_S": "0.5",
    }
    started = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "proxy.cli", "train", "--steps", str(steps)],
        env=env,
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    root = data_dir / "checkpoints" / "rlproxy"
    last = max(root.iterdir(), key=lambda p: p.name)
    print(f"  trained {last.name} in {time.monotonic() - started:.0f} s (lr {lr})", flush=True)
    return last


def publish(source: Path, data_dir: Path, version: int) -> None:
    """Put `source` in place as version `version`, trained from fresh weights (parent 0)."""
    root = data_dir / "checkpoints" / "rlproxy"
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{version:04d}-proof"
    shutil.copytree(source, tmp)
    state = json.loads((tmp / "trainer_state.json").read_text())
    state.update(step=version, parent=0)
    (tmp / "trainer_state.json").write_text(json.dumps(state))
    tmp.rename(root / f"{version:04d}")


def listing(url: str) -> dict[int, dict[str, Any]]:
    data = httpx.get(f"{url}/rl/adapters", timeout=30).json()["data"]
    return {int(a["version"]): a for a in data}


def trial(url: str, data_dir: Path, version: int, args: argparse.Namespace, seed: int) -> dict:
    """Practise until the rollout decides on `version`; the decision and the calls it took."""
    deadline = time.monotonic() + 60
    while not listing(url).get(version, {}).get("canary"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"version {version} never went on canary: {listing(url)}")
        time.sleep(0.5)
    started = time.monotonic()
    before = query(data_dir, "SELECT count(*) FROM calls")[0][0]
    rounds = 0
    record: dict[str, Any] = {}
    while rounds < args.max_rounds:
        result = practise(url, args, seed + rounds)
        rounds += 1
        wait_scored(data_dir)
        time.sleep(3)  # a few publisher polls
        record = listing(url)[version]
        state = (record.get("rollout") or {}).get("state")
        latest = (record.get("rollout") or {}).get("latest") or {}
        print(
            f"  round {rounds}: agent reward {result['mean_reward']:.3f}, rollout {state}, "
            f"{latest.get('groups', 0)} mixed groups",
            flush=True,
        )
        if state != "canary":
            break
    served = query(
        data_dir,
        f"SELECT coalesce(adapter_version, 0), count(*) FROM calls WHERE rowid > {before} "
        "GROUP BY 1",
    )
    calls = sum(n for _, n in served)
    return {
        "version": version,
        "state": (record.get("rollout") or {}).get("state"),
        "status": record.get("status"),
        "decision": ((record.get("rollout") or {}).get("decisions") or [{}])[-1],
        "calls": calls,
        "calls_by_version": dict(served),
        "rounds": rounds,
        "seconds": time.monotonic() - started,
    }


def show(result: dict[str, Any]) -> None:
    d = result["decision"]
    f = d.get("figures") or {}
    print(
        f"version {result['version']}: {result['state']} (status {result['status']}) after "
        f"{result['calls']} calls {result['calls_by_version']} in {result['rounds']} rounds, "
        f"{result['seconds']:.0f} s",
        flush=True,
    )
    print(f"  reason: {d.get('reason')}", flush=True)
    if f:
        print(
            f"  groups {f['n']} (of {f['groups']} mixed), old mean {f['old_mean']:.3f}, new mean "
            f"{f['new_mean']:.3f}, mean paired difference {f['mean_diff']:+.3f} "
            f"(sd {f['sd_diff']:.3f}), bounds [{f['lower']:+.3f}, {f['upper']:+.3f}] at "
            f"t={f['t_critical']:.3f}, alpha per look {f['alpha_per_look']:.4f}, "
            f"margin {f['margin']}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=4, help="questions per round")
    parser.add_argument("--runs", type=int, default=8, help="attempts per question (group)")
    parser.add_argument("--practice-rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per trained version")
    parser.add_argument("--groups-per-step", type=int, default=2)
    parser.add_argument("--harmful-lr", type=float, default=3e-3)
    parser.add_argument("--good-lr", type=float, default=1e-4)
    parser.add_argument("--margin", type=float, default=0.1)
    parser.add_argument("--min-groups", type=int, default=4)
    parser.add_argument("--max-groups", type=int, default=16)
    parser.add_argument("--max-rounds", type=int, default=6, help="rounds per trial at most")
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=Path(os.environ.get("RLPROXY_MODEL_DIR", REPO / "rlproxy-data")),
    )
    args = parser.parse_args()
    began = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="rlproxy-canary-"))
    print(f"working in {work}", flush=True)

    print("1. practice on the base model", flush=True)
    practice = work / "practice"
    proc, url = start_server(practice, args.model_dir, group_env(args.runs))
    try:
        for r in range(args.practice_rounds):
            out = practise(url, args, seed=r)
            print(f"  round {r + 1}: agent reward {out['mean_reward']:.3f}", flush=True)
        wait_scored(practice)
    finally:
        stop(proc)

    print("2. train a harmful version (rewards inverted) and a good one", flush=True)
    copy_data(practice, work / "harmful", invert=True)
    copy_data(practice, work / "good", invert=False)
    usable = usable_groups(practice)
    steps = min(args.steps, usable // args.groups_per_step)
    print(f"  {usable} groups with a reward spread: {steps} steps each", flush=True)
    if steps < 1:
        raise SystemExit("no group with a reward spread: practise more (--practice-rounds)")
    harmful = train(work / "harmful", args.model_dir, steps, args.harmful_lr, args.groups_per_step)
    good = train(work / "good", args.model_dir, steps, args.good_lr, args.groups_per_step)

    print("3. canary rollout", flush=True)
    served = work / "served"
    env = {
        **group_env(args.runs),
        "RLPROXY_PUBLISH_ADAPTERS": "true",
        "RLPROXY_ADAPTER_POLL_S": "1",
        "RLPROXY_ROLLOUT": "true",
        "RLPROXY_ROLLOUT_SHARE": "0.5",
        "RLPROXY_ROLLOUT_MARGIN": str(args.margin),
        "RLPROXY_ROLLOUT_MIN_GROUPS": str(args.min_groups),
        "RLPROXY_ROLLOUT_MAX_GROUPS": str(args.max_groups),
    }
    proc, url = start_server(served, args.model_dir, env)
    try:
        publish(harmful, served, 1)
        bad = trial(url, served, 1, args, seed=1000)
        show(bad)
        publish(good, served, 2)
        fine = trial(url, served, 2, args, seed=2000)
        show(fine)
        final = listing(url)
    finally:
        stop(proc)
    active = [v for v, a in final.items() if a.get("active")]
    print(
        json.dumps(
            {
                "harmful": {k: bad[k] for k in ("state", "calls", "rounds")},
                "good": {k: fine[k] for k in ("state", "calls", "rounds")},
                "active_at_end": active,
                "test": {
                    "margin": args.margin,
                    "min_groups": args.min_groups,
                    "max_groups": args.max_groups,
                    "group_size": args.runs,
                    "share": 0.5,
                },
                "runtime_s": round(time.monotonic() - began),
            }
        ),
        flush=True,
    )
    print(
        f"bound: a decision needs at most max_groups = {args.max_groups} mixed groups of "
        f"{args.runs} runs, i.e. {args.max_groups * args.runs} calls (plus runs in groups "
        "that happened to hold one version only)",
        flush=True,
    )


if __name__ == "__main__":
    main()
