"""The proof: an unchanged agent, pointed at rlproxy, gets better at its task while it works.

Starts two servers on this machine:
- the training server: `rlproxy serve` with its trainer process, background scoring and
  publishing on. The agent (examples/arithmetic_agent.py, plain `openai` SDK, run in this
  process) practises on it: each round asks QUESTIONS practice questions RUNS times each and
  reports the environment's reward for every answer. rlproxy groups the runs of each question
  (task signature), takes the rewards as scores, makes one GRPO step per QUESTIONS usable groups
  and publishes the new adapter.
- an evaluation server with no trainer and its own database, reading the same checkpoint
  folder, so held-out evaluation traffic never becomes training data.

Between steps nothing waits that need not: with `--ahead 1` (the default) the next practice
round is generated while the trainer steps on the last one (so a round is sampled from the
version one behind the newest; GRPO's clipped ratio is taken against the logprobs stored at
sampling time, so this is ordinary one-step-off-policy training), the runner counts the usable
groups it produced (runs with different rewards) and practises again at once when a step cannot
come yet, and the servers poll every 0.25 s. `--ahead 0` waits for every version before
practising again (strictly on-policy); `--ahead K` lets the trainer fall up to K - 1 versions
behind the practice (traffic that does not wait for training), and `--max-staleness` /
`--stale-policy` set the trainer's bound on how stale a trained group may be
(docs/concepts/grpo.md).

Held-out reward (100 questions never practised, `--eval-samples` attempts each) is measured for
the base model first, every `--eval-every` steps, and for the last version; no practice round is
in flight during an evaluation. After each evaluation the gain over the base is given in
standard errors; the first version at +3 standard errors or more gives the minutes to +3 s.e.
(training wall time since the first practice round with the time spent evaluating left out, and
with it). Exact answers (the reply is the right number alone) are reported beside the reward at
every evaluation, sampled at temperature 1 as in practice (what `--stop-at-exact` reads) and
greedy (temperature 0, one answer per question: the policy's most likely answer). Every setting
used is printed first. Writes `<out>/learning.json` and `<out>/learning.png` (training reward
per step and held-out reward with standard errors) and prints the summary.

    .venv/bin/python bench/learning_proof.py [--minutes 15] [--lr 6e-4] [--stop-at-exact 0.3]
                                             [--out bench/results]

Defaults: 15 training minutes at most, ending early at the first evaluation with 30 % exact
answers; lr 6e-4 (3e-4 took twice as long to +3 s.e. and stayed at 20 % exact after 12 minutes
on the same quiet machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

import arithmetic_agent  # noqa: E402
import proof_loop  # noqa: E402
import provenance  # noqa: E402


def practise(url: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One practice round of the agent against `url` (every answer rewarded)."""

    async def run() -> dict[str, Any]:
        async with AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-agent", timeout=600) as client:
            return await arithmetic_agent.train(
                client, "rlproxy", args.questions, args.runs, seed, args.max_tokens
            )

    result = asyncio.run(run())
    result["usable"] = result["questions_with_varied_rewards"]
    return result


