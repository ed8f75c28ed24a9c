"""The local engine on the real model: batching is exact, rows stop and leave cleanly."""

from __future__ import annotations

import asyncio

import pytest
import torch

from proxy.engines.base import ChoiceFinished, GenerationRequest, SamplingParams, TokenEvent
from proxy.engines.local import LocalEngine

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three colors."]


def prompt_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(rendered, add_special_tokens=False)


@pytest.fixture(scope="module")
async def engine(loaded_model):
    engine = LocalEngine(loaded_model, max_batch_size=8)
    await engine.start()
    yield engine
    await engine.stop()


async def run(engine: LocalEngine, request: GenerationRequest, delay: float = 0.0):
    await asyncio.sleep(delay)
    tokens: dict[int, list[TokenEvent]] = {}
    finished: dict[int, ChoiceFinished] = {}
    async for event in engine.generate(request):
        if isinstance(event, TokenEvent):
            tokens.setdefault(event.index, []).append(event)
        else:
            finished[event.index] = event
    return tokens, finished


async def test_staggered_batch_matches_generate_token_for_token(engine, loaded_model) -> None:
    """Requests that join a running batch get exactly the tokens of a lone greedy generate."""
    tok = loaded_model.tokenizer
    ids = [prompt_ids(tok, p) for p in PROMPTS]
    expected = []
    for i in ids:
        with torch.no_grad():
            out = loaded_model.model.generate(torch.tensor([i]), max_new_tokens=16, do_sample=False)
        expected.append(out[0, len(i) :].tolist())
    params = SamplingParams(max_tokens=16, temperature=0)
    results = await asyncio.gather(
        *(run(engine, GenerationRequest(i, params), delay=0.15 * k) for k, i in enumerate(ids))
    )
    for (tokens, finished), want in zip(results, expected, strict=True):
        got = finished[0].completion_token_ids
        assert got == want[: len(got)]
        assert [t.token_id for t in tokens[0]] == got
        assert finished[0].prompt_token_ids
        assert len(finished[0].completion_logprobs) == len(got)
        assert all(lp <= 0 for lp in finished[0].completion_logprobs)
        assert "".join(t.text for t in tokens[0]) == finished[0].text
        assert finished[0].text == tok.decode(got, skip_special_tokens=True).rstrip("\ufffd")


async def test_n_choices_with_a_seed_are_reproducible(engine, tokenizer) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7)
    request = GenerationRequest(prompt_ids(tokenizer, "Tell me a joke."), params, n=3)
    _, first = await run(engine, request)
    _, second = await run(engine, request)
    assert sorted(first) == [0, 1, 2]
    assert [first[i].completion_token_ids for i in range(3)] == [
        second[i].completion_token_ids for i in range(3)
    ]
    assert len({tuple(first[i].completion_token_ids) for i in range(3)}) > 1


async def test_choices_of_one_prompt_are_prefilled_once_and_match_generate(
    engine, loaded_model
) -> None:
    """A request's n choices share one prompt: the prefill runs it once (batch 1) and each
    choice still gets exactly the tokens and logprobs of a lone greedy generate."""
    tok = loaded_model.tokenizer
    ids = prompt_ids(tok, PROMPTS[0])
    with torch.no_grad():
        want = loaded_model.model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    want = want[0, len(ids) :].tolist()
    prefills: list[tuple[int, int]] = []

    def record(_module, args, kwargs) -> None:
        shape = tuple(kwargs["input_ids"].shape)
        if shape[1] > 1:  # a prefill (decode steps feed one token a row)
            prefills.append(shape)

    shared = engine.prefill_rows_shared
    hook = engine.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        _, lone = await run(
            engine, GenerationRequest(ids, SamplingParams(max_tokens=8, temperature=0))
        )
        _, four = await run(
            engine, GenerationRequest(ids, SamplingParams(max_tokens=8, temperature=0), n=4)
        )
    finally:
        hook.remove()
    assert prefills == [(1, len(ids)), (1, len(ids))]
    assert engine.prefill_rows_shared - shared == 3
    assert engine.health().detail["prefill_rows_shared"] == engine.prefill_rows_shared
    for i in range(4):
        got = four[i].completion_token_ids
        assert got == want[: len(got)] and len(got) == 8
        assert four[i].completion_logprobs == pytest.approx(lone[0].completion_logprobs, abs=1e-4)

    # Requests arriving together, prompts repeated among other prompts: each row still gets
    # its own prompt's tokens (the copies go back to the right rows).
    other = prompt_ids(tok, PROMPTS[1])
    with torch.no_grad():
        want_other = loaded_model.model.generate(
            torch.tensor([other]), max_new_tokens=8, do_sample=False
        )[0, len(other) :].tolist()
    params = SamplingParams(max_tokens=8, temperature=0)
    results = await asyncio.gather(
        run(engine, GenerationRequest(other, params)),
        run(engine, GenerationRequest(ids, params, n=2)),
        run(engine, GenerationRequest(other, params, n=2)),
    )
    got = [[f.completion_token_ids for _, f in sorted(r[1].items())] for r in results]
    assert got == [[want_other], [want, want], [want_other, want_other]]


