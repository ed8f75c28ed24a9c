"""Group commit: one writer task turns many concurrent writes into few transactions.

Callers submit a payload with its handler and await the result. The writer task takes
everything queued, runs all of it in one transaction, commits once, and only then resolves every
waiter, so a result always means "committed". Consecutive payloads of the same handler are given
to it together (`handler(conn, payloads) -> results`, one result per payload, in order), so a
handler can write a whole batch in a few statements. If a batch fails, its payloads are rerun
one per transaction, so one bad payload cannot fail its neighbours; its own error reaches its
waiter as the exception. Deadlocks and serialisation failures (Postgres) are retried.

A waiter that is cancelled (its client went away) does not cancel its write: it still
happens. This module knows nothing about calls or trajectories.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from storage.errors import StoreClosed

log = logging.getLogger(__name__)

Handler = Callable[[AsyncConnection, list[Any]], Awaitable[list[Any]]]
"""Writes a list of payloads inside the batch transaction; returns one result per payload."""

_TRANSIENT_SQLSTATES = {"40001", "40P01"}  # serialization_failure, deadlock_detected
_TRANSIENT_ATTEMPTS = 5


@dataclass
class WriterStats:
    jobs: int = 0
    """Payloads written (or failed) so far."""
    commits: int = 0
    """Transactions committed."""
    batches: int = 0
    """Batches taken off the queue (a failed batch is rerun one payload at a time)."""
    largest_batch: int = 0
    failed_batches: int = 0


@dataclass
class _Item:
    handler: Handler
    payload: Any
    future: asyncio.Future[Any]


def _is_transient(e: DBAPIError) -> bool:
    """Postgres deadlock/serialisation failures, and SQLite still busy after busy_timeout.

    SQLite write transactions begin with BEGIN IMMEDIATE, so "database is locked" can only come
    from that BEGIN, before anything was written: rerunning the batch is safe.
    """
    orig = e.orig
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    return code in _TRANSIENT_SQLSTATES or "database is locked" in str(orig)


class GroupCommitWriter:
    def __init__(self, engine: AsyncEngine, *, max_batch: int = 500) -> None:
        self._engine = engine
        self._max_batch = max_batch
        self._queue: asyncio.Queue[_Item | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.stats = WriterStats()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="rlproxy-store-writer")

    async def submit(self, handler: Handler, payload: Any) -> Any:
        """Write `payload` in the next batch; return its result once the batch has committed."""
        if self._closed:
            raise StoreClosed("the store is closed")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Item(handler, payload, future))
        # shield: cancelling the waiter must not cancel (or lose) the write.
        return await asyncio.shield(future)

    async def close(self) -> None:
        """Write everything already submitted, then stop the writer task."""
        if self._closed:
            return
        self._closed = True
        self._queue.put_nowait(None)
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        stop = False
        while not stop:
            first = await self._queue.get()
            if first is None:
                break
            batch = [first]
            while len(batch) < self._max_batch and not self._queue.empty():
                item = self._queue.get_nowait()
                if item is None:
                    stop = True
                    break
                batch.append(item)
            try:
                await self._write(batch)
            except BaseException as e:  # never let the writer die with waiters pending
                for item in batch:
                    _fail(item, e if isinstance(e, Exception) else StoreClosed(repr(e)))
                if not isinstance(e, Exception):
                    raise

    async def _write(self, batch: list[_Item]) -> None:
        self.stats.batches += 1
        self.stats.largest_batch = max(self.stats.largest_batch, len(batch))
        try:
            results = await self._transaction(batch)
        except Exception as e:
            self.stats.failed_batches += 1
            if len(batch) == 1:
                _fail(batch[0], e)
                self.stats.jobs += 1
                return
            log.warning("batch of %d writes failed (%r); rerunning them one by one", len(batch), e)
            for item in batch:
                try:
                    (result,) = await self._transaction([item])
                except Exception as e1:
                    _fail(item, e1)
                else:
                    _resolve(item, result)
                self.stats.jobs += 1
            return
        for item, result in zip(batch, results, strict=True):
            _resolve(item, result)
        self.stats.jobs += len(batch)

    async def _transaction(self, items: list[_Item]) -> list[Any]:
        for attempt in range(1, _TRANSIENT_ATTEMPTS + 1):
            try:
                results: list[Any] = []
                async with self._engine.begin() as conn:
                    for handler, group in itertools.groupby(items, key=lambda i: i.handler):
                        payloads = [i.payload for i in group]
                        out = await handler(conn, payloads)
                        if len(out) != len(payloads):
                            raise RuntimeError(f"{handler!r} returned {len(out)} results")
                        results.extend(out)
                self.stats.commits += 1
                return results
            except DBAPIError as e:
                if not _is_transient(e) or attempt == _TRANSIENT_ATTEMPTS:
                    raise
                log.warning("transient database error (attempt %d): %r; retrying", attempt, e)
                await asyncio.sleep(0.01 * attempt)
        raise AssertionError("unreachable")


def _resolve(item: _Item, result: Any) -> None:
    if not item.future.done():
        item.future.set_result(result)


def _fail(item: _Item, e: Exception) -> None:
    if not item.future.done():
        item.future.set_exception(e)
        # A cancelled waiter never retrieves it; mark it retrieved to avoid a noisy log.
        item.future.exception()
