"""A tool agent that knows nothing about rlproxy: the OpenAI Agents SDK, OPENAI_BASE_URL set.

The task: "What is the number of red plus the number of lime?" The number of a word is known
only to the `lookup` tool, and the answer is what the `add` tool returns, so an episode needs
at least three tool calls: `lookup` for each word, then `add` with the two numbers it got.
The agent is written as the SDK's docs write one: an `Agent` with two `function_tool`s,
`Runner.run`, the default Responses API model class. Settings a user of the SDK would choose
for this task and a small model:

- `tool_choice="required"` with `reset_tool_choice=False`: every turn calls a tool, and
  `tool_use_behavior=StopAtTools(["add"])`: the episode's final output is `add`'s result;
- `parallel_tool_calls=False`: one call a turn; at most 4 turns;
- `auto_previous_response_id=True`: each turn names the previous response instead of resending
  the conversation (Responses API chaining), so the server keeps the episode as one chain;
- `word` is typed as a `Literal` of the known words, so the tool's schema lists them.

The environment's reward for an episode (`reward`):

    1.0    the final output is the right number (the sum of the two words' numbers)
    0.1    otherwise, for each of the two words the agent looked up (at most 0.2)

The agent reports each episode's reward by the id of the last response it got, to
`POST <server>/rl/trajectories/<response id>/reward`: the one rlproxy endpoint an agent calls
to say how an episode went. Everything else is the OpenAI API through the SDK.

    # practice: each task run --runs times, every episode rewarded
    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 python examples/lookup_agent.py train \\
        --tasks 4 --runs 8 --seed 1
    # measure: held-out tasks, nothing reported, success rate and standard error printed
    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 python examples/lookup_agent.py eval \\
        --model rlproxy@base --samples 1 --temperature 0
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import random
import re
import statistics
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import httpx
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    StopAtTools,
    function_tool,
    set_tracing_disabled,
)
from agents.exceptions import AgentsException
from openai import AsyncOpenAI

set_tracing_disabled(True)  # the SDK would send its traces to OpenAI's platform

Word = Literal[
    "red", "blue", "gold", "pink", "gray", "lime", "navy", "teal", "rose", "jade", "ruby",
    "pear", "plum", "lemon", "mango", "peach", "grape", "melon", "olive", "rice", "corn", "kiwi",
]  # fmt: skip
# Held-out tasks use only the first 11 words, practice only the other 11: a held-out task's
# numbers were never seen in practice.
WORDS: list[str] = list(get_args(Word))
HELD_OUT_WORDS = WORDS[:11]
PRACTICE_WORDS = WORDS[11:]
HELD_OUT_SEED = 12345
HELD_OUT_COUNT = 100

INSTRUCTIONS = (
    "You answer with the tools. lookup(word) gives the number of a word. add(a, b) adds two "
    "numbers and gives the final answer. Look up both words, then add their numbers."
)


def number_of(word: str) -> int:
    """The environment's secret number for `word` (1..40, fixed)."""
    return int(hashlib.sha256(word.encode()).hexdigest(), 16) % 40 + 1


def question_text(a: str, b: str) -> str:
    return f"What is the number of {a} plus the number of {b}?"


def answer_of(task: tuple[str, str]) -> int:
    return number_of(task[0]) + number_of(task[1])


def all_pairs(words: list[str]) -> list[tuple[str, str]]:
    return [(a, b) for a in words for b in words if a != b]


def held_out() -> list[tuple[str, str]]:
    """100 tasks on words never used in practice."""
    return random.Random(HELD_OUT_SEED).sample(all_pairs(HELD_OUT_WORDS), HELD_OUT_COUNT)


def practice_tasks() -> list[tuple[str, str]]:
    return all_pairs(PRACTICE_WORDS)


@dataclass
class Episode:
    """One run of the agent: what the tools saw, the answer, the response ids in order."""

    task: tuple[str, str]
    looked_up: list[str] = field(default_factory=list)
    added: list[tuple[int, int]] = field(default_factory=list)
    final_output: str = ""
    response_ids: list[str] = field(default_factory=list)
    error: str | None = None


def reward(episode: Episode) -> float:
    """The environment's reward for an episode (see above)."""
    numbers = re.findall(r"-?\d+", episode.final_output)
    if numbers and int(numbers[-1]) == answer_of(episode.task):
        return 1.0
    return 0.1 * len(set(episode.task) & set(episode.looked_up))


def build_agent(episode: Episode, model: Any, settings: ModelSettings) -> Agent:
    """The agent for one episode: its tools write what they were asked into `episode`."""

    @function_tool
    def lookup(word: Word) -> str:
        """Get the number of a word."""
        episode.looked_up.append(word)
        return str(number_of(word))

    @function_tool
    def add(a: int, b: int) -> str:
        """Add two numbers."""
        episode.added.append((a, b))
        return str(a + b)

    return Agent(
        name="lookup",
        instructions=INSTRUCTIONS,
        model=model,
        tools=[lookup, add],
        model_settings=settings,
        # every turn calls a tool; `add`'s result is the final answer
        reset_tool_choice=False,
        tool_use_behavior=StopAtTools(stop_at_tool_names=["add"]),
    )


