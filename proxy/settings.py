"""rlproxy's settings: pydantic-settings classes by concern, every variable prefixed `RLPROXY_`.

`Settings` holds what serving itself needs (bind, data, names, the local engine, adapters, base
model) and one sub-model per concern: `judge`, `judge_checks`, `groups`, `rollout`,
`forgetting`, `vllm`, `limits`, `telemetry`, `trainer`. Each concern reads its own variables
(its `env_prefix`, or a `validation_alias` where a variable's name does not share the prefix),
so every variable has one name, e.g. `RLPROXY_PORT=9000`, `RLPROXY_JUDGE_MODEL=openai/o3`
(`settings.judge.model`), `RLPROXY_ALIASES='["gpt-4o-mini"]'`. Each concern builds the typed
configuration of the part it sets (`JudgeChecksSettings.config`, `GroupSettings.grouper`, ...),
in one place. The canary rollout's and the forgetting check's are built in their own room
(`proxy.adapters.rollout.rollout_config`, `proxy.adapters.forgetting.forgetting_config`) and the
request limits from `LimitSettings.request_bounds`: proxy.engines imports this module and may
import neither room.

Built by the app factory or the CLI, never at import time; a value out of bounds, or a key of
`RLPROXY_TRAINER` that `TrainerConfig` does not know, stops the build (`error_lines` words it by
variable). `unknown_variables` names the `RLPROXY_` variables that are none of these.
"""

from __future__ import annotations

import difflib
import ipaddress
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from trainer.config import TrainerConfig

if TYPE_CHECKING:
    from storage.grouping import SignatureGrouper
    from trainer.scoring import CanaryKind, JudgeChecksConfig, ScoringConfig

EMBEDDED_DEFAULT_MAX_TOKENS = 512
"""The budget of a request that sends none on the embedded SmolLM2-135M (`default_max_tokens`)."""

EMBEDDED_CONTEXT = 8192
"""The embedded SmolLM2-135M's context in tokens (its config's `max_position_embeddings`), for
what does not load it (`rlproxy status`); the engines read the loaded model's config."""

NOT_SETTINGS = frozenset(
    {
        "RLPROXY_BOOTSTRAP_KEY",  # deploy/entrypoint.sh: the container's first admin key
        "RLPROXY_BOOTSTRAP_KEY_FILE",
        "RLPROXY_TRAINER_PARENT_PID",  # set by serve for its trainer child (proxy/trainer_child.py)
        "RLPROXY_API_KEY",  # the key coding agents send (docs/quickstart/coding-agents.md)
        "RLPROXY_IMAGE",  # deploy/compose.yaml's own variables
        "RLPROXY_TRAINER_GPU_IMAGE",
        "RLPROXY_ENV_FILE",
        "RLPROXY_MODELS_DIR",
        "RLPROXY_PUBLISH",
        "RLPROXY_REPLICA_A",
        "RLPROXY_REPLICA_B",
        "RLPROXY_TEST_MODEL_DIR",  # tests and tools
        "RLPROXY_TEST_POSTGRES_URL",
        "RLPROXY_TEST_REDIS_URL",
        "RLPROXY_VLLM_VENV",
        "RLPROXY_CLI_CACHE",
        "RLPROXY_FUZZ_EXAMPLES",
        "RLPROXY_CONTAINERS_DIR",
        "RLPROXY_COMPOSE_HELPER_PIDS",
        "RLPROXY_DEPLOY_IMAGE",
        "RLPROXY_DEPLOY_REUSE_IMAGE",
        "RLPROXY_DEPLOY_VLLM_IMAGE",
    }
)
"""`RLPROXY_` variables that are not settings: read by the container, compose, tests or tools."""


class UpstreamTarget(BaseModel):
    """Where one upstream model name is forwarded: `openai/...` targets straight to the
    OpenAI-compatible server over HTTP, every other provider through litellm."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="litellm target, `provider/model` (e.g. `openai/gpt-4o-mini`).")
    via: Literal["auto", "litellm"] = Field(
        default="auto",
        description="`auto`: an `openai/` target is called directly (pooled HTTP client, "
        "streams passed through chunk by chunk), any other provider through litellm; "
        "`litellm`: always through litellm.",
    )
    api_base: str | None = Field(
        default=None, description="Base URL of an OpenAI-compatible server."
    )
    api_key_env: str | None = Field(
        default=None,
        description="Name of the server's environment variable that holds the provider key "
        "(default: the provider's usual one, e.g. OPENAI_API_KEY). Never taken from a request.",
    )


class Concern(BaseSettings):
    """The settings of one concern: its variables are its `env_prefix` and the field's name, or
    the field's `validation_alias`. Keyword arguments take field names."""

    model_config = SettingsConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True)
    title: ClassVar[str]
    """The heading of the concern's section in docs/reference/settings.md."""

    @classmethod
    def env_names(cls) -> dict[str, str]:
        """Field name -> the environment variable that sets it."""
        return {name: env_name(cls, name, info) for name, info in cls.model_fields.items()}


