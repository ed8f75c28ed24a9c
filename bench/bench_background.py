"""Serving first: one client's tokens/s and time to first token on `rlproxy serve`, idle, while the
trainer steps, and while the local judge scores a backlog, with serving first (the defaults)
and with it off (RLPROXY_SERVING_FIRST=false, RLPROXY_TRAINER_NICE=0: how rlproxy ran before),
each configuration in a server of its own, in one run.

    python bench/bench_background.py                       # writes bench/results/background.json
    python bench/bench_background.py --requests 6 --only serving_first

The client is an agent-like loop: a streamed chat completion (greedy, up to 128 new tokens, a
story prompt, a different one each time), then `--think-s` seconds of "tool time" before the
next, so background work gets the engine between requests and a user's request must take it
back (the case that costs a user most). Per request it records the time to first token (TTFT)
and the decode rate, tokens after the first over the time from the first to the last
(`tokens_per_s`); each phase reports medians and the ratio to the same server idle.

Each configuration runs two servers, one after the other, each measured idle first (nothing
else to do) and then busy:
- the judge's (RLPROXY_TRAIN=false, so nothing trains meanwhile): `--judge-groups` unrewarded
  groups of two runs wait for the local judge, which scores them while the client runs (the
  file records the groups judged, the engine's pauses and its time on background rows);
- the trainer's (RLPROXY_SCORING=false, so nothing judges meanwhile): measured idle with the
  trainer off while `--train-groups` groups of two runs with rewards 0 and 1 (scored from the
  rewards) are made; then the same data is served with the trainer on, and once it has written
  its first version the client runs while it steps through the backlog (the file records the
  versions written during the phase, the scored groups still waiting after it, and the trainer
  child's CPU and niceness); once it has trained the whole backlog and idled for a minute, the
  same server is measured idle again, and the trainer phase is compared with that (two servers'
  idle rates differed by up to 20 % in one run). Versions are written but not published
  (RLPROXY_PUBLISH_ADAPTERS=false): a loaded adapter sends every forward pass through PEFT, base
  requests included, which would be counted as the trainer's cost.
The client asks for `rlproxy@base`, so the versions the trainer publishes meanwhile do not
change what it measures.

Settings that differ from `rlproxy serve`'s defaults, and why: RLPROXY_SCORING=true (judge
whether or not a trainer uses the scores), RLPROXY_JUDGE_CHECKS=false (the local 135M judge
fails its canaries and backs off after about 5 groups, which takes the load away: this bench
measures a judge that keeps judging), RLPROXY_GROUP_MIN_SIZE=2, RLPROXY_SCORING_INTERVAL_S=1,
RLPROXY_TRAIN_POLL_S=1 (the phases start promptly), and the trainer's groups_per_step 4 and
max_staleness 1000 (it steps through the whole backlog made before the phase; the default bound
would drop the groups more than 4 versions behind). The file records
them, the commit, the command, and the load average at every phase's start and end.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import REPO, start_server

TOPICS = [
    "a lighthouse keeper",
    "a lost violin",
    "a city under the sea",
    "a clockmaker's apprentice",
    "a dragon who cannot fly",
    "a train that never stops",
    "a garden on the moon",
    "a library of maps",
    "a fox and a lantern",
    "a storm over the harbour",
    "a letter found in a wall",
    "a robot learning to paint",
]
WORDS = ["river", "stone", "lamp", "cedar", "violet", "copper", "meadow", "harbour"]

COMMON = {
    "RLPROXY_SCORING": "true",
    "RLPROXY_JUDGE_CHECKS": "false",
    "RLPROXY_GROUP_MIN_SIZE": "2",
    "RLPROXY_SCORING_INTERVAL_S": "1",
    "RLPROXY_TRAIN_POLL_S": "1",
    # Every group made before the phase is trained on (the default staleness bound would drop
    # those more than 4 versions behind), 4 groups a step.
    "RLPROXY_TRAINER": json.dumps({"groups_per_step": 4, "max_staleness": 1000}),
    "RLPROXY_TRAIN": "true",
    "RLPROXY_PUBLISH_ADAPTERS": "true",
}
CONFIGS = {
    "serving_first": {},
    "before": {"RLPROXY_SERVING_FIRST": "false", "RLPROXY_TRAINER_NICE": "0"},
    # Other trainer priorities, for --only (trainer phase: --servers trainer).
    "nice19": {"RLPROXY_TRAINER_NICE": "19"},
    "nice0": {"RLPROXY_TRAINER_NICE": "0"},
}
DEFAULT_CONFIGS = ["serving_first", "before"]


def commit() -> str:
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return head + ("+uncommitted" if dirty else "")


def ask(client: httpx.Client, url: str, topic: str, max_tokens: int) -> dict[str, Any]:
    """One streamed greedy story; its TTFT, tokens and decode rate."""
    body = {
        "model": "rlproxy@base",  # the same weights in every phase (versions appear meanwhile)
        "messages": [
            {"role": "system", "content": "You are a storyteller."},
            {"role": "user", "content": f"Tell a long story about {topic}."},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first = last = None
    tokens = 0
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
    assert first is not None and last is not None, "no content streamed"
    return {
        "ttft_s": round(first - sent, 3),
        "tokens": tokens,
        "seconds": round(last - sent, 3),
        "tokens_per_s": round((tokens - 1) / (last - first), 2) if last > first else None,
    }


def client_run(url: str, requests: int, think_s: float, max_tokens: int, offset: int) -> list:
    out = []
    with httpx.Client(timeout=600) as client:
        for i in range(requests):
            out.append(ask(client, url, TOPICS[(offset + i) % len(TOPICS)], max_tokens))
            time.sleep(think_s)
    return out


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [r["tokens_per_s"] for r in runs if r["tokens_per_s"]]
    return {
        "requests": len(runs),
        "tokens_per_s_median": round(statistics.median(rates), 2) if rates else None,
        "tokens_per_s_min": min(rates) if rates else None,
        "ttft_s_median": round(statistics.median(r["ttft_s"] for r in runs), 3),
        "ttft_s_max": max(r["ttft_s"] for r in runs),
        "end_to_end_tokens_per_s": round(
            sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs), 2
        ),
    }


def make_groups(url: str, name: str, count: int, rewarded: bool) -> None:
    """`count` explicit groups of two short runs each; rewarded ones get 0 and 1 (they score
    from the rewards), the others are ended and wait for the judge."""
    with httpx.Client(timeout=600) as client:
        for g in range(count):
            for m in range(2):
                tid = f"{name}-{g}-{m}"
                word = WORDS[(g + m) % len(WORDS)]
                r = client.post(
                    f"{url}/v1/chat/completions",
                    headers={"X-RLProxy-Trajectory": tid, "X-RLProxy-Group": f"{name}-{g}"},
                    json={
                        "model": "rlproxy",
                        "messages": [
                            {"role": "system", "content": "Answer in one sentence."},
                            {"role": "user", "content": f"Say something about a {word} ({g})."},
                        ],
                        "max_tokens": 12,
                    },
                )
                r.raise_for_status()
                if rewarded:
                    client.post(f"{url}/rl/trajectories/{tid}/reward", json={"reward": float(m)})
                else:
                    client.post(f"{url}/rl/trajectories/{tid}/end")


def stats(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/rl/stats", timeout=60).json()


def wait_until(what: str, check: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(1)
    raise RuntimeError(f"timed out waiting for {what}")


def phase(url: str, name: str, args: argparse.Namespace, offset: int) -> dict[str, Any]:
    before, load0 = stats(url), os.getloadavg()
    runs = client_run(url, args.requests, args.think_s, args.max_tokens, offset)
    after, load1 = stats(url), os.getloadavg()
    result = {"runs": runs, **summary(runs), "load_average": [load0, load1]}
    bg0, bg1 = before.get("background") or {}, after.get("background") or {}
    result["background_after"] = bg1
    engine0, engine1 = bg0.get("engine") or {}, bg1.get("engine") or {}
    result["engine_pauses"] = (engine1.get("pauses") or 0) - (engine0.get("pauses") or 0)
    result["engine_background_busy_s"] = round(
        (engine1.get("busy_s") or 0.0) - (engine0.get("busy_s") or 0.0), 2
    )
    newest0 = (before["trainer"].get("newest_version") or {}).get("version") or 0
    newest1 = (after["trainer"].get("newest_version") or {}).get("version") or 0
    result["versions_written"] = newest1 - newest0
    judge0, judge1 = bg0.get("judge") or {}, bg1.get("judge") or {}
    result["groups_judged"] = (judge1.get("groups_last_hour") or 0) - (
        judge0.get("groups_last_hour") or 0
    )
    print(
        f"  {name:8} tokens/s {result['tokens_per_s_median']}  TTFT {result['ttft_s_median']} s "
        f"(max {result['ttft_s_max']})  pauses {result['engine_pauses']}  judged "
        f"{result['groups_judged']}  versions {result['versions_written']}  "
        f"load {load0[0]:.1f}->{load1[0]:.1f}",
        flush=True,
    )
    return result


def serve(name: str, env: dict[str, str], args: argparse.Namespace, work: Path) -> Any:
    proc, url = start_server(work / name, args.model_dir, env)
    print(f"{name}: {url}", flush=True)
    client_run(url, 1, 0, 16, 0)  # warm up
    return proc, url


def stop(proc: Any) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def run_config(name: str, env: dict[str, str], args: argparse.Namespace, work: Path) -> dict:
    """Two servers of this configuration: one where the judge works (no trainer), one where
    the trainer works (no judge), each measured idle first."""
    out: dict[str, Any] = {}
    if "judge" in args.servers:
        judging = {**COMMON, "RLPROXY_TRAIN": "false", **env}
        proc, url = serve(f"{name}-judge", judging, args, work)
        try:
            out["judge_server"] = {"env": judging, "idle": phase(url, "idle", args, 0)}
            make_groups(url, "judge", args.judge_groups, rewarded=False)
            wait_until("the judge at work", lambda: judge_state(url) == "judging", args.timeout_s)
            out["judge_server"]["judge"] = phase(url, "judge", args, 4)
        finally:
            stop(proc)
    if "trainer" in args.servers:
        # The groups are made with the trainer off (it would train on them as they come, and
        # be idle by the time the client runs); the same data then serves with it on.
        # Versions are written but not loaded: a loaded adapter makes every forward pass go
        # through PEFT (base requests too), which is not the trainer's CPU this measures.
        training = {
            **COMMON,
            "RLPROXY_SCORING": "false",
            "RLPROXY_PUBLISH_ADAPTERS": "false",
            **env,
        }
        proc, url = serve(f"{name}-trainer", {**training, "RLPROXY_TRAIN": "false"}, args, work)
        try:
            out["trainer_server"] = {"env": training, "idle": phase(url, "idle", args, 0)}
            make_groups(url, "train", args.train_groups, rewarded=True)
        finally:
            stop(proc)
        proc, url = serve(f"{name}-trainer", training, args, work)
        try:
            wait_until("the trainer's first version", lambda: newest(url), args.timeout_s)
            out["trainer_server"]["trainer"] = phase(url, "trainer", args, 8)
            left = stats(url)["groups"]["untrained_scored"]
            out["trainer_server"]["trainer"]["scored_groups_left_after"] = left
            # The same server once the trainer has nothing left: the baseline its phase is
            # compared with (two servers' idle rates differ by up to 20 % in one run).
            wait_until("the backlog trained", lambda: trained_out(url), args.timeout_s)
            out["trainer_server"]["idle_after"] = phase(url, "idle", args, 0)
        finally:
            stop(proc)
    out["ratios"] = {}
    for server, busy in (("judge_server", "judge"), ("trainer_server", "trainer")):
        if server not in out:
            continue
        idle, loaded = out[server].get("idle_after", out[server]["idle"]), out[server][busy]
        if idle["tokens_per_s_median"] and loaded["tokens_per_s_median"]:
            out["ratios"][f"{busy}_tokens_per_s_vs_idle"] = round(
                loaded["tokens_per_s_median"] / idle["tokens_per_s_median"], 3
            )
        out["ratios"][f"{busy}_ttft_vs_idle"] = round(
            loaded["ttft_s_median"] / idle["ttft_s_median"], 3
        )
    print(f"  ratios: {out['ratios']}", flush=True)
    return out


def judge_state(url: str) -> str | None:
    return ((stats(url).get("background") or {}).get("judge") or {}).get("state")


def trained_out(url: str) -> bool:
    """No scored group waits and the trainer child has been nearly idle for the last minute."""
    now = stats(url)
    cpu = ((now.get("background") or {}).get("trainer") or {}).get("cpu_cores")
    return now["groups"]["untrained_scored"] == 0 and cpu is not None and cpu < 0.05


def newest(url: str) -> int:
    return int((stats(url)["trainer"].get("newest_version") or {}).get("version") or 0)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=8, help="client requests per phase")
    p.add_argument("--think-s", type=float, default=1.0, help="client pause between requests")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--train-groups", type=int, default=60, help="enough to keep it stepping")
    p.add_argument("--judge-groups", type=int, default=16)
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument(
        "--only", nargs="+", choices=sorted(CONFIGS), help="default: serving_first before"
    )
    p.add_argument(
        "--servers", nargs="+", choices=["judge", "trainer"], default=["judge", "trainer"]
    )
    p.add_argument("--model-dir", type=Path, default=REPO / "rlproxy-data")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "background.json")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    report: dict[str, Any] = {
        "bench": "bench/bench_background.py",
        "commit": commit(),
        "command": "python " + shlex.join(sys.argv),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "settings_not_default": {
            "all": COMMON,
            **{name: CONFIGS[name] for name in args.only or DEFAULT_CONFIGS},
        },
        "args": {k: str(v) for k, v in vars(args).items()},
        "configs": {},
        "complete": False,
    }
    names = args.only or DEFAULT_CONFIGS
    from proxy.engines.loader import ensure_fp32_cache

    ensure_fp32_cache(args.model_dir)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-background-") as tmp:
        for name in names:
            report["configs"][name] = run_config(name, CONFIGS[name], args, Path(tmp))
            args.out.write_text(json.dumps(report, indent=2))
    report["complete"] = True
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    args.out.write_text(json.dumps(report, indent=2))
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
