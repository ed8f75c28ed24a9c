"""What packing a trajectory's turns into one row saves a GRPO step, on real agent episodes.

Takes the stored episodes of the lookup agent (examples/lookup_agent.py: 2-4 tool calls an
episode, each call's prompt the previous one's plus the answer and the tool's result) and makes
the same training step on them twice in turn, `--repeats` times: one row per turn (`pack_turns`
off) and the turns of each episode packed into one row where the stored tokens allow
(trainer.packing). Prints the rows, the tokens run through the model and the seconds of each, and
the ratios pair by pair; both steps start from the same weights, and their losses are printed
to show they agree.

    .venv/bin/python bench/bench_packing.py                     # practises one round first (~3 min)
    .venv/bin/python bench/bench_packing.py --db /tmp/rlproxy-agent-proof-XXXX/train/rlproxy.db

Without `--db` it starts `rlproxy serve` (no training) and runs one practice round of the agent
(`--tasks` x 8 episodes) to get episodes. Advantages are set by episode (1, -0.5, 0.25 in
turn): the compute does not depend on them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "bench"))

from peft.utils import set_peft_model_state_dict  # noqa: E402

from storage.prompt_chunks import sqlite_prompts  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402
from trainer.grpo import TrainingExample  # noqa: E402
from trainer.packing import pack_turns  # noqa: E402
from trainer.peft_backend import PeftTrainer, model_context  # noqa: E402


def practise(model_dir: Path, tasks: int) -> Path:
    """One practice round of the lookup agent on a serve-only server; its database."""
    import lookup_agent
    from openai import AsyncOpenAI
    from servers import start_server

    data = Path(tempfile.mkdtemp(prefix="rlproxy-bench-packing-"))
    proc, url = start_server(data, model_dir, {"RLPROXY_CALLER_CONCURRENCY": "0"})
    try:

        async def run() -> None:
            async with AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-bench", timeout=1800) as c:
                await lookup_agent.train(c, "rlproxy", tasks, 8, seed=0, max_tokens=48)

        began = time.perf_counter()
        asyncio.run(run())
        print(f"practised {tasks} x 8 episodes in {time.perf_counter() - began:.0f} s", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return data / "rlproxy.db"


def turns_from(db: Path, episodes: int) -> list[TrainingExample]:
    """Each trajectory's turns in order, as the training loop builds them (one per call)."""
    conn = sqlite3.connect(db)
    rows = conn.execute(
        "select c.trajectory_id, c.turn_index, c.id, ch.completion_token_ids,"
        " ch.completion_logprobs from calls c join call_choices ch on ch.call_id = c.id"
        " where c.token_refs is not null and ch.completion_token_ids is not null"
        " order by c.trajectory_id, c.turn_index"
    ).fetchall()
    prompts = sqlite_prompts(conn, [r[2] for r in rows])
    by_trajectory: dict[str, list[TrainingExample]] = defaultdict(list)
    for trajectory, _, prompt, completion, logprobs in rows:
        if trajectory not in by_trajectory:
            advantage = (1.0, -0.5, 0.25)[len(by_trajectory) % 3]
        by_trajectory[trajectory].append(
            TrainingExample(
                trajectory,
                prompts[prompt].token_ids or [],
                json.loads(completion),
                json.loads(logprobs),
                advantage,
            )
        )
    chosen = list(by_trajectory.values())[:episodes]
    return [t for turns in chosen for t in turns]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", type=Path, help="an rlproxy SQLite database with agent episodes")
    parser.add_argument("--episodes", type=int, default=32, help="episodes in the step")
    parser.add_argument("--tasks", type=int, default=4, help="tasks practised without --db")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=Path(os.environ.get("RLPROXY_MODEL_DIR", REPO / "rlproxy-data")),
    )
    args = parser.parse_args()
    from proxy.engines.loader import ensure_fp32_cache

    db = args.db or practise(args.model_dir, args.tasks)
    turns = turns_from(db, args.episodes)
    model = ensure_fp32_cache(args.model_dir)
    packed = pack_turns(turns, TrainerConfig().max_seq_len or model_context(model))
    print(
        f"{len({t.sample_id for t in turns})} episodes, {len(turns)} turns; packed into "
        f"{len(packed)} rows; load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    trainer = PeftTrainer(model, TrainerConfig(micro_batch_size=args.micro_batch), device="cpu")
    start = trainer.adapter_state()
    optimizer = trainer.optimizer.state_dict()
    result: dict[str, list[float]] = defaultdict(list)
    for repeat in range(args.repeats):
        order = [("per turn", turns), ("packed", packed)]
        for name, rows in order if repeat % 2 == 0 else order[::-1]:
            set_peft_model_state_dict(trainer.model, start)
            trainer.optimizer.load_state_dict(optimizer)
            m = trainer.train_step(rows)
            result[f"{name} s"].append(m.seconds)
            result[f"{name} loss"].append(m.loss)
            print(
                f"  {name:8s} {m.turns:3d} rows  forward {m.forward_tokens:6d} tokens  "
                f"computed {m.computed_tokens:6d}  {m.seconds:6.1f} s  loss {m.loss:+.6f}",
                flush=True,
            )
            result[f"{name} computed"].append(m.computed_tokens)
    ratios = [a / b for a, b in zip(result["per turn s"], result["packed s"], strict=True)]
    computed = statistics.fmean(result["per turn computed"]) / statistics.fmean(
        result["packed computed"]
    )
    print(
        f"\npacked: {computed:.2f}x fewer tokens computed; a step "
        f"{statistics.median(ratios):.2f}x faster (median of {len(ratios)} pairs: "
        f"{', '.join(f'{r:.2f}' for r in ratios)}); loss per turn {result['per turn loss'][0]:+.6f}"
        f" vs packed {result['packed loss'][0]:+.6f}"
    )


if __name__ == "__main__":
    main()