class JudgeSettings(Concern):
    """RULER's judge and when it scores (trainer/scoring/)."""

    model_config = SettingsConfigDict(env_prefix="RLPROXY_JUDGE_")
    title = "Judge and scoring"

    scoring: bool | Literal["auto"] = Field(
        default="auto",
        validation_alias="RLPROXY_SCORING",
        description="Score ready groups with RULER in the background while serving. `auto`: "
        "only while something uses the scores (a trainer here, on another replica or a running "
        "`rlproxy train` on the database, or telemetry that receives scores); otherwise ready "
        "groups wait, unscored and never lost (`rlproxy score` scores them on demand). `true`: "
        "always. `false`: never; groups still form, and those whose every member has an "
        "explicit reward are scored from the rewards and trained on (no judge).",
    )
    scoring_interval_s: float = Field(
        default=5.0,
        validation_alias="RLPROXY_SCORING_INTERVAL_S",
        gt=0,
        description="How often groups are formed (scoring on or off) and the background scorer "
        "looks for ready groups.",
    )
    scoring_lease_s: float = Field(
        default=60.0,
        validation_alias="RLPROXY_SCORING_LEASE_S",
        gt=0,
        description="A group being judged is leased to its replica for this long, renewed every "
        "third of it while the judge works; another replica takes it back only once the lease "
        "has run out (its scorer died).",
    )
    retry_s: float = Field(
        default=900.0,
        gt=0,
        description="A judge that failed its checks (the gate holds it, or its canaries cannot "
        "reach the pass rate even at their 95% upper bound) judges one group this often, to notice "
        "a fix, instead of every ready group; the others wait, unscored and never lost.",
    )
    model: str | None = Field(
        default=None,
        description="RULER's judge: any litellm model (`openai/o3`, `anthropic/...`). Unset: the "
        "local model judges, a placeholder for trying things out, not a useful judge.",
    )
    api_base: str | None = Field(
        default=None,
        description="Base URL of an OpenAI-compatible judge server (with `openai/<name>`).",
    )
    api_key_env: str | None = Field(
        default=None,
        description="Environment variable holding the judge provider's key (default: the "
        "provider's usual one, e.g. OPENAI_API_KEY).",
    )
    timeout_s: float = Field(default=120.0, gt=0, description="Timeout of one judge call.")
    rubric: str | None = Field(
        default=None,
        description="The judge's rubric for every group (default: the built-in rubric of "
        "RLPROXY_JUDGE_MODE).",
    )
    rubrics: dict[str, str] = Field(
        default_factory=dict,
        description="Rubric per group: keyed by explicit group key, or by `agent:<system prompt>`.",
    )
    explicit_groups: bool = Field(
        default=False,
        description="Also call the judge for groups whose members all have explicit rewards "
        "(by default those are used as they are, with no judge call).",
    )
    mode: Literal["group", "turns"] = Field(
        default="group",
        description="How the judge scores a group. `group`: RULER, one call compares the members "
        "(members of different tasks each against its own task). `turns`: each assistant turn "
        "is judged good (+1), neutral (0) or bad (-1) from what came next (the tool result, the "
        "user's reply; the last turn on the final state) by majority of RLPROXY_JUDGE_VOTES "
        "calls, and a member scores its mean verdict mapped to 0..1: members x turns x votes "
        "judge calls per group (docs/concepts/ruler.md).",
    )
    votes: int = Field(
        default=3,
        ge=1,
        le=15,
        description="Judge calls per turn with RLPROXY_JUDGE_MODE=turns; the turn's verdict is "
        "their majority, neutral on a tie. Votes differ only where the judge samples: 1 suits a "
        "greedy judge such as the local one.",
    )

    def scoring_config(self, checks: JudgeChecksConfig | None, reward_policy: str) -> ScoringConfig:
        """The scorer's configuration: this judge, the judge checks and the reward policy."""
        from trainer.scoring import DEFAULT_RUBRIC, ScoringConfig

        return ScoringConfig(
            rubric=self.rubric or DEFAULT_RUBRIC,
            rubrics=dict(self.rubrics),
            mode=self.mode,
            votes=self.votes,
            judge_explicit_groups=self.explicit_groups,
            reward_policy=reward_policy,
            lease_s=self.scoring_lease_s,
            checks=checks,
            retry_s=self.retry_s,
        )


