"""Ordered, named schema migrations, recorded in the `migrations` table.

Each migration is a function of a synchronous SQLAlchemy `Connection` (run through
`AsyncConnection.run_sync`). Migrations are frozen history: they spell out their own tables and
never import `storage.models`, which describes only the latest shape. To change the schema,
append a new `Migration` to `MIGRATIONS`; never edit one that has shipped.

`migrate` applies the pending ones in order, all in one transaction, under a lock (BEGIN
IMMEDIATE on SQLite, an advisory transaction lock on Postgres), so replicas that start together
do not race. This module knows nothing about calls or trajectories beyond their DDL, except
m010, which moves every stored prompt into `prompt_chunks` (`storage.prompt_chunks`).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import (
    Boolean,
    Column,
    Connection,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    text,
)
from sqlalchemy.ext.asyncio import AsyncEngine

log = logging.getLogger(__name__)

# Any constant works; it only has to be the same in every replica.
_PG_ADVISORY_LOCK_KEY = 0x726C70726F7879  # "rlproxy"


@dataclass(frozen=True)
class Migration:
    id: int
    name: str
    apply: Callable[[Connection], None]


def _m001_initial(conn: Connection) -> None:
    md = MetaData()
    Table(
        "trajectories",
        md,
        Column("id", String, primary_key=True),
        Column("status", String, nullable=False),
        Column("created_at", Double, nullable=False),
        Column("updated_at", Double, nullable=False),
        Column("closed_at", Double),
        Column("close_reason", String),
        Column("group_key", String),
        Column("model", String),
        Column("turn_count", Integer, nullable=False),
        Column("call_count", Integer, nullable=False),
        Column("explicit", Boolean, nullable=False),
        Column("task_signature", String),
        Column("next_prefix_hash", String),
        Column("last_request_hash", String),
        Column("last_call_id", String),
        Column("last_call_created_at", Double),
        Column("last_call_finished_at", Double),
        Column("last_call_status", String),
        Index("ix_trajectories_status_next_prefix_hash", "status", "next_prefix_hash"),
        Index("ix_trajectories_status_last_request_hash", "status", "last_request_hash"),
        Index("ix_trajectories_status_updated_at", "status", "updated_at"),
        Index("ix_trajectories_created_at_id", "created_at", "id"),
        Index("ix_trajectories_status_created_at_id", "status", "created_at", "id"),
        Index("ix_trajectories_group_key", "group_key"),
        Index("ix_trajectories_task_signature", "task_signature"),
    )
    Table(
        "calls",
        md,
        Column("id", String, primary_key=True),
        Column("request_id", String),
        Column("created_at", Double, nullable=False),
        Column("finished_at", Double, nullable=False),
        Column("recorded_at", Double, nullable=False),
        Column("model_requested", String, nullable=False),
        Column("adapter_version", Integer),
        Column("engine", String, nullable=False),
        Column("request_messages", Text, nullable=False),
        Column("tools", Text),
        Column("params", Text, nullable=False),
        Column("response", Text),
        Column("prompt_token_ids", Text),
        Column("usage", Text),
        Column("prompt_tokens", Integer),
        Column("completion_tokens", Integer),
        Column("latency_s", Double, nullable=False),
        Column("status", String, nullable=False),
        Column("error", Text),
        Column("api_key_id", String),
        Column("stream", Boolean, nullable=False),
        Column("token_ids_note", Text),
        Column("explicit_trajectory_id", String),
        Column("explicit_group_key", String),
        Column("retry_count", Integer, nullable=False),
        Column("request_hash", String),
        Column("trajectory_id", String, ForeignKey("trajectories.id"), nullable=False),
        Column("turn_index", Integer, nullable=False),
        Column("retry_of", String),
        Column("superseded_by", String),
        Index("ix_calls_trajectory_id_turn_index", "trajectory_id", "turn_index"),
        Index("ix_calls_created_at", "created_at"),
        Index("ix_calls_request_id", "request_id"),
    )
    Table(
        "call_choices",
        md,
        Column("call_id", String, ForeignKey("calls.id"), primary_key=True),
        Column("choice_index", Integer, primary_key=True, autoincrement=False),
        Column("message", Text, nullable=False),
        Column("finish_reason", String),
        Column("completion_token_ids", Text),
        Column("completion_logprobs", Text),
    )
    Table(
        "rewards",
        md,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("trajectory_id", String, ForeignKey("trajectories.id"), nullable=False),
        Column("reward", Double, nullable=False),
        Column("source", String, nullable=False),
        Column("created_at", Double, nullable=False),
        Column("explanation", Text),
        Index("ix_rewards_trajectory_id", "trajectory_id"),
    )
    md.create_all(conn)


def _m002_groups_and_adapters(conn: Connection) -> None:
    conn.execute(text("ALTER TABLE calls ADD COLUMN completion_id VARCHAR"))
    conn.execute(text("CREATE INDEX ix_calls_completion_id ON calls (completion_id)"))
    md = MetaData()
    # Stand-ins for tables that exist already, so the foreign keys below resolve.
    existing = [
        Table("calls", md, Column("id", String, primary_key=True)),
        Table("trajectories", md, Column("id", String, primary_key=True)),
    ]
    Table(
        "call_samples",
        md,
        Column("call_id", String, ForeignKey("calls.id"), primary_key=True),
        Column("sample_index", Integer, primary_key=True, autoincrement=False),
        Column("message", Text, nullable=False),
        Column("finish_reason", String),
        Column("completion_token_ids", Text),
        Column("completion_logprobs", Text),
    )
    Table(
        "groups",
        md,
        Column("id", String, primary_key=True),
        Column("source", String, nullable=False),
        Column("key", String, nullable=False),
        Column("status", String, nullable=False),
        Column("created_at", Double, nullable=False),
        Column("updated_at", Double, nullable=False),
        Column("ready_at", Double),
        Column("scored_at", Double),
        Column("member_count", Integer, nullable=False),
        Column("rubric_hash", String),
        Column("judge_model", String),
        Column("judge_latency_s", Double),
        Column("judge_attempts", Integer),
        Column("judge_prompt_tokens", Integer),
        Column("judge_completion_tokens", Integer),
        Column("judge_cost_usd", Double),
        Column("failure", Text),
        Column("trained_step", Integer),
        Column("trained_at", Double),
        Index("ix_groups_source_key_status", "source", "key", "status"),
        Index("ix_groups_status_created_at", "status", "created_at"),
        Index("ix_groups_created_at_id", "created_at", "id"),
    )
    Table(
        "group_members",
        md,
        Column("group_id", String, ForeignKey("groups.id"), primary_key=True),
        Column("member_id", String, primary_key=True),
        Column("position", Integer, nullable=False),
        Column("trajectory_id", String, ForeignKey("trajectories.id"), nullable=False),
        Column("call_id", String),
        Column("choice_index", Integer),
        Column("sample_index", Integer),
        Column("added_at", Double, nullable=False),
        Index("ix_group_members_trajectory_id", "trajectory_id"),
    )
    Table(
        "scores",
        md,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("group_id", String, ForeignKey("groups.id"), nullable=False),
        Column("member_id", String, nullable=False),
        Column("score", Double, nullable=False),
        Column("explanation", Text),
        Column("judge_model", String, nullable=False),
        Column("rubric_hash", String),
        Column("latency_s", Double),
        Column("prompt_tokens", Integer),
        Column("completion_tokens", Integer),
        Column("cost_usd", Double),
        Column("created_at", Double, nullable=False),
        Index("ix_scores_group_id", "group_id"),
    )
    Table(
        "adapters",
        md,
        Column("policy", String, primary_key=True),
        Column("version", Integer, primary_key=True, autoincrement=False),
        Column("path", Text, nullable=False),
        Column("status", String, nullable=False),
        Column("created_at", Double, nullable=False),
        Column("updated_at", Double, nullable=False),
        Column("loaded_at", Double),
        Column("activated_at", Double),
        Column("error", Text),
        Column("metrics", Text),
    )
    md.create_all(conn, tables=[t for t in md.sorted_tables if t not in existing])


def _m003_bounded_linking(conn: Connection) -> None:
    """Linking reads the newest trajectories per hash (and per standing call status) instead of
    every open one: indexes that end in `updated_at` let it stop after the few it needs."""
    conn.execute(text("DROP INDEX ix_trajectories_status_next_prefix_hash"))
    conn.execute(text("DROP INDEX ix_trajectories_status_last_request_hash"))
    conn.execute(
        text(
            "CREATE INDEX ix_trajectories_prefix_lookup "
            "ON trajectories (status, next_prefix_hash, updated_at, id)"
        )
    )
    conn.execute(
        text(
            "CREATE INDEX ix_trajectories_request_lookup "
            "ON trajectories (status, last_request_hash, last_call_status, updated_at, id)"
        )
    )


def _m004_keys_owners_leases(conn: Connection) -> None:
    """API keys (a salted hash of each secret, never the secret); the key that owns each
    trajectory and group, so a key sees and continues only its own; a lease on a group being
    scored, so a replica never takes a group another replica is judging; one random salt per
    installation for hashing the bearer tokens of unauthenticated clients."""
    md = MetaData()
    Table(
        "api_keys",
        md,
        Column("id", String, primary_key=True),
        Column("name", String, nullable=False),
        Column("scope", String, nullable=False),
        Column("salt", String, nullable=False),
        Column("secret_hash", String, nullable=False),
        Column("created_at", Double, nullable=False),
        Column("revoked_at", Double),
    )
    Table(
        "installation",
        md,
        Column("name", String, primary_key=True),
        Column("value", Text, nullable=False),
    )
    md.create_all(conn)
    conn.execute(
        text("INSERT INTO installation (name, value) VALUES ('key_salt', :salt)"),
        {"salt": secrets.token_hex(32)},
    )
    conn.execute(text("ALTER TABLE trajectories ADD COLUMN owner_key_id VARCHAR"))
    conn.execute(text("ALTER TABLE groups ADD COLUMN owner_key_id VARCHAR"))
    conn.execute(text("ALTER TABLE groups ADD COLUMN claimed_by VARCHAR"))
    conn.execute(text("ALTER TABLE groups ADD COLUMN lease_until DOUBLE PRECISION"))
    conn.execute(
        text("CREATE INDEX ix_trajectories_owner ON trajectories (owner_key_id, created_at, id)")
    )
    conn.execute(text("CREATE INDEX ix_groups_owner ON groups (owner_key_id, created_at, id)"))


def _m005_untrained_groups(conn: Connection) -> None:
    """The trainer asks for scored groups not trained on yet, oldest first: an index that
    starts with (status, trained_step) lets it skip every group already trained on instead of
    walking past them on every poll."""
    conn.execute(
        text("CREATE INDEX ix_groups_untrained ON groups (status, trained_step, created_at, id)")
    )


def _m006_judge_checks(conn: Connection) -> None:
    """Judge checks: one row per judging (how the judge placed a canary, its agreement with
    itself in another order and with the environment's rewards, the gate's decision), and the
    reason a group's scores are held (status "held") when its judge fails its checks."""
    md = MetaData()
    Table(
        "judge_checks",
        md,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("group_id", String, nullable=False),
        Column("owner_key_id", String),
        Column("created_at", Double, nullable=False),
        Column("judge_model", String, nullable=False),
        Column("rubric_hash", String, nullable=False),
        Column("member_count", Integer, nullable=False),
        Column("canary_kind", String),
        Column("canary_member_id", String),
        Column("canary_score", Double),
        Column("canary_median", Double),
        Column("canary_passed", Boolean),
        Column("position_tau", Double),
        Column("env_members", Integer),
        Column("env_spearman", Double),
        Column("env_kendall", Double),
        Column("mean_reward", Double),
        Column("completion_tokens_mean", Double),
        Column("completion_tokens_std", Double),
        Column("decision", String, nullable=False),
        Column("reason", Text),
        Index("ix_judge_checks_judge", "judge_model", "rubric_hash", "id"),
        Index("ix_judge_checks_owner", "owner_key_id", "id"),
    )
    md.create_all(conn)
    conn.execute(text("ALTER TABLE groups ADD COLUMN hold_reason TEXT"))


