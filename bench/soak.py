"""Soak: a real `rlproxy serve` under mixed traffic for N minutes, its memory watched.

Concurrent clients loop until the time is up, each request drawn at random (seeded) from a mix:
plain completions, streamed ones, tool calls, multi-turn episodes that end with a reward, a
sprinkle of hostile requests (bad JSON, odd numbers, lone surrogates, over-size bodies, forged
cursors, bad rewards) and reads of the /rl routes. The server process's resident memory is
sampled every few seconds from /proc. Prints start, end and peak RSS, the RSS slope over the
second half (a leak shows as a slope that does not flatten), requests by kind and status, and
p50/p95 latency; never asserts (shared machines are noisy: read the figures).

    .venv/bin/python bench/soak.py [--minutes 10] [--clients 4] [--sample-s 5]

The server runs serve-only (no trainer, scorer or publisher) unless `--train`; its data
directory is a fresh temporary folder, kept with `--keep` (the server log is there).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from servers import start_server  # noqa: E402

from proxy.engines.loader import ensure_fp32_cache  # noqa: E402

MODEL = "rlproxy"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "Write a haiku about rain.",
    "How many legs does a spider have?",
    "Give me a word that rhymes with moon.",
    "What is 12 times 3?",
]
FOLLOW_UPS = ["Are you sure?", "Say it in fewer words.", "Now in French."]
# The mix: kind -> weight.
MIX = {"plain": 40, "stream": 20, "tools": 12, "episode": 12, "hostile": 10, "read": 6}


def _chat_body(extra: str = "", messages: str = '[{"role": "user", "content": "Hi"}]') -> bytes:
    return f'{{"model": "rlproxy", "max_tokens": 4, "messages": {messages}{extra}}}'.encode()


_STOPS = ", ".join(f'"s{i}"' for i in range(100))
_OVER_LIMIT = b'{"model": "rlproxy", "messages": [{"role": "user", "content": "'
_OVER_LIMIT += b"x" * (9 * 2**20) + b'"}]}'
# (method, path, body): a few hostile requests (the full corpus is tests/fuzz/hostile.py).
HOSTILE = [
    ("POST", "/v1/chat/completions", b'{"model": "rlproxy", "messages": ['),
    ("POST", "/v1/chat/completions", _chat_body(', "temperature": 1e-45')),
    ("POST", "/v1/chat/completions", _chat_body(', "seed": 18446744073709551616')),
    ("POST", "/v1/chat/completions", _chat_body(', "n": 1000')),
    ("POST", "/v1/chat/completions", _chat_body(', "max_tokens": "5"')),
    ("POST", "/v1/chat/completions", _chat_body(', "stop": [' + _STOPS + "]")),
    (
        "POST",
        "/v1/chat/completions",
        _chat_body(', "metadata": ' + '{"a": ' * 10_000 + "1" + "}" * 10_000),
    ),
    (
        "POST",
        "/v1/chat/completions",
        _chat_body(messages='[{"role": "user", "content": "a\\ud800"}]'),
    ),
    ("POST", "/v1/chat/completions", _chat_body().replace(b"Hi", b"\xff\xfe")),
    ("POST", "/v1/chat/completions", _chat_body(', "junk": "' + "j" * 2_000_000 + '"')),
    ("POST", "/v1/chat/completions", _OVER_LIMIT),
    ("POST", "/v1/chat/completions", _chat_body(', "model": "rlproxy@' + "9" * 5000 + '"')),
    ("GET", "/rl/trajectories?cursor=" + "9" * 400, b""),
    ("GET", "/rl/groups?cursor=WzFlOTk5LCAieCJd", b""),
    ("POST", "/rl/trajectories/{completion}/reward", b'{"reward": NaN}'),
    ("POST", "/rl/trajectories/{completion}/reward", b'{"reward": 1e308}'),
    ("POST", "/rl/trajectories/{completion}/reward", b'{"reward": "high"}'),
]


@dataclass
class Tally:
    """Every request's (kind, status, seconds); a status is an HTTP code or an exception name."""

    rows: list[tuple[str, str, float]] = field(default_factory=list)

    def add(self, kind: str, status: int | str, seconds: float) -> None:
        self.rows.append((kind, str(status), seconds))


