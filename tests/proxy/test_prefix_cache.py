"""The local engine's prefix cache: a later turn reuses the KV of the earlier turn's prompt AND
answer, gives the tokens and logprobs it would give without the cache, never reuses the KV of
weights that were swapped out, and stays within its byte budget.

The cache's own bookkeeping is tested on small hand-made tensors; the engine tests run the real
embedded model, with the cache (`on`) beside an engine without it (`off`) on the same weights.
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from safetensors.torch import load_file, save_file

from proxy.chat.grammar import constraint_for_json_object
from proxy.engines.base import ChoiceFinished, GenerationRequest, SamplingParams
from proxy.engines.local import LocalEngine
from proxy.engines.prefix_cache import KVSpan, PrefixCache
from proxy.telemetry.metrics import _StateCollector
from tests.e2e.test_adapters import write_random_lora
from tests.proxy.engine_runs import admitted_together, run

GREEDY = SamplingParams(max_tokens=8, temperature=0, top_logprobs=2)
SYSTEM = "You are a careful assistant for a team of engineers. " * 12
QUESTIONS = ["What is the capital of France?", "And of Italy?", "Name a river there."]


# ----------------------------------------------------------------- the cache on small tensors


def span(length: int, fill: float = 1.0, layers: int = 2) -> KVSpan:
    """A span of `length` positions: (1, H=1, T, D=4) float32 per layer, 32 bytes a position."""
    t = torch.full((1, 1, length, 4), fill)
    return KVSpan.copy_of([t] * layers, [t] * layers)


def test_lookup_finds_the_longest_prefix_under_the_same_key_and_leaves_the_last_token() -> None:
    cache = PrefixCache(max_bytes=10**6)
    cache.insert("a", [1, 2, 3, 4], [span(4)])
    cache.insert("a", [1, 2, 9, 9, 9], [span(5)])
    cache.insert("b", [1, 2, 3, 4, 5, 6], [span(6)])
    hit = cache.lookup("a", [1, 2, 3, 4, 5, 6, 7])
    assert hit is not None and hit.length == 4
    assert sum(s.length for s in hit.spans) == 4
    # The whole prompt is stored: all but its last token come from the cache.
    hit = cache.lookup("a", [1, 2, 3, 4])
    assert hit is not None and hit.length == 3 and hit.spans[0].length == 3
    assert cache.lookup("c", [1, 2, 3, 4, 5]) is None  # another adapter's identity: nothing
    assert cache.lookup("a", [7, 1, 2]) is None


def test_an_entry_that_extends_another_replaces_it_and_shared_spans_count_once() -> None:
    cache = PrefixCache(max_bytes=10**6)
    first = span(4)
    cache.insert("a", [1, 2, 3, 4], [first])
    assert cache.bytes == 4 * 32 * 2 and len(cache) == 1
    hit = cache.lookup("a", [1, 2, 3, 4, 5, 6])
    assert hit is not None and hit.length == 4
    cache.insert("a", [1, 2, 3, 4, 5, 6], [*hit.spans, span(2)])  # the next turn
    assert len(cache) == 1  # the turn-1 entry is inside the turn-2 one
    assert cache.bytes == 6 * 32 * 2  # turn 1's span is held once
    cache.insert("a", [1, 2, 3, 4, 5, 6, 7, 8], [*hit.spans, span(4)])  # a sibling branch
    cache.insert("a", [1, 2, 3, 4, 9], [*hit.spans, span(1)])
    assert len(cache) == 2  # 1..8 holds 1..6; 1..4,9 branches off
    assert cache.bytes == (4 + 4 + 1) * 32 * 2  # the shared first span once, not three times


def test_least_recently_used_entries_go_first_when_the_bytes_run_out() -> None:
    now = [0.0]
    cache = PrefixCache(max_bytes=3 * 10 * 64, clock=lambda: now[0])  # three 10-token entries
    for first in (1, 2, 3):
        now[0] += 1
        cache.insert("a", [first, *range(100, 109)], [span(10)])
    now[0] += 1
    assert cache.lookup("a", [1, *range(100, 120)]) is not None  # 1 is now the most recent
    now[0] += 1
    cache.insert("a", [4, *range(100, 109)], [span(10)])
    assert cache.bytes <= cache.max_bytes and cache.stats.evicted == 1
    assert cache.lookup("a", [2, *range(100, 120)]) is None  # the least recently used
    assert cache.lookup("a", [1, *range(100, 120)]) is not None
    cache.insert("a", list(range(200, 240)), [span(40)])  # larger than the whole budget
    assert cache.bytes <= cache.max_bytes and cache.lookup("a", list(range(200, 241))) is None


def test_entries_expire_and_an_adapter_s_entries_can_be_dropped() -> None:
    now = [0.0]
    cache = PrefixCache(max_bytes=10**6, ttl_s=60, clock=lambda: now[0])
    cache.insert("a", [1, 2, 3], [span(3)])
    cache.insert("b", [1, 2, 3], [span(3)])
    now[0] = 30
    assert cache.lookup("a", [1, 2, 3, 4]) is not None
    now[0] = 80  # "a" was used at 30, "b" at 0
    assert cache.lookup("b", [1, 2, 3, 4]) is None and cache.stats.expired == 1
    cache.drop("a")
    assert len(cache) == 0 and cache.bytes == 0
    assert PrefixCache(max_bytes=0).lookup("a", [1, 2]) is None  # 0 bytes: off


# ----------------------------------------------------------------- the engine on the real model


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


async def session(engine: LocalEngine, tokenizer: Any, turns: int) -> list[ChoiceFinished]:
    """An agent's conversation: each turn resends the history with the answer it got."""
    messages = [{"role": "system", "content": SYSTEM}]
    answers = []
    for question in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": question})
        answer = (await run(engine, GenerationRequest(chat_ids(tokenizer, messages), GREEDY)))[0]
        answers.append(answer)
        messages.append({"role": "assistant", "content": answer.text})
    return answers


