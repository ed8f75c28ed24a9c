"""The forgetting check: a new adapter version must still answer general prompts as the base does.

Training on one kind of traffic can break everything else (a LoRA that diverged, a learning rate
too high): the version would answer every other prompt badly. Before a version serves (the
publisher's `check`, once the version has loaded and before it becomes active or goes on canary)
it is compared with the base model on the general prompts that ship beside this module
(`general_prompts.json`: facts, arithmetic, instructions, rewrites, code, refusals, a system
prompt, a second turn):

1. the base's answers: greedy (temperature 0), at most `answer_tokens` tokens each (the stop
   token included when it came), generated through the engine like any request, a few at a time
   so that users' requests keep room in the batch; once per process (the base does not change);
2. each answer teacher-forced through the base and the version in one pass of two rows
   (`proxy.engines.base.TeacherForcing`): the whole next-token log-distribution of both at every
   answer position;
3. KL(base ‖ version) = Σ_v p_base(v) (log p_base(v) − log p_version(v)) at each position,
   averaged over every answer token of every prompt (token-weighted): `mean_kl`, in nats per
   token. Beside it, from the same pass, the share of prompts whose greedy answer the version
   changes in its first token (`first_token_changed`) and anywhere in the compared tokens
   (`answer_changed`): forced along the base's greedy answer, the first position where the two
   argmaxes differ is where the version's own greedy answer leaves the base's.

A version whose `mean_kl` is above `max_kl` is held (`HELD`): the publisher records it, never
serves it, and what served before keeps serving. An engine without teacher forcing (vLLM's)
skips the check (`SKIPPED`), saying so in the log and in the verdict: it never passes silently.
A check that fails (an engine error) holds the version too, with the error as its reason.

Not here: which version to try next and what a held version becomes (`publisher`), the canary
(`rollout`), rendering the prompts (the runtime gives `render`: the chat template's).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from importlib import resources
from typing import TYPE_CHECKING, Any

import torch

from proxy.adapters.held import CHECK_FAILED, FORGETTING, HELD
from proxy.adapters.registry import adapter_name
from proxy.engines.base import (
    ChoiceFinished,
    Engine,
    GenerationRequest,
    SamplingParams,
    TeacherForcing,
)

if TYPE_CHECKING:
    from proxy.settings import ForgettingSettings

logger = logging.getLogger(__name__)

PASSED, SKIPPED = "passed", "skipped"
"""A verdict's state, beside HELD."""

DEFAULT_MAX_KL = 0.4
"""nats per answer token: between the most-trained version that still answered general prompts
(0.26) and the least-drifted ones that no longer did (0.65, 0.82), measured by
bench/forgetting_threshold.py (bench/results/forgetting_threshold.json; docs/concepts/hot-swap.md,
"Forgetting check")."""

PROMPTS_FILE = "general_prompts.json"
AT_ONCE = 8
"""Base answers generated at a time: users' requests keep most of the batch meanwhile."""
KEPT_VERDICTS = 64


@dataclass(frozen=True)
class ForgettingConfig:
    max_kl: float = DEFAULT_MAX_KL
    """A version whose mean KL(base ‖ version) per answer token is above this is held."""
    answer_tokens: int = 32
    """Greedy tokens of the base's answer to each prompt that are compared."""

    def __post_init__(self) -> None:
        if not self.max_kl > 0:
            raise ValueError(f"max_kl must be > 0 (nats per token), got {self.max_kl}")
        if self.answer_tokens < 1:
            raise ValueError(f"answer_tokens must be >= 1, got {self.answer_tokens}")


def forgetting_config(settings: ForgettingSettings) -> ForgettingConfig | None:
    """The check's configuration from its settings (RLPROXY_FORGETTING_*); None when it is off
    (RLPROXY_FORGETTING_CHECK=false)."""
    if not settings.enabled:
        return None
    return ForgettingConfig(max_kl=settings.max_kl, answer_tokens=settings.answer_tokens)


@dataclass(frozen=True)
class GeneralPrompt:
    id: str
    kind: str
    messages: list[dict[str, Any]]


def general_prompts() -> list[GeneralPrompt]:
    """The prompts shipped in `general_prompts.json` (package data beside this module)."""
    text = resources.files(__package__ or "proxy.adapters").joinpath(PROMPTS_FILE).read_text()
    return [
        GeneralPrompt(p["id"], p["kind"], list(p["messages"])) for p in json.loads(text)["prompts"]
    ]


# --------------------------------------------------------------------------- the divergence


