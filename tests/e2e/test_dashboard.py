"""The dashboard in a real browser (headless Chromium) against a real server with real traffic.

The server scores groups in the background with a scripted fake judge on loopback (a paid judge
cannot run here; see fake_judge.py) and publishes adapter versions as the trainer writes them.
The traffic: two groups of three runs with explicit trajectory ids, group keys and rewards, one
run with a tool call, sent with the `openai` client; between the groups two adapter versions
appear the way the trainer writes them (recorded with step metrics, folders renamed into place),
so the first group is served by the base model and the second by v2. Then each page must show
that data, with no console error, on a desktop and on a 375 px phone screen, and rolling back
from the adapters page must change what the policy name serves. A second server on a fresh data
directory shows the empty states, then, once API keys exist, asks for a key and shows a 403.

Screenshots are kept under the pytest temporary directory (the path is printed at the end).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import Server
from tests.e2e.fake_judge import FakeJudge, FakeJudgeServer
from tests.e2e.helpers import own_server
from tests.e2e.test_adapters import write_random_lora
from tests.required import missing


@pytest.fixture(scope="session", autouse=True)  # session: before any server is started
def chromium_binary() -> str:
    """The browser; without it the tests skip, or fail in CI (tests/required.py)."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        missing(
            "no Chromium",
            "the dashboard's browser tests need Debian's `chromium` package "
            "(`apt-get install -y chromium`; `make setup` installs it when run as root)",
        )
    return binary


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city now.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                "required": ["city"],
            },
        },
    }
]
TOOL_RESULT = "18 °C and sunny"
THOUGHT = "Paris: ask the weather tool."
BASE_REWARDS = (0.2, 0.5, 0.8)
V2_REWARDS = (0.6, 0.7, 0.9)
JUDGE_SCORES = (0.3, 0.6, 0.9)
PHONE = {"width": 375, "height": 812}
DESKTOP = {"width": 1280, "height": 900}


# --------------------------------------------------------------------------- the browser


@dataclass
class Browser:
    """Chromium through Playwright; pages that record console errors; a screenshot folder."""

    browser: Any
    shots: Path
    pages: list[tuple[Any, list[str]]] = field(default_factory=list)

    def page(self, viewport: dict[str, int] = DESKTOP) -> Any:
        context = self.browser.new_context(viewport=viewport)
        page = context.new_page()
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
        page.set_default_timeout(30_000)
        self.pages.append((page, errors))
        return page

    def errors(self, page: Any) -> list[str]:
        return next(errs for p, errs in self.pages if p is page)

    def shoot(self, page: Any, name: str) -> Path:
        path = self.shots / f"{name}.png"
        page.screenshot(path=str(path), full_page=True)
        return path


@pytest.fixture(scope="module")
def browser(
    tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config, chromium_binary: str
) -> Iterator[Browser]:
    from playwright.sync_api import sync_playwright

    shots = tmp_path_factory.mktemp("dashboard-screenshots")
    with sync_playwright() as pw:
        # Playwright's own browser download cannot work here: Debian's Chromium runs instead.
        chromium = pw.chromium.launch(executable_path=chromium_binary)
        try:
            yield Browser(chromium, shots)
        finally:
            chromium.close()
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():  # shown without -s too
        print(f"\ndashboard screenshots: {shots}")


def no_console_errors(browser: Browser, page: Any, allowed: Callable[[str], bool] = bool) -> None:
    unexpected = [e for e in browser.errors(page) if allowed is bool or not allowed(e)]
    assert unexpected == [], f"console errors: {unexpected}"


def goto(page: Any, server: Server, view: str, ready: str) -> None:
    page.goto(f"{server.url}/dashboard#/{view}")
    page.wait_for_selector(ready)


def no_horizontal_overflow(page: Any) -> None:
    widths = page.evaluate(
        "() => [document.documentElement.scrollWidth, document.body.scrollWidth, innerWidth]"
    )
    assert max(widths[:2]) <= widths[2], f"page wider than the screen: {widths}"


# --------------------------------------------------------------------------- the server and traffic


@pytest.fixture(scope="module")
def judge() -> Iterator[FakeJudge]:
    with FakeJudgeServer() as fake:
        yield fake


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Path:
    path = tmp_path_factory.mktemp("dashboard-lora") / "lora"
    write_random_lora(model_data_dir, path)
    return path


