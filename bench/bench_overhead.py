"""Proxy overhead: rlproxy's full stack vs the LiteLLM proxy vs the provider called directly.

    .venv/bin/python bench/bench_overhead.py [--rates 50 200] [--duration 10]

Three targets in the same run, all answering non-streamed chat completions from one "instant"
OpenAI-compatible server (a raw asyncio HTTP server in a subprocess that returns a fixed
completion at once, keep-alive):

- direct:  the load generator calls the instant server itself (the baseline);
- rlproxy: `rlproxy serve` with the instant server as an upstream model (HTTP, request parsing,
  trajectory linking, a durable SQLite commit of every call before the response, litellm);
- litellm: the LiteLLM proxy (`litellm --config`, one worker, no database), its documented
  config.yaml with an `openai/` model whose api_base is the instant server.

The load generator is open-loop (httpx.AsyncClient): request i is due at t0 + i/rate whether or
not earlier ones finished, and its latency counts from that due time, so queueing shows. For each
rate it reports latency percentiles and the latency added over direct at the same percentile,
and errors (non-200, transport errors, or no answer within the timeout). Then each proxy is
stepped up through rates until one has an error or falls behind (under 95 % of the offered rate
completed in time): the last rate before that is the highest rate held with zero errors.

This is a benchmark, not a test: numbers depend on the machine and on what else runs on it.
Needs the LiteLLM proxy's runtime extras (see the `bench` extra in pyproject.toml).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
COMPLETION = json.dumps(
    {
        "id": "chatcmpl-instant",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "instant",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello from the instant server."},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 6, "total_tokens": 18},
    }
).encode()


# ----------------------------------------------------------------------------- instant server


async def _serve_instant(port: int) -> None:
    """HTTP/1.1 with keep-alive; every request gets the fixed completion, immediately."""
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(COMPLETION)).encode() + b"\r\n\r\n"
    )

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                headers = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in headers.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                if length:
                    await reader.readexactly(length)
                writer.write(head + COMPLETION)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


# ----------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(
    url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 240
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy:\n{log.read_text()[-3000:]}")


@contextmanager
def process(cmd: list[str], env: dict[str, str], log: Path, health: str) -> Iterator[None]:
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        wait_healthy(health, proc, log)
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass(frozen=True)
class Target:
    name: str
    url: str  # the chat completions URL
    model: str
    key: str


def litellm_config(path: Path, instant_base: str) -> None:
    """LiteLLM's documented proxy config: a model_list entry with litellm_params."""
    path.write_text(
        "model_list:\n"
        "  - model_name: instant\n"
        "    litellm_params:\n"
        "      model: openai/instant\n"
        f"      api_base: {instant_base}\n"
        "      api_key: sk-instant\n"
    )


# ----------------------------------------------------------------------------- load


@dataclass
class Result:
    rate: float
    sent: int
    ok: int
    errors: int
    late: int  # answered, but after the duration + grace window
    latencies_ms: list[float]

    def pct(self, p: float) -> float:
        if not self.latencies_ms:
            return float("nan")
        xs = sorted(self.latencies_ms)
        return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]

    @property
    def held(self) -> bool:
        return self.errors == 0 and self.ok >= 0.95 * self.sent and self.late == 0


async def open_loop(target: Target, rate: float, duration_s: float, timeout_s: float) -> Result:
    n = int(rate * duration_s)
    body = {
        "model": target.model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 16,
    }
    headers = {"Authorization": f"Bearer {target.key}"}
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    latencies: list[float] = []
    errors = late = 0
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:
        await client.post(target.url, json=body, headers=headers)  # warm a connection
        t0 = time.perf_counter() + 0.2
        end = t0 + duration_s + timeout_s

        async def one(i: int) -> None:
            nonlocal errors, late
            due = t0 + i / rate
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            try:
                r = await client.post(target.url, json=body, headers=headers)
                ok = r.status_code == 200 and b"choices" in r.content
            except httpx.HTTPError:
                ok = False
            done = time.perf_counter()
            if not ok:
                errors += 1
            elif done > end:
                late += 1
            else:
                latencies.append((done - due) * 1000)

        await asyncio.gather(*(one(i) for i in range(n)))
    return Result(rate, n, len(latencies), errors, late, latencies)


def run_rate(target: Target, rate: float, duration_s: float, timeout_s: float) -> Result:
    settle(target)
    return asyncio.run(open_loop(target, rate, duration_s, timeout_s))


def settle(target: Target, quiet_ms: float = 100.0, patience_s: float = 120.0) -> None:
    """Wait until the target has worked off an earlier overload (a lone request is quick)."""
    body = {"model": target.model, "messages": [{"role": "user", "content": "Hi"}]}
    headers = {"Authorization": f"Bearer {target.key}"}
    deadline = time.monotonic() + patience_s
    with httpx.Client(timeout=30) as client:
        while time.monotonic() < deadline:
            start = time.perf_counter()
            with suppress(httpx.HTTPError):
                client.post(target.url, json=body, headers=headers)
            if (time.perf_counter() - start) * 1000 < quiet_ms:
                return
            time.sleep(1)


