"""The local judge's request, against the real tokenizer and the real grammar engine.

The judge's reply is held by a grammar, and its `max_tokens` must let every reply the grammar
allows finish: a reply cut at the budget is invalid JSON, and the group fails after two tries
("judge reply invalid twice: ... Unterminated string"). The walk below plays the worst model the
grammar allows: at each step it takes the allowed token that spends the most tokens on the fewest
characters (one byte, an escape's backslash, a byte of a multi-byte character), and never closes
a string it may keep open.
"""

from __future__ import annotations

import asyncio
from typing import Any

import llguidance
import llguidance.torch
import pytest
import torch
from llguidance import LLMatcher

from proxy.chat.grammar import constraint_for_json_schema
from proxy.engines.token_mask import allocate_bitmask, apply_bitmask, build_tokenizer_info
from trainer.scoring.local_judge import LocalJudge, _as_list_form
from trainer.scoring.ruler import JudgeGroup, JudgeMember, parse_judge_reply, response_format_for


@pytest.fixture(scope="module")
def info(tokenizer: Any) -> llguidance.LLTokenizer:
    return build_tokenizer_info(tokenizer)


def judge_request(members: int) -> dict[str, Any]:
    """The chat-completions request the local judge sends for a group of `members`."""
    sent: list[dict[str, Any]] = []

    async def complete(request: dict[str, Any]) -> dict[str, Any]:
        sent.append(request)
        return {"choices": [{"message": {"content": "{}"}}], "usage": {}}

    group = JudgeGroup(
        group_id="g1",
        rubric="Be helpful.",
        tools=None,
        members=[
            JudgeMember(member_id=f"t{i}", messages=[{"role": "user", "content": "hi"}])
            for i in range(members)
        ],
    )
    judge = LocalJudge(complete, "rlproxy")
    asyncio.run(judge.complete([{"role": "user", "content": "judge"}], response_format_for(group)))
    return sent[0]


def worst_reply(source: str, info: llguidance.LLTokenizer, limit: int) -> tuple[bytes, int]:
    """The reply, and its token count, of a model that spends as many tokens as the grammar lets
    it (stops at `limit` tokens: a grammar that allows more is already a failure)."""
    matcher = LLMatcher(info, source, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    pieces = [info.decode_bytes([t]) for t in range(info.vocab_size)]
    mask = allocate_bitmask(1, info)
    out, tokens = b"", 0
    while not matcher.is_stopped() and tokens < limit:
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        logits = torch.zeros((1, info.vocab_size))
        apply_bitmask(logits, mask)  # banned tokens -> -inf
        allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
        candidates = [t for t in allowed if pieces[t]]  # special tokens decode to no bytes
        assert candidates, "the grammar allows nothing but EOS and is not stopped"

        def cost(t: int) -> tuple[int, int, int]:
            piece = pieces[t]
            # Fewest bytes first; then an escape or a non-ASCII byte (both make a character
            # take several tokens); a closing quote last (it ends a string early).
            rank = 0 if piece == b"\\" or piece[0] >= 0x80 else 2 if piece == b'"' else 1
            return (len(piece), rank, t)

        token = min(candidates, key=cost)
        assert matcher.consume_token(token), matcher.get_error()
        out += pieces[token]
        tokens += 1
    return out, tokens


@pytest.mark.parametrize("members", [2, 8])
def test_the_budget_lets_every_reply_the_grammar_allows_finish(
    members: int, info: llguidance.LLTokenizer
) -> None:
    request = judge_request(members)
    schema = request["response_format"]["json_schema"]["schema"]
    grammar = constraint_for_json_schema(schema)
    reply, tokens = worst_reply(grammar.source, info, limit=request["max_tokens"] + 1)
    assert tokens <= request["max_tokens"], (
        f"a reply of {tokens} tokens fits the grammar; the budget is {request['max_tokens']}: "
        f"{reply[:120]!r}..."
    )
    # The longest reply is still one RULER reads: every member scored, explanations whole.
    ids = [str(i + 1) for i in range(members)]
    parsed = parse_judge_reply(_as_list_form(reply.decode()), ids)
    assert [trajectory_id for trajectory_id, _, _ in parsed] == ids
    assert all(explanation for _, _, explanation in parsed)


def test_explanations_are_plain_text(info: llguidance.LLTokenizer) -> None:
    """No escapes and no control characters: each character of the reply is one byte at most,
    so a token (one byte or more) never carries less than one character."""
    schema = judge_request(2)["response_format"]["json_schema"]["schema"]
    source = constraint_for_json_schema(schema).source
    head = '{"scores": {"1": {"explanation": "Good'
    for tail, allowed in [(" answer", True), ("\\n", False), ("\\u00e9", False), ("é", False)]:
        matcher = LLMatcher(info, source, log_level=0)
        tokens = info.tokenize_bytes((head + tail).encode())
        assert (matcher.validate_tokens(tokens) == len(tokens)) is allowed, tail
