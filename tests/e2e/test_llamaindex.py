"""LlamaIndex's OpenAILike and OpenAI LLMs against a real rlproxy: chat and a tool-calling round.

The round is what LlamaIndex's function-calling agents do: `chat_with_tools(tool_required=True)`
(tool_choice "required"), `get_tool_calls_from_response`, run the FunctionTool, send its output
back as a tool message, and chat again.
"""

from __future__ import annotations

import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.tools import FunctionTool
from llama_index.llms.openai import OpenAI
from llama_index.llms.openai_like import OpenAILike

HI = [ChatMessage(role=MessageRole.USER, content="Say hello.")]


@pytest.fixture(scope="module")
def like(server) -> OpenAILike:  # server: conftest.Server
    return OpenAILike(
        model="rlproxy",
        api_base=server.base_url,
        api_key="sk-test",
        is_chat_model=True,
        is_function_calling_model=True,
        context_window=8192,
        max_tokens=40,
        temperature=0,
        max_retries=0,
        timeout=280,
    )


def shorter(llm: OpenAILike, max_tokens: int) -> OpenAILike:
    # The constructor's max_tokens wins over a per-call one in LlamaIndex: copy instead.
    return llm.model_copy(update={"max_tokens": max_tokens})


def test_openai_like_chat(like: OpenAILike) -> None:
    response = shorter(like, 8).chat(HI)
    assert response.message.role == MessageRole.ASSISTANT
    assert isinstance(response.message.content, str) and response.message.content


def test_openai_like_tool_round(like: OpenAILike) -> None:
    ran: list[tuple[int, int]] = []

    def add(a: int, b: int) -> int:
        """Add two integers."""
        ran.append((a, b))
        return a + b

    tool = FunctionTool.from_defaults(fn=add)
    user = ChatMessage(role=MessageRole.USER, content="What is 2 plus 3? Use the add tool.")
    response = like.chat_with_tools([tool], user_msg=user, tool_required=True)
    selections = like.get_tool_calls_from_response(response, error_on_no_tool_call=True)
    assert len(selections) == 1  # allow_parallel_tool_calls defaults to False
    selection = selections[0]
    assert selection.tool_name == "add"
    assert selection.tool_id
    output = tool.call(**selection.tool_kwargs)
    assert not output.is_error
    assert ran == [(selection.tool_kwargs["a"], selection.tool_kwargs["b"])]

    history = [
        user,
        response.message,
        ChatMessage(
            role=MessageRole.TOOL,
            content=str(output),
            additional_kwargs={"tool_call_id": selection.tool_id, "name": "add"},
        ),
    ]
    final = shorter(like, 16).chat_with_tools([tool], chat_history=history)
    assert final.message.role == MessageRole.ASSISTANT
    calls = like.get_tool_calls_from_response(final, error_on_no_tool_call=False)
    assert calls or final.message.content


def test_openai_class_with_alias(server) -> None:  # server: conftest.Server
    llm = OpenAI(
        model="gpt-4o-mini",
        api_base=server.base_url,
        api_key="sk-test",
        max_tokens=8,
        temperature=0,
        max_retries=0,
        timeout=280,
    )
    response = llm.chat(HI)
    assert response.message.role == MessageRole.ASSISTANT
    assert isinstance(response.message.content, str) and response.message.content
