"""The Responses API's tool declarations as the chat core's function tools, and back.

    tools = read_tools(request.tools)       # -> ResponseTools: the core's tools and what to keep
    namespace, name = client_name(core_name, wire)   # a call's name as the client declared it
    core_name(name, namespace, wire)        # and a replayed call's name as the core knows it

What a request may declare (https://platform.openai.com/docs/api-reference/responses/create):

- `function`: `{"type": "function", "name", "description", "parameters", "strict"}`, the
  core's function tool.
- `namespace`: `{"type": "namespace", "name": NS, "description", "tools": [function, ...]}`:
  functions grouped under a name (Codex declares its multi-agent tools and each MCP server's
  tools so). Each function is offered to the model as the core's function `NS__NAME` (the
  `mcp__server__tool` spelling Codex gave MCP tools before namespaces), so two namespaces may
  hold functions of the same name. A call of one is returned as OpenAI returns it: `name` NAME
  and `namespace` NS; a `function_call` input item that carries a `namespace` is read back as
  `NS__NAME`, so the stored conversation keeps one spelling and its turns link. The request's
  `tools` are echoed grouped again.
- hosted tools (`web_search`, `file_search`, `code_interpreter`, `image_generation`, `mcp`,
  `local_shell`, `shell`, `apply_patch`, `computer_use_preview`, `tool_search`, ...): OpenAI's
  servers run them, or the model calls them with item types of their own that this server's
  models do not produce. They are accepted and not offered to the model; the response says so
  (`X-RLProxy-Ignored-Tools`, by the route) rather than refusing the request.

Anything else (`custom` tools, which take free text instead of JSON, and unknown types) is a 400.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from proxy.errors import InvalidRequestError

SEPARATOR = "__"
"""Between a namespace's name and its function's name in the core's function name."""
HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_2025_08_26",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "image_generation",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
        "computer",
        "computer_use_preview",
        "tool_search",
    }
)
"""Tool types the Responses API's own servers (or its built-in item types) carry out."""
IGNORED_HEADER = "X-RLProxy-Ignored-Tools"


@dataclass
class ResponseTools:
    """A request's tools: the core's function tools, and what the edge keeps to answer."""

    chat: list[dict[str, Any]] = field(default_factory=list)
    namespaced: dict[str, list[str]] = field(default_factory=dict)
    """The core's name of a namespace's function -> [namespace, function name]."""
    namespaces: dict[str, str] = field(default_factory=dict)
    """Namespace -> its description, for the echo of `tools`."""
    ignored: list[str] = field(default_factory=list)
    """Hosted tool types declared (each once, in order): accepted, not offered to the model."""

    def wire(self) -> dict[str, Any]:
        """What the edge stores beside the call (only what there is, so plain requests' rows
        are unchanged)."""
        kept: dict[str, Any] = {}
        if self.namespaced:
            kept["namespaced"] = self.namespaced
            kept["namespaces"] = self.namespaces
        if self.ignored:
            kept["ignored_tools"] = self.ignored
        return kept


def read_tools(tools: list[Any] | None) -> ResponseTools:
    """The request's `tools` as the core's. Raises `InvalidRequestError` (400)."""
    out = ResponseTools()
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            out.chat.append(_function(tool, where))
        elif kind == "namespace":
            _namespace(tool, where, out)
        elif kind in HOSTED_TOOLS:
            if kind not in out.ignored:
                out.ignored.append(kind)
        else:
            raise _unsupported(kind, where)
    names = [t["function"]["name"] for t in out.chat]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise InvalidRequestError(
            f"Invalid 'tools': the function name {twice[0]!r} is declared twice (a namespace's "
            f"function NAME in namespace NS is offered to the model as NS{SEPARATOR}NAME).",
            param="tools",
        )
    return out


def _function(tool: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    if not isinstance(function.get("name"), str):
        raise InvalidRequestError(
            f"Missing required parameter: '{where}.name'.",
            param=f"{where}.name",
            code="missing_required_parameter",
        )
    function["name"] = prefix + function["name"]
    return {"type": "function", "function": function}


def _namespace(tool: dict[str, Any], where: str, out: ResponseTools) -> None:
    name, members = tool.get("name"), tool.get("tools")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(
            f"Missing required parameter: '{where}.name'.",
            param=f"{where}.name",
            code="missing_required_parameter",
        )
    if not isinstance(members, list):
        raise InvalidRequestError(
            f"Missing required parameter: '{where}.tools' (the namespace's function tools).",
            param=f"{where}.tools",
            code="missing_required_parameter",
        )
    description = tool.get("description")
    out.namespaces[name] = description if isinstance(description, str) else ""
    for j, member in enumerate(members):
        at = f"{where}.tools[{j}]"
        kind = member.get("type") if isinstance(member, dict) else None
        if kind != "function":
            raise _unsupported(kind, at)
        function = _function(member, at, prefix=name + SEPARATOR)
        out.chat.append(function)
        out.namespaced[function["function"]["name"]] = [name, member["name"]]


def _unsupported(kind: Any, where: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"Tools of type {kind!r} are not supported by this server: it serves function tools "
        "({'type': 'function', 'name': ..., 'parameters': ...}) and namespaces of them, and "
        "accepts hosted tools (web_search, file_search, ...) without running them.",
        param=f"{where}.type",
        code="unsupported_value",
    )


def client_name(name: str, wire: dict[str, Any]) -> tuple[str | None, str]:
    """(namespace, name) of the core's function `name` as the request declared it."""
    namespace, declared = (wire.get("namespaced") or {}).get(name, (None, name))
    return namespace, declared


def core_name(name: str, namespace: Any) -> str:
    """The core's name of a call the client replays (`function_call` with a `namespace`)."""
    if isinstance(namespace, str) and namespace:
        return namespace + SEPARATOR + name
    return name


def echo(tools: list[dict[str, Any]] | None, wire: dict[str, Any]) -> list[dict[str, Any]]:
    """The core's function tools as the response's `tools`: flat functions, and each
    namespace's functions grouped again at the place of its first one."""
    namespaced = wire.get("namespaced") or {}
    out: list[dict[str, Any]] = []
    groups: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        fn = tool.get("function") or {}
        namespace, name = namespaced.get(fn.get("name"), (None, fn.get("name")))
        flat = {
            "type": "function",
            "name": name,
            "description": fn.get("description"),
            "parameters": fn.get("parameters"),
            "strict": fn.get("strict"),
        }
        if namespace is None:
            out.append(flat)
            continue
        if namespace not in groups:
            groups[namespace] = {
                "type": "namespace",
                "name": namespace,
                "description": (wire.get("namespaces") or {}).get(namespace, ""),
                "tools": [],
            }
            out.append(groups[namespace])
        groups[namespace]["tools"].append(flat)
    return out