class JudgeChecksSettings(Concern):
    """Keeping the judge honest (trainer/scoring/judge_checks.py): canaries, self-agreement,
    agreement with the environment, a gate on training, a drift alarm. Figures: GET /rl/judge."""

    model_config = SettingsConfigDict(env_prefix="RLPROXY_JUDGE_")
    title = "Judge checks"

    enabled: bool = Field(
        default=True,
        validation_alias="RLPROXY_JUDGE_CHECKS",
        description="Run the judge checks below (false: judge as before, no checks).",
    )
    canary_share: float = Field(
        default=0.2,
        ge=0,
        le=1,
        description="Share of judged groups that get one extra synthetic member made from a real "
        "one and no better than it, never trained on. The check is pairwise: it passes when the "
        "judge scores the canary at or below the member it was made from, and fails above it or "
        "when every score is the same.",
    )
    canary_kinds: str = Field(
        default="declined",
        description="Canary kinds drawn in rotation, comma-separated: declined (the task answered "
        "with a refusal, no tool call: no better than any attempt under every reward met so "
        "far), empty, refusal, copied, truncated (each replaces only the final answer: right "
        "only where a complete final answer is what is judged; an empty reply beats a wordy "
        "wrong one under a reward that pays for brevity).",
    )
    position_share: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="Share of judged groups judged a second time with the members in reverse "
        "order; Kendall's tau between the two is the judge's self-agreement.",
    )
    gate: bool = Field(
        default=True,
        description="Hold (never train on) scores from a judge whose canary pass rate or "
        "self-agreement is shown to be below its threshold.",
    )
    gate_min_checks: int = Field(
        default=20,
        ge=1,
        description="Checks of a kind (canaries, re-orderings) before it can decide.",
    )
    gate_max_checks: int = Field(
        default=60,
        ge=1,
        description="Checks of a kind at which it decides by its point estimate when its 95% "
        "bounds have not: every kind decides within this many checks.",
    )
    gate_min_canary_pass: float = Field(
        default=0.7,
        ge=0,
        le=1,
        description="Canary pass rate a judge needs (a judge right on a share p of pairs passes "
        "about p of them, a coin flip half): held when the 95% Wilson upper bound of its rate "
        "is below this, passed when the lower bound reaches it.",
    )
    gate_min_self_tau: float = Field(
        default=0.25,
        ge=-1,
        le=1,
        description="Mean Kendall's tau between two orderings a judge needs (about (2p - 1)^2 at "
        "pair accuracy p: 0.25 is p = 0.75): held when its 95% upper bound (mean + 1.96 "
        "standard errors) is below this, passed when the lower bound reaches it.",
    )
    gate_window: int = Field(
        default=200,
        ge=1,
        description="Newest checks of each kind (canaries, re-orderings) per judge model and "
        "rubric the gate reads; agreement with environment rewards: the newest this many groups.",
    )
    gate_hold_unchecked: bool = Field(
        default=True,
        description="Hold a judge's scores while a kind of check has fewer than "
        "RLPROXY_JUDGE_GATE_MIN_CHECKS checks (its first groups: checks are front-loaded); they "
        "are judged again once the judge passes. Off: a judge trains from its first group.",
    )
    gate_hold_undecided: bool = Field(
        default=True,
        description="Also hold scores while a kind with enough checks cannot decide yet (its "
        "95% bounds straddle the threshold; it decides by RLPROXY_JUDGE_GATE_MAX_CHECKS). "
        "Off: such a judge trains.",
    )
    drift_window: int = Field(
        default=50,
        ge=1,
        description="Drift alarm: the newest this many judged groups against the ones before.",
    )
    drift_reward_rise: float = Field(
        default=0.1,
        ge=0,
        description="Drift alarm: a rise of the mean reward that counts as climbing.",
    )
    drift_canary_drop: float = Field(
        default=0.2,
        ge=0,
        le=1,
        description="Drift alarm: a fall of the canary pass rate that collapses.",
    )
    drift_length_ratio: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="Drift alarm: completion lengths (median, or spread) at or below this share "
        "of before count as collapsed.",
    )

    @field_validator("canary_kinds")
    @classmethod
    def _known_kinds(cls, value: str) -> str:
        from trainer.scoring import CANARY_KINDS

        kinds = [k.strip() for k in value.split(",") if k.strip()]
        unknown = [k for k in kinds if k not in CANARY_KINDS]
        if not kinds or unknown:
            raise ValueError(
                f"RLPROXY_JUDGE_CANARY_KINDS must list one or more of {', '.join(CANARY_KINDS)}"
                + (f"; unknown: {', '.join(unknown)}" if unknown else "")
            )
        return ",".join(kinds)

    def canary_kind_list(self) -> tuple[CanaryKind, ...]:
        """RLPROXY_JUDGE_CANARY_KINDS as the kinds (checked when the settings were read)."""
        return cast("tuple[CanaryKind, ...]", tuple(k for k in self.canary_kinds.split(",") if k))

    def config(self) -> JudgeChecksConfig | None:
        """The judge checks' configuration; None when they are off."""
        from trainer.scoring import JudgeChecksConfig

        if not self.enabled:
            return None
        return JudgeChecksConfig(
            canary_share=self.canary_share,
            canary_kinds=self.canary_kind_list(),
            position_share=self.position_share,
            gate=self.gate,
            min_checks=self.gate_min_checks,
            max_checks=self.gate_max_checks,
            min_canary_pass=self.gate_min_canary_pass,
            min_self_tau=self.gate_min_self_tau,
            window=self.gate_window,
            hold_unchecked=self.gate_hold_unchecked,
            hold_undecided=self.gate_hold_undecided,
            drift_window=self.drift_window,
            drift_reward_rise=self.drift_reward_rise,
            drift_canary_drop=self.drift_canary_drop,
            drift_length_ratio=self.drift_length_ratio,
        )


class GroupSettings(Concern):
    """Which trajectories are compared with each other, and when a group is ready to score."""

    model_config = SettingsConfigDict(env_prefix="RLPROXY_GROUP_")
    title = "Groups"

    shadow_samples: int = Field(
        default=0,
        validation_alias="RLPROXY_SHADOW_SAMPLES",
        ge=0,
        le=16,
        description="Shadow sampling: generate this many answers per eligible turn in one "
        "batch, return one at random, store all as a group (0 or 1: off).",
    )
    shadow_turns: Literal["first", "every"] = Field(
        default="first",
        validation_alias="RLPROXY_SHADOW_TURNS",
        description="Which turns get shadow samples: the first of a trajectory, or every.",
    )
    min_size: int = Field(
        default=4, ge=2, description="A group with this many closed members is ready to be scored."
    )
    max_size: int = Field(
        default=8,
        ge=2,
        description="Larger groups are split into parts of at most this many members.",
    )
    window_s: float = Field(
        default=600.0,
        gt=0,
        description="After this long, a group with at least 2 members is ready.",
    )
    cohort: bool = Field(
        default=True,
        description="A trajectory whose task group is still alone after RLPROXY_GROUP_ALONE_S "
        "joins a cohort of the same agent (same key, system prompt with dates, paths and "
        "numbers masked, tool names), so traffic whose every task is new trains. Cohort "
        "advantages use a leave-one-out baseline (docs/concepts/groups.md). False: lone tasks "
        "wait for a repeat.",
    )
    alone_s: float = Field(
        default=60.0,
        ge=0,
        description="How long a task seen once waits for another run of the same task before it "
        "joins its agent's cohort.",
    )

    @model_validator(mode="after")
    def _check(self) -> GroupSettings:
        if self.max_size < self.min_size:
            raise ValueError(
                f"RLPROXY_GROUP_MAX_SIZE ({self.max_size}) must be at least "
                f"RLPROXY_GROUP_MIN_SIZE ({self.min_size})"
            )
        return self

    def grouper(self) -> SignatureGrouper:
        """Which group a closed trajectory joins and when a group is ready."""
        from storage.grouping import SignatureGrouper

        return SignatureGrouper(
            min_size=self.min_size,
            max_size=self.max_size,
            window_s=self.window_s,
            cohort=self.cohort,
            alone_s=self.alone_s,
        )


