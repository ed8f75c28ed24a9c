"""What one replica's coordination poll costs the database (several replicas on one database).

    .venv/bin/python bench/bench_coordination.py [--polls 300] [--replicas 4]

On each publisher poll (`RLPROXY_ADAPTER_POLL_S`) a replica renews its publisher lease (one
write), reads the policy's state (one read) and writes its heartbeat (one write); the trainer
supervisor renews the trainer lease every third of `RLPROXY_LEASE_S`; on a shared vLLM an
eviction also reads the live replicas. This runs those operations through `Store` for
`--replicas` stores (one per replica) on SQLite and on Postgres (127.0.0.1:5432, a fresh
schema), polls in turn as the replicas would, and prints the p50 / p95 of each operation and of
one whole poll. A benchmark, not a test: read the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from storage import Store  # noqa: E402

POSTGRES_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/test"


async def _timed(out: dict[str, list[float]], name: str, op: Awaitable[Any]) -> None:
    t = time.perf_counter()
    await op
    out.setdefault(name, []).append(time.perf_counter() - t)


async def run(url: str, replicas: int, polls: int, schema: str | None) -> dict[str, list[float]]:
    kwargs: dict[str, Any] = {"postgres_schema": schema} if schema else {}
    stores = [await Store.open(url, **kwargs) for _ in range(replicas)]
    out: dict[str, list[float]] = {}
    try:
        await stores[0].set_policy_state("rlproxy", active_version=3)
        for i in range(polls):
            s = stores[i % replicas]
            rid = f"r{i % replicas}"
            t = time.perf_counter()
            await _timed(out, "publisher lease", s.acquire_lease("publisher:p", rid, 15))
            await _timed(out, "policy state read", s.get_policy_state("rlproxy"))
            await _timed(out, "heartbeat", s.heartbeat_replica(rid, "rlproxy", [1, 2, 3]))
            out.setdefault("whole poll", []).append(time.perf_counter() - t)
            await _timed(out, "trainer lease", s.acquire_lease("trainer:p", rid, 15))
            await _timed(out, "live replicas read", s.live_replicas("rlproxy", time.time() - 15))
    finally:
        for s in stores:
            await s.close()
    return out


async def postgres_schema(create: bool, name: str) -> None:
    import asyncpg

    conn = await asyncpg.connect("postgresql://postgres@127.0.0.1:5432/test")
    try:
        sql = f'CREATE SCHEMA "{name}"' if create else f'DROP SCHEMA IF EXISTS "{name}" CASCADE'
        await conn.execute(sql)
    finally:
        await conn.close()


def report(backend: str, out: dict[str, list[float]]) -> None:
    print(f"\n{backend}")
    print(f"  {'operation':<22}{'n':>6}{'p50 ms':>10}{'p95 ms':>10}")
    for name, samples in out.items():
        s = sorted(samples)
        p50 = statistics.median(s) * 1000
        p95 = s[int(0.95 * (len(s) - 1))] * 1000
        print(f"  {name:<22}{len(s):>6}{p50:>10.2f}{p95:>10.2f}")


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--polls", type=int, default=300)
    parser.add_argument("--replicas", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite+aiosqlite:///{Path(tmp) / 'rlproxy.db'}"
        report("SQLite (one file, WAL)", await run(url, args.replicas, args.polls, None))
    schema = f"bench_{uuid.uuid4().hex[:12]}"
    await postgres_schema(True, schema)
    try:
        out = await run(POSTGRES_URL, args.replicas, args.polls, schema)
        report("Postgres (127.0.0.1)", out)
    finally:
        await postgres_schema(False, schema)
    print(
        f"\n{args.replicas} stores polling in turn; a replica polls every RLPROXY_ADAPTER_POLL_S "
        "(2 s by default): three of these operations per poll."
    )


if __name__ == "__main__":
    asyncio.run(main())