def _m007_adapter_rollout(conn: Connection) -> None:
    """Canary rollout: each adapter version's rollout state and every decision with its
    figures (JSON), shown by `GET /rl/adapters`."""
    conn.execute(text("ALTER TABLE adapters ADD COLUMN rollout TEXT"))


def _m008_call_protocols(conn: Connection) -> None:
    """Which wire protocol a call came in by (NULL: chat completions, every call before this),
    and whether a Responses API call may be read back by its id (`store`, `DELETE`)."""
    conn.execute(text("ALTER TABLE calls ADD COLUMN protocol VARCHAR"))
    conn.execute(text("ALTER TABLE calls ADD COLUMN retrievable BOOLEAN"))


def _m009_replicas(conn: Connection) -> None:
    """Several replicas on one database: leases (one trainer, one publisher at a time), the
    policy's active version and canary as one row every replica follows, and each replica's
    heartbeat with the adapter versions it keeps loaded."""
    md = MetaData()
    Table(
        "leases",
        md,
        Column("name", String, primary_key=True),
        Column("holder", String, nullable=False),
        Column("acquired_at", Double, nullable=False),
        Column("expires_at", Double, nullable=False),
    )
    Table(
        "policy_state",
        md,
        Column("policy", String, primary_key=True),
        Column("active_version", Integer, nullable=False),
        Column("canary_version", Integer),
        Column("canary_share", Double),
        Column("changed_at", Double, nullable=False),
        Column("changed_by", String),
    )
    Table(
        "replicas",
        md,
        Column("id", String, primary_key=True),
        Column("policy", String, nullable=False),
        Column("versions", Text, nullable=False),
        Column("started_at", Double, nullable=False),
        Column("heartbeat_at", Double, nullable=False),
    )
    md.create_all(conn)


