"""The coding-agent CLIs, run as their users run them against a real `rlproxy serve`: Claude Code
(`claude -p`), Codex (`codex exec`), OpenCode (`opencode run`) and pi (`pi -p`).

Each CLI is installed from npm at a pinned version, once, into a cache outside the checkout
(`~/.cache/rlproxy/cli/<name>-<version>`, or RLPROXY_CLI_CACHE); the npm registry is needed only
then. Each run gets a throw-away HOME (and CODEX_HOME) under the test's folder, an environment
built from nothing (no key or config of the machine's user leaks in), the CLI's update checks and
telemetry switched off, and only the settings docs/quickstart/coding-agents.md gives a user. The
task is "Reply with the word hello."; a run passes when the CLI exits 0, prints an answer, and the
server stored its calls in order: one trajectory per session, its turns in order, each turn's
request the previous request plus the answer that came back, and the answer the CLI printed as
the last turn's. A CLI's side calls (OpenCode's title) are trajectories of their own.

Which model: pi's prompt (~1,500 tokens) and OpenCode's (~7,700) fit the embedded SmolLM2-135M's
8,192-token context and run on it. Claude Code's (~12,500) and Codex's (~9,200) do not; they run
on a tiny random Qwen2-style model built here with a 65,536-token context (tests/tiny_models.py),
whose output head is set so that an answer is a few words and ends: a plain random model samples
its ~49k tokens uniformly and runs to the budget, which Claude Code retries and Codex reports as
an error (docs/quickstart/coding-agents.md). The same model serves a session of two calls per CLI
(the task, then the CLI's own resume flag with a second message), which must stay one trajectory.

Sessions that use tools run on a third model, scripted by hand (tests/scripted_model.py): asked
to read notes.txt and run a shell command, each CLI calls its file reader (Codex: its shell),
then its shell tool, then answers; the model writes each call only once the result before it is
in its prompt, so the stored turns show the tools ran. Each CLI runs with its tools allowed as
the quickstart says (Claude Code `--allowedTools`, Codex with no sandbox, OpenCode's
`permission`; pi runs its tools as it is).

Without node and npm, or with a CLI whose binary cannot run on this machine (a native binary npm
has none for), the tests skip with the reason and how to run them, never pass; in CI (`CI` set,
as `.ci/run` does) they fail instead (tests/required.py). One server runs at a time (each class
has its own).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Server
from tests.e2e.helpers import calls_of, get_trajectory, list_trajectories, own_server
from tests.required import missing
from tests.scripted_model import build_scripted_model, hermes_call, marker_tokens
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.coding_agents

TASK = "Reply with the word hello."
FOLLOW_UP = "Now reply with the word bye."
KEY = "sk-test"  # rlproxy serves without keys here; every CLI insists on one
CLI_TIMEOUT_S = 600  # OpenCode's 7,700-token prompt on the embedded model, on a loaded 2-core CPU
WORDS = " a tiny random test model answers with these words"
EMBEDDED_OUTPUT_CAP = 32  # tokens: OpenCode's `limit.output`, pi's `maxTokens`


@dataclass(frozen=True)
class CLI:
    name: str  # the cache folder's stem, and the test ids
    package: str
    version: str
    binary: str
    protocol: str  # what rlproxy stores as the call's protocol


CLAUDE_CODE = CLI("claude-code", "@anthropic-ai/claude-code", "2.1.332", "claude", "messages")
CODEX = CLI("codex", "@openai/codex", "0.171.0", "codex", "responses")
OPENCODE = CLI("opencode", "opencode-ai", "1.18.33", "opencode", "chat")
PI = CLI("pi", "@mariozechner/pi-coding-agent", "0.73.1", "pi", "chat")
ALL = (CLAUDE_CODE, CODEX, OPENCODE, PI)
HOW = (
    "install Node.js 20+ with npm, then run `make test-coding-agents` (it installs the four CLIs "
    "from npm once, into ~/.cache/rlproxy/cli or RLPROXY_CLI_CACHE)"
)


# ----------------------------------------------------------------------------- installing


@pytest.fixture(scope="session")
def cli_cache() -> Path:
    absent = [name for name in ("node", "npm") if shutil.which(name) is None]
    if absent:
        missing(f"{' and '.join(absent)} not on PATH", HOW)
    default = Path.home() / ".cache" / "rlproxy" / "cli"
    return Path(os.environ.get("RLPROXY_CLI_CACHE", default))


def installed(cli: CLI, cache: Path) -> Path:
    """The CLI's executable, installed by `npm install --prefix` into `cache` the first time.
    Skips, or fails in CI, with the binary's words when it cannot run on this machine."""
    prefix = cache / f"{cli.name}-{cli.version}"
    if not (prefix / "installed").exists():
        staging = prefix.with_name(f"{prefix.name}.{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        done = subprocess.run(
            ["npm", "install", "--prefix", str(staging), "--no-audit", "--no-fund",
             "--loglevel=error", f"{cli.package}@{cli.version}"],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, f"npm install {cli.package}@{cli.version}:\n{done.stderr}"
        (staging / "installed").touch()
        try:
            staging.rename(prefix)  # atomic: a half-done install is never taken for a cache
        except OSError:  # another session installed it first
            shutil.rmtree(staging, ignore_errors=True)
    binary = prefix / "node_modules" / ".bin" / cli.binary
    how = (
        "run `make test-coding-agents` on a machine npm has the CLI's native binary for, or "
        f"delete {prefix} to install it afresh"
    )
    try:
        with tempfile.TemporaryDirectory() as home:
            probe = subprocess.run(
                [str(binary), "--version"],
                env=base_env(Path(home)),
                capture_output=True,
                text=True,
                timeout=120,
            )
    except OSError as e:
        missing(f"{cli.package} {cli.version} does not run on this machine ({e})", how)
    if probe.returncode != 0 or cli.version not in probe.stdout + probe.stderr:  # pi: stderr
        missing(
            f"{cli.package} {cli.version} does not run on this machine (`{cli.binary} --version` "
            f"exit {probe.returncode}: {probe.stderr.strip()[-500:]})",
            how,
        )
    return binary


# ----------------------------------------------------------------------------- running


def base_env(home: Path) -> dict[str, str]:
    """An environment built from nothing: node on PATH, a throw-away HOME."""
    home.mkdir(parents=True, exist_ok=True)
    node_dir = str(Path(shutil.which("node") or "/usr/bin/node").parent)
    return {
        "PATH": f"{node_dir}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "TMPDIR": str(home),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
    }


def configure(
    cli: CLI, home: Path, server: Server, output_cap: int | None = None, tools: bool = False
) -> dict[str, str]:
    """What docs/quickstart/coding-agents.md tells a user to set: the CLI's environment, and its
    config file written under `home`; `output_cap`, OpenCode's and pi's answer budget; `tools`:
    the CLI may run its tools without asking (OpenCode's permissions; the others take flags)."""
    env = base_env(home)
    if cli is CLAUDE_CODE:
        env |= {
            "ANTHROPIC_BASE_URL": server.url,  # the root: the SDK adds /v1
            "ANTHROPIC_API_KEY": KEY,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_BUG_COMMAND": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_TELEMETRY": "1",
        }
    elif cli is CODEX:
        codex_home = home / ".codex"
        codex_home.mkdir(exist_ok=True)
        (codex_home / "config.toml").write_text(
            'model = "rlproxy"\n'
            'model_provider = "rlproxy"\n'
            "check_for_update_on_startup = false\n\n"
            "[model_providers.rlproxy]\n"
            'name = "rlproxy"\n'
            f'base_url = "{server.base_url}"\n'
            'env_key = "RLPROXY_API_KEY"\n'
            'wire_api = "responses"\n\n'
            "[analytics]\nenabled = false\n\n"
            "[feedback]\nenabled = false\n"
        )
        env |= {"CODEX_HOME": str(codex_home), "RLPROXY_API_KEY": KEY}
    elif cli is OPENCODE:
        model = {"limit": {"context": 8192, "output": output_cap}} if output_cap else {}
        config = {
            "$schema": "https://opencode.ai/config.json",
            "autoupdate": False,
            "share": "disabled",
            **({"permission": {"edit": "allow", "bash": "allow"}} if tools else {}),
            "model": "rlproxy/rlproxy",
            "small_model": "rlproxy/rlproxy",
            "provider": {
                "rlproxy": {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "rlproxy",
                    "options": {"baseURL": server.base_url, "apiKey": KEY},
                    "models": {"rlproxy": model},
                }
            },
        }
        folder = home / ".config" / "opencode"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "opencode.json").write_text(json.dumps(config, indent=2))
        env |= {
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
        }
    else:
        models = {
            "providers": {
                "rlproxy": {
                    "baseUrl": server.base_url,
                    "api": "openai-completions",
                    "apiKey": KEY,
                    "models": [
                        {"id": "rlproxy", **({"maxTokens": output_cap} if output_cap else {})}
                    ],
                }
            }
        }
        folder = home / ".pi" / "agent"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "models.json").write_text(json.dumps(models, indent=2))
        env |= {"PI_OFFLINE": "1"}
    return env


