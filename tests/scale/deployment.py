"""Several `rlproxy serve` replicas behind a real load balancer, as a team would run them.

    with deployment(work, model_dir, {"a": {...}, "b": {...}}, common_env) as d:
        httpx.post(f"{d.url}/v1/chat/completions", ...)     # through HAProxy
        d.kill("b")                                          # SIGKILL one replica

What runs: a fresh Postgres database on the machine's server (127.0.0.1:5432, trust auth; or
RLPROXY_TEST_POSTGRES_URL) that every replica uses; one data directory they all share (the
checkpoint volume of a real deployment: the trainer writes versions there, every replica's
publisher loads them); each replica on its own loopback port with its own log; and HAProxy from
Debian (`make test-scale` installs it) in front with the compose profile's own config
(deploy/haproxy.cfg): fewest requests in flight, `GET /health` checked every second, a refused
connection retried on the other replica, the replica that answered named in
`x-rlproxy-replica`. Redis (for the shared rate) is the machine's, named by the caller's env.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from sqlalchemy.engine import make_url

from tests.e2e.conftest import free_port, start_server, stop_server

POSTGRES_URL = os.environ.get(
    "RLPROXY_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("RLPROXY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
REPLICA_HEADER = "x-rlproxy-replica"  # set by deploy/haproxy.cfg: the server that answered
HAPROXY_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "haproxy.cfg"


def _dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@contextmanager
def fresh_database() -> Iterator[str]:
    """A new Postgres database (dropped afterwards, even with connections left): its URL."""
    name = f"rlproxy_scale_{uuid.uuid4().hex[:12]}"

    async def run(sql: str) -> None:
        conn = await asyncpg.connect(_dsn(POSTGRES_URL))
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        asyncio.run(run(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def db_rows(database_url: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    async def fetch() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(_dsn(database_url))
        try:
            return list(await conn.fetch(sql, *args))
        finally:
            await conn.close()

    return asyncio.run(fetch())


def create_key(database_url: str, data_dir: Path, name: str) -> str:
    """`rlproxy keys create` on the deployment's database: the key, printed once."""
    out = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "keys", "create", "--name", name],
        env={**os.environ, "RLPROXY_DATABASE_URL": database_url, "RLPROXY_DATA_DIR": str(data_dir)},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return out.stdout.splitlines()[0].strip()


@dataclass
class Replica:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    log: Path


@dataclass
class Deployment:
    url: str  # the balancer: http://127.0.0.1:PORT
    database_url: str
    data_dir: Path
    replicas: dict[str, Replica] = field(default_factory=dict)
    balancer_log: Path | None = None

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def kill(self, name: str) -> None:
        """SIGKILL a replica: no shutdown, no flush, what a crashed machine does."""
        proc = self.replicas[name].proc
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def rows(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        return db_rows(self.database_url, sql, *args)


@contextmanager
def balancer(work: Path, a: str, b: str) -> Iterator[tuple[str, Path]]:
    """HAProxy with the compose profile's own config (deploy/haproxy.cfg) in front of replicas
    `a` and `b` (their URLs): the balancer's URL and log."""
    binary = shutil.which("haproxy")
    if binary is None:
        raise RuntimeError("no haproxy: `make test-scale` installs it (apt-get install haproxy)")
    port = free_port()
    log = work / "haproxy.log"
    env = {
        **os.environ,
        "BALANCER_BIND": f"127.0.0.1:{port}",
        "RLPROXY_REPLICA_A": a.removeprefix("http://"),
        "RLPROXY_REPLICA_B": b.removeprefix("http://"),
    }
    with log.open("w") as out:
        proc = subprocess.Popen(
            [binary, "-db", "-f", str(HAPROXY_CONFIG)], env=env, stdout=out, stderr=out
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"haproxy exited with {proc.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"haproxy never answered:\n{log.read_text()}")
            time.sleep(0.2)
        yield url, log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def deployment(
    work: Path,
    model_dir: Path,
    replicas: dict[str, dict[str, str]],
    env: dict[str, str] | None = None,
    keys: list[str] | None = None,
) -> Iterator[tuple[Deployment, dict[str, str]]]:
    """Replicas "a" and "b" (`replicas` gives each its own extra env, beside the common `env`),
    one fresh database, one shared data directory, HAProxy in front. Keys named in `keys` are
    created before the replicas start; yields the deployment and {name: key}."""
    assert sorted(replicas) == ["a", "b"], "deploy/haproxy.cfg names two replicas, a and b"
    data_dir = work / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        database_url = stack.enter_context(fresh_database())
        made = {name: create_key(database_url, data_dir, name) for name in keys or []}
        common = {"RLPROXY_DATABASE_URL": database_url, **(env or {})}

        def start(name: str) -> Replica:
            log = work / f"replica-{name}.log"
            proc, url, _ = start_server(data_dir, model_dir, {**common, **replicas[name]}, log)
            stack.callback(_stop, proc)
            return Replica(name, proc, url, log)

        # Started together: each loads the model for a few seconds.
        with ThreadPoolExecutor(max_workers=len(replicas)) as threads:
            started = list(threads.map(start, replicas))
        url, log = stack.enter_context(balancer(work, started[0].url, started[1].url))
        yield (
            Deployment(url, database_url, data_dir, {r.name: r for r in started}, log),
            made,
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        stop_server(proc)
