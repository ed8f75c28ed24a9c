"""What Codex declares on the Responses API, translated without HTTP: `namespace` tools
expanded to their functions and given back as `name` + `namespace`, hosted tools accepted and
not offered to the model, and what is still refused."""

from __future__ import annotations

import pytest

from proxy.errors import InvalidRequestError
from proxy.protocols import responses, responses_tools
from proxy.protocols.responses import ResponsesRequest

SPAWN = {
    "type": "function",
    "name": "spawn_agent",
    "description": "Start a sub-agent.",
    "parameters": {"type": "object", "properties": {"task": {"type": "string"}}},
    "strict": False,
}
CLOSE = {"type": "function", "name": "close_agent", "parameters": {"type": "object"}}
MULTI_AGENT = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Sub-agents.",
    "tools": [SPAWN, CLOSE],
}
EXEC = {"type": "function", "name": "exec_command", "parameters": {"type": "object"}}
WEB_SEARCH = {"type": "web_search", "external_web_access": False}


def _codex(**fields: object) -> ResponsesRequest:
    body = {
        "model": "rlproxy",
        "input": [{"role": "user", "content": "Reply with the word hello."}],
        "tools": [EXEC, MULTI_AGENT, WEB_SEARCH],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        **fields,
    }
    return ResponsesRequest.model_validate(body)


def test_a_namespace_is_expanded_to_its_functions() -> None:
    chat, wire = responses.to_chat(_codex())
    assert [t.function.name for t in chat.tools or []] == [
        "exec_command",
        "multi_agent_v1__spawn_agent",
        "multi_agent_v1__close_agent",
    ]
    spawn = (chat.tools or [])[1].function
    assert spawn.description == "Start a sub-agent." and spawn.parameters == SPAWN["parameters"]
    assert wire["namespaced"] == {
        "multi_agent_v1__spawn_agent": ["multi_agent_v1", "spawn_agent"],
        "multi_agent_v1__close_agent": ["multi_agent_v1", "close_agent"],
    }


def test_hosted_tools_are_accepted_not_offered_and_named() -> None:
    chat, wire = responses.to_chat(_codex(tools=[EXEC, WEB_SEARCH, {"type": "mcp"}, WEB_SEARCH]))
    assert [t.function.name for t in chat.tools or []] == ["exec_command"]
    assert wire["ignored_tools"] == ["web_search", "mcp"]
    only_hosted, wire = responses.to_chat(_codex(tools=[WEB_SEARCH]))
    assert only_hosted.tools is None and only_hosted.tool_choice is None  # "auto" of nothing
    assert wire["ignored_tools"] == ["web_search"]


def test_a_plain_request_stores_what_it_stored_before() -> None:
    _, wire = responses.to_chat(_codex(tools=[EXEC]))
    assert not {"namespaced", "namespaces", "ignored_tools"} & set(wire)


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ([{"type": "custom", "name": "apply"}], "tools[0].type"),
        ([{"type": "bogus"}], "tools[0].type"),
        ([{**MULTI_AGENT, "tools": [{"type": "custom", "name": "x"}]}], "tools[0].tools[0].type"),
        ([{"type": "namespace", "tools": [SPAWN]}], "tools[0].name"),
        ([{**EXEC, "name": "multi_agent_v1__close_agent"}, MULTI_AGENT], "tools"),
    ],
)
def test_what_is_still_refused(tools: list, param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        responses.to_chat(_codex(tools=tools))
    assert caught.value.param == param


def test_a_call_of_a_namespaced_function_comes_back_with_its_namespace() -> None:
    _, wire = responses.to_chat(_codex())
    calls = [("call_1", "multi_agent_v1__spawn_agent"), ("call_2", "exec_command")]
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": i, "function": {"name": n, "arguments": "{}"}} for i, n in calls],
    }
    spawn, exec_ = responses.output_items("resp_x", message, "completed", None, wire)
    assert (spawn["name"], spawn["namespace"]) == ("spawn_agent", "multi_agent_v1")
    assert exec_["name"] == "exec_command" and "namespace" not in exec_


def test_a_replayed_namespaced_call_is_read_back_to_the_same_function() -> None:
    chat, _ = responses.to_chat(
        _codex(
            input=[
                {"role": "user", "content": "Go."},
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "spawn_agent",
                    "namespace": "multi_agent_v1",
                    "arguments": "{}",
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "started"},
            ]
        )
    )
    call = (chat.messages[1].tool_calls or [])[0]
    assert call.function.name == "multi_agent_v1__spawn_agent"


def test_a_named_tool_choice_may_name_the_namespace() -> None:
    choice = {"type": "function", "name": "spawn_agent", "namespace": "multi_agent_v1"}
    chat, _ = responses.to_chat(_codex(tool_choice=choice))
    assert chat.tool_choice is not None and not isinstance(chat.tool_choice, str)
    assert chat.tool_choice.function == {"name": "multi_agent_v1__spawn_agent"}


def test_the_tools_echo_groups_the_namespace_again() -> None:
    chat, wire = responses.to_chat(_codex())
    tools = [t.model_dump(exclude_none=True) for t in chat.tools or []]
    echoed = responses_tools.echo(tools, wire)
    assert [t["type"] for t in echoed] == ["function", "namespace"]
    assert echoed[1]["name"] == "multi_agent_v1" and echoed[1]["description"] == "Sub-agents."
    assert [t["name"] for t in echoed[1]["tools"]] == ["spawn_agent", "close_agent"]
