"""SQLAlchemy 2 declarative models: the current shape of the database, for queries.

The schema a database actually has is created by the ordered migrations in
`storage.migrations`; `tests/storage/test_schema.py` checks that these models and the migrated
schema agree. JSON is stored as text (`JSONText`) on both backends so that token ids, logprobs
(including -Infinity) and message dicts round-trip exactly, key order included.

This module holds no queries and no engine setup.
"""

from __future__ import annotations

import json
from typing import Any, cast

from sqlalchemy import Boolean, Double, ForeignKey, Index, Integer, String, Table, Text, text
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator


class JSONText(TypeDecorator[Any]):
    """Any JSON value, stored as compact text. NaN/Infinity allowed (logprobs can be -inf)."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> str | None:
        if value is None:
            return None
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))

    def process_result_value(self, value: str | None, dialect: Dialect) -> Any:
        return None if value is None else json.loads(value)


class Base(DeclarativeBase):
    pass


class Migration(Base):
    __tablename__ = "migrations"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    name: Mapped[str] = mapped_column(String, unique=True)
    applied_at: Mapped[float] = mapped_column(Double)


class Trajectory(Base):
    __tablename__ = "trajectories"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    status: Mapped[str] = mapped_column(String)  # "open" | "closed"
    created_at: Mapped[float] = mapped_column(Double)
    updated_at: Mapped[float] = mapped_column(Double)
    closed_at: Mapped[float | None] = mapped_column(Double)
    close_reason: Mapped[str | None] = mapped_column(String)  # "end" | "reward" | "idle"
    group_key: Mapped[str | None] = mapped_column(String)
    model: Mapped[str | None] = mapped_column(String)
    turn_count: Mapped[int] = mapped_column(Integer)
    call_count: Mapped[int] = mapped_column(Integer)
    explicit: Mapped[bool] = mapped_column(Boolean)
    task_signature: Mapped[str | None] = mapped_column(String)
    # Linking state: hash(last request + its answer), hash(last request), and the last call.
    next_prefix_hash: Mapped[str | None] = mapped_column(String)
    last_request_hash: Mapped[str | None] = mapped_column(String)
    last_call_id: Mapped[str | None] = mapped_column(String)
    last_call_created_at: Mapped[float | None] = mapped_column(Double)
    last_call_finished_at: Mapped[float | None] = mapped_column(Double)
    last_call_status: Mapped[str | None] = mapped_column(String)
    # The API key whose calls make up this trajectory (None when the server has no keys).
    owner_key_id: Mapped[str | None] = mapped_column(String)
    # Linking's second key: hash(last request + the ids of its answer's tool calls), or None.
    next_tool_call_hash: Mapped[str | None] = mapped_column(String)
    # Linking's last key (storage.linking): the coding-agent session lane of its latest call
    # that had one (hashed with the owner) and that call's agent signature; the trajectory of
    # the agent that started this one (a sub-agent's main agent), if any.
    session_lane: Mapped[str | None] = mapped_column(String)
    agent_signature: Mapped[str | None] = mapped_column(String)
    parent_trajectory_id: Mapped[str | None] = mapped_column(String)
    # A task kept out of training (storage.held_out): never grouped, evaluated instead.
    held_out: Mapped[bool] = mapped_column(Boolean)

    __table_args__ = (
        # Linking's lookups (storage.trajectory_view): newest first within one hash.
        Index("ix_trajectories_prefix_lookup", "status", "next_prefix_hash", "updated_at", "id"),
        Index(
            "ix_trajectories_tool_call_lookup", "status", "next_tool_call_hash", "updated_at", "id"
        ),
        Index(
            "ix_trajectories_request_lookup",
            "status",
            "last_request_hash",
            "last_call_status",
            "updated_at",
            "id",
        ),
        # The newest open trajectory of a lane and agent (rewritten histories), and the newest of
        # a lane whatever its status or agent (a new trajectory's parent).
        Index(
            "ix_trajectories_lane_lookup",
            "status",
            "session_lane",
            "agent_signature",
            "updated_at",
            "id",
        ),
        Index("ix_trajectories_lane_newest", "session_lane", "updated_at", "id"),
        Index("ix_trajectories_parent", "parent_trajectory_id", "created_at", "id"),
        Index("ix_trajectories_status_updated_at", "status", "updated_at"),
        Index("ix_trajectories_created_at_id", "created_at", "id"),
        Index("ix_trajectories_status_created_at_id", "status", "created_at", "id"),
        Index("ix_trajectories_group_key", "group_key"),
        Index("ix_trajectories_task_signature", "task_signature"),
        Index("ix_trajectories_owner", "owner_key_id", "created_at", "id"),
        Index("ix_trajectories_held_out", "held_out", "created_at", "id"),
    )


class Call(Base):
    __tablename__ = "calls"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    request_id: Mapped[str | None] = mapped_column(String)
    created_at: Mapped[float] = mapped_column(Double)
    finished_at: Mapped[float] = mapped_column(Double)
    recorded_at: Mapped[float] = mapped_column(Double)
    model_requested: Mapped[str] = mapped_column(String)
    adapter_version: Mapped[int | None] = mapped_column(Integer)
    engine: Mapped[str] = mapped_column(String)
    params: Mapped[Any] = mapped_column(JSONText, nullable=False)
    response: Mapped[Any] = mapped_column(JSONText, nullable=True)
    usage: Mapped[Any] = mapped_column(JSONText, nullable=True)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    latency_s: Mapped[float] = mapped_column(Double)
    status: Mapped[str] = mapped_column(String)
    error: Mapped[str | None] = mapped_column(Text)
    api_key_id: Mapped[str | None] = mapped_column(String)
    stream: Mapped[bool] = mapped_column(Boolean)
    token_ids_note: Mapped[str | None] = mapped_column(Text)
    explicit_trajectory_id: Mapped[str | None] = mapped_column(String)
    explicit_group_key: Mapped[str | None] = mapped_column(String)
    retry_count: Mapped[int] = mapped_column(Integer)
    request_hash: Mapped[str | None] = mapped_column(String)
    trajectory_id: Mapped[str] = mapped_column(String, ForeignKey("trajectories.id"))
    turn_index: Mapped[int] = mapped_column(Integer)
    retry_of: Mapped[str | None] = mapped_column(String)
    superseded_by: Mapped[str | None] = mapped_column(String)
    completion_id: Mapped[str | None] = mapped_column(String)
    protocol: Mapped[str | None] = mapped_column(String)
    retrievable: Mapped[bool | None] = mapped_column(Boolean)
    # The prompt, by content (storage.prompt_chunks): the hashes of the request messages (one a
    # message), of the tools (one a tool; None: no tools) and of the prompt token ids (one per
    # block; None: no token ids).
    message_refs: Mapped[Any] = mapped_column(JSONText, nullable=False)
    tool_refs: Mapped[Any] = mapped_column(JSONText, nullable=True)
    token_refs: Mapped[Any] = mapped_column(JSONText, nullable=True)
    # Linked by its session lane only: the agent rewrote the history before this turn.
    history_rewritten: Mapped[bool] = mapped_column(Boolean)

    __table_args__ = (
        Index("ix_calls_trajectory_id_turn_index", "trajectory_id", "turn_index"),
        Index("ix_calls_created_at", "created_at"),
        Index("ix_calls_request_id", "request_id"),
        Index("ix_calls_completion_id", "completion_id"),
    )


class PromptChunk(Base):
    """A piece of some calls' prompts, stored once: one request message or tool declaration
    (JSON), or one block of prompt token ids (a JSON list). `hash` is seeded with the owner, so
    keys never share one."""

    __tablename__ = "prompt_chunks"

    hash: Mapped[str] = mapped_column(String, primary_key=True)
    owner_key_id: Mapped[str | None] = mapped_column(String)
    body: Mapped[str] = mapped_column(Text)

    __table_args__ = (Index("ix_prompt_chunks_owner", "owner_key_id"),)


class CallChoice(Base):
    __tablename__ = "call_choices"

    call_id: Mapped[str] = mapped_column(String, ForeignKey("calls.id"), primary_key=True)
    choice_index: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    message: Mapped[Any] = mapped_column(JSONText, nullable=False)
    finish_reason: Mapped[str | None] = mapped_column(String)
    completion_token_ids: Mapped[Any] = mapped_column(JSONText, nullable=True)
    completion_logprobs: Mapped[Any] = mapped_column(JSONText, nullable=True)


class Reward(Base):
    __tablename__ = "rewards"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    trajectory_id: Mapped[str] = mapped_column(String, ForeignKey("trajectories.id"))
    reward: Mapped[float] = mapped_column(Double)
    source: Mapped[str] = mapped_column(String)
    created_at: Mapped[float] = mapped_column(Double)
    explanation: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (Index("ix_rewards_trajectory_id", "trajectory_id"),)


class CallSample(Base):
    """A shadow sample: an alternative completion generated beside the returned one."""

    __tablename__ = "call_samples"

    call_id: Mapped[str] = mapped_column(String, ForeignKey("calls.id"), primary_key=True)
    sample_index: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    message: Mapped[Any] = mapped_column(JSONText, nullable=False)
    finish_reason: Mapped[str | None] = mapped_column(String)
    completion_token_ids: Mapped[Any] = mapped_column(JSONText, nullable=True)
    completion_logprobs: Mapped[Any] = mapped_column(JSONText, nullable=True)


class Group(Base):
    __tablename__ = "groups"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    source: Mapped[str] = mapped_column(String)  # "explicit" | "task" | "shadow" | "cohort"
    key: Mapped[str] = mapped_column(String)
    status: Mapped[str] = mapped_column(String)  # forming|ready|scoring|scored|failed|expired
    created_at: Mapped[float] = mapped_column(Double)
    updated_at: Mapped[float] = mapped_column(Double)
    ready_at: Mapped[float | None] = mapped_column(Double)
    scored_at: Mapped[float | None] = mapped_column(Double)
    member_count: Mapped[int] = mapped_column(Integer)
    rubric_hash: Mapped[str | None] = mapped_column(String)
    judge_model: Mapped[str | None] = mapped_column(String)
    judge_latency_s: Mapped[float | None] = mapped_column(Double)
    judge_attempts: Mapped[int | None] = mapped_column(Integer)
    judge_prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    judge_completion_tokens: Mapped[int | None] = mapped_column(Integer)
    judge_cost_usd: Mapped[float | None] = mapped_column(Double)
    failure: Mapped[str | None] = mapped_column(Text)
    trained_step: Mapped[int | None] = mapped_column(Integer)
    trained_at: Mapped[float | None] = mapped_column(Double)
    # The API key whose trajectories form this group (None when the server has no keys).
    owner_key_id: Mapped[str | None] = mapped_column(String)
    # The scorer holding a "scoring" group, and until when; an expired lease may be taken.
    claimed_by: Mapped[str | None] = mapped_column(String)
    lease_until: Mapped[float | None] = mapped_column(Double)
    # Why a scored group's scores are held (status "held"): its judge failed its checks.
    hold_reason: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        Index("ix_groups_source_key_status", "source", "key", "status"),
        Index("ix_groups_status_created_at", "status", "created_at"),
        Index("ix_groups_created_at_id", "created_at", "id"),
        Index("ix_groups_owner", "owner_key_id", "created_at", "id"),
        Index("ix_groups_untrained", "status", "trained_step", "created_at", "id"),
    )


class ApiKey(Base):
    """A client key: only a salted hash of its secret is kept."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    name: Mapped[str] = mapped_column(String)
    scope: Mapped[str] = mapped_column(String)  # "inference" | "admin"
    salt: Mapped[str] = mapped_column(String)
    secret_hash: Mapped[str] = mapped_column(String)
    created_at: Mapped[float] = mapped_column(Double)
    revoked_at: Mapped[float | None] = mapped_column(Double)