class RolloutSettings(Concern):
    """Canary rollout of new adapter versions (proxy/adapters/rollout.py)."""

    model_config = SettingsConfigDict(env_prefix="RLPROXY_ROLLOUT_")
    title = "Canary rollout"

    enabled: bool = Field(
        default=True,
        validation_alias="RLPROXY_ROLLOUT",
        description="Canary rollout (the guard): a new adapter version first serves "
        "RLPROXY_ROLLOUT_SHARE of the policy name's conversations beside the active one, and "
        "takes over only once groups scored with both show it is not harmful; a harmful one is "
        "rolled back and rejected. Off: each new version serves everything as soon as it loads.",
    )
    share: float = Field(
        default=0.25,
        gt=0,
        lt=1,
        description="Share of the policy name's conversations a canary serves.",
    )
    margin: float = Field(
        default=0.2,
        gt=0,
        description="How much worse counts as harmful, in reward units: the test weighs 'the "
        "canary's mean reward is this much below the active version's, in the same groups' "
        "against 'it is as good'.",
    )
    alpha: float = Field(
        default=0.05,
        gt=0,
        lt=0.5,
        description="The chance the test rolls back a version as good as the active one.",
    )
    beta: float = Field(
        default=0.1,
        gt=0,
        lt=0.5,
        description="The chance the test promotes a version worse by RLPROXY_ROLLOUT_MARGIN.",
    )
    min_groups: int = Field(
        default=4,
        ge=2,
        description="Scored groups holding both versions needed before the first decision; "
        "from then on the test looks after every new group.",
    )
    max_groups: int = Field(
        default=32,
        ge=2,
        description="At this many mixed groups the test decides for the likelier of 'harmful' "
        "and 'as good'.",
    )
    max_calls: int = Field(
        default=200,
        ge=1,
        description="The most calls a canary serves on trial (the harm it can do is bounded by "
        "this and the share): then it takes no new conversations and is decided on the "
        "evidence of those it served.",
    )
    evidence_wait_s: float = Field(
        default=600.0,
        gt=0,
        description="A canary paused at its call budget is decided once no new evidence has "
        "come for this long (rolled back if it has too little to show it is not harmful).",
    )
    close_budget: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="Promote a canary at once, before any reward, when its answers are provably "
        "close to the active version's on the newest trajectories it served: the bound on how "
        "much worse it can be (total variation from the KL of the two versions' answers, "
        "Pinsker), plus that of the versions promoted this way since the last reward-tested "
        "one, is within this many reward units. Local engine only; 0: always wait for rewards.",
    )

    watch_share: float = Field(
        default=0.1,
        ge=0,
        lt=0.5,
        description="The watch: while a trained version serves the policy name, this share of "
        "its other conversations is answered by the base model, and the two are compared on "
        "the groups holding both (the canary's test, with RLPROXY_ROLLOUT_WATCH_ALPHA); when "
        "what serves proves harmful against the base it is rolled back to the base, with every "
        "version on its lineage that served, and the trainer starts again from fresh weights. "
        "It catches what the canary test cannot: a version promoted on wrong rewards (a burst "
        "of them rewards the worse answer). 0: no watch.",
    )
    watch_alpha: float = Field(
        default=0.01,
        gt=0,
        lt=0.5,
        description="The watch's chance of rolling back a version as good as the base, per "
        "stretch of evidence (it starts afresh each time the test finds 'as good').",
    )

    @model_validator(mode="after")
    def _check(self) -> RolloutSettings:
        if self.max_groups < self.min_groups:
            raise ValueError(
                f"RLPROXY_ROLLOUT_MAX_GROUPS ({self.max_groups}) must be >= "
                f"RLPROXY_ROLLOUT_MIN_GROUPS ({self.min_groups})"
            )
        return self


class ForgettingSettings(Concern):
    """The forgetting check of new adapter versions (proxy/adapters/forgetting.py)."""

    model_config = SettingsConfigDict(env_prefix="RLPROXY_FORGETTING_")
    title = "Forgetting check"

    enabled: bool = Field(
        default=True,
        validation_alias="RLPROXY_FORGETTING_CHECK",
        description="Before a new adapter version serves (or goes on canary), compare it with "
        "the base model on the general prompts that ship with rlproxy: the base's greedy "
        "answers teacher-forced through both, KL(base || version) per answer token. A version "
        "over RLPROXY_FORGETTING_MAX_KL is held: recorded, never served; what served before "
        "keeps serving. The vllm engine cannot run it (no whole distributions over its API) "
        "and says so for each version. False: versions serve without the check (a held one "
        "serves only if activated by hand, POST /rl/adapters/N/activate).",
    )
    max_kl: float = Field(
        default=0.4,
        gt=0,
        description="A version whose mean KL(base || version) over the general prompts' answer "
        "tokens is above this (nats per token) is held. Measured on the embedded model: trained "
        "versions that still answered general prompts stayed at or under 0.26, versions that "
        "no longer did (bare numbers, repetition, word salad) started at 0.65 "
        "(bench/results/forgetting_threshold.json).",
    )
    answer_tokens: int = Field(
        default=32,
        ge=1,
        le=256,
        description="Greedy tokens of the base's answer to each general prompt that the check "
        "compares (the base's answers are generated once per process).",
    )


