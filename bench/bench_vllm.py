"""rlproxy's `vllm` engine in front of a vLLM-protocol server vs that server called directly.

    .venv/bin/python bench/bench_vllm.py [--rounds 3] [--requests 16] [--max-tokens 32]
                                         [--concurrency 1 16] [--vllm-url URL --model-dir D]

Without `--vllm-url` it starts `tests/fakes/vllm_server.py` (the embedded model on the local
engine, the CPU stand-in for vLLM) and `rlproxy serve` with `RLPROXY_ENGINE=vllm` in front of it;
with `--vllm-url` (a real vLLM on a GPU machine) only rlproxy is started, pointed at it.

Same prompts both ways: each prompt is sent through rlproxy once first (warm-up), and the
prompt token ids rlproxy stored for it are what the direct client sends as `/v1/completions`
`prompt`, so both paths ask the server for the same work. Every request is streamed at
temperature 0 with the same budget. Per concurrency level (1 and 16 clients by default), rounds
alternate direct and rlproxy; printed per path: completion tokens/s (all tokens / wall time),
time to the first token p50/p95 (direct: the first chunk carrying token ids; rlproxy: the first
chunk carrying content, not the role chunk it sends before generating), and the ratio and added
TTFT. Targets: rlproxy >= 0.97 of direct's tokens/s and <= 5 ms added TTFT p50; the last lines
say which hold. This is a benchmark, not a test: it prints figures and asserts nothing.

CPU time is printed beside the wall-clock figures (from /proc, Linux): rlproxy's own CPU
milliseconds per request, and the stand-in's CPU milliseconds per generated token on each path.
On a small shared machine rlproxy's CPU work competes with the stand-in's generation, which a
GPU server would not feel; the CPU figures separate rlproxy's cost from that competition.
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

    def add(self, other: Run) -> None:
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


async def via_rlproxy(url: str, max_tokens: int, client: httpx.AsyncClient, prompt: str) -> Run:
    body = {
        "model": "rlproxy",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    run, start = Run(), time.perf_counter()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            data = line.removeprefix("data: ").strip()
            if not data.startswith("{"):
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                run.errors += 1
            for choice in chunk.get("choices") or []:
                if choice.get("delta", {}).get("content") and not run.ttft_s:
                    run.ttft_s.append(time.perf_counter() - start)
            if chunk.get("usage"):
                run.tokens = int(chunk["usage"]["completion_tokens"])
    return run


async def direct(
    url: str, model: str, max_tokens: int, client: httpx.AsyncClient, ids: list[int]
) -> Run:
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
    run, start = Run(), time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            data = line.removeprefix("data: ").strip()
            if not data.startswith("{"):
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                run.errors += 1
            for choice in chunk.get("choices") or []:
                got = len(choice.get("token_ids") or [])
                if got and not run.ttft_s:
                    run.ttft_s.append(time.perf_counter() - start)
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
                one = await call(client, job)
                total.tokens += one.tokens
                total.ttft_s += one.ttft_s
                total.errors += one.errors

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        total.wall_s = time.perf_counter() - start
    return total


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
        rows = conn.execute("SELECT request_messages, prompt_token_ids FROM calls").fetchall()
    out = {}
    for messages, ids in rows:
        out[json.loads(messages)[-1]["content"]] = json.loads(ids)
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=16, help="requests per round and level")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--vllm-url", default=None, help="a real vLLM server (default: the fake)")
    p.add_argument("--model-dir", type=Path, default=REPO / "rlproxy-data")
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--profile", type=Path, default=None, help="py-spy output (see above)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    from tests.e2e.conftest import Server, start_server, stop_server
    from tests.fakes.stack import start_replicas, wait_in_rotation

    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        data_dir = Path(tmp)
        vllm_url, fake_pid = args.vllm_url, None
        if vllm_url is None:
            (fake,) = start_replicas(data_dir / "replicas", args.model_dir, 1)
            stack.callback(fake.stop)
            fake.wait()
            vllm_url = fake.url
            fake_pid = fake.proc.pid if fake.proc is not None else None
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
        asyncio.run(
            level(
                4,
                len(PROMPTS),
                partial(via_rlproxy, url, args.max_tokens),
                list(PROMPTS),
                args.timeout_s,
            )
        )
        ids = stored_prompts(data_dir / "rlproxy.db")
        jobs = [ids[p] for p in PROMPTS]
        print(f"server: {vllm_url} ({model}); {args.max_tokens} tokens per request, temperature 0")
        verdicts = []
        for level_no, clients in enumerate(args.concurrency):
            d_all, r_all = Run(), Run()
            cpu = {"rlproxy": 0.0, "fake direct": 0.0, "fake rlproxy": 0.0}
            spy = None
            if args.profile is not None and level_no == 0:
                spy = profile(args.profile, proc.pid)
            for _ in range(args.rounds):
                fake0 = cpu_s(fake_pid)
                d = asyncio.run(
                    level(
                        clients,
                        args.requests,
                        partial(direct, vllm_url, model, args.max_tokens),
                        list(jobs),
                        args.timeout_s,
                    )
                )
                fake1, rl1 = cpu_s(fake_pid), cpu_s(proc.pid)
                r = asyncio.run(
                    level(
                        clients,
                        args.requests,
                        partial(via_rlproxy, url, args.max_tokens),
                        list(PROMPTS),
                        args.timeout_s,
                    )
                )
                cpu["fake direct"] += fake1 - fake0
                cpu["fake rlproxy"] += cpu_s(fake_pid) - fake1
                cpu["rlproxy"] += cpu_s(proc.pid) - rl1
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
