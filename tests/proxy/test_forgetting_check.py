"""The forgetting check (`proxy.adapters.forgetting`): its divergence on hand-made tensors, the
prompts it ships, its verdicts, and its passes on the real local engine.

- KL(base ‖ version) per token, the token-weighted mean over prompts and the greedy-change shares,
  on tiny distributions whose values are worked out by hand.
- The check over engine fakes that honour the engine contract (`Engine`, `TeacherForcing`): the
  base's answers are generated once, a version over the limit is held, an engine that cannot
  teacher-force skips (saying so), a failing pass holds with its error.
- The real embedded model on the real local engine: the teacher-forced distributions agree with
  the logprobs the engine reported while generating the same answer, a freshly initialised LoRA
  has zero divergence, a broken one is held.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from proxy.adapters.forgetting import (
    PASSED,
    SKIPPED,
    Divergence,
    ForgettingCheck,
    ForgettingConfig,
    GeneralPrompt,
    PromptDivergence,
    compare_answer,
    forgetting_config,
    general_prompts,
    token_kl,
)
from proxy.adapters.held import (
    CHECK_FAILED,
    FORGETTING,
    HELD,
    held_record,
    held_rollout,
    shown_status,
)
from proxy.engines.base import (
    ChoiceFinished,
    EngineHealth,
    GenerationRequest,
    SamplingParams,
    TeacherForcing,
)
from proxy.settings import ForgettingSettings
from storage.records import AdapterRecord


def logs(*rows: Sequence[float]) -> torch.Tensor:
    """(T, V) log-probabilities from rows of probabilities."""
    return torch.tensor(rows, dtype=torch.float64).log()


# --------------------------------------------------------------------------- the divergence


def test_kl_of_identical_distributions_is_zero() -> None:
    p = logs([0.5, 0.3, 0.2], [0.1, 0.1, 0.8])
    assert token_kl(p, p).tolist() == [0.0, 0.0]


def test_kl_is_the_base_weighted_log_ratio_at_each_position() -> None:
    base = logs([0.5, 0.5], [0.9, 0.1])
    version = logs([0.9, 0.1], [0.9, 0.1])
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)  # 0.5108...
    assert token_kl(base, version).tolist() == pytest.approx([expected, 0.0])
    # KL(base ‖ version), not the reverse: the other order weighs by the version's mass.
    reverse = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)  # 0.3681...
    assert token_kl(version, base).tolist()[0] == pytest.approx(reverse)


def test_tokens_the_base_never_says_add_nothing_not_nan() -> None:
    base = torch.tensor([[0.0, -math.inf]])  # all mass on token 0
    version = logs([0.25, 0.75])
    assert token_kl(base, version).tolist() == pytest.approx([math.log(4)])


def test_a_version_that_takes_all_mass_off_the_base_answer_is_infinitely_far() -> None:
    base = logs([0.5, 0.5])
    version = torch.tensor([[0.0, -math.inf]])
    assert token_kl(base, version).tolist() == [math.inf]


def test_compare_answer_finds_where_the_greedy_answer_leaves_the_base() -> None:
    base = logs([0.6, 0.4], [0.7, 0.3], [0.2, 0.8])
    same_start = logs([0.55, 0.45], [0.4, 0.6], [0.2, 0.8])  # argmax differs at position 1
    d = compare_answer("p", base, same_start)
    assert (d.first_token_changed, d.answer_changed, d.tokens) == (False, True, 3)
    assert d.kl_sum == pytest.approx(float(token_kl(base, same_start).sum()))
    d = compare_answer("p", base, logs([0.3, 0.7], [0.7, 0.3], [0.2, 0.8]))
    assert (d.first_token_changed, d.answer_changed) == (True, True)
    d = compare_answer("p", base, base)
    assert (d.first_token_changed, d.answer_changed, d.kl_sum) == (False, False, 0.0)


def test_the_mean_is_over_answer_tokens_and_the_shares_over_prompts() -> None:
    short = PromptDivergence("short", kl_sum=1.0, tokens=2, first_token_changed=True,
                             answer_changed=True)  # fmt: skip
    long = PromptDivergence("long", kl_sum=1.0, tokens=6, first_token_changed=False,
                            answer_changed=True)  # fmt: skip
    calm = PromptDivergence("calm", kl_sum=0.0, tokens=2, first_token_changed=False,
                            answer_changed=False)  # fmt: skip
    d = Divergence.of([short, long, calm])
    assert d.mean_kl == pytest.approx(2.0 / 10)  # token-weighted, not the mean of 0.5, 1/6, 0
    assert (d.worst_prompt, d.worst_prompt_kl) == ("short", 0.5)
    assert d.first_token_changed == pytest.approx(1 / 3)
    assert d.answer_changed == pytest.approx(2 / 3)
    assert (d.prompts, d.tokens) == (3, 10)
    with pytest.raises(ValueError):
        Divergence.of([])


# --------------------------------------------------------------------------- prompts, settings


def test_the_shipped_prompts_are_about_twenty_varied_conversations() -> None:
    prompts = general_prompts()
    assert 18 <= len(prompts) <= 30
    assert len({p.id for p in prompts}) == len(prompts)
    kinds = {p.kind for p in prompts}
    assert {"fact", "instruction", "arithmetic", "rewrite", "code", "refusal"} <= kinds
    for p in prompts:
        assert p.messages and p.messages[-1]["role"] == "user"
        assert all(isinstance(m["content"], str) and m["content"] for m in p.messages)


def test_every_shipped_prompt_renders_with_the_models_chat_template(tokenizer: Any) -> None:
    from proxy.chat.prompt import ChatTemplate

    template = ChatTemplate.for_tokenizer(tokenizer)
    for p in general_prompts():
        ids = tokenizer.encode(template.render(p.messages, None), add_special_tokens=False)
        assert 5 < len(ids) < 200, p.id


def test_settings_build_the_config_or_turn_the_check_off() -> None:
    assert forgetting_config(ForgettingSettings()) == ForgettingConfig()
    on = ForgettingSettings(max_kl=0.3, answer_tokens=16)
    assert forgetting_config(on) == ForgettingConfig(max_kl=0.3, answer_tokens=16)
    assert forgetting_config(ForgettingSettings(enabled=False)) is None
    with pytest.raises(ValueError):
        ForgettingSettings(max_kl=0)
    with pytest.raises(ValueError):
        ForgettingConfig(max_kl=-1.0)


def test_the_switch_and_limit_are_read_from_their_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from proxy.settings import Settings

    monkeypatch.setenv("RLPROXY_FORGETTING_CHECK", "false")
    monkeypatch.setenv("RLPROXY_FORGETTING_MAX_KL", "0.25")
    settings = Settings()
    assert settings.forgetting.enabled is False
    assert settings.forgetting.max_kl == 0.25


# --------------------------------------------------------------------------- the check, on fakes

PROMPTS = [
    GeneralPrompt("a", "fact", [{"role": "user", "content": "a"}]),
    GeneralPrompt("b", "fact", [{"role": "user", "content": "b"}]),
]
VOCAB = 4


class FakeEngine:
    """The engine contract's generation side: every prompt's greedy answer is [1, 2, 3]."""

    kind = "local"
    max_context = 1024
    logprobs_after_grammar = False

    def __init__(self) -> None:
        self.generated: list[GenerationRequest] = []

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Any]:
        self.generated.append(request)
        yield ChoiceFinished(0, "length", request.prompt_ids, [1, 2, 3], [-0.1] * 3)

    async def load_adapter(self, name: str, path: str) -> None: ...

    async def unload_adapter(self, name: str) -> None: ...

    def health(self) -> EngineHealth:
        return EngineHealth(ok=True)

    def queued_rows(self) -> int:
        return 0

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class FakeForcing(FakeEngine):
    """A teacher-forcing engine whose adapters shift the base's distribution by `shift`."""

    def __init__(self, shift: dict[str | None, float]) -> None:
        super().__init__()
        self.shift = shift
        self.forced: list[tuple[list[int], list[int], list[str | None]]] = []

    async def forced_logprobs(
        self, prompt_ids: list[int], answer_ids: list[int], adapters: Sequence[str | None]
    ) -> torch.Tensor:
        self.forced.append((prompt_ids, answer_ids, list(adapters)))
        rows = []
        for adapter in adapters:
            logits = torch.zeros(len(answer_ids), VOCAB)
            logits[:, 0] = 2.0 + self.shift.get(adapter, 0.0)  # the base prefers token 0
            rows.append(torch.log_softmax(logits, -1))
        return torch.stack(rows)


