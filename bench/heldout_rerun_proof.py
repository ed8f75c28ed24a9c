"""Held-out re-runs on the lookup agent (or the arithmetic agent): does `rlproxy eval` show the
trained version's win over the base, with an interval, on `rlproxy serve`'s defaults?

One server on serve's defaults (the trainer, scoring, publishing, the canary rollout and the
watch, the forgetting check and the held-out split all as a user gets them; nothing that changes
learning is set). The lookup agent (`examples/lookup_agent.py`, the Agents SDK, no rlproxy
import) practises in rounds of `--tasks` x `--runs` episodes for `--minutes` of practice:

- `--traffic practice` (the default): `--tasks` practice words, `--runs` episodes each, so the
  runs of a word form a group by their task signature;
- `--traffic live`: as many tasks, each asked once in the whole run (a practice word with its
  own variant number: its own code, answer and listed words), grouped as serve groups live
  traffic (alone, then the agent's cohort); the file counts the tasks asked and any asked twice.

With `--agent arithmetic` the agent is examples/arithmetic_agent.py's question and reward (one
chat completion through the openai SDK): practice questions from its practice pairs, live ones
A + B with A, B in 1..50 (each once), held out its 100 held-out questions, 12 tokens a reply.

and its reward comes from

- `--reward env` (the default): every practice episode's reward is posted;
- `--reward judge`: none is posted; each episode is ended (`POST /rl/trajectories/{id}/end`) and
  the server's judge is `bench/standin_judge.py --truth <agent>` (a test fixture, not a judge: it
  orders two members with different true rewards right with probability `--pair-accuracy`),
  with the judge checks and the gate on serve's defaults. The judge's settings are the only
  ones that differ from the defaults, and the file records them.

At the start, and after every `--eval-every` minutes of practice and at the end, it re-runs the
`--eval-tasks` held-out tasks (100: words never practised; past 100, the lookup agent's variants
of those words, each with its own code and listed words) with the same client marked held out
(`X-RLProxy-Held-Out: true`): once pinned to `rlproxy@base` (at the start only: the base never
changes) and once pinned to the version the policy name serves then, sampled (temperature 1),
each reward posted (the environment's: the evaluation, whatever trains); with `--greedy` (the
default) once more each (the first `--greedy-tasks` of them) at temperature 0, rewards not
posted (so the proxy's pairing holds the sampled runs; it counts the greedy ones as left out),
success counted here. Practice stops during a re-run.

The proxy pairs the re-runs by task (`proxy/adapters/evaluation.py`); the script records what
`GET /rl/eval`, `rlproxy eval`, `rlproxy status` and the dashboard's "Is it getting better?"
card (in Debian's Chromium) show, and its own count of the same episodes (success and reward
per arm) to check the proxy's figures against.

    OMP_NUM_THREADS=1 .venv/bin/python bench/heldout_rerun_proof.py \
        [--minutes 45] [--eval-every 20] [--traffic live] [--reward judge --pair-accuracy 0.9] \
        [--seed 0] [--out bench/results]

Writes `<out>/heldout_rerun_<seed>.json` (the lookup agent's practice traffic with rewards) or
`heldout_rerun_[arithmetic_]<traffic>_<env|judgeNN>_<seed>.json`, with `bench/provenance.py`'s
record (commit, command, settings differing from the defaults, load), and prints the headline. A run
stopped early (Ctrl-C, SIGTERM, an error) still writes what it measured and says why.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "examples"))

import arithmetic_agent  # noqa: E402
import lookup_agent  # noqa: E402
import provenance  # noqa: E402
from servers import SERVE_ONLY, free_port, process, start_server, stop, stop_on_sigterm  # noqa: E402

HELD_OUT = {"X-RLProxy-Held-Out": "true"}
ERRORS: list[str] = []
"""Episodes that failed outside the agent (an HTTP error, a refused call): scored 0, listed."""
ASKED: set[tuple[str, ...]] = set()
REPEATED: list[str] = []
"""`--traffic live`: tasks asked twice (the question and listed words the model saw); none, or the
run is not live traffic."""
EVAL_CONCURRENCY = 32  # episodes at once: within serve's default queue bound (64 rows)


# ----------------------------------------------------------------------------- the agents
# A task is a string: the lookup agent's word (a practice word, a live variant, a held-out word)
# or the arithmetic agent's "A+B". `episode` runs one on `model` and returns the response ids of
# its calls (the last one names the trajectory) and the environment's reward.


async def lookup_episode(
    client: AsyncOpenAI, model: str, task: str, max_tokens: int, temperature: float
) -> tuple[list[str], float]:
    episode = await lookup_agent.run_episode(client, model, task, max_tokens, temperature)
    return episode.response_ids, lookup_agent.reward(episode)


async def arithmetic_episode(
    client: AsyncOpenAI, model: str, task: str, max_tokens: int, temperature: float
) -> tuple[list[str], float]:
    a, b = (int(x) for x in task.split("+"))
    completion = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": arithmetic_agent.question_text(a, b)}],
        max_tokens=max_tokens,
        temperature=temperature,
    )
    reply = completion.choices[0].message.content or ""
    return [completion.id], arithmetic_agent.reward(reply, a + b)


@functools.cache
def arithmetic_live_pool(seed: int) -> list[str]:
    """Questions for live traffic, each asked at most once: A + B with A, B in 1..50, less the
    100 held-out questions, shuffled by the seed (2,400: 75 rounds of 32)."""
    held = set(arithmetic_agent.held_out())
    pool = [f"{a}+{b}" for a in range(1, 51) for b in range(1, 51) if (a, b) not in held]
    random.Random(f"arithmetic-live:{seed}").shuffle(pool)
    return pool


@dataclass(frozen=True)
class Agent:
    episode: Callable[[AsyncOpenAI, str, str, int, float], Awaitable[tuple[list[str], float]]]
    practice: Callable[[], list[str]]
    held_out: Callable[[], list[str]]
    max_tokens: int
    """Its reply limit a turn unless `--max-tokens` says otherwise."""


AGENTS = {
    "lookup": Agent(lookup_episode, lookup_agent.practice_tasks, lookup_agent.held_out, 48),
    "arithmetic": Agent(
        arithmetic_episode,
        lambda: [f"{a}+{b}" for a, b in arithmetic_agent.practice_pairs()],
        lambda: [f"{a}+{b}" for a, b in arithmetic_agent.held_out()],
        12,  # the learning proof's
    ),
}


def held_out_tasks(agent: str, count: int) -> list[str]:
    """The first `count` held-out tasks: the agent's held-out list, then (the lookup agent only)
    variants of its words ("apple/1", then "apple/2", ...: the same never-practised word with its
    own secret code and listed words), for an evaluation of more tasks than there are held-out
    words. More tasks, a smaller standard error of the paired difference."""
    tasks = AGENTS[agent].held_out()
    if agent == "lookup":
        words = list(tasks)
        variant = 1
        while len(tasks) < count:
            tasks += [lookup_agent.live_task(w, variant) for w in words]
            variant += 1
    if count > len(tasks):
        raise ValueError(f"the {agent} agent has {len(tasks)} held-out tasks, not {count}")
    return tasks[:count]


def round_tasks(args: argparse.Namespace, round_number: int) -> list[str]:
    """A practice round's episodes, one task each: `--tasks` practice tasks `--runs` times each
    (`--traffic practice`), or as many tasks never asked before (`--traffic live`: the lookup
    agent's practice words with their own variant numbers, so each has its own code, answer and
    listed words; the arithmetic agent's next questions from `arithmetic_live_pool`)."""
    count = args.tasks * args.runs
    rng = random.Random(f"{args.traffic}:{args.seed}:{round_number}")
    agent = AGENTS[args.agent]
    if args.traffic == "practice":
        return [t for t in rng.sample(agent.practice(), args.tasks) for _ in range(args.runs)]
    if args.agent == "arithmetic":
        pool = arithmetic_live_pool(args.seed)
        if (round_number + 1) * count > len(pool):
            raise RuntimeError(f"live traffic ran out of fresh questions after {len(ASKED)}")
        tasks = pool[round_number * count : (round_number + 1) * count]
        seen_as = [(arithmetic_agent.question_text(*map(int, t.split("+"))),) for t in tasks]
    else:
        tasks = [
            lookup_agent.live_task(
                rng.choice(lookup_agent.practice_tasks()), round_number * count + i + 1
            )
            for i in range(count)
        ]
        # the task as the model sees it: its question and its tools' words
        seen_as = [(lookup_agent.question_text(t), *lookup_agent.choices_of(t)) for t in tasks]
    for task, seen in zip(tasks, seen_as, strict=True):
        if seen in ASKED:
            REPEATED.append(task)
        ASKED.add(seen)
    return tasks


async def post_outcome(
    http: httpx.AsyncClient, response_id: str, reward: float | None, agent: str
) -> None:
    """The environment's word on an episode: its reward, or (None) only that it is over."""
    if reward is None:
        done = await http.post(f"/rl/trajectories/{response_id}/end")
    else:
        body = {"reward": reward, "source": f"{agent}-env"}
        done = await http.post(f"/rl/trajectories/{response_id}/reward", json=body)
    done.raise_for_status()


async def practise(url: str, args: argparse.Namespace, round_number: int) -> dict[str, Any]:
    """One round on the policy name. `--reward env`: each episode's reward is posted;
    `--reward judge`: nothing is posted, each episode is ended (`POST /rl/trajectories/{id}/end`,
    the environment saying it is over) and the server's judge scores its group. The true rewards
    are counted here either way."""
    tasks = round_tasks(args, round_number)
    async with (
        AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-agent", timeout=1800) as client,
        httpx.AsyncClient(base_url=url, timeout=60) as http,
    ):

        async def one(task: str) -> float:
            ids, value = await AGENTS[args.agent].episode(
                client, "rlproxy", task, args.max_tokens, 1.0
            )
            if ids:
                posted = value if args.reward == "env" else None
                await post_outcome(http, ids[-1], posted, args.agent)
            return value

        rewards = await asyncio.gather(*(one(t) for t in tasks))
    by_task: dict[str, set[float]] = {}
    for task, value in zip(tasks, rewards, strict=True):
        by_task.setdefault(task, set()).add(value)
    return {
        "episodes": len(tasks),
        "success": sum(v == 1.0 for v in rewards) / len(rewards),
        "mean_reward": sum(rewards) / len(rewards),
        # a task whose runs all got the same reward teaches a group-relative learner nothing
        # (live traffic: every task is asked once, so this is 0; its groups are cohorts)
        "tasks_with_varied_rewards": sum(len(v) > 1 for v in by_task.values()),
    }


async def rerun(
    url: str, model: str, args: argparse.Namespace, temperature: float = 1.0
) -> dict[str, Any]:
    """The held-out tasks once each, pinned to `model`, marked held out. Sampled (temperature
    1): the rewards are posted, and the proxy pairs these runs. Greedy (0): nothing is posted,
    so the proxy's pairing holds the sampled runs only (it counts the greedy ones as left out:
    held-out runs with no reward); the script counts their success."""
    gate = asyncio.Semaphore(EVAL_CONCURRENCY)
    async with (
        AsyncOpenAI(
            base_url=f"{url}/v1", api_key="sk-agent", timeout=1800, default_headers=HELD_OUT
        ) as client,
        httpx.AsyncClient(base_url=url, timeout=60) as http,
    ):

        async def one(task: str) -> tuple[str, float | None, bool]:
            try:
                async with gate:
                    ids, value = await AGENTS[args.agent].episode(
                        client, model, task, args.max_tokens, temperature
                    )
            except Exception as exc:  # a refused or failed call: counted, the run goes on
                ERRORS.append(f"{model} {task}: {type(exc).__name__}: {exc}")
                return task, None, False  # no reward: left out of the pairing, not a 0
            if temperature > 0 and ids:
                try:
                    await post_outcome(http, ids[-1], value, args.agent)
                except Exception as exc:  # the proxy misses this reward; the episode counts
                    ERRORS.append(
                        f"{model} {task}: posting its reward: {type(exc).__name__}: {exc}"
                    )
                    return task, value, False
            return task, value, bool(ids)

        t0 = time.monotonic()
        count = args.eval_tasks if temperature > 0 else args.greedy_tasks or args.eval_tasks
        tasks = held_out_tasks(args.agent, count)
        done = await asyncio.gather(*(one(t) for t in tasks))
    rewards = {task: value for task, value, _ in done if value is not None}
    if not rewards:
        return {"model": model, "episodes": 0, "rewards": {}}
    return {
        "model": model,
        "temperature": temperature,
        "episodes": len(done),
        "failed": len(done) - len(rewards),
        "unreported": sum(not reported for _, _, reported in done),
        "success": sum(v == 1.0 for v in rewards.values()) / len(rewards),
        "mean_reward": sum(rewards.values()) / len(rewards),
        "seconds": round(time.monotonic() - t0, 1),
        "rewards": rewards,
    }


def paired_by_script(base: dict[str, Any], version: dict[str, Any]) -> dict[str, Any]:
    """The script's own paired difference of the same episodes (to check the proxy's), over the
    tasks both finished."""
    both = [t for t in base["rewards"] if t in version["rewards"]]
    diffs = [version["rewards"][t] - base["rewards"][t] for t in both]
    n = len(diffs)
    if n < 2:
        return {"tasks": n}
    mean = sum(diffs) / n
    sd = (sum((d - mean) ** 2 for d in diffs) / (n - 1)) ** 0.5
    wins = [float(version["rewards"][t] == 1.0) - float(base["rewards"][t] == 1.0) for t in both]
    return {
        "tasks": n,
        "reward_difference": mean,
        "reward_difference_se": sd / n**0.5,
        "success_difference": sum(wins) / n,
    }


def cli(data: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPROXY_")}
    env["RLPROXY_DATA_DIR"] = str(data)
    done = subprocess.run(
        [sys.executable, "-m", "proxy.cli", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return done.stdout if done.returncode == 0 else f"exit {done.returncode}: {done.stderr}"


def dashboard_card(url: str) -> str | None:
    """The dashboard's "Is it getting better?" card as Chromium renders it (None: no browser)."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        return None
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=binary)
        try:
            page = browser.new_page()
            page.goto(f"{url}/dashboard#/overview")
            card = page.wait_for_selector("#better", timeout=60_000)
            return None if card is None else card.inner_text()
        finally:
            browser.close()


def active_version(url: str) -> int | None:
    return httpx.get(f"{url}/health", timeout=60).json().get("active_version")


async def main_async(args: argparse.Namespace, url: str, data: Path, out: dict[str, Any]) -> None:
    """Fills `out` as it goes: a run that fails part way keeps what it measured."""
    print("re-running the held-out tasks on the base", flush=True)
    base = await rerun(url, "rlproxy@base", args)
    out["base"] = base
    print(f"  base: success {base['success']:.0%}, reward {base['mean_reward']:.3f}", flush=True)
    if args.greedy:
        out["base_greedy"] = base_greedy = await rerun(url, "rlproxy@base", args, 0.0)
        print(f"  base greedy: success {base_greedy['success']:.0%}", flush=True)
    rounds: list[dict[str, Any]] = out.setdefault("practice_rounds", [])
    evaluations: list[dict[str, Any]] = out.setdefault("evaluations", [])
    practised = 0.0
    next_eval = args.eval_every
    round_number = 0
    while True:
        t0 = time.monotonic()
        result = await practise(url, args, round_number)
        # traffic arrives at most one round per --round-s (a fast agent would exhaust the pool)
        await asyncio.sleep(max(0.0, args.round_s - (time.monotonic() - t0)))
        practised += (time.monotonic() - t0) / 60
        round_number += 1
        rounds.append({
            "round": round_number, "practice_minutes": round(practised, 2),
            "success": result["success"], "mean_reward": result["mean_reward"],
            "tasks_with_varied_rewards": result["tasks_with_varied_rewards"],
            "active_version": active_version(url), "load": os.getloadavg()[0],
        })  # fmt: skip
        print(f"round {round_number} at {practised:.1f} min: {json.dumps(rounds[-1])}", flush=True)
        last = practised >= args.minutes
        if practised >= next_eval or last:
            next_eval += args.eval_every
            version = active_version(url)
            if version is None:
                print("  no version serves the policy name yet: nothing to re-run", flush=True)
                evaluations.append({"practice_minutes": practised, "version": None})
            else:
                v = await rerun(url, f"rlproxy@{version}", args)
                report = httpx.get(f"{url}/rl/eval", timeout=120).json()
                rerun_of = [r for r in report["reruns"] if r["version"] == version]
                evaluation = {
                    "practice_minutes": round(practised, 2),
                    "version": version,
                    "script": paired_by_script(base, v),
                    "success": v.get("success"),
                    "mean_reward": v.get("mean_reward"),
                    "seconds": v.get("seconds"),
                    "proxy_rerun": rerun_of[0] if rerun_of else None,
                    "proxy_headline": report["headline"],
                    "rewards": v["rewards"],
                }
                print(f"  v{version}: {report['headline']['line']}", flush=True)
                if args.greedy:
                    g = await rerun(url, f"rlproxy@{version}", args, 0.0)
                    evaluation["greedy"] = {
                        "success": g.get("success"),
                        "base_success": out["base_greedy"].get("success"),
                        "script": paired_by_script(out["base_greedy"], g),
                        "seconds": g.get("seconds"),
                        "rewards": g["rewards"],
                    }
                    print(
                        f"  v{version} greedy: success {g['success']:.0%} (base "
                        f"{out['base_greedy']['success']:.0%})",
                        flush=True,
                    )
                evaluations.append(evaluation)
        if last:
            break
    out["rl_eval"] = httpx.get(f"{url}/rl/eval", timeout=120).json()
    if args.reward == "judge":  # the gate's decision and its checks, per judge and rubric
        keep = ("judge_model", "canary", "self_agreement", "environment", "gate", "held_groups")
        judges = httpx.get(f"{url}/rl/judge", timeout=120).json()["judges"]
        out["judge_checks"] = [{k: j.get(k) for k in keep} for j in judges]
    adapters = httpx.get(f"{url}/rl/adapters", timeout=60).json()["data"]
    out["adapters"] = [
        {
            k: a.get(k)
            for k in ("id", "version", "status", "rollout", "created_at", "activated_at", "metrics")
        }
        for a in adapters
    ]


def finish(url: str, data: Path, out: dict[str, Any]) -> None:
    """What the user's tools show at the end, each step on its own: one that fails is noted."""
    steps = {
        "rlproxy_eval": lambda: cli(data, "eval"),
        "rlproxy_status_better": lambda: [
            line for line in cli(data, "status").splitlines() if line.startswith("better?")
        ],
        "dashboard_card": lambda: dashboard_card(url),  # Playwright's sync API: no event loop
    }
    for name, step in steps.items():
        try:
            out[name] = step()
        except Exception as exc:
            out[name] = f"failed: {type(exc).__name__}: {exc}"


def standin_judge(stack: ExitStack, args: argparse.Namespace, data: Path) -> dict[str, str]:
    """`--reward judge`: the stand-in judge (`bench/standin_judge.py`, a test fixture that orders
    pairs of members with different true rewards right with probability `--pair-accuracy`) in
    its own process; returns the server's judge settings. The judge checks and gate are left on
    serve's defaults."""
    port = free_port()
    cmd = [
        sys.executable, str(REPO / "bench" / "standin_judge.py"), "--port", str(port),
        "--pair-accuracy", str(args.pair_accuracy), "--truth", args.agent, "--seed", str(args.seed),
    ]  # fmt: skip
    data.mkdir(parents=True, exist_ok=True)
    stack.enter_context(
        process(cmd, dict(os.environ), data / "standin.log", f"http://127.0.0.1:{port}/health")
    )
    return {
        "RLPROXY_JUDGE_MODEL": "openai/standin",
        "RLPROXY_JUDGE_API_BASE": f"http://127.0.0.1:{port}/v1",
        "RLPROXY_JUDGE_API_KEY_ENV": "STANDIN_KEY",
    }


def result_name(args: argparse.Namespace) -> str:
    """`heldout_rerun_<seed>.json` for practice traffic with rewards on serve's defaults (the
    first proof's name); otherwise the traffic and the reward are in the name too, and each
    `--set` setting, e.g. `_shadow_samples4`."""
    agent = "" if args.agent == "lookup" else f"{args.agent}_"
    chosen = "".join(
        f"_{k.removeprefix('RLPROXY_').lower()}{re.sub(r'[^A-Za-z0-9.]+', '-', v)}"
        for k, v in sorted(getattr(args, "settings", {}).items())
    )
    if args.traffic == "practice" and args.reward == "env" and not agent and not chosen:
        return f"heldout_rerun_{args.seed}.json"
    reward = "env" if args.reward == "env" else f"judge{round(args.pair_accuracy * 100)}"
    return f"heldout_rerun_{agent}{args.traffic}_{reward}{chosen}_{args.seed}.json"


def chosen_settings(pairs: list[str]) -> dict[str, str]:
    """`--set` pairs as server environment variables; a name that is not an RLPROXY_ setting or
    a pair without "=" is refused."""
    chosen: dict[str, str] = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq or not name.startswith("RLPROXY_") or name == "RLPROXY_DATA_DIR":
            raise ValueError(f"--set takes RLPROXY_<NAME>=VALUE (not the data dir), not {pair!r}")
        chosen[name] = value
    return chosen


def build_parser() -> argparse.ArgumentParser:
    """The proof's options (bench/heldout_rerun_summary.py reads a run's recorded command
    with it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=45.0, help="practice wall-time budget")
    parser.add_argument("--eval-every", type=float, default=20.0, help="practice minutes")
    parser.add_argument(
        "--agent",
        choices=sorted(AGENTS),
        default="lookup",
        help="lookup: examples/lookup_agent.py (the Agents SDK, two tools); arithmetic: "
        "examples/arithmetic_agent.py's question and reward (the openai SDK, one call)",
    )
    parser.add_argument(
        "--traffic",
        choices=("practice", "live"),
        default="practice",
        help="practice: --tasks words --runs times each a round; live: as many tasks a round, "
        "each asked once in the whole run",
    )
    parser.add_argument("--tasks", type=int, default=4, help="practice tasks a round")
    parser.add_argument(
        "--round-s",
        type=float,
        default=0.0,
        help="the shortest round in seconds: the traffic's rate (the arithmetic agent answers "
        "32 questions in seconds; its live pool holds 2,400)",
    )
    parser.add_argument("--runs", type=int, default=8, help="episodes a word a round")
    parser.add_argument(
        "--reward",
        choices=("env", "judge"),
        default="env",
        help="env: each practice episode's reward posted; judge: none posted, the stand-in "
        "judge scores (the held-out re-runs post theirs either way: they are the evaluation)",
    )
    parser.add_argument(
        "--pair-accuracy", type=float, default=0.9, help="--reward judge: the stand-in's"
    )
    parser.add_argument(
        "--greedy",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also re-run the held-out tasks greedily (temperature 0, rewards not posted)",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="the agent's limit a turn (48 / 12)"
    )
    parser.add_argument(
        "--eval-tasks",
        type=int,
        default=100,
        help="held-out tasks each evaluation re-runs, sampled (fewer: a smoke run; past 100, "
        "the lookup agent's variants of its held-out words: a smaller standard error)",
    )
    parser.add_argument(
        "--greedy-tasks",
        type=int,
        default=None,
        help="of those, how many also re-run greedily (default: all of them)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="RLPROXY_<NAME>=VALUE",
        help="a server setting away from serve's defaults (repeatable), to measure a choice "
        "against the defaults (e.g. RLPROXY_SHADOW_SAMPLES=4); recorded in the file, and "
        "its name gets a suffix",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    args.max_tokens = args.max_tokens or AGENTS[args.agent].max_tokens
    if not 0.5 <= args.pair_accuracy <= 1.0:
        parser.error("--pair-accuracy is between 0.5 (a coin flip) and 1 (the truth)")
    try:
        args.settings = chosen_settings(args.set)
        held_out_tasks(args.agent, args.eval_tasks)
    except ValueError as exc:
        parser.error(str(exc))
    if args.greedy_tasks is not None and not 1 <= args.greedy_tasks <= args.eval_tasks:
        parser.error("--greedy-tasks is between 1 and --eval-tasks")
    stop_on_sigterm()  # kill as Ctrl-C: file written, server stopped
    data = args.data or Path(f"/tmp/rlproxy-rerun-{args.seed}-{os.getpid()}")
    for k in [k for k in os.environ if k.startswith("RLPROXY_")]:
        del os.environ[k]  # serve's defaults, whatever the caller's shell set
    stopped = None
    result: dict[str, Any] = {}
    record: dict[str, Any] = {}
    with ExitStack() as stack:
        try:
            judge = standin_judge(stack, args, data) if args.reward == "judge" else {}
            # serve's defaults; only the judge (the user's choice of judge model) differs, and
            # what --set chose
            chosen = judge | args.settings
            record = provenance.start(
                provenance.settings_differing(chosen), seed=args.seed, judge=judge or None
            )
            # start_server turns training, scoring and publishing off; serve's defaults: on
            key = {"STANDIN_KEY": "sk"} if judge else {}
            env = {k: "true" for k in SERVE_ONLY} | chosen | key
            proc, url = start_server(data, REPO / "rlproxy-data", env)
            stack.callback(stop, proc)
            print(f"serving {url} from {data}", flush=True)
            asyncio.run(main_async(args, url, data, result))
            finish(url, data, result)
        except KeyboardInterrupt:
            stopped = "interrupted (Ctrl-C or SIGTERM): what it measured until then"
        except Exception as exc:  # keep what was measured, and say why it ended
            stopped = f"{type(exc).__name__}: {exc}"
    result["episode_errors"] = ERRORS
    if args.traffic == "live":
        result["tasks_asked"] = len(ASKED)
        result["tasks_asked_twice"] = REPEATED
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / result_name(args)
    record = record or provenance.start({}, seed=args.seed)
    path.write_text(
        json.dumps({**provenance.finish(record, stopped_early=stopped), **result}, indent=1) + "\n"
    )
    print(result.get("rlproxy_eval", ""))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
