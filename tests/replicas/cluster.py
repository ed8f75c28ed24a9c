"""Several real `rlproxy serve` replicas on one fresh Postgres database and one checkpoint volume.

    with cluster(work, model_dir, ["a", "b"], env) as c:
        c.replicas["a"].url           # each on its own loopback port
        c.rows("SELECT ...")          # the shared database, straight
        c.kill("a")                   # SIGKILL

Each replica gets its own data directory under `work` (its server.log and trainer.log) with
`checkpoints` linked to the one folder `work/checkpoints`, as each machine would mount the same
volume; `RLPROXY_REPLICA_ID` is the replica's name. The database is new for each cluster
(127.0.0.1:5432 trust auth, or RLPROXY_TEST_POSTGRES_URL) and dropped afterwards.
Replicas start one after the other, in the order given.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
from sqlalchemy.engine import make_url

from tests.e2e.conftest import start_server, stop_server

POSTGRES_URL = os.environ.get(
    "RLPROXY_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
)


def _dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


async def _execute(sql: str) -> None:
    conn = await asyncpg.connect(_dsn(POSTGRES_URL))
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@contextmanager
def fresh_database() -> Iterator[str]:
    name = f"rlproxy_replicas_{uuid.uuid4().hex[:12]}"
    asyncio.run(_execute(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        asyncio.run(_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@dataclass
class Replica:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    data_dir: Path
    log: Path


@dataclass
class Cluster:
    database_url: str
    checkpoints: Path
    replicas: dict[str, Replica] = field(default_factory=dict)

    def rows(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        async def fetch() -> list[asyncpg.Record]:
            conn = await asyncpg.connect(_dsn(self.database_url))
            try:
                return list(await conn.fetch(sql, *args))
            finally:
                await conn.close()

        return asyncio.run(fetch())

    def kill(self, name: str) -> None:
        """SIGKILL: no shutdown, no lease given up, what a crashed machine does."""
        proc = self.replicas[name].proc
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def stop(self, name: str) -> None:
        """A clean stop (SIGTERM): leases given up, heartbeat removed."""
        stop_server(self.replicas[name].proc)


@contextmanager
def cluster(
    work: Path,
    model_dir: Path,
    names: list[str],
    env: dict[str, str] | None = None,
    per_replica: dict[str, dict[str, str]] | None = None,
) -> Iterator[Cluster]:
    checkpoints = work / "checkpoints"
    checkpoints.mkdir(parents=True, exist_ok=True)
    with fresh_database() as url, ExitStack() as stack:
        c = Cluster(url, checkpoints)
        for name in names:
            data_dir = work / f"replica-{name}"
            data_dir.mkdir()
            (data_dir / "checkpoints").symlink_to(checkpoints, target_is_directory=True)
            extra = {
                "RLPROXY_DATABASE_URL": url,
                "RLPROXY_REPLICA_ID": name,
                **(env or {}),
                **((per_replica or {}).get(name, {})),
            }
            proc, replica_url, log = start_server(data_dir, model_dir, extra)
            stack.callback(_stop_quietly, proc)
            c.replicas[name] = Replica(name, proc, replica_url, data_dir, log)
        yield c


def _stop_quietly(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        stop_server(proc)
