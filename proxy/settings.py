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


class UpstreamTarget(BaseModel):
    """Where one upstream model name is forwarded (through litellm)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="litellm target, `provider/model` (e.g. `openai/gpt-4o-mini`).")
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
    max_n: int = Field(8, ge=1, description="Largest `n` (choices per request) accepted.")
    default_max_tokens: int = Field(
        512, ge=1, description="Completion budget when the request sets none."
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
        600,
        ge=0,
        description="Requests per minute each caller (API key, else client address) may send to "
        "/v1/*, as a token bucket that holds a minute's worth; beyond it: 429 (0: no limit).",
    )
    caller_concurrency: int = Field(
        64,
        ge=0,
        description="Requests to /v1/* one caller may have in flight, streamed bodies included; "
        "beyond it: 429 (0: no limit).",
    )
    max_queued_rows: int = Field(
        64,
        ge=0,
        description="Rows (choices) waiting for a place in the local engine's batch; a request "
        "that would queue more is refused with a 429 before it starts (0: no bound).",
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
        False,
        description="Last resort: a trajectory whose task group stays alone past the window joins "
        "a cohort of the same agent (same system prompt and tools).",
    )
    scoring: bool = Field(
        True, description="Score ready groups with RULER in the background while serving."
    )
    scoring_interval_s: float = Field(
        5.0, gt=0, description="How often the background scorer looks for ready groups."
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
        None, description="RULER's rubric for every group (default: the built-in rubric)."
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
    trainer_command: list[str] | None = Field(
        None,
        description="The command line of serve's trainer child (default: this interpreter's "
        '`-m proxy.cli train`), e.g. ["nice", "-n", "10", "/opt/rlproxy/bin/rlproxy", "train"].',
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
        2.0, gt=0, description="How often serving looks for new adapter versions to publish."
    )
    reward_policy: Literal["explicit", "ruler"] = Field(
        "explicit",
        description="Which reward training uses when a trajectory has both: the explicit one "
        "posted by the environment, or RULER's score. Both stay stored and visible.",
    )

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.group_max_size < self.group_min_size:
            raise ValueError(
                f"RLPROXY_GROUP_MAX_SIZE ({self.group_max_size}) must be at least "
                f"RLPROXY_GROUP_MIN_SIZE ({self.group_min_size})"
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
