"""A stored chat call as span attributes, after OpenTelemetry's GenAI semantic conventions.

    name = span_name(record)                      # "chat gpt-4o-mini"
    attrs = call_attributes(record, trajectory_id, provider="rlproxy", response_model=...)

https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-spans/ names the attributes:
`gen_ai.operation.name`, `gen_ai.provider.name`, `gen_ai.request.*` (model and sampling
parameters), `gen_ai.response.{model,id,finish_reasons}`, `gen_ai.usage.{input,output}_tokens`
and `gen_ai.conversation.id` (here: the trajectory the call joined). rlproxy's own figures carry
the `rlproxy.` prefix. Message text (`gen_ai.input.messages`, `gen_ai.output.messages`,
`gen_ai.tool.definitions`, in the conventions' parts format) is added only with `capture=True`;
otherwise a span holds ids and counts, never a prompt.

With `langfuse=True` the attributes Langfuse reads are added too (observation type, session id,
first-token time, and with capture the OpenAI-shaped input and output it renders as a chat).

Pure functions over `storage.records.CallRecord`: no OpenTelemetry import, no I/O.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from storage.records import CallRecord

AttributeValue = str | bool | int | float | tuple[str, ...]

LOCAL_PROVIDER = "rlproxy"
"""`gen_ai.provider.name` of calls served by the embedded model."""

# request parameter -> attribute (`max_completion_tokens` also maps to max_tokens, below)
_REQUEST_PARAMS = {
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "max_tokens": "gen_ai.request.max_tokens",
    "seed": "gen_ai.request.seed",
    "frequency_penalty": "gen_ai.request.frequency_penalty",
    "presence_penalty": "gen_ai.request.presence_penalty",
}


def span_name(record: CallRecord) -> str:
    """`chat {gen_ai.request.model}`, as the conventions name an inference span."""
    return f"chat {record.model_requested}"


def call_attributes(
    record: CallRecord,
    trajectory_id: str,
    *,
    provider: str,
    response_model: str,
    capture: bool = False,
    langfuse: bool = False,
) -> dict[str, AttributeValue]:
    attrs: dict[str, AttributeValue] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": provider,
        "gen_ai.request.model": record.model_requested,
        "gen_ai.response.model": response_model,
        "gen_ai.conversation.id": trajectory_id,
        "rlproxy.engine": record.engine,
        "rlproxy.protocol": record.protocol,
        "rlproxy.status": record.status,
        "rlproxy.call_id": record.id,
        "rlproxy.adapter_version": record.adapter_version or 0,
        "rlproxy.stream": record.stream,
    }
    if record.completion_id:
        attrs["gen_ai.response.id"] = record.completion_id
    reasons = tuple(c.finish_reason for c in record.choices if c.finish_reason)
    if reasons:
        attrs["gen_ai.response.finish_reasons"] = reasons
    prompt, completion = record.token_counts()
    if prompt is not None:
        attrs["gen_ai.usage.input_tokens"] = prompt
    if completion is not None:
        attrs["gen_ai.usage.output_tokens"] = completion
    attrs.update(_request_attributes(record.params))
    if record.status != "completed":
        attrs["error.type"] = record.status
    if record.explicit_group_key:
        attrs["rlproxy.group"] = record.explicit_group_key
    if record.time_to_first_token_s is not None:
        attrs["rlproxy.time_to_first_token_s"] = record.time_to_first_token_s
    if record.retry_count:
        attrs["rlproxy.retry_count"] = record.retry_count
    if record.shadow_samples:
        attrs["rlproxy.shadow_samples"] = len(record.shadow_samples)
    if capture:
        attrs["gen_ai.input.messages"] = _json(input_messages(record.request_messages))
        attrs["gen_ai.output.messages"] = _json(output_messages(record))
        if record.tools:
            attrs["gen_ai.tool.definitions"] = _json(record.tools)
    if langfuse:
        attrs.update(_langfuse_attributes(record, trajectory_id, capture))
    return attrs


def _request_attributes(params: dict[str, Any]) -> dict[str, AttributeValue]:
    out: dict[str, AttributeValue] = {}
    for name, attr in _REQUEST_PARAMS.items():
        value = params.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[attr] = value
    if "gen_ai.request.max_tokens" not in out:
        value = params.get("max_completion_tokens")
        if isinstance(value, int):
            out["gen_ai.request.max_tokens"] = value
    stop = params.get("stop")
    if isinstance(stop, str):
        out["gen_ai.request.stop_sequences"] = (stop,)
    elif isinstance(stop, list) and stop:
        out["gen_ai.request.stop_sequences"] = tuple(str(s) for s in stop)
    n = params.get("n")
    if isinstance(n, int) and n != 1:
        out["gen_ai.request.choice.count"] = n
    return out


def _langfuse_attributes(
    record: CallRecord, trajectory_id: str, capture: bool
) -> dict[str, AttributeValue]:
    """What Langfuse reads beside `gen_ai.*`: the call is a generation, the trajectory its
    session (https://langfuse.com/integrations/native/opentelemetry)."""
    attrs: dict[str, AttributeValue] = {
        "langfuse.observation.type": "generation",
        "session.id": trajectory_id,
    }
    if record.time_to_first_token_s is not None:
        first = record.created_at + record.time_to_first_token_s
        attrs["langfuse.observation.completion_start_time"] = json.dumps(
            datetime.fromtimestamp(first, UTC).isoformat()
        )
    if capture:
        attrs["langfuse.observation.input"] = _json(record.request_messages)
        attrs["langfuse.observation.output"] = _json(
            [c.message for c in record.choices]
            if len(record.choices) != 1
            else record.choices[0].message
        )
    return attrs


# --- messages in the conventions' parts format ----------------------------------------------


def input_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages as `gen_ai.input.messages`: `{role, parts: [...]}` each."""
    out = []
    for m in messages:
        role = str(m.get("role", "user"))
        if role == "tool":
            parts = [
                {
                    "type": "tool_call_response",
                    "id": m.get("tool_call_id"),
                    "response": _text(m.get("content")),
                }
            ]
        else:
            parts = _parts(m)
        out.append({"role": role, "parts": parts})
    return out


def output_messages(record: CallRecord) -> list[dict[str, Any]]:
    """The choices as `gen_ai.output.messages`: `{role, parts, finish_reason}` each."""
    return [
        {
            "role": str(c.message.get("role", "assistant")),
            "parts": _parts(c.message),
            "finish_reason": c.finish_reason or "",
        }
        for c in record.choices
    ]


def _parts(message: dict[str, Any]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    text = _text(message.get("content"))
    if text:
        parts.append({"type": "text", "content": text})
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        parts.append(
            {
                "type": "tool_call",
                "id": call.get("id"),
                "name": fn.get("name"),
                "arguments": _arguments(fn.get("arguments")),
            }
        )
    return parts


def _text(content: Any) -> str:
    """A message's content as text (OpenAI also allows a list of text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _arguments(raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
