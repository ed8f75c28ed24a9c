"""API keys and scopes, end to end: `rlproxy keys` makes keys, a real server on loopback checks
them, and the real `openai` SDK sees OpenAI's 401/403 shapes as its typed exceptions.

With keys defined: every route but /health needs one; an inference key reaches /v1 and only its
own trajectories and groups; admin routes need an admin key; a key never continues another
key's trajectory, by explicit id or by matching messages. Without keys the server refuses to
listen beyond loopback unless told it may.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from proxy.api.app import UnsafeExposure, check_exposure
from proxy.api.auth import KeyRing
from proxy.settings import Settings
from storage import Store
from tests.e2e.conftest import Server, free_port
from tests.e2e.helpers import db_rows, own_server

SHORT = {"max_tokens": 4, "temperature": 0}


def rlproxy(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", *args, "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def make_key(data_dir: Path, name: str, scope: str) -> str:
    done = rlproxy(data_dir, "keys", "create", "--name", name, "--scope", scope)
    assert done.returncode == 0, done.stderr
    key = done.stdout.strip()
    assert key.startswith("rlp-") and "only time" in done.stderr
    return key


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Iterator[dict]:
    data_dir = tmp_path_factory.mktemp("auth-data")
    keys = {
        "alice": make_key(data_dir, "alice", "inference"),
        "bob": make_key(data_dir, "bob", "inference"),
        "admin": make_key(data_dir, "ops", "admin"),
    }
    with own_server(data_dir, model_data_dir, {"RLPROXY_KEY_REFRESH_S": "0.5"}) as server:
        yield {"server": server, **keys}


def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=120)


def ask(server: Server, key: str, text: str, **extra: object):
    with client(server, key) as c:
        return c.chat.completions.create(
            model="rlproxy",
            messages=[{"role": "user", "content": text}],
            **SHORT,
            **extra,  # type: ignore[arg-type]
        )


def test_a_missing_or_wrong_key_is_openais_401(keyed: dict) -> None:
    server = keyed["server"]
    for key in ("sk-not-an-rlproxy-key", keyed["alice"][:-4] + "0000"):
        with pytest.raises(openai.AuthenticationError) as err:
            ask(server, key, "hi")
        assert err.value.status_code == 401
        assert err.value.code == "invalid_api_key"
        assert key not in err.value.message  # masked, never echoed whole
    r = httpx.post(f"{server.base_url}/chat/completions", json={"model": "rlproxy"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_api_key"


def test_health_is_open_and_everything_else_needs_a_key(keyed: dict) -> None:
    server = keyed["server"]
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    # Without a key: the status only; the details (engine, storage, trainer log) are an admin's.
    assert not {"engine", "storage", "trainer"} & set(health.json())
    admin = {"Authorization": f"Bearer {keyed['admin']}"}
    assert {"engine", "storage", "trainer"} <= set(
        httpx.get(f"{server.url}/health", headers=admin).json()
    )
    alice = {"Authorization": f"Bearer {keyed['alice']}"}
    assert "trainer" not in httpx.get(f"{server.url}/health", headers=alice).json()
    for path in ("/v1/models", "/rl/trajectories", "/rl/groups", "/no/such/route", "/docs"):
        assert httpx.get(f"{server.url}{path}").status_code == 401, path
    # A valid key on an unknown path: now it is an honest 404.
    headers = {"Authorization": f"Bearer {keyed['alice']}"}
    assert httpx.get(f"{server.url}/no/such/route", headers=headers).status_code == 404


def test_an_inference_key_cannot_use_admin_routes(keyed: dict) -> None:
    server = keyed["server"]
    alice = {"Authorization": f"Bearer {keyed['alice']}"}
    admin = {"Authorization": f"Bearer {keyed['admin']}"}
    for method, path in (
        ("POST", "/rl/adapters/0/activate"),
        ("POST", "/rl/groups/x/score"),
        ("GET", "/docs"),
        ("GET", "/openapi.json"),
    ):
        r = httpx.request(method, f"{server.url}{path}", headers=alice)
        assert r.status_code == 403, (method, path)
        assert r.json()["error"]["code"] == "permission_denied"
    assert httpx.get(f"{server.url}/openapi.json", headers=admin).status_code == 200
    assert httpx.get(f"{server.url}/rl/adapters", headers=alice).status_code == 200
    rl = openai.OpenAI(base_url=f"{server.url}/rl", api_key=keyed["alice"], max_retries=0)
    with rl, pytest.raises(openai.PermissionDeniedError):
        rl.post("/adapters/0/activate", cast_to=httpx.Response, body={})


def test_a_key_sees_and_continues_only_its_own_trajectories(keyed: dict) -> None:
    server = keyed["server"]
    ask(server, keyed["alice"], "alice's task", extra_headers={"X-RLProxy-Trajectory": "t-alice"})
    ask(server, keyed["bob"], "bob's task", extra_headers={"X-RLProxy-Trajectory": "t-bob"})

    def ids(key: str) -> set[str]:
        r = httpx.get(
            f"{server.url}/rl/trajectories",
            params={"limit": 500},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert r.status_code == 200
        return {t["id"] for t in r.json()["data"]}

    assert "t-alice" in ids(keyed["alice"]) and "t-bob" not in ids(keyed["alice"])
    assert "t-bob" in ids(keyed["bob"]) and "t-alice" not in ids(keyed["bob"])
    assert {"t-alice", "t-bob"} <= ids(keyed["admin"])

    bob = {"Authorization": f"Bearer {keyed['bob']}"}
    assert httpx.get(f"{server.url}/rl/trajectories/t-alice", headers=bob).status_code == 404
    for action, body in (("reward", {"reward": 1.0}), ("end", None)):
        r = httpx.post(f"{server.url}/rl/trajectories/t-alice/{action}", json=body, headers=bob)
        assert r.status_code == 404, action
    # Naming alice's trajectory in a call: refused before any token is generated.
    with pytest.raises(openai.PermissionDeniedError):
        ask(server, keyed["bob"], "sneak in", extra_headers={"X-RLProxy-Trajectory": "t-alice"})
    rows = db_rows(
        server.data_dir,
        "SELECT turn_count, owner_key_id FROM trajectories WHERE id=?",
        ("t-alice",),
    )
    assert rows[0]["turn_count"] == 1
    alice_id = keyed["alice"].split("-")[1]
    assert rows[0]["owner_key_id"] == alice_id
    # The stored caller is the key's id; no key secret is anywhere in the database file.
    calls = db_rows(
        server.data_dir, "SELECT api_key_id FROM calls WHERE trajectory_id=?", ("t-alice",)
    )
    assert [c["api_key_id"] for c in calls] == [alice_id]
    raw = b"".join(p.read_bytes() for p in server.data_dir.glob("rlproxy.db*"))
    for key in (keyed["alice"], keyed["bob"], keyed["admin"]):
        assert key.split("-")[2].encode() not in raw


def test_matching_messages_never_link_across_keys(keyed: dict) -> None:
    """Bob sends a history that continues alice's conversation word for word: without keys it
    would join her trajectory; with keys it starts bob's own."""
    server = keyed["server"]
    first = ask(server, keyed["alice"], "a shared opening line")
    answer = first.choices[0].message.content or ""
    history = [
        {"role": "user", "content": "a shared opening line"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "and then?"},
    ]
    with client(server, keyed["bob"]) as c:
        second = c.chat.completions.create(model="rlproxy", messages=history, **SHORT)  # type: ignore[arg-type]
    rows = db_rows(
        server.data_dir,
        "SELECT c.completion_id, t.id, t.owner_key_id, t.turn_count FROM calls c "
        "JOIN trajectories t ON t.id = c.trajectory_id WHERE c.completion_id IN (?, ?)",
        (first.id, second.id),
    )
    by_completion = {r["completion_id"]: r for r in rows}
    assert by_completion[first.id]["id"] != by_completion[second.id]["id"]
    assert by_completion[first.id]["turn_count"] == 1
    assert by_completion[second.id]["owner_key_id"] == keyed["bob"].split("-")[1]
    # The same continuation from alice does join her trajectory.
    with client(server, keyed["alice"]) as c:
        third = c.chat.completions.create(model="rlproxy", messages=history, **SHORT)  # type: ignore[arg-type]
    rows = db_rows(
        server.data_dir, "SELECT trajectory_id FROM calls WHERE completion_id=?", (third.id,)
    )
    assert rows[0]["trajectory_id"] == by_completion[first.id]["id"]


