"""What the judge gate decides about the default local 135M judge: canaries and re-orderings.

Starts `rlproxy serve` with background scoring on and no judge model (the served model's base
weights judge), judge checks on with a canary in every group and every group judged twice (so
the gate's minimum of checks is reached after `--groups` groups rather than five times as many),
and the default thresholds (canary pass rate 0.8, self-agreement tau 0.5, `--min-checks`). Sends
`--groups` arithmetic questions through the OpenAI SDK; each call's shadow samples make one
ready group. Waits for every group to be judged, then prints `GET /rl/judge` (canary pass rate
with its Wilson bounds and per kind, self-agreement, the gate's decision and reason) and the
groups the gate held. No assertion: read the figures.

    .venv/bin/python bench/bench_judge_checks.py [--groups 20] [--samples 3] [--min-checks 20]

A canary check passes only when the canary scores strictly below the real members' median; the
figures count each outcome (below, tie, above). Progress is printed every minute once the calls
are sent, the figures once every group is judged (or at --timeout-s). On the shared 2-core machine
(load average 6-9, OMP_NUM_THREADS=1) a group took about a minute to judge:
`--groups 16 --samples 3 --min-checks 8 --position-share 0.5` ran 23 minutes
(docs/benchmarks/judge-and-rollout.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
from openai import AsyncOpenAI

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from servers import start_server  # noqa: E402


def env_for(args: argparse.Namespace) -> dict[str, str]:
    os.environ.pop("RLPROXY_JUDGE_MODEL", None)  # the local model judges
    return {
        "RLPROXY_SCORING": "true",
        "RLPROXY_SCORING_INTERVAL_S": "1",
        "RLPROXY_SHADOW_SAMPLES": str(args.samples),
        "RLPROXY_GROUP_MIN_SIZE": str(args.samples),
        "RLPROXY_JUDGE_CHECKS": "true",
        "RLPROXY_JUDGE_CANARY_SHARE": "1",
        "RLPROXY_JUDGE_POSITION_SHARE": str(args.position_share),
        "RLPROXY_JUDGE_GATE_MIN_CHECKS": str(args.min_checks),
        # A loaded 2-core machine takes minutes over one local judge call; a timed-out call
        # fails the group and makes no check.
        "RLPROXY_JUDGE_TIMEOUT_S": str(args.judge_timeout_s),
        "RLPROXY_LOG_LEVEL": "WARNING",
    }


async def ask(client: AsyncOpenAI, question: str, max_tokens: int) -> None:
    await client.chat.completions.create(
        model="rlproxy",
        messages=[
            {"role": "system", "content": "Answer the question with the number only."},
            {"role": "user", "content": question},
        ],
        max_tokens=max_tokens,
        temperature=1.0,
    )


def show(report: dict, groups: list[dict], elapsed_s: float) -> None:
    print(f"\ngroups judged: {len(groups)} in {elapsed_s:.0f} s")
    statuses: dict[str, int] = {}
    for g in groups:
        statuses[g["status"]] = statuses.get(g["status"], 0) + 1
    print(f"group statuses: {json.dumps(statuses)}")
    for j in report["judges"]:
        c, a, gate = j["canary"], j["self_agreement"], j["gate"]
        print(f"\njudge {j['judge_model']}  rubric {j['rubric_hash']}  checks {j['checks']}")
        rate = "-" if c["pass_rate"] is None else f"{c['pass_rate']:.2f}"
        print(
            f"  canaries passed {c['passed']}/{c['checks']} = {rate}  "
            f"95% Wilson [{c['low']:.2f}, {c['high']:.2f}]  verdict {c['verdict']}"
        )
        for kind, k in sorted(c["by_kind"].items()):
            print(f"    {kind:<10} {k['passed']}/{k['checks']}")
        outcomes = c.get("outcomes") or {}
        print(
            "  canary score against the real members' median: "
            + ", ".join(f"{k} {outcomes.get(k, 0)}" for k in ("below", "tie", "above"))
            + " (only below passes)"
        )
        if a["mean_tau"] is None:
            print(f"  self-agreement: no defined tau in {a['checks']} re-orderings")
        else:
            bounds = "" if a["low"] is None else f"  95% [{a['low']:.2f}, {a['high']:.2f}]"
            print(
                f"  self-agreement mean tau {a['mean_tau']:.2f} over {a['checks']} re-orderings"
                f"{bounds}  verdict {a['verdict']}"
            )
        print(f"  GATE: {gate['decision']}  ({gate['reason'] or 'checks pass'})")
        print(f"  held groups: {j['held_groups']}")
    drift = report["drift"]
    print(f"\ndrift alarm: {drift['alarm']} {drift['reason'] or ''}")


async def main_async(args: argparse.Namespace) -> None:
    model_dir = Path(os.environ.get("RLPROXY_MODEL_DIR", REPO / "rlproxy-data"))
    data = Path(tempfile.mkdtemp(prefix="rlproxy-judge-checks-"))
    proc, url = start_server(data, model_dir, env_for(args))
    print(f"server data and log: {data}")
    print(f"settings: {json.dumps(env_for(args))}")
    rng = random.Random(0)
    started = time.monotonic()
    try:
        async with AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-bench", timeout=600) as client:
            for _ in range(args.groups):
                a, b = rng.randint(2, 60), rng.randint(2, 60)
                await ask(client, f"What is {a} + {b}?", args.max_tokens)
        async with httpx.AsyncClient(timeout=60) as http:
            deadline = time.monotonic() + args.timeout_s
            groups: list[dict] = []
            next_note = time.monotonic() + 60
            while time.monotonic() < deadline:
                page = await http.get(f"{url}/rl/groups", params={"limit": 500})
                groups = page.json()["data"]
                judged = [g for g in groups if g["status"] in ("scored", "held", "failed")]
                if len(judged) >= args.groups:
                    break
                if time.monotonic() >= next_note:  # progress, in case the run is cut short
                    next_note = time.monotonic() + 60
                    for j in (await http.get(f"{url}/rl/judge")).json()["judges"]:
                        c = j["canary"]
                        print(
                            f"  {time.monotonic() - started:.0f} s: {len(judged)} judged, "
                            f"canaries {c['passed']}/{c['checks']} "
                            f"[{c['low']:.2f}, {c['high']:.2f}] {c.get('outcomes')}, "
                            f"gate {j['gate']['decision']}, held {j['held_groups']}",
                            flush=True,
                        )
                await asyncio.sleep(2)
            report = (await http.get(f"{url}/rl/judge")).json()
            judged = [g for g in groups if g["status"] in ("scored", "held", "failed")]
            show(report, judged, time.monotonic() - started)
            for g in [g for g in judged if g["status"] == "held"][:3]:
                print(f"  held {g['id'][:10]}: {g['hold_reason']}")
            for g in [g for g in judged if g["status"] == "failed"][:3]:
                print(f"  failed {g['id'][:10]}: {g['failure']}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=20)
    parser.add_argument(
        "--samples", type=int, default=3, help="answers sampled per call: the group's size"
    )
    parser.add_argument("--min-checks", type=int, default=20)
    parser.add_argument("--position-share", type=float, default=1.0)
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--max-tokens", type=int, default=12, help="tokens per sampled answer")
    parser.add_argument("--judge-timeout-s", type=float, default=900)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
