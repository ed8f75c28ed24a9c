"""Constrained decoding: the real model, one grammar per batch row, outputs checked for validity."""

from __future__ import annotations

import json
from dataclasses import dataclass

import jsonschema
import llguidance
import pytest
import torch
from transformers import DynamicCache

from proxy.chat import grammar
from proxy.chat.grammar import (
    Grammar,
    RowConstraint,
    TokenRejectedError,
    ToolChoice,
    constraint_for_json_object,
    constraint_for_json_schema,
    constraint_for_request,
    constraint_for_tools,
)
from proxy.chat.prompt import ChatTemplate
from proxy.chat.tool_formats import HERMES
from proxy.engines.token_mask import (
    GrammarError,
    allocate_bitmask,
    apply_bitmask,
    build_tokenizer_info,
)

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"tz": {"type": "string", "maxLength": 12}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Time in a timezone",
            "parameters": TIME_PARAMS,
        },
    },
]
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def info(tokenizer) -> llguidance.LLTokenizer:
    return build_tokenizer_info(tokenizer)


@dataclass
class Row:
    text: str
    stopped: bool  # ended by EOS or by the grammar (finish_reason "stop"), not by the length cap


@dataclass
class Job:
    prompt: str
    grammar: Grammar | None
    temperature: float = 0.0


def _prefill(model, tok, prompts: list[str]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
    """Prefill each distinct prompt once; return the rows' merged cache, mask and last logits.

    Rows are left-padded to the longest prompt: the cache holds zeros there and the attention
    mask (B, T) hides them.
    """
    distinct = list(dict.fromkeys(prompts))
    width = 0
    done: dict[str, tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]] = {}
    for prompt in distinct:
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids  # (1, T)
        res = model(input_ids=ids, use_cache=True)
        kv = [(layer.keys, layer.values) for layer in res.past_key_values.layers]  # (1, H, T, D)
        done[prompt] = (kv, res.logits[:, -1, :])
        width = max(width, ids.shape[1])

    def pad(t: torch.Tensor) -> torch.Tensor:  # (1, H, T, D) -> (1, H, width, D), zeros first
        return torch.nn.functional.pad(t, (0, 0, width - t.shape[2], 0))

    layers = []
    for layer in range(len(done[distinct[0]][0])):
        keys = torch.cat([pad(done[p][0][layer][0]) for p in prompts])
        values = torch.cat([pad(done[p][0][layer][1]) for p in prompts])
        layers.append((keys, values))
    lengths = [done[p][0][0][0].shape[2] for p in prompts]
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])  # (B, T)
    logits = torch.cat([done[p][1] for p in prompts])  # (B, V)
    return DynamicCache(layers, config=model.config), mask, logits


def generate(
    loaded_model, info: llguidance.LLTokenizer, jobs: list[Job], seed: int, max_new_tokens: int = 60
) -> list[Row]:
    """A minimal batched decode loop, one grammar per row applied to the logits as a mask."""
    model, tok = loaded_model.model, loaded_model.tokenizer
    eos = tok.eos_token_id
    batch = len(jobs)
    rows = [job.grammar.new_row(info) if job.grammar else None for job in jobs]
    temps = torch.tensor([job.temperature for job in jobs], dtype=torch.float32)  # (B,)
    bitmask = allocate_bitmask(batch, info)
    gen = torch.Generator().manual_seed(seed)
    out: list[list[int]] = [[] for _ in range(batch)]
    done = [False] * batch
    stopped = [False] * batch
    with torch.no_grad():
        past, mask, logits = _prefill(model, tok, [job.prompt for job in jobs])
        positions = mask.sum(-1, keepdim=True)  # (B, 1): position of each row's next token
        for _ in range(max_new_tokens):
            logits = logits.float()
            live = [i for i, r in enumerate(rows) if r is not None and not done[i]]
            for i in live:
                rows[i].fill_bitmask(bitmask, i)
            apply_bitmask(logits, bitmask, live)
            probs = torch.softmax(logits / temps.clamp(min=1e-4).unsqueeze(-1), -1)
            sampled = torch.multinomial(probs, 1, generator=gen).squeeze(-1)  # (B,)
            next_ids = torch.where(temps > 0, sampled, logits.argmax(-1))  # (B,)
            for i in range(batch):
                if done[i]:
                    continue
                token = int(next_ids[i])
                if rows[i] is not None:
                    rows[i].consume(token)
                if token == eos:
                    done[i] = stopped[i] = True
                    continue
                out[i].append(token)
                if rows[i] is not None and rows[i].is_stopped():
                    done[i] = stopped[i] = True
            if all(done):
                break
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype)], dim=-1)
            res = model(
                input_ids=next_ids.unsqueeze(-1),
                attention_mask=mask,
                position_ids=positions,
                past_key_values=past,
                use_cache=True,
            )
            logits = res.logits[:, -1, :]  # (B, V)
            positions = positions + 1
    return [Row(tok.decode(ids), s) for ids, s in zip(out, stopped, strict=True)]


