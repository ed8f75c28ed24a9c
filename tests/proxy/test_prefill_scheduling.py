"""How the local engine prefills newcomers: first come first served within a token budget per
pass, long prompts with nothing cached alone (no mask: the causal kernel), a short cached
beginning of a long prompt ignored, and grouped-query attention read in place on CPU. Each
schedule must give the tokens and logprobs the plain one gives.

Real embedded model; the passes are read with a forward hook on the model.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import torch

from proxy.engines.attention import NAME as CPU_ATTENTION
from proxy.engines.attention import use_cpu_attention
from proxy.engines.base import ChoiceFinished, GenerationRequest, SamplingParams
from proxy.engines.kv_batch import growing_cache
from proxy.engines.local import LocalEngine
from proxy.engines.prefill_plan import LONG_PROMPT, prefill_costs, prefill_groups, worth_reusing
from tests.proxy.engine_runs import admitted_together, run

GREEDY = SamplingParams(max_tokens=6, temperature=0, top_logprobs=2)
WORDS = [
    "river",
    "stone",
    "lamp",
    "harbour",
    "cedar",
    "violet",
    "engine",
    "garden",
    "copper",
    "lantern",
    "meadow",
]


def prompt(tokenizer: Any, seed: int, words: int) -> list[int]:
    """A chat prompt of about `words` filler words, different for each seed."""
    text = " ".join(WORDS[(seed * 7 + i * (seed + 3)) % len(WORDS)] for i in range(words))
    messages = [
        {"role": "system", "content": f"Agent {seed}. {text}"},
        {"role": "user", "content": "Go."},
    ]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(rendered, add_special_tokens=False))


class Passes:
    """Each forward pass the model runs: (rows, tokens, whether a mask reached attention)."""

    def __init__(self, engine: LocalEngine) -> None:
        self.calls: list[tuple[int, int, bool]] = []
        self._hook = engine.model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, _module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        cache = kwargs["past_key_values"]
        masked = bool(cache.get_seq_length() > 0 or not bool(mask.all()))
        self.calls.append((int(ids.shape[0]), int(ids.shape[1]), masked))

    @property
    def prefills(self) -> list[tuple[int, int, bool]]:
        return [c for c in self.calls if c[1] > 1]

    def close(self) -> None:
        self._hook.remove()


async def passes_of(
    engine: LocalEngine, requests: list[GenerationRequest]
) -> tuple[list[ChoiceFinished], Passes]:
    """Admit `requests` together on `engine` (stopped afterwards); their first choices and the
    passes the model ran."""
    passes = Passes(engine)
    try:
        got = await admitted_together(engine, requests)
    finally:
        passes.close()
        await engine.stop()
    return [g[0] for g in got], passes


def assert_same(got: ChoiceFinished, want: ChoiceFinished) -> None:
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.completion_token_ids == want.completion_token_ids
    assert got.completion_logprobs == pytest.approx(want.completion_logprobs, abs=1e-4)


@pytest_asyncio.fixture(loop_scope="function")
async def plain(loaded_model) -> AsyncIterator[LocalEngine]:
    """No prefix cache, everything waiting admitted at once: the reference outputs."""
    engine = LocalEngine(loaded_model, max_batch_size=8, prefill_tokens=10**9)
    await engine.start()
    yield engine
    await engine.stop()


async def make(loaded_model: Any, **options: Any) -> LocalEngine:
    engine = LocalEngine(loaded_model, max_batch_size=8, **options)
    await engine.start()
    return engine


# ----------------------------------------------------------------- the budget


async def test_new_prompts_past_the_budget_are_prefilled_one_pass_each_first_come_first_served(
    loaded_model, tokenizer, plain: LocalEngine
) -> None:
    engine = await make(loaded_model, prefill_tokens=100)
    prompts = [prompt(tokenizer, seed, 60) for seed in range(3)]  # ~90-110 tokens each
    requests = [GenerationRequest(p, GREEDY) for p in prompts]
    got, passes = await passes_of(engine, requests)
    # One newcomer a pass, in arrival order, each followed by a decode step of every running row.
    assert passes.calls[:5] == [
        (1, len(prompts[0]), False),
        (1, 1, True),
        (1, len(prompts[1]), False),
        (2, 1, True),
        (1, len(prompts[2]), False),
    ]
    for g, r in zip(got, requests, strict=True):
        assert_same(g, (await run(plain, r))[0])


async def test_prompts_within_the_budget_share_a_pass_and_repeats_of_one_prompt_cost_nothing(
    loaded_model, tokenizer
) -> None:
    first, second, third = (prompt(tokenizer, seed, 60) for seed in range(3))
    budget = len(first) + len(second) + len(third) // 2  # `first` and `second` fit, not `third`
    engine = await make(loaded_model, prefill_tokens=budget)
    requests = [GenerationRequest(p, GREEDY) for p in (first, first, first, second, third)]
    _, passes = await passes_of(engine, requests)
    # The three copies of `first` count once, so `second` joins them; `third` waits.
    assert passes.prefills[0][:2] == (2, max(len(first), len(second)))
    assert passes.prefills[1] == (1, len(third), False)


# ----------------------------------------------------------------- long prompts alone


def test_long_prompts_with_nothing_cached_get_a_pass_of_their_own() -> None:
    long, longer, short, other_short = LONG_PROMPT, LONG_PROMPT + 40, 90, 80
    assert prefill_groups([long, longer], cached=[False, False]) == [[1], [0]]
    assert prefill_groups([short, other_short, longer], cached=[False] * 3) == [[2], [0, 1]]
    # With a cached prefix the mask is needed anyway: similar lengths still share a pass.
    assert prefill_groups([long, longer], cached=[True, True]) == [[1, 0]]


async def test_long_new_prompts_admitted_together_run_unmasked_one_by_one_and_match(
    loaded_model, tokenizer, plain: LocalEngine
) -> None:
    engine = await make(loaded_model, prefill_tokens=10**9)
    prompts = [prompt(tokenizer, seed, 540 + 30 * seed) for seed in range(3)]
    assert all(len(p) >= LONG_PROMPT for p in prompts) and len({len(p) for p in prompts}) == 3
    requests = [GenerationRequest(p, GREEDY) for p in prompts]
    got, passes = await passes_of(engine, requests)
    # Padded together they would need a mask (and the slower kernel); alone, none.
    assert sorted(passes.prefills) == sorted((1, len(p), False) for p in prompts)
    for g, r in zip(got, requests, strict=True):
        assert_same(g, (await run(plain, r))[0])


# ----------------------------------------------------------------- short hits on long prompts


def test_a_short_cached_beginning_of_a_long_prompt_is_not_worth_a_mask() -> None:
    flops = (2 * 106e6, 4 * 576 * 30)  # SmolLM2-135M
    assert not worth_reusing(15, 2849, *flops)  # eight agents' shared "You are agent "
    assert worth_reusing(2733, 2848, *flops)  # an agent's next turn
    assert worth_reusing(1000, 3000, *flops)
    assert worth_reusing(10, 100, *flops)  # short prompts: attention is a small share


async def test_a_long_prompt_sharing_only_its_first_tokens_runs_whole_and_unmasked(
    loaded_model, tokenizer, plain: LocalEngine
) -> None:
    engine = await make(loaded_model, prefix_cache_bytes=2**30)
    assert worth_reusing(5, 700, *prefill_costs(loaded_model.model)) is False
    first = prompt(tokenizer, 1, 600)
    second = prompt(tokenizer, 2, 600)
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert 2 <= shared < 20
    passes = Passes(engine)
    try:
        answer = (await run(engine, GenerationRequest(first, GREEDY)))[0]
        hits = engine.health().detail["prefix_cache_hit_tokens"]
        got = (await run(engine, GenerationRequest(second, GREEDY)))[0]
        assert engine.health().detail["prefix_cache_hit_tokens"] == hits  # not reused
        assert passes.prefills[-1] == (1, len(second), False)
        # The same session's next turn still is.
        later = [*first, *answer.completion_token_ids, *tokenizer.encode(" More.")]
        await run(engine, GenerationRequest(later, GREEDY))
        assert engine.health().detail["prefix_cache_hit_tokens"] >= len(first) - 1 + hits
        assert passes.prefills[-1][1] < 10 and passes.prefills[-1][2]
    finally:
        passes.close()
        await engine.stop()
    assert_same(got, (await run(plain, GenerationRequest(second, GREEDY)))[0])


# ----------------------------------------------------------------- attention on CPU


def test_cpu_attention_reads_grouped_heads_in_place_and_equals_transformers_sdpa(
    loaded_model,
) -> None:
    model = loaded_model.model
    assert use_cpu_attention(model)  # what an engine on CPU does (again: it is idempotent)
    assert model.config._attn_implementation == CPU_ATTENTION
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    torch.manual_seed(0)
    ids = torch.randint(100, 40000, (2, 150))
    mask = torch.ones(2, 150, dtype=torch.long)
    mask[1, :9] = 0  # a left-padded row: the pass carries a mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)

    def logits() -> torch.Tensor:
        cache = growing_cache(model.config)
        with torch.inference_mode():
            model(
                input_ids=ids[:, :100],
                attention_mask=mask[:, :100],
                position_ids=positions[:, :100],
                past_key_values=cache,
                use_cache=True,
            )
            out = model(  # 50 new positions over 100 cached: masked, several queries
                input_ids=ids[:, 100:],
                attention_mask=mask,
                position_ids=positions[:, 100:],
                past_key_values=cache,
                use_cache=True,
            )
        return out.logits

    ours = logits()
    model.set_attn_implementation("sdpa")
    try:
        theirs = logits()
    finally:
        model.set_attn_implementation(CPU_ATTENTION)
    assert torch.allclose(ours, theirs, atol=1e-4)