class EvalSettings(Concern):
    """The held-out evaluation of the user's own traffic (storage/held_out.py,
    proxy/adapters/evaluation.py; `rlproxy eval`)."""

    model_config = SettingsConfigDict(env_prefix="RLPROXY_EVAL_")
    title = "Held-out evaluation"

    share: float = Field(
        default=0.1,
        ge=0,
        le=0.5,
        description="Share of tasks (by API key, agent and task signature, a stable hash) kept "
        "out of training to measure versions on: their trajectories are stored, served and "
        "rewarded as usual but never join a group, and half of them (another stable draw) are "
        "answered by the base model when they ask for the policy name, the other half as any "
        "call. `rlproxy eval`, `rlproxy status`, GET /rl/eval and the dashboard compare each "
        "version's rewards on them with the base's over the same hours. 0: no task is drawn "
        "(calls a client marks held out with X-RLProxy-Held-Out still are).",
    )


class VLLMSettings(Concern):
    """The policy's tokens from vLLM servers instead of the embedded model, with
    RLPROXY_ENGINE=vllm (proxy/engines/vllm.py; README, "vLLM", says how to start them)."""

    model_config = SettingsConfigDict(env_prefix="RLPROXY_VLLM_")
    title = "vLLM engine"

    urls: list[str] = Field(
        default_factory=list,
        description="Base URLs of the vLLM OpenAI servers (replicas of one model), e.g. "
        '["http://gpu-a:8000", "http://gpu-b:8000"]; each conversation goes to one of them '
        "(RLPROXY_VLLM_AFFINITY), else to the one with the least outstanding work.",
    )
    model: str | None = Field(
        default=None,
        description="The base model's served name on the vLLM servers (default: the first base "
        "model their /v1/models lists).",
    )
    data_dir: str | None = Field(
        default=None,
        description="The data directory as the vLLM machines see it (a shared volume mounted "
        "elsewhere): adapter paths under RLPROXY_DATA_DIR are rewritten to it. Default: the "
        "same path.",
    )
    health_interval_s: float = Field(
        default=2.0,
        gt=0,
        description="How often each vLLM server's /health is probed; a failing one leaves the "
        "rotation and comes back (its adapters reloaded first) once it answers.",
    )
    timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="Longest wait for the next bytes of a vLLM answer, in seconds.",
    )
    affinity: bool = Field(
        default=True,
        description="Send every turn of a conversation to the same vLLM server, whose prefix "
        "cache holds its history (keyed by the trajectory id, a coding agent's session header, or "
        "the task signature: system prompt, first user message, tools; docs/vllm-engine.md). "
        "Off: every request goes to the server with the least outstanding work.",
    )
    affinity_slack: int = Field(
        default=4,
        ge=0,
        description="How many more requests in flight a conversation's vLLM server may have than "
        "the least busy one before the conversation's next request goes to the least busy one "
        "instead (its prefix is then prefilled there).",
    )


class LimitSettings(Concern):
    """Bounds on what one request or one caller may ask for. Each is answered with an
    OpenAI-shaped 4xx before any work is done (429s with `retry-after`)."""

    model_config = SettingsConfigDict(env_prefix="RLPROXY_")
    title = "Limits"

    max_body_bytes: int = Field(
        default=8 * 2**20,
        ge=1024,
        description="Largest request body accepted, in bytes (larger: 413 before parsing).",
    )
    max_n: int = Field(default=8, ge=1, description="Largest `n` (choices per request) accepted.")
    max_messages: int = Field(
        default=2048, ge=1, description="Most messages one chat request may carry (OpenAI's limit)."
    )
    max_schema_depth: int = Field(
        default=32,
        ge=1,
        description="Deepest nesting of objects and arrays in a tool's parameters or a "
        "response_format schema (32 is about 15 levels of nested object properties).",
    )
    max_schema_nodes: int = Field(
        default=10_000,
        ge=1,
        description="Most JSON values in all of a request's schemas together (tool parameters "
        "and response_format), a bound on the grammar compiled from them (~0.4 s at most).",
    )
    caller_requests_per_minute: int = Field(
        default=3600,
        ge=0,
        description="Requests per minute each API key may send to /v1/*, as a token bucket that "
        "holds a minute's worth (60 a second sustained by default); beyond it: 429 (0: no "
        "limit). Requests without a key count only with RLPROXY_CALLER_ADDRESS_LIMITS.",
    )
    caller_concurrency: int = Field(
        default=64,
        ge=0,
        description="Requests to /v1/* one API key may have in flight, streamed bodies included; "
        "beyond it: 429 (0: no limit). Counted by each replica on its own.",
    )
    caller_address_limits: bool = Field(
        default=False,
        description="Also apply the two limits above to requests that carry no API key (open "
        "mode), counted per client address (behind a reverse proxy, name it in "
        "RLPROXY_TRUSTED_PROXIES). Off: without keys only the engine's queue bound "
        "(RLPROXY_MAX_QUEUED_ROWS) refuses work.",
    )
    redis_url: str | None = Field(
        default=None,
        description="Redis server for the per-caller request rate, shared by every replica that "
        "names it (redis://host:6379/0; rediss:// for TLS). Unset: each replica counts on its "
        "own. While Redis cannot be reached, each replica falls back to its own count.",
    )
    max_queued_rows: int = Field(
        default=64,
        ge=0,
        description="Rows (choices) waiting for a place in the local engine's batch, or sent to "
        "vLLM and still without a first token (the vllm engine); a request that would queue more "
        "is refused with a 429 before it starts (0: no bound).",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="A connection whose request line and headers are not complete this many "
        "seconds after it opens (or after the first byte of a later request on it) is closed "
        "(slowloris). Idle keep-alive connections are uvicorn's (5 s).",
    )

    def request_bounds(self) -> dict[str, int]:
        """The bounds on a request's shape, as `proxy.chat.request.RequestLimits`' fields."""
        return {
            "max_messages": self.max_messages,
            "max_schema_depth": self.max_schema_depth,
            "max_schema_nodes": self.max_schema_nodes,
        }


