"""What the lookup agent's model did, read from an rlproxy database's stored calls.

For the episodes of `examples/lookup_agent.py` stored in a server's SQLite file (the agent
proof's evaluation server: `<work>/eval/rlproxy.db`), one line per model and temperature:
finished episodes, how often the first call looked up one of the task's words, both words were
looked up, a lookup was repeated, `add` was called, and the success rate (the episode's `add`
summed to the right answer); then a few episodes as the calls the model wrote.

An episode is one trajectory (the proof checks that); it is finished when it called `add` (the
agent stops there) or reached the agent's 4 turns. Episodes still in flight are left out.

    .venv/bin/python bench/agent_episodes.py /tmp/rlproxy-agent-proof-XXXX/eval/rlproxy.db
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sqlite3
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import lookup_agent

TASK = re.compile(r"number of (\w+) plus the number of (\w+)\?")
MAX_TURNS = 4


def calls_of(response: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    message = response["choices"][0]["message"]
    out = []
    for call in message.get("tool_calls") or []:
        try:
            args = json.loads(call["function"]["arguments"] or "{}")
        except ValueError:
            args = {}
        out.append((call["function"]["name"], args))
    return out


def episodes(db: Path) -> list[dict[str, Any]]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    rows = con.execute(
        "select trajectory_id, turn_index, model_requested, params, request_messages, response "
        "from calls where status = 'completed' and superseded_by is null "
        "order by trajectory_id, turn_index"
    ).fetchall()
    by_trajectory: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for row in rows:
        by_trajectory[row[0]].append(row)
    out = []
    for turns in by_trajectory.values():
        messages = json.loads(turns[0][4])
        user = next((m["content"] for m in messages if m["role"] == "user"), "")
        match = TASK.search(user if isinstance(user, str) else json.dumps(user))
        if match is None:
            continue
        task = (match.group(1), match.group(2))
        calls = [c for t in turns for c in calls_of(json.loads(t[5]))]
        finished = any(name == "add" for name, _ in calls) or len(turns) >= MAX_TURNS
        if not finished:
            continue
        add = next((args for name, args in calls if name == "add"), None)
        total = None
        if add is not None:
            try:
                total = int(add.get("a", 0)) + int(add.get("b", 0))
            except (TypeError, ValueError):
                total = None
        words = [args.get("word") for name, args in calls if name == "lookup"]
        out.append(
            {
                "model": turns[0][2],
                "temperature": json.loads(turns[0][3]).get("temperature"),
                "task": task,
                "calls": calls,
                "first_call_looks_up_a_task_word": bool(words)
                and calls[0][0] == "lookup"
                and words[0] in task,
                "both_words_looked_up": set(task) <= set(words),
                "a_lookup_repeated": len(words) > len(set(words)),
                "add_called": add is not None,
                "success": total == lookup_agent.answer_of(task),
            }
        )
    return out


def report(eps: list[dict[str, Any]], examples: int = 4) -> dict[str, Any]:
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = defaultdict(list)
    for e in eps:
        groups[(e["model"], e["temperature"])].append(e)
    result = {}
    for (model, temperature), group in sorted(groups.items(), key=lambda kv: str(kv[0])):
        n = len(group)
        rate = {
            k: sum(e[k] for e in group) / n
            for k in (
                "first_call_looks_up_a_task_word",
                "both_words_looked_up",
                "a_lookup_repeated",
                "add_called",
                "success",
            )
        }
        se = math.sqrt(rate["success"] * (1 - rate["success"]) / (n - 1)) if n > 1 else 0.0
        key = f"{model} t={temperature}"
        result[key] = {"episodes": n, **rate, "success_stderr": se}
        print(
            f"{key}: {n} episodes; first call looks up a task word "
            f"{rate['first_call_looks_up_a_task_word']:.0%}, both words looked up "
            f"{rate['both_words_looked_up']:.0%}, a lookup repeated "
            f"{rate['a_lookup_repeated']:.0%}, add called {rate['add_called']:.0%}; "
            f"success {rate['success']:.1%} ± {se:.1%}"
        )
        for e in group[:examples]:
            calls = "; ".join(f"{name}({json.dumps(args)})" for name, args in e["calls"])
            numbers = [lookup_agent.number_of(w) for w in e["task"]]
            print(f"    {e['task']} (numbers {numbers}): {calls}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("db", type=Path, help="an rlproxy SQLite database")
    parser.add_argument("--examples", type=int, default=4)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    result = report(episodes(args.db), args.examples)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
