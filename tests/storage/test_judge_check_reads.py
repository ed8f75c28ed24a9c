"""The gate's read of one judge's checks (`Store.checks_of_judge`): each kind of check over its
own newest rows, on SQLite and Postgres."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest
from sqlalchemy import insert

from storage.models import judge_checks_table as J
from storage.records import JudgeCheckRecord

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def _insert(store: Any, rows: list[JudgeCheckRecord]) -> None:
    # written as finish_scoring writes them (one row per judged group), without the groups
    async with store._engines.write.begin() as conn:
        for i, row in enumerate(rows):
            await conn.execute(insert(J).values(**{**asdict(row), "created_at": float(i)}))


def _row(n: int, judge: str = "j", **fields: Any) -> JudgeCheckRecord:
    return JudgeCheckRecord(
        group_id=f"g{n}", judge_model=judge, rubric_hash="r", member_count=8, **fields
    )


async def test_each_kind_is_read_over_its_own_newest_checks(db: Any) -> None:
    store = await db.open()
    old = [_row(n, canary_passed=True, position_tau=0.5) for n in range(30)]
    newer = [_row(30 + n) for n in range(50)]  # groups with neither check
    other = [_row(80 + n, judge="other", canary_passed=False, position_tau=0.0) for n in range(5)]
    await _insert(store, [*old, *newer, *other])

    rows = await store.checks_of_judge("j", "r", limit=20)
    ids = [r.group_id for r in rows]
    # the newest 20 groups, then the newest 20 of each kind (here the same old rows), newest first
    assert ids == [f"g{n}" for n in range(79, 59, -1)] + [f"g{n}" for n in range(29, 9, -1)]
    assert all(r.judge_model == "j" for r in rows)

    # a kind with no rows (switched off) adds nothing
    assert [r.group_id for r in await store.checks_of_judge("other", "r", limit=3)] == [
        "g84",
        "g83",
        "g82",
    ]
