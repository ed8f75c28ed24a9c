"""The per-caller request rate shared by every replica: one token bucket per caller in Redis.

    RedisTokenBucket    `proxy.api.limits.RateLimiter` over Redis; this replica's own
                        `TokenBucket` while Redis cannot be reached

Each replica that names the same Redis server (RLPROXY_REDIS_URL) takes its callers' tokens
from the same buckets, so a caller's rate holds across replicas, wherever the balancer sends
its requests. Concurrency caps are not shared: each replica counts its own in-flight requests.

Why a token bucket in a Lua script: one script call reads, refills, spends and writes a bucket
atomically on the server (no race between two replicas reading the same count), in one round
trip, with the same semantics as the in-process bucket (a minute's worth as a burst, a
continuous refill). A fixed window (INCR + EXPIRE) is simpler but lets a caller send twice its
budget across a window's edge; a sliding log costs memory per request. A bucket is a hash of two
numbers that expires once it would be full again, so memory is bounded by the callers seen in
the last minute, as in-process. The time is Redis's own clock (`TIME`), one clock for every
replica; tests pass their own.

When Redis fails (down, unreachable, too slow: 0.5 s): fail open to per-replica limits. The
request is counted by this replica's own bucket instead, and so are the next ones until Redis is
tried again `retry_s` after the failure. Then one request probes it (a flag: one probe in
flight) while the others go on counting locally without waiting, until the probe's answer says
Redis is back. So while Redis is known to be down, at most one request per replica per
`retry_s` waits for the timeout. Before the first timeout nothing says Redis is down: the
requests already waiting on it wait too, at most `max_connections` of them (the connection pool
is bounded; a request that finds every connection busy is counted locally at once, without
marking Redis down, as a burst on a healthy Redis can fill the pool for a moment). A warning is
logged once per outage and `rlproxy_caller_limit_redis_errors_total` counts each request Redis
did not count (failed, timed out, or no free connection). So a caller may get up to N times its
rate across N replicas while Redis is down, never unlimited, and never refused because Redis is.
Failing closed would turn a Redis outage into a full serving outage for a limit that is about
fairness, not security.

Needs Redis 5 or newer: the script reads `TIME` and then writes, which older servers refuse
(they replicate scripts verbatim, so a non-deterministic read must not precede a write).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import MaxConnectionsError, RedisError

from proxy.api.limits import TokenBucket

logger = logging.getLogger(__name__)

KEY_PREFIX = "rlproxy:rate:"

MAX_CONNECTIONS = 64
"""Connections a replica opens to Redis at most: a script call takes well under a millisecond,
so this many busy at once means Redis is slow or hung, not a busy replica."""

# KEYS[1]: the caller's bucket, a hash {tokens, ts (ms)}. ARGV: capacity, tokens per ms, and the
# time in ms ("" for Redis's clock). Returns the ms until a token is there ("0": one was spent).
TAKE = """
local capacity = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local now = tonumber(ARGV[3])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
end
local bucket = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(bucket[1]) or capacity
local ts = tonumber(bucket[2]) or now
tokens = math.min(capacity, tokens + math.max(0, now - ts) * rate)
local wait = 0
if tokens < 1 then
  wait = (1 - tokens) / rate
else
  tokens = tokens - 1
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.17g', tokens), 'ts',
  string.format('%.17g', now))
redis.call('PEXPIRE', KEYS[1], math.ceil(capacity / rate))
return string.format('%.17g', wait)
"""


class RedisTokenBucket:
    """`per_minute` requests per caller, counted in Redis for every replica that shares it."""

    def __init__(
        self,
        url: str,
        per_minute: int,
        *,
        timeout_s: float = 0.5,
        retry_s: float = 5.0,
        max_connections: int = MAX_CONNECTIONS,
        on_error: Callable[[], None] = lambda: None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if per_minute < 1:
            raise ValueError(f"per_minute must be at least 1, not {per_minute}")
        self.per_minute = per_minute
        self.capacity = float(per_minute)
        self.rate_per_ms = per_minute / 60_000.0
        self.retry_s = retry_s
        self.on_error = on_error
        self.clock = clock  # None: Redis's clock
        self.local = TokenBucket(per_minute, clock or time.monotonic)
        # Fail fast: no retries, short timeouts (a request waits at most `timeout_s` on Redis).
        self.redis = Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            max_connections=max_connections,  # full: MaxConnectionsError at once, no waiting
        )
        self._take = self.redis.register_script(TAKE)
        self._down = False  # Redis failed last time: this replica's own bucket until retried
        self._down_until = 0.0  # when Redis is due to be tried again
        self._probing = False  # a request is trying the down Redis now: the others do not

    async def acquire(self, caller: str) -> float:
        if self._down and (self._probing or time.monotonic() < self._down_until):
            return self.local.take(caller)
        probe = self._down
        if probe:
            self._probing = True  # set before the first await: the requests after see it
        now = "" if self.clock is None else repr(self.clock() * 1000.0)
        try:
            reply = await self._take(
                keys=[KEY_PREFIX + caller], args=[self.capacity, repr(self.rate_per_ms), now]
            )
        except MaxConnectionsError:
            # Every connection is waiting on Redis: count this one here rather than open more.
            # Not a verdict on Redis (a burst can fill the pool): the waiting ones give that.
            self.on_error()
            return self.local.take(caller)
        except (RedisError, OSError) as exc:
            self.on_error()
            self._down_until = time.monotonic() + self.retry_s
            if not self._down:
                self._down = True
                logger.warning(
                    "the shared rate limit's Redis failed (%s: %s): each replica counts its own "
                    "callers until it answers again (tried every %.0f s)",
                    type(exc).__name__,
                    exc,
                    self.retry_s,
                )
            return self.local.take(caller)
        finally:
            if probe:
                self._probing = False
        if self._down:
            self._down = False
            logger.warning("the shared rate limit's Redis answers again: rates are shared")
        return float(reply) / 1000.0

    async def aclose(self) -> None:
        await self.redis.aclose()
