"""Canary rollout end to end: a real server, the real embedded model, the `openai` client, RULER
through litellm against a scripted judge on loopback.

The judge is a paid model that cannot run here. `VersionJudge` follows OpenAI's documented Chat
Completions protocol (https://platform.openai.com/docs/api-reference/chat/create) as
`tests/e2e/fake_judge.py` does (a `chat.completion` body whose `choices[0].message.content` is
RULER's JSON, `{"scores": [{"trajectory_id", "explanation", "score"}]}`, the shape
`trainer/scoring/ruler.py` asks for). Its script is a preference: it finds each member's run tag
in RULER's prompt (`<trajectory id="k">` blocks), reads which adapter version served that run
from the server's database, and scores the preferred version 0.9, any other 0.1.

- A new version put in the checkpoint folder starts a canary: calls to the policy name are split
  between it and the active version, and every stored call carries the version that served it.
- A judge preferring the old version's answers makes the rollout roll the canary back and reject
  it, with the figures; the publisher never serves it again.
- A judge preferring the new version's answers gets it promoted.
- The watch: once the judge prefers the base's answers again, the promoted version, compared
  with the base on the conversations the watch sends there, is rolled back.
- With the setting off, a new version serves everything at once, as before.

In the default suite since the test became sequential (about a minute on the shared 2-core
machine; the fixed-look t-test before it needed 4 to 12 and ran in `make test-slow`).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from openai import OpenAI

from tests.e2e.conftest import Server
from tests.e2e.helpers import MESSAGE_LIKE, db_rows, own_server, wait_for
from tests.e2e.test_adapters import write_random_lora

GROUP_SIZE = 4
MIN_GROUPS = 3
MAX_GROUPS = 6
WATCH_SHARE = 0.4  # the watch's base arm (default 0.1), so its mixed groups come quickly
TAG = re.compile(r"\[run-([0-9a-f]{12})\]")


class VersionJudge:
    """A loopback judge that prefers the answers of one adapter version (see the docstring)."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.data_dir: Path | None = None
        self.prefer: int = 0  # adapter version (0: base) whose members score 0.9
        self.requests = 0
        app = FastAPI()
        app.post("/v1/chat/completions")(self._chat)
        self._server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> VersionJudge:
        self._thread.start()
        wait_for(lambda: self._server.started, 30, "the judge to start", poll_s=0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def _version_of(self, tag: str) -> int:
        assert self.data_dir is not None
        uri = f"file:{self.data_dir / 'rlproxy.db'}?mode=ro"
        with closing(sqlite3.connect(uri, uri=True, timeout=30)) as conn:
            row = conn.execute(
                f"SELECT adapter_version FROM calls WHERE {MESSAGE_LIKE}",
                (f"%[run-{tag}]%",),
            ).fetchone()
        return int(row[0] or 0) if row else -1

    async def _chat(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        self.requests += 1
        prompt = "\n".join(str(m.get("content")) for m in body["messages"])
        blocks = re.findall(r'<trajectory id="(\d+)">(.*?)</trajectory>', prompt, re.S)
        scores = []
        for short, text in blocks:
            found = TAG.search(text)
            version = self._version_of(found.group(1)) if found else -1
            score = 0.9 if version == self.prefer else 0.1
            scores.append({"trajectory_id": short, "explanation": f"v{version}", "score": score})
        return {
            "id": f"chatcmpl-judge-{self.requests}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "judge"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": json.dumps({"scores": scores})},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120},
        }


@pytest.fixture(scope="module")
def judge() -> Iterator[VersionJudge]:
    with VersionJudge() as j:
        yield j


