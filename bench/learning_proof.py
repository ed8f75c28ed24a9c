"""The proof: an unchanged agent, pointed at rlproxy, gets better at its task while it works.

Starts two servers on this machine:
- the training server: `rlproxy serve` with its trainer process, background scoring and
  publishing on. The agent (examples/arithmetic_agent.py, plain `openai` SDK) practises on it:
  each round asks QUESTIONS practice questions RUNS times each and reports the environment's
  reward for every answer. rlproxy groups the runs of each question (task signature), takes the
  rewards as scores, makes one GRPO step per round and publishes the new adapter.
- an evaluation server with no trainer and its own database, reading the same checkpoint
  folder, so held-out evaluation traffic never becomes training data.

Held-out reward (100 questions never practised, `--eval-samples` attempts each) is measured for
the base model first, every `--eval-every` steps, and for the last version. After each
evaluation the gain over the base is given in standard errors; the first version at +3 standard
errors or more gives the minutes to +3 s.e. (training wall time since the first practice round,
the time spent evaluating left out, and with it). Exact answers (the reply is the right number
alone) are reported beside the reward at every evaluation. Writes
`<out>/learning.json` and `<out>/learning.png` (training reward per step and held-out reward
with standard errors) and prints the summary.

    .venv/bin/python bench/learning_proof.py [--minutes 30] [--lr 1e-4] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
AGENT = REPO / "examples" / "arithmetic_agent.py"
sys.path.insert(0, str(REPO))

from servers import start_server  # noqa: E402


def agent(url: str, *args: str) -> dict[str, Any]:
    env = {**os.environ, "OPENAI_BASE_URL": f"{url}/v1", "OPENAI_API_KEY": "sk-agent"}
    done = subprocess.run(
        [sys.executable, str(AGENT), *args], env=env, capture_output=True, text=True, check=True
    )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def adapters(url: str) -> dict[int, dict[str, Any]]:
    data = httpx.get(f"{url}/rl/adapters", timeout=30).json()["data"]
    return {int(a["version"]): a for a in data}


def wait_for_version(url: str, version: int, timeout_s: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        a = adapters(url).get(version)
        if a is not None and a.get("status") == "loaded":
            return a
        time.sleep(1)
    return None


def evaluate(eval_url: str, version: int | None, samples: int) -> dict[str, Any]:
    model = "rlproxy@base"
    if version is not None:
        r = httpx.post(f"{eval_url}/rl/adapters/{version}/load", timeout=120)
        r.raise_for_status()
        model = f"rlproxy@{version}"
    result = agent(eval_url, "eval", "--model", model, "--samples", str(samples))
    result["version"] = version or 0
    print(
        f"  held-out {model}: {result['mean_reward']:.3f} ± {result['stderr']:.3f} "
        f"(exact answers {result['exact']:.0%}, n={result['episodes']})",
        flush=True,
    )
    return result


def plot(path: Path, steps: list[dict[str, Any]], evals: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        [s["version"] for s in steps],
        [s["train_reward"] for s in steps],
        ".-",
        color="tab:blue",
        alpha=0.6,
        label="practice reward (mean of the step's groups)",
    )
    ax.errorbar(
        [e["version"] for e in evals],
        [e["mean_reward"] for e in evals],
        yerr=[e["stderr"] for e in evals],
        fmt="o-",
        color="tab:red",
        capsize=3,
        label="held-out reward (± 1 s.e.)",
    )
    ax.set_xlabel("training step (adapter version)")
    ax.set_ylabel("reward")
    ax.set_ylim(0, 1)
    ax.set_title("SmolLM2-135M, arithmetic agent through rlproxy (CPU)")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--minutes",
        type=float,
        default=30.0,
        help="training wall-time budget (time spent evaluating not counted)",
    )
    parser.add_argument("--questions", type=int, default=4, help="groups per step")
    parser.add_argument("--runs", type=int, default=8, help="attempts per question (group size)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--eval-samples", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=Path(os.environ.get("RLPROXY_MODEL_DIR", REPO / "rlproxy-data")),
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    work = Path(tempfile.mkdtemp(prefix="rlproxy-proof-"))
    train_dir, eval_dir = work / "train", work / "eval"
    (train_dir / "checkpoints" / "rlproxy").mkdir(parents=True)
    eval_dir.mkdir()
    (eval_dir / "checkpoints").symlink_to(train_dir / "checkpoints")
    print(f"working in {work}", flush=True)
    trainer_cfg = {"groups_per_step": args.questions, "learning_rate": args.lr}
    train_proc, train_url = start_server(
        train_dir,
        args.model_dir,
        {
            "RLPROXY_TRAIN": "true",
            "RLPROXY_SCORING": "true",
            "RLPROXY_PUBLISH_ADAPTERS": "true",
            "RLPROXY_SCORING_INTERVAL_S": "1",
            "RLPROXY_TRAIN_POLL_S": "1",
            "RLPROXY_ADAPTER_POLL_S": "1",
            "RLPROXY_GROUP_MIN_SIZE": str(args.runs),
            "RLPROXY_GROUP_MAX_SIZE": str(args.runs),
            "RLPROXY_GROUP_WINDOW_S": "1e9",
            "RLPROXY_TRAINER": json.dumps(trainer_cfg),
        },
    )
    eval_proc, eval_url = start_server(
        eval_dir,
        args.model_dir,
        {},  # serve only: no trainer, scorer or publisher
    )
    steps: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    eval_s = 0.0  # wall time spent evaluating since training started
    to_3se: dict[str, Any] | None = None

    def held_out(version: int) -> None:
        nonlocal eval_s, to_3se
        began = time.monotonic()
        train_minutes, wall_minutes = (began - started - eval_s) / 60, (began - started) / 60
        result = evaluate(eval_url, version, args.eval_samples)
        eval_s += time.monotonic() - began
        base = evals[0]
        se = math.hypot(base["stderr"], result["stderr"])
        result["gain_in_standard_errors"] = (
            (result["mean_reward"] - base["mean_reward"]) / se if se else None
        )
        result["train_minutes"], result["wall_minutes"] = train_minutes, wall_minutes
        evals.append(result)
        print(
            f"  gain {result['gain_in_standard_errors'] or 0:+.1f} s.e. after "
            f"{result['train_minutes']:.1f} min of training ({result['wall_minutes']:.1f} min "
            "with evaluations)",
            flush=True,
        )
        if to_3se is None and (result["gain_in_standard_errors"] or 0) >= 3:
            to_3se = {
                "version": version,
                "train_minutes": result["train_minutes"],
                "wall_minutes": result["wall_minutes"],
            }

    try:
        evals.append(evaluate(eval_url, None, args.eval_samples))
        started = time.monotonic()
        version, rounds = 0, 0
        while time.monotonic() - started - eval_s < args.minutes * 60:  # evaluations aside
            # Practise until the trainer has enough usable groups for its next step (a group
            # whose runs all got the same reward has no signal and is skipped).
            published = None
            for _ in range(5):
                practice = agent(
                    train_url,
                    "train",
                    "--questions",
                    str(args.questions),
                    "--runs",
                    str(args.runs),
                    "--seed",
                    str(rounds),
                )
                rounds += 1
                published = wait_for_version(train_url, version + 1, timeout_s=90)
                if published is not None:
                    break
            if published is None:
                print("  no new version after 5 practice rounds; stopping", flush=True)
                break
            version += 1
            metrics = published.get("metrics") or {}
            steps.append(
                {
                    "version": version,
                    "elapsed_s": time.monotonic() - started,
                    "agent_reward": practice["mean_reward"],
                    "train_reward": metrics.get("mean_reward", practice["mean_reward"]),
                    "loss": metrics.get("loss"),
                    "step_seconds": metrics.get("step_seconds"),
                    "skipped_groups": metrics.get("skipped_groups"),
                }
            )
            print(
                f"step {version:3d}  {steps[-1]['elapsed_s']:6.0f} s  practice reward "
                f"{practice['mean_reward']:.3f}  step {metrics.get('step_seconds', 0):.1f} s",
                flush=True,
            )
            if version % args.eval_every == 0:
                held_out(version)
        wall = time.monotonic() - started
        if version and evals[-1]["version"] != version:
            held_out(version)
    finally:
        for proc in (train_proc, eval_proc):
            proc.terminate()
            proc.wait(timeout=60)

    base, last = evals[0], evals[-1]
    gain = last["mean_reward"] - base["mean_reward"]
    se = math.hypot(base["stderr"], last["stderr"])
    summary = {
        "steps": version,
        "wall_s": wall,
        "base": {k: base[k] for k in ("mean_reward", "stderr", "exact", "episodes")},
        "trained": {k: last[k] for k in ("version", "mean_reward", "stderr", "exact", "episodes")},
        "gain": gain,
        "gain_in_standard_errors": gain / se if se else None,
        "minutes_to_3_standard_errors": to_3se,
        "evaluation_seconds": eval_s,
        "settings": vars(args) | {"out": str(args.out), "model_dir": str(args.model_dir)},
        "steps_detail": steps,
        "evals": evals,
    }
    (args.out / "learning.json").write_text(json.dumps(summary, indent=2))
    plot(args.out / "learning.png", steps, evals)
    print(
        f"\n{version} steps in {wall / 60:.1f} min. held-out reward: base "
        f"{base['mean_reward']:.3f} ± {base['stderr']:.3f} -> version {last['version']} "
        f"{last['mean_reward']:.3f} ± {last['stderr']:.3f}; gain {gain:+.3f} = "
        f"{summary['gain_in_standard_errors']:.1f} standard errors"
    )
    print(
        f"exact answers: base {base['exact']:.0%} -> version {last['version']} {last['exact']:.0%}"
    )
    if to_3se is None:
        print("never reached +3 standard errors over the base in this run")
    else:
        print(
            f"+3 standard errors first at version {to_3se['version']}: "
            f"{to_3se['train_minutes']:.1f} min of training "
            f"({to_3se['wall_minutes']:.1f} min with evaluations)"
        )
    print(f"wrote {args.out / 'learning.json'} and {args.out / 'learning.png'}")


if __name__ == "__main__":
    main()
