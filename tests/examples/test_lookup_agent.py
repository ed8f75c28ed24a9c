"""The lookup agent's task family (examples/lookup_agent.py): held-out tasks never share a word
with practice, the reward pays 1 only for the right final number, and the agent as the SDK
builds it offers the tools and settings the proof describes."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from agents import ModelSettings, StopAtTools
from lookup_agent import (
    HELD_OUT_COUNT,
    Episode,
    answer_of,
    build_agent,
    held_out,
    number_of,
    practice_tasks,
    reward,
)


def test_held_out_tasks_use_words_never_practised() -> None:
    tasks = held_out()
    assert len(tasks) == HELD_OUT_COUNT == len(set(tasks))
    practised = {w for task in practice_tasks() for w in task}
    assert not {w for task in tasks for w in task} & practised


def test_the_right_final_number_earns_one_and_lookups_earn_a_little() -> None:
    task = ("red", "lime")
    right = answer_of(task)
    assert right == number_of("red") + number_of("lime")
    assert reward(Episode(task, looked_up=["red", "lime"], final_output=str(right))) == 1.0
    assert reward(Episode(task, looked_up=[], final_output=f"{right}")) == 1.0
    wrong = str(right + 1)
    assert reward(Episode(task, looked_up=["red", "lime"], final_output=wrong)) == 0.2
    assert reward(Episode(task, looked_up=["red", "red", "red"], final_output=wrong)) == 0.1
    assert reward(Episode(task, looked_up=["blue"], final_output="")) == 0.0


def test_the_agent_must_call_a_tool_every_turn_and_ends_on_add() -> None:
    agent = build_agent(
        Episode(("red", "lime")), "gpt-4o-mini", ModelSettings(tool_choice="required")
    )
    assert [t.name for t in agent.tools] == ["lookup", "add"]
    assert agent.reset_tool_choice is False
    assert agent.tool_use_behavior == StopAtTools(stop_at_tool_names=["add"])
    lookup = agent.tools[0]
    schema = lookup.params_json_schema  # type: ignore[union-attr]
    assert "red" in schema["properties"]["word"]["enum"]