def test_anthropic_clients_send_their_key_as_x_api_key(keyed: dict) -> None:
    server = keyed["server"]
    with anthropic.Anthropic(base_url=server.url, api_key=keyed["alice"], max_retries=0) as c:
        message = c.messages.create(
            model="rlproxy", max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
        )
        assert message.id.startswith("msg_")
    with (
        anthropic.Anthropic(base_url=server.url, api_key="sk-nope", max_retries=0) as c,
        pytest.raises(anthropic.AuthenticationError) as err,
    ):
        c.messages.create(
            model="rlproxy", max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
        )
    assert err.value.body["type"] == "error"  # Anthropic's shape on its paths
    assert err.value.body["error"]["type"] == "authentication_error"
    # a message id names its trajectory for its own key only
    bob = httpx.post(
        f"{server.url}/rl/trajectories/{message.id}/reward",
        json={"reward": 1.0},
        headers={"authorization": f"Bearer {keyed['bob']}"},
    )
    assert bob.status_code == 404
    alice = httpx.post(
        f"{server.url}/rl/trajectories/{message.id}/reward",
        json={"reward": 1.0},
        headers={"x-api-key": keyed["alice"]},
    )
    assert alice.status_code == 200, alice.text


def test_a_key_reads_and_continues_only_its_own_responses(keyed: dict) -> None:
    server = keyed["server"]
    with client(server, keyed["alice"]) as alice, client(server, keyed["bob"]) as bob:
        mine = alice.responses.create(model="rlproxy", input="Hi", max_output_tokens=2)
        assert alice.responses.retrieve(mine.id).id == mine.id
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.input_items.list(mine.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.delete(mine.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.create(
                model="rlproxy", input="Go on", previous_response_id=mine.id, max_output_tokens=2
            )
        alice.responses.create(
            model="rlproxy", input="Go on", previous_response_id=mine.id, max_output_tokens=2
        )
    with client(server, keyed["admin"]) as admin:
        assert admin.responses.retrieve(mine.id).id == mine.id  # an admin reads every key's


def test_a_revoked_key_stops_working_without_a_restart(keyed: dict) -> None:
    server = keyed["server"]
    key = make_key(server.data_dir, "temp", "inference")
    assert ask(server, key, "hello").choices  # picked up (unknown id: early refresh)
    done = rlproxy(server.data_dir, "keys", "revoke", key.split("-")[1])
    assert done.returncode == 0, done.stderr
    deadline = time.monotonic() + 30  # the server re-reads keys every 0.5 s here
    while time.monotonic() < deadline:
        try:
            ask(server, key, "hello")
        except openai.AuthenticationError as err:
            assert "revoked" in err.message
            break
        time.sleep(0.2)
    else:
        pytest.fail("a revoked key kept working")
    listing = rlproxy(server.data_dir, "keys", "list")
    assert "temp" in listing.stdout and key.split("-")[2] not in listing.stdout


async def test_no_keys_means_loopback_only(tmp_path: Path) -> None:
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}")
    try:
        keys = KeyRing()
        await keys.open(store)
        check_exposure(Settings(host="127.0.0.1"), keys)
        with pytest.raises(UnsafeExposure, match="keys create"):
            check_exposure(Settings(host="0.0.0.0"), keys)
        check_exposure(Settings(host="0.0.0.0", insecure_no_auth=True), keys)  # warns only
        await store.create_api_key("ops", "admin")
        await keys.open(store)
        check_exposure(Settings(host="0.0.0.0"), keys)
        # Revoking every key keeps authentication on: revoked keys still count.
        for k in await store.list_api_keys():
            await store.revoke_api_key(k.id)
        await keys.open(store)
        assert keys.enabled
    finally:
        await store.close()


def test_serve_refuses_a_public_bind_without_keys(tmp_path: Path, model_data_dir: Path) -> None:
    env = {
        **os.environ,
        "RLPROXY_DATA_DIR": str(tmp_path),
        "RLPROXY_MODEL_DIR": str(model_data_dir),
        "RLPROXY_TRAIN": "false",
        "RLPROXY_SCORING": "false",
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "proxy.cli",
            "serve",
            "--host",
            "0.0.0.0",
            "--port",
            str(free_port()),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode != 0
    assert "refusing to listen on 0.0.0.0 with no API keys" in done.stdout + done.stderr
