"""The chat-completions service: an OpenAI request in, an OpenAI response (or chunk stream) out.

`ChatService.prepare` validates a request (chat_request.py: prompt ids, sampling parameters,
grammar); `complete` and `stream` run it on the engine and build OpenAI's JSON. Every
finished call is handed to the call sink (storage) before the response is acknowledged: the body
of a non-streamed response, the `[DONE]` of a stream.

No HTTP here: routes/chat.py is a thin layer over this class, and tests can drive it directly.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from proxy.chat_request import PreparedChat, prepare_chat
from proxy.engine.base import (
    ChoiceFinished,
    Engine,
    EngineError,
    GenerationRequest,
    TokenEvent,
)
from proxy.errors import APIError, ServerError
from proxy.protocol import (
    ChatCompletionRequest,
    assistant_message,
    chunk,
    completion_body,
    usage,
)
from proxy.registry import ServedModels
from proxy.tool_parser import (
    TextDelta,
    ToolCallArgsDelta,
    ToolCallStart,
    ToolCallStreamParser,
    parse_complete,
)

logger = logging.getLogger(__name__)


@dataclass
class ChoiceOutcome:
    index: int
    message: dict[str, Any]
    finish_reason: str
    completion_token_ids: list[int]
    completion_logprobs: list[float]


@dataclass
class ChatOutcome:
    """Everything about one finished call, for the call sink."""

    prepared: PreparedChat
    status: str  # "completed" | "error" | "client_disconnected"
    choices: list[ChoiceOutcome]
    response: dict[str, Any] | None
    usage: dict[str, Any] | None
    latency_s: float
    error: str | None = None
    shadow: list[ChoiceOutcome] = field(default_factory=list)
    """Shadow samples: answers generated beside the returned one, never sent to the client."""


@dataclass(frozen=True)
class _Plan:
    """Which engine rows the client sees: `visible[i]` is the row behind client choice i."""

    rows: int
    visible: tuple[int, ...]

    def client_index(self, row: int) -> int | None:
        return self.visible.index(row) if row in self.visible else None

    @property
    def shadow_rows(self) -> list[int]:
        return [r for r in range(self.rows) if r not in self.visible]


CallSink = Callable[[ChatOutcome], Awaitable[None]]


class ChatService:
    def __init__(
        self,
        engine: Engine,
        registry: ServedModels,
        tokenizer: Any,
        *,
        max_n: int = 8,
        default_max_tokens: int = 512,
        sink: CallSink | None = None,
        shadow_samples: int = 0,
        shadow_turns: Literal["first", "every"] = "first",
    ) -> None:
        self.engine = engine
        self.registry = registry
        self.tokenizer = tokenizer
        self.max_n = max_n
        self.default_max_tokens = default_max_tokens
        self.sink = sink
        self.shadow_samples = shadow_samples
        self.shadow_turns = shadow_turns
        self._rng = random.Random()
        self._token_text: dict[int, str] = {}

    # ----------------------------------------------------------------- validation

    def prepare(
        self,
        req: ChatCompletionRequest,
        request_id: str,
        headers: dict[str, str] | None = None,
    ) -> PreparedChat:
        return prepare_chat(
            req,
            request_id,
            headers,
            registry=self.registry,
            tokenizer=self.tokenizer,
            max_context=self.engine.max_context,
            max_n=self.max_n,
            default_max_tokens=self.default_max_tokens,
        )

    def _plan(self, prep: PreparedChat) -> _Plan:
        """Shadow sampling: k rows in one batched generation, one of them (at random) returned.

        Off for n > 1 (the client already gets several samples), at temperature 0 (the samples
        would be identical), and on later turns unless `shadow_turns` is "every".
        """
        k = self.shadow_samples
        if (
            k < 2
            or prep.n != 1
            or prep.params.temperature == 0
            or (
                self.shadow_turns == "first"
                and any(m.get("role") == "assistant" for m in prep.messages)
            )
        ):
            return _Plan(prep.n, tuple(range(prep.n)))
        return _Plan(k, (self._rng.randrange(k),))

    def _engine_request(self, prep: PreparedChat, plan: _Plan) -> GenerationRequest:
        params = prep.params
        if plan.rows != prep.n and params.seed is not None:
            # Row i is seeded with seed + i: give the returned row the client's seed, so a
            # seeded request returns what it would without shadow sampling.
            params = replace(params, seed=params.seed - plan.visible[0])
        return GenerationRequest(
            prompt_ids=prep.prompt_ids,
            params=params,
            n=plan.rows,
            adapter=prep.resolved.adapter,
            grammar=prep.grammar,
            request_id=prep.request_id,
        )

    def _shadow_outcomes(
        self, prep: PreparedChat, plan: _Plan, finished: dict[int, ChoiceFinished]
    ) -> list[ChoiceOutcome]:
        """The shadow rows as choices (index = engine row), once every row has finished."""
        rows = plan.shadow_rows
        if not rows or any(r not in finished for r in rows):
            return []
        return [self._outcome(prep, r, finished[r]) for r in rows]

    def _outcome(self, prep: PreparedChat, index: int, fin: ChoiceFinished) -> ChoiceOutcome:
        content, calls = self._split_tools(prep, fin.text)
        return ChoiceOutcome(
            index=index,
            message=assistant_message(content, calls),
            finish_reason=_finish_reason(fin.finish_reason, calls),
            completion_token_ids=fin.completion_token_ids,
            completion_logprobs=fin.completion_logprobs,
        )

    # ----------------------------------------------------------------- non-streamed

    async def complete(self, prep: PreparedChat) -> dict[str, Any]:
        plan = self._plan(prep)
        logprobs: dict[int, list[dict[str, Any]]] = {i: [] for i in range(plan.rows)}
        finished: dict[int, ChoiceFinished] = {}
        try:
            async for event in self.engine.generate(self._engine_request(prep, plan)):
                if isinstance(event, TokenEvent):
                    if prep.params.logprobs and event.index in plan.visible:
                        logprobs[event.index].append(self._logprob_entry(event))
                else:
                    finished[event.index] = event
        except EngineError as exc:
            await self._record(prep, "error", [], None, error=str(exc))
            raise ServerError(str(exc)) from exc
        except (asyncio.CancelledError, GeneratorExit):
            await asyncio.shield(self._record(prep, "client_disconnected", [], None))
            raise
        outcomes, choices = [], []
        for index, row in enumerate(plan.visible):
            outcome = self._outcome(prep, index, finished[row])
            outcomes.append(outcome)
            choices.append(
                {
                    "index": index,
                    "message": outcome.message,
                    "logprobs": {"content": logprobs[row], "refusal": None}
                    if prep.params.logprobs
                    else None,
                    "finish_reason": outcome.finish_reason,
                }
            )
        body = completion_body(
            id=prep.id,
            model=prep.request.model,
            created=prep.created,
            choices=choices,
            usage_=self._usage(prep, outcomes),
        )
        await self._record(
            prep, "completed", outcomes, body, shadow=self._shadow_outcomes(prep, plan, finished)
        )
        return body

    def _split_tools(self, prep: PreparedChat, text: str) -> tuple[str | None, list[dict]]:
        if not prep.parse_tools:
            return text, []
        return parse_complete(text)

    # ----------------------------------------------------------------- streamed

    async def stream(self, prep: PreparedChat) -> AsyncIterator[dict[str, Any]]:
        """Yield OpenAI chunk dicts; the caller writes them as SSE and then `[DONE]`.

        On an engine failure after the first chunk, yields an `{"error": ...}` dict last.
        """
        plan = self._plan(prep)
        parsers = {i: ToolCallStreamParser() if prep.parse_tools else None for i in range(prep.n)}
        made_calls: dict[int, bool] = {i: False for i in range(prep.n)}
        finished: dict[int, ChoiceFinished] = {}  # by client index
        shadow_finished: dict[int, ChoiceFinished] = {}  # by engine row
        usage_field = prep.include_usage

        def make(choices: list[dict[str, Any]]) -> dict[str, Any]:
            return chunk(
                id=prep.id,
                model=prep.request.model,
                created=prep.created,
                choices=choices,
                include_usage_field=usage_field,
            )

        status, error = "client_disconnected", None
        try:
            for i in range(prep.n):
                yield make(
                    [_stream_choice(i, {"role": "assistant", "content": "", "refusal": None})]
                )
            async for event in self.engine.generate(self._engine_request(prep, plan)):
                client = plan.client_index(event.index)
                if client is None:  # a shadow row: kept, never streamed
                    if isinstance(event, ChoiceFinished):
                        shadow_finished[event.index] = event
                    continue
                i = client
                if isinstance(event, TokenEvent):
                    deltas = self._deltas(parsers[i], event.text, final=False)
                    lp = [self._logprob_entry(event)] if prep.params.logprobs else None
                else:
                    finished[i] = event
                    deltas = self._deltas(parsers[i], "", final=True)
                    lp = None
                for delta in deltas:
                    if "tool_calls" in delta:
                        made_calls[i] = True
                    yield make([_stream_choice(i, delta, logprobs=lp)])
                    lp = None
                if lp:
                    yield make([_stream_choice(i, {}, logprobs=lp)])
                if isinstance(event, ChoiceFinished):
                    reason = (
                        "tool_calls"
                        if made_calls[i] and event.finish_reason == "stop"
                        else (event.finish_reason)
                    )
                    yield make([_stream_choice(i, {}, finish_reason=reason)])
            status = "completed"
            outcomes = self._stream_outcomes(prep, finished, parsers)
            if prep.include_usage:
                yield chunk(
                    id=prep.id,
                    model=prep.request.model,
                    created=prep.created,
                    choices=[],
                    usage_=self._usage(prep, outcomes),
                    include_usage_field=True,
                )
            shadow = self._shadow_outcomes(prep, plan, shadow_finished)
            await self._record(prep, status, outcomes, None, shadow=shadow)
        except EngineError as exc:
            status, error = "error", str(exc)
            await self._record(
                prep, status, self._stream_outcomes(prep, finished, parsers), None, error
            )
            yield ServerError(str(exc)).body()
        except APIError as exc:
            status, error = "error", exc.message
            await self._record(
                prep, status, self._stream_outcomes(prep, finished, parsers), None, error
            )
            yield exc.body()
        finally:
            if status == "client_disconnected":
                outcomes = self._stream_outcomes(prep, finished, parsers)
                await asyncio.shield(self._record(prep, status, outcomes, None))

    def _deltas(
        self, parser: ToolCallStreamParser | None, text: str, *, final: bool
    ) -> list[dict[str, Any]]:
        if parser is None:
            return [{"content": text}] if text else []
        events = parser.feed(text) if text else []
        if final:
            events += parser.finish()
        deltas: list[dict[str, Any]] = []
        for ev in events:
            if isinstance(ev, TextDelta):
                if ev.text:
                    deltas.append({"content": ev.text})
            elif isinstance(ev, ToolCallStart):
                call = {"name": ev.name, "arguments": ""}
                deltas.append(
                    {
                        "tool_calls": [
                            {"index": ev.index, "id": ev.id, "type": "function", "function": call}
                        ]
                    }
                )
            elif isinstance(ev, ToolCallArgsDelta) and ev.fragment:
                deltas.append(
                    {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.fragment}}]}
                )
        return deltas

    def _stream_outcomes(
        self,
        prep: PreparedChat,
        finished: dict[int, ChoiceFinished],
        parsers: dict[int, ToolCallStreamParser | None],
    ) -> list[ChoiceOutcome]:
        """The choices as the client saw them (the same tool call ids)."""
        outcomes = []
        for index, fin in sorted(finished.items()):
            parser = parsers[index]
            content: str | None
            if parser is None:
                content, calls = fin.text, []
            else:
                content, calls = parser.content, parser.tool_calls
            outcomes.append(
                ChoiceOutcome(
                    index=index,
                    message=assistant_message(content, calls),
                    finish_reason=_finish_reason(fin.finish_reason, calls),
                    completion_token_ids=fin.completion_token_ids,
                    completion_logprobs=fin.completion_logprobs,
                )
            )
        return outcomes

    # ----------------------------------------------------------------- helpers

    def _usage(self, prep: PreparedChat, outcomes: list[ChoiceOutcome]) -> dict[str, Any]:
        completion = sum(len(o.completion_token_ids) for o in outcomes)
        return usage(len(prep.prompt_ids), completion)

    def _token(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    def _logprob_entry(self, event: TokenEvent) -> dict[str, Any]:
        token = self._token(event.token_id)
        return {
            "token": token,
            "logprob": event.logprob,
            "bytes": list(token.encode("utf-8")),
            "top_logprobs": [
                {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
                for t, lp in ((self._token(i), lp) for i, lp in event.top_logprobs)
            ],
        }

    async def _record(
        self,
        prep: PreparedChat,
        status: str,
        outcomes: list[ChoiceOutcome],
        body: dict[str, Any] | None,
        error: str | None = None,
        *,
        shadow: list[ChoiceOutcome] | None = None,
    ) -> None:
        if self.sink is None:
            return
        outcome = ChatOutcome(
            prepared=prep,
            status=status,
            choices=outcomes,
            response=body,
            usage=self._usage(prep, outcomes) if outcomes else None,
            latency_s=time.monotonic() - prep.started,
            error=error,
            shadow=shadow or [],
        )
        await self.sink(outcome)


def _finish_reason(engine_reason: str, calls: list[dict[str, Any]]) -> str:
    if engine_reason == "cancelled":
        return "stop"
    if calls and engine_reason == "stop":
        return "tool_calls"
    return engine_reason


def _stream_choice(
    index: int,
    delta: dict[str, Any],
    *,
    finish_reason: str | None = None,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "index": index,
        "delta": delta,
        "logprobs": {"content": logprobs, "refusal": None} if logprobs else None,
        "finish_reason": finish_reason,
    }