# ----------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[50, 200])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per rate")
    parser.add_argument(
        "--step-rates",
        type=float,
        nargs="+",
        default=[50, 100, 150, 200, 300, 400, 600, 800],
        help="rates tried in order for the highest rate held",
    )
    parser.add_argument("--step-duration", type=float, default=5.0)
    parser.add_argument("--timeout", type=float, default=10.0, help="per-request timeout, s")
    parser.add_argument("--serve-instant", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_instant:
        asyncio.run(_serve_instant(args.serve_instant))
        return 0

    litellm_bin = shutil.which("litellm", path=str(Path(sys.executable).parent))
    if litellm_bin is None:
        print("the `litellm` command is missing; install the bench extra", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    p_instant, p_rl, p_lite = free_port(), free_port(), free_port()
    instant_base = f"http://127.0.0.1:{p_instant}/v1"
    base_env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    rl_env = {
        **base_env,
        "RLPROXY_DATA_DIR": str(work / "rlproxy-data"),
        "RLPROXY_MODEL_DIR": str(REPO / "rlproxy-data"),
        "RLPROXY_PORT": str(p_rl),
        "RLPROXY_LOG_LEVEL": "WARNING",
        "RLPROXY_TRAIN": "false",  # a forwarding-overhead comparison: no trainer or scorer
        "RLPROXY_SCORING": "false",
        "RLPROXY_UPSTREAM_MODELS": json.dumps(
            {"instant": {"model": "openai/instant", "api_base": instant_base, "api_key_env": "IK"}}
        ),
        "IK": "sk-instant",
    }
    lite_env = {**base_env, "LITELLM_MASTER_KEY": "sk-master", "LITELLM_LOG": "ERROR"}
    litellm_config(work / "litellm.yaml", instant_base)
    targets = [
        Target("direct", f"{instant_base}/chat/completions", "instant", "sk-instant"),
        Target("rlproxy", f"http://127.0.0.1:{p_rl}/v1/chat/completions", "instant", "sk-c"),
        Target("litellm", f"http://127.0.0.1:{p_lite}/chat/completions", "instant", "sk-master"),
    ]
    instant_cmd = [sys.executable, __file__, "--serve-instant", str(p_instant)]
    rl_cmd = [sys.executable, "-m", "proxy.cli", "serve"]
    lite_cmd = [litellm_bin, "--config", str(work / "litellm.yaml")]
    lite_cmd += ["--port", str(p_lite), "--num_workers", "1"]
    print(f"work dir {work}", flush=True)
    with (
        process(instant_cmd, base_env, work / "instant.log", f"{instant_base}/models"),
        process(rl_cmd, rl_env, work / "rlproxy.log", f"http://127.0.0.1:{p_rl}/health"),
        process(lite_cmd, lite_env, work / "litellm.log", f"http://127.0.0.1:{p_lite}/health"),
    ):
        results: dict[tuple[str, float], Result] = {}
        for rate in args.rates:
            for target in targets:
                print(f"  {target.name} at {rate:g}/s ...", flush=True)
                results[target.name, rate] = run_rate(target, rate, args.duration, args.timeout)
        held: dict[str, float | None] = {}
        for target in targets[1:]:
            held[target.name] = None
            for rate in args.step_rates:
                print(f"  step {target.name} at {rate:g}/s ...", flush=True)
                r = run_rate(target, rate, args.step_duration, args.timeout)
                if not r.held:
                    break
                held[target.name] = rate
        rows = count_rows(work / "rlproxy-data" / "rlproxy.db")
    print_table(args, results, held, rows)
    return 0


def count_rows(db: Path) -> int:
    import sqlite3

    with sqlite3.connect(db) as conn:
        return int(conn.execute("SELECT count(*) FROM calls").fetchone()[0])


def print_table(
    args: argparse.Namespace,
    results: dict[tuple[str, float], Result],
    held: dict[str, float | None],
    rlproxy_rows: int,
) -> None:
    print()
    print(f"Non-streamed chat completions, open loop, {args.duration:g} s per rate.")
    print("Latency in ms from the request's due time; 'added' = target minus direct.")
    header = (
        f"{'target':<8} {'rate/s':>6} {'sent':>5} {'errors':>6} "
        f"{'p50':>7} {'p95':>7} {'p99':>7} {'+p50':>7} {'+p95':>7} {'+p99':>7}"
    )
    print(header)
    print("-" * len(header))
    for rate in args.rates:
        direct = results["direct", rate]
        for name in ("direct", "rlproxy", "litellm"):
            r = results[name, rate]
            added = [r.pct(p) - direct.pct(p) for p in (50, 95, 99)]
            add_cols = (
                " ".join(f"{a:>7.1f}" for a in added)
                if name != "direct"
                else " ".join(f"{'':>7}" for _ in added)
            )
            print(
                f"{name:<8} {rate:>6g} {r.sent:>5} {r.errors + r.late:>6} "
                f"{r.pct(50):>7.1f} {r.pct(95):>7.1f} {r.pct(99):>7.1f} {add_cols}"
            )
    print()
    steps = " ".join(f"{r:g}" for r in args.step_rates)
    print(f"Highest rate held with zero errors (steps {steps}/s, {args.step_duration:g} s each):")
    for name, rate in held.items():
        print(f"  {name:<8} {'none' if rate is None else f'{rate:g}/s'}")
    print(f"rlproxy stored {rlproxy_rows} call rows durably during the run.")


if __name__ == "__main__":
    sys.exit(main())
