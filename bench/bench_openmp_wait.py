"""What OpenMP's wait policy costs the embedded model's forward passes, CPU.

    .venv/bin/python bench/bench_openmp_wait.py [--rounds 2] [--prompt-tokens 1024]

Each configuration runs in a process of its own (libgomp reads its environment once, when
torch loads it), in turn, --rounds times (A B C D E, A B C D E, ...), so load from other
processes hits them alike:

- `spin`: libgomp's default wait (`GOMP_SPINCOUNT=300000`, what rlproxy runs with), 2 threads;
- `passive`: `OMP_WAIT_POLICY=PASSIVE`, 2 threads;
- `spin1k`: `GOMP_SPINCOUNT=1000`, 2 threads;
- `1-thread`: the default wait, 1 thread (nothing to wait for).

Each process loads the embedded SmolLM2-135M (fp32, from --model-dir), runs one warm-up, then
times one prefill of --prompt-tokens random ids (batch 1) and --steps decode steps at batch 8
over a 512-token cache, the way the local engine runs them (`GrowingLayer` cache). Printed: wall
and process CPU time, the median over rounds and each one's ratio to `passive`, with the load
average. A benchmark, not a test: the figures depend on what else the machine runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CONFIGS: dict[str, tuple[dict[str, str], int]] = {
    "spin": ({"GOMP_SPINCOUNT": "300000"}, 2),
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, 2),
    "spin1k": ({"GOMP_SPINCOUNT": "1000"}, 2),
    "1-thread": ({"GOMP_SPINCOUNT": "300000"}, 1),
}


def child(model_dir: Path, threads: int, prompt_tokens: int, steps: int) -> dict[str, float]:
    import torch

    from proxy.engines.kv_batch import growing_cache
    from proxy.engines.loader import load_model

    torch.set_grad_enabled(False)
    torch.set_num_threads(threads)
    model = load_model(model_dir).model
    gen = torch.Generator().manual_seed(0)

    def forward(ids: torch.Tensor, cache: object, start: int = 0) -> None:
        b, t = ids.shape
        model(
            input_ids=ids,
            attention_mask=torch.ones((b, start + t), dtype=torch.long),
            position_ids=torch.arange(start, start + t).expand(b, t),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )

    def prefill() -> None:
        forward(
            torch.randint(100, 40000, (1, prompt_tokens), generator=gen),
            growing_cache(model.config),
        )

    decode_cache = growing_cache(model.config)  # (8, 512) cache for the decode steps

    def decode() -> None:  # `steps` steps of one token a row
        for s in range(steps):
            forward(torch.randint(100, 40000, (8, 1), generator=gen), decode_cache, 512 + s)

    forward(torch.randint(100, 40000, (1, 64), generator=gen), growing_cache(model.config))
    forward(torch.randint(100, 40000, (8, 512), generator=gen), decode_cache)
    out: dict[str, float] = {}
    for name, run in (("prefill", prefill), ("decode", decode)):
        cpu, wall = time.process_time(), time.perf_counter()
        run()
        out[f"{name}_wall"] = time.perf_counter() - wall
        out[f"{name}_cpu"] = time.process_time() - cpu
    out["decode_step_ms"] = 1000 * out["decode_wall"] / steps
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--steps", type=int, default=32, help="decode steps at batch 8")
    p.add_argument("--model-dir", type=Path, default=REPO / "rlproxy-data")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "openmp_wait.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        threads = CONFIGS[args.child][1]
        result = child(args.model_dir, threads, args.prompt_tokens, args.steps)
        print("RESULT " + json.dumps(result), flush=True)
        return
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
    print(f"load before: {os.getloadavg()}", flush=True)
    for r in range(args.rounds):
        for name, (env, _) in CONFIGS.items():
            cmd = [sys.executable, __file__, "--child", name, "--model-dir", str(args.model_dir)]
            cmd += ["--prompt-tokens", str(args.prompt_tokens), "--steps", str(args.steps)]
            done = subprocess.run(
                cmd, env={**clean, **env}, cwd=REPO, capture_output=True, text=True, check=True
            )
            line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
            result = json.loads(line.removeprefix("RESULT ")) | {"load": os.getloadavg()[0]}
            runs[name].append(result)
            print(f"round {r} {name:9s} {json.dumps({k: round(v, 2) for k, v in result.items()})}")
    print(f"load after: {os.getloadavg()}")

    def median(name: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[name])

    print(f"\n{'config':9s} {'prefill wall':>13s} {'cpu':>6s} {'decode ms/step':>15s} {'cpu':>6s}")
    for name in CONFIGS:
        pw, dw = median(name, "prefill_wall"), median(name, "decode_step_ms")
        pr = pw / median("passive", "prefill_wall")
        dr = dw / median("passive", "decode_step_ms")
        pc, dc = median(name, "prefill_cpu"), median(name, "decode_cpu")
        print(f"{name:9s} {pw:8.2f} s {pr:4.2f}x {pc:6.2f} {dw:9.0f} {dr:4.2f}x {dc:6.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "args": vars(args) | {"out": str(args.out), "model_dir": str(args.model_dir)},
                "runs": runs,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
