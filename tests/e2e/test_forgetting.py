"""The forgetting check on a real server: a version that broke general answers is held, the base
keeps answering; a sane version passes and serves.

`rlproxy serve` with publishing on and the check at its defaults, on the embedded model (local
engine, CPU). Versions are PEFT LoRA folders renamed into the checkpoint folder the way the
trainer writes them:

- version 1: a deliberately broken LoRA (the tests' random LoRA, B times 30: every answer is
  word salad). The check holds it: it never serves, the policy name keeps serving the base (every
  answer says `rlproxy@base`, `X-RLProxy-Version: base`), also while the check runs; it is shown
  held, with the figures and the reason, in `GET /rl/adapters`, `rlproxy status` and the
  dashboard's adapters page, and `/metrics` counts it (`rlproxy_versions_held_total`).
- version 2: a small random LoRA (B times 0.1: it changes some greedy answers, its KL to the
  base is about a hundredth of the limit). It passes and serves: answers say `rlproxy@2`.

With a canary rollout on, a held version never goes on canary; a sane one does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import Server
from tests.e2e.helpers import own_server, wait_for
from tests.e2e.test_adapters import write_random_lora
from tests.e2e.test_dashboard import Browser, browser, goto  # noqa: F401
from tests.required import missing

BROKEN, SANE = 1, 2
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def chromium_binary() -> str:
    """For the dashboard's test alone (test_dashboard.py's is autouse: every test would need
    Chromium)."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        missing("no Chromium", "the dashboard's browser tests need Debian's `chromium` package")
    return binary


