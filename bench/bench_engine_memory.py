"""Peak memory of `rlproxy serve` (the local engine) under a burst of concurrent long prompts,
in a few configurations (`CONFIGS`), each in a server process of its own.

    .venv/bin/python bench/bench_engine_memory.py              # 64 x 820 tokens at batch 64
    .venv/bin/python bench/bench_engine_memory.py --configs default mmap1m arenas2 --rounds 2

A burst of `--requests` distinct prompts of `--prompt-tokens` tokens each (seeded filler words),
greedy, `--max-tokens` new tokens each, all sent at once to a server whose engine decodes up to
`--max-batch` rows together. A config is the environment its server starts with (`CONFIGS`).
Reported per run: the server's peak resident memory over its whole life (`VmHWM` from
/proc, read just before it stops), its resident memory once the burst is answered (`VmRSS`),
the burst's wall time and completion tokens per second; then each config's figures as ratios
against the first config's, taken from the runs of the same round. Configs alternate within a
round, so a machine that slows down affects them alike. Linux only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sample_rss import rss_mb
from servers import REPO, start_server, stop

CONFIGS: dict[str, dict[str, str]] = {
    "default": {},
    # glibc's heap: allocations of 1 MiB or more get pages of their own (the trainer's setting).
    "mmap1m": {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576"},
    # glibc's heap: two malloc arenas instead of up to 8 per core.
    "arenas2": {"MALLOC_ARENA_MAX": "2"},
    # No prefix cache: what the cache's entries add.
    "nocache": {"RLPROXY_PREFIX_CACHE_BYTES": "0"},
}


WORDS = ["agent", "tool", "call", "result", "file", "line", "error", "test", "patch", "run"]


def prompts(model: Path, count: int, tokens: int) -> list[str]:
    """`count` distinct prompts of `tokens` tokens. Not bench_long_session's `Filler`: its words
    make greedy answers run to `--max-tokens` (3,072 tokens for the burst, 5.2 GB peak) where
    these stop about halfway (1,478); the figures in docs/running.md are of these."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    out = []
    for k in range(count):
        rng = random.Random(f"burst/{k}")
        words = f"Request {k}. " + " ".join(rng.choice(WORDS) for _ in range(tokens + 16))
        ids = tokenizer(words, add_special_tokens=False)["input_ids"][:tokens]
        out.append(str(tokenizer.decode(ids)))
    return out


async def burst(url: str, texts: list[str], max_tokens: int) -> tuple[float, int]:
    """Send every prompt at once; (wall seconds, completion tokens)."""
    async with httpx.AsyncClient(base_url=url, timeout=1800) as client:

        async def one(text: str) -> int:
            r = await client.post(
                "/v1/chat/completions",
                json={
                    "model": "rlproxy",
                    "messages": [{"role": "user", "content": text}],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                },
            )
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        start = time.monotonic()
        tokens = await asyncio.gather(*(one(t) for t in texts))
        return time.monotonic() - start, sum(tokens)


def run(
    config: str, model: Path, work: Path, texts: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    env = {"RLPROXY_MAX_BATCH_SIZE": str(args.max_batch), **CONFIGS[config]}
    proc, url = start_server(work / config, model, env)
    try:
        asyncio.run(burst(url, texts[:1], 4))  # the first forward pass is not the burst's
        wall, tokens = asyncio.run(burst(url, texts, args.max_tokens))
        peak, after = rss_mb(proc.pid, "VmHWM"), rss_mb(proc.pid)
    finally:
        stop(proc)
    figures = {
        "config": config,
        "peak_rss_mb": round(peak),
        "rss_after_mb": round(after),
        "wall_s": round(wall, 1),
        "tokens_per_s": round(tokens / wall, 2),
        "completion_tokens": tokens,
    }
    print(json.dumps(figures), flush=True)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=820)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--configs", nargs="+", default=["default", "nocache"], choices=CONFIGS)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--model-dir", type=Path, default=REPO / "rlproxy-data")
    parser.add_argument("--work", type=Path, default=REPO / "rlproxy-data" / "bench-memory")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/engine_memory.json")
    args = parser.parse_args()

    sys.path.insert(0, str(REPO))
    from proxy.engines.loader import ensure_fp32_cache

    model = ensure_fp32_cache(args.model_dir).resolve()
    texts = prompts(model, args.requests, args.prompt_tokens)
    runs = [
        run(config, model, args.work / f"round{r}", texts, args)
        for r in range(args.rounds)
        for config in args.configs
    ]
    base = args.configs[0]
    # Each round's figures by config; a ratio is the median over rounds of config / base.
    rounds = [
        {f["config"]: f for f in runs[i : i + len(args.configs)]}
        for i in range(0, len(runs), len(args.configs))
    ]
    summary = {
        config: {
            f"{key}_vs_{base}": round(
                statistics.median(rnd[config][key] / rnd[base][key] for rnd in rounds), 2
            )
            for key in ("peak_rss_mb", "rss_after_mb", "wall_s", "tokens_per_s")
        }
        for config in args.configs
    }
    print(json.dumps(summary, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"args": vars(args), "runs": runs, "ratios": summary}
    args.out.write_text(json.dumps(record, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
