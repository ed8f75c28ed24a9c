"""What one long agent session costs the store: bytes per call, in total, and write/read time.

    .venv/bin/python bench/bench_prompt_storage.py                       # this checkout only
    .venv/bin/python bench/bench_prompt_storage.py --baseline bf57a13~1  # and storage/ at a rev

The session is the one issue 35 measured: a 2,733-token system prompt and a 96-token user
message, then 13 more turns, each the whole history plus the answer (8 tokens) and a new
96-token user message; prompt token ids are the embedded model's chat template over the
messages (its tokenizer from `--model-dir`), answers are random ids with logprobs. Every call
goes through `Store.record_call` on a fresh SQLite file, as serving would store it.

`--baseline REV` extracts `storage/` at that git revision (`git archive`) into a temporary
folder and runs the same session on it in a child process, so both figures come from one run
on one machine. Printed per storage: the bytes the call's columns added (SQLite's `length()` of
every value of every table, whatever the schema), the total, its ratio to the last request's
JSON body, the database file's growth over an empty database of that schema, the median
`record_call` time of the first and last 5 calls, and the time to read the whole trajectory
back (`Store.get_trajectory_calls`). A benchmark: it prints figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WORDS = ("the", "agent", "reads", "files", "runs", "tests", "and", "edits", "code", "until")


def build_session(model_dir: Path, turns: int, system: int, user: int) -> list[dict[str, Any]]:
    """Each call as plain JSON: messages, prompt ids, answer ids and text, the request body."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(0)

    def text(n: int) -> str:
        words = " ".join(rng.choice(WORDS) for _ in range(n + 16))
        return str(tok.decode(tok(words, add_special_tokens=False)["input_ids"][:n]))

    messages = [
        {"role": "system", "content": text(system)},
        {"role": "user", "content": text(user)},
    ]
    calls = []
    for _ in range(turns + 1):
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompt = list(prompt if isinstance(prompt, list) else prompt["input_ids"])
        answer_ids = [rng.randrange(len(tok)) for _ in range(8)]
        answer = str(tok.decode(answer_ids))
        body = {"model": "rlproxy", "messages": messages, "stream": True, "max_tokens": 8}
        calls.append(
            {
                "messages": list(messages),
                "prompt_ids": prompt,
                "answer": answer,
                "answer_ids": answer_ids,
                "logprobs": [-rng.random() * 3 for _ in answer_ids],
                "request_bytes": len(json.dumps(body)),
            }
        )
        messages = [
            *messages,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": text(user)},
        ]
    return calls


def _one(cursor: sqlite3.Cursor) -> int:
    return int(cursor.fetchone()[0])


def column_bytes(db: Path) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        total = 0
        tables = conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
        ).fetchall()
        for (table,) in tables:
            cols = [r[1] for r in conn.execute(f'PRAGMA table_info("{table}")')]
            parts = " + ".join(f'coalesce(length(CAST("{c}" AS BLOB)), 0)' for c in cols)
            total += _one(conn.execute(f'SELECT coalesce(sum({parts}), 0) FROM "{table}"'))
        return total


def file_bytes(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return _one(conn.execute("PRAGMA page_count")) * _one(conn.execute("PRAGMA page_size"))


async def run_store(calls: list[dict[str, Any]], folder: Path) -> dict[str, Any]:
    """Record the session with whichever `storage` package is first on sys.path."""
    from storage import Store
    from storage.records import CallRecord, ChoiceRecord

    empty, db = folder / "empty.db", folder / "session.db"
    store = await Store.open(f"sqlite+aiosqlite:///{empty}")
    await store.close()
    store = await Store.open(f"sqlite+aiosqlite:///{db}")
    added, times, before = [], [], column_bytes(db)
    last_id = ""
    for c in calls:
        now = time.time()
        usage = {"prompt_tokens": len(c["prompt_ids"]), "completion_tokens": 8}
        answer = {"role": "assistant", "content": c["answer"]}
        record = CallRecord(
            id=uuid.uuid4().hex,
            created_at=now,
            finished_at=now + 0.1,
            model_requested="rlproxy",
            engine="local",
            request_messages=c["messages"],
            params={"max_tokens": 8, "temperature": 0.0},
            response={"object": "chat.completion", "choices": [{"index": 0, "message": answer}]},
            prompt_token_ids=c["prompt_ids"],
            usage=usage,
            stream=True,
            choices=[ChoiceRecord(0, answer, "length", c["answer_ids"], c["logprobs"])],
        )
        t0 = time.perf_counter()
        tid = await store.record_call(record)
        times.append(time.perf_counter() - t0)
        now_bytes = column_bytes(db)
        added.append(now_bytes - before)
        before, last_id = now_bytes, tid
    reads = []
    for _ in range(5):
        t0 = time.perf_counter()
        await store.get_trajectory_calls(last_id)
        reads.append(time.perf_counter() - t0)
    await store.close()
    return {
        "column_bytes": before,
        "added_per_call": added,
        "file_growth": file_bytes(db) - file_bytes(empty),
        "record_ms_first5": statistics.median(times[:5]) * 1000,
        "record_ms_last5": statistics.median(times[-5:]) * 1000,
        "read_trajectory_ms": statistics.median(reads) * 1000,
    }


def child(args: argparse.Namespace) -> None:
    calls = json.loads(Path(args.child).read_text())
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(asyncio.run(run_store(calls, Path(tmp)))))


def measure(calls_file: Path, storage_root: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(storage_root), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(calls_file)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=storage_root,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", help="a git revision whose storage/ is measured beside")
    p.add_argument("--turns", type=int, default=13, help="turns after turn 0")
    p.add_argument("--system-tokens", type=int, default=2_733)
    p.add_argument("--user-tokens", type=int, default=96)
    p.add_argument(
        "--model-dir",
        type=Path,
        default=REPO / "rlproxy-data" / "models" / "smollm2-135m-instruct-fp32",
        help="the tokenizer's folder",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    calls = build_session(args.model_dir, args.turns, args.system_tokens, args.user_tokens)
    last = calls[-1]["request_bytes"]
    print(
        f"session: {len(calls)} calls, last prompt {len(calls[-1]['prompt_ids'])} tokens, "
        f"last request body {last:,} bytes"
    )
    with tempfile.TemporaryDirectory() as tmp:
        calls_file = Path(tmp) / "calls.json"
        calls_file.write_text(json.dumps(calls))
        roots = {"this checkout": REPO}
        if args.baseline:
            old = Path(tmp) / "baseline"
            old.mkdir()
            archive = subprocess.run(
                ["git", "-C", str(REPO), "archive", args.baseline, "storage"],
                capture_output=True,
                check=True,
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
            roots = {f"storage/ at {args.baseline}": old, **roots}
        for name, root in roots.items():
            r = measure(calls_file, root)
            added = r["added_per_call"]
            print(f"\n{name}:")
            print(f"  bytes added per call: {', '.join(f'{b / 1000:.1f}k' for b in added)}")
            print(
                f"  columns {r['column_bytes'] / 1000:.0f} KB ({r['column_bytes'] / last:.1f}x the "
                f"last request), database file grew {r['file_growth'] / 1000:.0f} KB "
                f"({r['file_growth'] / last:.1f}x)"
            )
            print(
                f"  record_call p50 {r['record_ms_first5']:.1f} ms (first 5 calls), "
                f"{r['record_ms_last5']:.1f} ms (last 5); whole trajectory read back "
                f"{r['read_trajectory_ms']:.1f} ms"
            )


if __name__ == "__main__":
    main()