class Installation(Base):
    """Facts of this installation, written once by a migration (`key_salt`)."""

    __tablename__ = "installation"

    name: Mapped[str] = mapped_column(String, primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class GroupMember(Base):
    """A trajectory (call_id None) or one sampled answer at a turn (call_id + an index)."""

    __tablename__ = "group_members"

    group_id: Mapped[str] = mapped_column(String, ForeignKey("groups.id"), primary_key=True)
    member_id: Mapped[str] = mapped_column(String, primary_key=True)
    position: Mapped[int] = mapped_column(Integer)
    trajectory_id: Mapped[str] = mapped_column(String, ForeignKey("trajectories.id"))
    call_id: Mapped[str | None] = mapped_column(String)
    choice_index: Mapped[int | None] = mapped_column(Integer)
    sample_index: Mapped[int | None] = mapped_column(Integer)
    added_at: Mapped[float] = mapped_column(Double)

    __table_args__ = (Index("ix_group_members_trajectory_id", "trajectory_id"),)


class Score(Base):
    """A judge's score of one group member."""

    __tablename__ = "scores"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    group_id: Mapped[str] = mapped_column(String, ForeignKey("groups.id"))
    member_id: Mapped[str] = mapped_column(String)
    score: Mapped[float] = mapped_column(Double)
    explanation: Mapped[str | None] = mapped_column(Text)
    judge_model: Mapped[str] = mapped_column(String)
    rubric_hash: Mapped[str | None] = mapped_column(String)
    latency_s: Mapped[float | None] = mapped_column(Double)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    cost_usd: Mapped[float | None] = mapped_column(Double)
    created_at: Mapped[float] = mapped_column(Double)

    __table_args__ = (Index("ix_scores_group_id", "group_id"),)


class JudgeCheck(Base):
    """What one judging of a group told about its judge: how it placed a canary, whether it
    agreed with itself in another order, with the environment's rewards; the gate's decision."""

    __tablename__ = "judge_checks"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    group_id: Mapped[str] = mapped_column(String)
    owner_key_id: Mapped[str | None] = mapped_column(String)
    created_at: Mapped[float] = mapped_column(Double)
    judge_model: Mapped[str] = mapped_column(String)
    rubric_hash: Mapped[str] = mapped_column(String)
    member_count: Mapped[int] = mapped_column(Integer)
    canary_kind: Mapped[str | None] = mapped_column(String)  # empty|refusal|copied|truncated
    canary_member_id: Mapped[str | None] = mapped_column(String)
    canary_score: Mapped[float | None] = mapped_column(Double)
    canary_median: Mapped[float | None] = mapped_column(Double)
    canary_passed: Mapped[bool | None] = mapped_column(Boolean)
    position_tau: Mapped[float | None] = mapped_column(Double)
    env_members: Mapped[int | None] = mapped_column(Integer)
    env_spearman: Mapped[float | None] = mapped_column(Double)
    env_kendall: Mapped[float | None] = mapped_column(Double)
    mean_reward: Mapped[float | None] = mapped_column(Double)
    completion_tokens_mean: Mapped[float | None] = mapped_column(Double)
    completion_tokens_std: Mapped[float | None] = mapped_column(Double)
    decision: Mapped[str] = mapped_column(String)  # train | held
    reason: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        Index("ix_judge_checks_judge", "judge_model", "rubric_hash", "id"),
        Index("ix_judge_checks_owner", "owner_key_id", "id"),
        # Each kind of check read over its own newest rows (`checks_of_judge`): partial, so a
        # kind that is off (no rows) is found empty at once, not by a scan of the history.
        Index(
            "ix_judge_checks_canaries",
            "judge_model",
            "rubric_hash",
            "id",
            sqlite_where=text("canary_passed IS NOT NULL"),
            postgresql_where=text("canary_passed IS NOT NULL"),
        ),
        Index(
            "ix_judge_checks_positions",
            "judge_model",
            "rubric_hash",
            "id",
            sqlite_where=text("position_tau IS NOT NULL"),
            postgresql_where=text("position_tau IS NOT NULL"),
        ),
    )


