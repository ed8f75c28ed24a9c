"""Decode tokens/s of the local engine with its cache layers appending into spare room
(`GrowingLayer`, the default) against transformers' `DynamicLayer` (a `torch.cat` of the whole
cache every step), in one run on the same weights, rounds alternating so load falls on both.

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_decode_growth.py [--clients 1 8] [--rounds 3]

Each round: `clients` concurrent greedy requests of `--prompt-tokens` prompt tokens and
`--new-tokens` new tokens each (the prefix cache off, so prompts are prefilled alike). Prints
decode tokens/s per round (after every prompt is prefilled) and the median ratio; no assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

from proxy.engines.base import ChoiceFinished, GenerationRequest, SamplingParams, TokenEvent
from proxy.engines.loader import load_model
from proxy.engines.local import LocalEngine


async def one(engine: LocalEngine, prompt: list[int], new: int) -> tuple[float, int]:
    """(when its first token came, tokens generated) of one greedy request."""
    params = SamplingParams(max_tokens=new, temperature=0)
    first = 0.0
    async for event in engine.generate(GenerationRequest(prompt, params)):
        if isinstance(event, TokenEvent) and not first:
            first = time.perf_counter()
        if isinstance(event, ChoiceFinished):
            return first, len(event.completion_token_ids)
    return first, 0


async def round_(engine: LocalEngine, prompts: list[list[int]], new: int) -> float:
    """Decode tokens/s: tokens after each request's first, over the time from the last first
    token (every prompt prefilled) to the end."""
    results = await asyncio.gather(*(one(engine, p, new) for p in prompts))
    end = time.perf_counter()
    decoding_from = max(first for first, _ in results)
    return sum(n - 1 for _, n in results) / (end - decoding_from)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--data-dir", type=Path, default=Path("rlproxy-data"))
    args = parser.parse_args()
    loaded = load_model(args.data_dir)
    tok = loaded.tokenizer
    growing = LocalEngine(loaded, max_batch_size=max(args.clients))
    concat = LocalEngine(loaded, max_batch_size=max(args.clients))
    concat.plain_layers = False  # transformers' DynamicLayer: torch.cat every step
    engines = {"growing": growing, "cat": concat}
    for engine in engines.values():
        await engine.start()
    for clients in args.clients:
        prompts = []
        for c in range(clients):  # different prompts: no shared prefill
            words = " ".join(f"w{(c * 31 + i) % 997}" for i in range(args.prompt_tokens))
            prompts.append(tok.encode(words, add_special_tokens=False)[: args.prompt_tokens])
        await round_(growing, prompts, 4)  # warm-up
        await round_(concat, prompts, 4)
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for r in range(args.rounds):
            for name, engine in engines.items():
                rates[name].append(await round_(engine, prompts, args.new_tokens))
            print(
                f"clients {clients} round {r}: growing {rates['growing'][-1]:.1f} tok/s, "
                f"cat {rates['cat'][-1]:.1f} tok/s",
                flush=True,
            )
        ratio = statistics.median(
            g / c for g, c in zip(rates["growing"], rates["cat"], strict=True)
        )
        print(f"clients {clients}: growing / cat = {ratio:.3f} (median of {args.rounds} rounds)")
    for engine in engines.values():
        await engine.stop()
    print(f"load average {os.getloadavg()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")


if __name__ == "__main__":
    asyncio.run(main())
