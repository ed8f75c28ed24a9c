"""Data-parallel GRPO step time: 1 rank against N ranks of the same step (`trainer.distributed`).

    .venv/bin/python bench/bench_trainer_ddp.py [--ranks 1,2] [--steps 3] [--device cpu]

For each rank count it starts `torchrun --standalone --nproc-per-node N` on this script in
worker mode. Each rank loads the fp32 SmolLM2-135M (`ensure_fp32_cache(rlproxy-data)`, or
--model-dir) with a fresh LoRA (the defaults of `TrainerConfig`: r=8 on q,k,v,o, AdamW lr 1e-4,
micro-batches of 4 rows), joins the process group (gloo on CPU, NCCL on CUDA) and trains the
same batch every step: --groups groups of --members samples, each group one prompt of
--prompt-tokens token ids, each sample --completion-tokens completion ids (fixed pseudo-random ids;
stored logprobs the fresh policy's own; advantages +-1), the step's rows split between the ranks
as `rlproxy train` splits them. One warm-up step, then --steps measured steps; rank 0 reports
each step's wall time (`train_step`: broadcast of the examples, each rank's share, the gradient
all-reduce, clipping and the AdamW step).

On CPU the machine's cores (--threads, default all) are divided between the ranks (N ranks of
threads/N torch threads each), so the comparison is the same cores used by one process or by
N. The load average is printed before and after each run: on a shared machine it says how much
of the figures is other people's work.

With --compare, rank 0 then replays the same steps in one process (no process group) from the
same fresh LoRA and prints max |delta| between the two sets of LoRA weights (bench/gpu_check.py
uses this for the data-parallel part). A benchmark, not a test: the figures depend on the
machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def batch(args: argparse.Namespace, vocab: int) -> list[Any]:
    from trainer.grpo import TrainingExample

    rng = random.Random(0)
    out = []
    for g in range(args.groups):
        prompt = [rng.randrange(10, vocab) for _ in range(args.prompt_tokens)]
        for m in range(args.members):
            completion = [rng.randrange(10, vocab) for _ in range(args.completion_tokens)]
            out.append(
                TrainingExample(
                    sample_id=f"g{g}m{m}",
                    prompt_ids=prompt,
                    completion_ids=completion,
                    old_logprobs=[-10.0] * len(completion),
                    advantage=1.0 if m % 2 == 0 else -1.0,
                )
            )
    return out


def with_policy_logprobs(trainer: Any, examples: list[Any]) -> list[Any]:
    """The examples with the fresh policy's logprobs as the stored ones (a first ratio of 1,
    as when serving sampled them from the same weights)."""
    import dataclasses

    import torch

    out = []
    with torch.no_grad():
        for e in examples:
            ids = torch.tensor([e.prompt_ids + e.completion_ids], device=trainer.device)
            logits = trainer.model(input_ids=ids).logits[0, len(e.prompt_ids) - 1 : -1].float()
            picked = torch.log_softmax(logits, -1).gather(
                -1, torch.tensor(e.completion_ids, device=trainer.device)[:, None]
            )
            out.append(dataclasses.replace(e, old_logprobs=picked.squeeze(-1).tolist()))
    return out


def worker(args: argparse.Namespace) -> int:
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads_per_rank:
        torch.set_num_threads(args.threads_per_rank)
    from trainer import distributed
    from trainer.config import TrainerConfig
    from trainer.peft_backend import PeftTrainer

    collective = distributed.from_env(args.device)
    if collective is None:
        raise SystemExit("worker mode runs under torchrun")
    device = str(collective.device)
    config = TrainerConfig()
    trainer = PeftTrainer(args.model_dir, config, device=device, collective=collective)
    examples = batch(args, trainer.model.get_base_model().config.vocab_size)
    examples = with_policy_logprobs(trainer, examples)
    if not collective.leader:
        distributed.follow(trainer, collective)
        collective.close()
        return 0
    trainer.sync_followers()
    seconds = []
    metrics = None
    for i in range(1 + args.steps):
        if collective.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = trainer.train_step(examples)
        if collective.device.type == "cuda":
            torch.cuda.synchronize()
        if i > 0:
            seconds.append(time.perf_counter() - start)
    collective.broadcast(("stop",))
    assert metrics is not None
    result: dict[str, Any] = {
        "ranks": collective.world_size,
        "backend": collective.backend,
        "device": device,
        "threads_per_rank": torch.get_num_threads(),
        "rows": metrics.turns,
        "forward_tokens": metrics.forward_tokens,
        "step_s": [round(s, 3) for s in seconds],
        "step_s_median": round(statistics.median(seconds), 3),
        "forward_tok_per_s": round(metrics.forward_tokens / statistics.median(seconds), 1),
        "loss": metrics.loss,
        "grad_norm": metrics.grad_norm,
    }
    if collective.device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(collective.device)
        result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if args.compare:
        reference = PeftTrainer(args.model_dir, config, device=device)
        for _ in range(1 + args.steps):
            ref_metrics = reference.train_step(examples)
        mine, theirs = trainer.adapter_state(), reference.adapter_state()
        result["max_abs_delta_vs_one_process"] = max(
            float((mine[k].float() - theirs[k].float()).abs().max()) for k in mine
        )
        result["max_abs_lora_b"] = max(
            float(v.float().abs().max()) for k, v in mine.items() if "lora_B" in k
        )
        result["loss_one_process"] = ref_metrics.loss
    Path(args.out).write_text(json.dumps(result))
    collective.close()
    return 0


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def launch(args: argparse.Namespace, ranks: int, out: Path) -> dict[str, Any]:
    """Run the worker under torchrun with `ranks` processes; rank 0's figures."""
    threads = max(1, args.threads // ranks)
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
        *("--nproc-per-node", str(ranks), str(Path(__file__).resolve()), "--worker"),
        *("--out", str(out), "--model-dir", str(args.model_dir), "--steps", str(args.steps)),
        *("--groups", str(args.groups), "--members", str(args.members)),
        *("--prompt-tokens", str(args.prompt_tokens)),
        *("--completion-tokens", str(args.completion_tokens)),
        *("--threads-per-rank", str(threads)),
        *(["--device", args.device] if args.device else []),
        *(["--compare"] if args.compare else []),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"torchrun with {ranks} ranks exited {done.returncode}:\n{done.stdout[-3000:]}"
            f"{done.stderr[-3000:]}"
        )
    return dict(json.loads(out.read_text()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2", help="rank counts to run, comma-separated")
    parser.add_argument("--steps", type=int, default=3, help="measured steps after 1 warm-up")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--completion-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--data-dir", type=Path, default=REPO / "rlproxy-data")
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threads-per-rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.model_dir is None:
        from proxy.engines.loader import ensure_fp32_cache

        args.model_dir = ensure_fp32_cache(args.data_dir)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlproxy-ddp-bench-") as tmp:
        for ranks in (int(x) for x in args.ranks.split(",")):
            before = load()
            figures = launch(args, ranks, Path(tmp) / f"{ranks}.json")
            figures["load_before"], figures["load_after"] = before, load()
            print(json.dumps(figures), flush=True)
            rows.append(figures)
    base = rows[0]["step_s_median"]
    print(
        f"\n{args.groups} groups x {args.members} samples, {args.prompt_tokens} prompt + "
        f"{args.completion_tokens} completion tokens, {args.threads} threads in all\n"
    )
    print("| ranks | threads/rank | step s (median) | steps s | forward tok/s | speed-up | load |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['ranks']} ({r['backend']}) | {r['threads_per_rank']} | {r['step_s_median']} "
            f"| {', '.join(map(str, r['step_s']))} | {r['forward_tok_per_s']} "
            f"| {base / r['step_s_median']:.2f}x | {r['load_before']} -> {r['load_after']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
