"""The guard's proof on live traffic: each task asked once, its reward posted, on `rlproxy
serve`'s defaults (the canary rollout on, the local trainer, scoring, publishing).

The task: "Say the number N." with a fresh N for every call; the environment's reward is 1 when
the answer holds N, else 0 (the embedded model's base gets about half right). One agent, so
rlproxy groups the calls in cohorts (docs/concepts/groups.md) and trains on them.

Scenarios (`--scenario`):
- `burst`: the first rewards are inverted (1 - r) until the trainer has written version
  `--burst-versions` (trained on nothing else: worse than the base), then `--calls` calls with
  true rewards. What is measured: the share of those calls each version served, whether the
  bad version was rolled back, and (pinned evaluation at the end) the bad version, the base and
  what the policy name serves at the end; `burst_outcome` puts them against what the guard
  must show (the bad version clearly worse, its share after the burst and its rolled-back
  lineage's, when and by what it was rolled back, the end against the base).
- `plain`: `--calls` calls with true rewards from the start; then the same evaluation.
- `harmful`: no trainer (RLPROXY_TRAIN=false, the one setting changed): `--warmup` calls served
  by the base, then a harmful version is put in place as version 1 (a random LoRA, B scaled by
  `--harm-scale`: it passes the forgetting check but answers this task badly), then `--calls`
  calls with true rewards. What is measured: the calls and minutes the guard took to roll it
  back and the share of calls it served meanwhile.
Run `plain` with the guard on (the default) and with `--guard-off` (RLPROXY_ROLLOUT=false, the
only setting changed) to see what the guard costs a good version.

Every call's served version comes from the answer's `model` (`rlproxy@N`, `rlproxy@base`). The
rollout's decisions (calls and minutes each took), each version's wait from written to serving
everything, and the evaluation go into `<out>/guard_<scenario>[_off]_<seed>.json`, with the
commit, the command, the settings that differ from the defaults and the machine's load.

    OMP_NUM_THREADS=1 .venv/bin/python bench/guard_proof.py --scenario burst [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import provenance  # noqa: E402
from servers import SERVE_ONLY, start_server, stop, stop_on_sigterm  # noqa: E402

SYSTEM = "You are a helpful assistant. Answer briefly."


def task(rng: random.Random, asked: set[int]) -> int:
    while True:
        n = rng.randint(100, 9999)
        if n not in asked:
            asked.add(n)
            return n


def reward_of(n: int, text: str) -> float:
    return 1.0 if str(n) in text else 0.0


class Traffic:
    def __init__(self, url: str, rng: random.Random) -> None:
        self.url = url
        self.rng = rng
        self.asked: set[int] = set()
        self.log: list[dict[str, Any]] = []
        self.client = httpx.AsyncClient(timeout=600)
        self.watch: dict[str, dict[str, Any]] = {}
        """The watch's latest figures per stretch (keyed by its start), as `/rl/adapters` showed
        them every few seconds while traffic ran: each stretch's last look."""

    async def ask(self, model: str, n: int) -> tuple[str, str, str]:
        """(answer, served model, response id)."""
        r = await self.client.post(
            f"{self.url}/v1/chat/completions",
            headers={"Authorization": "Bearer sk-agent"},
            json={
                "model": model,
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Say the number {n}."},
                ],
                "max_tokens": 24,
            },
        )
        r.raise_for_status()
        body = r.json()
        return body["choices"][0]["message"]["content"] or "", body["model"], body["id"]

    async def one(self, phase: str, invert: bool) -> None:
        n = task(self.rng, self.asked)
        started = time.time()
        text, served, rid = await self.ask("rlproxy", n)
        right = reward_of(n, text)
        posted = 1.0 - right if invert else right
        r = await self.client.post(
            f"{self.url}/rl/trajectories/{rid}/reward",
            json={"reward": posted, "source": "guard-proof"},
        )
        r.raise_for_status()
        self.log.append(
            {"phase": phase, "at": started, "served": served, "right": right, "posted": posted}
        )

    async def run(self, phase: str, invert: bool, calls: int | None, until: Any, workers: int):
        """`calls` calls (or until `until()` is true), `workers` at a time."""
        done = 0

        async def worker() -> None:
            nonlocal done
            while True:
                if calls is not None and done >= calls:
                    return
                if calls is None and await until():
                    return
                done += 1
                await self.one(phase, invert)

        async def look() -> None:
            while True:
                await asyncio.sleep(5)
                try:
                    listing = await self.adapters()
                except httpx.HTTPError:
                    continue  # a busy moment: the next look
                watch = (listing.get("rollout") or {}).get("watch") or {}
                latest = watch.get("latest")
                if latest:
                    self.watch[str(latest.get("since"))] = {**latest, "at": time.time()}

        looking = asyncio.ensure_future(look())
        try:
            await asyncio.gather(*(worker() for _ in range(workers)))
        finally:
            looking.cancel()

    async def adapters(self) -> dict[str, Any]:
        r = await self.client.get(f"{self.url}/rl/adapters")
        r.raise_for_status()
        return dict(r.json())

    async def evaluate(self, model: str, tasks: int) -> dict[str, Any]:
        rng = random.Random(f"eval:{model}")
        right = []
        sem = asyncio.Semaphore(4)

        async def one() -> None:
            async with sem:
                n = task(rng, self.asked)
                text, _served, _ = await self.ask(model, n)
                right.append(reward_of(n, text))

        await asyncio.gather(*(one() for _ in range(tasks)))
        mean = statistics.fmean(right)
        se = statistics.stdev(right) / len(right) ** 0.5
        return {"model": model, "tasks": len(right), "right": round(mean, 3), "se": round(se, 3)}


