"""Real container builds and runs for deploy/ (`make test-deploy`, marker `deploy`).

A machine that reaches no container registry is the case this harness is built for:
`tests/deploy/host/setup-host.sh` (or the folder $RLPROXY_CONTAINERS_DIR names) installs podman
(and debootstrap, docker-compose) from Debian and builds a local stand-in for
python:3.11-slim, and `compose-up.sh` runs docker-compose over podman with working
healthchecks. The images are built with the same Dockerfile users build, only with
BASE_IMAGE pointing at the stand-in (and the machine's torch CPU wheel folder mounted when it
exists, since PyTorch's own index is out of reach here). Layer caching keeps a rebuild after a
code change to the last, small layer.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
CONTAINERS = Path(os.environ.get("RLPROXY_CONTAINERS_DIR", Path(__file__).parent / "host"))
LOCAL_BASE = "localhost/local/python:3.11-slim"
CPU_IMAGE = os.environ.get("RLPROXY_DEPLOY_IMAGE", "localhost/rlproxy:deploy-test")
POSTGRES_IMAGE = "localhost/rlproxy-test/postgres:16"
WHEELS = Path("/opt/wheels")  # this machine's torch CPU wheel, for the build only
GB = 1000**3
LOGS = REPO / "rlproxy-data" / "deploy-tests"
"""Figures and the containers' logs of the last run (git-ignored, with the rest of rlproxy-data)."""


def container_env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(CONTAINERS / "containers.conf")}


def podman(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        ["podman", *args], env=container_env(), capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(line: str) -> None:
    """A figure for the person running `make test-deploy` (shown with -s, and in the log)."""
    print(f"\n[deploy] {line}", flush=True)
    LOGS.mkdir(parents=True, exist_ok=True)
    with (LOGS / "figures.txt").open("a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")


@dataclass(frozen=True)
class BuiltImage:
    ref: str
    size_bytes: int
    build_s: float


@pytest.fixture(scope="session")
def host_ready() -> None:
    setup = CONTAINERS / "setup-host.sh"
    assert setup.is_file(), f"no {setup}: set RLPROXY_CONTAINERS_DIR to the containers recipe"
    proc = subprocess.run(
        [str(setup)], env=container_env(), capture_output=True, text=True, timeout=1200
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="session")
def cpu_image(host_ready: None) -> BuiltImage:
    if os.environ.get("RLPROXY_DEPLOY_REUSE_IMAGE") == "1":  # iterating on the tests alone
        size = int(podman("image", "inspect", "--format", "{{.Size}}", CPU_IMAGE).stdout.strip())
        return BuiltImage(CPU_IMAGE, size, 0.0)
    # docker format: the OCI format drops HEALTHCHECK.
    args = ["build", "--format", "docker", "--build-arg", f"BASE_IMAGE={LOCAL_BASE}"]
    if WHEELS.is_dir():
        args += [
            "--build-arg",
            "TORCH_INDEX_URL=https://pypi.org/simple",
            "--build-arg",
            f"TORCH_FIND_LINKS={WHEELS}",
            "-v",
            f"{WHEELS}:{WHEELS}:ro",
        ]
    args += ["-f", "deploy/Dockerfile", "-t", CPU_IMAGE, str(REPO)]
    started = time.monotonic()
    proc = subprocess.run(
        ["podman", *args],
        env=container_env(),
        capture_output=True,
        text=True,
        timeout=3600,
        cwd=REPO,
    )
    build_s = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    size = int(podman("image", "inspect", "--format", "{{.Size}}", CPU_IMAGE).stdout.strip())
    report(f"CPU image {CPU_IMAGE}: {size / GB:.2f} GB, build {build_s:.0f} s (cached layers)")
    return BuiltImage(CPU_IMAGE, size, build_s)


@pytest.fixture(scope="session")
def postgres_image(host_ready: None) -> str:
    podman("build", "-t", POSTGRES_IMAGE, str(REPO / "tests" / "deploy" / "postgres"), timeout=1200)
    return POSTGRES_IMAGE


def wait_healthy(url: str, timeout_s: float, container: str | None = None) -> float:
    """Poll GET /health until 200; return the seconds it took. Fails with the container's log."""
    started = time.monotonic()
    last = ""
    while time.monotonic() - started < timeout_s:
        try:
            r = httpx.get(f"{url}/health", timeout=5)
            if r.status_code == 200:
                return time.monotonic() - started
            last = f"{r.status_code} {r.text[:300]}"
        except httpx.HTTPError as e:
            last = repr(e)
        if container is not None:
            state = podman("inspect", "--format", "{{.State.Status}}", container, check=False)
            if state.stdout.strip() in ("exited", "stopped"):
                break
        time.sleep(1)
    logs = podman("logs", "--tail", "60", container, check=False) if container else None
    detail = f"\n{logs.stdout[-4000:]}{logs.stderr[-4000:]}" if logs else ""
    raise AssertionError(f"{url}/health not ready after {timeout_s:.0f} s ({last}){detail}")


@pytest.fixture(scope="session")
def compose_helpers(host_ready: None) -> Iterator[dict[str, str]]:
    """podman's Docker socket and the healthcheck driver (compose-up.sh serve), for the session."""
    out = subprocess.run(
        [str(CONTAINERS / "compose-up.sh"), "serve"],
        env={**container_env(), "PODMAN_SOCK": f"/tmp/rlproxy-deploy-test-{os.getpid()}.sock"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    env = {}
    pids: list[int] = []
    for line in out.stdout.splitlines():
        if line.startswith("export "):
            for part in line.removeprefix("export ").split(";")[0].split():
                k, _, v = part.partition("=")
                env[k] = v
        if line.startswith("RLPROXY_COMPOSE_HELPER_PIDS="):
            pids = [int(p) for p in line.split("=", 1)[1].strip("'").split()]
    yield env
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 15)


def volume_path(name: str) -> Path:
    info = json.loads(podman("volume", "inspect", name).stdout)
    return Path(info[0]["Mountpoint"])
