"""rlproxy's settings: one pydantic-settings class, environment prefix `RLPROXY_`.

Built by the app factory or the CLI, never at import time. Every field can be set as
`RLPROXY_<FIELD>` (for example `RLPROXY_PORT=9000`, `RLPROXY_ALIASES='["gpt-4o-mini"]'`).
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

EMBEDDED_DEFAULT_MAX_TOKENS = 512
"""The budget of a request that sends none on the embedded SmolLM2-135M (`default_max_tokens`)."""


class UpstreamTarget(BaseModel):
    """Where one upstream model name is forwarded: `openai/...` targets straight to the
    OpenAI-compatible server over HTTP, every other provider through litellm."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="litellm target, `provider/model` (e.g. `openai/gpt-4o-mini`).")
    via: Literal["auto", "litellm"] = Field(
        "auto",
        description="`auto`: an `openai/` target is called directly (pooled HTTP client, "
        "streams passed through chunk by chunk), any other provider through litellm; "
        "`litellm`: always through litellm.",
    )
    api_base: str | None = Field(None, description="Base URL of an OpenAI-compatible server.")
    api_key_env: str | None = Field(
        None,
        description="Name of the server's environment variable that holds the provider key "
        "(default: the provider's usual one, e.g. OPENAI_API_KEY). Never taken from a request.",
    )


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RLPROXY_", extra="ignore")

    host: str = Field("127.0.0.1", description="Address the HTTP server binds to.")
    port: int = Field(8000, ge=1, le=65535, description="Port the HTTP server listens on.")
    data_dir: Path = Field(
        Path("rlproxy-data"), description="Database, checkpoints and the model cache live here."
    )
    model_name: str = Field(
        "rlproxy", description="The policy's served name; `NAME@base` and `NAME@N` derive from it."
    )
    aliases: list[str] = Field(
        default_factory=lambda: ["gpt-4o-mini", "gpt-4o", "gpt-3.5-turbo"],
        description="Other model names served by the policy (for clients that validate names).",
    )
    messages_model_patterns: list[str] = Field(
        default_factory=lambda: ["claude-*"],
        description="On Anthropic's Messages API (/v1/messages) only, further model names the "
        "policy serves: globs (`fnmatch`, case-sensitive). Claude Code and other Anthropic "
        "clients send their own names (`claude-opus-5-5`, `claude-haiku-...`); an upstream model "
        "of the same name (RLPROXY_UPSTREAM_MODELS) wins. Other names stay a 404 there, and on "
        "Chat Completions and Responses every unknown name does. []: the policy's name and "
        "aliases only.",
    )
    model_dir: Path | None = Field(
        None, description="Where the fp32 model cache lives (default: the data directory)."
    )
    database_url: str | None = Field(
        None, description="SQLAlchemy async URL; default sqlite+aiosqlite:///<data_dir>/rlproxy.db"
    )
    storage_probe_s: float = Field(
        5.0,
        gt=0,
        description="While the database cannot be written (disk full, read-only, unreachable), "
        "how often a tiny probe write tries it again; chat requests get a 503 until one commits.",
    )
    trajectory_idle_timeout_s: float = Field(
        600.0, gt=0, description="A trajectory with no new call for this long is closed."
    )
    retry_window_s: float = Field(
        10.0,
        ge=0,
        description="The same messages within this window after a failed attempt are a retry.",
    )
    max_body_bytes: int = Field(
        8 * 2**20,
        ge=1024,
        description="Largest request body accepted, in bytes (larger: 413 before parsing).",
    )
    max_batch_size: int = Field(16, ge=1, description="Rows decoded together by the local engine.")
    prefill_tokens: int = Field(
        2048,
        ge=1,
        description="Prompt tokens the local engine prefills in one pass (after its prefix "
        "cache), before the running rows take their next decode step. Newcomers are admitted "
        "first come first served until the next one would pass this; a longer prompt runs in a "
        "pass of its own. Lower: running sessions stall less behind a long new prompt; higher: "
        "fewer passes for many short prompts.",
    )
    prefix_cache_bytes: int = Field(
        2**30,
        ge=0,
        description="The local engine's prefix cache, in bytes: finished requests' key/value "
        "tensors (prompt and answer) kept so that a prompt starting with the same tokens on the "
        "same adapter version prefills only what follows (an agent's next turn). Least "
        "recently used entries go first; 0 turns it off. The embedded SmolLM2-135M takes about "
        "46 KB a token, so 1 GiB holds about 23,000 tokens.",
    )
    prefix_cache_ttl_s: float = Field(
        1800.0,
        gt=0,
        description="A prefix cache entry not used for this long is dropped.",
    )
    serving_first: bool = Field(
        True,
        description="Users' requests before background work on the local engine: the local "
        "judge's requests run only while no user's request runs or waits, and are paused (their "
        "KV kept in the prefix cache) when one arrives. False: one first-come-first-served queue.",
    )
    background_idle_s: float = Field(
        0.5,
        ge=0,
        description="Background work starts or resumes only after users' requests have been "
        "gone this long (an agent's next call usually follows within it).",
    )
    background_max_wait_s: float = Field(
        600.0,
        gt=0,
        description="A background request that waited this long runs beside users' requests, so "
        "that under endless traffic the judge still gets a bounded share of the engine.",
    )
    background_prefill_tokens: int = Field(
        256,
        ge=1,
        description="A background prompt is prefilled at most this many tokens a pass (through "
        "the prefix cache), so a user's request that arrives waits for one chunk, not a whole "
        "long judge prompt. Needs the prefix cache (RLPROXY_PREFIX_CACHE_BYTES > 0).",
    )
    max_n: int = Field(8, ge=1, description="Largest `n` (choices per request) accepted.")
    default_max_tokens: int | None = Field(
        None,
        ge=1,
        description="The answer's budget when a request sets none (no `max_tokens`, "
        "`max_completion_tokens` or `max_output_tokens`), capped at what the context leaves "
        "after the prompt. Unset: what the context leaves (vLLM's rule; Codex sends no budget "
        "and treats a cut answer as an error), except on the embedded model: "
        f"{EMBEDDED_DEFAULT_MAX_TOKENS} (a 135M model at temperature 1 rarely stops, and its "
        "whole 8,192-token context takes minutes on a CPU).",
    )
    output_budget: Literal["fit", "strict"] = Field(
        "fit",
        description="A budget asked for that does not fit what the context leaves after the "
        "prompt: `fit` generates up to what it leaves (as Ollama and llama.cpp do; the "
        "X-RLProxy-Output-Budget header says so), `strict` refuses it with a 400 "
        "context_length_exceeded (vLLM's rule). A prompt that alone fills the context is a 400 "
        "either way.",
    )
    upstream_models: dict[str, UpstreamTarget] = Field(
        default_factory=dict,
        description="Served name -> upstream target, forwarded through litellm and stored like "
        'local calls, e.g. {"openai/gpt-4o-mini": {"model": "openai/gpt-4o-mini"}}.',
    )
    upstream_timeout_s: float = Field(
        600.0, gt=0, description="Timeout of one upstream provider call, in seconds."
    )
    log_level: str = Field("INFO", description="Python logging level.")
    trusted_proxies: list[str] = Field(
        default_factory=list,
        description="Addresses of reverse proxies whose X-Forwarded-For names the client "
        '(e.g. ["127.0.0.1"]); by default the connecting address is the client.',
    )
    insecure_no_auth: bool = Field(
        False,
        description="Serve beyond loopback with no API keys (anyone who reaches the port may do "
        "anything). Without it, a public bind needs at least one key (`rlproxy keys create`).",
    )
    key_refresh_s: float = Field(
        5.0,
        gt=0,
        description="How often serving re-reads the API keys (a key created or revoked by "
        "`rlproxy keys` takes effect within this time).",
    )

    # --- limits ---------------------------------------------------------------------------
    # Each is answered with an OpenAI-shaped 4xx before any work is done (429s with
    # `retry-after`); `max_body_bytes` above is one of them.
    max_messages: int = Field(
        2048, ge=1, description="Most messages one chat request may carry (OpenAI's limit)."
    )
    max_schema_depth: int = Field(
        32,
        ge=1,
        description="Deepest nesting of objects and arrays in a tool's parameters or a "
        "response_format schema (32 is about 15 levels of nested object properties).",
    )
    max_schema_nodes: int = Field(
        10_000,
        ge=1,
        description="Most JSON values in all of a request's schemas together (tool parameters "
        "and response_format), a bound on the grammar compiled from them (~0.4 s at most).",
    )
    caller_requests_per_minute: int = Field(
        3600,
        ge=0,
        description="Requests per minute each API key may send to /v1/*, as a token bucket that "
        "holds a minute's worth (60 a second sustained by default); beyond it: 429 (0: no "
        "limit). Requests without a key count only with RLPROXY_CALLER_ADDRESS_LIMITS.",
    )
    caller_concurrency: int = Field(
        64,
        ge=0,
        description="Requests to /v1/* one API key may have in flight, streamed bodies included; "
        "beyond it: 429 (0: no limit). Counted by each replica on its own.",
    )
    caller_address_limits: bool = Field(
        False,
        description="Also apply the two limits above to requests that carry no API key (open "
        "mode), counted per client address (behind a reverse proxy, name it in "
        "RLPROXY_TRUSTED_PROXIES). Off: without keys only the engine's queue bound "
        "(RLPROXY_MAX_QUEUED_ROWS) refuses work.",
    )
    redis_url: str | None = Field(
        None,
        description="Redis server for the per-caller request rate, shared by every replica that "
        "names it (redis://host:6379/0; rediss:// for TLS). Unset: each replica counts on its "
        "own. While Redis cannot be reached, each replica falls back to its own count.",
    )
    max_queued_rows: int = Field(
        64,
        ge=0,
        description="Rows (choices) waiting for a place in the local engine's batch, or sent to "
        "vLLM and still without a first token (the vllm engine); a request that would queue more "
        "is refused with a 429 before it starts (0: no bound).",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="A connection whose request line and headers are not complete this many "
        "seconds after it opens (or after the first byte of a later request on it) is closed "
        "(slowloris). Idle keep-alive connections are uvicorn's (5 s).",
    )

    # --- telemetry ------------------------------------------------------------------------
    # Where spans go is read from the standard variables, not from here: OTLP/HTTP with
    # OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, Langfuse with
    # LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY and LANGFUSE_HOST (see proxy/telemetry/).
    metrics_auth: Literal["open", "inference", "admin"] = Field(
        "open",
        description="Who may scrape GET /metrics once API keys exist: anyone (`open`: the "
        "metrics hold counts, never prompt text), any key (`inference`), or an admin key.",
    )
    metrics_cache_s: float = Field(
        5.0,
        ge=0,
        description="How long /metrics reuses the figures it reads from the database "
        "(trajectories and groups by status, the trainer's newest step) before reading again.",
    )
    telemetry_capture_content: bool = Field(
        False,
        description="Put request and response messages on chat spans (gen_ai.input.messages, "
        "gen_ai.output.messages; Langfuse's input and output). Off: spans hold ids and counts, "
        "no text. OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true turns it on too.",
    )

    # --- groups and RULER ----------------------------------------------------------------
    shadow_samples: int = Field(
        0,
        ge=0,
        le=16,
        description="Shadow sampling: generate this many answers per eligible turn in one "
        "batch, return one at random, store all as a group (0 or 1: off).",
    )
    shadow_turns: Literal["first", "every"] = Field(
        "first", description="Which turns get shadow samples: the first of a trajectory, or every."
    )
    group_min_size: int = Field(
        4, ge=2, description="A group with this many closed members is ready to be scored."
    )
    group_max_size: int = Field(
        8, ge=2, description="Larger groups are split into parts of at most this many members."
    )
    group_window_s: float = Field(
        600.0, gt=0, description="After this long, a group with at least 2 members is ready."
    )
    group_cohort: bool = Field(
        True,
        description="A trajectory whose task group is still alone after `group_alone_s` joins a "
        "cohort of the same agent (same key, system prompt with dates, paths and numbers masked, "
        "tool names), so traffic whose every task is new trains. Cohort advantages use a "
        "leave-one-out baseline (docs/concepts/groups.md). False: lone tasks wait for a repeat.",
    )
    group_alone_s: float = Field(
        60.0,
        ge=0,
        description="How long a task seen once waits for another run of the same task before it "
        "joins its agent's cohort.",
    )
    scoring: bool | Literal["auto"] = Field(
        "auto",
        description="Score ready groups with RULER in the background while serving. `auto`: "
        "only while something uses the scores (a trainer here, on another replica or a running "
        "`rlproxy train` on the database, or telemetry that receives scores); otherwise ready "
        "groups wait, unscored and never lost (`rlproxy score` scores them on demand). `true`: "
        "always. `false`: never; groups still form, and those whose every member has an "
        "explicit reward are scored from the rewards and trained on (no judge).",
    )
    scoring_interval_s: float = Field(
        5.0,
        gt=0,
        description="How often groups are formed (scoring on or off) and the background scorer "
        "looks for ready groups.",
    )
    judge_retry_s: float = Field(
        900.0,
        gt=0,
        description="A judge that failed its checks (the gate holds it, or its canaries cannot "
        "reach the pass rate even at their 95% upper bound) judges one group this often, to notice "
        "a fix, instead of every ready group; the others wait, unscored and never lost.",
    )
    scoring_lease_s: float = Field(
        60.0,
        gt=0,
        description="A group being judged is leased to its replica for this long, renewed every "
        "third of it while the judge works; another replica takes it back only once the lease "
        "has run out (its scorer died).",
    )
    judge_model: str | None = Field(
        None,
        description="RULER's judge: any litellm model (`openai/o3`, `anthropic/...`). Unset: the "
        "local model judges, a placeholder for trying things out, not a useful judge.",
    )
    judge_api_base: str | None = Field(
        None, description="Base URL of an OpenAI-compatible judge server (with `openai/<name>`)."
    )
    judge_api_key_env: str | None = Field(
        None,
        description="Environment variable holding the judge provider's key (default: the "
        "provider's usual one, e.g. OPENAI_API_KEY).",
    )
    judge_timeout_s: float = Field(120.0, gt=0, description="Timeout of one judge call.")
    judge_rubric: str | None = Field(
        None,
        description="The judge's rubric for every group (default: the built-in rubric of "
        "RLPROXY_JUDGE_MODE).",
    )
    judge_rubrics: dict[str, str] = Field(
        default_factory=dict,
        description="Rubric per group: keyed by explicit group key, or by `agent:<system prompt>`.",
    )
    judge_explicit_groups: bool = Field(
        False,
        description="Also call the judge for groups whose members all have explicit rewards "
        "(by default those are used as they are, with no judge call).",
    )
    judge_mode: Literal["group", "turns"] = Field(
        "group",
        description="How the judge scores a group. `group`: RULER, one call compares the members "
        "(members of different tasks each against its own task). `turns`: each assistant turn "
        "is judged good (+1), neutral (0) or bad (-1) from what came next (the tool result, the "
        "user's reply; the last turn on the final state) by majority of RLPROXY_JUDGE_VOTES "
        "calls, and a member scores its mean verdict mapped to 0..1: members x turns x votes "
        "judge calls per group (docs/concepts/ruler.md).",
    )
    judge_votes: int = Field(
        3,
        ge=1,
        le=15,
        description="Judge calls per turn with RLPROXY_JUDGE_MODE=turns; the turn's verdict is "
        "their majority, neutral on a tie. Votes differ only where the judge samples: 1 suits a "
        "greedy judge such as the local one.",
    )
    train: bool = Field(
        True,
        description="Run the GRPO trainer in its own process beside the server (`rlproxy serve "
        "--no-train` or false: serve only).",
    )
    trainer: dict[str, Any] = Field(
        default_factory=dict,
        description='Trainer configuration overrides, e.g. {"learning_rate": 1e-4}; the fields of '
        "trainer.config.TrainerConfig.",
    )
    train_poll_s: float = Field(5.0, gt=0, description="How often the trainer looks for groups.")
    trainer_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="CPU priority of serve's trainer child, as `nice`: 10 leaves serving most of a "
        "shared core while a step runs (19: training only in what serving leaves; 0: equals).",
    )
    trainer_command: list[str] | None = Field(
        None,
        description="The command line of serve's trainer child (default: this interpreter's "
        '`-m proxy.cli train`), e.g. ["nice", "-n", "10", "/opt/rlproxy/bin/rlproxy", "train"].',
    )
    trainer_processes: int = Field(
        1,
        ge=1,
        description="Processes of serve's trainer child. Above 1 it trains data-parallel under "
        "torchrun (`torchrun --standalone --nproc-per-node N -m proxy.cli train`): gloo on CPU, "
        "NCCL with one GPU per process on CUDA. Ignored when RLPROXY_TRAINER_COMMAND is set.",
    )
    trainer_restart_s: float = Field(
        1.0,
        gt=0,
        description="A trainer child that exits is restarted after this delay, doubled after "
        "each exit in a row up to RLPROXY_TRAINER_RESTART_MAX_S.",
    )
    trainer_restart_max_s: float = Field(
        300.0,
        gt=0,
        description="The longest wait before restarting the trainer. A child that ran a minute "
        "(or this long, if longer) counts as healthy: its next exit waits "
        "RLPROXY_TRAINER_RESTART_S again.",
    )
    train_threads: int | None = Field(
        None,
        ge=1,
        description="Torch threads of the trainer process (serve's trainer defaults to 1 on CPU, "
        "leaving the other cores to serving; unset for a standalone `rlproxy train`: torch's "
        "default).",
    )
    publish_adapters: bool = Field(
        True,
        description="Serve each new adapter version the trainer writes as soon as it loads "
        "(false: versions are only loaded and activated through /rl/adapters).",
    )
    keep_adapters: int = Field(
        2,
        ge=0,
        description="Previous adapter versions kept loaded beside the active one, for a quick "
        "rollback; older ones are unloaded (and loaded again when a client pins `NAME@N`).",
    )
    adapter_poll_s: float = Field(
        2.0,
        gt=0,
        description="How often serving looks for new adapter versions to publish; also how "
        "often each replica follows the active version and canary recorded in the database and "
        "writes its heartbeat.",
    )
    replica_id: str | None = Field(
        None,
        description="This replica's name in the database's leases and heartbeats (several "
        "`rlproxy serve` on one database). Unset: host:pid:random, new on every start.",
    )
    lease_s: float = Field(
        15.0,
        gt=0,
        description="Length of the trainer and publisher leases (renewed every third of it): "
        "with several replicas on one database, a replica that dies without giving its leases "
        "up hands them to another one after at most this long. Must be more than three times "
        "RLPROXY_ADAPTER_POLL_S.",
    )
    reward_policy: Literal["explicit", "ruler"] = Field(
        "explicit",
        description="Which reward training uses when a trajectory has both: the explicit one "
        "posted by the environment, or RULER's score. Both stay stored and visible.",
    )

    # --- judge checks ---------------------------------------------------------------------
    # Keeping the judge honest (trainer/scoring/judge_checks.py): canaries, self-agreement,
    # agreement with the environment, a gate on training, a drift alarm. Figures: GET /rl/judge.
    judge_checks: bool = Field(
        True, description="Run the judge checks below (false: judge as before, no checks)."
    )
    judge_canary_share: float = Field(
        0.2,
        ge=0,
        le=1,
        description="Share of judged groups that get one extra synthetic member known to be bad "
        "(empty, a refusal, another task's answer, an answer cut in half), never trained on. The "
        "check passes only when the judge scores it strictly below the group's median (a tie "
        "fails).",
    )
    judge_position_share: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Share of judged groups judged a second time with the members in reverse "
        "order; Kendall's tau between the two is the judge's self-agreement.",
    )
    judge_gate: bool = Field(
        True,
        description="Hold (never train on) scores from a judge whose canary pass rate or "
        "self-agreement is shown to be below its threshold.",
    )
    judge_gate_min_checks: int = Field(
        20, ge=1, description="Checks of a kind (canaries, re-orderings) before it can decide."
    )
    judge_gate_min_canary_pass: float = Field(
        0.8,
        ge=0,
        le=1,
        description="Canary pass rate a judge needs: held when the 95% Wilson upper bound of its "
        "rate is below this.",
    )
    judge_gate_min_self_tau: float = Field(
        0.5,
        ge=-1,
        le=1,
        description="Mean Kendall's tau between two orderings a judge needs: held when its 95% "
        "upper bound (mean + 1.96 standard errors) is below this.",
    )
    judge_gate_window: int = Field(
        200, ge=1, description="Newest checks per judge model and rubric the gate reads."
    )
    judge_gate_hold_unchecked: bool = Field(
        True,
        description="Hold a judge's scores while a kind of check has fewer than "
        "RLPROXY_JUDGE_GATE_MIN_CHECKS checks (its first groups: checks are front-loaded); they "
        "are judged again once the judge passes. Off: a judge trains from its first group.",
    )
    judge_gate_hold_undecided: bool = Field(
        False,
        description="Also hold scores while a kind with enough checks cannot decide (its 95% "
        "bounds straddle the threshold). Off: such a judge trains.",
    )
    judge_drift_window: int = Field(
        50,
        ge=1,
        description="Drift alarm: the newest this many judged groups against the ones before.",
    )
    judge_drift_reward_rise: float = Field(
        0.1, ge=0, description="Drift alarm: a rise of the mean reward that counts as climbing."
    )
    judge_drift_canary_drop: float = Field(
        0.2, ge=0, le=1, description="Drift alarm: a fall of the canary pass rate that collapses."
    )
    judge_drift_length_ratio: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Drift alarm: completion lengths (median, or spread) at or below this share "
        "of before count as collapsed.",
    )

    # --- base model -----------------------------------------------------------------------
    # Which model is served and trained (proxy/engines/loader.py) and how its tool calls are
    # written (proxy/chat/tool_formats.py). Prompts always go through the model's chat template.
    base_model: str | None = Field(
        None,
        description="The base model: a local Hugging Face folder (config, weights, tokenizer "
        "with a chat template), a .gguf file (converted once to fp32 under the model cache), or "
        "a hub id such as `Qwen/Qwen2.5-0.5B-Instruct` (downloaded only then, if the hub is "
        "reachable). Unset: the embedded SmolLM2-135M-Instruct.",
    )
    tool_format: Literal["auto", "hermes", "llama3_json"] = Field(
        "auto",
        description="How the model writes tool calls: `hermes` (`<tool_call>{...}</tool_call>`: "
        'Qwen2.5/3, SmolLM2), `llama3_json` (`{"name": ..., "parameters": ...}`: Llama 3.1+), '
        "or `auto`: read from the chat template (Hermes when it has no tool markup).",
    )

    # --- vllm engine ----------------------------------------------------------------------
    # The policy's tokens from vLLM servers instead of the embedded model (proxy/engines/vllm.py;
    # README, "vLLM", says how to start them).
    engine: Literal["local", "vllm"] = Field(
        "local",
        description="What generates the policy's tokens: the embedded model (`local`) or the vLLM "
        "servers in RLPROXY_VLLM_URLS (`vllm`).",
    )
    vllm_urls: list[str] = Field(
        default_factory=list,
        description="Base URLs of the vLLM OpenAI servers (replicas of one model), e.g. "
        '["http://gpu-a:8000", "http://gpu-b:8000"]; each conversation goes to one of them '
        "(RLPROXY_VLLM_AFFINITY), else to the one with the least outstanding work.",
    )
    vllm_model: str | None = Field(
        None,
        description="The base model's served name on the vLLM servers (default: the first base "
        "model their /v1/models lists).",
    )
    vllm_data_dir: str | None = Field(
        None,
        description="The data directory as the vLLM machines see it (a shared volume mounted "
        "elsewhere): adapter paths under RLPROXY_DATA_DIR are rewritten to it. Default: the "
        "same path.",
    )
    vllm_health_interval_s: float = Field(
        2.0,
        gt=0,
        description="How often each vLLM server's /health is probed; a failing one leaves the "
        "rotation and comes back (its adapters reloaded first) once it answers.",
    )
    vllm_timeout_s: float = Field(
        600.0, gt=0, description="Longest wait for the next bytes of a vLLM answer, in seconds."
    )
    vllm_affinity: bool = Field(
        True,
        description="Send every turn of a conversation to the same vLLM server, whose prefix "
        "cache holds its history (keyed by the trajectory id, a coding agent's session header, or "
        "the task signature: system prompt, first user message, tools; docs/vllm-engine.md). "
        "Off: every request goes to the server with the least outstanding work.",
    )
    vllm_affinity_slack: int = Field(
        4,
        ge=0,
        description="How many more requests in flight a conversation's vLLM server may have than "
        "the least busy one before the conversation's next request goes to the least busy one "
        "instead (its prefix is then prefilled there).",
    )

    # --- rollout --------------------------------------------------------------------------
    rollout: bool = Field(
        False,
        description="Canary rollout: a new adapter version first serves RLPROXY_ROLLOUT_SHARE of "
        "the policy name's conversations beside the active one, and takes over only once groups "
        "scored with both show it is not worse; a worse one is rolled back and rejected. Off: "
        "each new version serves everything as soon as it loads.",
    )
    rollout_share: float = Field(
        0.25, gt=0, lt=1, description="Share of the policy name's conversations a canary serves."
    )
    rollout_margin: float = Field(
        0.05,
        ge=0,
        description="Non-inferiority margin, in reward units: a canary whose mean reward is "
        "shown to be at most this much below the active version's (within the same groups) "
        "is promoted.",
    )
    rollout_alpha: float = Field(
        0.05,
        gt=0,
        lt=0.5,
        description="Error rate of the rollout's test over all its looks (each look gets "
        "alpha / looks).",
    )
    rollout_min_groups: int = Field(
        8,
        ge=2,
        description="Scored groups holding both versions needed before the first decision; the "
        "test looks again at twice, four times ... this many, up to RLPROXY_ROLLOUT_MAX_GROUPS.",
    )
    rollout_max_groups: int = Field(
        64,
        ge=2,
        description="At this many mixed groups the rollout decides: a canary not shown to be "
        "non-inferior by then is rolled back.",
    )

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.engine == "vllm" and not self.vllm_urls:
            raise ValueError(
                'RLPROXY_ENGINE=vllm needs RLPROXY_VLLM_URLS, e.g. ["http://127.0.0.1:8001"]'
            )
        if self.rollout_max_groups < self.rollout_min_groups:
            raise ValueError(
                f"RLPROXY_ROLLOUT_MAX_GROUPS ({self.rollout_max_groups}) must be >= "
                f"RLPROXY_ROLLOUT_MIN_GROUPS ({self.rollout_min_groups})"
            )
        if self.group_max_size < self.group_min_size:
            raise ValueError(
                f"RLPROXY_GROUP_MAX_SIZE ({self.group_max_size}) must be at least "
                f"RLPROXY_GROUP_MIN_SIZE ({self.group_min_size})"
            )
        if self.adapter_poll_s >= self.lease_s / 3:
            raise ValueError(
                f"RLPROXY_ADAPTER_POLL_S ({self.adapter_poll_s}) must be under a third of "
                f"RLPROXY_LEASE_S ({self.lease_s}): each poll renews the publisher lease and "
                "writes this replica's heartbeat; lower the poll or lengthen the lease"
            )
        for name in self.upstream_models:
            if name == self.model_name or name.startswith(f"{self.model_name}@"):
                raise ValueError(
                    f"upstream model {name!r} clashes with the policy name {self.model_name!r}; "
                    "rename it in RLPROXY_UPSTREAM_MODELS"
                )
            if name in self.aliases:
                raise ValueError(
                    f"{name!r} is both an alias of the policy and an upstream model; remove it "
                    "from RLPROXY_ALIASES or from RLPROXY_UPSTREAM_MODELS"
                )
        return self

    @property
    def public_bind(self) -> bool:
        """True when the server listens beyond loopback (then it needs API keys)."""
        return not _is_loopback(self.host)

    @property
    def resolved_default_max_tokens(self) -> int | None:
        """The budget of a request that sends none (`default_max_tokens`): as set, else
        EMBEDDED_DEFAULT_MAX_TOKENS on the embedded model, else None (what the context leaves)."""
        if self.default_max_tokens is not None:
            return self.default_max_tokens
        return EMBEDDED_DEFAULT_MAX_TOKENS if self.base_model is None else None

    @property
    def base_model_name(self) -> str:
        """How `/health` and `GET /v1/models` name the base model: RLPROXY_BASE_MODEL as given."""
        return self.base_model or "SmolLM2-135M-Instruct (embedded)"

    @property
    def checkpoints_dir(self) -> Path:
        return self.data_dir / "checkpoints" / self.model_name

    @property
    def sqlite_path(self) -> Path:
        return self.data_dir / "rlproxy.db"

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite+aiosqlite:///{self.sqlite_path}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