def assert_same(got: ChoiceFinished, want: ChoiceFinished) -> None:
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.completion_token_ids == want.completion_token_ids
    assert got.text == want.text
    assert got.completion_logprobs == pytest.approx(want.completion_logprobs, abs=1e-4)


def cache_figures(engine: LocalEngine) -> tuple[int, int]:
    detail = engine.health().detail
    return detail["prefix_cache_hit_tokens"], detail["prefix_cache_query_tokens"]


@pytest_asyncio.fixture(loop_scope="function")
async def off(loaded_model) -> AsyncIterator[LocalEngine]:
    engine = LocalEngine(loaded_model, max_batch_size=8)
    await engine.start()
    yield engine
    await engine.stop()


@pytest_asyncio.fixture(loop_scope="function")
async def on(loaded_model) -> AsyncIterator[LocalEngine]:
    engine = LocalEngine(loaded_model, max_batch_size=8, prefix_cache_bytes=2**30)
    await engine.start()
    yield engine
    await engine.stop()


async def test_a_session_reuses_its_prompts_and_answers_and_matches_no_cache(
    on: LocalEngine, off: LocalEngine, tokenizer
) -> None:
    prefills: list[int] = []  # tokens each prefill ran (decode steps pass no logits_to_keep)

    def record(_module, _args, kwargs) -> None:
        if kwargs.get("logits_to_keep"):
            prefills.append(int(kwargs["input_ids"].shape[1]))

    hook = on.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        cached = await session(on, tokenizer, turns=3)
    finally:
        hook.remove()
    plain = await session(off, tokenizer, turns=3)
    for got, want in zip(cached, plain, strict=True):
        assert_same(got, want)
    hits, queried = cache_figures(on)
    assert queried == sum(len(a.prompt_token_ids) for a in cached)
    first, second, third = cached
    # Turn 1 ran its whole prompt; turns 2 and 3 ran only what follows the previous turn's
    # prompt AND most of its answer (the generated tokens are cached too; the last one or two
    # may tokenize differently once the answer is rendered into the next prompt).
    assert len(prefills) == 3 and prefills[0] == len(first.prompt_token_ids)
    for ran, turn, before in ((prefills[1], second, first), (prefills[2], third, second)):
        reused = len(before.prompt_token_ids) + len(before.completion_token_ids) - 2
        assert ran <= len(turn.prompt_token_ids) - reused
    assert hits >= len(first.prompt_token_ids) + len(second.prompt_token_ids)
    assert off.health().detail["prefix_cache_hit_tokens"] == 0
    detail = on.health().detail["prefix_cache"]
    assert 0 < detail["bytes"] <= detail["max_bytes"] and detail["entries"] >= 1
    assert detail["hit_tokens"] == hits and detail["query_tokens"] == queried
    # /metrics reads the same figures from the engine's health.
    families = {f.name: f for f in _StateCollector()._engine(on.health().detail)}
    assert families["rlproxy_engine_prefix_cache_hit_tokens"].samples[0].value == hits
    assert families["rlproxy_engine_prefix_cache_query_tokens"].samples[0].value == queried
    assert families["rlproxy_engine_prefix_cache_bytes"].samples[0].value == detail["bytes"]


