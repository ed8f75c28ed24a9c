"""The openai SDK, sync and async, against a real rlproxy: response shapes and sampling options.

What it checks are protocol properties, not answers (the model has 135M parameters): the shape of
a completion and of a chunk stream, counts, determinism at temperature 0 and under a seed, and
that streamed and non-streamed outputs agree. Tool calls and structured outputs live in
test_openai_tools.py, errors in test_openai_errors.py.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import pytest
from openai import AsyncOpenAI, OpenAI
from openai.types.chat import ChatCompletion, ChatCompletionChunk

# A prompt the model answers at length, so short budgets end on "length", never early.
STORY = [{"role": "user", "content": "Write a long story about a dragon."}]
STORY_TOKENS = 10
ALIASES = ("gpt-4o-mini", "gpt-4o", "gpt-3.5-turbo")
# What every answer names as its model: the version that served it. No version is ever made
# active on the shared server, so the policy's name and its aliases are served by the base.
SERVED = "rlproxy@base"


@pytest.fixture(scope="module")
def story(client: OpenAI) -> ChatCompletion:
    """The reference: STORY at temperature 0, non-streamed."""
    return client.chat.completions.create(
        model="rlproxy", messages=STORY, max_tokens=STORY_TOKENS, temperature=0, seed=0
    )


def assert_completion(r: ChatCompletion, *, model: str, n: int = 1) -> None:
    assert isinstance(r.id, str) and r.id
    assert r.object == "chat.completion"
    assert isinstance(r.created, int) and abs(r.created - time.time()) < 600
    assert r.model == model
    assert [c.index for c in r.choices] == list(range(n))
    for c in r.choices:
        assert c.message.role == "assistant"
        assert isinstance(c.message.content, str)
        assert not c.message.tool_calls
        assert c.finish_reason in ("stop", "length")
    assert r.usage is not None
    assert r.usage.prompt_tokens > 0
    assert r.usage.completion_tokens >= n
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def collect_stream(chunks: list[ChatCompletionChunk]) -> dict[int, dict]:
    """Per choice index: joined content, finish reasons seen, and the first delta's role.

    Also checks what every chunk must satisfy: one id, one model, object "chat.completion.chunk".
    """
    assert chunks
    assert len({c.id for c in chunks}) == 1
    assert len({c.model for c in chunks}) == 1
    per: dict[int, dict] = defaultdict(lambda: {"text": "", "finish": [], "roles": []})
    for c in chunks:
        assert c.object == "chat.completion.chunk"
        for choice in c.choices:
            p = per[choice.index]
            assert not p["finish"], f"choice {choice.index} has a chunk after its finish_reason"
            if choice.delta.role is not None:
                p["roles"].append((len(p["text"]), choice.delta.role))
            if not p["roles"]:
                pytest.fail(f"choice {choice.index}'s first delta has no role")
            p["text"] += choice.delta.content or ""
            if choice.finish_reason is not None:
                p["finish"].append(choice.finish_reason)
    for index, p in per.items():
        assert p["roles"][0] == (0, "assistant"), f"choice {index}: {p['roles']}"
        assert len(p["finish"]) == 1, f"choice {index}: finish reasons {p['finish']}"
    return dict(per)


# ----------------------------------------------------------------------------- completions


def test_completion_shape(story: ChatCompletion) -> None:
    assert_completion(story, model=SERVED)
    assert story.choices[0].finish_reason == "length"
    assert story.usage.completion_tokens == STORY_TOKENS
    assert story.choices[0].logprobs is None


def test_an_alias_serves_the_policy_and_names_its_version(
    client: OpenAI, story: ChatCompletion
) -> None:
    r = client.chat.completions.create(
        model="gpt-4o-mini", messages=STORY, max_tokens=STORY_TOKENS, temperature=0, seed=0
    )
    assert_completion(r, model=SERVED)
    assert r.choices[0].message.content == story.choices[0].message.content


async def test_async_completion(aclient: AsyncOpenAI, story: ChatCompletion) -> None:
    r = await aclient.chat.completions.create(
        model="rlproxy", messages=STORY, max_tokens=STORY_TOKENS, temperature=0, seed=0
    )
    assert_completion(r, model=SERVED)
    assert r.choices[0].message.content == story.choices[0].message.content
    assert r.id != story.id


def test_stream_matches_non_streamed(client: OpenAI, story: ChatCompletion) -> None:
    chunks = list(
        client.chat.completions.create(
            model="rlproxy",
            messages=STORY,
            max_tokens=STORY_TOKENS,
            temperature=0,
            seed=0,
            stream=True,
        )
    )
    per = collect_stream(chunks)
    assert set(per) == {0}
    assert per[0]["text"] == story.choices[0].message.content
    assert per[0]["finish"] == [story.choices[0].finish_reason]
    assert all(c.usage is None for c in chunks)
    assert chunks[0].model == SERVED


@pytest.mark.parametrize("stream", [False, True])
def test_the_answer_names_the_version_that_served_it(client: OpenAI, stream: bool) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=STORY, max_tokens=2, stream=stream
    )
    assert raw.headers["x-rlproxy-version"] == "base"
    answer = raw.parse()
    chunks = list(answer) if stream else [answer]
    assert {(c.model, c.system_fingerprint) for c in chunks} == {(SERVED, SERVED)}


async def test_async_stream_with_usage(aclient: AsyncOpenAI, story: ChatCompletion) -> None:
    stream = await aclient.chat.completions.create(
        model="rlproxy",
        messages=STORY,
        max_tokens=STORY_TOKENS,
        temperature=0,
        seed=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    *body, last = chunks
    for c in body:
        # OpenAI sends "usage": null on every chunk but the last when include_usage is set.
        assert "usage" in c.model_fields_set and c.usage is None
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.prompt_tokens == story.usage.prompt_tokens
    assert last.usage.completion_tokens == story.usage.completion_tokens
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    per = collect_stream(body)
    assert per[0]["text"] == story.choices[0].message.content


def test_n_choices(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model="rlproxy", messages=STORY, n=3, max_tokens=4, temperature=1, seed=7
    )
    assert_completion(r, model=SERVED, n=3)
    assert r.usage.completion_tokens == 3 * 4


async def test_n_choices_streamed(aclient: AsyncOpenAI) -> None:
    stream = await aclient.chat.completions.create(
        model="rlproxy",
        messages=STORY,
        n=3,
        max_tokens=4,
        temperature=1,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    per = collect_stream(chunks[:-1])
    assert sorted(per) == [0, 1, 2]
    assert all(p["text"] for p in per.values())
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3 * 4


def test_logprobs(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model="rlproxy",
        messages=STORY,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    choice = r.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:
        assert isinstance(e.token, str)
        assert e.logprob <= 0
        assert e.bytes is not None and all(0 <= b < 256 for b in e.bytes)
        if "\ufffd" not in e.token:
            assert bytes(e.bytes).decode("utf-8") == e.token
        assert len(e.top_logprobs) == 3
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert all(t <= 0 for t in tops)
        # At temperature 0 the sampled token is the argmax: the first of the top logprobs.
        assert e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-4)
    if not any("\ufffd" in e.token for e in entries):
        assert "".join(e.token for e in entries) == choice.message.content


@pytest.mark.parametrize("budget_field", ["max_tokens", "max_completion_tokens"])
def test_token_budget_ends_on_length(client: OpenAI, budget_field: str) -> None:
    r = client.chat.completions.create(
        model="rlproxy", messages=STORY, temperature=0, **{budget_field: 4}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 4


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(client: OpenAI, story: ChatCompletion, stream: bool) -> None:
    text = story.choices[0].message.content
    words = text.split()
    assert len(words) >= 4, f"reference too short for this test: {text!r}"
    stop = " " + " ".join(words[2:4])  # spans several tokens: the server must hold back text
    expected = text[: text.index(stop)]
    kwargs = dict(model="rlproxy", messages=STORY, max_tokens=STORY_TOKENS, temperature=0, seed=0)
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stop=[stop], stream=True))
        per = collect_stream(chunks)
        content, finish = per[0]["text"], per[0]["finish"][0]
    else:
        r = client.chat.completions.create(**kwargs, stop=stop)
        content, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert stop not in content
    assert content == expected
    assert finish == "stop"


async def test_seed_reproducible_at_temperature_1(client: OpenAI, aclient: AsyncOpenAI) -> None:
    kwargs = dict(model="rlproxy", messages=STORY, max_tokens=5, temperature=1, seed=1234)
    first = client.chat.completions.create(**kwargs).choices[0].message.content
    # Two more at once: they share a batch, and each must still follow its own seed.
    again = await asyncio.gather(*(aclient.chat.completions.create(**kwargs) for _ in range(2)))
    assert [r.choices[0].message.content for r in again] == [first, first]


# ----------------------------------------------------------------------------- messages


def test_content_as_text_parts(client: OpenAI, story: ChatCompletion) -> None:
    parts = [{"type": "text", "text": STORY[0]["content"]}]
    r = client.chat.completions.create(
        model="rlproxy",
        messages=[{"role": "user", "content": parts}],
        max_tokens=STORY_TOKENS,
        temperature=0,
        seed=0,
    )
    assert r.choices[0].message.content == story.choices[0].message.content


def test_system_and_developer_roles(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model="rlproxy",
        messages=[
            {"role": "system", "content": "You are a pirate."},
            {"role": "developer", "content": "Answer in one short sentence."},
            {"role": "user", "content": "Who are you?"},
        ],
        max_tokens=4,
        temperature=0,
    )
    assert_completion(r, model=SERVED)


def test_unknown_fields_are_accepted(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model="rlproxy",
        messages=STORY,
        max_tokens=2,
        temperature=0,
        extra_body={"some_future_field": 1, "another": {"nested": [1, 2]}},
    )
    assert_completion(r, model=SERVED)


# ----------------------------------------------------------------------------- models


def test_models_list(client: OpenAI) -> None:
    models = client.models.list().data
    ids = [m.id for m in models]
    for expected in ("rlproxy", "rlproxy@base", *ALIASES):
        assert expected in ids
    assert len(ids) == len(set(ids))
    for m in models:
        assert m.object == "model"
        assert isinstance(m.created, int)
        assert isinstance(m.owned_by, str)


@pytest.mark.parametrize("model_id", ["gpt-4o-mini", "rlproxy", "rlproxy@base"])
def test_models_retrieve(client: OpenAI, model_id: str) -> None:
    m = client.models.retrieve(model_id)
    assert m.id == model_id
    assert m.object == "model"


async def test_async_models_list(aclient: AsyncOpenAI) -> None:
    ids = [m.id async for m in aclient.models.list()]
    assert "rlproxy" in ids and "gpt-4o-mini" in ids


@pytest.mark.parametrize("stream", [False, True])
def test_fields_with_no_effect_are_named_in_a_header(client: OpenAI, stream: bool) -> None:
    """What OpenAI takes and rlproxy does nothing with is named, never its value: `store: false`
    (the call is stored and trained on all the same), a `service_tier` (one tier here),
    `reasoning_effort` (the model does not reason) and unknown fields. `metadata` (kept with the
    stored call) and `prompt_cache_key` (the replica affinity key) are honoured, not named."""
    raw = client.chat.completions.with_raw_response.create(
        model="rlproxy",
        messages=STORY,
        max_tokens=2,
        stream=stream,
        store=False,
        metadata={"run": "r-1"},
        service_tier="flex",
        prompt_cache_key="session-1",
        reasoning_effort="low",
        extra_body={"some_future_field": "sk-not-echoed"},
    )
    assert raw.headers["x-rlproxy-ignored-fields"] == (
        "reasoning_effort, service_tier, some_future_field, store"
    )
    answer = raw.parse()
    chunks = list(answer) if stream else [answer]
    assert {c.model for c in chunks} == {SERVED}
    plain = client.chat.completions.with_raw_response.create(
        model="rlproxy", messages=STORY, max_tokens=2, stream=stream, store=True
    )
    assert "x-rlproxy-ignored-fields" not in plain.headers
    if stream:
        list(plain.parse())
