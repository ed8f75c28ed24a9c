"""Users' requests before background work on the local engine (the local judge's requests are
`background`): background work runs only while no user's request runs or waits, is paused when
one arrives and resumed after it, prefills long prompts a chunk per pass, and gives the tokens
and logprobs it would give alone. Background work that waited `background_max_wait_s` runs
beside users' requests.

Real embedded model; the passes are read with a forward hook on the model (`Passes`). Stop ids
are cleared on the engines so that every greedy answer runs to its `max_tokens`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from proxy.engines.base import ChoiceFinished, GenerationRequest, SamplingParams, TokenEvent
from proxy.engines.local import LocalEngine
from tests.proxy.engine_runs import run
from tests.proxy.test_prefill_scheduling import Passes, assert_same, prompt

CACHE = 256 * 2**20


async def engine_of(loaded_model: Any, **options: Any) -> LocalEngine:
    options = {"max_batch_size": 8, "prefix_cache_bytes": CACHE, **options}
    engine = LocalEngine(loaded_model, **options)
    engine.stop_token_ids = frozenset()  # every answer runs to max_tokens
    await engine.start()
    return engine


async def alone(loaded_model: Any, request: GenerationRequest) -> ChoiceFinished:
    """The request's answer on an engine of its own, nothing else running."""
    engine = await engine_of(loaded_model, prefix_cache_bytes=0, serving_first=False)
    try:
        return (await run(engine, request))[0]
    finally:
        await engine.stop()


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0, top_logprobs=2)


async def run_until(
    engine: LocalEngine, request: GenerationRequest, started: asyncio.Event, after: int
) -> ChoiceFinished:
    """Run `request`; set `started` once it has `after` tokens."""
    tokens = 0
    finished = None
    async for event in engine.generate(request):
        if isinstance(event, TokenEvent):
            tokens += 1
            if tokens == after:
                started.set()
        elif isinstance(event, ChoiceFinished):
            finished = event
    assert finished is not None
    return finished


async def user_arrives_during_background(
    loaded_model: Any, tokenizer: Any, **options: Any
) -> tuple[ChoiceFinished, ChoiceFinished, list[tuple[int, int, bool]], LocalEngine]:
    """A background request decodes; after 8 of its tokens a user's request arrives. Returns
    both answers, the passes the model ran and the engine (stopped)."""
    engine = await engine_of(loaded_model, background_idle_s=0.0, **options)
    passes = Passes(engine)
    background = GenerationRequest(prompt(tokenizer, 1, 40), greedy(40), background=True)
    user = GenerationRequest(prompt(tokenizer, 2, 30), greedy(16))
    try:
        started = asyncio.Event()
        judging = asyncio.ensure_future(run_until(engine, background, started, after=8))
        await started.wait()
        answered = (await run(engine, user))[0]
        judged = await judging
    finally:
        passes.close()
        await engine.stop()
    assert_same(answered, await alone(loaded_model, user))
    assert_same(judged, await alone(loaded_model, background))
    return answered, judged, passes.calls, engine


async def test_a_users_request_pauses_background_work_which_resumes_with_the_same_answer(
    loaded_model, tokenizer
) -> None:
    _, _, calls, engine = await user_arrives_during_background(loaded_model, tokenizer)
    # Never a pass with both rows: the user's request decoded alone, the judge's waited.
    assert max(rows for rows, _, _ in calls) == 1
    figures = engine.background
    assert figures.pauses == 1
    assert figures.tokens == 40
    assert figures.busy_s > 0
    health = engine.health().detail["background"]
    assert health["paused_rows"] == 0 and health["running_rows"] == 0
    # Resuming prefilled only what the cache did not hold: the last sampled token.
    resumed = [c for c in calls if c[1] > 1 or c[2]]
    assert any(c == (1, 1, True) for c in resumed)


async def test_without_serving_first_background_work_shares_the_users_passes(
    loaded_model, tokenizer
) -> None:
    """The check above can fail: with the rule off the two rows decode together."""
    _, _, calls, engine = await user_arrives_during_background(
        loaded_model, tokenizer, serving_first=False
    )
    assert max(rows for rows, _, _ in calls) == 2
    assert engine.background.pauses == 0


async def test_background_work_that_waited_too_long_runs_beside_users(
    loaded_model, tokenizer
) -> None:
    _, _, calls, engine = await user_arrives_during_background(
        loaded_model, tokenizer, background_max_wait_s=0.0
    )
    assert max(rows for rows, _, _ in calls) == 2
    assert engine.background.promoted == 1
    assert engine.background.pauses == 0