async def test_n_choices_on_a_cached_prefix_match_no_cache(
    on: LocalEngine, off: LocalEngine, tokenizer
) -> None:
    answers = await session(on, tokenizer, turns=1)
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTIONS[0]},
        {"role": "assistant", "content": answers[0].text},
        {"role": "user", "content": QUESTIONS[1]},
    ]
    request = GenerationRequest(chat_ids(tokenizer, messages), GREEDY, n=3)
    hits_before, _ = cache_figures(on)
    got = await run(on, request)
    want = await run(off, request)
    assert cache_figures(on)[0] - hits_before > len(answers[0].prompt_token_ids)
    assert sorted(got) == [0, 1, 2]
    for i in range(3):
        assert_same(got[i], want[i])
    # Seeded sampling over a cached prefix draws what it draws without the cache.
    sampled = SamplingParams(max_tokens=8, temperature=0.7, seed=11)
    seeded = GenerationRequest(chat_ids(tokenizer, messages), sampled, n=3)
    got, want = await run(on, seeded), await run(off, seeded)
    assert [got[i].completion_token_ids for i in range(3)] == [
        want[i].completion_token_ids for i in range(3)
    ]


async def test_a_batch_mixing_cached_uncached_and_grammar_rows_matches_no_cache(
    on: LocalEngine, off: LocalEngine, tokenizer
) -> None:
    answers = await session(on, tokenizer, turns=1)
    later = chat_ids(
        tokenizer,
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": QUESTIONS[0]},
            {"role": "assistant", "content": answers[0].text},
            {"role": "user", "content": QUESTIONS[1]},
        ],
    )
    fresh = chat_ids(tokenizer, [{"role": "user", "content": "Write a haiku about rain."}])
    as_json = chat_ids(
        tokenizer,
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Reply in JSON."}],
    )
    requests = [
        GenerationRequest(later, GREEDY),  # cached: the session's next turn
        GenerationRequest(fresh, GREEDY),  # nothing cached
        GenerationRequest(as_json, GREEDY, grammar=constraint_for_json_object()),  # system cached
    ]
    hits_before, _ = cache_figures(on)
    got = await admitted_together(on, requests)
    want = [await run(off, r) for r in requests]
    assert cache_figures(on)[0] - hits_before > len(answers[0].prompt_token_ids)
    for g, w in zip(got, want, strict=True):
        assert_same(g[0], w[0])
    assert got[2][0].text.lstrip().startswith("{")


# ----------------------------------------------------------------- adapters and the budget


def write_other_lora(source: Path, target: Path) -> None:
    """The same LoRA with lora_B negated: other weights, same name and shape."""
    target.mkdir(parents=True)
    (target / "adapter_config.json").write_text((source / "adapter_config.json").read_text())
    tensors = load_file(str(source / "adapter_model.safetensors"))
    save_file(
        {k: -v if "lora_B" in k else v for k, v in tensors.items()},
        str(target / "adapter_model.safetensors"),
    )


