"""LangChain's ChatOpenAI against a real rlproxy: invoke, stream, a tool loop, structured output.

langchain-openai 1.7's `with_structured_output` defaults to method="json_schema" (OpenAI's
structured outputs, sent as `response_format` through the SDK's `parse`); "function_calling"
binds the schema as a tool and forces it with a named tool_choice. Both must give a valid
instance. The schemas bound every field so that constrained answers end within the budget.
"""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict, Field


class City(BaseModel):
    """A city."""

    # additionalProperties false: with an open schema the model may add keys until the budget ends.
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=12, description="The city's name")
    is_capital: bool = Field(description="Whether it is a national capital")


@pytest.fixture(scope="module")
def llm(server) -> ChatOpenAI:  # server: conftest.Server
    return ChatOpenAI(
        base_url=server.base_url,
        api_key="sk-test",
        model="gpt-4o-mini",
        temperature=0,
        max_tokens=40,
        max_retries=0,
        timeout=280,
    )


def test_invoke_and_stream_agree(llm: ChatOpenAI) -> None:
    short = llm.bind(max_tokens=10)
    message = short.invoke("Write a long story about a dragon.")
    assert isinstance(message, AIMessage)
    assert isinstance(message.content, str) and message.content
    assert message.response_metadata["finish_reason"] == "length"
    assert message.usage_metadata is not None
    assert message.usage_metadata["output_tokens"] == 10
    chunks = list(short.stream("Write a long story about a dragon."))
    assert "".join(c.content for c in chunks) == message.content


def test_tool_loop(llm: ChatOpenAI) -> None:
    ran: list[tuple[int, int]] = []

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        ran.append((a, b))
        return a + b

    history: list[BaseMessage] = [HumanMessage("What is 2 plus 3? Use the add tool.")]
    # The first turn must call the tool; later turns may answer (tool_choice auto).
    model = llm.bind_tools([add], tool_choice="required", parallel_tool_calls=False)
    for _ in range(3):
        reply = model.invoke(history)
        assert isinstance(reply, AIMessage)
        history.append(reply)
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            assert call["name"] == "add"
            assert isinstance(call["id"], str) and call["id"]
            history.append(ToolMessage(str(add.invoke(call["args"])), tool_call_id=call["id"]))
        # A short budget for the answer: at 135M parameters it may ramble to the limit.
        model = llm.bind_tools([add], max_tokens=16)
    assert ran, "the tool never ran"
    assert all(isinstance(a, int) and isinstance(b, int) for a, b in ran)
    assert isinstance(history[-1], AIMessage)


@pytest.mark.parametrize("method", [None, "function_calling"])
def test_structured_output(llm: ChatOpenAI, method: str | None) -> None:
    kwargs = {} if method is None else {"method": method}
    structured = llm.with_structured_output(City, **kwargs)
    city = structured.invoke("Describe Paris.")
    assert isinstance(city, City)


def test_context_overflow_is_recognised(llm: ChatOpenAI) -> None:
    """LangChain maps code "context_length_exceeded" to its own overflow error."""
    from langchain_core.exceptions import ContextOverflowError

    with pytest.raises(ContextOverflowError):
        llm.invoke(" ".join(["word"] * 9000))
