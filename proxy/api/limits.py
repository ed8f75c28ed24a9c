"""Per-caller limits at the HTTP edge: a request rate and a concurrency cap, each refused with
OpenAI's 429 (`proxy.errors.RateLimitError`, with `retry-after`).

    CallerLimitsMiddleware    pure ASGI, registered inside the auth middleware (it needs the caller)
    TokenBucket               requests per minute per caller in this process, on an injectable clock
    RateLimiter               what the middleware asks for a token: a TokenBucket, or the bucket
                              every replica shares through Redis (`proxy.api.redis_limits`)

Who the caller is: the API key of `scope["state"]["principal"]` (set by `proxy.api.auth`).
A request without a key (open mode: the server has no keys) is not limited, unless address
limits are on (RLPROXY_CALLER_ADDRESS_LIMITS): then it counts against the client's address.
Why not by address by default: with no keys there is no caller to be fair between. The client
is usually one batch of rollouts on loopback or behind one NAT or balancer address, and a
minute's budget by address refused a plain sequential run of 2,100 calls. What protects the
server from too much work is the engine's queue bound (RLPROXY_MAX_QUEUED_ROWS), which is
about capacity, not about callers.

What is limited: every request under `/v1/` (chat completions and any later generation route;
the model list is cheap and shares the budget). `/health` and the `/rl` routes are not: an
environment posting rewards must not be refused because its rollouts were busy.

A refused request has cost nothing: no body read, no engine work. A concurrency slot is held
until the response is completely sent, a streamed body included, or the client is gone. Slots
are counted by each replica on its own (a caller's cap is per replica); the rate is shared by
every replica when they share a Redis server.

The rate is a token bucket per caller that holds a minute's worth of requests (a burst of
rollouts may spend it at once) and refills at `per_minute / 60` per second. A bucket idle for a
minute is full, the same as a new one, so such buckets are forgotten: memory is bounded by the
callers seen within the last minute.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.api.auth import PRINCIPAL_KEY, Principal
from proxy.errors import RateLimitError

LIMITED_PREFIX = "/v1/"


class RateLimiter(Protocol):
    per_minute: int

    async def acquire(self, caller: str) -> float:
        """Spend one of `caller`'s tokens: 0.0 if there was one, else the seconds until there
        is (nothing is spent then)."""
        ...


class TokenBucket:
    """`per_minute` requests per caller: a bucket of that many tokens, refilled continuously."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        if per_minute < 1:
            raise ValueError(f"per_minute must be at least 1, not {per_minute}")
        self.per_minute = per_minute
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0  # tokens per second
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # caller -> (tokens, when)
        self._swept = clock()

    def take(self, caller: str) -> float:
        """Spend one of `caller`'s tokens: 0.0 if there was one, else the seconds until there is
        (nothing is spent then)."""
        now = self.clock()
        self._sweep(now)
        tokens, when = self._buckets.get(caller, (self.capacity, now))
        tokens = min(self.capacity, tokens + (now - when) * self.rate)
        if tokens < 1.0:
            self._buckets[caller] = (tokens, now)
            return (1.0 - tokens) / self.rate
        self._buckets[caller] = (tokens - 1.0, now)
        return 0.0

    async def acquire(self, caller: str) -> float:
        return self.take(caller)

    def __len__(self) -> int:
        """Callers with a bucket that is not known to be full."""
        return len(self._buckets)

    def _sweep(self, now: float) -> None:
        """Forget the buckets that have refilled (idle for `capacity / rate` seconds), at most
        once per that period."""
        refill_s = self.capacity / self.rate
        if now - self._swept < refill_s:
            return
        self._swept = now
        self._buckets = {c: b for c, b in self._buckets.items() if now - b[1] < refill_s}


class CallerLimitsMiddleware:
    """Refuse a caller's request to `/v1/*` with a 429 when it is over its rate or has
    `concurrency` requests in flight (0 turns either limit off). `rate` replaces this process's
    own bucket (the one Redis shares between replicas); `by_address` limits requests without a
    key by their client address."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        per_minute: int,
        concurrency: int,
        by_address: bool = False,
        rate: RateLimiter | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.per_minute = per_minute
        self.concurrency = concurrency
        self.by_address = by_address
        self.rate: RateLimiter | None = rate
        if rate is None and per_minute:
            self.rate = TokenBucket(per_minute, clock)
        self.in_flight: Counter[str] = Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(LIMITED_PREFIX):
            await self.app(scope, receive, send)
            return
        caller = caller_of(scope, by_address=self.by_address)
        if caller is None:
            await self.app(scope, receive, send)
            return
        refusal = await self._refusal(caller)
        if refusal is not None:
            response = JSONResponse(
                refusal.body(), status_code=refusal.status_code, headers=refusal.headers
            )
            await response(scope, receive, send)
            return
        self.in_flight[caller] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight[caller] -= 1
            if self.in_flight[caller] <= 0:
                del self.in_flight[caller]

    async def _refusal(self, caller: str) -> RateLimitError | None:
        # The concurrency cap first: a request it refuses does not spend a token.
        if self.concurrency and self.in_flight[caller] >= self.concurrency:
            return RateLimitError(
                f"Too many requests in flight: this caller has {self.in_flight[caller]} running, "
                f"the limit is {self.concurrency} (RLPROXY_CALLER_CONCURRENCY). Wait for one to "
                "finish.",
                retry_after_s=1,
            )
        wait = await self.rate.acquire(caller) if self.rate is not None else 0.0
        if wait:
            return RateLimitError(
                f"Rate limit reached for requests per minute: the limit is {self.per_minute} per "
                f"caller (RLPROXY_CALLER_REQUESTS_PER_MINUTE). Please try again in {wait:.1f}s.",
                retry_after_s=wait,
            )
        return None


def caller_of(scope: Scope, *, by_address: bool = False) -> str | None:
    """The caller a request is counted against: its API key; without one, its client address
    when `by_address`, else nobody (None: not limited)."""
    state: dict[str, Any] = scope.get("state") or {}
    principal = state.get(PRINCIPAL_KEY)
    if isinstance(principal, Principal) and principal.key_id is not None:
        return f"key:{principal.key_id}"
    if not by_address:
        return None
    client = scope.get("client")
    return f"host:{client[0]}" if client else "host:unknown"
