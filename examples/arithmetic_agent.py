"""An arithmetic agent that knows nothing about rlproxy: plain `openai` SDK, OPENAI_BASE_URL set.

The task: answer "What is A + B? Answer with just the number." with the number alone. The
environment's reward for a reply (`reward`) makes that answer clearly best:

    1.0    the reply is the right number alone (a trailing period allowed)
    0.25   the reply is a number alone, but the wrong one
    0.2 .. 0.4   the right number inside other text ("11 + 14 = 25"): 0.2 + 0.2 * brevity
    0 .. 0.1     anything else: 0.1 * brevity

where brevity = max(0, 1 - characters / 40). A sentence holding the right number earns at most
0.4, so it never nears the exact answer; the brevity terms still pay shorter replies a little
more, which is the gradient from rambling towards the bare number. A wrong number alone sits
beside a sentence with the right one: each does half of what was asked.

Two other shapes for a wrong bare number were tried in `bench/learning_proof.py` on 2026-12-03
(a flat 0.25 lets a policy answer every question with the same few numbers, "15", "16", "19":
right on 26 of 32 held-out sums from 11 to 20, on 1 of 50 above 20, at 30 % exact): paying less
the further off it is, 0.25 * (1 - |error| / 10), put it below the right sentence, and the
policy settled on "11 + 14 = 25" (0 % exact after 10 training minutes); a closeness bonus above
0.25, 0.25 + 0.1 * (1 - |error| / 10), learnt no faster than the flat reward (22 % exact after
10.8 minutes against 28-42 % in the flat reward's run the same day). So the flat 0.25 stays.

The agent reports each reward for the response it got, by that response's completion id, to
`POST <server>/rl/trajectories/<completion id>/reward`: the one rlproxy endpoint an agent calls
to say how an episode went. Everything else is the OpenAI API.

    # practice: each question asked --runs times, every answer rewarded
    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 python examples/arithmetic_agent.py train \\
        --questions 4 --runs 8 --seed 1
    # measure: held-out questions, nothing reported, mean reward and standard error printed
    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 python examples/arithmetic_agent.py eval \\
        --model rlproxy@base --samples 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import statistics

import httpx
from openai import AsyncOpenAI

HELD_OUT_SEED = 12345
HELD_OUT_COUNT = 100


def question_text(a: int, b: int) -> str:
    return f"What is {a} + {b}? Answer with just the number."


def reward(reply: str, answer: int) -> float:
    """The environment's reward for `reply` to a question whose answer is `answer` (see above)."""
    text = reply.strip()
    if re.fullmatch(r"-?\d+\.?", text):
        return 1.0 if int(text.rstrip(".")) == answer else 0.25
    brevity = max(0.0, 1.0 - len(text) / 40)
    if str(answer) in re.findall(r"-?\d+", text):
        return 0.2 + 0.2 * brevity
    return 0.1 * brevity


def all_pairs() -> list[tuple[int, int]]:
    return [(a, b) for a in range(1, 21) for b in range(1, 21)]


def held_out() -> list[tuple[int, int]]:
    """100 questions never used for practice."""
    return random.Random(HELD_OUT_SEED).sample(all_pairs(), HELD_OUT_COUNT)


def practice_pairs() -> list[tuple[int, int]]:
    excluded = set(held_out())
    return [p for p in all_pairs() if p not in excluded]


async def episode(
    client: AsyncOpenAI,
    model: str,
    a: int,
    b: int,
    report: bool,
    max_tokens: int = 16,
    temperature: float = 1.0,
) -> tuple[str, float]:
    completion = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question_text(a, b)}],
        max_tokens=max_tokens,
        temperature=temperature,
    )
    reply = completion.choices[0].message.content or ""
    r = reward(reply, a + b)
    if report:
        server = str(client.base_url).rstrip("/").removesuffix("/v1")
        async with httpx.AsyncClient(timeout=60) as http:
            response = await http.post(
                f"{server}/rl/trajectories/{completion.id}/reward",
                json={"reward": r, "source": "arithmetic-env"},
            )
            response.raise_for_status()
    return reply, r


async def train(
    client: AsyncOpenAI, model: str, questions: int, runs: int, seed: int, max_tokens: int = 16
) -> dict:
    pairs = random.Random(seed).sample(practice_pairs(), questions)
    jobs = [
        episode(client, model, a, b, report=True, max_tokens=max_tokens)
        for a, b in pairs
        for _ in range(runs)
    ]
    rewards = [r for _, r in await asyncio.gather(*jobs)]
    per_question = [rewards[i : i + runs] for i in range(0, len(rewards), runs)]
    return {
        "episodes": len(rewards),
        "mean_reward": statistics.fmean(rewards),
        "exact": sum(r == 1.0 for r in rewards) / len(rewards),
        # a question whose runs all got the same reward teaches a group-relative learner nothing
        "questions_with_varied_rewards": sum(len(set(q)) > 1 for q in per_question),
    }


async def evaluate(
    client: AsyncOpenAI, model: str, samples: int, max_tokens: int = 16, temperature: float = 1.0
) -> dict:
    """Held-out questions, `samples` attempts each at `temperature` (0: the greedy answer, and
    then one attempt is enough), nothing reported."""
    jobs = [
        episode(client, model, a, b, report=False, max_tokens=max_tokens, temperature=temperature)
        for a, b in held_out()
        for _ in range(samples)
    ]
    results = await asyncio.gather(*jobs)
    rewards = [r for _, r in results]
    n = len(rewards)
    return {
        "model": model,
        "episodes": n,
        "mean_reward": statistics.fmean(rewards),
        "stderr": statistics.stdev(rewards) / math.sqrt(n),
        "exact": sum(r == 1.0 for r in rewards) / n,
        "examples": [reply for reply, _ in results[:5]],
    }


async def main_async(args: argparse.Namespace) -> None:
    async with AsyncOpenAI(
        base_url=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
        api_key=os.environ.get("OPENAI_API_KEY", "sk-local"),
        timeout=600,
    ) as client:
        if args.command == "train":
            out = await train(
                client, args.model, args.questions, args.runs, args.seed, args.max_tokens
            )
        else:
            out = await evaluate(
                client, args.model, args.samples, args.max_tokens, args.temperature
            )
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description="An arithmetic agent on the OpenAI API.")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="practice questions, every answer rewarded")
    t.add_argument("--questions", type=int, default=4)
    t.add_argument("--runs", type=int, default=8, help="attempts per question")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--model", default="rlproxy")
    e = sub.add_parser("eval", help="held-out questions, nothing reported")
    e.add_argument("--samples", type=int, default=2, help="attempts per held-out question")
    e.add_argument("--model", default="rlproxy")
    e.add_argument("--temperature", type=float, default=1.0, help="0: greedy answers")
    for command in (t, e):
        command.add_argument("--max-tokens", type=int, default=16, help="reply length limit")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
