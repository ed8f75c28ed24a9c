"""The OpenAI Agents SDK against a real rlproxy, run as a user runs it: its own process.

`tests/e2e/clients/agents_sdk_tool.py` is an agent program as the SDK's docs write one (the
default model class, which speaks the Responses API; a `@function_tool`; tracing off), reaching
the server through OPENAI_BASE_URL and OPENAI_API_KEY alone. The SDK sends the whole
conversation on every turn, with no ids of rlproxy's: the proxy must still store the run as one
trajectory, its turns in order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.e2e.conftest import Server
from tests.e2e.helpers import get_trajectory

CLIENT = Path(__file__).parent / "clients" / "agents_sdk_tool.py"
INSTRUCTIONS = "You answer questions about the weather. Use the get_weather tool."
QUESTION = "What is the weather in Paris?"


def run_client(server: Server, cwd: Path) -> dict[str, Any]:
    """The client program in a fresh interpreter that sees only the documented variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "RLPROXY_"))}
    env |= {"OPENAI_BASE_URL": server.base_url, "OPENAI_API_KEY": "sk-test"}
    env.pop("PYTHONPATH", None)  # the client imports nothing of rlproxy
    done = subprocess.run(
        [sys.executable, str(CLIENT)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_agent_with_a_tool_is_one_trajectory(server: Server, tmp_path: Path) -> None:
    out = run_client(server, tmp_path)

    # The run completed, and the tool ran on the model's call.
    assert isinstance(out["final_output"], str)
    assert out["tool_calls"][0] == "get_weather"
    assert out["weather_asked"] and all(isinstance(c, str) for c in out["weather_asked"])
    ids = out["response_ids"]
    assert len(ids) >= 2 and all(i.startswith("resp_") for i in ids), ids

    # One trajectory, whichever of the run's response ids names it; its turns are the SDK's
    # responses in order.
    trajectory = get_trajectory(server, ids[0])
    assert {get_trajectory(server, i)["id"] for i in ids} == {trajectory["id"]}
    turns = trajectory["turns"]
    assert [t["completion_id"] for t in turns] == ids
    assert [t["turn_index"] for t in turns] == list(range(len(ids)))
    assert {t["protocol"] for t in turns} == {"responses"}
    assert {t["model_requested"] for t in turns} == {"gpt-4o-mini"}  # an alias of the policy
    assert all(t["status"] == "completed" for t in turns)

    # Turn 1: the instructions and the question; the answer is a call of the tool.
    first = turns[0]
    assert first["request_messages"] == [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": QUESTION},
    ]
    [call] = first["response_messages"][0]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] == out["weather_asked"][0]
    assert [t["function"]["name"] for t in first["tools"]] == ["get_weather"]

    # Turn 2: the same conversation, then that call and the tool's output.
    second = turns[1]["request_messages"]
    assert second[:2] == first["request_messages"]
    assert second[2]["role"] == "assistant"
    assert [c["id"] for c in second[2]["tool_calls"]] == [call["id"]]
    assert second[3] == {
        "role": "tool",
        "tool_call_id": call["id"],
        "content": f"It is sunny and 21 C in {out['weather_asked'][0]}.",
    }