class Traffic:
    def __init__(self, url: str, seed: int, max_tokens: int, tally: Tally) -> None:
        self.url = url
        self.rng = random.Random(seed)
        self.max_tokens = max_tokens
        self.tally = tally
        self.last_completion = "chatcmpl-none"

    async def timed(
        self, http: httpx.AsyncClient, kind: str, method: str, path: str, **kw: Any
    ) -> httpx.Response | None:
        started = time.monotonic()
        try:
            if kw.pop("stream", False):
                async with http.stream(method, path, **kw) as response:
                    async for _ in response.aiter_lines():
                        pass
            else:
                response = await http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            self.tally.add(kind, type(exc).__name__, time.monotonic() - started)
            return None
        self.tally.add(kind, response.status_code, time.monotonic() - started)
        return response

    def chat(self, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        return {
            "model": MODEL,
            "messages": messages,
            "max_tokens": self.rng.randint(4, self.max_tokens),
            "temperature": 0.8,
            "seed": self.rng.randrange(2**31),
            **fields,
        }

    async def one(self, http: httpx.AsyncClient) -> None:
        kind = self.rng.choices(list(MIX), weights=list(MIX.values()))[0]
        question = [{"role": "user", "content": self.rng.choice(QUESTIONS)}]
        if kind == "plain":
            r = await self.timed(
                http, kind, "POST", "/v1/chat/completions", json=self.chat(question)
            )
            if r is not None and r.status_code == 200:
                self.last_completion = r.json()["id"]
        elif kind == "stream":
            body = self.chat(question, stream=True, stream_options={"include_usage": True})
            await self.timed(http, kind, "POST", "/v1/chat/completions", json=body, stream=True)
        elif kind == "tools":
            choice = self.rng.choice(["auto", "required"])
            ask = [{"role": "user", "content": "What is the weather in Paris?"}]
            body = self.chat(ask, tools=[WEATHER], tool_choice=choice)
            await self.timed(http, kind, "POST", "/v1/chat/completions", json=body)
        elif kind == "episode":
            await self.episode(http, question)
        elif kind == "hostile":
            method, path, content = self.rng.choice(HOSTILE)
            path = path.replace("{completion}", self.last_completion)
            headers = {"content-type": "application/json"}
            # Its own connection: after a 500 the server closes the one it answered on.
            async with httpx.AsyncClient(base_url=self.url, timeout=300) as own:
                await self.timed(own, kind, method, path, content=content, headers=headers)
        else:
            path = self.rng.choice(["/rl/trajectories?limit=20", "/rl/groups", "/v1/models"])
            await self.timed(http, kind, "GET", path)

    async def episode(self, http: httpx.AsyncClient, messages: list[dict[str, Any]]) -> None:
        """Two or three turns of one conversation, then a reward on its last completion."""
        last = None
        for turn in range(self.rng.randint(2, 3)):
            r = await self.timed(
                http, "episode", "POST", "/v1/chat/completions", json=self.chat(messages)
            )
            if r is None or r.status_code != 200:
                return
            answer = r.json()
            last = answer["id"]
            messages = [
                *messages,
                {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]},
            ]
        reward = {"reward": round(self.rng.random(), 3), "source": "soak"}
        await self.timed(http, "reward", "POST", f"/rl/trajectories/{last}/reward", json=reward)