_M010_PAGE = 200
"""Calls rewritten per step of m010: bounded memory on a database of any size."""


def _m010_prompt_chunks(conn: Connection) -> None:
    """Prompts stored once by content (`storage.prompt_chunks`): a `prompt_chunks` table, each
    call's `message_refs`, `tool_refs` and `token_refs` (hashes of its messages, tools and
    token-id blocks), every stored call rewritten into them, then `request_messages`, `tools`
    and `prompt_token_ids` dropped.

    The rewrite uses today's split (`SplitPrompts`); that is safe for a frozen migration because
    readers only follow hashes, so any split this migration ever made reads back the same."""
    from storage.prompt_chunks import SplitPrompts  # pure; no storage.models shapes used

    md = MetaData()
    Table(
        "prompt_chunks",
        md,
        Column("hash", String, primary_key=True),
        Column("owner_key_id", String),
        Column("body", Text, nullable=False),
        Index("ix_prompt_chunks_owner", "owner_key_id"),
    )
    md.create_all(conn)
    conn.execute(text("ALTER TABLE calls ADD COLUMN message_refs TEXT NOT NULL DEFAULT '[]'"))
    conn.execute(text("ALTER TABLE calls ADD COLUMN tool_refs TEXT"))
    conn.execute(text("ALTER TABLE calls ADD COLUMN token_refs TEXT"))
    after = ""
    while True:
        rows = conn.execute(
            text(
                "SELECT c.id, c.request_messages, c.tools, c.prompt_token_ids, t.owner_key_id "
                "FROM calls c JOIN trajectories t ON t.id = c.trajectory_id "
                "WHERE c.id > :after ORDER BY c.id LIMIT :n"
            ),
            {"after": after, "n": _M010_PAGE},
        ).all()
        if not rows:
            break
        split = SplitPrompts()
        updates = []
        for r in rows:
            tools = None if r.tools is None else json.loads(r.tools)
            ids = None if r.prompt_token_ids is None else json.loads(r.prompt_token_ids)
            updates.append(
                {
                    "i": r.id,
                    "m": _json(split.messages(r.owner_key_id, json.loads(r.request_messages))),
                    "f": None if tools is None else _json(split.tools(r.owner_key_id, tools)),
                    "t": None if ids is None else _json(split.token_ids(r.owner_key_id, ids)),
                }
            )
        if split.values:
            conn.execute(
                text(
                    "INSERT INTO prompt_chunks (hash, owner_key_id, body) VALUES (:h, :o, :b) "
                    "ON CONFLICT (hash) DO NOTHING"
                ),
                [{"h": h, "o": split.owners[h], "b": split.body(h)} for h in split.values],
            )
        conn.execute(
            text(
                "UPDATE calls SET message_refs = :m, tool_refs = :f, token_refs = :t WHERE id = :i"
            ),
            updates,
        )
        after = rows[-1].id
    conn.execute(text("ALTER TABLE calls DROP COLUMN request_messages"))
    conn.execute(text("ALTER TABLE calls DROP COLUMN tools"))
    conn.execute(text("ALTER TABLE calls DROP COLUMN prompt_token_ids"))


