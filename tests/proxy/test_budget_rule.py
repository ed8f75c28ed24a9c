"""The output budget (`proxy.chat.budget`): a budget asked for is fitted to what the context
leaves after the prompt, in the one place every engine's request goes through
(`proxy.chat.request.prepare_chat`); strict mode refuses as vLLM does; a prompt that alone fills
the context is refused either way, and counted by `count_prompt_tokens` whatever its length."""

from __future__ import annotations

import pytest

from proxy.adapters.registry import ServedModels
from proxy.chat.budget import BudgetMode, BudgetRule, OutputBudget, prompt_too_long
from proxy.chat.record import CallInfo, call_record
from proxy.chat.request import count_prompt_tokens, prepare_chat
from proxy.errors import ContextLengthError
from proxy.protocols.chat import ChatCompletionRequest

CONTEXT = 100


def test_a_budget_that_fits_is_used_as_asked() -> None:
    assert BudgetRule().fit(40, 60, CONTEXT) == OutputBudget(60, 60)
    assert not OutputBudget(60, 60).shortened


def test_a_budget_that_does_not_fit_is_cut_to_what_the_context_leaves() -> None:
    budget = BudgetRule().fit(40, 32_000, CONTEXT)
    assert budget == OutputBudget(32_000, 60) and budget.shortened
    assert budget.header_value() == "used=60; requested=32000"


def test_no_budget_takes_what_the_context_leaves_or_the_default_within_it() -> None:
    assert BudgetRule().fit(40, None, CONTEXT) == OutputBudget(None, 60)
    assert BudgetRule(default=16).fit(40, None, CONTEXT) == OutputBudget(None, 16)
    assert BudgetRule(default=512).fit(40, None, CONTEXT) == OutputBudget(None, 60)
    assert OutputBudget(None, 60).header_value() == "used=60; requested=none"
    assert not OutputBudget(None, 60).shortened


def test_strict_refuses_a_budget_that_does_not_fit_as_vllm_does() -> None:
    strict = BudgetRule(mode="strict")
    assert strict.fit(40, 60, CONTEXT) == OutputBudget(60, 60)
    with pytest.raises(ContextLengthError) as caught:
        strict.fit(40, 61, CONTEXT)
    error = caught.value
    assert error.code == "context_length_exceeded" and error.requested == 61
    assert "maximum context length is 100 tokens" in error.message
    assert "you requested 101 tokens (40 in the messages, 61 in the completion)" in error.message
    assert "RLPROXY_OUTPUT_BUDGET=strict" in error.message


@pytest.mark.parametrize("mode", ["fit", "strict"])
@pytest.mark.parametrize("requested", [None, 1, 5000])
def test_a_prompt_that_fills_the_context_is_refused_naming_it_and_what_to_do(
    mode: BudgetMode, requested: int | None
) -> None:
    rule = BudgetRule(mode=mode)
    with pytest.raises(ContextLengthError) as caught:
        rule.fit(CONTEXT, requested, CONTEXT)
    error = caught.value
    assert error.prompt_tokens == CONTEXT and error.max_context == CONTEXT
    assert error.requested is None
    assert "maximum context length is 100 tokens" in error.message
    assert "RLPROXY_BASE_MODEL" in error.message
    assert rule.fit(CONTEXT - 1, min(requested or 1, 1), CONTEXT).used == 1  # one token fits


def test_the_refusal_names_a_model_with_a_longer_context_only_when_its_context_is_longer() -> None:
    embedded = prompt_too_long(12_445, 8192).message
    assert embedded.endswith(
        "or serve a base model with a longer context, e.g. "
        "RLPROXY_BASE_MODEL=Qwen/Qwen2.5-0.5B-Instruct rlproxy serve (32,768 tokens; "
        "RLPROXY_BASE_MODEL: a Hugging Face id or a local model folder)."
    )
    qwen = prompt_too_long(40_000, 32_768).message
    assert qwen.endswith(
        "or serve a base model with a longer context (RLPROXY_BASE_MODEL: a Hugging Face id or a "
        "local model folder)."
    )


# ----------------------------------------------------------------------------- the one place


def _call(content: str, **fields: object) -> CallInfo:
    body = {"model": "rlproxy", "messages": [{"role": "user", "content": content}], **fields}
    return CallInfo(ChatCompletionRequest.model_validate(body), "req_test")


def _prepare(tokenizer, call: CallInfo, context: int, rule: BudgetRule | None = None):
    return prepare_chat(
        call,
        registry=ServedModels("rlproxy"),
        tokenizer=tokenizer,
        max_context=context,
        max_n=8,
        budget=rule or BudgetRule(),
    )


def test_prepare_fits_max_tokens_and_max_completion_tokens(tokenizer) -> None:
    prompt = len(_prepare(tokenizer, _call("Hi!"), 10_000).prompt_ids)
    context = prompt + 50
    for field in ("max_tokens", "max_completion_tokens"):
        prep = _prepare(tokenizer, _call("Hi!", **{field: 32_000}), context)
        assert prep.budget == OutputBudget(32_000, 50)
        assert prep.params.max_tokens == 50  # what the engine is asked for, vLLM's included
    assert _prepare(tokenizer, _call("Hi!"), context).params.max_tokens == 50
    with pytest.raises(ContextLengthError):
        _prepare(tokenizer, _call("Hi!", max_tokens=51), context, BudgetRule(mode="strict"))


def test_the_stored_call_keeps_the_budget_asked_for_and_the_one_used(tokenizer) -> None:
    call = _call("Hi!", max_tokens=32_000)
    prep = _prepare(tokenizer, call, len(_prepare(tokenizer, call, 10_000).prompt_ids) + 50)
    record = call_record(call, engine="local", status="completed", output_budget=prep.budget)
    assert record.params["max_tokens"] == 32_000  # the request's own field, as ever
    assert record.params["output_budget"] == {"requested": 32_000, "used": 50}


def test_a_prompt_longer_than_the_context_is_refused_but_counted(tokenizer) -> None:
    call = _call("word " * 300)
    with pytest.raises(ContextLengthError) as caught:
        _prepare(tokenizer, call, 100)
    counted = count_prompt_tokens(call, registry=ServedModels("rlproxy"), tokenizer=tokenizer)
    assert counted == caught.value.prompt_tokens > 300
    assert counted == len(_prepare(tokenizer, call, 10_000).prompt_ids)


def test_the_default_budget_is_the_context_left_except_on_the_embedded_model() -> None:
    from proxy.settings import EMBEDDED_DEFAULT_MAX_TOKENS, Settings

    assert Settings().resolved_default_max_tokens == EMBEDDED_DEFAULT_MAX_TOKENS == 512
    assert Settings(base_model="Qwen/Qwen2.5-0.5B-Instruct").resolved_default_max_tokens is None
    assert Settings(base_model="x", default_max_tokens=64).resolved_default_max_tokens == 64
    assert Settings().output_budget == "fit"
