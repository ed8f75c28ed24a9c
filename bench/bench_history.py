"""Per-call store cost as history grows: does recording a call get slower with every call stored?

    .venv/bin/python bench/bench_history.py [--calls 5000] [--block 500] [--postgres]

Records calls one at a time through `Store.record_call` (the write every chat call makes before
it is acknowledged), the way agents send them: most calls repeat one task (the same system
prompt and first user message, as an agent run many times on one task sends, which is what GRPO
groups are made of), some continue their run with a second turn, a few are new tasks. Prints,
per block of calls, the p50 and p95 of `record_call` and the trajectory rows the linking step
read per call (`Store.link_stats`), so growth shows as a drift down the table; the last line is
the ratio of the last block's p50 to the first's. A benchmark, not a test: read the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from storage import CallRecord, ChoiceRecord, Store  # noqa: E402

POSTGRES_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
TASK = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "What is 17 times 23?"},
]


def _call(messages: list[dict], answer: str) -> CallRecord:
    now = time.time()
    return CallRecord(
        id=uuid.uuid4().hex,
        created_at=now - 0.01,
        finished_at=now,
        model_requested="rlproxy",
        engine="local",
        request_messages=messages,
        choices=[ChoiceRecord(0, {"role": "assistant", "content": answer}, "stop", [1, 2], [0.0])],
        prompt_token_ids=[1, 2, 3],
    )


async def run(calls: int, block: int, url: str, schema: str | None) -> None:
    store = await Store.open(url, postgres_schema=schema)
    try:
        p50s: list[float] = []
        latencies: list[float] = []
        print(f"{'stored':>7} {'p50 ms':>8} {'p95 ms':>8} {'rows/call':>10}")
        last_rows, last_calls = 0, 0
        for i in range(calls):
            kind = i % 10
            if kind < 7:  # the same task again
                messages, answer = TASK, f"It is {391 + i % 3}."
            elif kind < 9:  # the run of the previous call goes on
                messages = [*TASK, {"role": "assistant", "content": f"It is {391 + (i - 1) % 3}."}]
                messages.append({"role": "user", "content": "Show your work."})
                answer = "17 * 23 = 391."
            else:  # a task nobody asked before
                messages, answer = [{"role": "user", "content": f"Task {uuid.uuid4().hex}"}], "ok"
            start = time.perf_counter()
            await store.record_call(_call(messages, answer))
            latencies.append(time.perf_counter() - start)
            if (i + 1) % block == 0:
                stats = store.link_stats
                per_call = (stats.rows - last_rows) / max(1, stats.calls - last_calls)
                last_rows, last_calls = stats.rows, stats.calls
                p50 = statistics.median(latencies) * 1000
                p95 = statistics.quantiles(latencies, n=20)[-1] * 1000
                print(f"{i + 1:>7} {p50:>8.2f} {p95:>8.2f} {per_call:>10.2f}")
                p50s.append(p50)
                latencies.clear()
        print(f"last block p50 / first block p50: {p50s[-1] / p50s[0]:.2f}")
    finally:
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--block", type=int, default=500)
    parser.add_argument("--postgres", action="store_true", help="the local Postgres, not SQLite")
    args = parser.parse_args()
    if args.postgres:
        import asyncpg

        schema = f"bench_{uuid.uuid4().hex[:12]}"

        async def create() -> None:
            conn = await asyncpg.connect("postgresql://postgres@127.0.0.1:5432/test")
            await conn.execute(f'CREATE SCHEMA "{schema}"')
            await conn.close()

        asyncio.run(create())
        try:
            asyncio.run(run(args.calls, args.block, POSTGRES_URL, schema))
        finally:

            async def drop() -> None:
                conn = await asyncpg.connect("postgresql://postgres@127.0.0.1:5432/test")
                await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
                await conn.close()

            asyncio.run(drop())
        return
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite+aiosqlite:///{Path(tmp) / 'rlproxy.db'}"
        asyncio.run(run(args.calls, args.block, url, None))


if __name__ == "__main__":
    main()
