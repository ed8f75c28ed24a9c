"""A call's prompt (request messages, tools, prompt token ids), stored once by content.

Agents resend the whole history on every call, so call N+1's prompt is mostly call N's. Storing
each prompt whole made a session's rows grow with the square of its length (a 13-turn session of
a 2,733-token system prompt took 848 KB for a last request of 27 KB). Here a prompt is cut into
chunks, each stored once in `prompt_chunks` under the hash of its content, and a call row keeps
only the list of its chunks' hashes:

- messages: one chunk per message (its JSON text, key order kept), so a message resent on every
  turn is stored once and a call adds only the messages that are new;
- tools: one chunk per tool declaration (a coding agent resends tens of KB of them every call);
- prompt token ids: blocks of `TOKEN_BLOCK` ids at fixed positions (ids 0-127, 128-255, ...), so
  the blocks a prompt shares with the previous call's are stored once; the block where the two
  first differ and every later one are new chunks.

Why content addressing rather than "a reference to the parent call plus the new suffix": nothing
is assumed about what the previous call held. A client that edits earlier history, compaction,
or a re-tokenised boundary simply produce new chunks, and whatever is identical is shared, also
across trajectories (one agent's system prompt is stored once per API key, not once per
session). A write needs no earlier call (no chain to rebuild, one query for the hashes that exist
already); a read needs no chain either: one query for a call's chunks, whatever turn it is. Writing
costs no more CPU than encoding the whole prompt did: only hashes are computed for chunks that
exist, and a token block is hashed as 8-byte integers, turned into JSON only when missing. The
cost is the list of hashes each call keeps (22 characters and JSON quoting a chunk), which still
grows with the history: about 1/30 of what the whole prompt took (a 100-token message is ~500
characters of JSON, a 128-id block ~700).

Hashes are seeded with the owning API key (`CallRecord.owner_key_id`), so keys never share a
chunk and deleting a key's data deletes its chunks (`storage.api_keys.delete_owner_data`).

Any split reads back the same: readers only follow hashes, so a later change of the block size
or of the split (or the migration that moved older rows here, `m010_prompt_chunks`) needs no
rewrite. This module holds the split, the join and their SQL; callers are `storage.write_ops`,
`storage.read_ops` (whose `read_calls` every reader of whole calls goes through),
`storage.group_ops`, `storage.migrations` (m010), and scripts that read a SQLite file
(`sqlite_prompts`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import sqlite3
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Row, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from storage.models import prompt_chunks_table as P

TOKEN_BLOCK = 128
"""Prompt token ids per chunk. Smaller blocks store less of a changed tail again; larger ones
keep fewer hashes per call. At 128 the tail costs ~0.6 KB a call and the hashes ~0.2 KB per
1,000 prompt tokens."""

_QUERY_SLICE = 500
"""Hashes per `IN (...)` query: far below SQLite's and asyncpg's bound-parameter limits."""


def _dumps(value: Any) -> str:
    """Compact JSON, as `storage.models.JSONText` writes it (key order and -Infinity kept)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _seed(owner: str | None, kind: str) -> Any:
    """sha256 fed with (owner, kind): copied per chunk, so each chunk hashes only its body."""
    h = hashlib.sha256()
    h.update(f"{owner or ''}\x00{kind}\x00".encode())
    return h


def _name(h: Any) -> str:
    """128 bits of the hash, base64url without padding (22 characters)."""
    return base64.urlsafe_b64encode(h.digest()[:16])[:22].decode()


def _token_bytes(block: list[int]) -> bytes:
    """The ids as 8-byte integers (a fraction of JSON's cost); JSON for ids that do not fit."""
    try:
        return array("q", block).tobytes()
    except OverflowError:
        return _dumps(block).encode()


@dataclass
class SplitPrompts:
    """The chunks of a batch of prompts (deduplicated), to insert where missing.

    Only a chunk's hash is computed for every call; the JSON text of a token block is built
    only for the blocks `insert_missing` finds missing (a long prompt's are mostly stored)."""

    values: dict[str, str | list[int]] = field(default_factory=dict)
    """hash -> a message's or tool's JSON text, or a token block (JSON only when inserted)."""
    owners: dict[str, str | None] = field(default_factory=dict)

    def _add(self, owner: str | None, h: Any, value: str | list[int]) -> str:
        key = _name(h)
        if key not in self.values:
            self.values[key] = value
            self.owners[key] = owner
        return key

    def _json_chunks(self, owner: str | None, kind: str, items: Sequence[Any]) -> list[str]:
        seed, out = _seed(owner, kind), []
        for item in items:
            body = _dumps(item)
            h = seed.copy()
            h.update(body.encode())
            out.append(self._add(owner, h, body))
        return out

    def messages(self, owner: str | None, messages: Sequence[Any]) -> list[str]:
        """The hashes of these messages, in order (the `calls.message_refs` value)."""
        return self._json_chunks(owner, "m", messages)

    def tools(self, owner: str | None, tools: Sequence[Any] | None) -> list[str] | None:
        """The hashes of these tool declarations, in order (the `calls.tool_refs` value)."""
        return None if tools is None else self._json_chunks(owner, "f", tools)

    def token_ids(self, owner: str | None, ids: Sequence[int] | None) -> list[str] | None:
        """The hashes of these ids' blocks, in order (the `calls.token_refs` value)."""
        if ids is None:
            return None
        seed, ids, out = _seed(owner, "t"), list(ids), []
        for i in range(0, len(ids), TOKEN_BLOCK):
            block = ids[i : i + TOKEN_BLOCK]
            h = seed.copy()
            h.update(_token_bytes(block))
            out.append(self._add(owner, h, block))
        return out

    def body(self, key: str) -> str:
        """The JSON text stored for the chunk `key`."""
        value = self.values[key]
        return value if isinstance(value, str) else _dumps(value)


