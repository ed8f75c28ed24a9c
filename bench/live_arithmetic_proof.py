"""The live arithmetic proof: the learning proof's unchanged arithmetic agent, but every question
is new and asked exactly once, and rlproxy groups it on its defaults; rewarded by the
environment (`--reward env`) or by nothing but a judge (`--reward judge`).

The learning proof (`bench/learning_proof.py`) asks each practice question 8 times, so the runs
of a question form a group by their task signature. Live traffic never repeats a question: here
each practice round asks `--questions` questions drawn fresh from a shuffled pool (A + B with A
and B in 1..`--max-term`, less the learning proof's 100 held-out questions, each asked once in
the whole run: the 300 practice questions of 1..20 would last about nine steps). Nothing about
grouping is set: each answer waits alone in its task group for `RLPROXY_GROUP_ALONE_S` (60 s),
then joins the agent's cohort (one cohort: the agent has no system prompt and no tools), whose
groups are ready at 4 members and hold at most 8 (`RLPROXY_GROUP_MIN_SIZE`, `_MAX_SIZE`); the
trainer takes a cohort's advantages against a leave-one-out baseline (docs/concepts/groups.md).
A round takes at least `--round-s` seconds (traffic arrives at most `--questions` per
`--round-s`); as in the learning proof, the next round is asked while the trainer steps.

`--reward env`: the agent posts each answer's reward (the live-traffic proof of this agent).

`--reward judge`: nothing is posted. The harness ends each round's episodes
(`POST /rl/trajectories/{id}/end`, the environment saying the episode is over, with no reward;
left open they would close only after `RLPROXY_TRAJECTORY_IDLE_TIMEOUT_S`, 600 s), and the
training server's judge is `bench/standin_judge.py`, started here with `--pair-accuracy P
--truth arithmetic`: a test fixture, NOT a judge, that answers RULER's request with each member's
true reward (the agent's reward recomputed from the rendered question and reply) in a share
2P - 1 of groups and uniform random scores in the rest, so that a pair of answers with
different rewards is ordered correctly with probability P. The judge checks (canaries,
self-agreement, the gate) are on their defaults. At the end the run reads the stand-in's
`GET /stats`, the server's `GET /rl/judge`, and every judged group: its status (scored, held),
whether it was trained on, and the pair accuracy its stored scores actually had against the
true rewards.

Held-out evaluation is the learning proof's: its 100 questions, never practised, 2 samples each
at temperature 1 (mean reward ± s.e., exact answers) and once greedy, on a second server that
never trains, for the base, every `--eval-every` versions and the last one; the gain over the
base in standard errors after each and the training minutes to +3 s.e. The trainer settings
are the learning proof's (lr 6e-4, 4 groups a step, the agent's max_tokens 12, engine batch 32).

    OMP_NUM_THREADS=1 .venv/bin/python bench/live_arithmetic_proof.py --reward env
    OMP_NUM_THREADS=1 .venv/bin/python bench/live_arithmetic_proof.py --reward judge \\
        --pair-accuracy 0.9

Writes `<out>/live_arithmetic_<env|judgeNN>.json` and `.png` and prints the summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "examples"))

import arithmetic_agent  # noqa: E402
import learning_proof  # noqa: E402
import proof_loop  # noqa: E402
import provenance  # noqa: E402
import servers as bench_servers  # noqa: E402
from standin_judge import pair_accuracy_of  # noqa: E402

JUDGE_MODEL = "openai/standin"
DECIDED = ("scored", "held", "failed", "expired")


def practice_pool(max_term: int, seed: int) -> list[tuple[int, int]]:
    """Every question A + B with A, B in 1..max_term that is not held out, shuffled."""
    held_out = set(arithmetic_agent.held_out())
    pool = [
        (a, b)
        for a in range(1, max_term + 1)
        for b in range(1, max_term + 1)
        if (a, b) not in held_out
    ]
    random.Random(f"live-arithmetic:{seed}").shuffle(pool)
    return pool


@dataclass
class Traffic:
    """The questions still to ask, those asked, and the groups already counted."""

    pool: list[tuple[int, int]]
    asked: list[tuple[int, int]] = field(default_factory=list)
    counted: set[str] = field(default_factory=set)

    def draw(self, count: int) -> list[tuple[int, int]]:
        if len(self.pool) < count:
            raise RuntimeError(
                f"the pool of fresh questions ran out after {len(self.asked)}: raise --max-term"
            )
        drawn, self.pool = self.pool[:count], self.pool[count:]
        self.asked += drawn
        return drawn

    def repeated(self) -> int:
        return len(self.asked) - len(set(self.asked))


def pages(http: httpx.Client, path: str, **params: Any) -> Iterator[dict[str, Any]]:
    cursor = None
    while True:
        query = {"limit": 200, **params} | ({"cursor": cursor} if cursor else {})
        page = http.get(path, params=query).json()
        yield from page["data"]
        cursor = page.get("next_cursor")
        if not cursor:
            return


def usable_groups(url: str, traffic: Traffic) -> int:
    """Groups newly scored whose rewards differ (the trainer skips the others): the steps they
    make. Groups still forming, ready or being judged are counted once decided; held groups are
    never counted (their scores do not train)."""
    usable = 0
    with httpx.Client(base_url=url, timeout=60) as http:
        for g in pages(http, "/rl/groups"):
            if g["id"] in traffic.counted or g["status"] not in ("scored", "failed", "expired"):
                continue
            traffic.counted.add(g["id"])
            if g["status"] != "scored":
                continue
            members = http.get(f"/rl/groups/{g['id']}").json()["members"]
            rewards = {m["reward"] for m in members}
            usable += len(rewards) > 1 and None not in rewards
    return usable


def end_open_trajectories(url: str) -> int:
    """End every open trajectory (the round's episodes: rounds never overlap), no reward."""
    with httpx.Client(base_url=url, timeout=60) as http:
        ids = [t["id"] for t in pages(http, "/rl/trajectories", status="open")]
        for tid in ids:
            http.post(f"/rl/trajectories/{tid}/end").raise_for_status()
    return len(ids)


def practise(url: str, traffic: Traffic, args: argparse.Namespace) -> dict[str, Any]:
    began = time.monotonic()
    pairs = traffic.draw(args.questions)
    report = args.reward == "env"

    async def run() -> list[tuple[str, float]]:
        async with AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-agent", timeout=600) as client:
            jobs = [
                arithmetic_agent.episode(client, "rlproxy", a, b, report, args.max_tokens)
                for a, b in pairs
            ]
            return list(await asyncio.gather(*jobs))

    rewards = [r for _, r in asyncio.run(run())]
    ended = 0 if report else end_open_trajectories(url)
    time.sleep(max(0.0, began + args.round_s - time.monotonic()))
    return {
        "episodes": len(rewards),
        "mean_reward": statistics.fmean(rewards),  # the true reward, posted or not
        "exact": sum(r == 1.0 for r in rewards) / len(rewards),
        "ended": ended,
        "usable": usable_groups(url, traffic),
        "questions_asked": len(traffic.asked),
    }


# ----------------------------------------------------------------------------- what happened


def true_reward(messages: list[dict[str, Any]]) -> float | None:
    """The agent's reward for a stored member: its question and its reply."""
    question = next((m["content"] for m in messages if m.get("role") == "user"), "")
    reply = messages[-1].get("content") if messages[-1].get("role") == "assistant" else None
    found = re.search(r"What is (\d+) \+ (\d+)\?", str(question))
    if found is None or reply is None:
        return None
    return arithmetic_agent.reward(str(reply), int(found.group(1)) + int(found.group(2)))


def groups_tally(url: str, judged_pairs: bool = False) -> dict[str, Any]:
    """Groups by status and source, their sizes, how many were trained on or skipped; with
    `judged_pairs`, the pair accuracy of the stored judge scores against the true rewards, for
    the groups held and for the others."""
    tally: dict[str, Any] = {"status": Counter(), "source": Counter(), "sizes": Counter()}
    trained: Counter[str] = Counter()
    skipped: Counter[str] = Counter()
    untrained: Counter[str] = Counter()
    pairs: dict[str, list[int]] = {"held": [0, 0], "not held": [0, 0]}
    with httpx.Client(base_url=url, timeout=60) as http:
        for g in pages(http, "/rl/groups"):
            tally["status"][g["status"]] += 1
            tally["source"][g["source"]] += 1
            if g["status"] not in ("scored", "held"):
                continue
            tally["sizes"][g["member_count"]] += 1
            step = g["trained_step"]
            (untrained if step is None else trained if step > 0 else skipped)[g["status"]] += 1
            if judged_pairs and g["judge_model"] == JUDGE_MODEL:
                members = http.get(f"/rl/groups/{g['id']}").json()["members"]
                known = [
                    (true_reward(m["messages"]), (m["ruler"] or {}).get("score")) for m in members
                ]
                truth = [t for t, s in known if t is not None and s is not None]
                scores = [float(s) for t, s in known if t is not None and s is not None]
                if len(truth) < len(members):
                    continue
                right, total = pair_accuracy_of(truth, scores)
                kind = pairs["held" if g["status"] == "held" else "not held"]
                kind[0], kind[1] = kind[0] + right, kind[1] + total
    tally |= {"trained_on": trained, "skipped": skipped, "not_yet_trained": untrained}
    if judged_pairs:
        tally["judge_pair_accuracy"] = {
            k: {"right": r, "pairs": t, "accuracy": r / t if t else None}
            for k, (r, t) in pairs.items()
        }
    return {k: dict(v) if isinstance(v, Counter) else v for k, v in tally.items()}


def hold_timeline(url: str) -> dict[str, Any]:
    """When the gate first held a group, and the versions written before and after it (those
    after trained on groups scored before it: held groups never train)."""
    with httpx.Client(base_url=url, timeout=60) as http:
        held = [g["scored_at"] or g["updated_at"] for g in pages(http, "/rl/groups", status="held")]
        versions = [
            a["created_at"] for a in http.get("/rl/adapters").json()["data"] if a.get("created_at")
        ]
    first = min(held) if held else None
    return {
        "first_held_at": first,
        "versions": len(versions),
        "versions_before_first_hold": None if first is None else sum(v < first for v in versions),
    }


def judge_figures(url: str) -> list[dict[str, Any]]:
    """`GET /rl/judge`'s figures per judge, less the per-day and per-kind detail."""
    judges = httpx.get(f"{url}/rl/judge", timeout=60).json()["judges"]
    keep = ("judge_model", "canary", "self_agreement", "environment", "gate", "held_groups")
    return [{k: j.get(k) for k in keep} for j in judges]


@contextmanager
def standin(args: argparse.Namespace) -> Iterator[dict[str, str]]:
    """The stand-in judge in its own process; yields the training server's judge settings."""
    port = bench_servers.free_port()
    cmd = [
        sys.executable,
        str(REPO / "bench" / "standin_judge.py"),
        "--port",
        str(port),
        "--pair-accuracy",
        str(args.pair_accuracy),
        "--truth",
        "arithmetic",
        "--seed",
        str(args.seed),
    ]
    log = args.out / f"{args.name}_standin.log"
    with bench_servers.process(cmd, dict(os.environ), log, f"http://127.0.0.1:{port}/health"):
        yield {
            "STANDIN_KEY": "sk-standin",
            "RLPROXY_JUDGE_MODEL": JUDGE_MODEL,
            "RLPROXY_JUDGE_API_BASE": f"http://127.0.0.1:{port}/v1",
            "RLPROXY_JUDGE_API_KEY_ENV": "STANDIN_KEY",
        }


# ----------------------------------------------------------------------------- the run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reward", choices=("env", "judge"), required=True)
    parser.add_argument(
        "--pair-accuracy",
        type=float,
        default=0.9,
        help="with --reward judge: the stand-in's P(a pair with different rewards is ordered "
        "correctly), 0.5 (a coin flip) .. 1",
    )
    parser.add_argument("--minutes", type=float, default=12.0, help="training wall-time budget")
    parser.add_argument("--questions", type=int, default=32, help="fresh questions a round")
    parser.add_argument("--round-s", type=float, default=15.0, help="shortest round (seconds)")
    parser.add_argument("--max-term", type=int, default=50, help="A, B in 1..max-term")
    parser.add_argument("--lr", type=float, default=6e-4, help="the learning proof's")
    parser.add_argument("--groups-per-step", type=int, default=4, help="the learning proof's")
    parser.add_argument("--max-tokens", type=int, default=12, help="the agent's reply limit")
    parser.add_argument("--max-batch", type=int, default=32, help="engine rows decoded together")
    parser.add_argument("--eval-samples", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0, help="question order; the stand-in's draws")
    parser.add_argument(
        "--stalled-s",
        type=float,
        default=240.0,
        help="give up on a version the counted groups should make when it has not come for this "
        "long (the gate held them, or the trainer dropped stale ones) and practise on",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=Path(os.environ.get("RLPROXY_MODEL_DIR", REPO / "rlproxy-data")),
    )
    args = parser.parse_args()
    if not 0.5 <= args.pair_accuracy <= 1:
        parser.error("--pair-accuracy must lie in [0.5, 1]")
    args.name = (
        "live_arithmetic_env"
        if args.reward == "env"
        else f"live_arithmetic_judge{round(args.pair_accuracy * 100)}"
    )
    traffic = Traffic(practice_pool(args.max_term, args.seed))
    rounds = math.ceil(args.minutes * 60 / args.round_s) + 2
    if rounds * args.questions > len(traffic.pool):
        parser.error(
            f"{rounds} rounds of {args.questions} would ask more than the {len(traffic.pool)} "
            "fresh questions: raise --max-term or --round-s"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    # stopped with SIGTERM while starting, it still stops the stand-in and the servers
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    print(f"settings: {json.dumps({k: str(v) for k, v in vars(args).items()})}", flush=True)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    judging = args.reward == "judge"
    final: dict[str, Any] = {}

    def snapshot(url: str) -> dict[str, Any]:
        out: dict[str, Any] = {"groups": groups_tally(url)}
        if judging:
            out["gate"] = [j["gate"] for j in judge_figures(url)]
        return out

    with ExitStack() as stack:
        judge_env = stack.enter_context(standin(args)) if judging else {}
        servers = proof_loop.start_servers(
            args.model_dir,
            1,
            args.groups_per_step,
            args.lr,
            args.max_batch,
            "rlproxy-live-arithmetic-",
            grouping_defaults=True,
            train_env_extra=judge_env,
        )
        train_url = servers.train_url
        standin_url = judge_env.get("RLPROXY_JUDGE_API_BASE", "").removesuffix("/v1")

        def evaluate(url: str, model: str) -> dict[str, Any]:
            result = learning_proof.evaluate(url, model, args)
            result["questions_asked"] = len(traffic.asked)
            result["training_server"] = snapshot(train_url)
            print(f"  groups: {json.dumps(result['training_server'])}", flush=True)
            return result

        def finish(url: str) -> None:
            final["groups"] = groups_tally(url, judged_pairs=judging)
            final["stats"] = httpx.get(f"{url}/rl/stats", timeout=60).json()["trainer"]
            if judging:
                final["hold"] = hold_timeline(url)
                final["judge"] = judge_figures(url)
                final["standin_stats"] = httpx.get(f"{standin_url}/stats", timeout=30).json()

        result = proof_loop.run(
            servers,
            lambda url, r: practise(url, traffic, args),
            evaluate,
            minutes=args.minutes,
            groups_per_step=args.groups_per_step,
            eval_every=args.eval_every,
            ahead=1,
            describe=lambda p: (
                f"practice reward {p['mean_reward']:.3f} (exact {p['exact']:.0%}, true reward; "
                f"{p['questions_asked']} questions asked)"
            ),
            step_fields=lambda p: {
                "agent_reward": p["mean_reward"],
                "agent_exact": p["exact"],
                "questions_asked": p["questions_asked"],
            },
            finish=finish,
            stalled_s=args.stalled_s,
        )
    report(args, traffic, result, final, servers.settings_env, servers.record)


def report(
    args: argparse.Namespace,
    traffic: Traffic,
    result: proof_loop.Run,
    final: dict[str, Any],
    server_env: dict[str, str],
    record: dict[str, Any],
) -> None:
    evals = result.evals
    base, last = evals[0], evals[-1]
    gain = last["mean_reward"] - base["mean_reward"]
    se = math.hypot(base["stderr"], last["stderr"])
    keep = ("version", "mean_reward", "stderr", "exact", "episodes", "greedy")
    summary = {
        "reward": args.reward,
        "pair_accuracy": args.pair_accuracy if args.reward == "judge" else None,
        "steps": result.version,
        "wall_s": result.wall_s,
        "questions_asked": len(traffic.asked),
        "repeated_questions": traffic.repeated(),
        "held_out_practised": len(set(traffic.asked) & set(arithmetic_agent.held_out())),
        "base": {k: base[k] for k in keep},
        "trained": {k: last[k] for k in keep},
        "gain": gain,
        "gain_in_standard_errors": gain / se if se else None,
        "minutes_to_3_standard_errors": result.to_3se,
        "stalled_versions": result.stalls,
        "evaluation_seconds": result.eval_s,
        **final,
        "settings": {k: str(v) for k, v in vars(args).items()}
        | {"server_env": _rlproxy_environ() | server_env},
        "hardware": learning_proof.hardware(),
        **provenance.finish(record),
        "steps_detail": result.steps,
        "evals": evals,
    }
    path = args.out / f"{args.name}.json"
    path.write_text(json.dumps(summary, indent=2))
    print(
        f"\n{result.version} versions in {result.wall_s / 60:.1f} min; {len(traffic.asked)} "
        f"questions asked, {traffic.repeated()} repeated, "
        f"{summary['held_out_practised']} held-out ones practised."
    )
    print(
        "\n| version | training min | with evaluations | held-out reward ± s.e. | exact "
        "| greedy exact | gain |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for e in evals:
        print(
            f"| {e['version']} | {e.get('train_minutes', 0):.1f} | {e.get('wall_minutes', 0):.1f} "
            f"| {e['mean_reward']:.3f} ± {e['stderr']:.3f} | {e['exact']:.0%} "
            f"| {e['greedy']['exact']:.0%} | {e.get('gain_in_standard_errors') or 0:+.1f} s.e. |"
        )
    if result.to_3se is None:
        print("never reached +3 standard errors over the base in this run")
    else:
        t = result.to_3se
        print(f"+3 standard errors first at version {t['version']}: {t['train_minutes']:.1f} min")
    print(f"groups: {json.dumps(final.get('groups'))}")
    if "judge" in final:
        print(f"stand-in judge: {json.dumps(final['standin_stats'])}")
        print(f"gate: {json.dumps(final['hold'])}")
        for j in final["judge"]:
            print(f"judge checks: {json.dumps(j)}")
    scores = "the judge's scores" if args.reward == "judge" else "the environment's rewards"
    proof_loop.plot(
        args.out / f"{args.name}.png",
        result.steps,
        evals,
        f"SmolLM2-135M, live arithmetic, {summary['hardware']}; practice: {scores}",
    )
    print(f"wrote {path} and {args.out / f'{args.name}.png'}")


def _rlproxy_environ() -> dict[str, str]:
    """The RLPROXY_ settings this process passed on to the servers (the run's own win)."""
    return {k: v for k, v in os.environ.items() if k.startswith("RLPROXY_")}


if __name__ == "__main__":
    main()
