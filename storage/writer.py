"""Group commit: one writer task turns many concurrent writes into few transactions.

Callers submit a payload with its handler and await the result. The writer task takes
everything queued, runs all of it in one transaction, commits once, and only then resolves every
waiter, so a result always means "committed". Consecutive payloads of the same handler are given
to it together (`handler(conn, payloads) -> results`, one result per payload, in order), so a
handler can write a whole batch in a few statements. If a batch fails, its payloads are rerun
one per transaction, so one bad payload cannot fail its neighbours; its own error reaches its
waiter as the exception. Deadlocks and serialisation failures (Postgres) are retried.

A failure that says the database takes no writes at all (a full disk, a read-only file, an
unreachable server: `storage.health`) fails the whole batch at once as `StoreUnavailable` and
marks the writer unwritable (`health`). While it is, a probe write is submitted every
`probe_interval_s`; the first that commits marks it writable again, with no restart. Other writes
are still tried meanwhile, but only the probe decides recovery (see `storage.health` for why).

A waiter that is cancelled (its client went away) does not cancel its write: it still
happens. This module knows nothing about calls or trajectories.

Given a `thread_engine` (SQLite), a batch's transaction runs in the writer's own thread on that
blocking engine (`storage.blocking_conn`): the event loop hands the batch over once and gets the
results back once, instead of hopping to aiosqlite's thread and back for every statement (BEGIN,
the linking read, each insert, COMMIT). The handlers are the same either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from storage.blocking_conn import BlockingConnection, run_inline
from storage.errors import StoreClosed, StoreUnavailable
from storage.health import WriteHealth, driver_message, unwritable_reason

log = logging.getLogger(__name__)

Handler = Callable[[AsyncConnection, list[Any]], Awaitable[list[Any]]]
"""Writes a list of payloads inside the batch transaction; returns one result per payload."""
Probe = Callable[[AsyncConnection], Awaitable[None]]
"""A tiny real write (`storage.health.probe_write`): committing it proves the database writable."""
CommitObserver = Callable[[int, float], None]
"""Told of every commit: the payloads it held and the seconds its transaction took (telemetry).
Called on the writer task, so it must be quick and must not raise."""

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
    def __init__(
        self,
        engine: AsyncEngine,
        *,
        max_batch: int = 500,
        probe: Probe | None = None,
        probe_interval_s: float = 5.0,
        thread_engine: Engine | None = None,
    ) -> None:
        self._engine = engine
        self._thread_engine = thread_engine
        self._thread = (
            ThreadPoolExecutor(1, thread_name_prefix="rlproxy-store-writer")
            if thread_engine is not None
            else None
        )
        self._max_batch = max_batch
        self._queue: asyncio.Queue[_Item | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.stats = WriterStats()
        self._probe = probe
        self._probe_interval_s = probe_interval_s
        self._prober: asyncio.Task[None] | None = None
        self._health = WriteHealth()
        self._unwritable = asyncio.Event()
        self.on_commit: CommitObserver | None = None

    @property
    def health(self) -> WriteHealth:
        """Writable, or why not and since when (see `storage.health`)."""
        return self._health

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="rlproxy-store-writer")
        if self._probe is not None:
            self._prober = asyncio.create_task(self._probe_while_unwritable(), name="store-probe")

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
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober
        self._queue.put_nowait(None)
        if self._task is not None:
            await self._task
        if self._thread is not None:
            self._thread.shutdown(wait=True)

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
            if self._note_unwritable(e) or len(batch) == 1:
                # Nothing would commit one by one either: every waiter hears it now.
                for item in batch:
                    _fail(item, self._as_unavailable(e))
                self.stats.jobs += len(batch)
                return
            log.warning("batch of %d writes failed (%r); rerunning them one by one", len(batch), e)
            for item in batch:
                try:
                    (result,) = await self._transaction([item])
                except Exception as e1:
                    self._note_unwritable(e1)
                    _fail(item, self._as_unavailable(e1))
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
                started = time.perf_counter()
                if self._thread is not None:
                    loop = asyncio.get_running_loop()
                    results = await loop.run_in_executor(self._thread, self._in_thread, items)
                else:
                    results = []
                    async with self._engine.begin() as conn:
                        for handler, payloads in _runs(items):
                            results += _checked(handler, payloads, await handler(conn, payloads))
                self.stats.commits += 1
                if self._probe is None:  # no probe to decide recovery: any commit does
                    self._note_writable()
                self._tell_commit(len(items), time.perf_counter() - started)
                return results
            except DBAPIError as e:
                if not _is_transient(e) or attempt == _TRANSIENT_ATTEMPTS:
                    raise
                log.warning("transient database error (attempt %d): %r; retrying", attempt, e)
                await asyncio.sleep(0.01 * attempt)
        raise AssertionError("unreachable")

    def _in_thread(self, items: list[_Item]) -> list[Any]:
        """One batch's transaction on the blocking engine, in the writer's thread."""
        assert self._thread_engine is not None
        results: list[Any] = []
        with self._thread_engine.begin() as sync_conn:
            conn: Any = BlockingConnection(sync_conn)  # what the handlers use of AsyncConnection
            for handler, payloads in _runs(items):
                results += _checked(handler, payloads, run_inline(handler(conn, payloads)))
        return results

    def _tell_commit(self, payloads: int, seconds: float) -> None:
        """Tell `on_commit`; its failure is logged, never the batch's (the batch committed)."""
        if self.on_commit is None:
            return
        try:
            self.on_commit(payloads, seconds)
        except Exception:
            log.exception("the commit observer failed")

    # --- health ----------------------------------------------------------------------------

    def _note_unwritable(self, e: Exception) -> bool:
        """True (and the state says so) when `e` means the database takes no writes at all."""
        reason = unwritable_reason(e)
        if reason is None:
            return False
        was = self._health
        self._health = WriteHealth(
            writable=False,
            reason=reason,
            error=driver_message(e),
            since=was.since if not was.writable else time.time(),
        )
        if was.writable:
            log.error(
                "%s; chat requests are refused with 503 until a probe write commits (one every "
                "%g s)",
                self._health.describe(),
                self._probe_interval_s,
            )
        self._unwritable.set()
        return True

    def _note_writable(self) -> None:
        was = self._health
        if was.writable:
            return
        self._health = WriteHealth()
        self._unwritable.clear()
        down = time.time() - (was.since or time.time())
        log.warning("the database is writable again after %.1f s (%s)", down, was.reason)

    def _as_unavailable(self, e: Exception) -> Exception:
        """`StoreUnavailable` (cause chained) for a database that takes no writes; else `e`."""
        reason = unwritable_reason(e)
        if reason is None:
            return e
        error = StoreUnavailable(reason, driver_message(e))
        error.__cause__ = e
        return error

    async def _probe_while_unwritable(self) -> None:
        assert self._probe is not None
        probe = self._probe

        async def handler(conn: AsyncConnection, payloads: list[Any]) -> list[Any]:
            await probe(conn)
            return [None] * len(payloads)

        while True:
            await self._unwritable.wait()
            await asyncio.sleep(self._probe_interval_s)
            if self._health.writable or self._closed:  # a real write got through first
                continue
            try:
                await self.submit(handler, None)
            except StoreUnavailable:
                pass  # still unwritable: `health` already says why
            except Exception as e:
                log.warning("the write probe failed: %r", e)
            else:
                self._note_writable()


def _runs(items: list[_Item]) -> list[tuple[Handler, list[Any]]]:
    """Consecutive payloads of the same handler, together."""
    return [
        (handler, [i.payload for i in group])
        for handler, group in itertools.groupby(items, key=lambda i: i.handler)
    ]


def _checked(handler: Handler, payloads: list[Any], out: list[Any]) -> list[Any]:
    if len(out) != len(payloads):
        raise RuntimeError(f"{handler!r} returned {len(out)} results")
    return out


def _resolve(item: _Item, result: Any) -> None:
    if not item.future.done():
        item.future.set_result(result)


def _fail(item: _Item, e: Exception) -> None:
    if not item.future.done():
        item.future.set_exception(e)
        # A cancelled waiter never retrieves it; mark it retrieved to avoid a noisy log.
        item.future.exception()