def token_kl(base: torch.Tensor, version: torch.Tensor) -> torch.Tensor:
    """KL(base ‖ version) at each position, in nats: `base`, `version` (T, V) log-probabilities
    over the vocabulary; returns (T,). Tokens the base gives no mass add nothing."""
    p = base.exp()
    terms = torch.where(p > 0, p * (base - version), torch.zeros_like(p))
    return terms.sum(-1)


@dataclass(frozen=True)
class PromptDivergence:
    """One prompt's answer teacher-forced through the base and the version."""

    prompt_id: str
    kl_sum: float
    """KL(base ‖ version) summed over the answer's tokens (nats)."""
    tokens: int
    first_token_changed: bool
    """The version's greedy first token is not the base's."""
    answer_changed: bool
    """Somewhere in the compared tokens the version's greedy token is not the base's."""

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / self.tokens


def compare_answer(prompt_id: str, base: torch.Tensor, version: torch.Tensor) -> PromptDivergence:
    """`base`, `version`: (T, V) log-distributions along one teacher-forced answer."""
    kl = token_kl(base, version)  # (T,)
    differs = base.argmax(-1) != version.argmax(-1)  # (T,)
    return PromptDivergence(
        prompt_id=prompt_id,
        kl_sum=float(kl.sum()),
        tokens=int(kl.shape[0]),
        first_token_changed=bool(differs[0]),
        answer_changed=bool(differs.any()),
    )


@dataclass(frozen=True)
class Divergence:
    """A version against the base over all the general prompts."""

    mean_kl: float
    """KL(base ‖ version) per answer token, over every answer token of every prompt (nats)."""
    worst_prompt: str
    worst_prompt_kl: float
    """The prompt whose answer diverged most (its mean KL per token)."""
    first_token_changed: float
    """Share of prompts whose greedy first token the version changes."""
    answer_changed: float
    """Share of prompts whose greedy answer the version changes within the compared tokens."""
    prompts: int
    tokens: int

    @classmethod
    def of(cls, answers: Sequence[PromptDivergence]) -> Divergence:
        if not answers:
            raise ValueError("no answers to compare")
        tokens = sum(a.tokens for a in answers)
        worst = max(answers, key=lambda a: a.mean_kl)
        return cls(
            mean_kl=sum(a.kl_sum for a in answers) / tokens,
            worst_prompt=worst.prompt_id,
            worst_prompt_kl=worst.mean_kl,
            first_token_changed=sum(a.first_token_changed for a in answers) / len(answers),
            answer_changed=sum(a.answer_changed for a in answers) / len(answers),
            prompts=len(answers),
            tokens=tokens,
        )


# --------------------------------------------------------------------------- the check


@dataclass(frozen=True)
class Verdict:
    version: int
    state: str
    """PASSED, HELD or SKIPPED."""
    reason: str
    max_kl: float
    divergence: Divergence | None = None
    held_for: str | None = None
    """FORGETTING or CHECK_FAILED when held."""
    seconds: float = 0.0
    at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class _Answer:
    prompt_id: str
    prompt_ids: list[int]
    answer_ids: list[int]


Render = Callable[[Sequence[Mapping[str, Any]]], list[int]]
"""A conversation's prompt token ids, ending with the assistant's turn opening."""


