"""The output budget: how many tokens an answer may take, decided in one place for every engine.

    rule = BudgetRule(mode="fit", default=None)
    budget = rule.fit(prompt_tokens=P, requested=M, context=C)   # OutputBudget(M, used)

A client asks for a budget (Chat's `max_tokens` / `max_completion_tokens`, Responses'
`max_output_tokens`, Messages' `max_tokens`) without knowing this server's model: coding agents
send 16,000 to 128,000 whatever the model. The context holds the prompt and the answer, so
`C - P` tokens are left for the answer:

- `fit` (the default, as Ollama, llama.cpp's server and LM Studio do): the answer may take
  `min(M, C - P)` tokens; a budget that does not fit is shortened, never refused.
- `strict` (vLLM's rule): a budget that does not fit, `P + M > C`, is a 400
  `context_length_exceeded`.

With no budget sent, the answer may take what the context leaves (`C - P`, as vLLM), or
`default` when set (RLPROXY_DEFAULT_MAX_TOKENS), capped at `C - P`. A prompt that leaves no room
(`P >= C`) is a 400 in both modes; the error names the context and what to do.

Every request the policy serves (the local and the vllm engine) is budgeted here, by
`proxy.chat.request.prepare_chat`. Not upstream models: their provider knows its own context,
and the request is forwarded as sent. No HTTP here; the edges say what was used (a header, and
each protocol's own field where it has one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from proxy.errors import ContextLengthError, longer_context

BudgetMode = Literal["fit", "strict"]
HEADER = "X-RLProxy-Output-Budget"
"""The response header that says the budget used and the one asked for (`header_value`)."""
RECORD_KEY = "output_budget"
"""Key in a stored call's `params`: `{"requested": M or None, "used": N}`."""


@dataclass(frozen=True)
class OutputBudget:
    """What the client asked for (None: nothing) and what the answer may take."""

    requested: int | None
    used: int

    @property
    def shortened(self) -> bool:
        """The client's budget did not fit the context and was cut to what it leaves."""
        return self.requested is not None and self.used < self.requested

    def header_value(self) -> str:
        """`used=N; requested=M` (`requested=none` when the client sent no budget)."""
        requested = "none" if self.requested is None else str(self.requested)
        return f"used={self.used}; requested={requested}"

    def as_params(self) -> dict[str, Any]:
        return {"requested": self.requested, "used": self.used}


@dataclass(frozen=True)
class BudgetRule:
    """How budgets are fitted (RLPROXY_OUTPUT_BUDGET) and the budget of a request that sends
    none (RLPROXY_DEFAULT_MAX_TOKENS; None: the context left)."""

    mode: BudgetMode = "fit"
    default: int | None = None

    def fit(self, prompt_tokens: int, requested: int | None, context: int) -> OutputBudget:
        """The budget of a prompt of `prompt_tokens` in a context of `context` tokens. Raises
        `ContextLengthError` when the prompt leaves no room, or (strict) `requested` does not
        fit."""
        left = context - prompt_tokens
        if left < 1:
            raise prompt_too_long(prompt_tokens, context)
        if requested is None:
            return OutputBudget(None, left if self.default is None else min(self.default, left))
        if requested > left and self.mode == "strict":
            raise ContextLengthError(
                f"This model's maximum context length is {context} tokens. However, you "
                f"requested {prompt_tokens + requested} tokens ({prompt_tokens} in the messages, "
                f"{requested} in the completion). Please reduce the length of the messages or "
                "completion (this server refuses a budget that does not fit: "
                "RLPROXY_OUTPUT_BUDGET=strict).",
                param="messages",
                prompt_tokens=prompt_tokens,
                max_context=context,
                requested=requested,
            )
        return OutputBudget(requested, min(requested, left))


DEFAULT_RULE = BudgetRule()
"""Fit, and no default: a request without a budget may take what the context leaves."""


def prompt_too_long(
    prompt_tokens: int, context: int, *, at_least: bool = False
) -> ContextLengthError:
    """The 400 for a prompt that alone fills the context (`at_least`: the prompt has more than
    `prompt_tokens` tokens, known without tokenizing it)."""
    count = f"more than {prompt_tokens}" if at_least else str(prompt_tokens)
    return ContextLengthError(
        f"This model's maximum context length is {context} tokens. However, your messages "
        f"resulted in {count} tokens, which leaves no room for an answer. Please reduce the "
        f"length of the messages, or {longer_context(context)}.",
        param="messages",
        prompt_tokens=prompt_tokens,
        max_context=context,
        at_least=at_least,
    )
