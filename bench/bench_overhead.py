"""Proxy overhead in steady state: rlproxy vs the LiteLLM proxy, same upstream, same run.

    .venv/bin/python bench/bench_overhead.py [--long-calls 20000] [--rounds 5] [--quick]
    .venv/bin/python bench/bench_overhead.py --only rlproxy --profile x.svg   # one target
    .venv/bin/python bench/bench_overhead.py --only rlproxy --rounds 0 --long-calls 0 \
        --postgres postgresql+asyncpg://postgres@127.0.0.1:5432/test     # store on Postgres

Targets, all answering chat completions from one "instant" OpenAI-compatible server (a raw
asyncio HTTP server in a subprocess: a fixed completion, or a fixed chunk stream, at once,
keep-alive):

- direct:          the load generator calls the instant server itself (the baseline);
- rlproxy:         `rlproxy serve`, the instant server as an `openai/` upstream (the direct
                   httpx path), every call linked and committed durably to SQLite before the
                   response;
- rlproxy-litellm: the same server and store, a second upstream name with `via: litellm`;
- rlproxy-responses, rlproxy-messages: the same server, store and upstream as `rlproxy`, the
                   same conversations sent as OpenAI Responses API and Anthropic Messages
                   requests (`/v1/responses`, `/v1/messages`): what translating in and out
                   adds beside Chat Completions;
- litellm:         the LiteLLM proxy (one worker, no database), its documented config.yaml.

Traffic is what agents send, the same sequence for every target: repeated tasks (one of a few
fixed first messages, as runs of one task and GRPO groups are), distinct tasks, and multi-turn
trajectories (each turn carries the earlier ones and the upstream's reply).

Phases, in order:
1. warm-up: sequential calls, then a short open-loop burst, on every target (not measured);
2. sequential latency, interleaved: `--rounds` rounds; in each, every target (order rotated)
   gets `--calls` non-streamed calls and half as many streamed ones (time to the first `data:`
   event and to the end); "added" = target minus direct, per round and overall; beside it, the
   CPU seconds each server process spent per call (all its threads; steadier than latency on a
   shared machine);
3. the long run: `--long-calls` sequential calls to rlproxy (every tenth call also to direct),
   p50/p95 per block of `--block` calls beside the stored-call count: does latency drift?
4. the zero-error rate: every target stepped up through `--step-rates` (interleaved per rate,
   open loop, `--step-duration` s each) until it has an error, falls behind, or its p99 passes
   `--slo-ms`; the last rate before that is the one it holds.

With `--postgres URL` rlproxy stores into a fresh database on that server (dropped afterwards)
instead of SQLite, and each step of phase 4 also prints the calls committed per second and what
Postgres did meanwhile (transactions committed and rows written per second, from
pg_stat_database): the store's commit rate at each request rate.

The load generator is open-loop where a rate is given (request i is due at t0 + i/rate, latency
counts from the due time, so queueing shows), and shares the machine with the servers: direct's
row shows what the generator itself manages. This is a benchmark, not a test: absolute numbers
depend on the machine and on what else runs on it; ratios inside one run are the figures to
trust. Needs the LiteLLM proxy's runtime extras (`make bench-overhead` installs them).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import REPO, free_port, process, start_server, stop

TEXT = "Hello from the instant server."
PIECES = ["Hello", " from the", " instant", " server."]
USAGE = {"prompt_tokens": 12, "completion_tokens": 6, "total_tokens": 18}


# ----------------------------------------------------------------------------- instant server


def _completion() -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-instant",
            "object": "chat.completion",
            "created": 1700000000,
            "model": "instant",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": TEXT},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": USAGE,
        }
    ).encode()


def _stream(include_usage: bool) -> bytes:
    """OpenAI's chunk stream: role, content pieces, finish, optional usage, `[DONE]`; in HTTP/1.1
    chunked transfer encoding, one HTTP chunk per event."""

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        event = {
            "id": "chatcmpl-instant",
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": "instant",
            "choices": choices,
        }
        if include_usage:
            event["usage"] = usage
        return b"data: " + json.dumps(event).encode() + b"\n\n"

    def choice(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    events = [chunk([choice({"role": "assistant", "content": ""})])]
    events += [chunk([choice({"content": p})]) for p in PIECES]
    events.append(chunk([choice({}, "stop")]))
    if include_usage:
        events.append(chunk([], USAGE))
    events.append(b"data: [DONE]\n\n")
    return b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


async def _serve_instant(port: int) -> None:
    """HTTP/1.1 with keep-alive; every request gets the fixed answer immediately."""
    body = _completion()
    plain = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    sse_head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    streams = {True: sse_head + _stream(True), False: sse_head + _stream(False)}
    models = json.dumps({"object": "list", "data": [{"id": "instant", "object": "model"}]})
    models_answer = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
        + str(len(models)).encode()
        + b"\r\n\r\n"
        + models.encode()
    )
    streamed = re.compile(rb'"stream"\s*:\s*true')
    with_usage = re.compile(rb'"include_usage"\s*:\s*true')

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                request = await reader.readexactly(length) if length else b""
                if head.startswith(b"GET"):
                    writer.write(models_answer)
                elif streamed.search(request):
                    writer.write(streams[bool(with_usage.search(request))])
                else:
                    writer.write(plain)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


# ----------------------------------------------------------------------------- traffic


class Workload:
    """Chat requests as agents send them; the same seed gives every target the same sequence.

    40 % a repeated task (one of `tasks` fixed first messages), 30 % a distinct task, 30 % the
    next turn of one of `open_conversations` multi-turn trajectories (up to `turns` turns, each
    started on a repeated task; a finished one starts again)."""

    def __init__(self, seed: int, tasks: int = 16, open_conversations: int = 8, turns: int = 6):
        self.rng = random.Random(seed)
        self.tasks = [f"Task {i}: add the numbers {i} and {2 * i + 1}." for i in range(tasks)]
        self.turns = turns
        self.conversations: list[list[dict[str, Any]]] = [[] for _ in range(open_conversations)]

    def _start(self, task: str) -> list[dict[str, Any]]:
        return [
            {"role": "system", "content": "You are a careful agent. Answer briefly."},
            {"role": "user", "content": task},
        ]

    def next(self) -> list[dict[str, Any]]:
        draw = self.rng.random()
        if draw < 0.4:
            return self._start(self.rng.choice(self.tasks))
        if draw < 0.7:
            return self._start(f"Distinct task {self.rng.getrandbits(64):016x}: say hello.")
        i = self.rng.randrange(len(self.conversations))
        conv = self.conversations[i]
        if not conv or len(conv) >= 2 * self.turns + 1:
            conv = self._start(self.rng.choice(self.tasks))
        else:
            conv = [
                *conv,
                {"role": "assistant", "content": TEXT},
                {"role": "user", "content": f"Good. Next step {len(conv) // 2}."},
            ]
        self.conversations[i] = conv
        return conv


@dataclass
class Target:
    name: str
    url: str  # the chat completions URL (or /v1/responses, /v1/messages: see `protocol`)
    model: str
    key: str
    workload: Workload = field(default_factory=lambda: Workload(0))
    pid: int | None = None
    """The server process behind the target (its CPU time per call is reported); None: direct."""
    protocol: str = "chat"
    """"chat", "responses" or "messages": the same conversation in that protocol's shape."""

    def body(self, stream: bool = False) -> dict[str, Any]:
        messages = self.workload.next()
        body: dict[str, Any]
        if self.protocol == "responses":
            body = {"model": self.model, "input": messages, "max_output_tokens": 16}
        elif self.protocol == "messages":
            system = [m["content"] for m in messages if m["role"] == "system"]
            turns = [m for m in messages if m["role"] != "system"]
            body = {"model": self.model, "system": system[0], "messages": turns, "max_tokens": 16}
        else:
            body = {"model": self.model, "messages": messages, "max_tokens": 16}
        if stream:
            body["stream"] = True
            if self.protocol == "chat":
                body["stream_options"] = {"include_usage": True}
        return body

    @property
    def answered(self) -> bytes:
        """What a successful non-streamed answer holds."""
        return {"chat": b'"choices"', "responses": b'"output"', "messages": b'"content"'}[
            self.protocol
        ]

    @property
    def text_event(self) -> str:
        """What a streamed event carrying text holds."""
        return {"chat": '"content"', "responses": '"delta"', "messages": '"text_delta"'}[
            self.protocol
        ]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