class TelemetrySettings(Concern):
    """What serving tells the outside (proxy/telemetry/). Where spans go is read from the
    standard variables, not from here: OTLP/HTTP with OTEL_EXPORTER_OTLP_ENDPOINT or
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, Langfuse with LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY
    and LANGFUSE_HOST."""

    model_config = SettingsConfigDict(env_prefix="RLPROXY_")
    title = "Telemetry"

    metrics_auth: Literal["open", "inference", "admin"] = Field(
        default="open",
        description="Who may scrape GET /metrics once API keys exist: anyone (`open`: the "
        "metrics hold counts, never prompt text), any key (`inference`), or an admin key.",
    )
    metrics_cache_s: float = Field(
        default=5.0,
        ge=0,
        description="How long /metrics reuses the figures it reads from the database "
        "(trajectories and groups by status, the trainer's newest step) before reading again.",
    )
    capture_content: bool = Field(
        default=False,
        validation_alias="RLPROXY_TELEMETRY_CAPTURE_CONTENT",
        description="Put request and response messages on chat spans (gen_ai.input.messages, "
        "gen_ai.output.messages; Langfuse's input and output). Off: spans hold ids and counts, "
        "no text. OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true turns it on too.",
    )


class TrainerSettings(Concern):
    """The GRPO trainer: whether serve runs it, its child process, and its configuration
    (`RLPROXY_TRAINER`, the fields of `trainer.config.TrainerConfig`, checked here)."""

    model_config = SettingsConfigDict(env_prefix="RLPROXY_TRAINER_")
    title = "Training"

    enabled: bool = Field(
        default=True,
        validation_alias="RLPROXY_TRAIN",
        description="Run the GRPO trainer in its own process beside the server (`rlproxy serve "
        "--no-train` or false: serve only).",
    )
    config: TrainerConfig = Field(
        default_factory=TrainerConfig,
        validation_alias="RLPROXY_TRAINER",
        description='Trainer configuration overrides, e.g. {"learning_rate": 1e-4}; the fields of '
        "trainer.config.TrainerConfig.",
    )
    poll_s: float = Field(
        default=5.0,
        gt=0,
        validation_alias="RLPROXY_TRAIN_POLL_S",
        description="How often the trainer looks for groups.",
    )
    nice: int = Field(
        default=10,
        ge=0,
        le=19,
        description="CPU priority of serve's trainer child, as `nice`: 10 leaves serving most of a "
        "shared core while a step runs (19: training only in what serving leaves; 0: equals).",
    )
    command: list[str] | None = Field(
        default=None,
        description="The command line of serve's trainer child (default: this interpreter's "
        '`-m proxy.cli train`), e.g. ["nice", "-n", "10", "/opt/rlproxy/bin/rlproxy", "train"].',
    )
    processes: int = Field(
        default=1,
        ge=1,
        description="Processes of serve's trainer child. Above 1 it trains data-parallel under "
        "torchrun (`torchrun --standalone --nproc-per-node N -m proxy.cli train`): gloo on CPU, "
        "NCCL with one GPU per process on CUDA. Ignored when RLPROXY_TRAINER_COMMAND is set.",
    )
    restart_s: float = Field(
        default=1.0,
        gt=0,
        description="A trainer child that exits is restarted after this delay, doubled after "
        "each exit in a row up to RLPROXY_TRAINER_RESTART_MAX_S.",
    )
    restart_max_s: float = Field(
        default=300.0,
        gt=0,
        description="The longest wait before restarting the trainer. A child that ran a minute "
        "(or this long, if longer) counts as healthy: its next exit waits "
        "RLPROXY_TRAINER_RESTART_S again.",
    )
    threads: int | None = Field(
        default=None,
        validation_alias="RLPROXY_TRAIN_THREADS",
        ge=1,
        description="Torch threads of the trainer process (serve's trainer defaults to 1 on CPU, "
        "leaving the other cores to serving; unset for a standalone `rlproxy train`: torch's "
        "default).",
    )

    @field_validator("config", mode="plain")
    @classmethod
    def _trainer_config(cls, value: Any) -> TrainerConfig:
        if isinstance(value, TrainerConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"must be a JSON object of TrainerConfig's fields, got {value!r}")
        try:
            return TrainerConfig.from_dict(value)
        except TypeError as e:  # a value of the wrong type: reported like any other bad value
            raise ValueError(str(e)) from e


