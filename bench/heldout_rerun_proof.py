"""Held-out re-runs on the lookup agent: does `rlproxy eval` show the trained version's win over
the base, with an interval, on `rlproxy serve`'s defaults?

One server on serve's defaults (the trainer, scoring, publishing, the canary rollout, the
forgetting check and the held-out split all as a user gets them; nothing that changes learning
is set). The lookup agent (`examples/lookup_agent.py`, the Agents SDK, no rlproxy import)
practises: rounds of `--tasks` practice words x `--runs` episodes, every episode's reward
posted, for `--minutes` of practice. At the start, and after every `--eval-every` minutes of
practice and at the end, it re-runs the 100 held-out tasks (words never practised) with the
same client marked held out (`X-RLProxy-Held-Out: true`): once pinned to `rlproxy@base` (at
the start only: the base never changes) and once pinned to the version the policy name serves
then, sampled (temperature 1), each reward posted. Practice stops during a re-run.

The proxy pairs the re-runs by task (`proxy/adapters/evaluation.py`); the script records what
`GET /rl/eval`, `rlproxy eval`, `rlproxy status` and the dashboard's "Is it getting better?"
card (in Debian's Chromium) show, and its own count of the same episodes (success and reward
per arm) to check the proxy's figures against.

    OMP_NUM_THREADS=1 .venv/bin/python bench/heldout_rerun_proof.py \
        [--minutes 45] [--eval-every 20] [--seed 0] [--out bench/results]

Writes `<out>/heldout_rerun_<seed>.json` (with `bench/provenance.py`'s record: commit, command,
settings differing from the defaults, load) and prints the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "examples"))

import lookup_agent  # noqa: E402
import provenance  # noqa: E402
from servers import SERVE_ONLY, start_server, stop  # noqa: E402

HELD_OUT = {"X-RLProxy-Held-Out": "true"}
ERRORS: list[str] = []
"""Episodes that failed outside the agent (an HTTP error, a refused call): scored 0, listed."""
EVAL_CONCURRENCY = 32  # episodes at once: within serve's default queue bound (64 rows)


async def practise(url: str, args: argparse.Namespace, round_number: int) -> dict[str, Any]:
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-agent", timeout=1800) as client:
        result = await lookup_agent.train(
            client, "rlproxy", args.tasks, args.runs, args.seed * 10_000 + round_number,
            args.max_tokens,
        )  # fmt: skip
    result.pop("runs")
    return result


async def rerun(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """The held-out tasks once each, pinned to `model`, marked held out, rewards posted."""
    gate = asyncio.Semaphore(EVAL_CONCURRENCY)
    async with AsyncOpenAI(
        base_url=f"{url}/v1", api_key="sk-agent", timeout=1800, default_headers=HELD_OUT
    ) as client:

        async def one(task: str) -> tuple[str, float, bool]:
            try:
                async with gate:
                    episode = await lookup_agent.run_episode(client, model, task, args.max_tokens)
                value = lookup_agent.reward(episode)
                await lookup_agent.report(client, episode, value)
            except Exception as exc:  # a refused or failed call: counted, the run goes on
                ERRORS.append(f"{model} {task}: {type(exc).__name__}: {exc}")
                return task, 0.0, False
            return task, value, bool(episode.response_ids)

        t0 = time.monotonic()
        tasks = lookup_agent.held_out()[: args.eval_tasks]
        done = await asyncio.gather(*(one(t) for t in tasks))
    rewards = {task: value for task, value, _ in done}
    if not rewards:
        return {"model": model, "episodes": 0, "rewards": {}}
    return {
        "model": model,
        "episodes": len(done),
        "unreported": sum(not reported for _, _, reported in done),
        "success": sum(v == 1.0 for v in rewards.values()) / len(rewards),
        "mean_reward": sum(rewards.values()) / len(rewards),
        "seconds": round(time.monotonic() - t0, 1),
        "rewards": rewards,
    }


def paired_by_script(base: dict[str, Any], version: dict[str, Any]) -> dict[str, Any]:
    """The script's own paired difference of the same episodes (to check the proxy's)."""
    diffs = [version["rewards"][t] - base["rewards"][t] for t in base["rewards"]]
    n = len(diffs)
    if n < 2:
        return {"tasks": n}
    mean = sum(diffs) / n
    sd = (sum((d - mean) ** 2 for d in diffs) / (n - 1)) ** 0.5
    wins = [
        float(version["rewards"][t] == 1.0) - float(base["rewards"][t] == 1.0)
        for t in base["rewards"]
    ]
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
    rounds: list[dict[str, Any]] = out.setdefault("practice_rounds", [])
    evaluations: list[dict[str, Any]] = out.setdefault("evaluations", [])
    practised = 0.0
    next_eval = args.eval_every
    round_number = 0
    while True:
        t0 = time.monotonic()
        result = await practise(url, args, round_number)
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
                evaluations.append(
                    {
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
                )
                print(f"  v{version}: {report['headline']['line']}", flush=True)
        if last:
            break
    out["rl_eval"] = httpx.get(f"{url}/rl/eval", timeout=120).json()
    adapters = httpx.get(f"{url}/rl/adapters", timeout=60).json()["data"]
    out["adapters"] = [
        {k: a.get(k) for k in ("id", "version", "status", "rollout", "created_at", "activated_at")}
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


def interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=45.0, help="practice wall-time budget")
    parser.add_argument("--eval-every", type=float, default=20.0, help="practice minutes")
    parser.add_argument("--tasks", type=int, default=4, help="practice words a round")
    parser.add_argument("--runs", type=int, default=8, help="episodes a word a round")
    parser.add_argument("--max-tokens", type=int, default=48, help="the agent's limit a turn")
    parser.add_argument(
        "--eval-tasks", type=int, default=100, help="held-out tasks re-run (fewer: a smoke run)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    record = provenance.start({}, seed=args.seed)  # serve's defaults: nothing differs
    signal.signal(signal.SIGTERM, interrupted)  # kill as Ctrl-C: file written, server stopped
    data = args.data or Path(f"/tmp/rlproxy-rerun-{args.seed}-{os.getpid()}")
    for k in [k for k in os.environ if k.startswith("RLPROXY_")]:
        del os.environ[k]  # serve's defaults, whatever the caller's shell set
    # start_server turns training, scoring and publishing off; serve's defaults turn them on
    proc, url = start_server(data, REPO / "rlproxy-data", {k: "true" for k in SERVE_ONLY})
    print(f"serving {url} from {data}", flush=True)
    stopped = None
    result: dict[str, Any] = {}
    try:
        asyncio.run(main_async(args, url, data, result))
        finish(url, data, result)
    except KeyboardInterrupt:
        stopped = "interrupted (Ctrl-C or SIGTERM): what it measured until then"
    except Exception as exc:  # keep what was measured, and say why it ended
        stopped = f"{type(exc).__name__}: {exc}"
    finally:
        stop(proc)
    result["episode_errors"] = ERRORS
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"heldout_rerun_{args.seed}.json"
    path.write_text(
        json.dumps({**provenance.finish(record, stopped_early=stopped), **result}, indent=1) + "\n"
    )
    print(result.get("rlproxy_eval", ""))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
