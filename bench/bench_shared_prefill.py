"""What prefilling a shared prompt once saves the local engine: a request for `n` choices of
one prompt against `n` requests of `n` different prompts of the same length, in turn.

Both make the same rows of the same length; only the first can share its prefill (the engine
runs a prompt once for the rows that have it, `prefill_rows_shared`). `max_tokens` is small, so
the time is mostly the prefill. Prints each pair's seconds and the ratio, and the median.

    .venv/bin/python bench/bench_shared_prefill.py [--n 8] [--prompt-tokens 384] [--pairs 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from proxy.engines.base import GenerationRequest, SamplingParams  # noqa: E402
from proxy.engines.loader import load_model  # noqa: E402
from proxy.engines.local import LocalEngine  # noqa: E402


async def finish(engine: LocalEngine, request: GenerationRequest) -> None:
    async for _ in engine.generate(request):
        pass


async def timed(engine: LocalEngine, requests: list[GenerationRequest]) -> float:
    began = time.perf_counter()
    await asyncio.gather(*(finish(engine, r) for r in requests))
    return time.perf_counter() - began


async def main_async(args: argparse.Namespace) -> None:
    loaded = load_model(args.model_dir)
    engine = LocalEngine(loaded, max_batch_size=args.n)
    await engine.start()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
    vocab = range(1000, 1000 + args.n * args.prompt_tokens)
    prompts = [
        list(vocab[i * args.prompt_tokens : (i + 1) * args.prompt_tokens]) for i in range(args.n)
    ]
    shared = [GenerationRequest(prompts[0], params, n=args.n)]
    distinct = [GenerationRequest(p, params) for p in prompts]
    await timed(engine, shared)  # warm up
    ratios = []
    try:
        for pair in range(args.pairs):
            order = [("distinct", distinct), ("shared", shared)]
            seconds = {}
            for name, requests in order if pair % 2 == 0 else order[::-1]:
                seconds[name] = await timed(engine, requests)
            ratios.append(seconds["distinct"] / seconds["shared"])
            print(
                f"pair {pair + 1}: {args.n} distinct prompts {seconds['distinct']:.2f} s, one "
                f"prompt x {args.n} {seconds['shared']:.2f} s, ratio {ratios[-1]:.2f}",
                flush=True,
            )
    finally:
        await engine.stop()
    print(
        f"\n{args.n} rows of {args.prompt_tokens} prompt tokens, {args.max_tokens} new tokens: "
        f"sharing the prompt is {statistics.median(ratios):.2f}x faster (median of {len(ratios)}"
        f" pairs); rows not prefilled again: {engine.prefill_rows_shared}; load average "
        f"{os.getloadavg()[0]:.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=384)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=Path(os.environ.get("RLPROXY_MODEL_DIR", REPO / "rlproxy-data")),
    )
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
