"""A JavaScript client against a real rlproxy: the Vercel AI SDK (`ai` with `@ai-sdk/openai`),
whose `openai(...)` models speak the Responses API by default.

`tests/e2e/js/ai_sdk.mjs` is a program as the SDK's docs write one (`createOpenAI({baseURL,
apiKey})`, `generateText`, `streamText`, a `tool()` with a zod schema); it knows nothing of
rlproxy. Its packages are pinned by `tests/e2e/js/package-lock.json` and installed once with
`npm ci` into a cache folder outside the checkout, under the test model cache, keyed by the
lockfile's hash (a changed lockfile installs afresh; the npm registry is needed only then).

Skipped only when `node` is not on PATH, and then a failure in CI, which has Node.js 18 or newer
(tests/required.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Server
from tests.e2e.helpers import get_trajectory
from tests.required import missing

JS = Path(__file__).parent / "js"
CLIENT = JS / "ai_sdk.mjs"


@pytest.fixture(scope="session")  # before `server`: no server is started to be skipped
def node_modules(model_data_dir: Path) -> Path:
    """The pinned packages, installed once per lockfile into `<model cache>/js-clients/`."""
    if shutil.which("node") is None:
        missing(
            "node is not on PATH",
            "install Node.js 18+ with npm to run the JavaScript clients (`make test` runs them)",
        )
    npm = shutil.which("npm")
    assert npm is not None, "node is on PATH but npm is not: npm installs the pinned clients"
    lock = (JS / "package-lock.json").read_bytes()
    cache = model_data_dir / "js-clients" / hashlib.sha256(lock).hexdigest()[:16]
    if not (cache / "installed").exists():
        staging = cache.with_name(f"{cache.name}.{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for name in ("package.json", "package-lock.json"):
            shutil.copyfile(JS / name, staging / name)
        done = subprocess.run(
            [npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund"],
            cwd=staging,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, f"npm ci failed:\n{done.stdout}\n{done.stderr}"
        (staging / "installed").touch()
        try:
            staging.rename(cache)  # atomic: a half-done install is never taken for a cache
        except OSError:  # another session installed it first
            shutil.rmtree(staging, ignore_errors=True)
    return cache / "node_modules"


def run_client(node_modules: Path, where: Path, server: Server, mode: str) -> dict[str, Any]:
    """`node ai_sdk.mjs BASE_URL MODE` beside a link to the installed packages."""
    script = where / CLIENT.name
    shutil.copyfile(CLIENT, script)
    if not (where / "node_modules").exists():
        (where / "node_modules").symlink_to(node_modules, target_is_directory=True)
    done = subprocess.run(
        ["node", str(script), server.base_url, mode],
        cwd=where,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def stored_turn(server: Server, response_id: str) -> dict[str, Any]:
    """The stored call behind a response id the client received."""
    turns = get_trajectory(server, response_id)["turns"]
    [turn] = [t for t in turns if t["completion_id"] == response_id]
    return turn


def test_generate_and_stream_text(node_modules: Path, tmp_path: Path, server: Server) -> None:
    generated = run_client(node_modules, tmp_path, server, "generate")
    streamed = run_client(node_modules, tmp_path, server, "stream")
    for out in (generated, streamed):
        assert out["text"]
        assert out["finishReason"] == "length"  # max_output_tokens cut it: "incomplete"
        assert out["usage"]["outputTokens"] == 12
        assert out["usage"]["inputTokens"] > 0
        # The SDK went through /v1/responses: the call is stored under the Responses protocol.
        assert out["responseId"].startswith("resp_")
        turn = stored_turn(server, out["responseId"])
        assert turn["protocol"] == "responses"
        assert turn["completion_tokens"] == 12
    # Text deltas as they came, which add up to the text; greedy, the same as generateText's.
    assert len(streamed["deltas"]) > 1
    assert "".join(streamed["deltas"]) == streamed["text"] == generated["text"]


def test_tool_call(node_modules: Path, tmp_path: Path, server: Server) -> None:
    out = run_client(node_modules, tmp_path, server, "tool")
    # The call's input passed the zod schema and the tool ran on it.
    [call] = out["toolCalls"]
    assert call["toolName"] == "weather"
    assert isinstance(call["input"]["city"], str) and call["input"]["city"]
    assert out["toolResults"] == [
        {"toolName": "weather", "output": {"city": call["input"]["city"], "temperature": 21}}
    ]
    assert out["finishReason"] == "tool-calls"
    turn = stored_turn(server, out["responseId"])
    assert turn["protocol"] == "responses"
    [stored] = turn["response_messages"][0]["tool_calls"]
    assert stored["function"]["name"] == "weather"
    assert json.loads(stored["function"]["arguments"]) == call["input"]