def evaluate(eval_url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    async def run() -> tuple[dict[str, Any], dict[str, Any]]:
        async with AsyncOpenAI(
            base_url=f"{eval_url}/v1", api_key="sk-agent", timeout=600
        ) as client:
            sampled = await arithmetic_agent.evaluate(
                client, model, args.eval_samples, args.max_tokens
            )
            greedy = await arithmetic_agent.evaluate(
                client, model, 1, args.max_tokens, temperature=0.0
            )
            return sampled, greedy

    result, greedy = asyncio.run(run())
    result["greedy"] = {k: greedy[k] for k in ("mean_reward", "stderr", "exact", "episodes")}
    print(
        f"  held-out {model}: {result['mean_reward']:.3f} ± {result['stderr']:.3f} "
        f"(exact answers {result['exact']:.0%}, n={result['episodes']}); greedy: "
        f"{greedy['mean_reward']:.3f}, exact {greedy['exact']:.0%} (n={greedy['episodes']})",
        flush=True,
    )
    return result


def hardware() -> str:
    """What the servers ran on: they take CUDA when this machine has it (`pick_device`)."""
    import torch

    return f"CUDA, {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--minutes",
        type=float,
        default=15.0,
        help="training wall-time budget (time spent evaluating not counted)",
    )
    parser.add_argument("--questions", type=int, default=4, help="groups per step")
    parser.add_argument("--runs", type=int, default=8, help="attempts per question (group size)")
    parser.add_argument("--lr", type=float, default=6e-4, help="the trainer's learning rate")
    parser.add_argument("--max-tokens", type=int, default=12, help="the agent's reply limit")
    parser.add_argument(
        "--ahead",
        type=int,
        default=1,
        help="0: on-policy rounds (wait for each version); 1: practise while the trainer steps; "
        "K: also let the trainer fall up to K-1 versions behind the practice",
    )
    parser.add_argument(
        "--max-staleness",
        default="default",
        help="the trainer's max_staleness: an integer, 'none' (no bound) or 'default' (its own)",
    )
    parser.add_argument("--stale-policy", choices=("drop", "downweight"), default=None)
    parser.add_argument("--max-batch", type=int, default=32, help="engine rows decoded together")
    parser.add_argument("--eval-samples", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument(
        "--stop-at-exact",
        type=float,
        default=0.3,
        help="end early at the first evaluation with at least this share of exact answers",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=Path(os.environ.get("RLPROXY_MODEL_DIR", REPO / "rlproxy-data")),
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    print(f"settings: {json.dumps({k: str(v) for k, v in vars(args).items()})}", flush=True)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    trainer_extra: dict[str, Any] = {}
    if args.max_staleness != "default":
        bound = args.max_staleness.lower()
        trainer_extra["max_staleness"] = None if bound == "none" else int(bound)
    if args.stale_policy is not None:
        trainer_extra["stale_policy"] = args.stale_policy
    servers = proof_loop.start_servers(
        args.model_dir, args.runs, args.questions, args.lr, args.max_batch,
        trainer_extra=trainer_extra,
    )  # fmt: skip
    settings = {k: str(v) for k, v in vars(args).items()} | {"server_env": servers.settings_env}
    print(f"server settings: {json.dumps(servers.settings_env)}", flush=True)
    result = proof_loop.run(
        servers,
        lambda url, seed: practise(url, seed, args),
        lambda url, model: evaluate(url, model, args),
        minutes=args.minutes,
        groups_per_step=args.questions,
        eval_every=args.eval_every,
        ahead=args.ahead,
        describe=lambda p: f"practice reward {p['mean_reward']:.3f} (exact {p['exact']:.0%})",
        step_fields=lambda p: {"agent_reward": p["mean_reward"], "agent_exact": p["exact"]},
        stop=lambda e: args.stop_at_exact is not None and e["exact"] >= args.stop_at_exact,
    )
    steps, evals, version, wall = result.steps, result.evals, result.version, result.wall_s
    eval_s, to_3se = result.eval_s, result.to_3se

    base, last = evals[0], evals[-1]
    gain = last["mean_reward"] - base["mean_reward"]
    se = math.hypot(base["stderr"], last["stderr"])
    summary = {
        "steps": version,
        "wall_s": wall,
        "base": {k: base[k] for k in ("mean_reward", "stderr", "exact", "episodes", "greedy")},
        "trained": {
            k: last[k] for k in ("version", "mean_reward", "stderr", "exact", "episodes", "greedy")
        },
        "gain": gain,
        "gain_in_standard_errors": gain / se if se else None,
        "minutes_to_3_standard_errors": to_3se,
        "evaluation_seconds": eval_s,
        "settings": settings,
        **provenance.finish(servers.record),
        "steps_detail": steps,
        "evals": evals,
    }
    print(
        f"\n{version} steps in {wall / 60:.1f} min. held-out reward: base "
        f"{base['mean_reward']:.3f} ± {base['stderr']:.3f} -> version {last['version']} "
        f"{last['mean_reward']:.3f} ± {last['stderr']:.3f}; gain {gain:+.3f} = "
        f"{summary['gain_in_standard_errors']:.1f} standard errors"
    )
    print(
        "\n| version | training min | with evaluations | held-out reward ± s.e. | exact "
        "| greedy exact | gain |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for e in evals:
        print(
            f"| {e['version']} | {e.get('train_minutes', 0):.1f} | {e.get('wall_minutes', 0):.1f} "
            f"| {e['mean_reward']:.3f} ± {e['stderr']:.3f} | {e['exact']:.0%} "
            f"| {e['greedy']['exact']:.0%} | {e.get('gain_in_standard_errors') or 0:+.1f} s.e. |"
        )
    print(
        f"exact answers: base {base['exact']:.0%} -> version {last['version']} {last['exact']:.0%} "
        f"sampled at temperature 1; greedy {base['greedy']['exact']:.0%} -> "
        f"{last['greedy']['exact']:.0%}"
    )
    exact_30 = next((e for e in evals[1:] if e["exact"] >= 0.3), None)
    summary["exact_30_percent"] = exact_30 and {
        k: exact_30[k] for k in ("version", "train_minutes", "wall_minutes", "exact")
    }
    if exact_30 is not None:
        print(
            f"exact answers >= 30 % first at version {exact_30['version']}: "
            f"{exact_30['train_minutes']:.1f} min of training "
            f"({exact_30['wall_minutes']:.1f} min with evaluations)"
        )
    if to_3se is None:
        print("never reached +3 standard errors over the base in this run")
    else:
        print(
            f"+3 standard errors first at version {to_3se['version']}: "
            f"{to_3se['train_minutes']:.1f} min of training "
            f"({to_3se['wall_minutes']:.1f} min with evaluations)"
        )
    summary["hardware"] = hardware()
    (args.out / "learning.json").write_text(json.dumps(summary, indent=2))
    proof_loop.plot(
        args.out / "learning.png",
        steps,
        evals,
        f"SmolLM2-135M, arithmetic agent through rlproxy ({summary['hardware']})",
    )
    print(f"wrote {args.out / 'learning.json'} and {args.out / 'learning.png'}")


if __name__ == "__main__":
    main()