def argv(cli: CLI, binary: Path, message: str, resume: bool, tools: bool = False) -> list[str]:
    """The CLI's non-interactive command; `resume`: continue the last session in this folder;
    `tools`: let it run its tools without asking (Claude Code: the file reader and the shell;
    Codex: no approvals and no sandbox, which needs kernel features a container may lack)."""
    if cli is CLAUDE_CODE:
        allow = ["--allowedTools", "Read,Bash", "--"] if tools else []  # the list ends at --
        return [str(binary), "-p", *(["--continue"] if resume else []), *allow, message]
    if cli is CODEX:  # the folder is not a git repository, which Codex checks by default
        allow = ["--dangerously-bypass-approvals-and-sandbox"] if tools else []
        return [
            str(binary), "exec", "--skip-git-repo-check", *allow,
            *(["resume", "--last"] if resume else []), message,
        ]  # fmt: skip
    if cli is OPENCODE:
        return [str(binary), "run", *(["--continue"] if resume else []), message]
    return [
        str(binary), "-p", *(["--continue"] if resume else []),
        "--provider", "rlproxy", "--model", "rlproxy", message,
    ]  # fmt: skip


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def why(self) -> str:
        return f"exit {self.returncode} after {self.seconds:.1f} s\n{self.stderr[-3000:]}"


