"""`rlproxy score`: form groups and score them now, then print what the judge said.

Groups are formed first in every case, as serving forms them (`trainer.scoring.Grouping`), then
either the one group asked for or every ready group is scored.

Runs against the database directly (no server needed). With no judge model configured it loads
the local model and judges with it, as the server does.
"""

from __future__ import annotations

import sys
from typing import TextIO

from proxy.settings import Settings
from storage.records import GroupDetail


async def score_command(settings: Settings, group_id: str | None, out: TextIO = sys.stdout) -> int:
    """Score one group (`group_id`) or every ready one; print a table; return an exit code."""
    from proxy.cli.progress import progress
    from proxy.runtime import open_runtime

    async with open_runtime(settings, scoring=True) as rt:
        store, scorer, grouping = rt.store, rt.scorer, rt.grouping
        assert scorer is not None and grouping is not None
        await store.release_scoring()
        scored: list[GroupDetail] = []
        formed = (await grouping.step()).formed
        print(
            f"rlproxy score: {formed.assigned} trajectories grouped, "
            f"{len(formed.ready)} groups became ready",
            file=sys.stderr,
        )
        if group_id is not None:
            if await store.get_group(group_id) is None:
                print(f"rlproxy score: no group {group_id}", file=sys.stderr)
                return 1
            detail = await scorer.score(group_id)
            if detail is None:
                print(
                    f"rlproxy score: group {group_id} has fewer than two members or is being "
                    "scored elsewhere",
                    file=sys.stderr,
                )
                return 1
            scored.append(detail)
        else:
            waiting = await store.group_queue()
            total = waiting.counts["ready"] + waiting.counts["scoring"]
            with progress(total, "score", "groups") as bar:
                while (detail := await scorer.score_next()) is not None:
                    scored.append(detail)
                    bar.update(1)
        print_table(scored, out)
        return 0 if all(d.summary.status == "scored" for d in scored) else 2


def print_table(groups: list[GroupDetail], out: TextIO) -> None:
    if not groups:
        print("no group was ready to score", file=out)
        return
    row = "{:<10} {:<8} {:<7} {:<14} {:>5} {:>6}  {}"
    print(
        row.format("group", "source", "status", "member", "score", "reward", "explanation"),
        file=out,
    )
    for g in groups:
        s = g.summary
        if s.status == "failed":
            print(row.format(s.id[:10], s.source, s.status, "-", "-", "-", s.failure), file=out)
            continue
        for m in g.members:
            score = f"{m.ruler.score:.2f}" if m.ruler else "-"
            reward = f"{m.reward:.2f}" if m.reward is not None else "-"
            why = (m.ruler.explanation or "") if m.ruler else f"({m.reward_source or 'no'} reward)"
            cells = (s.id[:10], s.source, s.status, m.member_id[:14], score, reward, why[:80])
            print(row.format(*cells), file=out)