@pytest.fixture(scope="module")
def rserver(
    tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path, judge: VersionJudge
) -> Iterator[Server]:
    env = {
        "RLPROXY_PUBLISH_ADAPTERS": "true",
        "RLPROXY_ADAPTER_POLL_S": "0.5",
        # The tests' random LoRA is word salad by the forgetting check's measure: it would be
        # held. This suite is about the canary; the check's: test_forgetting.py.
        "RLPROXY_FORGETTING_CHECK": "false",
        "RLPROXY_ROLLOUT": "true",
        "RLPROXY_ROLLOUT_SHARE": "0.5",
        "RLPROXY_ROLLOUT_MIN_GROUPS": str(MIN_GROUPS),
        "RLPROXY_ROLLOUT_MAX_GROUPS": str(MAX_GROUPS),
        "RLPROXY_ROLLOUT_WATCH_SHARE": str(WATCH_SHARE),
        "RLPROXY_SCORING": "true",
        "RLPROXY_SCORING_INTERVAL_S": "0.5",
        "RLPROXY_GROUP_MIN_SIZE": str(GROUP_SIZE),
        "RLPROXY_JUDGE_MODEL": "openai/judge",
        "RLPROXY_JUDGE_API_BASE": judge.base_url,
        "RLPROXY_JUDGE_API_KEY_ENV": "FAKE_JUDGE_KEY",
        "FAKE_JUDGE_KEY": "sk-judge",
        "RLPROXY_JUDGE_TIMEOUT_S": "30",
    }
    data_dir = tmp_path_factory.mktemp("rollout-data")
    judge.data_dir = data_dir
    with own_server(data_dir, model_data_dir, env) as server:
        yield server


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Path:
    path = tmp_path_factory.mktemp("lora") / "lora"
    write_random_lora(model_data_dir, path)
    return path


def _publish(server: Server, lora: Path, version: int, parent: int | None) -> None:
    """Put a version in place as the trainer does (a temporary folder, then one rename)."""
    root = server.data_dir / "checkpoints" / "rlproxy"
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{version:04d}-test"
    shutil.copytree(lora, tmp)
    if parent is not None:
        (tmp / "trainer_state.json").write_text(json.dumps({"step": version, "parent": parent}))
    tmp.rename(root / f"{version:04d}")


def _listing(server: Server) -> dict[str, Any]:
    r = httpx.get(f"{server.url}/rl/adapters", timeout=30)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _adapter(server: Server, version: int) -> dict[str, Any]:
    return {a["version"]: a for a in _listing(server)["data"]}.get(version) or {}