def assert_valid_calls(row: Row, *, allowed: set[str], exactly: int | None = None) -> list[dict]:
    """The row's calls parse and, if the row finished, validate against their tools' schemas."""
    content, calls = HERMES.parse_complete(row.text, tool_names=allowed)
    assert "<tool_call>" not in (content or ""), row.text
    complete = calls if row.stopped else calls[:-1]
    for call in complete:
        args = json.loads(call["function"]["arguments"])
        jsonschema.validate(args, PARAMS[call["function"]["name"]])
    if exactly is not None:
        assert row.stopped, row.text
        assert len(calls) == exactly, row.text
    return calls


ALL_TOOLS = {"get_weather", "get_time"}


@pytest.fixture(scope="module")
def outputs(loaded_model, info) -> dict[str, list[Row]]:
    """One batched generation, every row under its own grammar (greedy and seeded sampling)."""
    render_prompt = ChatTemplate.for_tokenizer(loaded_model.tokenizer).render
    plain = render_prompt([{"role": "user", "content": "What's the weather in Paris?"}], None)
    person = render_prompt([{"role": "user", "content": "Describe a person: name, age."}], None)
    weather = render_prompt([{"role": "user", "content": "What's the weather in Paris?"}], TOOLS)
    joke = render_prompt([{"role": "user", "content": "Tell me a short joke."}], TOOLS)
    required_one = constraint_for_tools(TOOLS, ToolChoice("required"), parallel_tool_calls=False)
    auto = constraint_for_tools(TOOLS, ToolChoice("auto"))
    named = {"type": "function", "function": {"name": "get_time"}}
    plan: dict[str, list[Job]] = {
        "json_object": [Job(plain, constraint_for_json_object())],
        "json_schema": [Job(person, constraint_for_json_schema(PERSON), t) for t in (0, 1)],
        "required_one": [Job(weather, required_one, t) for t in (0, 1)],
        "required_many": [Job(weather, constraint_for_tools(TOOLS, ToolChoice("required")))],
        "named": [Job(weather, constraint_for_tools(TOOLS, ToolChoice.of(named)), 1)],
        "auto": [Job(weather, auto), Job(joke, auto, 1), Job(joke, auto, 1)],
    }
    jobs = [job for group in plan.values() for job in group]
    rows = iter(generate(loaded_model, info, jobs, seed=1234))
    return {name: [next(rows) for _ in group] for name, group in plan.items()}


def test_json_object_output_parses(outputs) -> None:
    (row,) = outputs["json_object"]
    assert row.stopped, row.text
    assert isinstance(json.loads(row.text), dict)


def test_json_schema_output_validates(outputs) -> None:
    for row in outputs["json_schema"]:
        assert row.stopped, row.text
        jsonschema.validate(json.loads(row.text), PERSON)


def test_required_single_call_is_one_valid_call(outputs) -> None:
    for row in outputs["required_one"]:
        assert_valid_calls(row, allowed=ALL_TOOLS, exactly=1)
        assert HERMES.parse_complete(row.text)[0] is None  # nothing but the call


