"""The local chat service: an OpenAI request in, an OpenAI response (or chunk stream) out, on a
token-level engine (`proxy.engines`).

`ChatService.prepare` validates a request (`proxy.chat.request`: prompt ids, sampling
parameters, grammar) and picks the version that serves it; `complete` and `stream` run it on the
engine and build OpenAI's JSON (chunks through `proxy.chat.streaming`), whose `model` names that
version (`served_model`). Every finished call is recorded
(`proxy.chat.record.call_record`, then the store) before the response is acknowledged: the body
of a non-streamed response, the `[DONE]` of a stream.

Admission: `prepare` refuses a request the engine's queue cannot take (`max_queued_rows`) with
a 429 (`OverloadedError`), before any work; requests already admitted are never touched.

No HTTP here: `proxy.api.routes.completions` is a thin layer over this class, and tests can
drive it directly.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Literal

from proxy.adapters.registry import ServedModels, conversation_key
from proxy.chat.affinity import affinity_key
from proxy.chat.budget import DEFAULT_RULE, BudgetRule
from proxy.chat.prompt import ChatTemplate
from proxy.chat.record import CallInfo, call_record
from proxy.chat.request import (
    DEFAULT_LIMITS,
    PreparedChat,
    RequestLimits,
    count_prompt_tokens,
    prepare_chat,
)
from proxy.chat.streaming import Chunks, text_deltas
from proxy.chat.tool_parser import StreamParser
from proxy.engines.base import (
    ChoiceFinished,
    Engine,
    EngineError,
    EngineUnavailableError,
    GenerationRequest,
    RequestInputError,
    TokenEvent,
)
from proxy.errors import (
    APIError,
    BadGatewayError,
    EngineUnreachableError,
    InvalidRequestError,
    OverloadedError,
    ServerError,
)
from proxy.protocols.chat import (
    ChatCompletionRequest,
    assistant_message,
    completion_body,
    usage,
)
from storage.held_out import NO_HELD_OUT, HeldOutSplit
from storage.records import CallRecord, CallStatus, ChoiceRecord

logger = logging.getLogger(__name__)

RecordSink = Callable[[CallRecord], Awaitable[object]]
"""Where finished calls go (`Store.record_call`); awaited before a response is acknowledged."""


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


class _Admissions:
    """Rows of requests admitted by `ChatService.prepare` that the engine does not count yet.

    Between `prepare` and the engine call there are awaits (a stream sends its first chunks
    before its generation starts), so the engine's own count alone would let a burst of requests
    all see the same room. An admitted request holds its rows here until `release`, called right
    before the engine call with no await between; a request dropped without running (a stream
    never read) releases them when it is freed (`weakref.finalize`).
    """

    def __init__(self) -> None:
        self.rows = 0
        self._held: dict[int, weakref.finalize] = {}
        self._lock = threading.Lock()  # a finalizer may run on any thread (cyclic GC)

    def hold(self, prep: PreparedChat, rows: int) -> None:
        with self._lock:
            self.rows += rows
            self._held[id(prep)] = weakref.finalize(prep, self._drop, id(prep), rows)

    def release(self, prep: PreparedChat) -> None:
        """The engine counts `prep`'s rows from now on (or they will never run)."""
        held = self._held.get(id(prep))
        if held is not None:
            held()  # a finalizer runs at most once

    def _drop(self, key: int, rows: int) -> None:
        with self._lock:
            self.rows -= rows
            self._held.pop(key, None)