def _m011_tool_call_link_key(conn: Connection) -> None:
    """Linking's second key (`storage.linking`): a hash of a trajectory's last request and the
    ids of its answer's tool calls, so a turn whose tool call the client rewrote under the same
    id still continues it; indexed like `next_prefix_hash`, newest first within one hash.
    Trajectories stored before have none and link by the chain until their next answer."""
    conn.execute(text("ALTER TABLE trajectories ADD COLUMN next_tool_call_hash VARCHAR"))
    conn.execute(
        text(
            "CREATE INDEX ix_trajectories_tool_call_lookup "
            "ON trajectories (status, next_tool_call_hash, updated_at, id)"
        )
    )


def _m012_session_lanes(conn: Connection) -> None:
    """Linking's last key (`storage.linking`): a trajectory's coding-agent session lane (hashed
    with the owner) and agent signature, looked up newest first within one lane and agent (a
    rewritten history continues there) and within one lane (a new trajectory's parent); the
    parent itself, listed by `?parent=`; and on each call whether it continued by the lane only
    (`history_rewritten`, false for every call before). Trajectories stored before have no lane
    until their next call that has one."""
    for column in ("session_lane", "agent_signature", "parent_trajectory_id"):
        conn.execute(text(f"ALTER TABLE trajectories ADD COLUMN {column} VARCHAR"))
    conn.execute(
        text(
            "CREATE INDEX ix_trajectories_lane_lookup "
            "ON trajectories (status, session_lane, agent_signature, updated_at, id)"
        )
    )
    conn.execute(
        text(
            "CREATE INDEX ix_trajectories_lane_newest "
            "ON trajectories (session_lane, updated_at, id)"
        )
    )
    conn.execute(
        text(
            "CREATE INDEX ix_trajectories_parent "
            "ON trajectories (parent_trajectory_id, created_at, id)"
        )
    )
    conn.execute(
        text("ALTER TABLE calls ADD COLUMN history_rewritten BOOLEAN NOT NULL DEFAULT FALSE")
    )