async def run_episode(
    client: AsyncOpenAI,
    model: str,
    task: tuple[str, str],
    max_tokens: int = 64,
    temperature: float = 1.0,
    max_turns: int = 4,
) -> Episode:
    episode = Episode(task)
    settings = ModelSettings(
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=max_tokens,
        temperature=temperature,
    )
    agent = build_agent(episode, OpenAIResponsesModel(model, client), settings)
    try:
        result = await Runner.run(
            agent,
            question_text(*task),
            max_turns=max_turns,
            auto_previous_response_id=True,
            run_config=RunConfig(tracing_disabled=True),
        )
        episode.final_output = str(result.final_output or "")
        episode.response_ids = [r.response_id for r in result.raw_responses if r.response_id]
    except AgentsException as e:  # e.g. MaxTurnsExceeded: the episode failed
        episode.error = type(e).__name__
        data = getattr(e, "run_data", None)
        if data is not None:
            episode.response_ids = [r.response_id for r in data.raw_responses if r.response_id]
    return episode


async def report(client: AsyncOpenAI, episode: Episode, value: float) -> None:
    """Post the episode's reward by its last response id."""
    if not episode.response_ids:
        return
    server = str(client.base_url).rstrip("/").removesuffix("/v1")
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(
            f"{server}/rl/trajectories/{episode.response_ids[-1]}/reward",
            json={"reward": value, "source": "lookup-env"},
        )
        r.raise_for_status()


def summary(episodes: list[Episode], rewards: list[float]) -> dict[str, Any]:
    n = len(episodes)
    success = [float(r == 1.0) for r in rewards]
    return {
        "episodes": n,
        "success": statistics.fmean(success),
        "success_stderr": statistics.stdev(success) / math.sqrt(n) if n > 1 else 0.0,
        "mean_reward": statistics.fmean(rewards),
        "stderr": statistics.stdev(rewards) / math.sqrt(n) if n > 1 else 0.0,
        "tool_calls_per_episode": statistics.fmean(
            len(e.looked_up) + len(e.added) for e in episodes
        ),
        "errors": sum(e.error is not None for e in episodes),
    }


async def train(
    client: AsyncOpenAI,
    model: str,
    tasks: int,
    runs: int,
    seed: int,
    max_tokens: int = 64,
) -> dict[str, Any]:
    chosen = random.Random(seed).sample(practice_tasks(), tasks)

    async def one(task: tuple[str, str]) -> tuple[Episode, float]:
        episode = await run_episode(client, model, task, max_tokens)
        value = reward(episode)
        await report(client, episode, value)
        return episode, value

    results = await asyncio.gather(*(one(t) for t in chosen for _ in range(runs)))
    episodes, rewards = [e for e, _ in results], [r for _, r in results]
    per_task = [rewards[i : i + runs] for i in range(0, len(rewards), runs)]
    return summary(episodes, rewards) | {
        # a task whose runs all got the same reward teaches a group-relative learner nothing
        "tasks_with_varied_rewards": sum(len(set(t)) > 1 for t in per_task),
        "runs": [e.__dict__ | {"reward": r} for e, r in results],
    }


async def evaluate(
    client: AsyncOpenAI,
    model: str,
    samples: int,
    max_tokens: int = 64,
    temperature: float = 1.0,
) -> dict[str, Any]:
    """Held-out tasks, `samples` episodes each at `temperature` (0: greedy), nothing reported."""
    jobs = [
        run_episode(client, model, task, max_tokens, temperature)
        for task in held_out()
        for _ in range(samples)
    ]
    episodes = await asyncio.gather(*jobs)
    rewards = [reward(e) for e in episodes]
    return (
        {"model": model, "temperature": temperature}
        | summary(episodes, rewards)
        | {"runs": [e.__dict__ | {"reward": r} for e, r in zip(episodes, rewards, strict=True)]}
    )


async def main_async(args: argparse.Namespace) -> None:
    async with AsyncOpenAI(
        base_url=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
        api_key=os.environ.get("OPENAI_API_KEY", "sk-local"),
        timeout=600,
    ) as client:
        if args.command == "train":
            out = await train(client, args.model, args.tasks, args.runs, args.seed, args.max_tokens)
        else:
            out = await evaluate(
                client, args.model, args.samples, args.max_tokens, args.temperature
            )
    out.pop("runs")
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description="A lookup-and-add tool agent (Agents SDK).")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="practice tasks, every episode rewarded")
    t.add_argument("--tasks", type=int, default=4)
    t.add_argument("--runs", type=int, default=8, help="episodes per task")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--model", default="rlproxy")
    e = sub.add_parser("eval", help="held-out tasks, nothing reported")
    e.add_argument("--samples", type=int, default=1, help="episodes per held-out task")
    e.add_argument("--model", default="rlproxy")
    e.add_argument("--temperature", type=float, default=1.0, help="0: greedy episodes")
    for command in (t, e):
        command.add_argument("--max-tokens", type=int, default=64, help="limit per model turn")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