class Session:
    """One user's folder and HOME for a CLI against a server: its runs share them, so the CLI's
    resume flag finds the session before."""

    def __init__(
        self,
        cli: CLI,
        binary: Path,
        server: Server,
        root: Path,
        output_cap: int | None = None,
        tools: bool = False,
    ) -> None:
        self.cli, self.binary, self.server, self.tools = cli, binary, server, tools
        self.workdir = root / "work"
        self.workdir.mkdir(parents=True)
        self.env = configure(cli, root / "home", server, output_cap, tools)
        self.runs: list[Run] = []

    def run(self, message: str, resume: bool = False) -> Run:
        start = time.monotonic()
        done = subprocess.run(
            argv(self.cli, self.binary, message, resume, self.tools),
            cwd=self.workdir,
            env=self.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT_S,
        )
        self.runs.append(Run(done.returncode, done.stdout, done.stderr, time.monotonic() - start))
        return self.runs[-1]


# ----------------------------------------------------------------------------- the result file

REPO = Path(__file__).resolve().parents[2]
RESULTS: list[dict[str, Any]] = []


@pytest.fixture(scope="module", autouse=True)
def result_file() -> Iterator[None]:
    """Write what the passing tests measured (each CLI run's time, each stored session's shape)
    to the file CODING_AGENTS_RESULTS names once the module is done: `make
    test-coding-agents` names bench/results/coding-agents.json, which the docs cite; a run of
    a few tests names none and leaves it alone."""
    load = os.getloadavg()
    yield
    target = os.environ.get("CODING_AGENTS_RESULTS")
    if not RESULTS or not target:
        return
    result = REPO / target
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    result.parent.mkdir(parents=True, exist_ok=True)
    result.write_text(
        json.dumps(
            {
                "command": "make test-coding-agents",
                "commit": commit,
                "machine": {
                    "cpus": os.cpu_count(),
                    "loadavg_1_5_15_at_start": load,
                    "loadavg_1_5_15_at_end": os.getloadavg(),
                },
                "clis": {c.name: f"{c.package}@{c.version}" for c in ALL},
                "passed": RESULTS,
            },
            indent=1,
        )
        + "\n"
    )


