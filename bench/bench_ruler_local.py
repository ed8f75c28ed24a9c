"""How far the local 135M judge is from usable: RULER on 20 groups from the local engine.

Starts `rlproxy serve` with background scoring on and no judge model (so the served model's base
weights judge), runs N_TASKS arithmetic tasks GROUP_SIZE times each through the OpenAI SDK, ends
every trajectory, and waits for the scorer to finish every task group. Prints per-group judge
latency, attempts and status, then the retry and failure rates and a few explanations. No
assertion: read the figures.

    .venv/bin/python bench/bench_ruler_local.py [--tasks 20] [--group-size 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from openai import AsyncOpenAI

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from servers import start_server  # noqa: E402


def serve(model_dir: Path, group_size: int) -> tuple[subprocess.Popen, str, Path]:
    data = Path(tempfile.mkdtemp(prefix="rlproxy-ruler-"))
    os.environ.pop("RLPROXY_JUDGE_MODEL", None)  # the local model judges
    env = {
        "RLPROXY_SCORING": "true",
        "RLPROXY_SCORING_INTERVAL_S": "1",
        "RLPROXY_GROUP_MIN_SIZE": str(group_size),
        "RLPROXY_LOG_LEVEL": "WARNING",
    }
    proc, url = start_server(data, model_dir, env)
    return proc, url, data


async def run_task(client: AsyncOpenAI, url: str, question: str, runs: int) -> None:
    """`runs` runs of one task at once; each run is its own trajectory, ended when answered."""

    async def one() -> None:
        tid = uuid.uuid4().hex
        await client.chat.completions.create(
            model="rlproxy",
            messages=[
                {"role": "system", "content": "Answer the question with a short sentence."},
                {"role": "user", "content": question},
            ],
            max_tokens=24,
            temperature=1.0,
            extra_headers={"X-RLProxy-Trajectory": tid},
        )
        async with httpx.AsyncClient(timeout=60) as http:
            (await http.post(f"{url}/rl/trajectories/{tid}/end")).raise_for_status()

    await asyncio.gather(*(one() for _ in range(runs)))


async def main_async(args: argparse.Namespace) -> None:
    model_dir = Path(os.environ.get("RLPROXY_MODEL_DIR", REPO / "rlproxy-data"))
    proc, url, data = serve(model_dir, args.group_size)
    print(f"server data and log: {data}")
    rng = random.Random(0)
    try:
        started = time.monotonic()
        async with AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-bench", timeout=300) as client:
            for _ in range(args.tasks):
                a, b = rng.randint(2, 60), rng.randint(2, 60)
                await run_task(client, url, f"What is {a} + {b}?", args.group_size)
        print(f"{args.tasks} tasks x {args.group_size} runs in {time.monotonic() - started:.0f} s")
        deadline = time.monotonic() + args.timeout_s
        groups: list[dict] = []
        while time.monotonic() < deadline:
            groups = httpx.get(
                f"{url}/rl/groups", params={"source": "task", "limit": 500}, timeout=30
            ).json()["data"]
            done = [g for g in groups if g["status"] in ("scored", "failed")]
            if len(done) >= args.tasks:
                break
            await asyncio.sleep(2)
        done = [g for g in groups if g["status"] in ("scored", "failed")]
        print(f"\n{'group':<10} {'members':>7} {'status':<7} {'attempts':>8} {'latency_s':>9}")
        for g in done:
            print(
                f"{g['id'][:10]:<10} {g['member_count']:>7} {g['status']:<7} "
                f"{g['judge_attempts'] or 0:>8} {g['judge_latency_s'] or 0:>9.1f}"
            )
        lat = [g["judge_latency_s"] for g in done if g["judge_latency_s"]]
        retried = sum(1 for g in done if (g["judge_attempts"] or 0) > 1)
        failed = [g for g in done if g["status"] == "failed"]
        print(f"\ngroups judged: {len(done)} of {len(groups)} task groups")
        if lat:
            print(
                f"judge latency per group: mean {statistics.mean(lat):.1f} s, median "
                f"{statistics.median(lat):.1f} s, max {max(lat):.1f} s"
            )
        print(f"retried (2 attempts): {retried}/{len(done)}; failed: {len(failed)}/{len(done)}")
        for g in failed[:5]:
            print(f"  failure: {g['failure']}")
        for g in [g for g in done if g["status"] == "scored"][:3]:
            detail = httpx.get(f"{url}/rl/groups/{g['id']}", timeout=30).json()
            for m in detail["members"]:
                answer = m["messages"][-1].get("content")
                print(
                    f"  {m['ruler']['score']:.2f}  {answer!r:40.40}  "
                    f"{m['ruler']['explanation']!r:.70}"
                )
            print()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=20)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--timeout-s", type=float, default=1800)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
