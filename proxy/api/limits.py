"""Per-caller limits at the HTTP edge: a request rate and a concurrency cap, each refused with
OpenAI's 429 (`proxy.api.errors.RateLimitError`, with `retry-after`).

    CallerLimitsMiddleware    pure ASGI, registered inside the auth middleware (it needs the caller)
    TokenBucket               requests per minute per caller, on an injectable clock

Who the caller is: the API key of `scope["state"]["principal"]` (set by `proxy.api.auth`), else
the client's address (open mode). Behind a reverse proxy on this machine, uvicorn takes that
address from `X-Forwarded-For` (it trusts proxy headers from 127.0.0.1 by default).

What is limited: every request under `/v1/` (chat completions and any later generation route;
the model list is cheap and shares the budget). `/health` and the `/rl` routes are not: an
environment posting rewards must not be refused because its rollouts were busy.

A refused request has cost nothing: no body read, no engine work. A concurrency slot is held
until the response is completely sent, a streamed body included, or the client is gone.

The rate is a token bucket per caller that holds a minute's worth of requests (a burst of
rollouts may spend it at once) and refills at `per_minute / 60` per second. A bucket idle for a
minute is full, the same as a new one, so such buckets are forgotten: memory is bounded by the
callers seen within the last minute.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.api.auth import PRINCIPAL_KEY, Principal
from proxy.api.errors import RateLimitError

LIMITED_PREFIX = "/v1/"


class TokenBucket:
    """`per_minute` requests per caller: a bucket of that many tokens, refilled continuously."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        if per_minute < 1:
            raise ValueError(f"per_minute must be at least 1, not {per_minute}")
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
    `concurrency` requests in flight (0 turns either limit off)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        per_minute: int,
        concurrency: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.per_minute = per_minute
        self.concurrency = concurrency
        self.bucket = TokenBucket(per_minute, clock) if per_minute else None
        self.in_flight: Counter[str] = Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(LIMITED_PREFIX):
            await self.app(scope, receive, send)
            return
        caller = caller_of(scope)
        refusal = self._refusal(caller)
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

    def _refusal(self, caller: str) -> RateLimitError | None:
        # The concurrency cap first: a request it refuses does not spend a token.
        if self.concurrency and self.in_flight[caller] >= self.concurrency:
            return RateLimitError(
                f"Too many requests in flight: this caller has {self.in_flight[caller]} running, "
                f"the limit is {self.concurrency} (RLPROXY_CALLER_CONCURRENCY). Wait for one to "
                "finish.",
                retry_after_s=1,
            )
        wait = self.bucket.take(caller) if self.bucket is not None else 0.0
        if wait:
            return RateLimitError(
                f"Rate limit reached for requests per minute: the limit is {self.per_minute} per "
                f"caller (RLPROXY_CALLER_REQUESTS_PER_MINUTE). Please try again in {wait:.1f}s.",
                retry_after_s=wait,
            )
        return None


def caller_of(scope: Scope) -> str:
    """The caller a request is counted against: its API key, else its client address."""
    state: dict[str, Any] = scope.get("state") or {}
    principal = state.get(PRINCIPAL_KEY)
    if isinstance(principal, Principal) and principal.key_id is not None:
        return f"key:{principal.key_id}"
    client = scope.get("client")
    return f"host:{client[0]}" if client else "host:unknown"
