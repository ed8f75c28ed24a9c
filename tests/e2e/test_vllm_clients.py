"""The client suites again, with rlproxy's engine set to `vllm` in front of two vLLM-protocol
replicas (`tests/fakes/vllm_server.py`, generating with the real embedded model).

The tests are the ones the local engine passes, imported from their modules: the openai SDK
(shapes, streams, `n`, logprobs, stop strings, seeds), tools and structured outputs (the grammars
travel to vLLM as `structured_outputs.grammar`), LangChain and LlamaIndex, the Responses API and
Anthropic Messages (their stop sequences read from vLLM's `stop_reason`), with the Agents SDK,
LangChain's two other classes and the Vercel AI SDK. Only the fixtures that
name the server are replaced here, so both engines are held to the same assertions.

Slow (42 tests, about 9 minutes on the shared 2-core machine, three processes sharing it): run
with `make test-slow`. The default run checks the engine against vLLM-shaped handlers
(tests/proxy/test_vllm_engine.py, test_vllm_routing.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

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
from tests.fakes.stack import vllm_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Iterator[Server]:
    with vllm_stack(tmp_path_factory.mktemp("vllm-clients"), model_data_dir) as (srv, fakes):
        yield srv
        # Both replicas served: the routing spread the module's requests.
        assert all(f.completions() for f in fakes), [len(f.completions()) for f in fakes]


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
