"""Where one decode step of the local engine spends its time, on CUDA or the CPU.

    .venv/bin/python bench/engine_profile.py [--rows 1 32] [--dtypes float32 bfloat16]
                                             [--data-dir rlproxy-data] [--steps 32]

For each dtype and row count, on the embedded model:
- engine: `rows` requests of `--steps` new tokens through a `LocalEngine` (one warm-up round
  first): wall milliseconds a decode step (sampling, text, events included);
- forward: the model alone decoding the same batch with a KV cache (no sampling: the next
  input is the argmax), wall milliseconds a step.

Engine above forward is the engine's own per-step work (sampling, detokenising, events). A
forward step that takes as long for 32 rows as for one is bound by the host (Python and kernel
launches in the model's code), not by the device's arithmetic. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from proxy.engines.base import ChoiceFinished, GenerationRequest, SamplingParams  # noqa: E402
from proxy.engines.loader import ensure_fp32_cache, load_model  # noqa: E402
from proxy.engines.local import LocalEngine  # noqa: E402


async def _one(engine: LocalEngine, prompt: list[int], tokens: int) -> int:
    request = GenerationRequest(prompt_ids=prompt, params=SamplingParams(max_tokens=tokens))
    async for event in engine.generate(request):
        if isinstance(event, ChoiceFinished):
            return len(event.completion_token_ids)
    return 0


def forward_only(loaded: Any, prompt: list[int], rows: int, steps: int) -> float:
    """Wall milliseconds a decode step of the bare model (batch `rows`)."""
    from transformers import DynamicCache

    model, device = loaded.model, loaded.device
    ids = torch.tensor([prompt] * rows, device=device)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start) / steps


async def measure(model_dir: Path, dtype: torch.dtype, rows: int, steps: int) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    loaded = await asyncio.to_thread(load_model, model_dir, device, str(model_dir), dtype)
    chat = [{"role": "user", "content": "Write a long story about a dragon."}]
    prompt = list(
        loaded.tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
    )
    engine = LocalEngine(loaded, max_batch_size=rows)
    await engine.start()
    try:
        await asyncio.gather(*(_one(engine, prompt, 4) for _ in range(rows)))
        before = engine.steps
        start = time.perf_counter()
        await asyncio.gather(*(_one(engine, prompt, steps) for _ in range(rows)))
        engine_ms = 1000 * (time.perf_counter() - start) / max(1, engine.steps - before)
    finally:
        await engine.stop()
    forward_only(loaded, prompt, rows, 4)  # warm-up
    wall = forward_only(loaded, prompt, rows, steps)
    figures = {
        "dtype": str(dtype).removeprefix("torch."),
        "rows": rows,
        "engine_ms_per_step": round(engine_ms, 2),
        "forward_ms_per_step": round(wall, 2),
    }
    print(json.dumps(figures), flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--out", type=Path, help="also write the figures here as JSON")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--data-dir", type=Path, default=REPO / "rlproxy-data")
    args = parser.parse_args()
    model_dir = ensure_fp32_cache(args.data_dir)
    figures = [
        asyncio.run(measure(model_dir, getattr(torch, name), rows, args.steps))
        for name in args.dtypes
        for rows in args.rows
    ]
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
