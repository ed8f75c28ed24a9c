"""The per-caller rate shared through Redis: a real Redis server (127.0.0.1:6379 here and in CI,
or RLPROXY_TEST_REDIS_URL), two buckets standing for two replicas, and a Redis server of the
test's own (`redis-server` on a free port) that is stopped under it to see the fallback.

Every test counts callers of its own (a fresh uuid), so runs and other suites on the same server
never share a bucket. Time is the test's fake clock, passed to the script in place of Redis's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
import pytest_asyncio
from redis.asyncio import Redis

from proxy.api.auth import Principal
from proxy.api.limits import CallerLimitsMiddleware, TokenBucket
from proxy.api.redis_limits import KEY_PREFIX, RedisTokenBucket
from tests.e2e.conftest import free_port
from tests.proxy.test_limits import FakeClock, Reply, assert_openai_429, call
from tests.redis_server import redis_server

REDIS_URL = os.environ.get("RLPROXY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest_asyncio.fixture(loop_scope="function")
async def buckets() -> AsyncIterator[Any]:
    """`make(per_minute, **kw)` -> a RedisTokenBucket on the shared server, closed afterwards."""
    made: list[RedisTokenBucket] = []

    def make(per_minute: int, url: str = REDIS_URL, **kwargs: Any) -> RedisTokenBucket:
        bucket = RedisTokenBucket(url, per_minute, **kwargs)
        made.append(bucket)
        return bucket

    yield make
    for bucket in made:
        await bucket.aclose()


def caller() -> str:
    return f"key:test-{uuid.uuid4().hex}"


async def test_two_replicas_spend_one_bucket(buckets: Any) -> None:
    clock = FakeClock()
    a, b = buckets(4, clock=clock), buckets(4, clock=clock)
    who = caller()
    assert [await a.acquire(who), await b.acquire(who), await a.acquire(who)] == [0.0] * 3
    assert await b.acquire(who) == 0.0
    assert await a.acquire(who) == pytest.approx(15.0)  # empty: 4 a minute, one per 15 s
    assert await b.acquire(who) == pytest.approx(15.0)  # the other replica sees it empty too
    clock.now += 15.0
    assert await b.acquire(who) == 0.0
    assert await a.acquire(who) > 0
    assert await a.acquire(caller()) == 0.0  # another caller has its own bucket


async def test_the_shared_bucket_answers_as_the_in_process_one(buckets: Any) -> None:
    """The same takes at the same times get the same waits from the script and from
    `TokenBucket` (bursts, refusals that spend nothing, partial refills)."""
    clock = FakeClock()
    shared, local = buckets(6, clock=clock), TokenBucket(6, clock)
    who = caller()
    steps = [0.0] * 8 + [3.0, 0.5, 0.0, 10.0, 0.0, 0.0, 30.0] + [0.0] * 5 + [120.0, 0.0]
    for dt in steps:
        clock.now += dt
        assert await shared.acquire(who) == pytest.approx(local.take(who), abs=1e-6)


async def test_a_bucket_expires_once_it_would_be_full_again(buckets: Any) -> None:
    bucket = buckets(60, clock=FakeClock())
    who = caller()
    await bucket.acquire(who)
    async with Redis.from_url(REDIS_URL) as redis:
        ttl_ms = await redis.pttl(KEY_PREFIX + who)
    assert 0 < ttl_ms <= 60_000  # 60 a minute: full again after a minute at most


async def test_redis_time_is_the_clock_when_none_is_given(buckets: Any) -> None:
    a, b = buckets(2), buckets(2)  # Redis's own clock, one for both replicas
    who = caller()
    assert [await a.acquire(who), await b.acquire(who)] == [0.0, 0.0]
    wait = await a.acquire(who)
    assert 29.0 < wait <= 30.0  # 2 a minute: the next token within 30 s of Redis's time


async def test_two_middlewares_sharing_redis_refuse_a_caller_over_its_rate(buckets: Any) -> None:
    clock = FakeClock()
    replicas = [
        CallerLimitsMiddleware(
            Reply(), per_minute=3, concurrency=0, rate=buckets(3, clock=clock), clock=clock
        )
        for _ in range(2)
    ]
    key = Principal(f"test-{uuid.uuid4().hex}", "inference")
    statuses = [(await call(replicas[i % 2], principal=key))[0] for i in range(3)]
    assert statuses == [200, 200, 200]  # a minute's worth, wherever the balancer sent them
    for replica in replicas:
        status, headers, body = await call(replica, principal=key)
        assert_openai_429(status, headers, body, "rate_limit_exceeded")
        assert headers["retry-after"] == "20"


# ----------------------------------------------------------------------------- Redis fails


@pytest.fixture
def own_redis() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    with redis_server() as running:
        yield running


async def test_while_redis_is_down_each_replica_counts_its_own_and_says_so(
    buckets: Any, own_redis: tuple[str, subprocess.Popen[bytes]], caplog: Any
) -> None:
    url, proc = own_redis
    errors: list[int] = []
    clock = FakeClock()
    a = buckets(2, url=url, clock=clock, retry_s=0.0, on_error=lambda: errors.append(1))
    b = buckets(2, url=url, clock=clock, retry_s=0.0)
    who = caller()
    assert [await a.acquire(who), await b.acquire(who)] == [0.0, 0.0]
    assert await a.acquire(who) > 0  # shared: spent by both

    proc.kill()
    proc.wait()
    with caplog.at_level(logging.WARNING, logger="proxy.api.redis_limits"):
        # Fail open to this replica's own bucket: its own minute's worth, then refusals.
        assert [await a.acquire(who), await a.acquire(who)] == [0.0, 0.0]
        assert await a.acquire(who) > 0
    assert len(errors) == 3  # every request that could not reach Redis is counted
    warnings = [r for r in caplog.records if "Redis failed" in r.getMessage()]
    assert len(warnings) == 1  # once per outage, not once per request


async def test_an_unreachable_redis_never_refuses_nor_fails_a_request(buckets: Any) -> None:
    """Nothing listens on the port: the middleware serves from its own bucket."""
    errors: list[int] = []
    rate = buckets(100, url=f"redis://127.0.0.1:{free_port()}/0", on_error=lambda: errors.append(1))
    limited = CallerLimitsMiddleware(Reply(), per_minute=100, concurrency=0, rate=rate)
    key = Principal(f"test-{uuid.uuid4().hex}", "inference")
    assert [(await call(limited, principal=key))[0] for _ in range(20)] == [200] * 20
    assert len(errors) == 1  # tried once, then not again for retry_s (5 s)


@pytest_asyncio.fixture(loop_scope="function")
async def silent_redis() -> AsyncIterator[tuple[str, list[int]]]:
    """A port that accepts connections and never answers (a hung Redis, a half-dead route):
    its URL and the number of connections it took, one per request that went to it and waited
    for the timeout (each timed-out connection is dropped, never reused)."""
    taken: list[int] = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        taken.append(1)
        await reader.read()  # until the client gives up
        writer.close()

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"redis://127.0.0.1:{port}/0", taken
    finally:
        server.close()


def _together(n: int, acquire: Callable[[], Awaitable[float]]) -> Awaitable[list[float]]:
    return asyncio.gather(*(acquire() for _ in range(n)))


async def test_while_redis_hangs_one_request_at_a_time_waits_for_it(
    buckets: Any, silent_redis: tuple[str, list[int]]
) -> None:
    """Redis takes connections but never answers. The first request waits for the timeout and
    finds it down; from then on, each time it is due to be tried again, one request probes it
    while those arriving meanwhile count on this replica's bucket without waiting."""
    url, taken = silent_redis
    errors: list[int] = []
    rate = buckets(
        100, url=url, timeout_s=0.2, retry_s=0.0, on_error=lambda: errors.append(1)
    )  # retry_s 0: due to be tried again at once, by every request that comes
    who = caller()
    assert await rate.acquire(who) == 0.0  # waited, then its own bucket
    assert len(taken) == 1
    for round_ in range(2):
        waits = await _together(20, lambda: rate.acquire(who))
        assert waits == [0.0] * 20  # every one served (100 a minute here)
        assert len(taken) == 2 + round_  # one probe each time, not 20
    assert len(errors) == len(taken)


async def test_requests_held_up_by_a_hung_redis_are_bounded_by_the_pool(
    buckets: Any, silent_redis: tuple[str, list[int]]
) -> None:
    """Before the first timeout nothing says Redis hangs: requests go to it together, but at
    most `max_connections` of them wait on it; the others count on this replica's bucket at
    once (the pool is full) rather than open a connection each."""
    url, taken = silent_redis
    rate = buckets(100, url=url, timeout_s=0.2, retry_s=60.0, max_connections=4)
    who = caller()
    assert await _together(30, lambda: rate.acquire(who)) == [0.0] * 30
    assert len(taken) == 4
