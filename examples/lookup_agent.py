"""A tool agent that knows nothing about rlproxy: the OpenAI Agents SDK, OPENAI_BASE_URL set.

The task: "What is the number of the code of lime?" Every word has a secret code (another word)
and every code a secret number; only the `find` tool knows a word's code and only the `get` tool
a code's number, and `get`'s result is the final answer. So an episode needs at least two tool
calls, and the second one's argument comes from the first one's result: `find(lime)` says
`pink`, then `get(pink)` says `17`. The agent is written as the SDK's docs write one: an `Agent`
with two `function_tool`s, `Runner.run`, the default Responses API model class. Settings a user
of the SDK would choose for this task and a small model:

- `tool_choice="required"` with `reset_tool_choice=False`: every turn calls a tool, and
  `tool_use_behavior=StopAtTools(["get"])`: the episode's final output is `get`'s result;
- `parallel_tool_calls=False`: one call a turn; at most 4 turns;
- `auto_previous_response_id=True`: each turn names the previous response instead of resending
  the conversation (Responses API chaining), so the server keeps the episode as one chain;
- the tools' `word` and `code` are typed as a `Literal` of the task's six words (the task's
  word, its code and four others, shuffled), so each task's tool schemas list the words that
  matter and the model cannot call a tool with a word that does not exist.

The environment's reward for an episode (`reward`):

    1.0    `find` was called with the task's word and the final output is the right number
    0.1    otherwise, when `find` was called with the task's word

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
from typing import Any, Literal

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

WORDS = [
    "apple", "arrow", "badge", "basket", "bell", "blanket", "boat", "bottle", "bread", "brick",
    "bridge", "brush", "bucket", "button", "cabin", "cable", "camera", "candle", "canoe",
    "carpet", "castle", "chair", "chalk", "cheese", "cherry", "circle", "clock", "cloud", "coat",
    "coin", "comet", "copper", "corn", "cotton", "crown", "cup", "curtain", "desk", "diamond",
    "dish", "door", "dragon", "drum", "eagle", "engine", "feather", "fence", "field", "flag",
    "flame", "flower", "forest", "fork", "fountain", "garden", "gate", "glass", "glove", "grape",
    "hammer", "harbor", "hat", "helmet", "honey", "horse", "island", "jacket", "jar", "jewel",
    "kettle", "key", "kite", "ladder", "lamp", "leaf", "lemon", "letter", "lion", "map", "marble",
    "mask", "meadow", "mirror", "moon", "mountain", "needle", "nest", "oak", "ocean", "orange",
    "owl", "paint", "palace", "paper", "pearl", "pencil", "pepper", "piano", "pillow", "pipe",
    "planet", "plate", "pocket", "pond", "potato", "queen", "rabbit", "radio", "rain", "ribbon",
    "ring", "river", "robot", "rocket", "roof", "rope", "rose", "saddle", "salt", "sand", "scarf",
    "shell", "ship", "shoe", "silver", "skirt", "sky", "snow", "sock", "spoon", "star", "stone",
    "storm", "sugar", "sun", "table", "tiger", "tower", "train", "tree", "trumpet", "tulip",
    "turtle", "umbrella", "valley", "vase", "violin", "wagon", "wall", "wheel", "whistle",
    "window", "wing", "wolf", "wool", "yarn", "zebra", "anchor", "barrel", "beacon", "cactus",
    "canyon", "cliff", "compass", "crystal", "desert", "falcon", "glacier", "guitar", "hammock",
    "lantern", "lizard", "magnet", "meteor", "orchid", "parrot", "pebble", "puzzle", "quilt",
    "rainbow", "saucer", "shovel", "spider", "statue", "sword", "thunder", "tunnel", "walnut",
]  # fmt: skip
# A held-out task asks about one of the first 100 words, practice about one of the other 88;
# a word's code is a word of its own half: no held-out word or code is ever seen in practice.
HELD_OUT_COUNT = 100
HELD_OUT_WORDS = WORDS[:HELD_OUT_COUNT]
PRACTICE_WORDS = WORDS[HELD_OUT_COUNT:]
CHOICES = 6  # words each task's tool schemas list

INSTRUCTIONS = (
    "You answer with the tools. find(word) gives the code of a word. get(code) gives the "
    "number of a code; that number is the final answer. First find the word's code, then get "
    "the code's number."
)


def _digest(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest(), 16)


def _half(word: str) -> list[str]:
    return HELD_OUT_WORDS if word in HELD_OUT_WORDS else PRACTICE_WORDS


# A task is a word ("lime"), or a word and a variant ("lime/17") for live traffic, where every
# task is asked once: a variant gives the word another secret code and other listed words, so
# 88 practice words make as many distinct tasks as needed. Variant 0 is the plain word.
def word_of(task: str) -> str:
    return task.split("/", 1)[0]


def _salt(task: str) -> str:
    word, _, variant = task.partition("/")
    return word if variant in ("", "0") else f"{word}:{variant}"


def live_task(word: str, variant: int) -> str:
    return f"{word}/{variant}" if variant else word


def code_of(task: str) -> str:
    """The environment's secret code of the task's word: another word of the same half (fixed
    per task)."""
    word = word_of(task)
    others = [w for w in _half(word) if w != word]
    return others[_digest(f"code:{_salt(task)}") % len(others)]


def number_of(code: str) -> int:
    """The environment's secret number of a code (1..40, fixed)."""
    return _digest(code) % 40 + 1