class _TopLevelEnv(EnvSettingsSource):
    """`RLPROXY_<FIELD>` for `Settings`' own fields; each concern reads its own variables (so
    RLPROXY_ROLLOUT is the rollout's switch, not the whole concern as JSON)."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        if field_name in CONCERNS:
            return None, field_name, False
        return super().get_field_value(field, field_name)


class Settings(BaseSettings):
    """What serving itself needs (`RLPROXY_<FIELD>`), and one sub-model per concern."""

    model_config = SettingsConfigDict(env_prefix="RLPROXY_", extra="forbid")

    host: str = Field(default="127.0.0.1", description="Address the HTTP server binds to.")
    port: int = Field(default=8000, ge=1, le=65535, description="Port the HTTP server listens on.")
    data_dir: Path = Field(
        default=Path("rlproxy-data"),
        description="Database, checkpoints and the model cache live here.",
    )
    model_name: str = Field(
        default="rlproxy",
        description="The policy's served name; `NAME@base` and `NAME@N` derive from it.",
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
        default=None, description="Where the fp32 model cache lives (default: the data directory)."
    )
    database_url: str | None = Field(
        default=None,
        description="SQLAlchemy async URL; default sqlite+aiosqlite:///<data_dir>/rlproxy.db",
    )
    storage_probe_s: float = Field(
        default=5.0,
        gt=0,
        description="While the database cannot be written (disk full, read-only, unreachable), "
        "how often a tiny probe write tries it again; chat requests get a 503 until one commits.",
    )
    trajectory_idle_timeout_s: float = Field(
        default=600.0, gt=0, description="A trajectory with no new call for this long is closed."
    )
    retry_window_s: float = Field(
        default=10.0,
        ge=0,
        description="The same messages within this window after a failed attempt are a retry.",
    )
    default_max_tokens: int | None = Field(
        default=None,
        ge=1,
        description="The answer's budget when a request sets none (no `max_tokens`, "
        "`max_completion_tokens` or `max_output_tokens`), capped at what the context leaves "
        "after the prompt. Unset: what the context leaves (vLLM's rule; Codex sends no budget "
        "and treats a cut answer as an error), except on the embedded model: "
        f"{EMBEDDED_DEFAULT_MAX_TOKENS} (a 135M model at temperature 1 rarely stops, and its "
        "whole 8,192-token context takes minutes on a CPU).",
    )
    output_budget: Literal["fit", "strict"] = Field(
        default="fit",
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
        default=600.0, gt=0, description="Timeout of one upstream provider call, in seconds."
    )
    log_level: str = Field(default="INFO", description="Python logging level.")
    trusted_proxies: list[str] = Field(
        default_factory=list,
        description="Addresses of reverse proxies whose X-Forwarded-For names the client "
        '(e.g. ["127.0.0.1"]); by default the connecting address is the client.',
    )
    insecure_no_auth: bool = Field(
        default=False,
        description="Serve beyond loopback with no API keys (anyone who reaches the port may do "
        "anything). Without it, a public bind needs at least one key (`rlproxy keys create`).",
    )
    key_refresh_s: float = Field(
        default=5.0,
        gt=0,
        description="How often serving re-reads the API keys (a key created or revoked by "
        "`rlproxy keys` takes effect within this time).",
    )

    # --- local engine -------------------------------------------------------------------
    # The embedded model's batching, prefix cache and background work (proxy/engines/local.py).
    max_batch_size: int = Field(
        default=16, ge=1, description="Rows decoded together by the local engine."
    )
    prefill_tokens: int = Field(
        default=2048,
        ge=1,
        description="Prompt tokens the local engine prefills in one pass (after its prefix "
        "cache), before the running rows take their next decode step. Newcomers are admitted "
        "first come first served until the next one would pass this; a longer prompt runs in a "
        "pass of its own. Lower: running sessions stall less behind a long new prompt; higher: "
        "fewer passes for many short prompts.",
    )
    prefix_cache_bytes: int = Field(
        default=2**30,
        ge=0,
        description="The local engine's prefix cache, in bytes: finished requests' key/value "
        "tensors (prompt and answer) kept so that a prompt starting with the same tokens on the "
        "same adapter version prefills only what follows (an agent's next turn). Least "
        "recently used entries go first; 0 turns it off. The embedded SmolLM2-135M takes about "
        "46 KB a token, so 1 GiB holds about 23,000 tokens.",
    )
    prefix_cache_ttl_s: float = Field(
        default=1800.0,
        gt=0,
        description="A prefix cache entry not used for this long is dropped.",
    )
    serving_first: bool = Field(
        default=True,
        description="Users' requests before background work on the local engine: the local "
        "judge's requests run only while no user's request runs or waits, and are paused (their "
        "KV kept in the prefix cache) when one arrives. False: one first-come-first-served queue.",
    )
    background_idle_s: float = Field(
        default=0.5,
        ge=0,
        description="Background work starts or resumes only after users' requests have been "
        "gone this long (an agent's next call usually follows within it).",
    )
    background_max_wait_s: float = Field(
        default=600.0,
        gt=0,
        description="A background request that waited this long runs beside users' requests, so "
        "that under endless traffic the judge still gets a bounded share of the engine.",
    )
    background_prefill_tokens: int = Field(
        default=256,
        ge=1,
        description="A background prompt is prefilled at most this many tokens a pass (through "
        "the prefix cache), so a user's request that arrives waits for one chunk, not a whole "
        "long judge prompt. Needs the prefix cache (RLPROXY_PREFIX_CACHE_BYTES > 0).",
    )

    # --- adapters -----------------------------------------------------------------------
    # Serving the versions the trainer writes, and replicas sharing one database.
    publish_adapters: bool = Field(
        default=True,
        description="Serve each new adapter version the trainer writes as soon as it loads "
        "(false: versions are only loaded and activated through /rl/adapters).",
    )
    keep_adapters: int = Field(
        default=2,
        ge=0,
        description="Previous adapter versions kept loaded beside the active one, for a quick "
        "rollback; older ones are unloaded (and loaded again when a client pins `NAME@N`).",
    )
    adapter_poll_s: float = Field(
        default=2.0,
        gt=0,
        description="How often serving looks for new adapter versions to publish; also how "
        "often each replica follows the active version and canary recorded in the database and "
        "writes its heartbeat.",
    )
    replica_id: str | None = Field(
        default=None,
        description="This replica's name in the database's leases and heartbeats (several "
        "`rlproxy serve` on one database). Unset: host:pid:random, new on every start.",
    )
    lease_s: float = Field(
        default=15.0,
        gt=0,
        description="Length of the trainer and publisher leases (renewed every third of it): "
        "with several replicas on one database, a replica that dies without giving its leases "
        "up hands them to another one after at most this long. Must be more than three times "
        "RLPROXY_ADAPTER_POLL_S.",
    )
    reward_policy: Literal["explicit", "ruler"] = Field(
        default="explicit",
        description="Which reward training uses when a trajectory has both: the explicit one "
        "posted by the environment, or RULER's score. Both stay stored and visible.",
    )

    # --- base model -----------------------------------------------------------------------
    # Which model is served and trained (proxy/engines/loader.py), how its tool calls are
    # written (proxy/chat/tool_formats.py), and what generates its tokens. Prompts always go
    # through the model's chat template.
    base_model: str | None = Field(
        default=None,
        description="The base model: a local Hugging Face folder (config, weights, tokenizer "
        "with a chat template), a .gguf file (converted once to fp32 under the model cache), or "
        "a hub id such as `Qwen/Qwen2.5-0.5B-Instruct` (downloaded only then, if the hub is "
        "reachable). Unset: the embedded SmolLM2-135M-Instruct.",
    )
    tool_format: Literal["auto", "hermes", "llama3_json"] = Field(
        default="auto",
        description="How the model writes tool calls: `hermes` (`<tool_call>{...}</tool_call>`: "
        'Qwen2.5/3, SmolLM2), `llama3_json` (`{"name": ..., "parameters": ...}`: Llama 3.1+), '
        "or `auto`: read from the chat template (Hermes when it has no tool markup).",
    )
    engine: Literal["local", "vllm"] = Field(
        default="local",
        description="What generates the policy's tokens: the embedded model (`local`) or the vLLM "
        "servers in RLPROXY_VLLM_URLS (`vllm`).",
    )

    judge: JudgeSettings = Field(default_factory=JudgeSettings)
    judge_checks: JudgeChecksSettings = Field(default_factory=JudgeChecksSettings)
    groups: GroupSettings = Field(default_factory=GroupSettings)
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    forgetting: ForgettingSettings = Field(default_factory=ForgettingSettings)
    eval: EvalSettings = Field(default_factory=EvalSettings)
    vllm: VLLMSettings = Field(default_factory=VLLMSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    trainer: TrainerSettings = Field(default_factory=TrainerSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, _TopLevelEnv(settings_cls)

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.engine == "vllm" and not self.vllm.urls:
            raise ValueError(
                'RLPROXY_ENGINE=vllm needs RLPROXY_VLLM_URLS, e.g. ["http://127.0.0.1:8001"]'
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

    @classmethod
    def env_names(cls) -> dict[str, str]:
        """Field name -> the environment variable that sets it, for `Settings`' own fields."""
        return {
            name: env_name(cls, name, info)
            for name, info in cls.model_fields.items()
            if name not in CONCERNS
        }

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

    def scoring_config(self) -> ScoringConfig:
        """The scorer's configuration (RLPROXY_JUDGE_*, the judge checks, RLPROXY_REWARD_POLICY)."""
        return self.judge.scoring_config(self.judge_checks.config(), self.reward_policy)


