"""Group commit: one writer task turns many concurrent writes into few transactions.

Callers submit jobs (async functions of an `AsyncConnection`) and await their results. The
writer task takes everything queued, runs all of it in one transaction, commits once, and only
then resolves every waiter, so a result always means "committed". If a batch fails, its jobs are
rerun one per transaction, so one bad job cannot fail its neighbours; a job's own error reaches
its waiter as the exception. Deadlocks and serialisation failures (Postgres) are retried.

A waiter that is cancelled (its client went away) does not cancel its job: the write still
happens. This module knows nothing about calls or trajectories.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from storage.errors import StoreClosed

log = logging.getLogger(__name__)

Job = Callable[[AsyncConnection], Awaitable[Any]]

_TRANSIENT_SQLSTATES = {"40001", "40P01"}  # serialization_failure, deadlock_detected
_TRANSIENT_ATTEMPTS = 5


@dataclass
class WriterStats:
    jobs: int = 0
    """Jobs committed (or failed) so far."""
    commits: int = 0
    """Transactions committed."""
    batches: int = 0
    """Batches taken off the queue (a failed batch is rerun job by job)."""
    largest_batch: int = 0
    failed_batches: int = 0


@dataclass
class _Item:
    job: Job
    future: asyncio.Future[Any]


def _is_transient(e: DBAPIError) -> bool:
    orig = e.orig
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    return code in _TRANSIENT_SQLSTATES


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

    async def submit(self, job: Job) -> Any:
        """Run `job` in the next batch; return its result once the batch has committed."""
        if self._closed:
            raise StoreClosed("the store is closed")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Item(job, future))
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
            results = await self._transaction([item.job for item in batch])
        except Exception as e:
            self.stats.failed_batches += 1
            if len(batch) == 1:
                _fail(batch[0], e)
                self.stats.jobs += 1
                return
            log.warning("batch of %d writes failed (%r); rerunning them one by one", len(batch), e)
            for item in batch:
                try:
                    (result,) = await self._transaction([item.job])
                except Exception as e1:
                    _fail(item, e1)
                else:
                    _resolve(item, result)
                self.stats.jobs += 1
            return
        for item, result in zip(batch, results, strict=True):
            _resolve(item, result)
        self.stats.jobs += len(batch)

    async def _transaction(self, jobs: list[Job]) -> list[Any]:
        for attempt in range(1, _TRANSIENT_ATTEMPTS + 1):
            try:
                async with self._engine.begin() as conn:
                    results = [await job(conn) for job in jobs]
                self.stats.commits += 1
                return results
            except DBAPIError as e:
                if not _is_transient(e) or attempt == _TRANSIENT_ATTEMPTS:
                    raise
                log.info("transient database error (attempt %d): %r; retrying", attempt, e)
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