def _wait(server: Server, what: str, test: Any, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        listing = _listing(server)
        if test(listing):
            return listing
        time.sleep(0.3)
    raise AssertionError(f"{what} did not happen: {json.dumps(_listing(server), indent=1)}")


def _call(client: OpenAI, server: Server, group: str) -> tuple[str, int]:
    """One single-turn run of a task (its own run tag), closed at once; (run tag, version)."""
    tag = uuid.uuid4().hex[:12]
    raw = client.chat.completions.with_raw_response.create(
        model="rlproxy",
        messages=[
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": f"Name a colour. [run-{tag}]"},
        ],
        max_tokens=3,
        temperature=1.0,
        extra_headers={"X-RLProxy-Group": group},
    )
    rows = db_rows(
        server.data_dir,
        "SELECT trajectory_id, adapter_version FROM calls WHERE request_id = ?",
        (raw.headers["x-request-id"],),
    )
    assert len(rows) == 1
    r = httpx.post(f"{server.url}/rl/trajectories/{rows[0]['trajectory_id']}/end", timeout=30)
    assert r.status_code == 200, r.text
    return tag, int(rows[0]["adapter_version"] or 0)


def _comes_true(condition: Any, within_s: float, poll_s: float = 0.1) -> bool:
    """Whether `condition()` holds within `within_s` seconds (True as soon as it does)."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def _run_groups_until(client: OpenAI, server: Server, done: Any, max_groups: int = 8) -> list[int]:
    """Send groups of GROUP_SIZE runs until `done(listing)`; the versions that served them."""
    versions: list[int] = []
    for _ in range(max_groups):
        group = f"g-{uuid.uuid4().hex[:8]}"
        versions += [_call(client, server, group)[1] for _ in range(GROUP_SIZE)]
        deadline = time.monotonic() + 20  # the group is scored, then the rollout looks
        while time.monotonic() < deadline:
            if done(_listing(server)):
                return versions
            scored = db_rows(
                server.data_dir,
                "SELECT status FROM groups WHERE key = ? AND source = 'explicit'",
                (group,),
            )
            if scored and scored[0]["status"] in ("scored", "failed"):
                # The rollout looks at the evidence on the publisher's polls (every 0.5 s): the
                # decision, if this group completes it, comes within a few of them; none by then
                # means the test wants more groups.
                if _comes_true(lambda: done(_listing(server)), within_s=3):
                    return versions
                break
            time.sleep(0.3)
    groups = db_rows(server.data_dir, "SELECT key, status, member_count, failure FROM groups")
    raise AssertionError(
        f"no decision after {max_groups} groups: {_listing(server)}\n"
        f"groups: {[dict(g) for g in groups]}\nlog: {server.log.read_text()[-3000:]}"
    )


@pytest.fixture(scope="module")
def client(rserver: Server) -> Iterator[OpenAI]:
    with OpenAI(base_url=rserver.base_url, api_key="sk-test", max_retries=0, timeout=300) as c:
        yield c


def test_a_published_version_starts_a_canary_and_a_judge_preferring_the_old_rolls_it_back(
    rserver: Server, client: OpenAI, judge: VersionJudge, lora: Path
) -> None:
    assert _listing(rserver)["rollout"]["enabled"] is True
    judge.prefer = 0  # the base model's answers win
    _publish(rserver, lora, 1, parent=0)
    listing = _wait(rserver, "canary of version 1", lambda d: d["rollout"]["canary"] == 1)
    v1 = {a["version"]: a for a in listing["data"]}[1]
    assert v1["canary"] is True and v1["active"] is False
    assert v1["rollout"]["state"] == "canary" and v1["rollout"]["baseline"] == 0

    versions = _run_groups_until(
        client, rserver, lambda d: _adapter_in(d, 1).get("status") == "rejected"
    )
    # the traffic was split: both versions served, each call stored with its version
    assert set(versions) == {0, 1}, versions
    v1 = _adapter(rserver, 1)
    assert v1["rollout"]["state"] == "rolled_back"
    decision = v1["rollout"]["decisions"][-1]
    assert decision["decision"] == "rolled_back"
    figures = decision["figures"]
    assert figures["groups"] >= MIN_GROUPS
    assert figures["mean_diff"] == pytest.approx(-0.8, abs=1e-6)  # 0.1 - 0.9 in every group
    assert figures["llr"] >= v1["rollout"]["test"]["roll_back_at_llr"]
    assert "harmful" in decision["reason"]
    assert "rolled back" in v1["error"]
    assert v1["active"] is False and v1["canary"] is False
    # the base serves everything again, and the publisher never takes version 1 back: what is
    # tested is that nothing happens, so the sleep stays (four of the publisher's 0.5 s polls,
    # any of which would have taken version 1 back)
    time.sleep(2)
    assert _listing(rserver)["rollout"]["canary"] is None
    after = [_call(client, rserver, f"after-{uuid.uuid4().hex[:6]}")[1] for _ in range(6)]
    assert after == [0] * 6
    assert _adapter(rserver, 1)["active"] is False


def test_a_judge_preferring_the_new_version_gets_it_promoted(
    rserver: Server, client: OpenAI, judge: VersionJudge, lora: Path
) -> None:
    judge.prefer = 2
    _publish(rserver, lora, 2, parent=0)  # trained from fresh weights, not from rejected 1
    _wait(rserver, "canary of version 2", lambda d: d["rollout"]["canary"] == 2)
    versions = _run_groups_until(client, rserver, lambda d: _adapter_in(d, 2).get("active"))
    assert set(versions) == {0, 2}, versions
    v2 = _adapter(rserver, 2)
    assert v2["status"] == "loaded" and v2["rollout"]["state"] == "promoted"
    figures = v2["rollout"]["decisions"][-1]["figures"]
    assert figures["mean_diff"] == pytest.approx(0.8, abs=1e-6)
    assert figures["llr"] <= v2["rollout"]["test"]["promote_at_llr"]
    assert figures["lower"] > 0  # the interval shown beside it
    assert v2["activated_at"] is not None
    # version 2 serves now, and the watch sends its share of conversations to the base
    assert _listing(rserver)["rollout"]["watch"]["on"] is True
    after = [_call(client, rserver, f"after2-{uuid.uuid4().hex[:6]}")[1] for _ in range(10)]
    assert set(after) <= {0, 2} and after.count(2) >= 3, after


def test_a_version_trained_from_a_rolled_back_one_is_never_served(
    rserver: Server, lora: Path
) -> None:
    _publish(rserver, lora, 3, parent=1)  # version 1 was rolled back above
    listing = _wait(
        rserver, "version 3 rejected", lambda d: _adapter_in(d, 3).get("status") == "rejected"
    )
    v3 = _adapter_in(listing, 3)
    assert "trained from version 1" in v3["error"]
    assert listing["rollout"]["canary"] is None
    assert _adapter_in(listing, 2)["active"] is True


def test_the_watch_rolls_back_a_promoted_version_that_turns_out_worse_than_the_base(
    rserver: Server, client: OpenAI, judge: VersionJudge
) -> None:
    """Version 2 was promoted on the judge's word; now the judge prefers the base's answers (as
    when rewards that were wrong are put right). The watch compares version 2 with the base on
    the groups holding both and rolls it back: the base serves again."""
    watch = _listing(rserver)["rollout"]["watch"]
    assert watch["share"] == WATCH_SHARE and watch["on"] is True
    judge.prefer = 0
    versions = _run_groups_until(
        client, rserver, lambda d: _adapter_in(d, 2).get("status") == "rejected"
    )
    assert set(versions) == {0, 2}, versions
    listing = _listing(rserver)
    v2 = _adapter_in(listing, 2)
    assert v2["rollout"]["state"] == "rolled_back" and v2["active"] is False
    decision = v2["rollout"]["decisions"][-1]
    assert decision["by"] == "watch" and decision["decision"] == "rolled_back"
    assert decision["figures"]["mean_diff"] == pytest.approx(-0.8, abs=1e-6)
    assert decision["figures"]["llr"] >= watch["roll_back_at_llr"]
    assert decision["figures"]["groups"] >= MIN_GROUPS
    assert "rolled back with version 2" in v2["error"]
    assert listing["rollout"]["watch"]["on"] is False  # the base serves: nothing to watch
    after = [_call(client, rserver, f"after4-{uuid.uuid4().hex[:6]}")[1] for _ in range(4)]
    assert after == [0] * 4


def _adapter_in(listing: dict[str, Any], version: int) -> dict[str, Any]:
    return {a["version"]: a for a in listing["data"]}.get(version) or {}


def test_with_the_setting_off_a_new_version_serves_everything_at_once(
    tmp_path: Path, model_data_dir: Path, lora: Path
) -> None:
    env = {
        "RLPROXY_PUBLISH_ADAPTERS": "true",
        "RLPROXY_ROLLOUT": "false",
        "RLPROXY_ADAPTER_POLL_S": "0.5",
        "RLPROXY_FORGETTING_CHECK": "false",  # as above: the random LoRA would be held
    }
    with own_server(tmp_path / "data", model_data_dir, env) as server:
        assert _listing(server)["rollout"] == {"enabled": False}
        _publish(server, lora, 1, parent=None)
        listing = _wait(server, "version 1 active", lambda d: _adapter_in(d, 1).get("active"))
        v1 = _adapter_in(listing, 1)
        assert v1["canary"] is False and v1["rollout"] is None
        with OpenAI(base_url=server.base_url, api_key="sk-test", max_retries=0) as c:
            served = [_call(c, server, "off")[1] for _ in range(4)]
        assert served == [1] * 4