class ChatService:
    def __init__(
        self,
        engine: Engine,
        registry: ServedModels,
        tokenizer: Any,
        *,
        max_n: int = 8,
        budget: BudgetRule = DEFAULT_RULE,
        record: RecordSink | None = None,
        shadow_samples: int = 0,
        shadow_turns: Literal["first", "every"] = "first",
        limits: RequestLimits = DEFAULT_LIMITS,
        max_queued_rows: int = 0,
        tool_format: str = "auto",
        background: bool = False,
        held_out: HeldOutSplit = NO_HELD_OUT,
    ) -> None:
        self.engine = engine
        self.background = background  # its requests give way to users' (the judge's service)
        self.registry = registry
        self.tokenizer = tokenizer
        # The model's own chat template and tool-call family (RLPROXY_TOOL_FORMAT).
        self.template = ChatTemplate.for_tokenizer(tokenizer, tool_format)
        self.max_n = max_n
        self.budget = budget
        self.record = record
        self.shadow_samples = shadow_samples
        self.shadow_turns = shadow_turns
        self.limits = limits
        self.max_queued_rows = max_queued_rows  # 0: no bound
        self.held_out = held_out  # tasks kept out of training (RLPROXY_EVAL_SHARE)
        self._admissions = _Admissions()
        self._rng = random.Random()
        self._token_text: dict[int, str] = {}
        # The longest token's spelling bounds the characters per token (byte-level BPE spells
        # each byte as one character): a longer prompt cannot fit, whatever it tokenizes to.
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.max_token_chars = max((len(t) for t in vocab), default=0)

    # ----------------------------------------------------------------- validation

    async def prepare(self, call: CallInfo) -> PreparedChat:
        """Validate the request (every 400 and 404), then admit it to the engine's queue (429).

        Validation runs in a worker thread: tokenizing a long prompt and compiling a grammar
        never hold up the event loop (other requests, their streams, /health)."""
        prep = await self._validate(call)
        prep.held_out = self.held_out.arm(
            call.owner, prep.messages, prep.tools, marked=call.marked_held_out
        )
        self._admit(prep)
        if prep.held_out == "base" or self.registry.splits:
            # The evaluation's control, a canary rollout or the watch: this call's version.
            key = conversation_key(prep.messages, prep.call.explicit_trajectory_id)
            prep.resolved = self.registry.route(prep.resolved, key, held_out=prep.held_out)
        return prep

    def served_model(self, prep: PreparedChat) -> str:
        """What `prep`'s answer names as its model: the version that serves it, `NAME@N` or
        `NAME@base`, whatever name it asked for. Fixed once `prepare` has routed it: the same
        version generates it and is stored on its call, even if another becomes active
        meanwhile."""
        return self.registry.version_id(prep.resolved.version)

    async def count_prompt_tokens(self, call: CallInfo) -> int:
        """The prompt's length in tokens, validated as `prepare` does, never admitted to the
        engine (Anthropic's `count_tokens`); a prompt longer than the context is counted too."""
        return await asyncio.to_thread(
            count_prompt_tokens,
            call,
            registry=self.registry,
            tokenizer=self.tokenizer,
            limits=self.limits,
            template=self.template,
        )

    async def _validate(self, call: CallInfo) -> PreparedChat:
        return await asyncio.to_thread(
            prepare_chat,
            call,
            registry=self.registry,
            tokenizer=self.tokenizer,
            max_context=self.engine.max_context,
            max_n=self.max_n,
            budget=self.budget,
            max_token_chars=self.max_token_chars,
            limits=self.limits,
            template=self.template,
        )

    def _admit(self, prep: PreparedChat) -> None:
        """Refuse `prep` (429) if its rows would queue more than `max_queued_rows` behind the
        engine's batch. A request alone in the queue is always admitted, whatever its size (as the
        engine starts a request bigger than its batch alone)."""
        if not self.max_queued_rows:
            return
        rows = self._rows(prep)
        queued = self.engine.queued_rows() + self._admissions.rows
        if queued and queued + rows > self.max_queued_rows:
            raise OverloadedError(
                f"The server is at capacity: {queued} choices are already waiting for the model "
                f"(limit {self.max_queued_rows}, RLPROXY_MAX_QUEUED_ROWS). Please retry shortly.",
                retry_after_s=1,
            )
        self._admissions.hold(prep, rows)

    async def complete_json(self, body: dict[str, Any]) -> dict[str, Any]:
        """A request body in, the response body out (no HTTP; for the local judge). Raises
        `APIError` for a request the route would refuse."""
        request = ChatCompletionRequest.model_validate(body)
        prep = await self.prepare(CallInfo(request, f"req_{uuid.uuid4().hex}"))
        return await self.complete(prep)

    def _plan(self, prep: PreparedChat) -> _Plan:
        """Shadow sampling: k rows in one batched generation, one of them (at random) returned.

        Off for n > 1 (the client already gets several samples), at temperature 0 (the samples
        would be identical), and on later turns unless `shadow_turns` is "every".
        """
        rows = self._rows(prep)
        if rows == prep.n:
            return _Plan(rows, tuple(range(rows)))
        return _Plan(rows, (self._rng.randrange(rows),))

    def _rows(self, prep: PreparedChat) -> int:
        """Engine rows `prep` takes: k with shadow sampling, else its `n` (no random draw, so
        admission can count them without choosing the returned row)."""
        k = self.shadow_samples
        if (
            k < 2
            or prep.n != 1
            or prep.params.temperature == 0
            or prep.held_out is not None  # never trained on: no group to sample for
            or (
                self.shadow_turns == "first"
                and any(m.get("role") == "assistant" for m in prep.messages)
            )
        ):
            return prep.n
        return k

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
            background=self.background,
            affinity=partial(affinity_key, prep.call, prep.dumped),
        )

    def _shadow_outcomes(
        self, prep: PreparedChat, plan: _Plan, finished: dict[int, ChoiceFinished]
    ) -> list[ChoiceRecord]:
        """The shadow rows as choices (index = engine row), once every row has finished."""
        rows = plan.shadow_rows
        if not rows or any(r not in finished for r in rows):
            return []
        return [self._outcome(prep, r, finished[r]) for r in rows]

    def _outcome(self, prep: PreparedChat, index: int, fin: ChoiceFinished) -> ChoiceRecord:
        content, calls = self._split_tools(prep, fin.text)
        return ChoiceRecord(
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
            self._admissions.release(prep)  # the engine counts the rows at its first step
            async for event in self.engine.generate(self._engine_request(prep, plan)):
                if isinstance(event, TokenEvent):
                    prep.call.token_arrived()
                    if prep.params.logprobs and event.index in plan.visible:
                        logprobs[event.index].append(self._logprob_entry(event))
                else:
                    finished[event.index] = event
                    if event.stop is not None and event.index in plan.visible:
                        prep.call.stopped_by[plan.visible.index(event.index)] = event.stop
        except EngineError as exc:
            await self._record(prep, "error", [], None, error=str(exc))
            raise _api_error(exc) from exc
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
            model=self.served_model(prep),
            created=prep.call.created,
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
        return self.template.tool_format.parse_complete(text)

    # ----------------------------------------------------------------- streamed

    async def stream(self, prep: PreparedChat) -> AsyncIterator[dict[str, Any]]:
        """Yield OpenAI chunk dicts; the caller writes them as SSE and then `[DONE]`.

        On an engine failure after the first chunk, yields an `{"error": ...}` dict last.
        """
        plan = self._plan(prep)
        fmt = self.template.tool_format
        parsers = {i: fmt.parser() if prep.parse_tools else None for i in range(prep.n)}
        made_calls: dict[int, bool] = {i: False for i in range(prep.n)}
        finished: dict[int, ChoiceFinished] = {}  # by client index
        shadow_finished: dict[int, ChoiceFinished] = {}  # by engine row
        chunks = Chunks(prep.id, self.served_model(prep), prep.call.created, prep.include_usage)

        status: CallStatus = "client_disconnected"
        error: str | None = None
        try:
            for i in range(prep.n):
                yield chunks.choice(i, {"role": "assistant", "content": "", "refusal": None})
            self._admissions.release(prep)  # the engine counts the rows at its first step
            async for event in self.engine.generate(self._engine_request(prep, plan)):
                client = plan.client_index(event.index)
                if client is None:  # a shadow row: kept, never streamed
                    if isinstance(event, ChoiceFinished):
                        shadow_finished[event.index] = event
                    continue
                i = client
                if isinstance(event, TokenEvent):
                    prep.call.token_arrived()
                    deltas = text_deltas(parsers[i], event.text, final=False)
                    lp = [self._logprob_entry(event)] if prep.params.logprobs else None
                else:
                    finished[i] = event
                    if event.stop is not None:
                        prep.call.stopped_by[i] = event.stop
                    deltas = text_deltas(parsers[i], "", final=True)
                    lp = None
                for delta in deltas:
                    if "tool_calls" in delta:
                        made_calls[i] = True
                    yield chunks.choice(i, delta, logprobs=lp)
                    lp = None
                if lp:
                    yield chunks.choice(i, {}, logprobs=lp)
                if isinstance(event, ChoiceFinished):
                    reason = (
                        "tool_calls"
                        if made_calls[i] and event.finish_reason == "stop"
                        else (event.finish_reason)
                    )
                    yield chunks.choice(i, {}, finish_reason=reason)
            status = "completed"
            outcomes = self._stream_outcomes(prep, finished, parsers)
            if prep.include_usage:
                yield chunks.usage(self._usage(prep, outcomes))
            shadow = self._shadow_outcomes(prep, plan, shadow_finished)
            await self._record(prep, status, outcomes, None, shadow=shadow)
        except EngineError as exc:
            status, error = "error", str(exc)
            await self._record(
                prep, status, self._stream_outcomes(prep, finished, parsers), None, error
            )
            yield _api_error(exc).body()
        except APIError as exc:
            status, error = "error", exc.message
            await self._record(
                prep, status, self._stream_outcomes(prep, finished, parsers), None, error
            )
            yield exc.body()
        finally:
            self._admissions.release(prep)  # gone before the generation started
            if status == "client_disconnected":
                outcomes = self._stream_outcomes(prep, finished, parsers)
                await asyncio.shield(self._record(prep, status, outcomes, None))

    def _stream_outcomes(
        self,
        prep: PreparedChat,
        finished: dict[int, ChoiceFinished],
        parsers: dict[int, StreamParser | None],
    ) -> list[ChoiceRecord]:
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
                ChoiceRecord(
                    index=index,
                    message=assistant_message(content, calls),
                    finish_reason=_finish_reason(fin.finish_reason, calls),
                    completion_token_ids=fin.completion_token_ids,
                    completion_logprobs=fin.completion_logprobs,
                )
            )
        return outcomes

    # ----------------------------------------------------------------- helpers

    def _usage(self, prep: PreparedChat, outcomes: list[ChoiceRecord]) -> dict[str, Any]:
        completion = sum(len(o.completion_token_ids or ()) for o in outcomes)
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
        status: CallStatus,
        outcomes: list[ChoiceRecord],
        body: dict[str, Any] | None,
        error: str | None = None,
        *,
        shadow: list[ChoiceRecord] | None = None,
    ) -> None:
        if self.registry.splits and status == "completed" and prep.resolved.follows_policy:
            for outcome in outcomes:  # the next turn answers this: keep it on this version
                key = conversation_key([*prep.messages, outcome.message])
                if key is not None:
                    self.registry.remember(key, prep.resolved.version)
        if self.record is None:
            return
        record = call_record(
            prep.call,
            engine=self.engine.kind,
            status=status,
            choices=outcomes,
            response=body,
            usage=self._usage(prep, outcomes) if outcomes else None,
            error=error,
            dumped=prep.dumped,
            prompt_token_ids=prep.prompt_ids,
            adapter_version=prep.resolved.version,
            shadow_samples=shadow or [],
            logprobs_after_grammar=prep.grammar is not None and self.engine.logprobs_after_grammar,
            output_budget=prep.budget,
            held_out=prep.held_out is not None,
        )
        await self.record(record)


def _finish_reason(engine_reason: str, calls: list[dict[str, Any]]) -> str:
    if engine_reason == "cancelled":
        return "stop"
    if calls and engine_reason == "stop":
        return "tool_calls"
    return engine_reason


def _api_error(exc: EngineError) -> APIError:
    """A request that failed on its own input is the client's 400; an engine server that died
    mid-answer a 502, none reachable a 503; anything else a 500."""
    if isinstance(exc, RequestInputError):
        return InvalidRequestError(str(exc), code="invalid_schema")
    if isinstance(exc, EngineUnavailableError):
        return BadGatewayError(str(exc)) if exc.mid_answer else EngineUnreachableError(str(exc))
    return ServerError(str(exc))
