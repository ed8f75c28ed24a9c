"""Time to first token per turn of one long agent session, local engine with and without its
prefix cache, in one run on the same weights.

The session (issue 35's): a system prompt of about 2,733 tokens, then `--turns` turns that each
resend the whole history, the answer the previous turn got and a new user message of about 114
tokens; greedy, `--max-tokens` new tokens a turn, read as a stream (the first token event is the
time to first token). The two engines take the turns alternately (turn k without the cache, then
turn k with it), so machine load falls on both alike. Prints a table and the ratios the issue
asks about; no assertions.

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_prefix_cache.py [--turns 13] [--max-tokens 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path
from typing import Any

from proxy.engines.base import ChoiceFinished, GenerationRequest, SamplingParams, TokenEvent
from proxy.engines.loader import load_model
from proxy.engines.local import LocalEngine

WORDS = (  # noqa: SIM905 (one string reads better than 37 quoted words)
    "agent tool call result file line test build error patch module function class value "
    "return branch commit review config server client request response token cache batch "
    "model adapter version trainer group reward judge score session history message"
).split()


def text_of(tokens: int, seed: int, tokenizer: Any) -> str:
    """Deterministic filler text of about `tokens` tokens."""
    words: list[str] = []
    i = seed
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < tokens:
        words.extend(WORDS[(i * 7 + k) % len(WORDS)] for k in range(20))
        i += 1
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) > tokens:
        words.pop()
    return " ".join(words)


async def turn(engine: LocalEngine, ids: list[int], max_tokens: int) -> tuple[float, float, str]:
    """(time to first token, total time, answer text) of one streamed greedy request."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    start = time.perf_counter()
    first = None
    text = ""
    async for event in engine.generate(GenerationRequest(ids, params)):
        if isinstance(event, TokenEvent) and first is None:
            first = time.perf_counter() - start
        if isinstance(event, ChoiceFinished):
            text = event.text
    return first or 0.0, time.perf_counter() - start, text


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=13, help="turns after the first (issue: 13)")
    parser.add_argument("--system-tokens", type=int, default=2733)
    parser.add_argument("--turn-tokens", type=int, default=114)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--cache-bytes", type=int, default=2**30)
    parser.add_argument("--data-dir", type=Path, default=Path("rlproxy-data"))
    args = parser.parse_args()

    loaded = load_model(args.data_dir)
    tok = loaded.tokenizer
    engines = {
        "off": LocalEngine(loaded, prefix_cache_bytes=0),
        "on": LocalEngine(loaded, prefix_cache_bytes=args.cache_bytes),
    }
    for engine in engines.values():
        await engine.start()
    system = text_of(args.system_tokens, 0, tok)
    histories = {name: [{"role": "system", "content": system}] for name in engines}
    rows = []
    for k in range(args.turns + 1):
        question = text_of(args.turn_tokens, k + 1, tok)
        row: dict[str, Any] = {"turn": k}
        for name, engine in engines.items():
            messages = histories[name]
            messages.append({"role": "user", "content": question})
            rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = list(tok.encode(rendered, add_special_tokens=False))
            ttft, total, answer = await turn(engine, ids, args.max_tokens)
            messages.append({"role": "assistant", "content": answer})
            row["prompt"] = len(ids)
            row[name] = ttft
            row[f"{name}_total"] = total
            row[f"{name}_answer"] = answer
        rows.append(row)
        same = "same" if row["on_answer"] == row["off_answer"] else "DIFFERENT"
        print(
            f"turn {k:2d}  prompt {row['prompt']:5d} tokens  TTFT off {row['off']:6.2f} s  "
            f"on {row['on']:6.2f} s  ({row['on'] / row['off']:.2f}x)  answers {same}",
            flush=True,
        )
    cache = engines["on"].health().detail["prefix_cache"]
    for engine in engines.values():
        await engine.stop()
    last, first = rows[-1], rows[0]
    print(
        f"\nturn {last['turn']} TTFT: off {last['off']:.2f} s, on {last['on']:.2f} s; "
        f"on / turn 0 (on) = {last['on'] / first['on']:.2f}; on / off at turn {last['turn']} = "
        f"{last['on'] / last['off']:.2f}"
    )
    print(
        f"session total: off {sum(r['off_total'] for r in rows):.1f} s, "
        f"on {sum(r['on_total'] for r in rows):.1f} s"
    )
    print(
        f"prefix cache: {cache['hit_tokens']} of {cache['query_tokens']} prompt tokens hit "
        f"({cache['hit_rate']}), {cache['bytes'] / 2**20:.0f} MB in {cache['entries']} entries"
    )
    print(f"load average {os.getloadavg()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")


if __name__ == "__main__":
    asyncio.run(main())