async def timed(engine: LocalEngine, request: GenerationRequest) -> tuple[ChoiceFinished, float]:
    """Run `request`; its answer and the loop time of its first token."""
    loop = asyncio.get_running_loop()
    first = None
    finished = None
    async for event in engine.generate(request):
        if isinstance(event, TokenEvent) and first is None:
            first = loop.time()
        elif isinstance(event, ChoiceFinished):
            finished = event
    assert finished is not None and first is not None
    return finished, first


async def test_background_work_waits_while_a_users_request_runs_and_for_the_idle_time(
    loaded_model, tokenizer
) -> None:
    engine = await engine_of(loaded_model, background_idle_s=0.3)
    passes = Passes(engine)
    user = GenerationRequest(prompt(tokenizer, 3, 30), greedy(24))
    background = GenerationRequest(prompt(tokenizer, 4, 30), greedy(8), background=True)
    loop = asyncio.get_running_loop()
    try:
        started = asyncio.Event()
        answering = asyncio.ensure_future(run_until(engine, user, started, after=2))
        await started.wait()
        judging = asyncio.ensure_future(timed(engine, background))
        answered = await answering
        user_done = loop.time()
        judged, first_token = await judging
    finally:
        passes.close()
        await engine.stop()
    assert max(rows for rows, _, _ in passes.calls) == 1
    assert first_token - user_done >= 0.25  # RLPROXY_BACKGROUND_IDLE_S after the user's end
    assert_same(answered, await alone(loaded_model, user))
    assert_same(judged, await alone(loaded_model, background))
    assert engine.background.pauses == 0  # it never started while the user's request ran


async def test_a_long_background_prompt_is_prefilled_a_chunk_per_pass(
    loaded_model, tokenizer
) -> None:
    engine = await engine_of(loaded_model, background_idle_s=0.0, background_prefill_tokens=128)
    passes = Passes(engine)
    request = GenerationRequest(prompt(tokenizer, 5, 600), greedy(4), background=True)
    try:
        got = (await run(engine, request))[0]
    finally:
        passes.close()
        await engine.stop()
    length = len(request.prompt_ids)
    assert length > 4 * 128
    prefills = [tokens for _, tokens, _ in passes.prefills]
    assert max(prefills) <= 128
    assert sum(prefills) == length
    assert engine.background.chunks == length // 128 - (length % 128 == 0)
    assert_same(got, await alone(loaded_model, request))


async def test_a_user_waits_at_most_one_chunk_of_a_long_background_prefill(
    loaded_model, tokenizer
) -> None:
    """A user's request that arrives while a long background prompt is being prefilled runs
    after the chunk in progress; the background prompt goes on from the cache afterwards."""
    engine = await engine_of(loaded_model, background_idle_s=0.0, background_prefill_tokens=64)
    passes = Passes(engine)
    background = GenerationRequest(prompt(tokenizer, 6, 400), greedy(4), background=True)
    user = GenerationRequest(prompt(tokenizer, 7, 20), greedy(4))
    try:
        judging = asyncio.ensure_future(run(engine, background))
        while engine.background.chunks < 2:
            await asyncio.sleep(0.005)
        answered = (await run(engine, user))[0]
        judged = (await judging)[0]
    finally:
        passes.close()
        await engine.stop()
    # The user's prefill (a few tokens of its chat template may come from the cache).
    user_pass = next(i for i, c in enumerate(passes.calls) if 1 < c[1] <= len(user.prompt_ids))
    before = [tokens for _, tokens, _ in passes.calls[:user_pass] if tokens > 1]
    assert sum(before) < len(background.prompt_ids)  # the user did not wait for all of it
    assert_same(answered, await alone(loaded_model, user))
    assert_same(judged, await alone(loaded_model, background))


async def test_a_paused_background_request_whose_caller_left_is_dropped(
    loaded_model, tokenizer
) -> None:
    engine = await engine_of(loaded_model, background_idle_s=0.0)
    background = GenerationRequest(prompt(tokenizer, 8, 30), greedy(200), background=True)
    user = GenerationRequest(prompt(tokenizer, 9, 30), greedy(24))
    try:
        started = asyncio.Event()
        judging = asyncio.ensure_future(run_until(engine, background, started, after=4))
        await started.wait()
        answering = asyncio.ensure_future(run(engine, user))
        while engine.background.pauses == 0:
            await asyncio.sleep(0.005)
        judging.cancel()  # the judge's caller gave up (its claim was lost)
        await asyncio.gather(judging, return_exceptions=True)
        await answering
        for _ in range(500):  # the next pass drops it (5 s at most)
            if not engine.health().detail["background"]["paused_rows"]:
                break
            await asyncio.sleep(0.01)
    finally:
        await engine.stop()
    background = engine.health().detail["background"]
    assert background["paused_rows"] == background["running_rows"] == 0
