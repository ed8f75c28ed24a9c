"""A user pressing Ctrl-C mid-stream, again and again, on all three protocols.

Each round starts real SDK clients in their own processes (the openai SDK streaming Chat
Completions and Responses, the anthropic SDK streaming Messages), waits until each has printed
its first streamed text, and sends it SIGINT, as Ctrl-C in a terminal does; beside them, one
client per protocol runs to the end. After the rounds: every protocol still answers, the engine
has no rows left running, every answer a client received in full is stored as completed, and
every interrupted one is stored as a call the client left (nothing acknowledged is lost).

The clients restore Python's SIGINT handler themselves: a test run started as a background job
inherits SIGINT ignored, and then the clients kept streaming after the "Ctrl-C" (seen once: a
neighbouring test timed out on the 2000-token streams left running). Clients still alive at the
end are killed, so a failure here never slows the tests after it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Server
from tests.e2e.helpers import MESSAGE_LIKE, db_rows, own_server

ROUNDS = 2
LONG = "Write a very long story about the sea, with many chapters."

CLIENT = r"""
import json, signal, sys
# Ctrl-C raises KeyboardInterrupt, as in a terminal, even when this test runs where SIGINT is
# ignored (a shell's background job: Python then leaves it ignored for its children too).
signal.signal(signal.SIGINT, signal.default_int_handler)
protocol, base, prompt, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if protocol == "messages":
    import anthropic
    c = anthropic.Anthropic(base_url=base, api_key="sk-test", max_retries=0)
    seen, message_id = False, None
    stream = c.messages.create(model="rlproxy", max_tokens=max_tokens,
                               stream=True, messages=[{"role": "user", "content": prompt}])
    for event in stream:
        if event.type == "message_start":
            message_id = event.message.id
        if not seen and event.type == "content_block_delta":
            seen = True
            print("FIRST", flush=True)
    print("DONE " + json.dumps({"id": message_id}), flush=True)
else:
    from openai import OpenAI
    c = OpenAI(base_url=base + "/v1", api_key="sk-test", max_retries=0)
    seen, last_id = False, None
    if protocol == "chat":
        stream = c.chat.completions.create(model="rlproxy", stream=True, max_tokens=max_tokens,
            temperature=2.0, messages=[{"role": "user", "content": prompt}])
        for chunk in stream:
            last_id = chunk.id
            if not seen and chunk.choices and chunk.choices[0].delta.content:
                seen = True
                print("FIRST", flush=True)
    else:
        stream = c.responses.create(model="rlproxy", stream=True, max_output_tokens=max_tokens,
            temperature=2.0, input=prompt)
        for event in stream:
            if event.type == "response.created":
                last_id = event.response.id
            if not seen and event.type == "response.output_text.delta":
                seen = True
                print("FIRST", flush=True)
    print("DONE " + json.dumps({"id": last_id}), flush=True)
"""

PROTOCOLS = ("chat", "responses", "messages")


def _client(server: Server, protocol: str, max_tokens: int) -> subprocess.Popen[str]:
    base = server.url
    return subprocess.Popen(
        [sys.executable, "-c", CLIENT, protocol, base, LONG, str(max_tokens)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _wait_line(proc: subprocess.Popen[str], prefix: str, timeout_s: float) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line
        if not line and proc.poll() is not None:
            raise AssertionError(f"client exited {proc.returncode}: {proc.stderr.read()}")
    raise AssertionError(f"no {prefix!r} from the client in {timeout_s} s")


def _running_rows(server: Server) -> int:
    return int(httpx.get(f"{server.url}/health", timeout=10).json()["engine"]["running_rows"])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Iterator[Server]:
    """A server of its own: its engine rows and stored calls are this test's alone."""
    with own_server(tmp_path_factory.mktemp("interrupts-data"), model_data_dir) as s:
        yield s


@pytest.mark.timeout(900)
def test_ctrl_c_mid_stream_again_and_again_loses_nothing_and_every_protocol_answers(
    server: Server,
) -> None:
    finished: list[str] = []
    clients: list[subprocess.Popen[str]] = []
    try:
        _rounds(server, finished, clients)
    finally:
        for proc in clients:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    _check_after(server, finished)


def _rounds(server: Server, finished: list[str], clients: list[subprocess.Popen[str]]) -> None:
    for _ in range(ROUNDS):
        interrupted = [_client(server, p, 2000) for p in PROTOCOLS]
        complete = [_client(server, p, 8) for p in PROTOCOLS]
        clients += interrupted + complete
        for proc in interrupted:
            _wait_line(proc, "FIRST", 240)
            proc.send_signal(signal.SIGINT)
        for proc in interrupted:
            proc.wait(timeout=60)
            assert proc.returncode != 0  # KeyboardInterrupt: the user left
        for proc in complete:
            line = _wait_line(proc, "DONE", 240)
            finished.append(json.loads(line.removeprefix("DONE "))["id"])
            assert proc.wait(timeout=60) == 0


def _check_after(server: Server, finished: list[str]) -> None:
    deadline = time.monotonic() + 120
    while _running_rows(server) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _running_rows(server) == 0

    # every protocol still answers, in its own shape
    with httpx.Client(base_url=server.url, timeout=240) as http:
        hi = [{"role": "user", "content": "Hi"}]
        chat = http.post(
            "/v1/chat/completions", json={"model": "rlproxy", "messages": hi, "max_tokens": 4}
        )
        assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
        resp = http.post(
            "/v1/responses", json={"model": "rlproxy", "input": "Hi", "max_output_tokens": 4}
        )
        assert resp.status_code == 200 and resp.json()["object"] == "response"
        msg = http.post(
            "/v1/messages",
            json={"model": "rlproxy", "max_tokens": 4, "messages": hi},
            headers={"x-api-key": "sk-test", "anthropic-version": "2023-06-01"},
        )
        assert msg.status_code == 200 and msg.json()["type"] == "message"

    # nothing acknowledged is lost: each answer received in full is stored, completed
    assert len(finished) == ROUNDS * len(PROTOCOLS) and all(finished)
    for completion_id in finished:
        rows = db_rows(
            server.data_dir, "SELECT status FROM calls WHERE completion_id = ?", (completion_id,)
        )
        assert [r["status"] for r in rows] == ["completed"], completion_id
    left = db_rows(
        server.data_dir,
        f"SELECT COUNT(*) AS n FROM calls WHERE status = 'client_disconnected' AND {MESSAGE_LIKE}",
        (f"%{LONG}%",),
    )
    assert left[0]["n"] >= ROUNDS * len(PROTOCOLS)