@pytest.fixture(scope="module")
def dserver(
    tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path, judge: FakeJudge
) -> Iterator[Server]:
    env = {
        "RLPROXY_SCORING": "true",
        "RLPROXY_SCORING_INTERVAL_S": "0.5",
        "RLPROXY_GROUP_MIN_SIZE": "3",
        "RLPROXY_JUDGE_MODEL": "openai/judge",
        "RLPROXY_JUDGE_API_BASE": judge.base_url,
        "RLPROXY_JUDGE_API_KEY_ENV": "FAKE_JUDGE_KEY",
        "FAKE_JUDGE_KEY": "sk-judge",
        # Members with explicit rewards are judged too, so a group shows both side by side.
        "RLPROXY_JUDGE_EXPLICIT_GROUPS": "true",
        "RLPROXY_PUBLISH_ADAPTERS": "true",
        "RLPROXY_ROLLOUT": "false",  # each version serves at once (the guard: test_rollout.py)
        "RLPROXY_ADAPTER_POLL_S": "0.5",
        # The tests' random LoRA is word salad by the forgetting check's measure: it would be
        # held. This suite is about the pages; the check's: test_forgetting.py.
        "RLPROXY_FORGETTING_CHECK": "false",
    }
    with own_server(tmp_path_factory.mktemp("dashboard-data"), model_data_dir, env) as server:
        yield server


@dataclass(frozen=True)
class Traffic:
    base_group: str
    v2_group: str
    tool_trajectory: str
    base_trajectories: list[str]


def _judge_reply() -> str:
    return json.dumps(
        {
            "scores": [
                {"trajectory_id": str(i + 1), "explanation": f"member {i + 1} is fine", "score": s}
                for i, s in enumerate(JUDGE_SCORES)
            ]
        }
    )