def render(messages: Any) -> list[int]:
    return [100 + ord(messages[-1]["content"])]


def _kl_of_shift(shift: float) -> float:
    base = torch.log_softmax(torch.tensor([[2.0, 0, 0, 0]]), -1)
    version = torch.log_softmax(torch.tensor([[2.0 + shift, 0, 0, 0]]), -1)
    return float(token_kl(base, version)[0])


async def test_a_version_within_the_limit_passes_and_the_base_answers_are_made_once() -> None:
    engine = FakeForcing({"v1": -0.5, "v2": -0.6})
    check = ForgettingCheck(engine, render, ForgettingConfig(max_kl=1.0), PROMPTS)
    assert isinstance(engine, TeacherForcing) and check.unsupported is None
    verdict = await check.check(1)
    assert verdict.state == PASSED and verdict.held_for is None
    assert verdict.divergence is not None
    assert verdict.divergence.mean_kl == pytest.approx(_kl_of_shift(-0.5), rel=1e-5)
    assert verdict.divergence.answer_changed == 0.0  # token 0 still wins everywhere
    # greedy, at most answer_tokens, the base's (no adapter), one per prompt
    assert [(r.params.temperature, r.params.max_tokens, r.adapter) for r in engine.generated] == [
        (0.0, 32, None),
        (0.0, 32, None),
    ]
    # each answer teacher-forced through the base and the version, in one pass
    assert engine.forced == [([197], [1, 2, 3], [None, "v1"]), ([198], [1, 2, 3], [None, "v1"])]
    await check.check(2)
    assert len(engine.generated) == 2  # the base's answers were not generated again
    assert len(engine.forced) == 4
    assert await check.check(1) is verdict  # a version is checked once
    assert len(engine.forced) == 4
    assert +check.outcomes == {PASSED: 2} and check.last is not None and check.last.version == 2


