"""API keys: how a key is made, how its secret is kept, and the SQL of the `api_keys` table.

A key reads `rlp-<id>-<secret>`: a public id (12 hex digits, stored and shown in lists and logs)
and a 48-hex-digit secret (192 random bits) that is printed once and never stored. The table
keeps a random salt per key and SHA-256(salt + secret). A fast hash is enough here: the secret is
random, not a password, so there is nothing to guess from the hash. Comparison is constant-time.

The installation's salt (written once by migration 4) keys the hash that names an unregistered
bearer token in the calls table (`client_ref`), so that name says nothing about the token.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from typing import Literal

from sqlalchemy import select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection

from storage.models import api_keys_table as K

KeyScope = Literal["inference", "admin"]
SCOPES: tuple[KeyScope, ...] = ("inference", "admin")
PREFIX = "rlp-"


@dataclass(frozen=True)
class ApiKeyRecord:
    id: str
    name: str
    scope: KeyScope
    created_at: float
    revoked_at: float | None
    salt: str
    secret_hash: str

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    def matches(self, secret: str) -> bool:
        """Constant-time check of a presented secret against the stored hash."""
        return hmac.compare_digest(_hash(self.salt, secret), self.secret_hash)


def _hash(salt: str, secret: str) -> str:
    return hashlib.sha256(f"{salt}:{secret}".encode()).hexdigest()


def new_key(name: str, scope: KeyScope, now: float | None = None) -> tuple[ApiKeyRecord, str]:
    """A fresh key: its record (salted hash only) and the one printable form of the key."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)}, not {scope!r}")
    if not name.strip():
        raise ValueError("a key needs a name (who or what uses it)")
    key_id, secret, salt = secrets.token_hex(6), secrets.token_hex(24), secrets.token_hex(16)
    record = ApiKeyRecord(
        id=key_id,
        name=name.strip(),
        scope=scope,
        created_at=time.time() if now is None else now,
        revoked_at=None,
        salt=salt,
        secret_hash=_hash(salt, secret),
    )
    return record, f"{PREFIX}{key_id}-{secret}"


def split_key(presented: str) -> tuple[str, str] | None:
    """(id, secret) of a key in rlproxy's form, or None for anything else."""
    if not presented.startswith(PREFIX):
        return None
    key_id, sep, secret = presented[len(PREFIX) :].partition("-")
    if not sep or not key_id or not secret:
        return None
    return key_id, secret


def client_ref(salt: str, token: str) -> str:
    """A stable, non-reversible name for a bearer token that is not an rlproxy key."""
    return "client_" + hmac.new(salt.encode(), token.encode(), hashlib.sha256).hexdigest()[:32]


# --- SQL -----------------------------------------------------------------------------------


def _record(row: object) -> ApiKeyRecord:
    return ApiKeyRecord(
        id=row.id,  # type: ignore[attr-defined]
        name=row.name,  # type: ignore[attr-defined]
        scope=row.scope,  # type: ignore[attr-defined]
        created_at=row.created_at,  # type: ignore[attr-defined]
        revoked_at=row.revoked_at,  # type: ignore[attr-defined]
        salt=row.salt,  # type: ignore[attr-defined]
        secret_hash=row.secret_hash,  # type: ignore[attr-defined]
    )


async def insert_key(conn: AsyncConnection, record: ApiKeyRecord) -> None:
    await conn.execute(
        K.insert().values(
            id=record.id,
            name=record.name,
            scope=record.scope,
            salt=record.salt,
            secret_hash=record.secret_hash,
            created_at=record.created_at,
            revoked_at=record.revoked_at,
        )
    )


async def all_keys(conn: AsyncConnection) -> list[ApiKeyRecord]:
    rows = (await conn.execute(select(K).order_by(K.c.created_at, K.c.id))).all()
    return [_record(r) for r in rows]


async def revoke_key(conn: AsyncConnection, key_id: str, now: float) -> bool:
    result = await conn.execute(
        update(K).where(K.c.id == key_id, K.c.revoked_at.is_(None)).values(revoked_at=now)
    )
    return bool(result.rowcount)


async def installation_salt(conn: AsyncConnection) -> str:
    row = (
        await conn.execute(text("SELECT value FROM installation WHERE name = 'key_salt'"))
    ).first()
    if row is None:
        raise RuntimeError("the database has no installation salt: was migration 4 applied?")
    return str(row.value)


async def delete_owner_data(conn: AsyncConnection, key_id: str) -> dict[str, int]:
    """Delete every trajectory, call, reward, group and score a key owns; return the counts.

    Adapters already trained on that data are not touched (they hold no text, only weights)."""
    owned_t = "SELECT id FROM trajectories WHERE owner_key_id = :k"
    owned_g = "SELECT id FROM groups WHERE owner_key_id = :k"
    owned_c = f"SELECT id FROM calls WHERE trajectory_id IN ({owned_t})"
    steps = [
        ("scores", f"DELETE FROM scores WHERE group_id IN ({owned_g})"),
        ("judge_checks", "DELETE FROM judge_checks WHERE owner_key_id = :k"),
        (
            "group_members",
            f"DELETE FROM group_members WHERE group_id IN ({owned_g}) "
            f"OR trajectory_id IN ({owned_t})",
        ),
        ("groups", "DELETE FROM groups WHERE owner_key_id = :k"),
        ("call_choices", f"DELETE FROM call_choices WHERE call_id IN ({owned_c})"),
        ("call_samples", f"DELETE FROM call_samples WHERE call_id IN ({owned_c})"),
        ("rewards", f"DELETE FROM rewards WHERE trajectory_id IN ({owned_t})"),
        ("calls", f"DELETE FROM calls WHERE trajectory_id IN ({owned_t})"),
        ("trajectories", "DELETE FROM trajectories WHERE owner_key_id = :k"),
        # Prompt chunks are hashed per owner (storage.prompt_chunks): no other key's call
        # refers to one of these.
        ("prompt_chunks", "DELETE FROM prompt_chunks WHERE owner_key_id = :k"),
    ]
    counts: dict[str, int] = {}
    for table, sql in steps:
        result = await conn.execute(text(sql), {"k": key_id})
        counts[table] = int(result.rowcount or 0)
    return counts