CONCERNS: dict[str, type[Concern]] = {
    name: info.annotation
    for name, info in Settings.model_fields.items()
    if isinstance(info.annotation, type) and issubclass(info.annotation, Concern)
}
"""`Settings`' attribute -> the concern's class (its fields typed by a `Concern`)."""


def env_name(cls: type[BaseSettings], name: str, info: FieldInfo) -> str:
    """The environment variable of one field: its alias, else the class's prefix and its name."""
    if isinstance(info.validation_alias, str):
        return info.validation_alias.upper()
    return f"{cls.model_config.get('env_prefix', '')}{name}".upper()


def known_variables() -> dict[str, str]:
    """Every setting's environment variable -> where it lives (`port`, `judge.model`)."""
    known = {env: name for name, env in Settings.env_names().items()}
    for attr, concern in CONCERNS.items():
        known |= {env: f"{attr}.{name}" for name, env in concern.env_names().items()}
    return known


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One line per `RLPROXY_` variable in `environ` that is neither a setting nor one of
    NOT_SETTINGS, naming the nearest known variable."""
    known = [*known_variables(), *sorted(NOT_SETTINGS)]
    suffixes = [name.removeprefix("RLPROXY_") for name in known]  # the shared prefix matches all
    lines = []
    for variable in sorted(environ):
        upper = variable.upper()
        if not upper.startswith("RLPROXY_") or upper in known:
            continue
        near = difflib.get_close_matches(upper.removeprefix("RLPROXY_"), suffixes, n=1)
        hint = f" (did you mean RLPROXY_{near[0]}?)" if near else ""
        lines.append(f"unknown environment variable {variable}{hint}; rlproxy ignores it")
    return lines


def error_lines(error: ValidationError) -> list[str]:
    """One line per error of building the settings, each naming its variable."""
    owners: dict[str, type[BaseSettings]] = {c.__name__: c for c in CONCERNS.values()}
    owners[Settings.__name__] = Settings
    lines = []
    for err in error.errors():
        owner: type[BaseSettings] | None = owners.get(error.title)
        loc = [str(part) for part in err["loc"]]
        if owner is Settings and loc and loc[0] in CONCERNS:
            owner = CONCERNS[loc.pop(0)]
        message = err["msg"].removeprefix("Value error, ")
        if not loc:
            lines.append(message)
            continue
        info = owner.model_fields.get(loc[0]) if owner is not None else None
        variable = env_name(owner, loc[0], info) if owner is not None and info else loc[0]
        lines.append(f"{variable}: {message}")
    return lines


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