def _m013_held_out(conn: Connection) -> None:
    """The held-out split (`storage.held_out`): a trajectory of a task kept out of training is
    marked when it is created, and grouping never takes it; the evaluation lists them newest
    first (`ix_trajectories_held_out`). Trajectories stored before were all trained on: false."""
    conn.execute(
        text("ALTER TABLE trajectories ADD COLUMN held_out BOOLEAN NOT NULL DEFAULT FALSE")
    )
    conn.execute(
        text("CREATE INDEX ix_trajectories_held_out ON trajectories (held_out, created_at, id)")
    )


def _m014_judge_check_kinds(conn: Connection) -> None:
    """The gate reads each kind of judge check over its own newest rows (`checks_of_judge`): a
    canary or a re-ordering drawn for a share of groups keeps its last `window` checks however
    many groups came after. Partial indexes, one per kind, so a kind with no rows (switched
    off) is answered at once."""
    for name, column in (("canaries", "canary_passed"), ("positions", "position_tau")):
        conn.execute(
            text(
                f"CREATE INDEX ix_judge_checks_{name} "
                f"ON judge_checks (judge_model, rubric_hash, id) WHERE {column} IS NOT NULL"
            )
        )


def _json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


MIGRATIONS: list[Migration] = [
    Migration(1, "m001_initial", _m001_initial),
    Migration(2, "m002_groups_and_adapters", _m002_groups_and_adapters),
    Migration(3, "m003_bounded_linking", _m003_bounded_linking),
    Migration(4, "m004_keys_owners_leases", _m004_keys_owners_leases),
    Migration(5, "m005_untrained_groups", _m005_untrained_groups),
    Migration(6, "m006_judge_checks", _m006_judge_checks),
    Migration(7, "m007_adapter_rollout", _m007_adapter_rollout),
    Migration(8, "m008_call_protocols", _m008_call_protocols),
    Migration(9, "m009_replicas", _m009_replicas),
    Migration(10, "m010_prompt_chunks", _m010_prompt_chunks),
    Migration(11, "m011_tool_call_link_key", _m011_tool_call_link_key),
    Migration(12, "m012_session_lanes", _m012_session_lanes),
    Migration(13, "m013_held_out", _m013_held_out),
    Migration(14, "m014_judge_check_kinds", _m014_judge_check_kinds),
]


def _create_migrations_table(conn: Connection) -> None:
    md = MetaData()
    Table(
        "migrations",
        md,
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("name", String, nullable=False, unique=True),
        Column("applied_at", Double, nullable=False),
    )
    md.create_all(conn, checkfirst=True)


def _apply_pending(conn: Connection) -> list[str]:
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_ADVISORY_LOCK_KEY})
    _create_migrations_table(conn)
    applied = {row[0]: row[1] for row in conn.execute(text("SELECT id, name FROM migrations"))}
    done: list[str] = []
    for m in MIGRATIONS:
        if m.id in applied:
            if applied[m.id] != m.name:
                raise RuntimeError(
                    f"migration {m.id} is recorded as {applied[m.id]!r} but the code calls it "
                    f"{m.name!r}: this database was migrated by a different rlproxy version"
                )
            continue
        m.apply(conn)
        conn.execute(
            text("INSERT INTO migrations (id, name, applied_at) VALUES (:id, :name, :t)"),
            {"id": m.id, "name": m.name, "t": time.time()},
        )
        done.append(m.name)
    unknown = set(applied) - {m.id for m in MIGRATIONS}
    if unknown:
        log.warning("database has migrations this code does not know: %s", sorted(unknown))
    return done


async def migrate(engine: AsyncEngine) -> list[str]:
    """Apply pending migrations in order; return the names applied now."""
    async with engine.begin() as conn:
        done = await conn.run_sync(_apply_pending)
    if done:
        log.info("applied migrations: %s", ", ".join(done))
    return done