# ----------------------------------------------------------------------------- sequential


@dataclass
class Sequential:
    total_ms: list[float] = field(default_factory=list)
    stream_total_ms: list[float] = field(default_factory=list)
    ttfb_ms: list[float] = field(default_factory=list)
    errors: int = 0
    cpu_s: float = 0.0
    """CPU seconds (user + system, all threads) the target's server process spent on the calls."""
    calls: int = 0


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc); 0.0 for no process.
    Unlike latency, this hardly moves with what else the machine runs."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def call_once(client: httpx.Client, target: Target) -> float | None:
    """One non-streamed call; its latency in ms, None on an error."""
    start = time.perf_counter()
    try:
        r = client.post(target.url, json=target.body(), headers=target.headers)
        ok = r.status_code == 200 and target.answered in r.content
    except httpx.HTTPError:
        ok = False
    return (time.perf_counter() - start) * 1000 if ok else None


def stream_once(client: httpx.Client, target: Target) -> tuple[float, float] | None:
    """One streamed call: (ms to the first `data:` event, ms to the end), None on an error."""
    start = time.perf_counter()
    first = None
    text = []
    try:
        with client.stream(
            "POST", target.url, json=target.body(stream=True), headers=target.headers
        ) as r:
            if r.status_code != 200:
                r.read()
                return None
            for line in r.iter_lines():
                if line.startswith("data:"):
                    if first is None:
                        first = time.perf_counter()
                    if target.text_event in line:
                        text.append(line)
    except httpx.HTTPError:
        return None
    end = time.perf_counter()
    if first is None or not text:
        return None
    return (first - start) * 1000, (end - start) * 1000