def question_text(task: str) -> str:
    return f"What is the number of the code of {word_of(task)}?"


def answer_of(task: str) -> int:
    return number_of(code_of(task))


def choices_of(task: str) -> list[str]:
    """The task's words the tool schemas list: the word, its code and four others of its half,
    in an order fixed per task."""
    word, code = word_of(task), code_of(task)
    rng = random.Random(f"choices:{_salt(task)}")
    others = [w for w in _half(word) if w not in (word, code)]
    chosen = [word, code, *rng.sample(others, CHOICES - 2)]
    rng.shuffle(chosen)
    return chosen


def held_out() -> list[str]:
    """100 tasks on words never used in practice."""
    return list(HELD_OUT_WORDS)


def practice_tasks() -> list[str]:
    return list(PRACTICE_WORDS)


@dataclass
class Episode:
    """One run of the agent: what the tools were asked, the answer, the response ids in order."""

    task: str
    found: list[str] = field(default_factory=list)
    got: list[str] = field(default_factory=list)
    final_output: str = ""
    response_ids: list[str] = field(default_factory=list)
    error: str | None = None


def reward(episode: Episode) -> float:
    """The environment's reward for an episode (see above)."""
    if word_of(episode.task) not in episode.found:
        return 0.0
    numbers = re.findall(r"-?\d+", episode.final_output)
    if numbers and int(numbers[-1]) == answer_of(episode.task):
        return 1.0
    return 0.1


def build_agent(episode: Episode, model: Any, settings: ModelSettings) -> Agent:
    """The agent for one episode: its tools write what they were asked into `episode`."""

    def find(word: str) -> str:
        """Get the code of a word."""
        episode.found.append(word)
        # the task's own code for its word; any other word's code as in the plain task
        return code_of(episode.task if word == word_of(episode.task) else word)

    def get(code: str) -> str:
        """Get the number of a code."""
        episode.got.append(code)
        return str(number_of(code))

    # the task's words as a Literal: the schemas list them (set here, since this module's
    # annotations are strings the SDK would resolve in the module's namespace)
    choice = Literal[tuple(choices_of(episode.task))]  # type: ignore[valid-type]
    find.__annotations__["word"] = choice
    get.__annotations__["code"] = choice

    return Agent(
        name="lookup",
        instructions=INSTRUCTIONS,
        model=model,
        tools=[function_tool(find), function_tool(get)],
        model_settings=settings,
        # every turn calls a tool; `get`'s result is the final answer
        reset_tool_choice=False,
        tool_use_behavior=StopAtTools(stop_at_tool_names=["get"]),
    )


async def run_episode(
    client: AsyncOpenAI,
    model: str,
    task: str,
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
            question_text(task),
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
        "tool_calls_per_episode": statistics.fmean(len(e.found) + len(e.got) for e in episodes),
        "errors": sum(e.error is not None for e in episodes),
    }


async def train(
    client: AsyncOpenAI,
    model: str,
    tasks: int | list[str],
    runs: int,
    seed: int,
    max_tokens: int = 64,
) -> dict[str, Any]:
    """Practice: `tasks` practice words drawn with `seed` (or the given task list), each run
    `runs` times, every episode rewarded."""
    if isinstance(tasks, int):
        chosen = random.Random(seed).sample(practice_tasks(), tasks)
    else:
        chosen = tasks

    async def one(task: str) -> tuple[Episode, float]:
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
    parser = argparse.ArgumentParser(description="A find-then-get tool agent (Agents SDK).")
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