async def test_a_version_over_the_limit_is_held_with_its_figures() -> None:
    engine = FakeForcing({"v3": -4.0})  # token 0 no longer wins: every answer changes
    check = ForgettingCheck(engine, render, ForgettingConfig(max_kl=0.5), PROMPTS)
    verdict = await check.check(3)
    assert verdict.state == HELD and verdict.held_for == FORGETTING
    assert verdict.divergence is not None
    assert verdict.divergence.mean_kl == pytest.approx(_kl_of_shift(-4.0), rel=1e-5)
    assert verdict.divergence.mean_kl > 0.5
    assert verdict.divergence.first_token_changed == 1.0
    assert verdict.reason.startswith("held: it forgot general answers: mean KL(base ‖ v3)")
    assert "RLPROXY_FORGETTING_MAX_KL" in verdict.reason
    assert +check.held == {FORGETTING: 1}


async def test_an_engine_without_teacher_forcing_skips_and_says_why() -> None:
    engine = FakeEngine()
    engine.kind = "vllm"
    check = ForgettingCheck(engine, render, ForgettingConfig(), PROMPTS)
    assert not isinstance(engine, TeacherForcing)
    verdict = await check.check(1)
    assert verdict.state == SKIPPED and verdict.divergence is None
    assert "vllm engine gives no teacher-forced distributions" in verdict.reason
    assert engine.generated == []  # nothing was asked of it
    assert +check.outcomes == {SKIPPED: 1} and not +check.held