class ForgettingCheck:
    def __init__(
        self,
        engine: Engine,
        render: Render,
        config: ForgettingConfig,
        prompts: Sequence[GeneralPrompt] | None = None,
    ) -> None:
        self.engine = engine
        self.render = render
        self.config = config
        self.prompts = list(prompts) if prompts is not None else general_prompts()
        self._answers: list[_Answer] | None = None
        self._answering = asyncio.Lock()
        self.verdicts: dict[int, Verdict] = {}
        """The latest versions' verdicts (a version's files never change: checked once)."""
        self.last: Verdict | None = None
        self.outcomes: Counter[str] = Counter(dict.fromkeys((PASSED, HELD, SKIPPED), 0))
        """Checks by state."""
        self.held: Counter[str] = Counter(dict.fromkeys((FORGETTING, CHECK_FAILED), 0))
        """Held versions by reason (the `reason` label of `rlproxy_versions_held_total`)."""

    @property
    def unsupported(self) -> str | None:
        """Why this engine cannot run the check (None: it can)."""
        if isinstance(self.engine, TeacherForcing):
            return None
        return (
            f"the {self.engine.kind} engine gives no teacher-forced distributions (vLLM's API "
            "returns the top few logprobs of prompt tokens, not the whole distribution KL needs)"
        )

    async def check(self, version: int) -> Verdict:
        """Compare loaded `version` with the base; never raises."""
        if version in self.verdicts:
            return self.verdicts[version]
        started = time.monotonic()
        max_kl = self.config.max_kl
        why_not = self.unsupported
        if why_not is not None:
            verdict = Verdict(version, SKIPPED, f"not checked: {why_not}", max_kl)
            logger.warning("adapter %d: forgetting check skipped: %s", version, why_not)
        else:
            try:
                divergence = await self.divergence(adapter_name(version))
            except Exception as exc:
                logger.exception("adapter %d: the forgetting check failed", version)
                reason = f"held: the forgetting check failed: {exc!r}"
                verdict = Verdict(version, HELD, reason, max_kl, held_for=CHECK_FAILED)
            else:
                verdict = _judge(version, divergence, max_kl)
        verdict = replace(verdict, seconds=time.monotonic() - started, at=time.time())
        self._keep(verdict)
        return verdict

    async def divergence(self, adapter: str) -> Divergence:
        """`adapter` (loaded) against the base over every general prompt."""
        forcing = self.engine
        if not isinstance(forcing, TeacherForcing):
            raise TypeError(self.unsupported)
        compared: list[PromptDivergence] = []
        for answer in await self.base_answers():
            both = await forcing.forced_logprobs(
                answer.prompt_ids, answer.answer_ids, [None, adapter]
            )  # (2, T, V)
            compared.append(
                await asyncio.to_thread(compare_answer, answer.prompt_id, both[0], both[1])
            )
        return Divergence.of(compared)

    async def base_answers(self) -> list[_Answer]:
        """The base's greedy answers to the general prompts, generated once."""
        async with self._answering:
            if self._answers is None:
                started = time.monotonic()
                rendered: list[tuple[str, list[int]]] = []
                for p in self.prompts:
                    try:
                        rendered.append((p.id, self.render(p.messages)))
                    except Exception as exc:  # a template that refuses it (a system message)
                        logger.warning("forgetting check: prompt %s left out: %s", p.id, exc)
                answers: list[_Answer] = []
                for i in range(0, len(rendered), AT_ONCE):
                    chunk = rendered[i : i + AT_ONCE]
                    answers += await asyncio.gather(*(self._answer(p, ids) for p, ids in chunk))
                self._answers = [a for a in answers if a.answer_ids]
                logger.info(
                    "forgetting check: the base's answers to %d general prompts in %.1f s",
                    len(self._answers),
                    time.monotonic() - started,
                )
            return self._answers

    async def _answer(self, prompt_id: str, prompt_ids: list[int]) -> _Answer:
        request = GenerationRequest(
            prompt_ids,
            SamplingParams(max_tokens=self.config.answer_tokens, temperature=0.0),
            request_id=f"forgetting-{prompt_id}",
        )
        ids: list[int] = []
        async for event in self.engine.generate(request):
            if isinstance(event, ChoiceFinished):
                ids = list(event.completion_token_ids)
        return _Answer(prompt_id, prompt_ids, ids)

    def _keep(self, verdict: Verdict) -> None:
        self.verdicts[verdict.version] = verdict
        for old in sorted(self.verdicts)[:-KEPT_VERDICTS]:
            del self.verdicts[old]
        self.last = verdict
        self.outcomes[verdict.state] += 1
        if verdict.state == HELD and verdict.held_for:
            self.held[verdict.held_for] += 1

    def describe(self) -> dict[str, Any]:
        """The check's settings and this engine's support, for `GET /rl/adapters`."""
        return {
            "enabled": True,
            "max_kl": self.config.max_kl,
            "answer_tokens": self.config.answer_tokens,
            "prompts": len(self.prompts),
            "unsupported": self.unsupported,
        }


def _judge(version: int, d: Divergence, max_kl: float) -> Verdict:
    figures = (
        f"mean KL(base ‖ v{version}) {d.mean_kl:.4f} nats/token over {d.prompts} general "
        f"prompts ({d.tokens} answer tokens; worst: {d.worst_prompt} {d.worst_prompt_kl:.3f}); "
        f"greedy answer changed on {d.answer_changed:.0%}, first token on "
        f"{d.first_token_changed:.0%}"
    )
    if d.mean_kl > max_kl:
        logger.warning(
            "adapter %d held: it forgot general answers: %s > %g", version, figures, max_kl
        )
        return Verdict(
            version,
            HELD,
            f"held: it forgot general answers: {figures}, over the limit {max_kl:g} "
            "(RLPROXY_FORGETTING_MAX_KL)",
            max_kl,
            d,
            held_for=FORGETTING,
        )
    logger.info("adapter %d passed the forgetting check: %s <= %g", version, figures, max_kl)
    return Verdict(version, PASSED, f"passed: {figures}, within {max_kl:g}", max_kl, d)
