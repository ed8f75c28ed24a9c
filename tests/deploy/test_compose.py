"""deploy/compose.yaml: every profile validated with docker-compose, the default (cpu) stack run.

The cpu profile runs for real over podman (`compose-up.sh`'s socket and healthcheck driver):
Postgres (a stand-in built from Debian's packages, tests/deploy/postgres/, since no registry is
reachable), rlproxy and the trainer service, from the image the CPU test builds. The gpu and
observability profiles need images this machine cannot pull and a GPU it does not have; they are
checked through `docker-compose config`: the flags vLLM needs for runtime LoRA, the shared
checkpoint path, the networks, the published ports and the secrets.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import yaml
from openai import OpenAI

from tests.deploy.conftest import (
    LOGS,
    REPO,
    BuiltImage,
    container_env,
    free_port,
    podman,
    report,
    wait_healthy,
)

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(3600)]

COMPOSE_FILE = REPO / "deploy" / "compose.yaml"
VLLM_LORA_RANKS = {1, 8, 16, 32, 64, 128, 256, 320, 512}  # vllm/config/lora.py


def compose_config(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["docker-compose", "-f", str(COMPOSE_FILE), *args, "config"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO / "deploy",
    )


@pytest.fixture(scope="module")
def base_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    env_file = tmp_path_factory.mktemp("compose") / "rlproxy.env"
    env_file.write_text("RLPROXY_LOG_LEVEL=INFO\n")
    return {"POSTGRES_PASSWORD": secrets.token_hex(16), "RLPROXY_ENV_FILE": str(env_file)}


def rendered(env: dict[str, str], profile: str) -> dict:
    """The resolved file, with only the services `--profile PROFILE` starts (docker-compose
    1.29's `config` prints every service with its `profiles`)."""
    proc = compose_config(env, "--profile", profile)
    assert proc.returncode == 0, proc.stderr
    config = yaml.safe_load(proc.stdout)
    config["services"] = {
        name: s
        for name, s in config["services"].items()
        if not s.get("profiles") or profile in s["profiles"]
    }
    return config


def test_a_database_password_is_required(base_env: dict[str, str]) -> None:
    env = {**base_env, "POSTGRES_PASSWORD": ""}
    proc = compose_config(env)
    assert proc.returncode != 0
    assert "POSTGRES_PASSWORD" in proc.stderr


def test_gpu_profile_wires_vllm_to_the_trainer_checkpoints(base_env: dict[str, str]) -> None:
    from trainer.config import TrainerConfig

    env = {**base_env, "VLLM_MODEL": "Qwen3-8B", "RLPROXY_MODELS_DIR": "/srv/models"}
    services = rendered(env, "gpu")["services"]
    assert {"postgres", "rlproxy", "vllm", "trainer-gpu"} <= set(services)
    assert "trainer" not in services  # the CPU trainer is the cpu profile's, never beside this one
    vllm = services["vllm"]
    flags = vllm["command"]
    assert "--enable-lora" in flags
    assert "--max-loras=4" in flags
    assert "--model=/models/Qwen3-8B" in flags
    assert "--structured-outputs-config.backend=guidance" in flags  # rlproxy's Lark grammars
    assert "--logprobs-mode=raw_logprobs" in flags
    rank = int(next(f for f in flags if f.startswith("--max-lora-rank=")).split("=")[1])
    assert rank == 16 and rank in VLLM_LORA_RANKS
    assert rank >= TrainerConfig().lora_rank  # every adapter the trainer writes fits
    assert vllm["environment"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    # The checkpoint volume is mounted at the same path everywhere: the path the trainer writes
    # and rlproxy names in load_lora_adapter is the one vLLM reads.
    for name in ("rlproxy", "trainer-gpu", "vllm"):
        assert any(v.startswith("rlproxy-data:/data") for v in services[name]["volumes"]), name
        assert services[name].get("environment", {}).get("RLPROXY_DATA_DIR", "/data") == "/data"
    assert "rlproxy-data:/data:ro" in vllm["volumes"]
    assert "/srv/models:/models:ro" in vllm["volumes"]
    for name in ("vllm", "trainer-gpu"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"] and devices[0]["driver"] == "nvidia"
    assert (
        services["vllm"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        != services["trainer-gpu"]["deploy"]["resources"]["reservations"]["devices"][0][
            "device_ids"
        ]
    )
    assert services["trainer-gpu"]["build"]["dockerfile"] == "deploy/Dockerfile.trainer-gpu"


def test_only_rlproxy_is_published_and_backends_are_internal(base_env: dict[str, str]) -> None:
    env = {**base_env, "VLLM_MODEL": "m"}
    for profile in ("cpu", "gpu", "observability"):
        config = rendered(env, profile)
        assert config["networks"]["internal"]["internal"] is True
        services = config["services"]
        published = {name for name, s in services.items() if s.get("ports")}
        allowed = {"rlproxy"} | ({"langfuse-web"} if profile == "observability" else set())
        assert published == allowed, (profile, published)
        for name in published:
            for port in services[name]["ports"]:
                assert str(port).startswith("127.0.0.1:"), (name, port)  # loopback by default
        for name in ("postgres", "vllm", "langfuse-postgres", "clickhouse", "redis", "minio"):
            if name in services:
                assert list(services[name]["networks"]) == ["internal"], name


def test_scale_profile_puts_two_replicas_behind_the_balancer(base_env: dict[str, str]) -> None:
    """Profile scale (with cpu, which runs the one trainer): a second replica on the same
    database and data volume, HAProxy in front with deploy/haproxy.cfg (tests/scale/ runs that
    file on loopback), Redis for the shared rate. Only the balancer and rlproxy publish."""
    env = {**base_env, "LIMITS_REDIS_PASSWORD": "l1mits"}
    proc = compose_config(env, "--profile", "cpu", "--profile", "scale")
    assert proc.returncode == 0, proc.stderr
    services = {
        name: s
        for name, s in yaml.safe_load(proc.stdout)["services"].items()
        if not s.get("profiles") or {"cpu", "scale"} & set(s["profiles"])
    }
    assert {"postgres", "rlproxy", "rlproxy-b", "balancer", "limits-redis", "trainer"} <= set(
        services
    )
    a, b = services["rlproxy"], services["rlproxy-b"]
    assert a["environment"]["RLPROXY_TRAIN"] == b["environment"]["RLPROXY_TRAIN"] == "false"
    assert a["environment"]["RLPROXY_DATABASE_URL"] == b["environment"]["RLPROXY_DATABASE_URL"]
    assert a["volumes"] == b["volumes"] and a["image"] == b["image"]
    assert b["environment"]["RLPROXY_BOOTSTRAP_KEY"] == "false"  # replica a made the admin key
    assert b["depends_on"]["rlproxy"]["condition"] == "service_healthy"
    published = {name for name, s in services.items() if s.get("ports")}
    assert published == {"rlproxy", "balancer"}
    assert [str(p) for p in services["balancer"]["ports"]] == ["127.0.0.1:8080:8000/tcp"]
    balancer = services["balancer"]
    assert any(v.endswith(":/usr/local/etc/haproxy/haproxy.cfg:ro") for v in balancer["volumes"])
    assert balancer["environment"]["RLPROXY_REPLICA_B"] == "rlproxy-b:8000"
    assert list(services["limits-redis"]["networks"]) == ["internal"]
    assert services["limits-redis"]["environment"]["LIMITS_REDIS_PASSWORD"] == "l1mits"


def test_observability_profile_has_no_default_secrets(base_env: dict[str, str]) -> None:
    services = rendered(base_env, "observability")["services"]
    web = services["langfuse-web"]["environment"]
    for key in ("SALT", "ENCRYPTION_KEY", "NEXTAUTH_SECRET", "CLICKHOUSE_PASSWORD", "REDIS_AUTH"):
        assert web[key] in ("", None), key
    assert services["langfuse-postgres"]["environment"]["POSTGRES_PASSWORD"] in ("", None)
    assert services["minio"]["environment"]["MINIO_ROOT_PASSWORD"] in ("", None)
    # With them set, they reach Langfuse.
    env = {**base_env, "LANGFUSE_SALT": "s4lt", "REDIS_AUTH": "r3dis"}
    web = rendered(env, "observability")["services"]["langfuse-web"]["environment"]
    assert web["SALT"] == "s4lt" and web["REDIS_AUTH"] == "r3dis"


def test_env_example_names_every_variable_compose_reads() -> None:
    import re

    compose = COMPOSE_FILE.read_text()
    example = (REPO / "deploy" / ".env.example").read_text()
    used = set(re.findall(r"\$\{([A-Z0-9_]+)", compose)) - {"RLPROXY_ENV_FILE"}
    listed = set(re.findall(r"^#? ?([A-Z0-9_]+)=", example, flags=re.M))
    assert used <= listed, sorted(used - listed)


@dataclass
class Stack:
    env: dict[str, str]
    url: str
    project: str

    def compose(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["docker-compose", "-f", str(COMPOSE_FILE), *args],
            env={**container_env(), **self.env},
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO / "deploy",
        )


@pytest.fixture(scope="module")
def stack(
    cpu_image: BuiltImage,
    postgres_image: str,
    compose_helpers: dict[str, str],
    base_env: dict[str, str],
) -> Iterator[Stack]:
    port = free_port()
    project = f"rlproxydeploy{uuid.uuid4().hex[:8]}"
    env = {
        **compose_helpers,
        **base_env,
        "COMPOSE_PROJECT_NAME": project,
        "COMPOSE_PROFILES": "cpu",
        "RLPROXY_IMAGE": cpu_image.ref,
        "POSTGRES_IMAGE": postgres_image,
        "RLPROXY_PUBLISH": f"127.0.0.1:{port}",
    }
    s = Stack(env, f"http://127.0.0.1:{port}", project)
    try:
        started = time.monotonic()
        up = s.compose("up", "-d")
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        ready_s = wait_healthy(s.url, 900)
        report(
            f"compose (cpu profile): up and serving in {time.monotonic() - started:.1f} s "
            f"(rlproxy ready {ready_s:.1f} s after `up` returned; first model conversion)"
        )
        yield s
    finally:
        logs = s.compose("logs", "--no-color", timeout=120)
        (LOGS / "compose.log").write_text(logs.stdout + logs.stderr)
        down = s.compose("down", "-v", "-t", "30", timeout=300)
        assert down.returncode == 0, down.stderr[-2000:]


def container(stack: Stack, service: str) -> str:
    out = podman(
        "ps",
        "-a",
        "--filter",
        f"label=com.docker.compose.project={stack.project}",
        "--filter",
        f"label=com.docker.compose.service={service}",
        "--format",
        "{{.Names}}",
    ).stdout.split()
    assert len(out) == 1, (service, out)
    return out[0]


def test_default_stack_comes_up_healthy_and_serves(stack: Stack) -> None:
    rlproxy, postgres = container(stack, "rlproxy"), container(stack, "postgres")
    trainer = container(stack, "trainer")
    for name in (rlproxy, postgres):
        deadline = time.monotonic() + 120
        status = ""
        while time.monotonic() < deadline:
            status = podman("inspect", "--format", "{{.State.Health.Status}}", name).stdout.strip()
            if status == "healthy":
                break
            time.sleep(2)
        assert status == "healthy", name
    assert podman("inspect", "--format", "{{.State.Status}}", trainer).stdout.strip() == "running"
    # Only rlproxy's port is published, on loopback.
    assert podman("port", postgres, check=False).stdout.strip() == ""
    assert podman("port", trainer, check=False).stdout.strip() == ""
    ports = podman("port", rlproxy).stdout.strip()
    assert ports.startswith("8000/tcp -> 127.0.0.1:"), ports

    key = podman("exec", rlproxy, "cat", "/data/admin.key").stdout.strip()
    assert httpx.get(f"{stack.url}/v1/models", timeout=30).status_code == 401
    client = OpenAI(base_url=f"{stack.url}/v1", api_key=key, timeout=300)
    r = client.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8
    )
    assert r.choices[0].message.content
    # Stored in Postgres (the stack's own database, reached only on the internal network).
    row = podman(
        "exec",
        postgres,
        "psql",
        "-U",
        "rlproxy",
        "-d",
        "rlproxy",
        "-tAc",
        f"SELECT status FROM calls WHERE completion_id = '{r.id}'",
    ).stdout.strip()
    assert row == "completed"
    # The trainer service shares the database and the data volume and is polling for groups.
    deadline = time.monotonic() + 600
    log = ""
    while time.monotonic() < deadline:
        out = podman("logs", trainer, check=False)
        log = out.stdout + out.stderr
        if "training rlproxy into /data/checkpoints/rlproxy" in log:
            break
        time.sleep(3)
    assert "training rlproxy into /data/checkpoints/rlproxy" in log, log[-3000:]
    health = httpx.get(
        f"{stack.url}/health", headers={"Authorization": f"Bearer {key}"}, timeout=30
    ).json()
    assert health["trainer"] == {"state": "off"}  # serve runs no child: the service trains
    report(f"compose health: {json.dumps({k: health[k] for k in ('status', 'model')})}")