async def test_a_check_that_fails_holds_the_version_with_the_error() -> None:
    class Failing(FakeForcing):
        async def forced_logprobs(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            raise RuntimeError("out of memory")

    check = ForgettingCheck(Failing({}), render, ForgettingConfig(), PROMPTS)
    verdict = await check.check(4)
    assert verdict.state == HELD and verdict.held_for == CHECK_FAILED
    assert "the forgetting check failed" in verdict.reason and "out of memory" in verdict.reason
    assert +check.held == {CHECK_FAILED: 1}


def test_a_held_version_is_recorded_and_read_back_as_held() -> None:
    verdict = {"state": HELD, "reason": "held: it forgot general answers", "version": 3}
    record = AdapterRecord(
        "rlproxy", 3, "/x", "rejected", 0.0, 0.0, error=verdict["reason"],
        rollout=held_rollout(verdict),
    )  # fmt: skip
    assert held_record(record) == verdict
    assert shown_status(record) == "held"
    rejected = AdapterRecord("rlproxy", 4, "/x", "rejected", 0.0, 0.0, error="corrupt")
    assert held_record(rejected) is None and shown_status(rejected) == "rejected"
    rolled = AdapterRecord(
        "rlproxy", 5, "/x", "rejected", 0.0, 0.0, rollout={"state": "rolled_back"}
    )
    assert held_record(rolled) is None and shown_status(rolled) == "rejected"


# --------------------------------------------------------------------------- the real engine


@pytest.fixture(scope="module")
def loras(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> dict[str, Path]:
    from tests.e2e.test_adapters import write_random_lora

    root = tmp_path_factory.mktemp("forgetting-loras")
    write_random_lora(model_data_dir, root / "fresh", scale=0.0)  # B = 0, as PEFT initialises
    write_random_lora(model_data_dir, root / "broken", scale=30.0)
    return {"fresh": root / "fresh", "broken": root / "broken"}


async def test_on_the_local_engine_a_fresh_lora_passes_and_a_broken_one_is_held(
    model_data_dir: Path, loras: dict[str, Path]
) -> None:
    from proxy.chat.prompt import ChatTemplate
    from proxy.engines.loader import load_model
    from proxy.engines.local import LocalEngine

    loaded = load_model(model_data_dir, device=torch.device("cpu"))  # PEFT wraps its own copy
    engine = LocalEngine(loaded)
    template = ChatTemplate.for_tokenizer(loaded.tokenizer)

    def render_real(messages: Any) -> list[int]:
        text = template.render(messages, None)
        return list(loaded.tokenizer.encode(text, add_special_tokens=False))

    prompts = [p for p in general_prompts() if p.id in ("capital", "times", "lock", "square")]
    config = ForgettingConfig(answer_tokens=12)
    check = ForgettingCheck(engine, render_real, config, prompts)
    await engine.start()
    try:
        # Teacher forcing lines up with generation: the forced base distribution gives every
        # token of the base's own greedy answer the logprob the engine reported sampling it.
        (first, *_) = await check.base_answers()
        request = GenerationRequest(first.prompt_ids, SamplingParams(max_tokens=12, temperature=0))
        reported: list[float] = []
        async for event in engine.generate(request):
            if isinstance(event, ChoiceFinished):
                assert event.completion_token_ids == first.answer_ids
                reported = event.completion_logprobs
        forced = await engine.forced_logprobs(first.prompt_ids, first.answer_ids, [None])
        assert forced.shape == (1, len(first.answer_ids), loaded.model.config.vocab_size)
        picked = forced[0].gather(-1, torch.tensor(first.answer_ids)[:, None]).squeeze(-1)
        assert picked.tolist() == pytest.approx(reported, abs=2e-3)
        assert forced[0].argmax(-1).tolist() == first.answer_ids  # greedy is the argmax

        await engine.load_adapter("v1", str(loras["fresh"]))
        await engine.load_adapter("v2", str(loras["broken"]))
        fresh = await check.check(1)
        broken = await check.check(2)
    finally:
        await engine.stop()
    assert fresh.state == PASSED, fresh.reason
    assert fresh.divergence is not None and fresh.divergence.mean_kl == pytest.approx(0, abs=1e-6)
    assert fresh.divergence.answer_changed == 0.0
    assert broken.state == HELD and broken.held_for == FORGETTING, broken.reason
    assert broken.divergence is not None and broken.divergence.mean_kl > 5 * config.max_kl
    assert broken.divergence.answer_changed == 1.0
