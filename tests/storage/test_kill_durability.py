"""An acknowledged call survives the process being killed (SIGKILL) mid-write, on SQLite.

A child process records calls from 20 concurrent writers and prints each call id once
`record_call` has returned; the parent kills it with SIGKILL while writes are in flight, then
checks that every printed id is in the database and that the database is intact.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from storage import Store

pytestmark = pytest.mark.asyncio(loop_scope="session")

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import asyncio, sys, time, uuid
from storage import CallRecord, ChoiceRecord, Store

async def writer(store, i):
    msgs = [{"role": "user", "content": f"writer {i}"}]
    while True:
        now = time.time()
        record = CallRecord(
            id=uuid.uuid4().hex, created_at=now, finished_at=now, model_requested="policy",
            engine="local", request_messages=msgs,
            choices=[ChoiceRecord(0, {"role": "assistant", "content": "a"}, "stop", [1, 2])],
        )
        await store.record_call(record)
        sys.stdout.write(record.id + "\\n")
        sys.stdout.flush()
        msgs = [*msgs, {"role": "assistant", "content": "a"}, {"role": "user", "content": "x"}]

async def main():
    store = await Store.open(sys.argv[1])
    await asyncio.gather(*(writer(store, i) for i in range(20)))

asyncio.run(main())
"""


async def test_acknowledged_calls_survive_sigkill(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'rlproxy.db'}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, url, stdout=asyncio.subprocess.PIPE, env=env, cwd=REPO
    )
    assert proc.stdout is not None
    acked: list[str] = []
    try:
        while len(acked) < 300:
            line = await asyncio.wait_for(proc.stdout.readline(), timeout=30)
            assert line, "the writer process exited early"
            acked.append(line.decode().strip())
    finally:
        proc.send_signal(signal.SIGKILL)
    rest = await proc.stdout.read()  # ids acknowledged before the kill landed
    acked += [x for x in rest.decode().split("\n") if len(x) == 32]
    await proc.wait()
    assert proc.returncode == -signal.SIGKILL

    store = await Store.open(url)
    try:
        missing = [cid for cid in acked if await store.get_call(cid) is None]
        stored = await store.count_calls()
    finally:
        await store.close()
    print(f"\nSIGKILL: {len(acked)} calls acknowledged, {stored} stored, {len(missing)} missing")
    assert missing == []
    assert stored >= len(acked)
