"""Ending a streamed HTTP response so that its connection can be used again.

httpx gives a connection back to its pool only when the response was read to its end; closing
one before (say, right after an SSE stream's `data: [DONE]`) closes the connection, and the next
request pays a new one before its first byte. Both engines that read SSE streams from another
server (`proxy.engines.openai_compat`, `proxy.engines.vllm`) read on past `[DONE]` with this.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

DRAIN_S = 1.0
DRAIN_BYTES = 64 * 1024


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
