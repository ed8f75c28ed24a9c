"""The HTTP client side both engines that call another server share (`proxy.engines.openai_compat`,
`proxy.engines.vllm`): one pooled aiohttp session each, reading a streamed body line by line, and
ending it so its connection can be reused.

httpx and aiohttp give a connection back to their pool only when the response was read to its
end; closing one before (say, right after an SSE stream's `data: [DONE]`) closes the connection,
and the next request pays a new one before its first byte. Both engines that read SSE streams
from another server (`proxy.engines.openai_compat`, `proxy.engines.vllm`) read on past `[DONE]`
with `drain`. `lines_of` splits raw body pieces into lines as SSE defines them; `json_bytes` is
the request body both send; `PooledSession` is the session, `TRANSPORT_ERRORS` what it raises
when the server cannot be reached, breaks off or a read times out.

aiohttp, not httpx: a proxy pays its client on every call, and aiohttp's costs about a third of
httpx's CPU per call (the figures: docs/benchmarks/overhead.md, `bench/bench_overhead.py`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

DRAIN_S = 1.0
DRAIN_BYTES = 64 * 1024

TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError)
"""The server could not be reached, broke the connection, or a read timed out."""


class PooledSession:
    """One aiohttp session, made on first use (it belongs to the running event loop) and again
    if it was closed; up to `limit` connections kept open, so a burst of concurrent calls reuses
    them. Call it for the session; `close` it when done."""

    def __init__(self, timeout: aiohttp.ClientTimeout, limit: int) -> None:
        self.timeout = timeout
        self.limit = limit
        self._session: aiohttp.ClientSession | None = None

    def __call__(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self.limit, limit_per_host=0, keepalive_timeout=30
            )
            self._session = aiohttp.ClientSession(connector=connector, timeout=self.timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


async def lines_of(pieces: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of a body that arrives in `pieces` of any size, without their ends (CRLF, LF
    or a lone CR: https://html.spec.whatwg.org/multipage/server-sent-events.html), as UTF-8
    text; a last line without an end is a line too. No length limit per line (an event may be
    one large JSON object)."""
    rest = b""
    async for piece in pieces:
        rest += piece
        parts = rest.splitlines(keepends=True)  # bytes split on CR, LF and CRLF only
        # A last part that ends in LF is whole; in a lone CR it may be the first half of CRLF.
        rest = parts.pop() if parts and not parts[-1].endswith(b"\n") else b""
        for part in parts:
            yield part.rstrip(b"\r\n").decode("utf-8", "replace")
    if rest:
        yield rest.rstrip(b"\r\n").decode("utf-8", "replace")


async def drain(lines: AsyncIterator[str]) -> None:
    """Read what follows `[DONE]` (normally nothing but the end of the body). A server that
    sends more than `DRAIN_BYTES`, or is slower than `DRAIN_S` to end the body, loses its
    connection instead (the caller closes the response)."""
    seen = 0
    try:
        async with asyncio.timeout(DRAIN_S):
            async for line in lines:
                seen += len(line) + 1
                if seen > DRAIN_BYTES:
                    return
    except TimeoutError:
        return


def json_bytes(payload: Any) -> bytes:
    """A request body: compact JSON, UTF-8 (non-ASCII text as itself, not as escapes)."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