def report(session: Session, model: str, trajectories: list[dict[str, Any]]) -> None:
    """Record a passing test: its CLI runs' seconds and the shape of what was stored."""
    RESULTS.append(
        {
            "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0].split("::", 1)[-1],
            "cli": session.cli.name,
            "model": model,
            "runs_s": [round(r.seconds, 1) for r in session.runs],
            "trajectories": [
                {
                    "turns": len(t["turns"]),
                    "tool_calls": [
                        [c["function"]["name"] for c in m.get("tool_calls") or []]
                        for turn in t["turns"]
                        for m in turn["response_messages"][:1]
                    ],
                    "history_rewritten": [
                        bool(turn.get("history_rewritten")) for turn in t["turns"]
                    ],
                    "parent": t.get("parent_trajectory_id") is not None,
                }
                for t in trajectories
            ],
        }
    )


# ----------------------------------------------------------------------------- what is stored


def stored(server: Server) -> dict[str, dict[str, Any]]:
    """Every trajectory on the server, with its turns."""
    return {t["id"]: get_trajectory(server, t["id"]) for t in list_trajectories(server)}


def text_of(message: dict[str, Any]) -> str:
    """A message's text, whitespace removed (content as a string or as parts)."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return "".join((content or "").split())


def shape(message: dict[str, Any]) -> tuple[str, str]:
    return message["role"], text_of(message)


def changed(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> list[dict]:
    """The trajectories a run opened or added calls to, oldest first."""
    out = [
        t
        for tid, t in after.items()
        if tid not in before or t["call_count"] != before[tid]["call_count"]
    ]
    return sorted(out, key=lambda t: t["created_at"])


def main_and_side(trajectories: list[dict[str, Any]]) -> tuple[dict, list[dict]]:
    """The session's trajectory (its calls carry the CLI's tools) and its side calls' (none)."""
    main = [t for t in trajectories if t["turns"][0]["tools"]]
    assert len(main) == 1, [t["turns"][0]["request_messages"][0] for t in trajectories]
    return main[0], [t for t in trajectories if t is not main[0]]


def assert_in_order(trajectory: dict[str, Any], protocol: str) -> None:
    """Turns numbered in order, each a completed call of `protocol` whose request is the turn
    before's request plus the answer it got."""
    turns = trajectory["turns"]
    assert [t["turn_index"] for t in turns] == list(range(len(turns)))
    assert [t["created_at"] for t in turns] == sorted(t["created_at"] for t in turns)
    for before, turn in pairwise(turns):
        history = [shape(m) for m in before["request_messages"] + before["response_messages"]]
        assert [shape(m) for m in turn["request_messages"][: len(history)]] == history
    for turn in turns:
        assert turn["protocol"] == protocol and turn["status"] == "completed", turn