class Adapter(Base):
    """An adapter version the trainer wrote, and what serving made of it."""

    __tablename__ = "adapters"

    policy: Mapped[str] = mapped_column(String, primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    path: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String)  # written | loaded | rejected
    created_at: Mapped[float] = mapped_column(Double)
    updated_at: Mapped[float] = mapped_column(Double)
    loaded_at: Mapped[float | None] = mapped_column(Double)
    activated_at: Mapped[float | None] = mapped_column(Double)
    error: Mapped[str | None] = mapped_column(Text)
    metrics: Mapped[Any] = mapped_column(JSONText, nullable=True)
    rollout: Mapped[Any] = mapped_column(JSONText, nullable=True)  # canary state, decisions


class Lease(Base):
    """A job only one process of a deployment may run (the trainer, publishing), and who holds
    it until when; the holder renews it, anyone takes it once it has expired."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String, primary_key=True)
    holder: Mapped[str] = mapped_column(String)
    acquired_at: Mapped[float] = mapped_column(Double)
    expires_at: Mapped[float] = mapped_column(Double)


class PolicyState(Base):
    """What a policy name serves, for every replica: the active version (0: the base model) and
    the canary on trial beside it, with who set them and when."""

    __tablename__ = "policy_state"

    policy: Mapped[str] = mapped_column(String, primary_key=True)
    active_version: Mapped[int] = mapped_column(Integer)
    canary_version: Mapped[int | None] = mapped_column(Integer)
    canary_share: Mapped[float | None] = mapped_column(Double)
    changed_at: Mapped[float] = mapped_column(Double)
    changed_by: Mapped[str | None] = mapped_column(String)


class Replica(Base):
    """A serving replica, its heartbeat and the adapter versions it keeps loaded (on a shared
    engine no replica unloads a version a live one still keeps)."""

    __tablename__ = "replicas"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    policy: Mapped[str] = mapped_column(String)
    versions: Mapped[Any] = mapped_column(JSONText)  # [int, ...]
    started_at: Mapped[float] = mapped_column(Double)
    heartbeat_at: Mapped[float] = mapped_column(Double)


trajectories_table = cast(Table, Trajectory.__table__)
calls_table = cast(Table, Call.__table__)
call_choices_table = cast(Table, CallChoice.__table__)
prompt_chunks_table = cast(Table, PromptChunk.__table__)
rewards_table = cast(Table, Reward.__table__)
migrations_table = cast(Table, Migration.__table__)
call_samples_table = cast(Table, CallSample.__table__)
groups_table = cast(Table, Group.__table__)
group_members_table = cast(Table, GroupMember.__table__)
scores_table = cast(Table, Score.__table__)
adapters_table = cast(Table, Adapter.__table__)
judge_checks_table = cast(Table, JudgeCheck.__table__)
api_keys_table = cast(Table, ApiKey.__table__)
leases_table = cast(Table, Lease.__table__)
policy_state_table = cast(Table, PolicyState.__table__)
replicas_table = cast(Table, Replica.__table__)