def _slices(items: Sequence[str]) -> Iterable[Sequence[str]]:
    for i in range(0, len(items), _QUERY_SLICE):
        yield items[i : i + _QUERY_SLICE]


async def insert_missing(conn: AsyncConnection, split: SplitPrompts) -> int:
    """Insert the chunks not stored yet; return how many the lookup did not find.

    One query finds the hashes that exist (most of a long session's), so their text is never
    sent again; the insert ignores a chunk another replica inserted meanwhile."""
    if not split.values:
        return 0
    wanted = list(split.values)
    present: set[str] = set()
    for part in _slices(wanted):
        present.update(r[0] for r in await conn.execute(select(P.c.hash).where(P.c.hash.in_(part))))
    rows = [
        {"hash": h, "owner_key_id": split.owners[h], "body": split.body(h)}
        for h in wanted
        if h not in present
    ]
    if rows:
        insert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
        await conn.execute(insert(P).on_conflict_do_nothing(index_elements=["hash"]), rows)
    return len(rows)


@dataclass(frozen=True)
class Prompt:
    """A call's prompt as `CallRecord` holds it: request messages, tools, prompt token ids."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    token_ids: list[int] | None


@dataclass(frozen=True)
class _Refs:
    messages: list[str]
    tools: list[str] | None
    token_ids: list[str] | None

    def all(self) -> list[str]:
        return [*self.messages, *(self.tools or ()), *(self.token_ids or ())]


async def _bodies(conn: AsyncConnection, hashes: set[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in _slices(sorted(hashes)):
        for r in await conn.execute(select(P.c.hash, P.c.body).where(P.c.hash.in_(part))):
            out[r.hash] = json.loads(r.body)
    return out


def _join(call_id: str, refs: _Refs, bodies: dict[str, Any]) -> Prompt:
    missing = [h for h in refs.all() if h not in bodies]
    if missing:
        raise RuntimeError(f"call {call_id}: prompt chunks missing from prompt_chunks: {missing}")
    return Prompt(
        messages=[bodies[h] for h in refs.messages],
        tools=None if refs.tools is None else [bodies[h] for h in refs.tools],
        token_ids=None
        if refs.token_ids is None
        else [i for h in refs.token_ids for i in bodies[h]],
    )


async def load_prompts(
    conn: AsyncConnection, rows: Sequence[Row[Any]], token_ids: bool = True
) -> dict[str, Prompt]:
    """The prompt of each `calls` row (with `id`, `message_refs`, `tool_refs` and, unless
    `token_ids` is False, `token_refs`), by call id, read with one query per `_QUERY_SLICE`
    distinct chunks whatever the number of calls. With `token_ids` False, `Prompt.token_ids`
    is None (grouping and judging need no token ids)."""
    refs = {
        r.id: _Refs(r.message_refs, r.tool_refs, r.token_refs if token_ids else None) for r in rows
    }
    bodies = await _bodies(conn, {h for r in refs.values() for h in r.all()})
    return {cid: _join(cid, r, bodies) for cid, r in refs.items()}


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def sqlite_prompts(conn: sqlite3.Connection, call_ids: Sequence[str]) -> dict[str, Prompt]:
    """The same for scripts and tests that read a SQLite file with the `sqlite3` module."""
    refs: dict[str, _Refs] = {}
    for i in range(0, len(call_ids), _QUERY_SLICE):
        part = list(call_ids[i : i + _QUERY_SLICE])
        marks = ",".join("?" * len(part))
        sql = f"SELECT id, message_refs, tool_refs, token_refs FROM calls WHERE id IN ({marks})"
        for cid, m, f, t in conn.execute(sql, part):
            refs[cid] = _Refs(json.loads(m), _loads(f), _loads(t))
    hashes = sorted({h for r in refs.values() for h in r.all()})
    bodies: dict[str, Any] = {}
    for i in range(0, len(hashes), _QUERY_SLICE):
        part = hashes[i : i + _QUERY_SLICE]
        marks = ",".join("?" * len(part))
        sql = f"SELECT hash, body FROM prompt_chunks WHERE hash IN ({marks})"
        bodies.update((h, json.loads(b)) for h, b in conn.execute(sql, part))
    return {cid: _join(cid, r, bodies) for cid, r in refs.items()}