def _chat(client: OpenAI, tid: str, group: str, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return client.chat.completions.create(
        model="rlproxy",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=kw.pop("max_tokens", 8),
        temperature=0.7,
        extra_headers={"X-RLProxy-Trajectory": tid, "X-RLProxy-Group": group},
        **kw,
    )


def _tool_run(client: OpenAI, tid: str, group: str) -> None:
    """Two turns: a forced tool call, then the answer after the tool's result (the call sent
    back with the reasoning a client may keep beside it, `reasoning_content`)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You answer questions about the weather."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    forced = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    first = _chat(client, tid, group, messages, max_tokens=32, **forced)
    calls = first.choices[0].message.tool_calls or []
    assert calls, first
    messages.append(
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": THOUGHT,
            "tool_calls": [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in calls
            ],
        }
    )
    messages += [{"role": "tool", "tool_call_id": c.id, "content": TOOL_RESULT} for c in calls]
    _chat(client, tid, group, messages, tools=TOOLS)


def _plain_run(client: OpenAI, tid: str, group: str, question: str) -> None:
    _chat(client, tid, group, [{"role": "user", "content": question}])


def _reward(server: Server, tid: str, reward: float) -> None:
    r = httpx.post(
        f"{server.url}/rl/trajectories/{tid}/reward",
        json={"reward": reward, "source": "env"},
        timeout=30,
    )
    assert r.status_code == 200, r.text


def _wait(what: str, check: Callable[[], Any], timeout_s: float = 180) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def _scored_group(server: Server, key: str) -> str | None:
    r = httpx.get(f"{server.url}/rl/groups", params={"status": "scored"}, timeout=30)
    return next((g["id"] for g in r.json()["data"] if g["key"] == key), None)


async def _record_versions(data_dir: Path, versions: list[int]) -> None:
    """Record versions with step metrics, as the trainer's loop does after writing each."""
    from storage import Store
    from storage.records import AdapterRecord

    store = await Store.open(f"sqlite+aiosqlite:///{data_dir / 'rlproxy.db'}")
    try:
        for v in versions:
            now = time.time()
            metrics = {"loss": 0.05 / v, "mean_reward": 0.4 + 0.1 * v, "groups": 4}
            metrics |= {"tokens_per_s": 150.0 + v, "step_seconds": 9.5}
            metrics |= {"groups_trained_total": 4 * v, "stale_dropped_total": v}
            metrics |= {"stale_downweighted_total": 0, "stale_dropped": 1, "staleness_max": 5}
            path = data_dir / "checkpoints" / "rlproxy" / f"{v:04d}"
            await store.record_adapter(AdapterRecord("rlproxy", v, str(path), "written", now, now))
            await store.update_adapter("rlproxy", v, metrics=metrics)
    finally:
        await store.close()


def publish(lora: Path, data_dir: Path, versions: list[int]) -> None:
    """Versions appear as the trainer writes them: recorded, then renamed into place."""
    asyncio.run(_record_versions(data_dir, versions))
    root = data_dir / "checkpoints" / "rlproxy"
    root.mkdir(parents=True, exist_ok=True)
    for v in versions:
        tmp = root / f".tmp-{v:04d}-test"
        shutil.copytree(lora, tmp)
        os.rename(tmp, root / f"{v:04d}")


@pytest.fixture(scope="module")
def traffic(dserver: Server, judge: FakeJudge, lora: Path) -> Traffic:
    judge.reply(_judge_reply()).reply(_judge_reply())
    run = uuid.uuid4().hex[:6]
    base_group, v2_group = f"dash-base-{run}", f"dash-v2-{run}"
    base = [f"dash-{run}-base-{i}" for i in range(3)]
    v2 = [f"dash-{run}-v2-{i}" for i in range(3)]
    with (
        OpenAI(base_url=dserver.base_url, api_key="sk-test", max_retries=0, timeout=300) as client,
        ThreadPoolExecutor(max_workers=3) as pool,
    ):
        jobs = [pool.submit(_tool_run, client, base[0], base_group)]
        jobs += [
            pool.submit(_plain_run, client, tid, base_group, q)
            for tid, q in zip(base[1:], ("Name a colour.", "Name a fruit."), strict=True)
        ]
        for job in jobs:
            job.result()
        for tid, reward in zip(base, BASE_REWARDS, strict=True):
            _reward(dserver, tid, reward)

        publish(lora, dserver.data_dir, [1, 2])
        _wait("v2 to serve", lambda: _health(dserver)["active_version"] == 2)

        questions = ("Name an animal.", "Name a city.", "Name a tree.")
        for job in [
            pool.submit(_plain_run, client, tid, v2_group, q)
            for tid, q in zip(v2, questions, strict=True)
        ]:
            job.result()
        for tid, reward in zip(v2, V2_REWARDS, strict=True):
            _reward(dserver, tid, reward)
    base_id = _wait("the base group to be scored", lambda: _scored_group(dserver, base_group))
    v2_id = _wait("the v2 group to be scored", lambda: _scored_group(dserver, v2_group))
    return Traffic(base_id, v2_id, base[0], base)


def _health(server: Server) -> dict[str, Any]:
    return dict(httpx.get(f"{server.url}/health", timeout=30).json())


# --------------------------------------------------------------------------- pages with data


def test_overview_plots_reward_per_version_with_error_bars(
    dserver: Server, traffic: Traffic, browser: Browser
) -> None:
    page = browser.page()
    goto(page, dserver, "overview", "#reward-chart .point")
    points = page.eval_on_selector_all(
        "#reward-chart g.point",
        "els => els.map(e => [Number(e.dataset.version), e.dataset.source, Number(e.dataset.mean),"
        " Number(e.dataset.n), e.querySelectorAll('line.err').length])",
    )
    by = {(v, source): (mean, n, bars) for v, source, mean, n, bars in points}
    assert set(by) == {(0, "explicit"), (2, "explicit"), (0, "ruler"), (2, "ruler")}
    assert by[0, "explicit"][:2] == (pytest.approx(sum(BASE_REWARDS) / 3), 3)
    assert by[2, "explicit"][:2] == (pytest.approx(sum(V2_REWARDS) / 3), 3)
    assert by[2, "ruler"][:2] == (pytest.approx(sum(JUDGE_SCORES) / 3), 3)
    assert all(bars == 3 for _, _, bars in by.values())  # a whisker and two caps each
    assert page.inner_text("#active-version .figure") == "v2"
    assert "rlproxy@2" in page.inner_text("#active-version")
    assert int(page.inner_text("#calls-total .figure")) >= 7
    assert page.locator("#calls-chart rect.bar").count() >= 1
    assert page.inner_text("#trainer .figure") == "off"  # this server runs no trainer
    # the newest version's run counts: 2 of 10 usable groups dropped for staleness
    assert page.inner_text("#stale-groups") == "stale: 2 of 10 usable groups dropped (20 %)"
    stale = httpx.get(f"{dserver.url}/rl/stats", timeout=30).json()["trainer"]["stale_groups"]
    assert stale == {"trained": 8, "dropped": 2, "downweighted": 0, "dropped_share": 0.2}
    assert "openai/judge" in page.inner_text("#judge")
    # The engine's prefix cache: the share of prompt tokens its later turns did not prefill.
    cache = _health(dserver)["engine"]["prefix_cache"]
    assert cache["enabled"] and cache["hit_tokens"] > 0
    assert page.inner_text("#prefix-cache .figure").endswith("%")
    assert "prompt tokens came from the cache" in page.inner_text("#prefix-cache")
    assert page.inner_text("#health").startswith("rlproxy")
    browser.shoot(page, "overview")
    no_console_errors(browser, page)


def test_group_page_shows_members_side_by_side_with_scores_and_rewards(
    dserver: Server, traffic: Traffic, browser: Browser
) -> None:
    page = browser.page()
    goto(page, dserver, "groups", f'#groups-table tr[data-id="{traffic.base_group}"]')
    page.click(f'#groups-table tr[data-id="{traffic.base_group}"] a')
    page.wait_for_selector("#members article.member")
    members = page.locator("#members article.member")
    assert members.count() == 3
    texts = [members.nth(i).inner_text() for i in range(3)]
    for i, text in enumerate(texts):
        assert f"member {i + 1} is fine" in text
        assert str(JUDGE_SCORES[i]) in text
        assert str(BASE_REWARDS[i]) in text  # the explicit reward beside the judge's score
    boxes = [members.nth(i).bounding_box() for i in range(3)]
    assert len({round(b["y"]) for b in boxes}) == 1  # side by side on a desktop screen
    assert boxes[0]["x"] < boxes[1]["x"] < boxes[2]["x"]
    browser.shoot(page, "group")
    no_console_errors(browser, page)


def test_trajectory_viewer_shows_turns_tool_calls_tokens_versions_and_rewards(
    dserver: Server, traffic: Traffic, browser: Browser
) -> None:
    page = browser.page()
    goto(page, dserver, f"trajectories/{traffic.tool_trajectory}", "#turns article.turn")
    turns = page.locator("#turns article.turn")
    assert turns.count() == 2
    first, second = turns.nth(0).inner_text(), turns.nth(1).inner_text()
    assert "get_weather" in first and "Paris" in first and "What is the weather" in first
    assert "TOOL RESULT" in second.upper() and TOOL_RESULT in second
    # shown with the answer it was sent back beside: the first turn's tool call
    reasoning = turns.nth(0).locator("details.reasoning")
    assert "reasoning sent back" in reasoning.inner_text()
    assert reasoning.locator("pre").text_content() == THOUGHT
    assert "prompt +" in first and "completion tokens" in first
    assert [turns.nth(i).get_attribute("data-version") for i in range(2)] == ["0", "0"]
    assert "base" in first
    assert str(BASE_REWARDS[0]) in page.inner_text("#rewards")
    browser.shoot(page, "trajectory")

    goto(page, dserver, "trajectories", "#trajectories-table")
    for tid in traffic.base_trajectories:
        assert page.locator(f'#trajectories-table tr[data-id="{tid}"]').count() == 1
    no_console_errors(browser, page)


def test_every_page_fits_a_phone_screen(
    dserver: Server, traffic: Traffic, browser: Browser
) -> None:
    page = browser.page(PHONE)
    views = [
        ("overview", "#reward-chart"),
        ("groups", "#groups-table"),
        (f"groups/{traffic.base_group}", "#members article.member"),
        ("trajectories", "#trajectories-table"),
        (f"trajectories/{traffic.tool_trajectory}", "#turns article.turn"),
        ("adapters", "#adapters-table"),
    ]
    for view, ready in views:
        goto(page, dserver, view, ready)
        no_horizontal_overflow(page)
        browser.shoot(page, "phone-" + view.split("/")[0] + ("-detail" if "/" in view else ""))
    no_console_errors(browser, page)


def test_rolling_back_from_the_adapters_page_changes_what_the_policy_serves(
    dserver: Server, traffic: Traffic, browser: Browser
) -> None:
    page = browser.page()
    goto(page, dserver, "adapters", '#adapters-table tr[data-version="1"] button')
    row = page.locator('#adapters-table tr[data-version="2"]')
    assert "serving" in row.inner_text() and "0.025" in row.inner_text()  # v2's step loss
    page.once("dialog", lambda dialog: dialog.accept())
    page.click('#adapters-table tr[data-version="1"] button')
    page.wait_for_selector("#notice:has-text('now serves v1')")
    page.wait_for_selector('#adapters-table tr[data-version="1"] .pill.ok')
    browser.shoot(page, "adapters-after-rollback")

    assert _health(dserver)["active_version"] == 1
    served = [m["id"] for m in httpx.get(f"{dserver.base_url}/models", timeout=30).json()["data"]]
    assert "rlproxy@1" in served
    tid = f"after-rollback-{uuid.uuid4().hex[:6]}"
    with OpenAI(base_url=dserver.base_url, api_key="sk-test", max_retries=0, timeout=300) as c:
        _plain_run(c, tid, "after-rollback", "Say hi.")
    detail = httpx.get(f"{dserver.url}/rl/trajectories/{tid}", timeout=30).json()
    assert [t["adapter_version"] for t in detail["turns"]] == [1]
    no_console_errors(browser, page)


# --------------------------------------------------------------------------- a fresh data dir


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Iterator[Server]:
    env = {"RLPROXY_KEY_REFRESH_S": "0.5"}
    with own_server(tmp_path_factory.mktemp("dashboard-fresh"), model_data_dir, env) as server:
        yield server


def test_a_fresh_data_dir_shows_an_empty_state_on_every_page(
    fresh: Server, browser: Browser
) -> None:
    page = browser.page(PHONE)
    goto(page, fresh, "overview", "#empty-overview")
    assert page.is_visible("#reward-empty") and page.is_visible("#calls-empty")
    assert page.inner_text("#active-version .figure") == "base"
    browser.shoot(page, "empty-overview")
    for view in ("groups", "trajectories", "adapters"):
        goto(page, fresh, view, f"#{view}-empty")
        no_horizontal_overflow(page)
    no_console_errors(browser, page)


RLPROXY = [sys.executable, "-m", "proxy.cli"]


def _make_key(data_dir: Path, scope: str) -> str:
    args = ["keys", "create", "--name", scope, "--scope", scope, "--data-dir", str(data_dir)]
    done = subprocess.run(
        [*RLPROXY, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout.strip()


def test_with_api_keys_the_page_asks_for_one_and_shows_a_403(
    fresh: Server, browser: Browser, lora: Path
) -> None:
    """Runs after the empty-state test: it gives the fresh server keys and a version."""
    shutil.copytree(lora, fresh.data_dir / "checkpoints" / "rlproxy" / "0001")
    inference, admin = _make_key(fresh.data_dir, "inference"), _make_key(fresh.data_dir, "admin")
    _wait("keys to be on", lambda: httpx.get(f"{fresh.url}/rl/stats").status_code == 401, 30)

    page = browser.page()
    page.goto(f"{fresh.url}/dashboard#/adapters")
    page.wait_for_selector("#key-form:not([hidden])")
    assert "needs an API key" in page.inner_text("#key-form")
    page.fill("#key-input", inference)
    page.click("#key-form button")
    page.wait_for_selector('#adapters-table tr[data-version="1"] button')
    assert page.evaluate("() => Object.values(localStorage)") == [inference]
    page.once("dialog", lambda dialog: dialog.accept())
    page.click('#adapters-table tr[data-version="1"] button')
    page.wait_for_selector("#notice.error:has-text('admin')")
    assert _health(fresh)["active_version"] is None

    page.click("#forget-key")
    page.wait_for_selector("#key-form:not([hidden])")
    page.fill("#key-input", admin)
    page.click("#key-form button")
    page.once("dialog", lambda dialog: dialog.accept())
    page.click('#adapters-table tr[data-version="1"] button')
    page.wait_for_selector("#notice:has-text('now serves v1')")
    assert _health(fresh)["active_version"] == 1
    browser.shoot(page, "keys-admin-activated")
    # The browser reports each refused request (401 without a key, 403 for the inference key).
    no_console_errors(browser, page, lambda e: "status of 401" in e or "status of 403" in e)