@pytest.fixture(scope="module")
def fserver(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Iterator[Server]:
    env = {
        "RLPROXY_PUBLISH_ADAPTERS": "true",
        "RLPROXY_ROLLOUT": "false",  # each version serves at once (the guard: test_rollout.py)
        "RLPROXY_ADAPTER_POLL_S": "0.5",
    }
    with own_server(tmp_path_factory.mktemp("forgetting-data"), model_data_dir, env) as server:
        yield server


def _publish(source: Path, server: Server, version: int) -> None:
    """Put a version in place as the trainer does: a temporary folder, then one rename."""
    root = server.data_dir / "checkpoints" / server.model_name
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{version:04d}-test"
    shutil.copytree(source, tmp)
    os.rename(tmp, root / f"{version:04d}")


def _adapters(server: Server) -> dict[str, Any]:
    return httpx.get(f"{server.url}/rl/adapters", timeout=30).json()


def _version(server: Server, version: int) -> dict[str, Any] | None:
    return next((a for a in _adapters(server)["data"] if a["version"] == version), None)


def _ask(client: OpenAI) -> tuple[str, str]:
    """(the answer's `model`, its X-RLProxy-Version) for a request to the policy's name."""
    raw = client.chat.completions.with_raw_response.create(
        model="rlproxy", messages=MESSAGES, max_tokens=4, temperature=0
    )
    return raw.parse().model, raw.headers["x-rlproxy-version"]


def _metric(server: Server, name: str) -> float | None:
    for line in httpx.get(f"{server.url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.fixture(scope="module")
def held(fserver: Server, model_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Publish the broken version while a client keeps asking the policy; its listing once the
    check has decided, and what every answer meanwhile said about its version."""
    broken = tmp_path_factory.mktemp("broken") / "lora"
    write_random_lora(model_data_dir, broken, scale=30)
    answers: list[tuple[str, str]] = []
    failures: list[str] = []
    stop = threading.Event()

    def keep_asking() -> None:
        with OpenAI(base_url=fserver.base_url, api_key="sk-test", max_retries=0, timeout=120) as c:
            while not stop.is_set():
                try:
                    answers.append(_ask(c))
                except Exception as exc:  # every failure counts
                    failures.append(f"{type(exc).__name__}: {exc}")

    asker = threading.Thread(target=keep_asking)
    asker.start()
    try:
        _publish(broken, fserver, BROKEN)
        listing = wait_for(
            lambda: (a := _version(fserver, BROKEN)) and a["status"] != "written" and a,
            600,
            "the check's verdict on version 1",
        )
    finally:
        stop.set()
        asker.join(timeout=120)
    return {"listing": listing, "answers": answers, "failures": failures}


def test_a_broken_version_is_held_and_the_base_keeps_answering(fserver: Server, held: dict) -> None:
    version = held["listing"]
    assert version["status"] == "held", version
    assert not version["active"] and not version["loaded"]
    verdict = version["forgetting"]
    assert verdict["state"] == "held" and verdict["held_for"] == "forgetting"
    assert verdict["divergence"]["mean_kl"] > verdict["max_kl"]
    assert verdict["divergence"]["prompts"] >= 20
    assert "forgot general answers" in version["error"]
    assert "RLPROXY_FORGETTING_MAX_KL" in version["error"]
    # The policy kept serving the base while the check ran, and after.
    assert held["failures"] == []
    assert held["answers"], "no request was answered while the check ran"
    assert set(held["answers"]) == {("rlproxy@base", "base")}
    with OpenAI(base_url=fserver.base_url, api_key="sk-test", max_retries=0, timeout=120) as c:
        assert _ask(c) == ("rlproxy@base", "base")
    assert _adapters(fserver)["forgetting"]["enabled"] is True
    models = [m["id"] for m in httpx.get(f"{fserver.base_url}/models", timeout=30).json()["data"]]
    assert f"rlproxy@{BROKEN}" not in models


def test_the_hold_raises_the_alarm_metrics(fserver: Server, held: dict) -> None:
    assert _metric(fserver, 'rlproxy_versions_held_total{reason="forgetting"}') == 1
    divergence = _metric(fserver, "rlproxy_forgetting_divergence")
    assert divergence == pytest.approx(held["listing"]["forgetting"]["divergence"]["mean_kl"])
    assert _metric(fserver, "rlproxy_forgetting_checked_version") == BROKEN


def test_rlproxy_status_shows_the_held_version(fserver: Server, held: dict) -> None:
    env = {**os.environ, "RLPROXY_DATA_DIR": str(fserver.data_dir)}
    done = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "status"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if line.strip()}
    assert "held 1" in lines["adapters"]
    assert lines["held"].split(None, 1)[1].startswith("v1: held: it forgot general answers")
    report = json.loads(
        subprocess.run(
            [sys.executable, "-m", "proxy.cli", "status", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        ).stdout
    )
    assert report["adapters"]["by_status"]["held"] == 1
    (shown,) = report["adapters"]["held"]
    assert shown["version"] == BROKEN and shown["mean_kl"] > shown["max_kl"]


def test_the_dashboard_shows_the_held_version_and_why(
    fserver: Server,
    held: dict,
    browser: Browser,  # noqa: F811
) -> None:
    page = browser.page()
    goto(page, fserver, "adapters", f'#adapters-table tr[data-version="{BROKEN}"]')
    row = page.locator(f'#adapters-table tr[data-version="{BROKEN}"]')
    assert row.locator("td").nth(1).inner_text().strip() == "held"
    assert "forgot general answers" in row.inner_text()


def test_a_sane_version_passes_and_serves(
    fserver: Server, held: dict, model_data_dir: Path, tmp_path: Path
) -> None:
    sane = tmp_path / "lora"
    write_random_lora(model_data_dir, sane, scale=0.1)
    _publish(sane, fserver, SANE)
    version = wait_for(
        lambda: (a := _version(fserver, SANE)) and a["active"] and a,
        600,
        "version 2 to serve",
    )
    assert version["status"] == "loaded"
    verdict = version["forgetting"]
    assert verdict["state"] == "passed"
    assert 0 < verdict["divergence"]["mean_kl"] < verdict["max_kl"]
    with OpenAI(base_url=fserver.base_url, api_key="sk-test", max_retries=0, timeout=120) as c:
        assert _ask(c) == (f"rlproxy@{SANE}", str(SANE))
    # The held version stays held and out of service.
    assert _version(fserver, BROKEN)["status"] == "held"  # type: ignore[index]
    assert _metric(fserver, "rlproxy_forgetting_checked_version") == SANE
    assert _metric(fserver, 'rlproxy_versions_held_total{reason="forgetting"}') == 1


def test_with_rollout_on_a_held_version_never_goes_on_canary_and_a_sane_one_does(
    tmp_path: Path, model_data_dir: Path
) -> None:
    broken, sane = tmp_path / "broken", tmp_path / "sane"
    write_random_lora(model_data_dir, broken, scale=30)
    write_random_lora(model_data_dir, sane, scale=0.1)
    env = {
        "RLPROXY_PUBLISH_ADAPTERS": "true",
        "RLPROXY_ADAPTER_POLL_S": "0.5",
        "RLPROXY_ROLLOUT": "true",
    }
    with own_server(tmp_path / "data", model_data_dir, env) as server:
        _publish(broken, server, BROKEN)
        held = wait_for(
            lambda: (a := _version(server, BROKEN)) and a["status"] != "written" and a,
            600,
            "the check's verdict on version 1",
        )
        assert held["status"] == "held" and not held["canary"]
        assert _adapters(server)["rollout"]["canary"] is None
        _publish(sane, server, SANE)
        on_canary = wait_for(
            lambda: _adapters(server)["rollout"]["canary"] == SANE and _version(server, SANE),
            600,
            "version 2 on canary",
        )
        assert on_canary["forgetting"]["state"] == "passed"
        assert on_canary["rollout"]["state"] == "canary"
        assert _version(server, BROKEN)["status"] == "held"  # type: ignore[index]
