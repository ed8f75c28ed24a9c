"""Turn a stored trajectory into one line of OpenAI's chat fine-tuning format.

    {"messages": [...history..., final assistant message], "tools": [...]}

(https://platform.openai.com/docs/guides/supervised-fine-tuning). Agents resend the whole
history on every call, so the last turn's request messages plus the assistant message that
answered it are the whole conversation, unless the agent rewrote its history (a coding agent's
compaction: `TurnView.history_rewritten`); then each part, from one rewrite to the next, is a
whole conversation of its own and `to_finetune_lines` gives one line each. Messages are reduced
to the fields the format accepts;
"developer" becomes "system". This module only reshapes dicts: it does no I/O and no JSON
encoding (write `json.dumps(line)` per line yourself).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from storage.records import TrajectoryDetail, TurnView

_KEEP = ("role", "content", "name", "tool_calls", "tool_call_id")


def _clean_tool_call(tc: dict[str, Any]) -> dict[str, Any]:
    fn = tc.get("function") or {}
    out: dict[str, Any] = {
        "type": tc.get("type", "function"),
        "function": {"name": fn.get("name"), "arguments": fn.get("arguments", "")},
    }
    if tc.get("id") is not None:
        out = {"id": tc["id"], **out}
    return out


def clean_message(message: dict[str, Any]) -> dict[str, Any]:
    """One message reduced to the fine-tuning format's fields."""
    out = {k: message[k] for k in _KEEP if message.get(k) is not None}
    if out.get("role") == "developer":
        out["role"] = "system"
    if "tool_calls" in out:
        if out["tool_calls"]:
            out["tool_calls"] = [_clean_tool_call(tc) for tc in out["tool_calls"]]
        else:
            del out["tool_calls"]
    if out.get("role") == "assistant" and "content" not in out and "tool_calls" not in out:
        out["content"] = ""
    return out


def _final_turn(turns: Sequence[TurnView]) -> TurnView | None:
    for turn in reversed(turns):
        if turn.status == "completed" and turn.response_messages:
            return turn
    return None


def to_finetune_line(detail: TrajectoryDetail) -> dict[str, Any] | None:
    """The trajectory's last conversation as {"messages", "tools"?} (after its last rewritten
    history, if any); None if no turn completed with an answer."""
    return _line(detail.turns)


def to_finetune_lines(detail: TrajectoryDetail) -> list[dict[str, Any]]:
    """One line per part of the trajectory, cut where the agent rewrote its history; one line
    (`to_finetune_line`'s) when it never did. Parts with no completed answer give none."""
    parts: list[list[TurnView]] = []
    for turn in detail.turns:
        if not parts or turn.history_rewritten:
            parts.append([])
        parts[-1].append(turn)
    return [line for part in parts if (line := _line(part)) is not None]


def _line(turns: Sequence[TurnView]) -> dict[str, Any] | None:
    turn = _final_turn(turns)
    if turn is None:
        return None
    messages = [clean_message(m) for m in turn.request_messages]
    messages.append(clean_message({"role": "assistant", **turn.response_messages[0]}))
    line: dict[str, Any] = {"messages": messages}
    if turn.tools:
        line["tools"] = turn.tools
    return line
