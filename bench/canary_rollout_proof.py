"""The proof of the canary rollout: a harmful adapter version is rolled back by itself, a good one
is promoted, on the arithmetic task (examples/arithmetic_agent.py), with the numbers behind both.

1. Practice (a server serving the base model, no trainer): the agent asks `--questions`
   practice questions `--runs` times each, `--practice-rounds` times, and reports the
   environment's reward for every answer; rlproxy groups the runs of each question.
2. Two adapters are trained from that same practice with `rlproxy train` (the real GRPO loop),
   `--steps` steps of `--groups-per-step` groups each, from fresh weights:
   - good: the true rewards, `--good-lr`;
   - harmful: the same groups with every reward inverted (1 - r), `--harmful-lr` (high on
     purpose, so that the version is measurably worse, not just different).
3. Before any rollout, both are measured on their own server: the agent's `eval` (100 held-out
   questions, `--eval-samples` each, the agent's own reward) for the base, the good and the
   harmful version; each version's reward against its parent's (the base) is printed in
   standard errors. A rollout decision means something only if these differ as intended.
4. The rollout server (RLPROXY_ROLLOUT=true, share 0.5, publisher on, no trainer) decides on the
   environment's explicit rewards (RLPROXY_REWARD_POLICY=explicit; groups whose members all
   carry one are scored with no judge call): far less noisy than the 135M local judge, whose
   scores are noise. The good version goes on canary first, against the base; the agent keeps
   practising (true rewards) on new questions, each question's runs form a group that mixes
   both versions, until the rollout decides. Then the harmful version goes on canary against
   whatever serves then (the good version if it was promoted), and the same again.

Prints the measured rewards, each decision with its figures (n groups, mean paired difference d,
its sd, the bounds, t critical), the policy name's calls from the canary's start to its decision,
and the wall time. Not a test: it prints, it asserts nothing.

    OMP_NUM_THREADS=1 .venv/bin/python bench/canary_rollout_proof.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/canary_rollout_proof.py --reuse /tmp/rlproxy-canary-X

`--reuse` takes the trained versions of an earlier run's working folder and starts at 3. On a
loaded machine one torch thread per process (OMP_NUM_THREADS=1, inherited by the servers and
trainers) ran about ten times faster than the default. What it printed and how long it took on
the shared 2-core machine: docs/benchmarks/judge-and-rollout.md.
"""

from __future__ import annotations

import argparse
import json
import math
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

sys.path.insert(0, str(AGENT.parent))
from arithmetic_agent import HELD_OUT_COUNT  # noqa: E402


