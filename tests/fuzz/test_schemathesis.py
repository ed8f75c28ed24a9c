"""Schemathesis over the OpenAPI schema the server serves (`/openapi.json`), every route.

Requests are generated from the schema, valid and invalid, against a real `rlproxy serve` with
the real model (`fuzz_server`). Every response is checked: never a 5xx, its body valid against
the schema's response model, its content type and headers as documented, and invalid data
refused with a 4xx.

Two of schemathesis' checks are left out, for reasons that are facts about the schema, not bugs
the fuzzer should keep rediscovering:

- `status_code_conformance`: FastAPI documents a 422 for invalid input; rlproxy answers 400, as
  OpenAI does (and 404/413 are not documented at all);
- `positive_data_acceptance`: the schema is looser than the server (a tool message needs a
  `tool_call_id`, a cursor must be one the server wrote), so schema-valid data may be a 400.

`unsupported_method` (TRACE and friends) found one bug, a 405 without `Allow`; it is fixed, the
check runs on every route, and `test_a_405_says_which_methods_are_allowed` pins it.

Valid chat bodies are made servable (`servable`: the policy's name, content where the schema does
not require it) so that they reach prompts, grammars and sampling; a generated `max_tokens` is
held to at most 8 so that an accepted request answers in about a second on two cores, not in
minutes; every other field is as generated. Examples per route:
`RLPROXY_FUZZ_EXAMPLES` (default 50).
"""

from __future__ import annotations

import os
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import (
    positive_data_acceptance,
    status_code_conformance,
)

from tests.e2e.conftest import Server

pytestmark = pytest.mark.fuzz

MAX_EXAMPLES = int(os.environ.get("RLPROXY_FUZZ_EXAMPLES", "50"))
MAX_GENERATED_TOKENS = 8


def served_schema() -> dict[str, Any]:
    """The OpenAPI schema the app serves at /openapi.json, built without serving.

    (Schemathesis' lazy `from_fixture` loader does not run under pytest 9; the test below
    checks that the running server serves exactly this schema.)"""
    from proxy.api.app import create_app
    from proxy.settings import Settings

    return create_app(Settings()).openapi()


schema = schemathesis.openapi.from_dict(served_schema())


def test_the_fuzzed_schema_is_the_served_one(fuzz_server: Server) -> None:
    served = httpx.get(f"{fuzz_server.url}/openapi.json", timeout=30).json()
    assert served == schema.raw_schema


def bounded(body: Any) -> Any:
    """The body with an integer `max_tokens` / `max_completion_tokens` / `max_output_tokens`
    (Responses) above 8 lowered to 8."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                body[key] = min(value, MAX_GENERATED_TOKENS)
    return body


def servable(body: Any) -> Any:
    """A schema-valid body given what the schema does not say: the policy's name, content
    for every message but an assistant's, an id for a tool message. Without this nearly every
    generated body is a 400 (`{"role": "tool"}` is schema-valid) or a 404, and the fuzzer never
    reaches prompts, grammars and sampling."""
    if isinstance(body, dict) and ("input" in body or "messages" in body):
        body["model"] = "rlproxy"  # a Responses, Messages or chat body
    if isinstance(body, dict) and isinstance(body.get("messages"), list):
        for message in body["messages"]:
            if not isinstance(message, dict):
                continue
            if message.get("content") is None and message.get("role") != "assistant":
                message["content"] = "Hi"
            if message.get("role") == "tool" and not message.get("tool_call_id"):
                message["tool_call_id"] = "call_1"
    return body


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
def test_every_route_conforms_and_never_answers_5xx(case: Any, fuzz_server: Server) -> None:
    body = bounded(case.body)
    if case.meta is not None and not case.meta.generation.mode.is_negative:
        body = servable(body)
    case.body = body
    case.call_and_validate(
        base_url=fuzz_server.url,
        excluded_checks=[status_code_conformance, positive_data_acceptance],
        timeout=120,
    )


def test_a_405_says_which_methods_are_allowed(fuzz_server: Server) -> None:
    response = httpx.request("TRACE", f"{fuzz_server.url}/health", timeout=30)
    assert response.status_code == 405
    assert "GET" in response.headers.get("allow", "")
