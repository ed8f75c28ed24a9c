"""What the trainer's memory defaults cost per GRPO step on short rows, CPU.

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_trainer_defaults.py \
        [--rounds 8] [--shapes learning,agent] [--threads 2] [--extra NAME=JSON ...]

The defaults that bound a long row's memory (`gradient_checkpointing` on, `release_memory`
'mmap') are timed against the trainer as it was before them (`old`: checkpointing off and
release_memory 'off'), on the short rows most training sees:

- `learning`: the learning proof's arithmetic agent, 4 groups x 8 rows, prompts of 30-50
  tokens shared by a group's rows, completions of 12 tokens;
- `agent`: the agent proof's lookup agent, 4 groups x 8 rows, prompts of 380-420 tokens,
  completions of 40-80 tokens.

Configurations (`TrainerConfig` on top of its defaults): `old`, `defaults`, `ckpt-every`
(every pass checkpointed, `checkpoint_min_tokens` 0: the defaults before that field), and any
--extra NAME=JSON, e.g. `no-release={"release_memory": "off"}`. Both shapes' passes run fewer
than `checkpoint_min_tokens` tokens, so there `defaults` is checkpointing off with 'mmap' (what
'mmap' costs: `defaults` / `old`) and `ckpt-every` adds checkpointing to it. The work
is random token ids (the step's cost does not depend on which), the embedded SmolLM2-135M in
fp32, LoRA r=8 on q,k,v,o. `release_memory` 'mmap' sets a process-wide glibc switch that cannot
be undone, so each configuration lives in a process of its own and this script drives them in
turn: one warm-up step each, then --rounds rounds of one step per configuration (A B C D, A B
C D, ...), so load from other processes hits them alike; --env gives one configuration's process
environment variables (MALLOC_ARENA_MAX, GLIBC_TUNABLES, LD_PRELOAD of jemalloc). Printed per
shape and configuration: the median step time (wall and process CPU, with its kernel time and
minor page faults) and its ratio to `old`'s median, each round's ratio spread, the process's
peak RSS so far, and the machine's load (`uptime`) before and after. A benchmark, not a test:
figures depend on the machine and on what else runs beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CONFIGS = {
    "old": {"gradient_checkpointing": False, "release_memory": "off"},
    "defaults": {},
    "ckpt-every": {"checkpoint_min_tokens": 0},
}
SHAPES = {  # groups, rows a group, prompt tokens (low, high), completion tokens (low, high)
    "learning": (4, 8, (30, 50), (12, 12)),
    "agent": (4, 8, (380, 420), (40, 80)),
}


def child(args: argparse.Namespace) -> None:
    """One configuration's trainer; reads a shape name a line, answers one JSON line a step."""
    sys.path.insert(0, str(REPO))
    import random

    import torch

    from proxy.engines.loader import ensure_fp32_cache
    from trainer.config import TrainerConfig
    from trainer.grpo import TrainingExample
    from trainer.peft_backend import PeftTrainer

    torch.set_num_threads(args.threads)
    trainer = PeftTrainer(
        ensure_fp32_cache(REPO / "rlproxy-data"),
        TrainerConfig(**json.loads(args.config)),
        device="cpu",
    )
    rng = random.Random(0)  # the same rows in every configuration
    work = {}
    for shape, (groups, members, prompt_range, completion_range) in SHAPES.items():
        examples = []
        for g in range(groups):
            prompt = [rng.randrange(100, 49000) for _ in range(rng.randint(*prompt_range))]
            for m in range(members):
                n = rng.randint(*completion_range)
                examples.append(
                    TrainingExample(
                        sample_id=f"g{g}m{m}",
                        prompt_ids=prompt,
                        completion_ids=[rng.randrange(100, 49000) for _ in range(n)],
                        old_logprobs=[-9.0] * n,
                        advantage=1.0 if m % 2 else -1.0,
                    )
                )
        work[shape] = examples
    config = trainer.config
    print(
        json.dumps(
            {
                "checkpointing": config.gradient_checkpointing,
                "checkpoint_min_tokens": config.checkpoint_min_tokens,
                "release_memory": config.release_memory,
                "mmap_threshold": config.mmap_threshold,
            }
        ),
        flush=True,
    )
    for line in sys.stdin:
        shape = line.strip()
        before = resource.getrusage(resource.RUSAGE_SELF)
        wall, cpu = time.perf_counter(), time.process_time()
        metrics = trainer.train_step(work[shape])
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        after = resource.getrusage(resource.RUSAGE_SELF)
        result = {
            "wall": wall,
            "cpu": cpu,
            "sys": after.ru_stime - before.ru_stime,
            "faults": after.ru_minflt - before.ru_minflt,
            "peak_mb": after.ru_maxrss / 1024,  # the process's peak so far (Linux: kB)
            "forward_tokens": metrics.forward_tokens,
        }
        print(json.dumps(result), flush=True)


