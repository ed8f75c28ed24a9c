"""What the forgetting check measures on sane and on broken adapter versions: its threshold's basis.

One process, no server: the real local engine on the embedded SmolLM2-135M (CPU) and the real
check (`proxy.adapters.forgetting.ForgettingCheck`, prompts rendered by the model's chat template
as serving renders them) against adapter folders written the way the trainer and the tests write
them:

- `fresh`: the trainer's own LoRA before any step (B = 0: the base exactly);
- `trained lr=...`: the real trainer (`trainer.peft_backend.PeftTrainer`, LoRA r 8) after 1, 2, 4
  ... GRPO steps on the arithmetic agent's task (`examples/arithmetic_agent.py`, on-policy, as
  `bench/staleness_drift.py` trains), at the trainer's default rate (1e-4) and at the learning
  proof's (6e-4);
- `random xS`: the tests' random LoRA (`tests.e2e.test_adapters.write_random_lora`: PEFT's
  `init_lora_weights=False` draw, B times S), S = 1, 3 (what the hot-swap, rollout and dashboard
  tests publish), 10, 30 (deliberately broken).

For each: the check's figures (mean KL(base || version) per answer token, the worst prompt's,
the share of prompts whose greedy answer / first token changed), the check's seconds, and the
version's greedy answer to a few prompts beside the base's, so a reader sees what a KL means.
Writes `<out>/forgetting_threshold.json`.

    .venv/bin/python bench/forgetting_threshold.py [--steps 8] [--out bench/results]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "examples"))

import arithmetic_agent  # noqa: E402
from staleness_drift import sample_groups  # noqa: E402

from proxy.adapters.forgetting import ForgettingCheck, ForgettingConfig  # noqa: E402
from proxy.adapters.registry import adapter_name  # noqa: E402
from proxy.chat.prompt import ChatTemplate  # noqa: E402
from proxy.engines.base import ChoiceFinished, GenerationRequest, SamplingParams  # noqa: E402
from tests.e2e.test_adapters import write_random_lora  # noqa: E402
from trainer import checkpoints  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402
from trainer.peft_backend import PeftTrainer  # noqa: E402

SHOWN = ("capital", "times", "lock", "square")
"""Prompts whose greedy answers are written beside the figures."""


def train_versions(
    model_dir: Path, root: Path, lr: float, steps: list[int], args: argparse.Namespace
) -> dict[str, Path]:
    """Train on-policy GRPO steps at `lr`; the checkpoint folders after each of `steps`."""
    from transformers import AutoTokenizer

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    trainer = PeftTrainer(
        model_dir, TrainerConfig(learning_rate=lr, groups_per_step=args.questions), device="cpu"
    )
    pairs = arithmetic_agent.practice_pairs()
    out: dict[str, Path] = {}
    if lr == args.lrs[0]:  # the trainer's LoRA before any step
        out["fresh"] = checkpoints.write_checkpoint(
            root / "fresh", 1, trainer.adapter_state(), trainer.adapter_config(), {}, {}
        )
    for step in range(1, max(steps) + 1):
        started = time.monotonic()
        examples, reward = [], 0.0
        while not examples:  # a round whose groups all had equal rewards trains nothing
            examples, reward = sample_groups(
                trainer, tok, rng.sample(pairs, args.questions), args.runs, args.max_tokens
            )
        trainer.train_step(examples)
        print(
            f"lr {lr:g} step {step}: practice reward {reward:.3f}, "
            f"{time.monotonic() - started:.0f} s",
            flush=True,
        )
        if step in steps:
            out[f"trained lr={lr:g} step {step}"] = trainer.save(root / f"lr{lr:g}")
    return out


async def greedy(engine: Any, prompt_ids: list[int], adapter: str | None) -> str:
    request = GenerationRequest(
        prompt_ids, SamplingParams(max_tokens=32, temperature=0.0), adapter=adapter
    )
    async for event in engine.generate(request):
        if isinstance(event, ChoiceFinished):
            return event.text
    return ""


async def measure(model_dir: Path, adapters: dict[str, Path]) -> dict[str, Any]:
    from proxy.engines.loader import load_model
    from proxy.engines.local import LocalEngine

    loaded = load_model(model_dir, device=torch.device("cpu"))
    engine = LocalEngine(loaded)
    template = ChatTemplate.for_tokenizer(loaded.tokenizer)

    def render(messages: Any) -> list[int]:
        return list(
            loaded.tokenizer.encode(template.render(messages, None), add_special_tokens=False)
        )

    check = ForgettingCheck(engine, render, ForgettingConfig())
    shown = {p.id: render(p.messages) for p in check.prompts if p.id in SHOWN}
    await engine.start()
    try:
        started = time.monotonic()
        await check.base_answers()
        base_seconds = time.monotonic() - started
        base = {k: await greedy(engine, ids, None) for k, ids in shown.items()}
        rows = []
        for number, (label, path) in enumerate(adapters.items(), start=1):
            name = adapter_name(number)
            await engine.load_adapter(name, str(path))
            verdict = await check.check(number)
            answers = {k: await greedy(engine, ids, name) for k, ids in shown.items()}
            await engine.unload_adapter(name)
            assert verdict.divergence is not None, verdict.reason
            row = {
                "adapter": label,
                **{
                    k: verdict.divergence.__dict__[k]
                    for k in (
                        "mean_kl",
                        "worst_prompt",
                        "worst_prompt_kl",
                        "answer_changed",
                        "first_token_changed",
                        "tokens",
                    )
                },
                "check_seconds": round(verdict.seconds, 2),
                "answers": answers,
            }
            rows.append(row)
            print(
                f"| {label} | {row['mean_kl']:.4f} | {row['worst_prompt_kl']:.3f} "
                f"({row['worst_prompt']}) | {row['answer_changed']:.0%} | "
                f"{row['first_token_changed']:.0%} | {row['check_seconds']:.1f} |",
                flush=True,
            )
        return {
            "prompts": len(check.prompts),
            "answer_tokens": check.config.answer_tokens,
            "base_answers_seconds": round(base_seconds, 2),
            "base_answers": base,
            "rows": rows,
        }
    finally:
        await engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="the most GRPO steps trained")
    parser.add_argument("--lrs", type=float, nargs="*", default=[1e-4, 6e-4])
    parser.add_argument("--questions", type=int, default=4, help="groups per step")
    parser.add_argument("--runs", type=int, default=8, help="replies per question")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--scales", type=float, nargs="+", default=[1, 3, 10, 30])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=Path(os.environ.get("RLPROXY_MODEL_DIR", REPO / "rlproxy-data")),
    )
    args = parser.parse_args()
    from proxy.engines.loader import ensure_fp32_cache

    torch.set_num_threads(args.threads)
    print(f"settings: {json.dumps({k: str(v) for k, v in vars(args).items()})}", flush=True)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    model_dir = ensure_fp32_cache(args.model_dir)
    steps = sorted({s for s in (1, 2, 4, 8, 16, args.steps) if s <= args.steps})
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        adapters: dict[str, Path] = {}
        for lr in args.lrs:
            adapters |= train_versions(model_dir, root, lr, steps, args)
        for scale in args.scales:
            path = root / f"random-x{scale:g}"
            write_random_lora(args.model_dir, path, scale=scale)
            adapters[f"random x{scale:g}"] = path
        print("| adapter | mean KL | worst prompt | answers changed | first token | seconds |")
        print("| --- | --- | --- | --- | --- | --- |")
        result = asyncio.run(measure(model_dir, adapters))
    summary = {
        "settings": {k: str(v) for k, v in vars(args).items()},
        "seconds": round(time.monotonic() - started),
        "load_average_at_end": os.getloadavg(),
        **result,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "forgetting_threshold.json"
    out.write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
