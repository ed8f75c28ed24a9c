"""The exact schema a blank database migrates to, on SQLite and on Postgres.

If this test fails after a model change, add a migration (storage/migrations.py) and update the
expected schema below and storage/models.py together.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import Boolean, Float, Integer, String, Text, inspect
from sqlalchemy.engine import Connection

from storage.engines import create_engines
from storage.migrations import MIGRATIONS, migrate
from storage.models import Base

pytestmark = pytest.mark.asyncio(loop_scope="session")

# table -> columns in order: "name kind" (+ " null" when nullable); pk; indexes; foreign keys.
EXPECTED: dict[str, dict[str, Any]] = {
    "migrations": {
        "columns": ["id int", "name str", "applied_at float"],
        "pk": ["id"],
        "unique": [["name"]],
        "indexes": {},
        "fks": [],
    },
    "trajectories": {
        "columns": [
            "id str",
            "status str",
            "created_at float",
            "updated_at float",
            "closed_at float null",
            "close_reason str null",
            "group_key str null",
            "model str null",
            "turn_count int",
            "call_count int",
            "explicit bool",
            "task_signature str null",
            "next_prefix_hash str null",
            "last_request_hash str null",
            "last_call_id str null",
            "last_call_created_at float null",
            "last_call_finished_at float null",
            "last_call_status str null",
            "owner_key_id str null",
            "next_tool_call_hash str null",
            "session_lane str null",
            "agent_signature str null",
            "parent_trajectory_id str null",
            "held_out bool",
        ],
        "pk": ["id"],
        "unique": [],
        "indexes": {
            "ix_trajectories_created_at_id": ["created_at", "id"],
            "ix_trajectories_owner": ["owner_key_id", "created_at", "id"],
            "ix_trajectories_held_out": ["held_out", "created_at", "id"],
            "ix_trajectories_status_created_at_id": ["status", "created_at", "id"],
            "ix_trajectories_group_key": ["group_key"],
            "ix_trajectories_request_lookup": [
                "status",
                "last_request_hash",
                "last_call_status",
                "updated_at",
                "id",
            ],
            "ix_trajectories_prefix_lookup": ["status", "next_prefix_hash", "updated_at", "id"],
            "ix_trajectories_tool_call_lookup": [
                "status",
                "next_tool_call_hash",
                "updated_at",
                "id",
            ],
            "ix_trajectories_lane_lookup": [
                "status",
                "session_lane",
                "agent_signature",
                "updated_at",
                "id",
            ],
            "ix_trajectories_lane_newest": ["session_lane", "updated_at", "id"],
            "ix_trajectories_parent": ["parent_trajectory_id", "created_at", "id"],
            "ix_trajectories_status_updated_at": ["status", "updated_at"],
            "ix_trajectories_task_signature": ["task_signature"],
        },
        "fks": [],
    },
    "calls": {
        "columns": [
            "id str",
            "request_id str null",
            "created_at float",
            "finished_at float",
            "recorded_at float",
            "model_requested str",
            "adapter_version int null",
            "engine str",
            "params text",
            "response text null",
            "usage text null",
            "prompt_tokens int null",
            "completion_tokens int null",
            "latency_s float",
            "status str",
            "error text null",
            "api_key_id str null",
            "stream bool",
            "token_ids_note text null",
            "explicit_trajectory_id str null",
            "explicit_group_key str null",
            "retry_count int",
            "request_hash str null",
            "trajectory_id str",
            "turn_index int",
            "retry_of str null",
            "superseded_by str null",
            "completion_id str null",
            "protocol str null",
            "retrievable bool null",
            "message_refs text",
            "tool_refs text null",
            "token_refs text null",
            "history_rewritten bool",
        ],
        "pk": ["id"],
        "unique": [],
        "indexes": {
            "ix_calls_completion_id": ["completion_id"],
            "ix_calls_created_at": ["created_at"],
            "ix_calls_request_id": ["request_id"],
            "ix_calls_trajectory_id_turn_index": ["trajectory_id", "turn_index"],
        },
        "fks": [(["trajectory_id"], "trajectories", ["id"])],
    },
    "prompt_chunks": {
        "columns": ["hash str", "owner_key_id str null", "body text"],
        "pk": ["hash"],
        "unique": [],
        "indexes": {"ix_prompt_chunks_owner": ["owner_key_id"]},
        "fks": [],
    },
    "call_choices": {
        "columns": [
            "call_id str",
            "choice_index int",
            "message text",
            "finish_reason str null",
            "completion_token_ids text null",
            "completion_logprobs text null",
        ],
        "pk": ["call_id", "choice_index"],
        "unique": [],
        "indexes": {},
        "fks": [(["call_id"], "calls", ["id"])],
    },
    "rewards": {
        "columns": [
            "id int",
            "trajectory_id str",
            "reward float",
            "source str",
            "created_at float",
            "explanation text null",
        ],
        "pk": ["id"],
        "unique": [],
        "indexes": {"ix_rewards_trajectory_id": ["trajectory_id"]},
        "fks": [(["trajectory_id"], "trajectories", ["id"])],
    },
    "call_samples": {
        "columns": [
            "call_id str",
            "sample_index int",
            "message text",
            "finish_reason str null",
            "completion_token_ids text null",
            "completion_logprobs text null",
        ],
        "pk": ["call_id", "sample_index"],
        "unique": [],
        "indexes": {},
        "fks": [(["call_id"], "calls", ["id"])],
    },
    "groups": {
        "columns": [
            "id str",
            "source str",
            "key str",
            "status str",
            "created_at float",
            "updated_at float",
            "ready_at float null",
            "scored_at float null",
            "member_count int",
            "rubric_hash str null",
            "judge_model str null",
            "judge_latency_s float null",
            "judge_attempts int null",
            "judge_prompt_tokens int null",
            "judge_completion_tokens int null",
            "judge_cost_usd float null",
            "failure text null",
            "trained_step int null",
            "trained_at float null",
            "owner_key_id str null",
            "claimed_by str null",
            "lease_until float null",
            "hold_reason text null",
        ],
        "pk": ["id"],
        "unique": [],
        "indexes": {
            "ix_groups_owner": ["owner_key_id", "created_at", "id"],
            "ix_groups_untrained": ["status", "trained_step", "created_at", "id"],
            "ix_groups_source_key_status": ["source", "key", "status"],
            "ix_groups_status_created_at": ["status", "created_at"],
            "ix_groups_created_at_id": ["created_at", "id"],
        },
        "fks": [],
    },
    "group_members": {
        "columns": [
            "group_id str",
            "member_id str",
            "position int",
            "trajectory_id str",
            "call_id str null",
            "choice_index int null",
            "sample_index int null",
            "added_at float",
        ],
        "pk": ["group_id", "member_id"],
        "unique": [],
        "indexes": {"ix_group_members_trajectory_id": ["trajectory_id"]},
        "fks": [
            (["group_id"], "groups", ["id"]),
            (["trajectory_id"], "trajectories", ["id"]),
        ],
    },
    "scores": {
        "columns": [
            "id int",
            "group_id str",
            "member_id str",
            "score float",
            "explanation text null",
            "judge_model str",
            "rubric_hash str null",
            "latency_s float null",
            "prompt_tokens int null",
            "completion_tokens int null",
            "cost_usd float null",
            "created_at float",
        ],
        "pk": ["id"],
        "unique": [],
        "indexes": {"ix_scores_group_id": ["group_id"]},
        "fks": [(["group_id"], "groups", ["id"])],
    },
    "judge_checks": {
        "columns": [
            "id int",
            "group_id str",
            "owner_key_id str null",
            "created_at float",
            "judge_model str",
            "rubric_hash str",
            "member_count int",
            "canary_kind str null",
            "canary_member_id str null",
            "canary_score float null",
            "canary_median float null",
            "canary_passed bool null",
            "position_tau float null",
            "env_members int null",
            "env_spearman float null",
            "env_kendall float null",
            "mean_reward float null",
            "completion_tokens_mean float null",
            "completion_tokens_std float null",
            "decision str",
            "reason text null",
        ],
        "pk": ["id"],
        "unique": [],
        "indexes": {
            "ix_judge_checks_judge": ["judge_model", "rubric_hash", "id"],
            "ix_judge_checks_owner": ["owner_key_id", "id"],
            "ix_judge_checks_canaries": ["judge_model", "rubric_hash", "id"],
            "ix_judge_checks_positions": ["judge_model", "rubric_hash", "id"],
        },
        "fks": [],
    },
    "adapters": {
        "columns": [
            "policy str",
            "version int",
            "path text",
            "status str",
            "created_at float",
            "updated_at float",
            "loaded_at float null",
            "activated_at float null",
            "error text null",
            "metrics text null",
            "rollout text null",
        ],
        "pk": ["policy", "version"],
        "unique": [],
        "indexes": {},
        "fks": [],
    },
    "api_keys": {
        "columns": [
            "id str",
            "name str",
            "scope str",
            "salt str",
            "secret_hash str",
            "created_at float",
            "revoked_at float null",
        ],
        "pk": ["id"],
        "unique": [],
        "indexes": {},
        "fks": [],
    },
    "installation": {
        "columns": ["name str", "value text"],
        "pk": ["name"],
        "unique": [],
        "indexes": {},
        "fks": [],
    },
    "leases": {
        "columns": ["name str", "holder str", "acquired_at float", "expires_at float"],
        "pk": ["name"],
        "unique": [],
        "indexes": {},
        "fks": [],
    },
    "policy_state": {
        "columns": [
            "policy str",
            "active_version int",
            "canary_version int null",
            "canary_share float null",
            "changed_at float",
            "changed_by str null",
        ],
        "pk": ["policy"],
        "unique": [],
        "indexes": {},
        "fks": [],
    },
    "replicas": {
        "columns": [
            "id str",
            "policy str",
            "versions text",
            "started_at float",
            "heartbeat_at float",
        ],
        "pk": ["id"],
        "unique": [],
        "indexes": {},
        "fks": [],
    },
}


def _kind(t: Any) -> str:
    for cls, name in ((Boolean, "bool"), (Integer, "int"), (Float, "float"), (Text, "text")):
        if isinstance(t, cls):
            return name
    if isinstance(t, String):
        return "text" if t.__class__.__name__ == "TEXT" else "str"
    return repr(t)


def _describe(conn: Connection) -> dict[str, dict[str, Any]]:
    insp = inspect(conn)
    out: dict[str, dict[str, Any]] = {}
    for table in insp.get_table_names():
        cols = [
            f"{c['name']} {_kind(c['type'])}" + (" null" if c["nullable"] else "")
            for c in insp.get_columns(table)
        ]
        out[table] = {
            "columns": cols,
            "pk": insp.get_pk_constraint(table)["constrained_columns"],
            "unique": sorted(u["column_names"] for u in insp.get_unique_constraints(table)),
            "indexes": {
                i["name"]: i["column_names"]
                for i in insp.get_indexes(table)
                if not i.get("unique")  # Postgres lists unique constraints here too
            },
            "fks": [
                (f["constrained_columns"], f["referred_table"], f["referred_columns"])
                for f in insp.get_foreign_keys(table)
            ],
        }
    return out


async def _migrated_schema(url: str, schema: str | None) -> tuple[list[str], dict[str, Any]]:
    engines = create_engines(url, postgres_schema=schema)
    try:
        applied = await migrate(engines.write)
        async with engines.read.connect() as conn:
            return applied, await conn.run_sync(_describe)
    finally:
        await engines.dispose()


async def test_blank_database_migrates_to_expected_schema(db: Any) -> None:
    applied, schema = await _migrated_schema(db.url, db.schema)
    assert applied == [m.name for m in MIGRATIONS]
    assert schema == EXPECTED


async def test_models_match_migrated_schema(db: Any) -> None:
    """storage/models.py describes the same tables, columns and indexes as the migrations."""
    _, schema = await _migrated_schema(db.url, db.schema)
    for table in Base.metadata.sorted_tables:
        described = schema[table.name]
        cols = [
            f"{c.name} {_kind(c.type.impl if hasattr(c.type, 'impl') else c.type)}"
            + (" null" if c.nullable else "")
            for c in table.columns
        ]
        assert cols == described["columns"], table.name
        indexes = {i.name: [c.name for c in i.columns] for i in table.indexes}
        assert indexes == described["indexes"], table.name
    assert {t.name for t in Base.metadata.sorted_tables} == set(schema)


async def test_migrations_are_recorded_and_not_reapplied(db: Any) -> None:
    store = await db.open()
    await store.close()
    again, _ = await _migrated_schema(db.url, db.schema)
    assert again == []


async def test_concurrent_opens_migrate_once(db: Any) -> None:
    stores = await asyncio.gather(*(db.open() for _ in range(4)))
    assert all(s.dialect in ("sqlite", "postgresql") for s in stores)
    _, schema = await _migrated_schema(db.url, db.schema)
    assert schema == EXPECTED


async def test_many_stores_opening_one_new_sqlite_file_at_once(tmp_path: Any) -> None:
    """Switching a new file to WAL fails at once ("database is locked", no busy handler) for
    every connection that races another doing it; the switch is retried. (Before: about one
    round in ten of eight concurrent opens failed.)"""
    from storage import Store

    for round_ in range(20):
        url = f"sqlite+aiosqlite:///{tmp_path / f'r{round_}.db'}"
        stores = await asyncio.gather(*(Store.open(url) for _ in range(8)))
        for store in stores:
            await store.close()