@pytest.fixture(scope="module")
def loras(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("loras")
    write_random_lora(model_data_dir, root / "a")
    write_other_lora(root / "a", root / "b")
    return root / "a", root / "b"


async def test_a_version_loaded_again_under_its_name_never_reuses_the_old_kv(
    model_data_dir: Path, loras: tuple[Path, Path], tokenizer
) -> None:
    from proxy.engines.loader import load_model

    first, second = loras
    name = "rlproxy@1"
    # Own model objects: PEFT wraps the model it loads adapters into.
    on = LocalEngine(load_model(model_data_dir), max_batch_size=8, prefix_cache_bytes=2**30)
    off = LocalEngine(load_model(model_data_dir), max_batch_size=8)
    await on.start()
    await off.start()
    try:
        await on.load_adapter(name, str(first))
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi."}]
        ids = chat_ids(tokenizer, messages)
        on_first = (await run(on, GenerationRequest(ids, GREEDY, adapter=name)))[0]
        again = (await run(on, GenerationRequest(ids, GREEDY, adapter=name)))[0]
        assert_same(again, on_first)
        hits, _ = cache_figures(on)
        assert hits == len(ids) - 1  # the same version: its own prompt, all but the last token

        # Hot swap: the name is unloaded and loaded again with other weights.
        await on.unload_adapter(name)
        assert on.health().detail["prefix_cache"]["entries"] == 0
        await on.load_adapter(name, str(second))
        await off.load_adapter(name, str(second))
        swapped = (await run(on, GenerationRequest(ids, GREEDY, adapter=name)))[0]
        assert cache_figures(on)[0] == hits  # nothing of the old version was reused
        want = (await run(off, GenerationRequest(ids, GREEDY, adapter=name)))[0]
        assert_same(swapped, want)
        assert swapped.completion_logprobs != pytest.approx(on_first.completion_logprobs, abs=1e-3)

        # Rows of the base model and of the adapter in one batch, each on its own KV.
        base_first = (await run(on, GenerationRequest(ids, GREEDY)))[0]
        both = await admitted_together(
            on, [GenerationRequest(ids, GREEDY), GenerationRequest(ids, GREEDY, adapter=name)]
        )
        assert cache_figures(on)[0] > hits
        assert_same(both[0][0], base_first)
        assert_same(both[1][0], want)
    finally:
        await on.stop()
        await off.stop()


def two_prompts_and_room_for_one(tokenizer: Any) -> tuple[list[int], list[int], int]:
    """Two prompts of about 150 tokens, and a cache budget that holds one answered prompt, not
    two."""
    one = chat_ids(tokenizer, [{"role": "user", "content": "Tell me about the sea. " * 20}])
    two = chat_ids(tokenizer, [{"role": "user", "content": "Tell me about hills. " * 20}])
    per_token = 30 * 2 * 3 * 64 * 4  # layers x (K, V) x KV heads x head dim x fp32
    return one, two, int(per_token * (len(one) + 8) * 1.5)


async def test_the_cache_stays_within_its_bytes_and_evicts_the_least_recently_used(
    loaded_model, tokenizer
) -> None:
    one, two, budget = two_prompts_and_room_for_one(tokenizer)
    engine = LocalEngine(loaded_model, prefix_cache_bytes=budget)
    await engine.start()
    try:
        await run(engine, GenerationRequest(one, GREEDY))
        held = engine.health().detail["prefix_cache"]
        assert held["entries"] == 1 and 0 < held["bytes"] <= budget
        await run(engine, GenerationRequest(two, GREEDY))
        held = engine.health().detail["prefix_cache"]
        assert held["entries"] == 1 and held["bytes"] <= budget and held["evicted"] >= 1
        hits, _ = cache_figures(engine)
        shared = next(i for i, (a, b) in enumerate(zip(one, two, strict=False)) if a != b)
        await run(engine, GenerationRequest(one, GREEDY))  # evicted: only what `two` shares
        assert cache_figures(engine)[0] == hits + shared
        hits = cache_figures(engine)[0]
        await run(engine, GenerationRequest(one, GREEDY))  # now held: all but the last token
        assert cache_figures(engine)[0] == hits + len(one) - 1
        assert engine.health().detail["prefix_cache"]["bytes"] <= budget
    finally:
        await engine.stop()


def kv_no_cache_holds() -> int:
    """Bytes of live KV spans that no prefix cache in this process holds (rows pinning KV the
    cache has let go). Spans are freed as soon as nothing refers to them (no cycles)."""
    caches = [o for o in gc.get_objects() if type(o) is PrefixCache]
    held = {id(s.block) for c in caches for e in c._entries for s in e.spans}
    live = {id(o.block): o.block for o in gc.get_objects() if type(o) is KVSpan}
    return sum(block.nbytes for key, block in live.items() if key not in held)


async def test_rows_in_flight_hold_no_kv_the_cache_has_let_go(
    loaded_model, tokenizer, off: LocalEngine
) -> None:
    """The byte bound holds while rows decode: a row keeps no copy of its prompt's KV once the
    cache evicted it (64 rows of 820 tokens would pin 2.4 GB beside a 1 GiB cache), and a row
    whose prompt was evicted still stores its whole KV when it finishes."""
    one, two, budget = two_prompts_and_room_for_one(tokenizer)
    engine = LocalEngine(loaded_model, prefix_cache_bytes=budget)
    pinned: list[int] = []

    def during_decode(_module, _args, kwargs) -> None:
        if not kwargs.get("logits_to_keep"):  # a decode step: both rows admitted and running
            pinned.append(kv_no_cache_holds())

    hook = engine.model.register_forward_pre_hook(during_decode, with_kwargs=True)
    await engine.start()
    before = kv_no_cache_holds()  # whatever earlier tests left alive
    try:
        # `two` ends first, so `one` (its prompt evicted at `two`'s prefill) is stored last.
        short = SamplingParams(max_tokens=4, temperature=0, top_logprobs=2)
        first, _ = await admitted_together(
            engine, [GenerationRequest(one, GREEDY), GenerationRequest(two, short)]
        )
        hook.remove()
        assert pinned and max(pinned) == before, f"rows pinned {max(pinned) - before} bytes"
        assert engine.health().detail["prefix_cache"]["bytes"] <= budget
        # `one`'s prompt was evicted while it decoded; its next turn finds its prompt and answer.
        answer = first[0]
        again = (
            one
            + answer.completion_token_ids
            + tokenizer.encode("\nMore.", add_special_tokens=False)
        )
        hits, _ = cache_figures(engine)
        got = (await run(engine, GenerationRequest(again, GREEDY)))[0]
        assert cache_figures(engine)[0] - hits >= len(one) + len(answer.completion_token_ids) - 1
        assert_same(got, (await run(off, GenerationRequest(again, GREEDY)))[0])
    finally:
        hook.remove()
        await engine.stop()


# ----------------------------------------------------------------- decode steps without torch.cat


def test_a_growing_layer_holds_what_concatenation_holds_and_never_writes_tensors_put_in() -> None:
    from transformers.cache_utils import DynamicLayer

    from proxy.engines.kv_batch import GrowingLayer

    torch.manual_seed(0)
    growing, plain = GrowingLayer(), DynamicLayer()
    given = torch.randn(2, 3, 5, 4)
    kept = given.clone()
    batch, held, held_before = 2, given, kept
    for step in range(200):
        new = 7 if step == 0 else 1
        k, v = torch.randn(batch, 3, new, 4), torch.randn(batch, 3, new, 4)
        got, want = growing.update(k, v), plain.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        if step == 50:  # rows join from outside (KVBatch.stack): new tensors are put in
            growing.keys = torch.cat([given, growing.keys[:1, :, -5:]])
            growing.values = torch.cat([given, growing.values[:1, :, -5:]])
            plain.keys, plain.values = growing.keys.clone(), growing.values.clone()
            held, batch = growing.keys, 3
            held_before = held.clone()
    assert torch.equal(given, kept)
    assert torch.equal(held, held_before)  # the tensor put in was copied, never written
    assert growing.get_seq_length() == plain.get_seq_length() == 5 + 149