def test_required_parallel_calls_are_valid(outputs) -> None:
    (row,) = outputs["required_many"]
    assert len(assert_valid_calls(row, allowed=ALL_TOOLS)) >= 1


def test_named_tool_is_called_exactly_once(outputs) -> None:
    for row in outputs["named"]:
        (call,) = assert_valid_calls(row, allowed={"get_time"}, exactly=1)
        assert call["function"]["name"] == "get_time"


def test_auto_gives_text_or_valid_calls(outputs) -> None:
    for row in outputs["auto"]:
        assert_valid_calls(row, allowed=ALL_TOOLS)


def _feed(tokenizer, info, grammar: Grammar, text: str) -> RowConstraint:
    row = grammar.new_row(info)
    for token in tokenizer.encode(text, add_special_tokens=False):
        row.consume(token)
    return row


def test_auto_allows_text_and_valid_calls_but_blocks_malformed_ones(tokenizer, info) -> None:
    auto = constraint_for_tools(TOOLS, ToolChoice("auto"))
    assert _feed(tokenizer, info, auto, "Just text, <b>tags</b> and\nlines.").is_accepting()
    call = '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
    row = _feed(tokenizer, info, auto, "Let me look.\n" + call)
    assert row.is_accepting()
    with pytest.raises(TokenRejectedError, match="rejected"):
        _feed(tokenizer, info, auto, "Sure <tool_call>junk")
    with pytest.raises(TokenRejectedError):
        _feed(tokenizer, info, auto, '<tool_call>{"name": "rm_rf", "arguments": {}}')
    with pytest.raises(TokenRejectedError):  # arguments must follow the tool's schema
        _feed(tokenizer, info, auto, '<tool_call>{"name": "get_time", "arguments": {"city": 1}}')


def test_tool_schemas_with_refs_are_enforced(tokenizer, info) -> None:
    # The shape pydantic (and so LangChain) generates for a tool's parameters.
    params = {
        "$defs": {"Unit": {"enum": ["c", "f"], "type": "string"}},
        "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
        "required": ["city", "unit"],
        "title": "GetWeather",
        "type": "object",
    }
    grammar = constraint_for_tools([_tool("w", params)], ToolChoice("required"))
    ok = '<tool_call>{"name": "w", "arguments": {"city": "Oslo", "unit": "c"}}</tool_call>'
    assert _feed(tokenizer, info, grammar, ok).is_accepting()
    with pytest.raises(TokenRejectedError):
        _feed(tokenizer, info, grammar, ok.replace('"c"', '"k"'))


def test_a_single_required_call_stops_the_grammar(tokenizer, info) -> None:
    grammar = constraint_for_tools(TOOLS, ToolChoice("required"), parallel_tool_calls=False)
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    row = _feed(tokenizer, info, grammar, call)
    assert row.is_stopped()
    bitmask = allocate_bitmask(1, info)
    row.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, tokenizer.vocab_size)
    apply_bitmask(logits, bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [tokenizer.eos_token_id]


def test_no_constraint_cases() -> None:
    assert constraint_for_tools(None, ToolChoice("auto")) is None
    assert constraint_for_tools([], ToolChoice("required")) is None
    assert constraint_for_tools(TOOLS, ToolChoice("none")) is None
    assert constraint_for_request(None, None, None) is None
    assert constraint_for_request({"type": "text"}, TOOLS, ToolChoice("none")) is None
    assert constraint_for_request(None, TOOLS, None).kind == "tool_choice auto"
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    assert constraint_for_request(fmt, None, None).kind == "json_schema"
    assert constraint_for_request({"type": "json_object"}, None, None).kind == "json_object"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: constraint_for_json_schema({"type": "strin"}), "strin"),
        (lambda: constraint_for_json_schema({"type": "string", "pattern": "(?<=a)b"}), "look"),
        (lambda: constraint_for_json_schema({"$ref": "#/defs/missing"}), "missing"),
        (lambda: constraint_for_json_schema([1]), "JSON object"),
        (
            lambda: constraint_for_tools(TOOLS, ToolChoice("function", "x")),
            "'x'",
        ),
        (lambda: ToolChoice.of("sometimes"), "sometimes"),
        (lambda: constraint_for_tools([TOOLS[0], TOOLS[0]], ToolChoice("auto")), "same name"),
        (
            lambda: constraint_for_tools(
                [*TOOLS, _tool("bad", {"type": "strin"})], ToolChoice("auto")
            ),
            "bad",
        ),
        (lambda: constraint_for_tools([{"type": "retrieval"}], ToolChoice("auto")), "function"),
        (lambda: constraint_for_request({"type": "xml"}, None, None), "xml"),
    ],
)
def test_bad_requests_raise_grammar_error(call, message) -> None:
    with pytest.raises(GrammarError, match=message) as info:
        call()
    assert isinstance(info.value, ValueError)