async def test_stop_string_ends_the_row_and_is_not_returned(engine, tokenizer) -> None:
    params = SamplingParams(max_tokens=30, temperature=0, stop=("Paris",))
    tokens, finished = await run(
        engine, GenerationRequest(prompt_ids(tokenizer, PROMPTS[0]), params)
    )
    assert finished[0].finish_reason == "stop"
    assert "Paris" not in finished[0].text
    assert "".join(t.text for t in tokens[0]) == finished[0].text


async def test_closing_the_stream_cancels_the_row(engine, tokenizer) -> None:
    params = SamplingParams(max_tokens=200, temperature=0)
    stream = engine.generate(GenerationRequest(prompt_ids(tokenizer, PROMPTS[1]), params))
    async for _ in stream:
        break
    await stream.aclose()
    steps = engine.steps
    for _ in range(50):
        if engine.health().detail["running_rows"] == 0:
            break
        await asyncio.sleep(0.1)
    assert engine.health().detail["running_rows"] == 0
    assert engine.steps - steps < 50


# --- one bad row fails alone ------------------------------------------------------------------


class _BrokenGrammar:
    """Follows the engine's grammar protocol (`proxy.chat.grammar.Grammar.new_row` and the row's
    `fill_bitmask` / `consume` / `is_stopped`), but fails where a real one could: when its row's
    matcher is built (`fail_at` None), or when the `fail_at`-th token is consumed."""

    def __init__(self, fail_at: int | None) -> None:
        self.fail_at = fail_at

    def new_row(self, info: object) -> _BrokenRow:
        if self.fail_at is None:
            raise RuntimeError("this grammar cannot make a matcher")
        return _BrokenRow(self.fail_at)


class _BrokenRow:
    def __init__(self, fail_at: int) -> None:
        self.fail_at = fail_at
        self.consumed = 0

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        pass  # every token allowed

    def consume(self, token_id: int) -> None:
        self.consumed += 1
        if self.consumed >= self.fail_at:
            raise RuntimeError("the matcher rejected a token")

    def is_stopped(self) -> bool:
        return False


@pytest.mark.parametrize("fail_at", [None, 1, 4])
async def test_a_failing_row_fails_alone(engine, loaded_model, fail_at: int | None) -> None:
    from proxy.engines.base import EngineError

    tok = loaded_model.tokenizer
    params = SamplingParams(max_tokens=10, temperature=0)
    good = [GenerationRequest(prompt_ids(tok, p), params) for p in PROMPTS]
    alone = [(await run(engine, r))[1][0].completion_token_ids for r in good]
    broken = GenerationRequest(prompt_ids(tok, PROMPTS[0]), params, grammar=_BrokenGrammar(fail_at))
    results = await asyncio.gather(
        run(engine, broken), *(run(engine, r) for r in good), return_exceptions=True
    )
    assert isinstance(results[0], EngineError), results[0]
    together = [r[1][0].completion_token_ids for r in results[1:]]  # type: ignore[index]
    assert together == alone
    assert engine.health().ok
    assert (await run(engine, good[0]))[1][0].completion_token_ids == alone[0]


async def test_a_vanishing_temperature_samples_greedily(engine, loaded_model) -> None:
    """1e-45 divides the logits into infinities; it is the greedy distribution, not NaN."""
    ids = prompt_ids(loaded_model.tokenizer, PROMPTS[1])
    greedy = GenerationRequest(ids, SamplingParams(max_tokens=8, temperature=0))
    tiny = GenerationRequest(ids, SamplingParams(max_tokens=8, temperature=1e-45, seed=3))
    neighbour = GenerationRequest(ids, SamplingParams(max_tokens=8, temperature=0))
    (_, a), (_, b), (_, c) = await asyncio.gather(
        run(engine, greedy), run(engine, tiny), run(engine, neighbour)
    )
    assert a[0].completion_token_ids == b[0].completion_token_ids == c[0].completion_token_ids


async def test_any_integer_seed_is_a_valid_generator_seed(engine, loaded_model) -> None:
    ids = prompt_ids(loaded_model.tokenizer, PROMPTS[2])
    request = GenerationRequest(ids, SamplingParams(max_tokens=4, seed=2**64 - 1), n=2)
    _, finished = await run(engine, request)
    assert sorted(finished) == [0, 1]