async def client_loop(traffic: Traffic, url: str, deadline: float) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        while time.monotonic() < deadline:
            await traffic.one(http)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of `pid` so far (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


async def sample_rss(pid: int, every_s: float, samples: list[tuple[float, float]]) -> None:
    start = time.monotonic()
    while True:
        samples.append((time.monotonic() - start, rss_mb(pid)))
        await asyncio.sleep(every_s)


def slope_mb_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of RSS over time, MB per minute."""
    if len(samples) < 2:
        return 0.0
    ts = [t / 60 for t, _ in samples]
    ms = [m for _, m in samples]
    t_mean, m_mean = statistics.fmean(ts), statistics.fmean(ms)
    var = sum((t - t_mean) ** 2 for t in ts)
    return (
        sum((t - t_mean) * (m - m_mean) for t, m in zip(ts, ms, strict=True)) / var if var else 0.0
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def report(tally: Tally, samples: list[tuple[float, float]], minutes: float, log: Path) -> None:
    print(f"\n== soak: {minutes:g} min, {len(tally.rows)} requests ==")
    second_half = [s for s in samples if s[0] >= samples[-1][0] / 2]
    peak = max(samples, key=lambda s: s[1])
    print(
        f"RSS start {samples[0][1]:.0f} MB, end {samples[-1][1]:.0f} MB, "
        f"peak {peak[1]:.0f} MB at {peak[0] / 60:.1f} min ({len(samples)} samples)"
    )
    print(
        f"RSS slope: {slope_mb_per_min(samples):+.2f} MB/min overall, "
        f"{slope_mb_per_min(second_half):+.2f} MB/min over the second half"
    )
    minutes_seen = int(samples[-1][0] // 60)
    marks = [min(samples, key=lambda x: abs(x[0] - 60 * m)) for m in range(minutes_seen + 1)]
    print("RSS by minute: " + ", ".join(f"{t / 60:.0f}: {m:.0f}" for t, m in marks) + " MB")
    by_kind: dict[str, Counter[str]] = defaultdict(Counter)
    latency: dict[str, list[float]] = defaultdict(list)
    for kind, status, seconds in tally.rows:
        by_kind[kind][status] += 1
        if status.isdigit() and int(status) < 400:
            latency[kind].append(seconds)
    statuses = Counter(status for _, status, _ in tally.rows)
    print("status counts: " + ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items())))
    print(f"\n{'kind':<9} {'requests':>8} {'p50 s':>7} {'p95 s':>7}  statuses")
    for kind in sorted(by_kind):
        ok = latency.get(kind, [])
        p50 = f"{percentile(ok, 0.5):7.2f}" if ok else f"{'-':>7}"
        p95 = f"{percentile(ok, 0.95):7.2f}" if ok else f"{'-':>7}"
        codes = ", ".join(f"{s}: {n}" for s, n in sorted(by_kind[kind].items()))
        print(f"{kind:<9} {sum(by_kind[kind].values()):>8} {p50} {p95}  {codes}")
    served = [s for _, status, s in tally.rows if status.isdigit() and int(status) < 400]
    if served:
        print(
            f"{'all 2xx':<9} {len(served):>8} {percentile(served, 0.5):7.2f} "
            f"{percentile(served, 0.95):7.2f}"
        )
    text = log.read_text(errors="replace")
    print(
        f"\nserver log: {text.count('Traceback')} tracebacks, "
        f"{text.count('unhandled error')} unhandled errors ({log})"
    )


async def soak(url: str, pid: int, args: argparse.Namespace) -> tuple[Tally, list]:
    tally, samples = Tally(), []
    cpu_before, started = cpu_seconds(pid), time.monotonic()
    deadline = started + args.minutes * 60
    sampler = asyncio.create_task(sample_rss(pid, args.sample_s, samples))
    await asyncio.gather(
        *(
            client_loop(Traffic(url, args.seed + i, args.max_tokens, tally), url, deadline)
            for i in range(args.clients)
        )
    )
    sampler.cancel()
    samples.append((samples[-1][0] + args.sample_s, rss_mb(pid)))
    cpu, wall = cpu_seconds(pid) - cpu_before, time.monotonic() - started
    health = httpx.get(f"{url}/health", timeout=30).json()
    print(f"/health after: {health['status']}, engine {health['engine']}")
    print(
        f"server CPU {cpu:.0f} s in {wall:.0f} s ({cpu / wall:.2f} of {os.cpu_count()} cores); "
        f"machine load average {os.getloadavg()[0]:.1f} at the end (others' work included)"
    )
    return tally, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", action="store_true", help="trainer, scorer and publisher on")
    parser.add_argument("--keep", action="store_true", help="keep the data directory")
    args = parser.parse_args()

    model_dir = REPO / "rlproxy-data"
    ensure_fp32_cache(model_dir)
    data_dir = Path(tempfile.mkdtemp(prefix="rlproxy-soak-"))
    env = {"RLPROXY_TRAIN": "true", "RLPROXY_SCORING": "true", "RLPROXY_PUBLISH_ADAPTERS": "true"}
    proc, url = start_server(data_dir, model_dir, env if args.train else None)
    print(
        f"server pid {proc.pid} at {url}, data {data_dir}; {args.clients} clients, "
        f"{args.minutes:g} min, mix {MIX}"
    )
    try:
        tally, samples = asyncio.run(soak(url, proc.pid, args))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    report(tally, samples, args.minutes, data_dir / "server.log")
    if not args.keep:
        shutil.rmtree(data_dir)


if __name__ == "__main__":
    main()
