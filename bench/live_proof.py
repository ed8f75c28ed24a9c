"""The live-traffic proof: the agent proof's unchanged Agents SDK agent, but every task is new and
asked exactly once, as in production, and rlproxy groups it on its defaults.

The agent proof (`bench/agent_proof.py`) practises each task 8 times, so the runs of a task form
a group by their task signature. Live traffic never repeats a task: here each practice round
draws `--tasks` fresh tasks (a practice word with a variant that gives it its own secret code
and its own listed words: `examples/lookup_agent.py`'s `live_task`), runs each once and posts
the environment's reward. Nothing about grouping is set: each trajectory waits alone in its
task group for `RLPROXY_GROUP_ALONE_S` (60 s), then joins its agent's cohort, and the trainer
takes a cohort's advantages against a leave-one-out baseline (docs/concepts/groups.md).

Held-out evaluation is the agent proof's, on the same 100 tasks whose words are never practised
(sampled and greedy, mean ± s.e.), so the two proofs' curves compare directly. The trainer's
learning rate and groups per step are the agent proof's (6e-4, 4): the comparison is about the
traffic, not the optimiser. Every task is checked to be asked once (`repeated_tasks` must be 0),
and every episode to be one ordered trajectory, as in the agent proof.

    OMP_NUM_THREADS=1 .venv/bin/python bench/live_proof.py \
        [--minutes 70] [--eval-every 10] [--out bench/results]

Writes `<out>/live.json` and `<out>/live.png` (with the agent proof's curve from
`<out>/agent.json` beside it, by training minutes and by episodes) and prints the summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "examples"))

import agent_proof  # noqa: E402
import lookup_agent  # noqa: E402
import proof_loop  # noqa: E402
import provenance  # noqa: E402

EPISODES = {"practised": 0}
ASKED: set[tuple[str, ...]] = set()
REPEATED: list[str] = []
COUNTED: set[str] = set()


def fresh_tasks(round_number: int, count: int, seed: int) -> list[str]:
    """`count` tasks never asked before: practice words with variants numbered by the round."""
    rng = random.Random(f"live:{seed}:{round_number}")
    tasks = [
        lookup_agent.live_task(
            rng.choice(lookup_agent.practice_tasks()), round_number * count + i + 1
        )
        for i in range(count)
    ]
    for task in tasks:  # the task as the model sees it: its question and its tools' words
        seen = (lookup_agent.question_text(task), *lookup_agent.choices_of(task))
        if seen in ASKED:
            REPEATED.append(task)
        ASKED.add(seen)
    return tasks


def usable_groups(url: str) -> int:
    """The groups ready since the last count whose rewards differ (the trainer skips the
    others): the steps they make. A round's last trajectories may still wait alone (for
    `RLPROXY_GROUP_ALONE_S`) or in a cohort part not yet full; the next round's count has them."""
    with httpx.Client(base_url=url, timeout=60) as http:
        usable, cursor = 0, None
        while True:
            params: dict[str, Any] = {"limit": 200} | ({"cursor": cursor} if cursor else {})
            page = http.get("/rl/groups", params=params).json()
            for g in page["data"]:
                if g["id"] in COUNTED or g["status"] in ("forming", "expired"):
                    continue
                COUNTED.add(g["id"])
                members = http.get(f"/rl/groups/{g['id']}").json()["members"]
                rewards = {m["reward"] for m in members}
                usable += len(rewards) > 1 and None not in rewards
            cursor = page.get("next_cursor")
            if not cursor:
                break
    return usable


def practise(url: str, round_number: int, args: argparse.Namespace) -> dict[str, Any]:
    tasks = fresh_tasks(round_number, args.tasks, args.seed)

    async def run() -> dict[str, Any]:
        async with AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-agent", timeout=1800) as client:
            return await lookup_agent.train(client, "rlproxy", tasks, 1, 0, args.max_tokens)

    result = asyncio.run(run())
    EPISODES["practised"] += len(tasks)
    result["trajectories_checked"] = agent_proof.check_trajectories(url, result.pop("runs"))
    result["usable"] = usable_groups(url)
    result["episodes_so_far"] = EPISODES["practised"]
    return result