def assert_answered(run: Run, trajectory: dict[str, Any], message: str) -> None:
    """The CLI exited 0 and printed the last turn's answer, and that turn was asked the message
    the CLI was given (its last user message)."""
    assert run.returncode == 0, run.why()
    assert run.stdout.strip(), f"no answer printed: {run.why()}"
    users = [m for m in trajectory["turns"][-1]["request_messages"] if m["role"] == "user"]
    assert "".join(message.split()) in text_of(users[-1])
    answer = text_of(trajectory["turns"][-1]["response_messages"][0])
    assert answer, trajectory["turns"][-1]
    assert answer in "".join(run.stdout.split()), (answer, run.stdout)


def assert_side_calls(cli: CLI, side: list[dict[str, Any]]) -> None:
    """OpenCode asks `small_model` for the session's title beside the task: a trajectory of its
    own, one call without tools. `opencode run` exits once the task is answered, so the title may
    be cut (stored as `client_disconnected`). The others make no side call in these runs."""
    if cli is not OPENCODE:
        assert side == []
        return
    (title,) = side
    (turn,) = title["turns"]
    assert not turn["tools"] and turn["status"] in ("completed", "client_disconnected")
    system = turn["request_messages"][0]
    assert system["role"] == "system" and "title" in text_of(system)


