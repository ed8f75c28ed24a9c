"""`Store`: the one API through which every other package reads and writes the database.

    store = await Store.open("sqlite+aiosqlite:///rlproxy-data/rlproxy.db")
    trajectory_id = await store.record_call(record)   # returns once the row is committed
    await store.add_reward(trajectory_id, 0.8, "env")  # also closes the trajectory
    await store.close()

Writes (calls, ends, rewards, idle closing) go through one group-commit writer task
(`storage.writer`), so concurrent calls share a transaction and a commit. Linking a call to a
trajectory happens inside that transaction, by the rule in `storage.linking`; forming groups
follows the rule in `storage.grouping`. Reads use their own connections and never wait for the
writer.

`health` says whether the database takes writes (`storage.health`): a full disk or a read-only
file makes it unwritable at the first failed write, and a probe write every `probe_interval_s`
brings it back without a restart. A group being scored is leased to one store (`instance_id`,
a uuid per `Store.open`): claiming sets the lease, the scorer renews it, finishing needs it, and
another store only takes the group back once the lease has expired. Error texts (a call's
`error`, a group's `failure`) and a call's `params` pass through `redact` before they are
written, so a credential a provider echoed never reaches the database.

The store knows nothing about HTTP, engines or training; it does not import `proxy` or `trainer`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from storage import (
    adapter_ops,
    api_keys,
    coordination_ops,
    group_ops,
    group_reads,
    held_out_runs,
    judge_checks,
    read_ops,
    rollout,
    stats,
    write_ops,
)
from storage.api_keys import ApiKeyRecord, KeyScope
from storage.coordination_ops import LeaseRecord, PolicyStateRecord, ReplicaRecord
from storage.engines import Engines, SqliteSynchronous, create_engines
from storage.errors import InvalidRecord, TrajectoryNotFound
from storage.group_ops import FormResult
from storage.grouping import SignatureGrouper
from storage.health import WriteHealth, probe_write
from storage.linking import PrefixLinker
from storage.migrations import migrate
from storage.models import groups_table as G
from storage.models import trajectories_table as T
from storage.read_ops import TrajectoryFilter
from storage.records import (
    CALL_STATUSES,
    MAX_ABS_REWARD,
    AdapterRecord,
    CallRecord,
    GroupDetail,
    GroupPage,
    JudgeCheckRecord,
    JudgeOutcome,
    StoredCall,
    TrajectoryDetail,
    TrajectoryPage,
)
from storage.trajectory_view import LinkStats
from storage.writer import CommitObserver, GroupCommitWriter, WriterStats

log = logging.getLogger(__name__)

LIVE_TRAJECTORIES = ("open",)
LIVE_GROUPS = ("forming", "ready", "scoring")
"""Statuses of rows still on their way (few at any time): what `live_counts` counts."""


class Store:
    """Open with `await Store.open(url)`; always `await store.close()`."""

    def __init__(
        self,
        engines: Engines,
        linker: PrefixLinker,
        writer: GroupCommitWriter,
        *,
        redact: Callable[[str], str] | None = None,
    ) -> None:
        self._engines = engines
        self._linker = linker
        self._writer = writer
        self._link_stats = LinkStats()
        self._redact = redact
        self.instance_id = uuid.uuid4().hex
        """Who this store is when it claims a group for scoring (`groups.claimed_by`)."""

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        retry_window_s: float = 10.0,
        busy_timeout_s: float = 10.0,
        sqlite_synchronous: SqliteSynchronous = "FULL",
        max_batch: int = 500,
        postgres_schema: str | None = None,
        probe_interval_s: float = 5.0,
        redact: Callable[[str], str] | None = None,
    ) -> Store:
        """Connect, apply pending migrations, start the writer.

        `retry_window_s` is the linking rule's retry window (`storage.linking.PrefixLinker`).
        `busy_timeout_s` and
        `sqlite_synchronous` apply to SQLite (see `storage.engines`); `postgres_schema` keeps
        the tables in an existing Postgres schema instead of `public`. `max_batch` caps how
        many writes share one transaction. `probe_interval_s`: how often an unwritable database
        is tried again. `redact` scrubs credentials from error texts and call params before
        they are written (the proxy passes `proxy.redact.Redactor`).
        """
        engines = create_engines(
            url,
            busy_timeout_s=busy_timeout_s,
            sqlite_synchronous=sqlite_synchronous,
            postgres_schema=postgres_schema,
        )
        try:
            await migrate(engines.write)
        except BaseException:
            await engines.dispose()
            raise
        linker = PrefixLinker(retry_window_s=retry_window_s)
        writer = GroupCommitWriter(
            engines.write,
            max_batch=max_batch,
            probe=probe_write,
            probe_interval_s=probe_interval_s,
            thread_engine=engines.write_thread,
        )
        writer.start()
        return cls(engines, linker, writer, redact=redact)

    async def close(self) -> None:
        """Finish every write already submitted, then release the connections."""
        await self._writer.close()
        await self._engines.dispose()

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def dialect(self) -> str:
        """ "sqlite" or "postgresql"."""
        return self._engines.dialect

    @property
    def link_stats(self) -> LinkStats:
        """Calls linked and the trajectory rows read to link them."""
        return self._link_stats

    @property
    def writer_stats(self) -> WriterStats:
        """Counters of the group-commit writer (commits, batches, jobs)."""
        return self._writer.stats

    def observe_commits(self, observer: CommitObserver | None) -> None:
        """Tell `observer` of every commit: payloads in it and its seconds (metrics)."""
        self._writer.on_commit = observer

    @property
    def health(self) -> WriteHealth:
        """Whether writes commit; if not, why and since when (`storage.health`)."""
        return self._writer.health

    # --- writes ----------------------------------------------------------------------------

    async def record_call(self, record: CallRecord) -> str:
        """Store one call, linked to its trajectory; return the trajectory id once committed.

        Raises `StoreUnavailable` when the database takes no writes (see `health`)."""
        _validate(record)
        if self._redact is not None:
            record = dataclasses.replace(
                record,
                error=None if record.error is None else self._redact(record.error),
                params=_redact_json(record.params, self._redact),
            )
        result: str = await self._writer.submit(self._write_calls, record)
        return result

    async def end_trajectory(self, trajectory_id: str) -> bool:
        """Close a trajectory (reason "end"); True if it was open. Raises TrajectoryNotFound."""
        closed = await self._writer.submit(self._write_ends, trajectory_id)
        if closed is None:
            raise TrajectoryNotFound(trajectory_id)
        return bool(closed)

    async def add_reward(
        self, trajectory_id: str, reward: float, source: str, explanation: str | None = None
    ) -> int:
        """Store a reward (several per trajectory allowed) and close the trajectory.

        Returns the reward id. Raises TrajectoryNotFound, or InvalidRecord for a reward that is
        not a finite number within ±MAX_ABS_REWARD (advantages of larger ones overflow).
        """
        if not math.isfinite(reward) or abs(reward) > MAX_ABS_REWARD:
            raise InvalidRecord(
                f"a reward must be a finite number between {-MAX_ABS_REWARD:g} and "
                f"{MAX_ABS_REWARD:g}, not {reward!r}"
            )
        payload = (trajectory_id, float(reward), source, explanation)
        reward_id = await self._writer.submit(self._write_rewards, payload)
        if reward_id is None:
            raise TrajectoryNotFound(trajectory_id)
        return int(reward_id)

    async def close_idle(self, older_than_s: float, *, now: float | None = None) -> list[str]:
        """Close open trajectories with no call for `older_than_s`; return their ids."""
        closed: list[str] = await self._writer.submit(self._write_idle, (older_than_s, now))
        return closed

    # --- groups and scores ------------------------------------------------------------------

    async def form_groups(
        self, grouper: SignatureGrouper, *, now: float | None = None
    ) -> FormResult:
        """Group closed trajectories that are in no group yet; mark forming groups ready.

        `grouper` decides which group each joins and when a group is ready. Shadow groups need
        no call: they are formed, ready, when their call is recorded.
        """
        t = time.time() if now is None else now
        result: FormResult = await self._writer.submit(
            self._run_ops, lambda conn: group_ops.form_groups(conn, grouper, t)
        )
        return result

    async def claim_group(
        self,
        group_id: str | None = None,
        *,
        lease_s: float = group_ops.DEFAULT_LEASE_S,
        now: float | None = None,
    ) -> str | None:
        """Mark a group "scoring", leased to this store for `lease_s`; return its id, or None
        when there is nothing to claim.

        Without an id: the oldest ready group, or a "scoring" one whose lease expired (its
        scorer died). With one: that group, if it has at least two members and nobody holds a
        live lease on it (a failed or scored group is scored again).
        """
        claim = group_ops.Claim(self.instance_id, lease_s)
        t = time.time() if now is None else now
        claimed: str | None = await self._writer.submit(
            self._run_ops, lambda conn: group_ops.claim_group(conn, group_id, claim, t)
        )
        return claimed

    async def renew_claim(
        self,
        group_id: str,
        *,
        lease_s: float = group_ops.DEFAULT_LEASE_S,
        now: float | None = None,
    ) -> bool:
        """Extend this store's lease on a group it is scoring; False when it no longer holds it."""
        claim = group_ops.Claim(self.instance_id, lease_s)
        t = time.time() if now is None else now
        held: bool = await self._writer.submit(
            self._run_ops, lambda conn: group_ops.renew_claim(conn, group_id, claim, t)
        )
        return held

    async def finish_scoring(self, group_id: str, outcome: JudgeOutcome) -> bool:
        """Store a claimed group's scores (or its failure) and set its status.

        False (and nothing written) when this store no longer holds the claim: another scorer
        took the group over after the lease expired, and its result stands. The outcome's judge
        check is written with it, and a `hold_reason` makes the group "held" (never trained on).
        """
        if outcome.status not in ("scored", "failed"):
            raise InvalidRecord(f"JudgeOutcome.status must be scored or failed: {outcome.status}")
        if outcome.failure is not None and self._redact is not None:
            outcome = dataclasses.replace(outcome, failure=self._redact(outcome.failure))
        owner = self.instance_id
        done: bool = await self._writer.submit(
            self._run_ops,
            lambda conn: judge_checks.finish_scoring(conn, group_id, owner, outcome, time.time()),
        )
        return done

    async def settle_explicit_groups(
        self, *, limit: int = 100, now: float | None = None
    ) -> list[str]:
        """Mark "scored", with no judge, the ready groups whose every member the environment
        rewarded (judge model "explicit"); their ids. Grouping runs this with scoring on or off:
        rewarded groups train even where no judge is configured."""
        t = time.time() if now is None else now
        settled: list[str] = await self._writer.submit(
            self._run_ops, lambda conn: group_ops.settle_explicit_groups(conn, limit, t)
        )
        return settled

    async def requeue_held(
        self, judge_model: str, rubric_hash: str, *, limit: int = 50, now: float | None = None
    ) -> list[str]:
        """Put up to `limit` groups held from this judge and rubric back to "ready" (oldest
        first) to be judged again; return their ids."""
        t = time.time() if now is None else now
        ids: list[str] = await self._writer.submit(
            self._run_ops,
            lambda conn: judge_checks.requeue_held(conn, judge_model, rubric_hash, limit, t),
        )
        return ids

    async def checks_of_judge(
        self, judge_model: str, rubric_hash: str, *, limit: int = 200
    ) -> list[JudgeCheckRecord]:
        """One judge model and rubric's newest `limit` checks, with its newest `limit` canary
        checks and newest `limit` re-orderings, however far back (newest first)."""
        async with self._engines.read.connect() as conn:
            return await judge_checks.checks_of_judge(conn, judge_model, rubric_hash, limit)

    async def newest_judge_checks(
        self, *, limit: int = 200, owner: str | None = None
    ) -> list[JudgeCheckRecord]:
        """The newest `limit` judge checks of any judge (`owner`: only that key's groups)."""
        async with self._engines.read.connect() as conn:
            return await judge_checks.newest_checks(conn, limit, owner)

    async def held_count(
        self,
        *,
        owner: str | None = None,
        judge_model: str | None = None,
        rubric_hash: str | None = None,
    ) -> int:
        """Groups whose scores are held by the judge gate."""
        async with self._engines.read.connect() as conn:
            return await judge_checks.held_count(conn, owner, judge_model, rubric_hash)

    async def release_scoring(
        self, group_id: str | None = None, *, now: float | None = None
    ) -> int:
        """Put groups back to "ready": one this store claimed (`group_id`), or, without an id,
        every "scoring" group whose lease has expired (its scorer died). A live lease of another
        store is never released."""
        owner = self.instance_id
        t = time.time() if now is None else now
        n: int = await self._writer.submit(
            self._run_ops, lambda conn: group_ops.release_scoring(conn, group_id, owner, t)
        )
        return n

    async def mark_trained(self, group_ids: list[str], step: int) -> None:
        """Record that a training step used these groups."""
        await self._writer.submit(
            self._run_ops,
            lambda conn: group_ops.mark_trained(conn, list(group_ids), step, time.time()),
        )

    async def list_groups(
        self,
        *,
        status: str | None = None,
        source: str | None = None,
        untrained: bool = False,
        limit: int = 50,
        cursor: str | None = None,
        oldest_first: bool = False,
        owner: str | None = None,
    ) -> GroupPage:
        """Newest first (or oldest first), keyset-paged on (created_at, id); `owner`: only that
        API key's groups."""
        async with self._engines.read.connect() as conn:
            return await group_reads.list_groups(
                conn,
                status=status,
                source=source,
                untrained=untrained,
                limit=limit,
                cursor=cursor,
                oldest_first=oldest_first,
                owner=owner,
            )

    async def get_group(self, group_id: str) -> GroupDetail | None:
        """A group with its members' conversations, token ids, judge scores and posted rewards.

        Members' `reward` is left unset: which reward trains is the reward policy's choice
        (`trainer.scoring.rewards.read_group`)."""
        async with self._engines.read.connect() as conn:
            return await group_reads.get_group(conn, group_id)

    async def group_ids_of_trajectory(self, trajectory_id: str) -> list[str]:
        async with self._engines.read.connect() as conn:
            return await group_reads.group_ids_of_trajectory(conn, trajectory_id)

    # --- adapters ----------------------------------------------------------------------------

    async def record_adapter(self, record: AdapterRecord) -> None:
        """Record an adapter version the trainer wrote (overwrites a same-numbered one)."""
        await self._writer.submit(
            self._run_ops, lambda conn: adapter_ops.record_adapter(conn, record)
        )

    async def update_adapter(self, policy: str, version: int, **changes: Any) -> bool:
        """Change an adapter's status, error, load or activation time; False if unknown."""
        ok: bool = await self._writer.submit(
            self._run_ops,
            lambda conn: adapter_ops.update_adapter(conn, policy, version, changes, time.time()),
        )
        return ok

    async def list_adapters(self, policy: str) -> list[AdapterRecord]:
        async with self._engines.read.connect() as conn:
            return await adapter_ops.list_adapters(conn, policy)

    async def latest_adapter(self, policy: str) -> AdapterRecord | None:
        """The newest version the trainer recorded for `policy`, with its step metrics."""
        async with self._engines.read.connect() as conn:
            return await adapter_ops.latest_adapter(conn, policy)

    # --- several replicas, one deployment (storage.coordination_ops) --------------------------

    async def acquire_lease(
        self, name: str, holder: str, ttl_s: float, *, now: float | None = None
    ) -> bool:
        """Take or renew the lease `name` for `holder` for `ttl_s` seconds: True when `holder`
        holds it now (it was free, expired, or already its own). The clock is read when the
        write runs, not when it is queued: a renewal that waited in the writer's queue never
        writes an expiry that has already passed."""
        held: bool = await self._writer.submit(
            self._run_ops,
            lambda conn: coordination_ops.acquire_lease(
                conn, name, holder, ttl_s, time.time() if now is None else now
            ),
        )
        return held

    async def release_lease(self, name: str, holder: str) -> bool:
        """Give the lease up if `holder` holds it; False otherwise."""
        released: bool = await self._writer.submit(
            self._run_ops, lambda conn: coordination_ops.release_lease(conn, name, holder)
        )
        return released

    async def get_lease(self, name: str) -> LeaseRecord | None:
        async with self._engines.read.connect() as conn:
            return await coordination_ops.get_lease(conn, name)

    async def set_policy_state(
        self,
        policy: str,
        *,
        by: str | None = None,
        expect: dict[str, Any] | None = None,
        **changes: Any,
    ) -> bool:
        """Set what `policy` serves on every replica: `active_version` (0: the base model),
        `canary_version` (None: no canary) and `canary_share`. `expect`: change it only if
        those fields still hold those values (False when they did not: another replica or a
        hand changed the state meanwhile)."""
        now = time.time()
        changed: bool = await self._writer.submit(
            self._run_ops,
            lambda conn: coordination_ops.set_policy_state(conn, policy, changes, by, now, expect),
        )
        return changed

    async def get_policy_state(self, policy: str) -> PolicyStateRecord | None:
        async with self._engines.read.connect() as conn:
            return await coordination_ops.get_policy_state(conn, policy)

    async def heartbeat_replica(self, replica_id: str, policy: str, versions: list[int]) -> None:
        """Record that `replica_id` is alive and keeps `versions` loaded."""
        now = time.time()
        await self._writer.submit(
            self._run_ops,
            lambda conn: coordination_ops.heartbeat_replica(
                conn, replica_id, policy, versions, now
            ),
        )

    async def remove_replica(self, replica_id: str) -> None:
        await self._writer.submit(
            self._run_ops, lambda conn: coordination_ops.remove_replica(conn, replica_id)
        )

    async def live_replicas(self, policy: str, since: float) -> list[ReplicaRecord]:
        """The replicas of `policy` whose last heartbeat is not older than `since`."""
        async with self._engines.read.connect() as conn:
            return await coordination_ops.live_replicas(conn, policy, since)

    async def held_out_runs(
        self, *, limit: int = 5000, owner: str | None = None
    ) -> list[held_out_runs.HeldOutRun]:
        """The newest `limit` trajectories of tasks held out of training (`storage.held_out`),
        oldest first, each with what served its calls and its latest environment reward (the
        held-out evaluation's evidence); of API key `owner` only, unless None."""
        async with self._engines.read.connect() as conn:
            return await held_out_runs.held_out_runs(conn, limit=limit, owner=owner)

    async def paired_rewards(
        self, *, old: int, new: int | Collection[int], since: float
    ) -> list[rollout.GroupPair]:
        """Scored groups since `since` holding members of adapter versions `old` and `new` (0:
        the base model; several: any of them), with each member's posted reward and judge
        score (a canary rollout's evidence; `trainer.scoring.rewards.version_rewards` picks by
        the reward policy)."""
        async with self._engines.read.connect() as conn:
            return await rollout.paired_rewards(conn, old=old, new=new, since=since)

    async def calls_served(self, *, version: int, since: float) -> int:
        """Calls adapter `version` (0: the base model) served since `since` (a canary's call
        budget)."""
        async with self._engines.read.connect() as conn:
            return await rollout.calls_served(conn, version=version, since=since)

    async def recent_trajectories(self, *, version: int, since: float, limit: int) -> list[str]:
        """The newest `limit` trajectories adapter `version` (0: the base model) served whole
        since `since`, newest first (a canary's closeness is measured on their calls)."""
        async with self._engines.read.connect() as conn:
            return await rollout.recent_trajectories(
                conn, version=version, since=since, limit=limit
            )

    async def trajectory_of_completion(self, completion_id: str) -> str | None:
        """The trajectory of the call that returned this `chatcmpl-...` id, if any."""
        async with self._engines.read.connect() as conn:
            return await read_ops.trajectory_of_completion(conn, completion_id)

    async def call_by_completion_id(self, completion_id: str) -> StoredCall | None:
        """The call that returned this `chatcmpl-...`, `resp_...` or `msg_...` id, if any."""
        async with self._engines.read.connect() as conn:
            return await read_ops.call_by_completion_id(conn, completion_id)

    async def forget_response(self, completion_id: str) -> bool:
        """Make a Responses API call unreadable by id (`DELETE /v1/responses/{id}`); the call
        itself stays for training. False when no retrievable response has that id."""
        done: bool = await self._writer.submit(
            self._run_ops, lambda conn: write_ops.forget_response(conn, completion_id)
        )
        return done

    async def trajectory_owner(self, trajectory_id: str) -> tuple[bool, str | None]:
        """(whether the trajectory exists, the API key that owns it)."""
        async with self._engines.read.connect() as conn:
            return await read_ops.trajectory_owner(conn, trajectory_id)

    # --- API keys ----------------------------------------------------------------------------

    async def create_api_key(self, name: str, scope: KeyScope) -> tuple[ApiKeyRecord, str]:
        """Store a new key and return it with its printable form (shown once, never stored)."""
        record, key = api_keys.new_key(name, scope)
        await self._writer.submit(self._run_ops, lambda conn: api_keys.insert_key(conn, record))
        return record, key

    async def list_api_keys(self) -> list[ApiKeyRecord]:
        """Every key ever created, revoked ones included, oldest first."""
        async with self._engines.read.connect() as conn:
            return await api_keys.all_keys(conn)

    async def revoke_api_key(self, key_id: str) -> bool:
        """Revoke a key; False when no active key has that id."""
        done: bool = await self._writer.submit(
            self._run_ops, lambda conn: api_keys.revoke_key(conn, key_id, time.time())
        )
        return done

    async def delete_key_data(self, key_id: str) -> dict[str, int]:
        """Delete everything a key's calls left: trajectories, calls, rewards, groups, scores.
        Returns the rows deleted per table. The key itself stays (revoke it separately)."""
        counts: dict[str, int] = await self._writer.submit(
            self._run_ops, lambda conn: api_keys.delete_owner_data(conn, key_id)
        )
        return counts

    async def installation_salt(self) -> str:
        """This installation's random salt (for naming unregistered bearer tokens)."""
        async with self._engines.read.connect() as conn:
            return await api_keys.installation_salt(conn)

    # Writer handlers: each gets every consecutive payload of its kind in the batch.

    async def _run_ops(
        self, conn: AsyncConnection, ops: list[Callable[[AsyncConnection], Awaitable[Any]]]
    ) -> list[Any]:
        return [await op(conn) for op in ops]

    async def _write_calls(self, conn: AsyncConnection, records: list[CallRecord]) -> list[str]:
        return await write_ops.record_calls(
            conn, records, self._linker, time.time(), self._link_stats
        )

    async def _write_ends(self, conn: AsyncConnection, ids: list[str]) -> list[bool | None]:
        return [await write_ops.close_trajectory(conn, tid, "end", time.time()) for tid in ids]

    async def _write_rewards(
        self, conn: AsyncConnection, payloads: list[tuple[str, float, str, str | None]]
    ) -> list[int | None]:
        return [
            await write_ops.add_reward(conn, tid, reward, source, explanation, time.time())
            for tid, reward, source, explanation in payloads
        ]

    async def _write_idle(
        self, conn: AsyncConnection, payloads: list[tuple[float, float | None]]
    ) -> list[list[str]]:
        out = []
        for older_than_s, now in payloads:
            t = time.time() if now is None else now
            out.append(await write_ops.close_idle(conn, t - older_than_s, t))
        return out

    # --- reads -----------------------------------------------------------------------------

    async def list_trajectories(
        self,
        *,
        status: str | None = None,
        group_key: str | None = None,
        model: str | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int = 50,
        cursor: str | None = None,
        owner: str | None = None,
        parent: str | None = None,
    ) -> TrajectoryPage:
        """Newest first, keyset-paged on (created_at, id); `since`/`until` bound created_at;
        `owner`: only that API key's trajectories; `parent`: only those that trajectory started
        (its sub-agents and side calls)."""
        f = TrajectoryFilter(status, group_key, model, since, until, owner, parent)
        async with self._engines.read.connect() as conn:
            return await read_ops.list_trajectories(conn, f, limit, cursor)

    async def get_trajectory(self, trajectory_id: str) -> TrajectoryDetail | None:
        """The trajectory with its turns in order (retries resolved) and its rewards."""
        async with self._engines.read.connect() as conn:
            return await read_ops.get_trajectory(conn, trajectory_id)

    async def get_call(self, call_id: str) -> StoredCall | None:
        async with self._engines.read.connect() as conn:
            return await read_ops.get_call(conn, call_id)

    async def get_trajectory_calls(self, trajectory_id: str) -> list[StoredCall]:
        """Every call of a trajectory, retries and superseded calls included, in turn order."""
        async with self._engines.read.connect() as conn:
            return await read_ops.calls_of(conn, trajectory_id)

    async def iter_trajectories_for_export(
        self,
        *,
        status: str | None = "closed",
        group_key: str | None = None,
        model: str | None = None,
        since: float | None = None,
        until: float | None = None,
        page_size: int = 100,
    ) -> AsyncIterator[TrajectoryDetail]:
        """Yield full trajectories (newest first); feed them to `storage.export`."""
        cursor: str | None = None
        while True:
            page = await self.list_trajectories(
                status=status,
                group_key=group_key,
                model=model,
                since=since,
                until=until,
                limit=page_size,
                cursor=cursor,
            )
            for item in page.items:
                detail = await self.get_trajectory(item.id)
                if detail is not None:
                    yield detail
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    async def count_calls(self, trajectory_id: str | None = None) -> int:
        async with self._engines.read.connect() as conn:
            return await read_ops.count_calls(conn, trajectory_id)

    async def count_trajectories(self, status: str | None = None) -> int:
        async with self._engines.read.connect() as conn:
            return await read_ops.count_trajectories(conn, status)

    async def live_counts(self) -> dict[str, dict[str, int]]:
        """Open trajectories, and groups forming, ready or being scored (for metrics):
        {"trajectories": {"open": n}, "groups": {status: n}}. Index ranges over the rows still in
        the pipeline only, so the cost does not grow with history (closed trajectories and
        scored groups are not counted: that would scan the tables, see `totals`)."""
        async with self._engines.read.connect() as conn:
            return {
                "trajectories": await read_ops.status_counts(conn, T, LIVE_TRAJECTORIES),
                "groups": await read_ops.status_counts(conn, G, LIVE_GROUPS),
            }

    async def status_counts(self) -> dict[str, dict[str, int]]:
        """Every trajectory and group by status, closed and scored ones included (a walk of the
        status indexes: its cost grows with history, so callers read it seldom, e.g. once a
        minute for /metrics). Same shape as `live_counts`."""
        async with self._engines.read.connect() as conn:
            return {
                "trajectories": await read_ops.status_counts(conn, T),
                "groups": await read_ops.status_counts(conn, G),
            }

    # --- figures (the dashboard, `rlproxy status`; SQL in storage.stats) ---------------------

    async def judge_work(self, *, since: float) -> stats.JudgeWork:
        """Groups the judge scored or failed since `since`, its calls and their time."""
        async with self._engines.read.connect() as conn:
            return await stats.judge_work(conn, since=since)

    async def calls_per_minute(
        self, *, minutes: int = 60, now: float | None = None, owner: str | None = None
    ) -> list[stats.MinuteCount]:
        """Calls and failed calls per minute over the last `minutes`, oldest first."""
        t = time.time() if now is None else now
        async with self._engines.read.connect() as conn:
            return await stats.calls_per_minute(
                conn, now=t, minutes=minutes, owner=owner, dialect=self.dialect
            )

    async def reward_by_version(
        self, *, window: int = 1000, owner: str | None = None
    ) -> list[stats.VersionReward]:
        """Mean ± standard error of explicit rewards and of judge scores per adapter version,
        over the newest `window` of each."""
        async with self._engines.read.connect() as conn:
            return await stats.reward_by_version(conn, window=window, owner=owner)

    async def group_queue(
        self, *, owner: str | None = None, untrained_window: int = 500
    ) -> stats.GroupQueue:
        """Groups forming, ready and being scored; scored groups no step has used yet (among
        the newest `untrained_window`); the newest scored and failed group."""
        async with self._engines.read.connect() as conn:
            return await stats.group_queue(conn, owner=owner, untrained_window=untrained_window)

    async def totals(self) -> stats.Totals:
        """Whole-table counts (scans: for the command line, not for polling)."""
        async with self._engines.read.connect() as conn:
            return await stats.totals(conn)

    async def trajectory_bytes(self, trajectory_id: str) -> int:
        """Bytes the trajectory's rows and the prompt chunks they refer to hold (see
        `storage.stats.trajectory_bytes`)."""
        async with self._engines.read.connect() as conn:
            return await conn.run_sync(stats.trajectory_bytes, trajectory_id)


def _redact_json(value: Any, redact: Callable[[str], str]) -> Any:
    """`value` with `redact` applied to every string in it, keys included."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {_redact_json(k, redact): _redact_json(v, redact) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_json(v, redact) for v in value]
    return value


def _validate(record: CallRecord) -> None:
    if not record.id:
        raise InvalidRecord("CallRecord.id is required (uuid4 hex)")
    if record.status not in CALL_STATUSES:
        raise InvalidRecord(
            f"CallRecord.status must be one of {sorted(CALL_STATUSES)}, not {record.status!r}"
        )
    if not isinstance(record.request_messages, list):
        raise InvalidRecord("CallRecord.request_messages must be a list of message dicts")
    if record.retry_count < 0:
        raise InvalidRecord("CallRecord.retry_count must be >= 0")