def evaluate(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    result = agent_proof.evaluate(url, model, args)
    result["episodes_practised"] = EPISODES["practised"]
    return result


def plot_beside(path: Path, live: list[dict[str, Any]], practice: list[dict[str, Any]]) -> None:
    """Held-out success of both proofs, by training minutes and by practice episodes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, x, label in (
        (axes[0], "train_minutes", "training minutes"),
        (axes[1], "episodes_practised", "practice episodes"),
    ):
        for evals, name, colour in (
            (practice, "practice: 4 tasks x 8 runs a round", "tab:blue"),
            (live, "live: every task new, asked once", "tab:red"),
        ):
            points = [e for e in evals if x in e or e["version"] == 0]
            if not points:
                continue
            ax.errorbar(
                [e.get(x, 0) for e in points],
                [e["success"] for e in points],
                yerr=[e["success_stderr"] for e in points],
                fmt="o-",
                color=colour,
                capsize=3,
                label=name,
            )
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out success, sampled (± 1 s.e.)")
    axes[0].set_ylim(0, 1)
    axes[1].legend(loc="upper left")
    fig.suptitle("SmolLM2-135M, Agents SDK lookup agent through rlproxy (2-core CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=70.0, help="training wall-time budget")
    parser.add_argument("--tasks", type=int, default=32, help="fresh tasks a practice round")
    parser.add_argument("--lr", type=float, default=6e-4, help="the agent proof's learning rate")
    parser.add_argument("--groups-per-step", type=int, default=4, help="the trainer's default")
    parser.add_argument("--max-tokens", type=int, default=48, help="limit per model turn")
    parser.add_argument("--max-batch", type=int, default=64, help="engine rows decoded together")
    parser.add_argument("--eval-samples", type=int, default=1)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=Path(os.environ.get("RLPROXY_MODEL_DIR", REPO / "rlproxy-data")),
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"settings: {json.dumps({k: str(v) for k, v in vars(args).items()})}", flush=True)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    servers = proof_loop.start_servers(
        args.model_dir,
        1,
        args.groups_per_step,
        args.lr,
        args.max_batch,
        "rlproxy-live-proof-",
        grouping_defaults=True,
    )
    settings = {k: str(v) for k, v in vars(args).items()} | {"server_env": servers.settings_env}
    result = proof_loop.run(
        servers,
        lambda url, r: practise(url, r, args),
        lambda url, model: evaluate(url, model, args),
        minutes=args.minutes,
        groups_per_step=args.groups_per_step,
        eval_every=args.eval_every,
        ahead=1,
        score="success",
        stderr="success_stderr",
        describe=lambda p: (
            f"practice success {p['success']:.0%} reward {p['mean_reward']:.3f} "
            f"({p['usable']} usable groups, {p['episodes_so_far']} episodes)"
        ),
        step_fields=lambda p: {
            "agent_success": p["success"],
            "agent_reward": p["mean_reward"],
            "episodes_so_far": p["episodes_so_far"],
        },
    )
    evals = result.evals
    base, last = evals[0], evals[-1]
    gain = last["success"] - base["success"]
    se = math.hypot(base["success_stderr"], last["success_stderr"])
    summary = {
        "steps": result.version,
        "wall_s": result.wall_s,
        "episodes_practised": EPISODES["practised"],
        "tasks_asked": len(ASKED),
        "repeated_tasks": REPEATED,
        "gain": gain,
        "gain_in_standard_errors": gain / se if se else None,
        "minutes_to_3_standard_errors": result.to_3se,
        "evaluation_seconds": result.eval_s,
        "trajectory_errors": agent_proof.TRAJECTORY_ERRORS,
        "settings": settings,
        **provenance.finish(servers.record),
        "steps_detail": result.steps,
        "evals": evals,
    }
    (args.out / "live.json").write_text(json.dumps(summary, indent=2))
    print(
        f"\n{result.version} steps in {result.wall_s / 60:.1f} min, {EPISODES['practised']} "
        f"episodes on {len(ASKED)} tasks ({len(REPEATED)} repeated)."
    )
    print(
        "\n| version | training min | episodes | success, sampled | success, greedy "
        "| gain (sampled) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for e in evals:
        g = e["greedy"]
        print(
            f"| {e['version']} | {e.get('train_minutes', 0):.1f} "
            f"| {e.get('episodes_practised', 0)} "
            f"| {e['success']:.1%} ± {e['success_stderr']:.1%} "
            f"| {g['success']:.1%} ± {g['success_stderr']:.1%} "
            f"| {e.get('gain_in_standard_errors') or 0:+.1f} |"
        )
    print(f"trajectories: {len(agent_proof.TRAJECTORY_ERRORS)} episodes not one ordered trajectory")
    if result.to_3se is None:
        print("never reached +3 standard errors over the base in this run")
    else:
        t = result.to_3se
        print(f"+3 standard errors first at version {t['version']}: {t['train_minutes']:.1f} min")
    practice_path = args.out / "agent.json"
    practice = json.loads(practice_path.read_text())["evals"] if practice_path.exists() else []
    for e in practice:  # the agent proof trains 4 groups x 8 runs a version
        e.setdefault("episodes_practised", 32 * e["version"])
    plot_beside(args.out / "live.png", evals, practice)
    print(f"wrote {args.out / 'live.json'} and {args.out / 'live.png'}")


if __name__ == "__main__":
    main()