def first_task(session: Session) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The task in a new session: its session's trajectory, and its side calls'."""
    before = stored(session.server)
    run = session.run(TASK)
    assert run.returncode == 0, run.why()
    main, side = main_and_side(changed(before, stored(session.server)))
    assert_in_order(main, session.cli.protocol)
    assert_answered(run, main, TASK)
    return main, side


# ----------------------------------------------------------------------------- the embedded model


@pytest.fixture(scope="class")
def embedded_server(
    tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path
) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("agents-embedded")
    with own_server(root / "data", model_data_dir) as server:
        yield server


@pytest.mark.parametrize("cli", [PI, OPENCODE], ids=lambda c: c.name)
class TestOnTheEmbeddedModel:
    """pi's and OpenCode's prompts fit SmolLM2-135M's 8,192 tokens. Their answers are capped at
    EMBEDDED_OUTPUT_CAP tokens by their own model settings (the quickstart's advice for a CPU):
    OpenCode's prompt alone takes minutes to read, and an uncapped answer may take ten more."""

    def test_the_task_is_answered_and_stored_as_one_session(
        self, cli: CLI, embedded_server: Server, cli_cache: Path, tmp_path: Path
    ) -> None:
        binary = installed(cli, cli_cache)
        session = Session(cli, binary, embedded_server, tmp_path, EMBEDDED_OUTPUT_CAP)
        main, side = first_task(session)
        assert_side_calls(cli, side)
        assert main["turns"][0]["prompt_tokens"] < 8192
        report(session, f"embedded SmolLM2-135M, answers capped at {EMBEDDED_OUTPUT_CAP}", [main])


# ----------------------------------------------------------------------------- a long context


@pytest.fixture(scope="class")
def long_context_server(
    tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path
) -> Iterator[Server]:
    from proxy.engines.loader import ensure_fp32_cache

    root = tmp_path_factory.mktemp("agents-long-context")
    folder = build_tiny_model(
        root / "model", ensure_fp32_cache(model_data_dir), "qwen2", context=65536, words=WORDS
    )
    with own_server(root / "data", root / "cache", {"RLPROXY_BASE_MODEL": str(folder)}) as s:
        assert httpx.get(f"{s.url}/health", timeout=10).json()["base_model"] == str(folder)
        yield s


@pytest.mark.parametrize("cli", ALL, ids=lambda c: c.name)
class TestOnALongContextModel:
    """Every CLI's full prompt, on a tiny random model with a 65,536-token context."""

    def test_a_session_of_two_calls_is_one_trajectory_in_order(
        self, cli: CLI, long_context_server: Server, cli_cache: Path, tmp_path: Path
    ) -> None:
        server = long_context_server
        session = Session(cli, installed(cli, cli_cache), server, tmp_path)
        main, side = first_task(session)
        if cli is CLAUDE_CODE or cli is CODEX:  # what the embedded model cannot hold
            assert main["turns"][0]["prompt_tokens"] > 8192
        assert_side_calls(cli, side)

        before = stored(server)
        again = session.run(FOLLOW_UP, resume=True)
        assert again.returncode == 0, again.why()
        (resumed,) = changed(before, stored(server))  # no new trajectory, no second title
        assert resumed["id"] == main["id"]
        assert len(resumed["turns"]) == len(main["turns"]) + 1
        assert_in_order(resumed, cli.protocol)
        assert_answered(again, resumed, FOLLOW_UP)
        report(session, "tiny random, 65,536-token context", [resumed])


# ----------------------------------------------------------------------------- using tools

TOOL_TASK = "Read notes.txt, then run a shell command that makes done.txt, then say what you did."
MARKERS = ("Agriculture", "Mindfulness")  # in notes.txt, and in what the shell command prints
COMMAND = "touch done.txt && cat sec*.txt"  # its text holds neither marker; its output does
# The final answer names both words, so a summary of the session (compaction) holds them too.
FINAL = f"Both tools ran: the note says {MARKERS[0]} and the command printed {MARKERS[1]}."


def tool_scripts(cli: CLI, workdir: Path) -> list[str]:
    """What the scripted model answers `cli` in each phase: a call of the CLI's file-reading
    tool (Codex has none: its shell), a call of its shell tool, the final answer. Arguments in
    the order of the tool's schema; paths absolute where the tool asks for that."""
    notes = str(workdir / "notes.txt")
    if cli is CLAUDE_CODE:
        calls = [
            hermes_call("Read", {"file_path": notes}),
            hermes_call("Bash", {"command": COMMAND, "description": "Make done.txt"}),
        ]
    elif cli is CODEX:
        calls = [
            hermes_call("exec_command", {"cmd": "cat notes.txt"}),
            hermes_call("exec_command", {"cmd": COMMAND}),
        ]
    elif cli is OPENCODE:
        calls = [
            hermes_call("read", {"filePath": notes}),
            hermes_call("bash", {"command": COMMAND}),
        ]
    else:
        calls = [
            hermes_call("read", {"path": "notes.txt"}),
            hermes_call("bash", {"command": COMMAND}),
        ]
    return [*calls, FINAL]


def scripted_server(root: Path, model_data_dir: Path, scripts: list[str]) -> Any:
    from proxy.engines.loader import ensure_fp32_cache

    folder = build_scripted_model(
        root / "model", ensure_fp32_cache(model_data_dir), scripts, MARKERS
    )
    return own_server(root / "data", root / "cache", {"RLPROXY_BASE_MODEL": str(folder)})


def tool_session(cli: CLI, binary: Path, server: Server, root: Path) -> Session:
    """A session of `cli` with its tools allowed, in a folder holding the two files the tool
    scripts read: notes.txt (the first marker) and second.txt (the second)."""
    session = Session(cli, binary, server, root, tools=True)
    (session.workdir / "notes.txt").write_text(MARKERS[0] + "\n")
    (session.workdir / "second.txt").write_text(MARKERS[1] + "\n")
    return session


@pytest.mark.parametrize("cli", ALL, ids=lambda c: c.name)
class TestASessionThatUsesTools:
    """Each CLI, its own tools allowed as a user allows them (docs/quickstart/coding-agents.md),
    on a model that calls them (tests/scripted_model.py): it reads notes.txt, runs a shell
    command that makes done.txt and prints the other file, and answers once both results are
    in its context. The model answers phase 1 only when the file's word is in its prompt and
    phase 2 only when the command's output is, so each stored turn shows a tool that ran."""

    def test_two_tools_run_and_the_session_is_stored_turn_by_turn(
        self, cli: CLI, cli_cache: Path, model_data_dir: Path, tmp_path: Path
    ) -> None:
        binary = installed(cli, cli_cache)
        workdir = tmp_path / "work"
        with scripted_server(tmp_path, model_data_dir, tool_scripts(cli, workdir)) as server:
            session = tool_session(cli, binary, server, tmp_path)
            run = session.run(TOOL_TASK)
            assert run.returncode == 0, run.why()
            assert (workdir / "done.txt").exists(), f"the shell tool did not run: {run.why()}"
            assert "".join(FINAL.split()) in "".join(run.stdout.split()), run.stdout
            main, side = main_and_side(changed({}, stored(server)))
            assert_side_calls(cli, side)
            assert_tool_session(main, cli, server, tmp_path / "model")
        report(session, "scripted (tests/scripted_model.py)", [main])


def assert_tool_session(trajectory: dict[str, Any], cli: CLI, server: Server, model: Path) -> None:
    """Three turns in order (the task, then each tool's result), each answered with its phase's
    script, token for token; each prompt holds the markers its phase needs and no later one."""
    turns = trajectory["turns"]
    assert len(turns) == 3, [t["response_messages"] for t in turns]
    assert_in_order(trajectory, cli.protocol)
    calls = calls_of(server.data_dir, trajectory["id"])
    from transformers import AutoTokenizer

    scripts = json.loads((model / "scripts.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    marks = [marker_tokens(word, tokenizer) for word in MARKERS]
    for phase, call in enumerate(calls):
        (choice,) = call["choices"]
        assert choice["completion_token_ids"] == scripts[phase], phase
        prompt = set(call["prompt_token_ids"])
        assert [bool(prompt & m) for m in marks] == [phase >= 1, phase >= 2], phase
    for phase, turn in enumerate(turns[:2]):
        (answer,) = turn["response_messages"]
        assert answer.get("tool_calls"), answer
        results = [m for m in turns[phase + 1]["request_messages"] if m["role"] == "tool"]
        assert results and MARKERS[phase] in str(results[-1]["content"]), results


# ----------------------------------------------------------------------- compaction, sub-agents

SUB_AGENT_CALL = hermes_call(
    "Agent",
    {
        "description": "Say the word",
        "prompt": f"Say {MARKERS[1]}.",  # the sub-agent starts in phase 2 and answers at once
        "subagent_type": "general-purpose",
        "run_in_background": False,  # the main agent waits for the hand-back
    },
)


def continues(before: dict[str, Any], turn: dict[str, Any]) -> bool:
    """Whether `turn`'s request is `before`'s request plus the answer it got (and more)."""
    history = [shape(m) for m in before["request_messages"] + before["response_messages"]]
    return [shape(m) for m in turn["request_messages"][: len(history)]] == history


class TestRewrittenSessions:
    """What docs/concepts/trajectories.md says an episode is when a CLI rewrites its history
    (compaction: Claude Code's and Codex's) or Claude Code starts a sub-agent (its Agent tool),
    with the real CLIs."""

    def test_a_compacted_session_is_one_episode_with_its_boundaries_recorded(
        self, cli_cache: Path, model_data_dir: Path, tmp_path: Path
    ) -> None:
        """The tool session, then `/compact` (the summarising call on the whole history), then
        a message on the rewritten history (the summary and the files read again): one
        trajectory, whose turns that do not continue the turn before are marked so."""
        cli = CLAUDE_CODE
        binary = installed(cli, cli_cache)
        workdir = tmp_path / "work"
        with scripted_server(tmp_path, model_data_dir, tool_scripts(cli, workdir)) as server:
            session = tool_session(cli, binary, server, tmp_path)
            runs = [session.run(TOOL_TASK)]
            runs.append(session.run("/compact", resume=True))
            runs.append(session.run(FOLLOW_UP, resume=True))
            for run in runs:
                assert run.returncode == 0, run.why()
            (main,) = stored(server).values()
        turns = main["turns"]
        rewritten = [t["history_rewritten"] for t in turns]
        assert rewritten == [False] + [not continues(a, b) for a, b in pairwise(turns)]
        assert any(rewritten), "no call after /compact rewrote the history"
        compacting = [t for t in turns if "TEXT ONLY" in str(t["request_messages"][-1])]
        assert compacting, "no summarising call stored in the session's trajectory"
        users = [m for m in turns[-1]["request_messages"] if m["role"] == "user"]
        assert "".join(FOLLOW_UP.split()) in text_of(users[-1])
        report(session, "scripted (tests/scripted_model.py)", [main])

    def test_a_codex_session_that_compacts_is_one_episode_with_its_boundary_recorded(
        self, cli_cache: Path, model_data_dir: Path, tmp_path: Path
    ) -> None:
        """Codex compacts on its own once a turn's context passes
        `model_auto_compact_token_limit`: set just under the tool session's last prompt, the
        next message starts with the summarising call, then goes on from the summary. One
        trajectory, the turn after the summary marked as a rewritten history."""
        cli = CODEX
        binary = installed(cli, cli_cache)
        workdir = tmp_path / "work"
        with scripted_server(tmp_path, model_data_dir, tool_scripts(cli, workdir)) as server:
            session = tool_session(cli, binary, server, tmp_path)
            first = session.run(TOOL_TASK)
            assert first.returncode == 0, first.why()
            (main,) = stored(server).values()
            limit = main["turns"][-1]["prompt_tokens"] - 50
            config = tmp_path / "home" / ".codex" / "config.toml"
            config.write_text(f"model_auto_compact_token_limit = {limit}\n" + config.read_text())
            again = session.run(FOLLOW_UP, resume=True)
            assert again.returncode == 0, again.why()
            (main,) = stored(server).values()
        turns = main["turns"]
        rewritten = [t["history_rewritten"] for t in turns]
        assert rewritten == [False] + [not continues(a, b) for a, b in pairwise(turns)]
        assert any(rewritten), "no call after the compaction rewrote the history"
        assert any("COMPACTION" in str(t["request_messages"][-1]) for t in turns), turns
        report(session, "scripted (tests/scripted_model.py)", [main])

    def test_a_sub_agent_is_its_own_trajectory_linked_to_its_parent(
        self, cli_cache: Path, model_data_dir: Path, tmp_path: Path
    ) -> None:
        """The main agent calls its Agent tool; the sub-agent (its own system prompt and tools,
        the prompt it was given) answers; the main agent answers with the hand-back in its
        context: two trajectories, the sub-agent's naming the main one as its parent."""
        cli = CLAUDE_CODE
        binary = installed(cli, cli_cache)
        with scripted_server(tmp_path, model_data_dir, [SUB_AGENT_CALL, FINAL, FINAL]) as server:
            session = Session(cli, binary, server, tmp_path, tools=True)
            run = session.run("Ask a helper agent to say a word.")
            assert run.returncode == 0, run.why()
            trajectories = list(stored(server).values())
        (main,) = [t for t in trajectories if t["parent_trajectory_id"] is None]
        (sub,) = [t for t in trajectories if t is not main]
        assert sub["parent_trajectory_id"] == main["id"]
        assert_in_order(main, cli.protocol)
        assert len(main["turns"]) == 2
        (call,) = main["turns"][0]["response_messages"][0]["tool_calls"]
        assert call["function"]["name"] == "Agent"
        (answer,) = sub["turns"]
        users = [m for m in answer["request_messages"] if m["role"] == "user"]
        assert f"Say{MARKERS[1]}." in text_of(users[-1]), users
        hand_back = [m for m in main["turns"][1]["request_messages"] if m["role"] == "tool"]
        assert hand_back and text_of(answer["response_messages"][0]) in text_of(hand_back[-1])
        assert "".join(FINAL.split()) in "".join(run.stdout.split())
        report(session, "scripted (tests/scripted_model.py)", [main, sub])