def test_a_repeated_tool_call_stops_the_row(tokenizer) -> None:
    """The small model loops on `required`; the row ends once a call repeats an earlier one."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    info = build_tokenizer_info(tokenizer)
    row = grammar.constraint_for_tools(tools, grammar.ToolChoice("required")).new_row(info)
    one = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    for token in tokenizer.encode(one, add_special_tokens=False):
        row.consume(token)
    assert not row.is_stopped()
    for token in tokenizer.encode("\n" + one, add_special_tokens=False):
        row.consume(token)
    assert row.is_stopped()


def test_objects_without_additional_properties_are_closed() -> None:
    closed = grammar._closed_objects(
        {"type": "object", "properties": {"a": {"type": "object", "properties": {}}}}
    )
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    kept = grammar._closed_objects(
        {"type": "object", "additionalProperties": True, "properties": {}}
    )
    assert kept["additionalProperties"] is True


def test_a_tool_named_auto_is_forced_when_named() -> None:
    """tool_choice is typed: naming a tool called "auto" forces that call, it is not the mode."""
    from proxy.chat.record import RequestDump
    from proxy.chat.request import grammar_for, tool_choice
    from proxy.protocols.chat import ChatCompletionRequest

    tools = [_tool("auto", {"type": "object", "properties": {}}), *TOOLS]
    req = ChatCompletionRequest.model_validate(
        {
            "model": "rlproxy",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "auto"}},
        }
    )
    dumped = RequestDump.of(req)
    choice = tool_choice(req, dumped.tools)
    assert choice == ToolChoice("function", "auto")
    forced = grammar_for(req, dumped, choice)
    free = grammar_for(req, dumped, ToolChoice("auto"))
    assert forced is not None and free is not None
    assert "TEXT | head" in free.source and "TEXT | head" not in forced.source


def _nested(depth: int, kind: str = "object") -> dict:
    """A schema of `depth` nested containers: objects ({"a": {...}}) or arrays ([[...]])."""
    inner: object = 1
    for _ in range(depth - 1):
        inner = {"a": inner} if kind == "object" else [inner]
    return {"a": inner} if kind == "object" else {"enum": [inner]}


@pytest.mark.parametrize("kind", ["object", "array"])
@pytest.mark.parametrize("depth", [grammar.MAX_SCHEMA_DEPTH + 1, 900])
def test_a_schema_nested_too_deep_is_a_grammar_error_not_a_recursion_error(
    kind: str, depth: int
) -> None:
    """A hostile schema nested hundreds of levels deep (found by the hostile corpus: a 500)."""
    with pytest.raises(GrammarError, match="deeper than"):
        constraint_for_json_schema(_nested(depth, kind))
    with pytest.raises(GrammarError, match="deeper than"):
        constraint_for_tools([_tool("deep", _nested(depth, kind))], ToolChoice("auto"))


def test_a_schema_at_the_depth_limit_still_compiles() -> None:
    assert constraint_for_json_schema(_nested(grammar.MAX_SCHEMA_DEPTH - 8)).kind == "json_schema"
