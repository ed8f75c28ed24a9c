"""`rlproxy keys`: create, list and revoke the API keys the server accepts.

    rlproxy keys create --name ci-agents --scope inference    prints the key once
    rlproxy keys list
    rlproxy keys revoke 3f9a1c0b7d2e
    rlproxy keys delete-data 3f9a1c0b7d2e                    forget everything its calls left

Keys live in the database (only a salted hash of each secret), so every replica on one
database accepts the same keys; a running server notices a change within RLPROXY_KEY_REFRESH_S.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from proxy.database import opened_store
from proxy.settings import Settings
from storage.api_keys import KeyScope


async def create_key(settings: Settings, name: str, scope: KeyScope, out: TextIO) -> int:
    async with opened_store(settings) as store:
        record, key = await store.create_api_key(name, scope)
    print(key, file=out)
    print(
        f"rlproxy keys: created {record.scope} key {record.id} ({record.name!r}). "
        "This is the only time the key is shown: store it now.",
        file=sys.stderr,
    )
    return 0


async def list_keys(settings: Settings, out: TextIO) -> int:
    async with opened_store(settings) as store:
        keys = await store.list_api_keys()
    if not keys:
        print("no API keys: the server is open, and serves on loopback only", file=out)
        return 0
    print(f"{'id':<14}{'scope':<11}{'created (UTC)':<21}{'revoked (UTC)':<21}name", file=out)
    for k in keys:
        revoked = _utc(k.revoked_at) if k.revoked_at is not None else "-"
        print(f"{k.id:<14}{k.scope:<11}{_utc(k.created_at):<21}{revoked:<21}{k.name}", file=out)
    return 0


async def revoke_key(settings: Settings, key_id: str, out: TextIO) -> int:
    async with opened_store(settings) as store:
        done = await store.revoke_api_key(key_id)
    if not done:
        print(f"rlproxy keys: no active key {key_id!r}", file=sys.stderr)
        return 1
    print(f"revoked {key_id}", file=out)
    return 0


async def delete_data(settings: Settings, key_id: str, out: TextIO) -> int:
    async with opened_store(settings) as store:
        counts = await store.delete_key_data(key_id)
    deleted = ", ".join(f"{n} {table}" for table, n in counts.items() if n) or "nothing"
    print(f"deleted {deleted} of key {key_id}", file=out)
    return 0


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))