def sequential(client: httpx.Client, target: Target, calls: int, out: Sequential) -> None:
    cpu = cpu_seconds(target.pid)
    out.calls += calls + max(1, calls // 2)
    for _ in range(calls):
        ms = call_once(client, target)
        if ms is None:
            out.errors += 1
        else:
            out.total_ms.append(ms)
    for _ in range(max(1, calls // 2)):
        s = stream_once(client, target)
        if s is None:
            out.errors += 1
        else:
            out.ttfb_ms.append(s[0])
            out.stream_total_ms.append(s[1])
    out.cpu_s += cpu_seconds(target.pid) - cpu


# ----------------------------------------------------------------------------- open loop


@dataclass
class Load:
    rate: float
    sent: int
    ok: int
    errors: int
    late: int
    latencies_ms: list[float]

    def held(self, slo_ms: float) -> bool:
        return (
            self.errors == 0
            and self.late == 0
            and self.ok == self.sent
            and pct(self.latencies_ms, 99) <= slo_ms
        )


async def open_loop(target: Target, rate: float, duration_s: float, timeout_s: float) -> Load:
    n = int(rate * duration_s)
    bodies = [target.body() for _ in range(n)]
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    latencies: list[float] = []
    errors = late = 0
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:
        await client.post(target.url, json=target.body(), headers=target.headers)
        t0 = time.perf_counter() + 0.2
        end = t0 + duration_s + timeout_s

        async def one(i: int) -> None:
            nonlocal errors, late
            due = t0 + i / rate
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            try:
                r = await client.post(target.url, json=bodies[i], headers=target.headers)
                ok = r.status_code == 200 and target.answered in r.content
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
    return Load(rate, n, len(latencies), errors, late, latencies)


def settle(target: Target, quiet_ms: float = 100.0, patience_s: float = 120.0) -> None:
    """Wait until the target has worked off an earlier overload (a lone request is quick)."""
    deadline = time.monotonic() + patience_s
    with httpx.Client(timeout=30) as client:
        while time.monotonic() < deadline:
            start = time.perf_counter()
            with suppress(httpx.HTTPError):
                client.post(target.url, json=target.body(), headers=target.headers)
            if (time.perf_counter() - start) * 1000 < quiet_ms:
                return
            time.sleep(1)


# ----------------------------------------------------------------------------- main


def stored_calls(db: Path) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        return int(conn.execute("SELECT count(*) FROM calls").fetchone()[0])


class PostgresStore:
    """A fresh database on a Postgres server for rlproxy to store into, and its counters."""

    def __init__(self, server_url: str) -> None:
        from sqlalchemy.engine import make_url

        self.name = f"bench_overhead_{os.getpid()}_{int(time.time())}"
        server = make_url(server_url)
        self.url = server.set(database=self.name).render_as_string(hide_password=False)
        self._admin = server.set(drivername="postgresql").render_as_string(hide_password=False)
        self._dsn = make_url(self.url).set(drivername="postgresql")
        self._dsn_text = self._dsn.render_as_string(hide_password=False)

    def _run(self, dsn: str, sql: str) -> Any:
        import asyncpg

        async def go() -> Any:
            conn = await asyncpg.connect(dsn)
            try:
                return await conn.fetchrow(sql)
            finally:
                await conn.close()

        return asyncio.run(go())

    def create(self) -> None:
        self._run(self._admin, f'CREATE DATABASE "{self.name}"')

    def drop(self) -> None:
        self._run(self._admin, f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')

    def calls(self) -> int:
        return int(self._run(self._dsn_text, "SELECT count(*) FROM calls")[0])

    def counters(self) -> tuple[int, int]:
        """(transactions committed, rows inserted + updated) in this database so far."""
        row = self._run(
            self._dsn_text,
            "SELECT pg_stat_force_next_flush(), xact_commit, tup_inserted + tup_updated "
            f"FROM pg_stat_database WHERE datname = '{self.name}'",
        )
        return int(row[1]), int(row[2])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--rounds", type=int, default=5, help="interleaved sequential rounds (0: skip)"
    )
    parser.add_argument("--calls", type=int, default=200, help="non-streamed calls per round")
    parser.add_argument(
        "--long-calls", type=int, default=20_000, help="the long run's length (0: skip)"
    )
    parser.add_argument("--block", type=int, default=2_000, help="long-run block size")
    parser.add_argument(
        "--step-rates",
        type=float,
        nargs="*",
        default=[50, 100, 150, 200, 300, 400, 600, 800],
        help="open-loop rates tried in order for the zero-error rate (none: skip)",
    )
    parser.add_argument("--step-duration", type=float, default=5.0, help="seconds per rate")
    parser.add_argument("--slo-ms", type=float, default=1000.0, help="p99 a held rate stays under")
    parser.add_argument("--timeout", type=float, default=10.0, help="per-request timeout, s")
    parser.add_argument("--no-litellm", action="store_true", help="skip the LiteLLM proxy")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=["rlproxy", "rlproxy-litellm", "rlproxy-responses", "rlproxy-messages", "litellm"],
        help="measure only these targets beside direct (the baseline always runs)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a short smoke run (2 rounds, 2,000 long calls)"
    )
    parser.add_argument(
        "--profile",
        type=Path,
        help="record rlproxy with py-spy during the sequential rounds into this file "
        "(collapsed stacks; `--profile x.svg` writes a flame graph)",
    )
    parser.add_argument(
        "--postgres",
        metavar="URL",
        help="store into a fresh database on this Postgres server (SQLAlchemy URL of any "
        "database on it) instead of SQLite, and print the commit rates at each step",
    )
    parser.add_argument("--serve-instant", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only and "litellm" not in args.only:
        args.no_litellm = True
    if args.quick:
        args.rounds, args.calls, args.long_calls, args.block = 2, 50, 2_000, 500
        args.step_rates, args.step_duration = [50, 200], 3.0
    return args


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    if args.serve_instant:
        asyncio.run(_serve_instant(args.serve_instant))
        return 0
    litellm_bin = shutil.which("litellm", path=str(Path(sys.executable).parent))
    if litellm_bin is None and not args.no_litellm:
        print(
            "the `litellm` command is missing: `make bench-overhead` installs it", file=sys.stderr
        )
        return 1
    work = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    p_instant, p_lite = free_port(), free_port()
    instant_base = f"http://127.0.0.1:{p_instant}/v1"
    base_env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "IK": "sk-instant"}
    upstreams = {
        "instant": {"model": "openai/instant", "api_base": instant_base, "api_key_env": "IK"},
        "instant-litellm": {
            "model": "openai/instant",
            "api_base": instant_base,
            "api_key_env": "IK",
            "via": "litellm",
        },
    }
    rl_env = {
        **base_env,
        "RLPROXY_LOG_LEVEL": "WARNING",
        # One load generator is one caller: the per-caller limits would answer 429s.
        "RLPROXY_CALLER_REQUESTS_PER_MINUTE": "0",
        "RLPROXY_CALLER_CONCURRENCY": "0",
        "RLPROXY_UPSTREAM_MODELS": json.dumps(upstreams),
    }
    pg = PostgresStore(args.postgres) if args.postgres else None
    if pg is not None:
        pg.create()
        rl_env["RLPROXY_DATABASE_URL"] = pg.url
    print(f"work dir {work}; event loop: {'uvloop' if has_uvloop() else 'asyncio'}", flush=True)
    with ExitStack() as stack:
        if pg is not None:
            stack.callback(pg.drop)
        instant_cmd = [sys.executable, __file__, "--serve-instant", str(p_instant)]
        health = f"{instant_base}/models"
        stack.enter_context(process(instant_cmd, base_env, work / "instant.log", health))
        rl_proc, rl_url = start_server(work / "rlproxy-data", REPO / "rlproxy-data", rl_env)
        stack.callback(stop, rl_proc)
        rl_chat = f"{rl_url}/v1/chat/completions"
        targets = [
            Target("direct", f"{instant_base}/chat/completions", "instant", "sk-instant"),
            Target("rlproxy", rl_chat, "instant", "sk-c", pid=rl_proc.pid),
            Target("rlproxy-litellm", rl_chat, "instant-litellm", "sk-c", pid=rl_proc.pid),
            Target(
                "rlproxy-responses",
                f"{rl_url}/v1/responses",
                "instant",
                "sk-c",
                pid=rl_proc.pid,
                protocol="responses",
            ),
            Target(
                "rlproxy-messages",
                f"{rl_url}/v1/messages",
                "instant",
                "sk-c",
                pid=rl_proc.pid,
                protocol="messages",
            ),
        ]
        if not args.no_litellm:
            assert litellm_bin is not None
            config = work / "litellm.yaml"
            config.write_text(  # LiteLLM's documented proxy config: model_list, litellm_params
                "model_list:\n  - model_name: instant\n    litellm_params:\n"
                f"      model: openai/instant\n      api_base: {instant_base}\n"
                "      api_key: sk-instant\n"
            )
            lite_cmd = [litellm_bin, "--config", str(config), "--port", str(p_lite)]
            lite_cmd += ["--num_workers", "1"]
            lite_env = {**base_env, "LITELLM_MASTER_KEY": "sk-master", "LITELLM_LOG": "ERROR"}
            lite_health = f"http://127.0.0.1:{p_lite}/health/liveliness"
            lite = stack.enter_context(
                process(lite_cmd, lite_env, work / "litellm.log", lite_health)
            )
            lite_url = f"http://127.0.0.1:{p_lite}/chat/completions"
            targets.append(Target("litellm", lite_url, "instant", "sk-master", pid=lite.pid))
        if args.only:
            targets = [t for t in targets if t.name == "direct" or t.name in args.only]
        db = work / "rlproxy-data" / "rlproxy.db"
        stored = pg.calls if pg is not None else lambda: stored_calls(db)
        print(f"store: {'Postgres, database ' + pg.name if pg else 'SQLite ' + str(db)}")
        run(args, targets, stored, rl_proc.pid, pg)
    return 0


def profile(out: Path, pid: int) -> subprocess.Popen[bytes]:
    """py-spy sampling `pid` until SIGINT (`pip install py-spy`; needs ptrace rights)."""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"
    fmt = "flamegraph" if out.suffix == ".svg" else "raw"
    cmd = [spy, "record", "--pid", str(pid), "--rate", "250", "--format", fmt, "-o", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL)


def has_uvloop() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def run(
    args: argparse.Namespace,
    targets: list[Target],
    stored: Callable[[], int],
    rl_pid: int,
    pg: PostgresStore | None = None,
) -> None:
    # 1. warm-up: connections, imports, caches, the database's first pages; not measured.
    print("warm-up ...", flush=True)
    with httpx.Client(timeout=args.timeout) as client:
        for t in targets:
            sequential(client, t, 100, Sequential())
    for t in targets:
        asyncio.run(open_loop(t, 30, 3, args.timeout))
    print(f"  stored calls after warm-up: {stored()}", flush=True)
    if args.rounds:
        run_sequential(args, targets, stored, rl_pid)
    if args.long_calls:
        run_long(args, targets, stored)
    if args.step_rates:
        run_steps(args, targets, stored, pg)


def run_sequential(
    args: argparse.Namespace, targets: list[Target], stored: Callable[[], int], rl_pid: int
) -> None:
    """2. sequential, interleaved rounds."""
    direct = targets[0]
    profiler = profile(args.profile, rl_pid) if args.profile else None
    seq = {t.name: Sequential() for t in targets}
    per_round: dict[str, list[float]] = {t.name: [] for t in targets}
    with httpx.Client(timeout=args.timeout) as client:
        for r in range(args.rounds):
            order = targets[r % len(targets) :] + targets[: r % len(targets)]
            this_round = {}
            for t in order:
                s = Sequential()
                sequential(client, t, args.calls, s)
                this_round[t.name] = s
                for name in ("total_ms", "stream_total_ms", "ttfb_ms"):
                    getattr(seq[t.name], name).extend(getattr(s, name))
                seq[t.name].errors += s.errors
                seq[t.name].cpu_s += s.cpu_s
                seq[t.name].calls += s.calls
            base = pct(this_round[direct.name].total_ms, 50)
            for t in targets:
                per_round[t.name].append(pct(this_round[t.name].total_ms, 50) - base)
            added = " ".join(f"{t.name} +{per_round[t.name][-1]:.2f}" for t in targets[1:])
            print(f"  round {r + 1}/{args.rounds}: p50 added ms: {added}", flush=True)
    if profiler is not None:
        profiler.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        profiler.wait(timeout=60)
        print(f"py-spy profile of rlproxy during the sequential rounds: {args.profile}")
    print_sequential(args, targets, seq, per_round, stored())


def run_long(args: argparse.Namespace, targets: list[Target], stored: Callable[[], int]) -> None:
    """3. the long run: does rlproxy's latency drift as calls are stored?"""
    direct, rl = targets[0], targets[1]
    print(f"\nLong run: {args.long_calls} sequential non-streamed calls to rlproxy", flush=True)
    header = f"{'calls':>7} {'stored':>7} {'p50':>6} {'p95':>6} {'direct p50':>10} {'+p50':>6}"
    print(header + "\n" + "-" * len(header), flush=True)
    blocks: list[float] = []
    with httpx.Client(timeout=args.timeout) as client:
        done = errors = 0
        while done < args.long_calls:
            lat: list[float] = []
            base: list[float] = []
            for i in range(min(args.block, args.long_calls - done)):
                ms = call_once(client, rl)
                if ms is None:
                    errors += 1
                else:
                    lat.append(ms)
                if i % 10 == 0:
                    d = call_once(client, direct)
                    if d is not None:
                        base.append(d)
            done += min(args.block, args.long_calls - done)
            blocks.append(pct(lat, 50) - pct(base, 50))
            print(
                f"{done:>7} {stored():>7} {pct(lat, 50):>6.2f} {pct(lat, 95):>6.2f} "
                f"{pct(base, 50):>10.2f} {blocks[-1]:>6.2f}",
                flush=True,
            )
    print(
        f"errors {errors}; added p50 first block {blocks[0]:.2f} ms, last {blocks[-1]:.2f} ms, "
        f"median of blocks {statistics.median(blocks):.2f} ms"
    )


def run_steps(
    args: argparse.Namespace,
    targets: list[Target],
    stored: Callable[[], int],
    pg: PostgresStore | None = None,
) -> None:
    """4. the zero-error rate, interleaved per rate: a target steps on while it has no error.
    Beside each rlproxy step: calls committed per second (and with Postgres, its transactions
    and rows written per second) over the step."""
    print("\nZero-error rate (open loop, interleaved per rate):", flush=True)
    header = f"{'target':<16} {'rate/s':>6} {'sent':>5} {'err':>4} {'p50':>7} {'p95':>7} {'p99':>8}"
    print(header + "\n" + "-" * len(header), flush=True)
    alive = list(targets)
    zero: dict[str, float | None] = {t.name: None for t in targets}
    within: dict[str, float | None] = {t.name: None for t in targets}
    for rate in args.step_rates:
        for t in list(alive):
            settle(t)
            counted = t.name.startswith("rlproxy")  # its calls are stored
            before = (stored(), pg.counters() if pg else None) if counted else None
            started = time.monotonic()
            res = asyncio.run(open_loop(t, rate, args.step_duration, args.timeout))
            store_rates = ""
            if before is not None:
                settle(t)  # the step's last calls committed
                seconds = time.monotonic() - started
                store_rates = f"  stored {(stored() - before[0]) / seconds:.0f} calls/s"
                if pg is not None and before[1] is not None:
                    commits, rows = pg.counters()
                    store_rates += (
                        f"; Postgres {(commits - before[1][0]) / seconds:.0f} commits/s, "
                        f"{(rows - before[1][1]) / seconds:.0f} rows written/s"
                    )
            print(
                f"{t.name:<16} {rate:>6g} {res.sent:>5} {res.errors + res.late:>4} "
                f"{pct(res.latencies_ms, 50):>7.1f} {pct(res.latencies_ms, 95):>7.1f} "
                f"{pct(res.latencies_ms, 99):>8.1f}{store_rates}",
                flush=True,
            )
            if res.errors or res.late or res.ok < res.sent:
                alive.remove(t)
                continue
            zero[t.name] = rate
            if res.held(args.slo_ms) and within[t.name] == (prev(args.step_rates, rate)):
                within[t.name] = rate
        if not alive:
            break
    steps = " ".join(f"{r:g}" for r in args.step_rates)
    print(
        f"\nHighest rate with zero errors (none late either), and highest with p99 <= "
        f"{args.slo_ms:g} ms at it and every rate below (steps {steps}/s, "
        f"{args.step_duration:g} s each):"
    )
    for t in targets:
        z, w = zero[t.name], within[t.name]
        print(
            f"  {t.name:<16} zero errors: {'none' if z is None else f'{z:g}/s':<8} "
            f"within p99: {'none' if w is None else f'{w:g}/s'}"
        )
    if zero[targets[0].name] != args.step_rates[-1]:
        print(
            "  (direct, the load generator alone, stopped there: rates above it measure this "
            "machine's load, not the proxies)"
        )
    print(f"rlproxy stored {stored()} calls durably during the run.")


def prev(rates: list[float], rate: float) -> float | None:
    """The rate stepped before `rate` (None for the first)."""
    i = rates.index(rate)
    return rates[i - 1] if i else None


def print_sequential(
    args: argparse.Namespace,
    targets: list[Target],
    seq: dict[str, Sequential],
    per_round: dict[str, list[float]],
    stored_now: int,
) -> None:
    direct = seq[targets[0].name]
    print(
        f"\nSequential, {args.rounds} interleaved rounds of {args.calls} non-streamed and "
        f"{max(1, args.calls // 2)} streamed calls per target (ms; + = minus direct):"
    )
    header = (
        f"{'target':<16} {'err':>4} {'p50':>6} {'p95':>6} {'+p50':>6} {'+p95':>6} "
        f"{'+p50 rounds':>16} {'ttfb p50':>8} {'+ttfb':>6} {'stream p50':>10} {'+stream':>7}"
    )
    print(header + "\n" + "-" * len(header))
    for t in targets:
        s = seq[t.name]
        rounds = per_round[t.name]
        spread = f"{min(rounds):.2f}..{max(rounds):.2f}" if t is not targets[0] else ""
        print(
            f"{t.name:<16} {s.errors:>4} {pct(s.total_ms, 50):>6.2f} {pct(s.total_ms, 95):>6.2f} "
            f"{pct(s.total_ms, 50) - pct(direct.total_ms, 50):>6.2f} "
            f"{pct(s.total_ms, 95) - pct(direct.total_ms, 95):>6.2f} {spread:>16} "
            f"{pct(s.ttfb_ms, 50):>8.2f} {pct(s.ttfb_ms, 50) - pct(direct.ttfb_ms, 50):>6.2f} "
            f"{pct(s.stream_total_ms, 50):>10.2f} "
            f"{pct(s.stream_total_ms, 50) - pct(direct.stream_total_ms, 50):>7.2f}"
        )
    names = [t.name for t in targets]
    if "litellm" in names and "rlproxy" in names:
        ratios = [
            b / a for a, b in zip(per_round["rlproxy"], per_round["litellm"], strict=True) if a > 0
        ]
        if ratios:
            print(
                "LiteLLM's added p50 / rlproxy's, per round: "
                f"median {statistics.median(ratios):.2f} "
                f"(min {min(ratios):.2f}, max {max(ratios):.2f})"
            )
    cpu = [
        f"{t.name} {1000 * seq[t.name].cpu_s / seq[t.name].calls:.2f}"
        for t in targets
        if t.pid is not None and seq[t.name].calls
    ]
    if cpu:
        print(f"server CPU ms per call (user + system, all its threads): {', '.join(cpu)}")
    print(f"stored calls so far: {stored_now}")


if __name__ == "__main__":
    sys.exit(main())
