"""How off-policy a group becomes as the trainer steps past the version that sampled it.

One process, no servers: the real trainer (`trainer.peft_backend.PeftTrainer`, SmolLM2-135M,
LoRA r 8) on the arithmetic agent's task (`examples/arithmetic_agent.py`: its practice questions
and its reward). First a batch of groups (QUESTIONS x RUNS replies at temperature 1) is sampled
from the base model, version 0, and kept with its behaviour logprobs, as serving stores a call.
Then every step samples fresh groups from the current weights and makes one GRPO step on them
(strictly on-policy), and afterwards scores the kept batch, now `step` versions behind, under the
new weights:

- `|log ratio|`: mean |log pi_theta / mu| over its tokens;
- `ppo no-grad`: the share of tokens whose clipped ratio against the stored mu gives no gradient
  (`off_policy_correction` 'ppo', epsilon 0.2): what a stale group loses today;
- `tis weight` and `tis capped`: the mean truncated importance weight min(pi / mu, 2) and the
  share of tokens at the cap ('tis'): what the correction keeps, bounded.

The stale batch's group advantages stay those of its own rewards. Prints one row per step and
writes `<out>/staleness_drift.json`.

    .venv/bin/python bench/staleness_drift.py [--steps 10] [--lr 6e-4] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

import arithmetic_agent  # noqa: E402

from trainer.config import TrainerConfig  # noqa: E402
from trainer.grpo import TrainingExample, group_advantages, grpo_loss  # noqa: E402
from trainer.peft_backend import PeftTrainer  # noqa: E402


def sample_groups(
    trainer: PeftTrainer, tok: Any, pairs: list[tuple[int, int]], runs: int, max_tokens: int
) -> tuple[list[TrainingExample], float]:
    """RUNS sampled replies per question under the trainer's current weights, with their
    logprobs (what the engine would store) and group advantages; and the mean reward."""
    examples: list[TrainingExample] = []
    rewards_all: list[float] = []
    model = trainer.model
    for a, b in pairs:
        text = tok.apply_chat_template(
            [{"role": "user", "content": arithmetic_agent.question_text(a, b)}],
            add_generation_prompt=True,
            tokenize=False,
        )
        prompt = list(tok(str(text), add_special_tokens=False)["input_ids"])
        with torch.no_grad():
            out = model.generate(
                input_ids=torch.tensor([prompt] * runs),
                attention_mask=torch.ones(runs, len(prompt), dtype=torch.long),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=max_tokens,
                pad_token_id=trainer.pad_id,
            )
        completions = []
        for row in out[:, len(prompt) :].tolist():
            ids = []
            for t in row:
                ids.append(t)
                if t == tok.eos_token_id:
                    break
            completions.append(ids)
        replies = [tok.decode(c, skip_special_tokens=True) for c in completions]
        rewards = [arithmetic_agent.reward(r, a + b) for r in replies]
        rewards_all += rewards
        advantages = group_advantages(rewards)
        if advantages is None:
            continue
        for i, (ids, adv) in enumerate(zip(completions, advantages, strict=True)):
            examples.append(
                TrainingExample(f"{a}+{b}#{i}", prompt, ids, logprobs(trainer, prompt, ids), adv)
            )
    return examples, sum(rewards_all) / max(len(rewards_all), 1)


def logprobs(trainer: PeftTrainer, prompt: list[int], completion: list[int]) -> list[float]:
    with torch.no_grad():
        logits = trainer.model(input_ids=torch.tensor([prompt + completion])).logits[0]
    picked = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), -1)
    return picked.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).tolist()


def drift(trainer: PeftTrainer, batch: list[TrainingExample]) -> dict[str, float]:
    """The stale batch under the current weights: the loss's view of it, 'ppo' and 'tis'."""
    width = max(len(e.completion_ids) for e in batch)
    new = torch.zeros(len(batch), width)
    mu = torch.zeros(len(batch), width)
    mask = torch.zeros(len(batch), width, dtype=torch.bool)
    for i, e in enumerate(batch):
        n = len(e.completion_ids)
        new[i, :n] = torch.tensor(logprobs(trainer, e.prompt_ids, e.completion_ids))
        mu[i, :n] = torch.tensor(e.old_logprobs)
        mask[i, :n] = True
    adv = torch.tensor([e.advantage for e in batch])
    _, ppo = grpo_loss(new, mu, adv, mask, epsilon=trainer.config.epsilon)
    _, tis = grpo_loss(new, new, adv, mask, behaviour_logprobs=mu, tis_cap=2.0)
    return {
        "abs_log_ratio": float((new - mu).abs()[mask].mean()),
        "ppo_no_grad": ppo["clip_fraction"],
        "tis_weight_mean": tis["is_weight_mean"],
        "tis_capped": tis["is_capped_fraction"],
        "tokens": ppo["tokens"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--questions", type=int, default=4, help="groups per step")
    parser.add_argument("--runs", type=int, default=8, help="replies per question")
    parser.add_argument("--lr", type=float, default=6e-4, help="the learning proof's rate")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (on a loaded 2-core machine, 2 threads ran 16x slower than 1)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=Path(os.environ.get("RLPROXY_MODEL_DIR", REPO / "rlproxy-data")),
    )
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from proxy.engines.loader import ensure_fp32_cache

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model_dir = ensure_fp32_cache(args.model_dir)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    trainer = PeftTrainer(
        model_dir,
        TrainerConfig(learning_rate=args.lr, groups_per_step=args.questions),
        device="cpu",
    )
    pairs = arithmetic_agent.practice_pairs()
    print(f"settings: {json.dumps({k: str(v) for k, v in vars(args).items()})}", flush=True)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    stale, base_reward = sample_groups(
        trainer, tok, rng.sample(pairs, args.questions), args.runs, args.max_tokens
    )
    print(f"kept batch from version 0: {len(stale)} replies, mean reward {base_reward:.3f}")
    rows: list[dict[str, Any]] = [
        {"behind": 0, "practice_reward": base_reward, **drift(trainer, stale)}
    ]
    print(
        "| versions behind | practice reward | mean abs log ratio | ppo no-grad | tis weight "
        "| tis capped |"
    )
    print("| --- | --- | --- | --- | --- | --- |")

    def show(r: dict[str, Any]) -> None:
        print(
            f"| {r['behind']} | {r['practice_reward']:.3f} | {r['abs_log_ratio']:.3f} | "
            f"{r['ppo_no_grad']:.1%} | {r['tis_weight_mean']:.3f} | {r['tis_capped']:.1%} |",
            flush=True,
        )

    show(rows[0])
    started = time.monotonic()
    for step in range(1, args.steps + 1):
        fresh: list[TrainingExample] = []
        reward = 0.0
        while not fresh:  # a round whose groups all had equal rewards has nothing to train on
            fresh, reward = sample_groups(
                trainer, tok, rng.sample(pairs, args.questions), args.runs, args.max_tokens
            )
        trainer.train_step(fresh)
        rows.append({"behind": step, "practice_reward": reward, **drift(trainer, stale)})
        show(rows[-1])
    summary = {
        "settings": {k: str(v) for k, v in vars(args).items()},
        "seconds": time.monotonic() - started,
        "load_average_at_end": os.getloadavg(),
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "staleness_drift.json"
    out.write_text(json.dumps(summary, indent=2))
    print(f"{args.steps} steps in {summary['seconds']:.0f} s; wrote {out}")


if __name__ == "__main__":
    main()
