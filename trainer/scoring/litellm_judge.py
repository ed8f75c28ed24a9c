"""A RULER judge reached through litellm: any provider model, or an OpenAI-compatible server.

    judge = LiteLLMJudge("openai/o3")                         # key from OPENAI_API_KEY
    judge = LiteLLMJudge("openai/judge", api_base="http://127.0.0.1:9000/v1", api_key="...")

Every litellm/openai/httpx failure becomes a `trainer.scoring.ruler.JudgeError` with a readable
reason (timeout, unreachable, HTTP status); `trainer.scoring.ruler.score_group` decides about
retries. litellm is imported lazily, with its cost map read locally (never fetched).
"""

from __future__ import annotations

import os
from typing import Any

from trainer.scoring.ruler import JudgeError, JudgeReply


def _litellm() -> Any:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    litellm.suppress_debug_info = True
    return litellm


class LiteLLMJudge:
    """A judge reached through litellm: any provider model ("openai/o3", "anthropic/...") or
    an OpenAI-compatible server (`api_base`)."""

    def __init__(
        self,
        model: str,
        *,
        api_base: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        temperature: float | None = None,
    ) -> None:
        self.model = model
        self.api_base = api_base
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.temperature = temperature

    async def complete(
        self, messages: list[dict[str, Any]], response_format: dict[str, Any]
    ) -> JudgeReply:
        import httpx
        import openai

        litellm = _litellm()
        kwargs: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "response_format": response_format,
            "api_base": self.api_base,
            "api_key": self.api_key,
            "timeout": self.timeout_s,
            "num_retries": 0,  # score_group decides about retries
        }
        if self.temperature is not None:  # reasoning models refuse the parameter
            kwargs["temperature"] = self.temperature
        try:
            response = await litellm.acompletion(**kwargs)
        except (openai.OpenAIError, httpx.HTTPError) as exc:
            raise JudgeError(self._describe(exc)) from exc
        choices = response.choices or []
        content = (choices[0].message.content if choices else None) or ""
        usage = getattr(response, "usage", None)
        prompt = getattr(usage, "prompt_tokens", None)
        completion = getattr(usage, "completion_tokens", None)
        if not prompt and not completion:
            prompt = completion = None  # litellm reports 0/0 when the provider sent no usage
        try:
            cost: float | None = float(litellm.completion_cost(completion_response=response))
        except Exception:  # a model without a price in litellm's map
            cost = None
        return JudgeReply(content, prompt, completion, cost)

    def _describe(self, exc: Exception) -> str:
        import openai

        detail = str(getattr(exc, "message", None) or exc)
        if isinstance(exc, openai.APITimeoutError):
            return f"judge {self.model} timed out after {self.timeout_s:g} s"
        # litellm reports a refused connection as an InternalServerError "Connection error."
        if isinstance(exc, openai.APIConnectionError) or "Connection error" in detail:
            return f"judge {self.model} is unreachable: {detail}"
        status = getattr(exc, "status_code", None)
        if isinstance(status, int):
            return f"judge {self.model} answered HTTP {status}: {detail}"
        return f"judge {self.model} failed ({type(exc).__name__}): {detail}"