def agent(url: str, *args: str) -> dict[str, Any]:
    env = {**os.environ, "OPENAI_BASE_URL": f"{url}/v1", "OPENAI_API_KEY": "sk-agent"}
    done = subprocess.run(
        [sys.executable, str(AGENT), *args], env=env, capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(f"the agent failed ({done.returncode}):\n{done.stderr[-3000:]}")
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
    last = last_version(data_dir)
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
    deadline = time.monotonic() + 120
    while not listing(url).get(version, {}).get("canary"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"version {version} never went on canary: {listing(url)}")
        time.sleep(0.5)
    started = time.monotonic()
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
    rollout = record.get("rollout") or {}
    decision = (rollout.get("decisions") or [{}])[-1]
    began_at = float(rollout.get("started_at") or 0)
    decided_at = float(decision.get("at") or time.time())
    # The policy name's calls from the canary's start to the decision (pins excepted).
    served = query(
        data_dir,
        "SELECT coalesce(adapter_version, 0), count(*) FROM calls WHERE model_requested = "
        f"'rlproxy' AND created_at >= {began_at} AND created_at <= {decided_at} GROUP BY 1",
    )
    return {
        "version": version,
        "baseline": rollout.get("baseline"),
        "state": rollout.get("state"),
        "status": record.get("status"),
        "decision": decision,
        "calls": sum(n for _, n in served),
        "calls_by_version": dict(served),
        "rounds": rounds,
        "seconds": time.monotonic() - started,
    }


def show(result: dict[str, Any]) -> None:
    d = result["decision"]
    f = d.get("figures") or {}
    print(
        f"version {result['version']} against {result['baseline']}: {result['state']} (status "
        f"{result['status']}) after {result['calls']} calls {result['calls_by_version']} "
        f"({result['rounds']} rounds, {result['seconds']:.0f} s)",
        flush=True,
    )
    print(f"  reason: {d.get('reason')}", flush=True)
    if f:
        print(
            f"  n {f['n']} groups (of {f['groups']} mixed), old mean {f['old_mean']:.3f}, new mean "
            f"{f['new_mean']:.3f}, mean paired difference d {f['mean_diff']:+.3f} "
            f"(sd {f['sd_diff']:.3f}), bounds [{f['lower']:+.3f}, {f['upper']:+.3f}] at "
            f"t={f['t_critical']:.3f}, alpha per look {f['alpha_per_look']:.4f}, "
            f"margin {f['margin']}",
            flush=True,
        )


def evaluate(url: str, version: int | None, samples: int) -> dict[str, Any]:
    """The agent's own `eval` (held-out questions, its reward, nothing reported) on `version`."""
    model = "rlproxy@base"
    if version is not None:
        httpx.post(f"{url}/rl/adapters/{version}/load", timeout=300).raise_for_status()
        model = f"rlproxy@{version}"
    result = agent(url, "eval", "--model", model, "--samples", str(samples))
    print(
        f"  held-out {model}: {result['mean_reward']:.3f} ± {result['stderr']:.3f} "
        f"(exact answers {result['exact']:.0%}, n={result['episodes']}), e.g. "
        f"{result['examples'][:3]}",
        flush=True,
    )
    return result


def last_version(data_dir: Path) -> Path:
    root = data_dir / "checkpoints" / "rlproxy"
    return max(root.iterdir(), key=lambda p: p.name)


def held_out(url: str, versions: dict[str, int], samples: int) -> dict[str, dict[str, Any]]:
    """Held-out reward of the base and each version (the agent's own `eval`, its reward)."""
    out = {"base": evaluate(url, None, samples)}
    for name, version in versions.items():
        out[name] = evaluate(url, version, samples)
    base = out["base"]
    for name in versions:
        r = out[name]
        se = math.hypot(r["stderr"], base["stderr"])
        r["vs_parent"] = r["mean_reward"] - base["mean_reward"]
        r["vs_parent_se"] = r["vs_parent"] / se if se else None
        print(
            f"  {name}: {r['mean_reward']:.3f} vs its parent (base) {base['mean_reward']:.3f}: "
            f"{r['vs_parent']:+.3f} ({r['vs_parent_se'] or 0:+.1f} s.e.)",
            flush=True,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=4, help="questions per round")
    parser.add_argument("--runs", type=int, default=8, help="attempts per question (group)")
    parser.add_argument("--practice-rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="GRPO steps per trained version")
    parser.add_argument("--groups-per-step", type=int, default=2)
    parser.add_argument("--harmful-lr", type=float, default=1e-2)
    parser.add_argument("--good-lr", type=float, default=1e-3)
    parser.add_argument("--eval-samples", type=int, default=1, help="per held-out question")
    parser.add_argument("--margin", type=float, default=0.1)
    parser.add_argument("--min-groups", type=int, default=4)
    parser.add_argument("--max-groups", type=int, default=16)
    parser.add_argument("--max-rounds", type=int, default=6, help="rounds per trial at most")
    parser.add_argument(
        "--reuse",
        type=Path,
        default=None,
        help="the working folder of an earlier run: reuse its trained versions (skips 1 and 2)",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=Path(os.environ.get("RLPROXY_MODEL_DIR", REPO / "rlproxy-data")),
    )
    args = parser.parse_args()
    began = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="rlproxy-canary-"))
    print(f"working in {work}", flush=True)
    if args.reuse is not None:
        good, harmful = last_version(args.reuse / "good"), last_version(args.reuse / "harmful")
        steps = int(good.name)
        print(f"1-2. reusing {good} and {harmful} ({steps} steps each)", flush=True)
    else:
        good, harmful, steps = practise_and_train(work, args)
    measure_and_roll_out(work, args, good, harmful, steps, began)


