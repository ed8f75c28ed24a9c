"""Peak memory (RSS) of one GRPO training step on long one-call rows, CPU.

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_trainer_memory.py \
        [--old-repo /tmp/old] [--allocators glibc,trim,arena2,jemalloc] [--steps 2]

The work: 2 groups of 4 one-call trajectories (8 rows), each row a prompt of --prompt-tokens
token ids shared by its group's members and its own --completion-tokens sampled tokens (about
3,500 tokens a row by default), the embedded SmolLM2-135M in fp32 with the trainer's defaults
(`TrainerConfig()`: LoRA r=8 on q,k,v,o, no KL). Each configuration runs in a fresh process:
the model is loaded, the peak RSS counter is reset (`/proc/self/clear_refs`), then --steps
steps run. Printed per configuration: RSS after loading, the peak during the steps (VmHWM), the
time per step, and the turns the step trained whole vs cut or skipped.

Configurations:

- `before` (with --old-repo): the same work on the trainer of another checkout (make one with
  `git worktree add /tmp/old <commit>`), its defaults;
- `after`: this checkout's defaults, with each heap setting of --allocators: `mmap` (the
  default `TrainerConfig.release_memory`: large allocations on pages of their own, and
  `malloc_trim(0)` after each step), `trim` (only the trim), `glibc` (release_memory 'off':
  glibc's defaults), `arena2` ('off' and MALLOC_ARENA_MAX=2), `jemalloc` ('off' and LD_PRELOAD
  of a libjemalloc found on the machine; skipped when there is none);
- any --extra JSON trainer configs, e.g. '{"gradient_checkpointing": false}'.

A benchmark, not a test: figures depend on the machine and on what else runs beside it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
JEMALLOC = ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/libjemalloc.so.2")


def rss_mb(field: str) -> float:
    """VmRSS or VmHWM of this process, in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(args: argparse.Namespace) -> None:
    """One configuration in this process; prints one JSON line."""
    sys.path.insert(0, args.repo)
    import random

    import torch

    from proxy.engines.loader import ensure_fp32_cache
    from trainer.config import TrainerConfig
    from trainer.grpo import TrainingExample
    from trainer.peft_backend import PeftTrainer

    torch.set_num_threads(args.threads)
    model_dir = ensure_fp32_cache(REPO / "rlproxy-data")
    trainer = PeftTrainer(model_dir, TrainerConfig(**json.loads(args.config)), device="cpu")
    rng = random.Random(0)
    examples = []
    for g in range(args.groups):
        prompt = [rng.randrange(100, 49000) for _ in range(args.prompt_tokens)]
        for m in range(args.members):
            examples.append(
                TrainingExample(
                    sample_id=f"g{g}m{m}",
                    prompt_ids=prompt,
                    completion_ids=[rng.randrange(100, 49000) for _ in range(args.completion)],
                    old_logprobs=[-9.0] * args.completion,
                    advantage=1.0 if m % 2 else -1.0,
                )
            )
    loaded = rss_mb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    seconds = []
    metrics = None
    for _ in range(args.steps):
        start = time.perf_counter()
        metrics = trainer.train_step(examples)
        seconds.append(time.perf_counter() - start)
    assert metrics is not None
    report = metrics.to_dict()
    print(
        json.dumps(
            {
                "loaded_mb": loaded,
                "peak_mb": rss_mb("VmHWM"),
                "end_mb": rss_mb("VmRSS"),
                "step_s": seconds,
                "turns": report["turns"],
                "cut": report.get("truncated", 0),
                "skipped": report.get("too_long", 0),
                "forward_tokens": report["forward_tokens"],
            }
        )
    )


def run(args: argparse.Namespace, name: str, repo: str, config: str, env: dict[str, str]) -> None:
    cmd = [sys.executable, __file__, "--child", "--repo", repo, "--config", config]
    for key in ("prompt_tokens", "completion", "groups", "members", "steps", "threads"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    extra_env = dict(item.split("=", 1) for item in args.env)
    out = subprocess.run(
        cmd, env={**os.environ, **extra_env, **env}, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        print(f"{name:<28} failed: {out.stderr.strip().splitlines()[-1:]}", flush=True)
        return
    r = json.loads(out.stdout.strip().splitlines()[-1])
    steps = " ".join(f"{s:.0f}" for s in r["step_s"])
    print(
        f"{name:<28} loaded {r['loaded_mb']:6.0f} MB  peak {r['peak_mb']:6.0f} MB  "
        f"after {r['end_mb']:6.0f} MB  step s {steps:<10} turns {r['turns']} "
        f"(cut {r['cut']}, skipped {r['skipped']}), forward tokens {r['forward_tokens']}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=3372)
    parser.add_argument("--completion", type=int, default=128)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--old-repo", help="a checkout of the trainer to measure as 'before'")
    parser.add_argument("--allocators", default="mmap,trim,glibc,arena2,jemalloc")
    parser.add_argument("--extra", action="append", default=[], help="JSON trainer config")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        help="VAR=VALUE for every configuration's process, e.g. GLIBC_TUNABLES=...",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repo", default=str(REPO), help=argparse.SUPPRESS)
    parser.add_argument("--config", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    print(
        f"one GRPO step, {args.groups} groups x {args.members} rows of {args.prompt_tokens} "
        f"prompt + {args.completion} completion tokens, {args.threads} threads, "
        f"{args.steps} steps per process",
        flush=True,
    )
    if args.old_repo:
        run(args, "before (old defaults)", args.old_repo, "{}", {})
    off = json.dumps({"release_memory": "off"})
    for allocator in args.allocators.split(","):
        if allocator == "mmap":
            run(args, "after, release mmap (default)", str(REPO), "{}", {})
        elif allocator == "trim":
            run(args, "after, release trim", str(REPO), json.dumps({"release_memory": "trim"}), {})
        elif allocator == "glibc":
            run(args, "after, glibc defaults", str(REPO), off, {})
        elif allocator == "arena2":
            run(args, "after, MALLOC_ARENA_MAX=2", str(REPO), off, {"MALLOC_ARENA_MAX": "2"})
        elif allocator == "jemalloc":
            found = [p for p in JEMALLOC if Path(p).exists()] or glob.glob(
                str(REPO / ".venv/lib/python*/site-packages/**/libjemalloc*.so*"), recursive=True
            )
            if not found:
                print("after, jemalloc             skipped: no libjemalloc on this machine")
                continue
            run(args, "after, jemalloc", str(REPO), off, {"LD_PRELOAD": found[0]})
    for extra in args.extra:
        run(args, f"after, {extra}", str(REPO), extra, {})


if __name__ == "__main__":
    main()
