"""What the lookup agent's model did, read from an rlproxy database's stored calls.

For the episodes of `examples/lookup_agent.py` stored in a server's SQLite file (the agent
proof's evaluation server: `<work>/eval/rlproxy.db`), one line per model and temperature:
finished episodes, how often the first call was `find` with the task's word, `find` was called
with the word's code (the first result: the model passed it to the wrong tool), a `find` was
repeated, `get` was called at all, `get` was called with the code, and the success rate (`find`
with the task's word, then `get` with its code); then a few episodes as the calls the model
wrote.

An episode is one trajectory (the proof checks that); it is finished when it called `get` (the
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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lookup_agent

from storage.prompt_chunks import sqlite_prompts

TASK = re.compile(r"number of the code of (\w+)\?")
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
        "select trajectory_id, turn_index, model_requested, params, id, response "
        "from calls where status = 'completed' and superseded_by is null "
        "order by trajectory_id, turn_index"
    ).fetchall()
    by_trajectory: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for row in rows:
        by_trajectory[row[0]].append(row)
    out = []
    for turns in by_trajectory.values():
        messages = sqlite_prompts(con, [turns[0][4]])[turns[0][4]].messages
        user = next((m["content"] for m in messages if m["role"] == "user"), "")
        match = TASK.search(user if isinstance(user, str) else json.dumps(user))
        if match is None:
            continue
        task = match.group(1)
        code = lookup_agent.code_of(task)
        calls = [c for t in turns for c in calls_of(json.loads(t[5]))]
        finished = any(name == "get" for name, _ in calls) or len(turns) >= MAX_TURNS
        if not finished:
            continue
        found = [args.get("word") for name, args in calls if name == "find"]
        got = [args.get("code") for name, args in calls if name == "get"]
        out.append(
            {
                "model": turns[0][2],
                "temperature": json.loads(turns[0][3]).get("temperature"),
                "task": task,
                "calls": calls,
                "first_call_finds_the_word": bool(calls)
                and calls[0][0] == "find"
                and calls[0][1].get("word") == task,
                "find_called_with_the_code": code in found,
                "a_find_repeated": len(found) > len(set(found)),
                "get_called": bool(got),
                "get_called_with_the_code": code in got,
                "success": task in found and bool(got) and got[0] == code,
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
                "first_call_finds_the_word",
                "find_called_with_the_code",
                "a_find_repeated",
                "get_called",
                "get_called_with_the_code",
                "success",
            )
        }
        se = math.sqrt(rate["success"] * (1 - rate["success"]) / (n - 1)) if n > 1 else 0.0
        key = f"{model} t={temperature}"
        result[key] = {"episodes": n, **rate, "success_stderr": se}
        print(
            f"{key}: {n} episodes; first call finds the word "
            f"{rate['first_call_finds_the_word']:.0%}, find called with the code "
            f"{rate['find_called_with_the_code']:.0%}, a find repeated "
            f"{rate['a_find_repeated']:.0%}, get called {rate['get_called']:.0%} "
            f"(with the code {rate['get_called_with_the_code']:.0%}); "
            f"success {rate['success']:.1%} ± {se:.1%}"
        )
        for e in group[:examples]:
            calls = "; ".join(f"{name}({json.dumps(args)})" for name, args in e["calls"])
            code = lookup_agent.code_of(e["task"])
            print(f"    {e['task']} (code {code}, number {lookup_agent.number_of(code)}): {calls}")
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