def practise_and_train(work: Path, args: argparse.Namespace) -> tuple[Path, Path, int]:
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

    print("2. train a good version (true rewards) and a harmful one (rewards inverted)", flush=True)
    copy_data(practice, work / "harmful", invert=True)
    copy_data(practice, work / "good", invert=False)
    usable = usable_groups(practice)
    steps = min(args.steps, usable // args.groups_per_step)
    print(f"  {usable} groups with a reward spread: {steps} steps each", flush=True)
    if steps < 1:
        raise SystemExit("no group with a reward spread: practise more (--practice-rounds)")
    good = train(work / "good", args.model_dir, steps, args.good_lr, args.groups_per_step)
    harmful = train(work / "harmful", args.model_dir, steps, args.harmful_lr, args.groups_per_step)
    return good, harmful, steps


def measure_and_roll_out(
    work: Path, args: argparse.Namespace, good: Path, harmful: Path, steps: int, began: float
) -> None:
    print(
        f"3. held-out reward before the rollout ({HELD_OUT_COUNT} questions x "
        f"{args.eval_samples}, temperature 1; a server of its own)",
        flush=True,
    )
    evals = work / "eval"
    publish(good, evals, 1)
    publish(harmful, evals, 2)
    # `eval` sends its 100 questions at once: let them all queue.
    proc, url = start_server(
        evals,
        args.model_dir,
        {"RLPROXY_MAX_QUEUED_ROWS": "512", "RLPROXY_CALLER_CONCURRENCY": "256"},
    )
    try:
        measured = held_out(url, {"good": 1, "harmful": 2}, args.eval_samples)
    finally:
        stop(proc)

    print(
        "4. canary rollout: the good version first (against the base), then the harmful one "
        "(against whatever serves then); the environment's explicit rewards decide "
        "(RLPROXY_REWARD_POLICY=explicit: groups whose members all carry one are scored with no "
        "judge call)",
        flush=True,
    )
    served = work / "served"
    env = {
        **group_env(args.runs),
        "RLPROXY_REWARD_POLICY": "explicit",
        "RLPROXY_PUBLISH_ADAPTERS": "true",
        "RLPROXY_ADAPTER_POLL_S": "1",
        # The canary's decision is what this proves; the forgetting check, which runs before a
        # canary starts, could hold a version trained far on the task (proof_loop.py says why).
        "RLPROXY_FORGETTING_CHECK": "false",
        "RLPROXY_ROLLOUT": "true",
        "RLPROXY_ROLLOUT_SHARE": "0.5",
        "RLPROXY_ROLLOUT_MARGIN": str(args.margin),
        "RLPROXY_ROLLOUT_MIN_GROUPS": str(args.min_groups),
        "RLPROXY_ROLLOUT_MAX_GROUPS": str(args.max_groups),
    }
    proc, url = start_server(served, args.model_dir, env)
    try:
        publish(good, served, 1)
        fine = trial(url, served, 1, args, seed=1000)
        show(fine)
        publish(harmful, served, 2)
        bad = trial(url, served, 2, args, seed=2000)
        show(bad)
        final = listing(url)
    finally:
        stop(proc)
    active = [v for v, a in final.items() if a.get("active")]
    keep = ("state", "baseline", "calls", "calls_by_version", "rounds")
    print(
        json.dumps(
            {
                "held_out": {
                    k: {f: v.get(f) for f in ("mean_reward", "stderr", "exact", "vs_parent")}
                    for k, v in measured.items()
                },
                "good": {k: fine[k] for k in keep} | {"figures": fine["decision"].get("figures")},
                "harmful": {k: bad[k] for k in keep} | {"figures": bad["decision"].get("figures")},
                "active_at_end": active,
                "test": {
                    "margin": args.margin,
                    "min_groups": args.min_groups,
                    "max_groups": args.max_groups,
                    "group_size": args.runs,
                    "share": 0.5,
                    "reward_policy": "explicit",
                },
                "training": {
                    "steps": steps,
                    "groups_per_step": args.groups_per_step,
                    "good_lr": args.good_lr,
                    "harmful_lr": args.harmful_lr,
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
