"""The engine contract: what every token generator behind the proxy provides.

An engine turns a tokenised prompt plus sampling parameters into an async stream of events: one
`TokenEvent` per sampled token (its id, logprob, optional top logprobs and the text it adds), and
one `ChoiceFinished` per choice with the exact prompt and completion token ids. The stored ids are
the ones sampled, never a re-tokenisation of the text.

This module holds only types; engines live beside it (`local.py`). Engines know nothing about
HTTP, chat messages or OpenAI wire types.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams
    n: int = 1
    adapter: str | None = None  # None: the base model, no adapter
    # A compiled grammar (proxy.chat.grammar.Grammar) every choice must follow; None = free text.
    grammar: Any | None = None
    request_id: str = ""
    background: bool = False
    """Background work (the local judge): the local engine runs it only while no user request
    runs or waits, and pauses it when one arrives (`proxy.engines.local`)."""
    affinity: Callable[[], str] | None = None
    """Gives what stays the same on every turn of one conversation (`proxy.chat.affinity`): an
    engine with several servers sends the turns to the same one, whose prefix cache holds the
    history (the vllm engine, with affinity on). Called only by an engine that routes by it, so
    the others never pay for the hash. None: the engine may derive one from the prompt."""


@dataclass(frozen=True)
class TokenEvent:
    index: int  # choice index
    token_id: int
    logprob: float  # of the model's raw distribution (temperature 1, before penalties/grammar)
    text: str  # text this token adds to the visible output (may be "" while held back)
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class ChoiceFinished:
    index: int
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    text: str = ""
    adapter: str | None = None
    stop: str | None = None
    """The stop string that ended the choice, when one did (`finish_reason` is then "stop")."""


EngineEvent = TokenEvent | ChoiceFinished


class EngineError(RuntimeError):
    """The engine failed while generating (not the client's fault)."""


class EngineUnavailableError(EngineError):
    """A remote engine could not take the request (no server reachable: a 503), or the server
    generating it died mid-answer (`mid_answer`: a 502). Not the client's fault; a retry may
    succeed. Nothing of the failed answer was acknowledged to the client."""

    def __init__(self, message: str, *, mid_answer: bool = False) -> None:
        super().__init__(message)
        self.mid_answer = mid_answer


class RequestInputError(EngineError):
    """Generation of one request failed because of its own input (a grammar that validated but
    cannot be followed): the client's fault, answered with a 400; its neighbours go on."""


@dataclass
class EngineHealth:
    ok: bool
    detail: dict[str, Any] = field(default_factory=dict)


class Engine(Protocol):
    """One async interface; `local` (transformers + PEFT) is the embedded implementation."""

    max_context: int
    kind: str
    """"local" or "vllm": stored as each call's `engine` (`storage.records.POLICY_ENGINES`)."""
    logprobs_after_grammar: bool
    """True when a grammar's mask is applied before the logprobs are taken (renormalised over the
    allowed tokens, as vLLM does): under a grammar the stored logprobs are then not the
    policy's, and the trainer does not use them as its ratio's reference (`masked_logprobs`)."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[EngineEvent]: ...

    async def load_adapter(self, name: str, path: str) -> None: ...

    async def unload_adapter(self, name: str) -> None: ...

    def health(self) -> EngineHealth: ...

    def queued_rows(self) -> int:
        """Rows (choices) handed to `generate` that are not decoding yet: waiting for room in
        the batch. A request counts from the first step of its `generate` stream, which has no
        await before it is queued."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@runtime_checkable
class TeacherForcing(Protocol):
    """An engine that scores a given continuation instead of sampling one: the local engine.
    The vllm engine does not (vLLM's API returns the top few logprobs of prompt tokens, never
    the whole distribution), so what needs it says so and does without (the forgetting check,
    `proxy.adapters.forgetting`)."""

    async def forced_logprobs(
        self, prompt_ids: list[int], answer_ids: list[int], adapters: Sequence[str | None]
    ) -> torch.Tensor:
        """The next-token log-distribution over the whole vocabulary that each of `adapters`
        (None: the base model) gives at each position of `answer_ids` after `prompt_ids`, the
        answer teacher-forced: (len(adapters), len(answer_ids), V) float32 on the CPU."""
        ...