def write_harmful_version(data: Path, scale: float) -> None:
    """A random LoRA (A and B drawn, B times `scale`) as version 1, written as the trainer
    writes a version: a temporary folder, then one rename."""
    import shutil

    import torch
    from peft import LoraConfig, get_peft_model

    sys.path.insert(0, str(REPO))
    from proxy.engines.loader import load_model

    torch.manual_seed(0)
    base = load_model(REPO / "rlproxy-data").model
    model = get_peft_model(
        base,
        LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            init_lora_weights=False,
        ),
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    root = data / "checkpoints" / "rlproxy"
    tmp = root / ".tmp-0001-harmful"
    shutil.rmtree(tmp, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    (tmp / "trainer_state.json").write_text(json.dumps({"step": 1, "parent": 0}))
    tmp.rename(root / "0001")


def version_of(served: str) -> int:
    suffix = served.rpartition("@")[2]
    return 0 if suffix == "base" else int(suffix)


def decisions(listing: dict[str, Any], log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each version's rollout: its decisions with the calls (all, and the canary's) and minutes
    from the canary's start to the decision; its wait from written to serving everything."""
    out = []
    for a in listing["data"]:
        rollout = a.get("rollout") or {}
        row: dict[str, Any] = {
            "version": a["version"],
            "status": a["status"],
            "state": rollout.get("state"),
            "created_at": a.get("created_at"),
            "activated_at": a.get("activated_at"),
        }
        start = rollout.get("started_at")
        for d in rollout.get("decisions") or []:
            if start is None:
                continue
            between = [c for c in log if start <= c["at"] < d["at"]]
            row.setdefault("decisions", []).append(
                {
                    "decision": d["decision"],
                    "reason": d["reason"],
                    "minutes": round((d["at"] - start) / 60, 2),
                    "calls": len(between),
                    "canary_calls": sum(version_of(c["served"]) == a["version"] for c in between),
                    "figures": d.get("figures"),
                }
            )
        if a.get("created_at") and a.get("activated_at"):
            waited = [c for c in log if a["created_at"] <= c["at"] < a["activated_at"]]
            row["wait_to_full_traffic"] = {
                "minutes": round((a["activated_at"] - a["created_at"]) / 60, 2),
                "calls": len(waited),
            }
        out.append(row)
    return out


def burst_outcome(
    result: dict[str, Any], listing: dict[str, Any], after: list[dict[str, Any]]
) -> dict[str, Any]:
    """The burst scenario against what it must show: the bad version clearly worse than the
    base (pinned evaluation); the share of the calls after the burst it served, and its whole
    rolled-back lineage served; whether and when (calls after the burst) it was rolled back,
    and by what; what serves at the end against the base."""
    bad = result["bad_version"]
    evals = result["evaluation"]
    base = evals["base"]
    records = {a["version"]: a for a in listing["data"]}

    def against_base(e: dict[str, Any] | None) -> dict[str, Any] | None:
        if not e or "right" not in e:
            return None
        se = (e["se"] ** 2 + base["se"] ** 2) ** 0.5
        diff = e["right"] - base["right"]
        return {"right": e["right"], "minus_base": round(diff, 3), "in_se": round(diff / se, 2)}

    active = result["active_at_end"]
    bad_eval = evals.get("active_at_end") if active == bad else evals.get(f"version_{bad}")
    rollout = (records.get(bad) or {}).get("rollout") or {}
    decision = next(
        (d for d in reversed(rollout.get("decisions") or []) if d["decision"] == "rolled_back"),
        None,
    )
    rolled = {
        v for v, a in records.items() if ((a.get("rollout") or {}).get("state") == "rolled_back")
    }
    served = [version_of(c["served"]) for c in after]
    outcome: dict[str, Any] = {
        "bad_version": bad,
        "bad_against_base": against_base(bad_eval),
        "base_right": base["right"],
        "bad_served_share_after": round(served.count(bad) / max(1, len(served)), 3),
        "bad_served_share_first_300": round(served[:300].count(bad) / max(1, len(served[:300])), 3),
        "rolled_back_versions": sorted(rolled),
        "rolled_back_served_share_after": round(
            sum(v in rolled for v in served) / max(1, len(served)), 3
        ),
        "bad_rolled_back": decision is not None,
        "serving_at_end": active,
        "end_against_base": {"right": base["right"], "minus_base": 0.0, "in_se": 0.0}
        if active == 0
        else against_base(evals.get("active_at_end")),
    }
    if decision is not None:
        outcome["rolled_back_by"] = decision.get("by", "canary")
        outcome["rolled_back_after_calls"] = sum(c["at"] < decision["at"] for c in after)
        outcome["rolled_back_after_the_traffic"] = bool(after) and decision["at"] > after[-1]["at"]
        outcome["rolled_back_reason"] = decision["reason"]
    return outcome


async def main_async(args: argparse.Namespace, url: str) -> dict[str, Any]:
    traffic = Traffic(url, random.Random(f"guard:{args.seed}"))
    t0 = time.time()
    result: dict[str, Any] = {}
    if args.scenario == "burst":

        async def bad_version_written() -> bool:
            listing = await traffic.adapters()
            return any(a["version"] >= args.burst_versions for a in listing["data"])

        await traffic.run("burst", True, None, bad_version_written, args.workers)
        result["burst_calls"] = len(traffic.log)
        result["burst_minutes"] = round((time.time() - t0) / 60, 2)
        result["bad_version"] = args.burst_versions
        print(f"burst: {len(traffic.log)} calls, version {args.burst_versions} written", flush=True)
    if args.scenario == "harmful":
        await traffic.run("warmup", False, args.warmup, None, args.workers)
        write_harmful_version(Path(args.data_dir), args.harm_scale)
        result["warmup_calls"] = args.warmup
        result["harm_scale"] = args.harm_scale
        print(f"warmup: {args.warmup} calls; harmful version 1 in place", flush=True)
    t1 = time.time()
    await traffic.run("true", False, args.calls, None, args.workers)
    after = [c for c in traffic.log if c["phase"] == "true"]
    served: dict[int, int] = {}
    for c in after:
        served[version_of(c["served"])] = served.get(version_of(c["served"]), 0) + 1
    result["true_calls"] = len(after)
    result["true_minutes"] = round((time.time() - t1) / 60, 2)
    result["served_share_after_burst" if args.scenario == "burst" else "served_share"] = {
        str(v): round(k / len(after), 3) for v, k in sorted(served.items())
    }
    tenth = max(1, len(after) // 10)
    result["right_by_tenth"] = [
        round(statistics.fmean(c["right"] for c in after[i : i + tenth]), 3)
        for i in range(0, len(after), tenth)
    ]
    listing = await traffic.adapters()
    result["serving_at_end"] = listing.get("rollout", None)
    active = next((a["version"] for a in listing["data"] if a.get("active")), 0)
    result["active_at_end"] = active
    result["versions"] = decisions(listing, traffic.log)
    print(json.dumps(result, indent=1)[:3000], flush=True)
    evals = {"base": await traffic.evaluate("rlproxy@base", args.eval_tasks)}
    if active:
        evals["active_at_end"] = await traffic.evaluate(f"rlproxy@{active}", args.eval_tasks)
    if args.scenario in ("burst", "harmful"):  # every version, pinned (loaded on demand)
        for a in listing["data"]:
            if a["version"] == active:
                continue
            try:
                evals[f"version_{a['version']}"] = await traffic.evaluate(
                    f"rlproxy@{a['version']}", args.eval_tasks
                )
            except httpx.HTTPStatusError as exc:
                evals[f"version_{a['version']}"] = {"error": exc.response.text[:300]}
    result["evaluation"] = evals
    result["watch_stretches"] = list(traffic.watch.values())
    if args.scenario == "burst":
        # read again after the evaluation: a decision whose evidence was still being scored when
        # the traffic stopped has come by now (its time says whether it came after the last call)
        result["burst_outcome"] = burst_outcome(result, await traffic.adapters(), after)
    r = await traffic.client.get(f"{url}/rl/eval")  # the held-out evaluation, as served
    result["held_out_evaluation"] = r.json() if r.status_code == 200 else {"error": r.text[:300]}
    result["calls"] = traffic.log
    await traffic.client.aclose()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=["burst", "plain", "harmful"], required=True)
    parser.add_argument("--warmup", type=int, default=60)
    parser.add_argument("--harm-scale", type=float, default=0.5)
    parser.add_argument("--guard-off", action="store_true")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--burst-versions", type=int, default=4)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--eval-tasks", type=int, default=80)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--data", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    settings = {"RLPROXY_ROLLOUT": "false"} if args.guard_off else {}
    if args.scenario == "harmful":
        settings["RLPROXY_TRAIN"] = "false"
    record = provenance.start(settings, scenario=args.scenario, seed=args.seed)
    data = args.data or Path(f"/tmp/rlproxy-guard-{args.scenario}-{os.getpid()}")
    args.data_dir = str(data)
    for k in [k for k in os.environ if k.startswith("RLPROXY_")]:
        del os.environ[k]  # serve's defaults, whatever the caller's shell set
    # start_server turns training, scoring and publishing off; serve's defaults turn them on
    defaults = {k: "true" for k in SERVE_ONLY}
    proc, url = start_server(data, REPO / "rlproxy-data", {**defaults, **settings})
    stopped = None
    result: dict[str, Any] = {}
    stop_on_sigterm()  # kill as Ctrl-C: file written, server stopped
    try:
        result = asyncio.run(main_async(args, url))
    except KeyboardInterrupt:
        stopped = "interrupted (Ctrl-C or SIGTERM)"
    except Exception as exc:  # say why it ended, in its own file
        stopped = f"{type(exc).__name__}: {exc}"
    finally:
        stop(proc)
    name = f"guard_{args.scenario}{'_off' if args.guard_off else ''}_{args.seed}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / name).write_text(
        json.dumps({**provenance.finish(record, stopped_early=stopped), **result}, indent=1) + "\n"
    )
    print(f"wrote {args.out / name}")


if __name__ == "__main__":
    main()
