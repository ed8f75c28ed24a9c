"""Serving throughput: rlproxy's HTTP API beside raw `model.generate`, in the same run.

For 1, 4 and 8 concurrent clients, every client sends the same chat prompts through the OpenAI
SDK (streaming, to also time the first token); the raw baseline runs `model.generate` on the same
prompt ids in batches of the same size. Both produce up to MAX_TOKENS tokens per prompt; the
figures are completion tokens per second of wall time, and their ratio. Prints a table; no
assertion (these machines are shared and noisy: read the figures, rerun if they look odd).

    .venv/bin/python bench/bench_serving.py [--rounds 2] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from openai import AsyncOpenAI

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from servers import start_server  # noqa: E402

from proxy.chat.prompt import ChatTemplate  # noqa: E402
from proxy.engines.loader import load_model  # noqa: E402

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works to a ten-year-old.",
    "Describe the water cycle in detail.",
    "Write a letter to a friend about your summer holidays.",
    "List ten ideas for a birthday party and explain each.",
    "Explain why the sky is blue.",
    "Describe a day in the life of a lighthouse keeper.",
    "Write a recipe for pancakes with step by step instructions.",
]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def raw_generate(model, tokenizer, prompt_ids: list[list[int]], batch: int, max_tokens: int):
    """Batched `model.generate`, left-padded, greedy. Returns (completion tokens, seconds)."""
    pad = tokenizer.pad_token_id
    tokens, elapsed = 0, 0.0
    for start in range(0, len(prompt_ids), batch):
        group = prompt_ids[start : start + batch]
        width = max(len(p) for p in group)
        ids = torch.full((len(group), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(group):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        elapsed += time.perf_counter() - t0
        for row in out[:, width:].tolist():
            n = len(row)
            if tokenizer.eos_token_id in row:
                n = row.index(tokenizer.eos_token_id) + 1
            tokens += n
    return tokens, elapsed


async def api_run(base_url: str, clients: int, prompts: list[str], max_tokens: int):
    """`clients` concurrent streaming clients share the prompt list. Returns tokens, s, TTFTs."""
    client = AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=600)
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    ttfts: list[float] = []
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while not queue.empty():
            prompt = queue.get_nowait()
            t0 = time.perf_counter()
            first = None
            stream = await client.chat.completions.create(
                model="rlproxy",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - t0
                if chunk.usage is not None:
                    tokens += chunk.usage.completion_tokens
            ttfts.append(first if first is not None else time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    elapsed = time.perf_counter() - t0
    await client.close()
    return tokens, elapsed, ttfts


def serve(model_dir: Path) -> tuple[subprocess.Popen, str]:
    data = Path(tempfile.mkdtemp(prefix="rlproxy-bench-"))
    return start_server(data, model_dir, {"RLPROXY_LOG_LEVEL": "WARNING"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="prompt list repeats per level")
    parser.add_argument("--model-dir", type=Path, default=REPO / "rlproxy-data")
    args = parser.parse_args()

    loaded = load_model(args.model_dir)
    tok = loaded.tokenizer
    prompts = PROMPTS * args.rounds
    template = ChatTemplate.for_tokenizer(tok)
    prompt_ids = [
        tok.encode(
            template.render([{"role": "user", "content": p}], None),
            add_special_tokens=False,
        )
        for p in prompts
    ]
    proc, url = serve(args.model_dir)
    rows = []
    try:
        for clients in (1, 4, 8):
            # Raw baseline and API measured back to back, same prompts and batch size.
            raw_tokens, raw_s = raw_generate(
                loaded.model, tok, prompt_ids, clients, args.max_tokens
            )
            api_tokens, api_s, ttfts = asyncio.run(
                api_run(f"{url}/v1", clients, prompts, args.max_tokens)
            )
            raw_tps, api_tps = raw_tokens / raw_s, api_tokens / api_s
            rows.append(
                (
                    clients,
                    raw_tps,
                    api_tps,
                    api_tps / raw_tps,
                    statistics.median(ttfts),
                    percentile(ttfts, 0.95),
                )
            )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(
        f"\nmax_tokens={args.max_tokens}, {len(prompts)} prompts per level, torch threads "
        f"{torch.get_num_threads()}"
    )
    print(
        f"{'clients':>7} {'raw tok/s':>10} {'API tok/s':>10} {'API/raw':>8} "
        f"{'TTFT p50':>9} {'TTFT p95':>9}"
    )
    for clients, raw_tps, api_tps, ratio, p50, p95 in rows:
        print(
            f"{clients:>7} {raw_tps:>10.1f} {api_tps:>10.1f} {ratio:>8.2f} "
            f"{p50 * 1000:>7.0f}ms {p95 * 1000:>7.0f}ms"
        )


if __name__ == "__main__":
    main()