class Trainer:
    """A child process holding one configuration's trainer."""

    def __init__(
        self, args: argparse.Namespace, config: dict[str, object], env: dict[str, str]
    ) -> None:
        cmd = [sys.executable, __file__, "--child", "--config", json.dumps(config)]
        cmd += ["--threads", str(args.threads)]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **env},
        )
        self.settings = self._read()  # loaded: the trainer's effective settings

    def _read(self) -> dict[str, float]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"trainer process exited with {self.proc.wait()}")
        result: dict[str, float] = json.loads(line)
        return result

    def step(self, shape: str) -> dict[str, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(shape + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="measured steps per configuration")
    parser.add_argument("--shapes", default="learning,agent")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--extra", action="append", default=[], help='NAME=JSON, e.g. ckpt-all={"x": 1}'
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        help="NAME=VAR=VALUE: an environment variable for configuration NAME's process, e.g. "
        "jemalloc=LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    )
    parser.add_argument("--only", help="comma-separated configurations to run (old is always run)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    configs: dict[str, dict[str, object]] = dict(CONFIGS)
    for extra in args.extra:
        name, _, config = extra.partition("=")
        configs[name] = json.loads(config)
    if args.only:
        keep = {"old", *args.only.split(",")}
        configs = {k: v for k, v in configs.items() if k in keep}
    print(f"load before: {uptime()}", flush=True)
    print(f"{args.threads} threads a trainer, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    for name, config in configs.items():
        print(f"  {name:<12} {json.dumps(config)}")
    envs: dict[str, dict[str, str]] = {name: {} for name in configs}
    for item in args.env:
        name, _, assignment = item.partition("=")
        var, _, value = assignment.partition("=")
        envs[name][var] = value
    for name, env in envs.items():
        if env:
            print(f"  {name:<12} env {json.dumps(env)}")
    trainers = {name: Trainer(args, config, envs[name]) for name, config in configs.items()}
    for name, trainer in trainers.items():
        print(f"  {name:<12} runs {json.dumps(trainer.settings)}", flush=True)
    try:
        for shape in args.shapes.split(","):
            groups, members, prompt, completion = SHAPES[shape]
            print(
                f"\n{shape}: {groups} groups x {members} rows, prompts {prompt[0]}-{prompt[1]} "
                f"tokens, completions {completion[0]}-{completion[1]} tokens",
                flush=True,
            )
            for trainer in trainers.values():  # warm-up
                trainer.step(shape)
            times: dict[str, list[dict[str, float]]] = {name: [] for name in trainers}
            for r in range(args.rounds):
                line = []
                for name, trainer in trainers.items():
                    result = trainer.step(shape)
                    times[name].append(result)
                    line.append(f"{name} {result['wall']:.2f} (cpu {result['cpu']:.2f})")
                print(f"  round {r}: " + ", ".join(line) + " s", flush=True)
            old_wall = statistics.median(t["wall"] for t in times["old"])
            old_cpu = statistics.median(t["cpu"] for t in times["old"])
            tokens = int(times["old"][0]["forward_tokens"])
            print(f"  {tokens} forward tokens a step; median of {args.rounds} steps:")
            for name, results in times.items():
                wall = statistics.median(t["wall"] for t in results)
                cpu = statistics.median(t["cpu"] for t in results)
                pairs = sorted(
                    t["wall"] / o["wall"] for t, o in zip(results, times["old"], strict=True)
                )
                system = statistics.median(t["sys"] for t in results)
                faults = statistics.median(t["faults"] for t in results)
                print(
                    f"  {name:<12} wall {wall:6.2f} s ({wall / old_wall:5.2f} x old)  "
                    f"cpu {cpu:6.2f} s ({cpu / old_cpu:5.2f} x old; kernel {system:5.2f} s, "
                    f"{faults / 1e3:6.0f} k faults)  round ratios {pairs[0]:.2f}..{pairs[-1]:.2f}"
                    f"  peak RSS {results[-1]['peak_mb']:6.0f} MB",
                    flush=True,
                )
    finally:
        for trainer in trainers.values():
            trainer.close()
    print(f"\nload after: {uptime()}")


if __name__ == "__main__":
    main()
