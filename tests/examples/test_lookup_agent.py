"""The lookup agent's task family (examples/lookup_agent.py): held-out tasks never share a word
or a code with practice, the reward pays 1 only for the right final number after `find` was
asked about the task's word, and the agent as the SDK builds it offers the tools and settings
the proof describes, with each task's words in its tool schemas."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from agents import ModelSettings, StopAtTools
from lookup_agent import (
    CHOICES,
    HELD_OUT_COUNT,
    Episode,
    answer_of,
    build_agent,
    choices_of,
    code_of,
    held_out,
    number_of,
    practice_tasks,
    question_text,
    reward,
)


def test_held_out_tasks_and_their_codes_are_never_practised() -> None:
    tasks = held_out()
    assert len(tasks) == HELD_OUT_COUNT == len(set(tasks))
    practised = set(practice_tasks()) | {code_of(w) for w in practice_tasks()}
    assert not (set(tasks) | {code_of(w) for w in tasks}) & practised


def test_a_code_is_another_word_and_the_choices_hold_word_and_code() -> None:
    for word in held_out() + practice_tasks():
        code = code_of(word)
        assert code != word
        choices = choices_of(word)
        assert len(set(choices)) == len(choices) == CHOICES
        assert word in choices and code in choices
        assert choices == choices_of(word)  # fixed per task
    assert question_text("apple") == "What is the number of the code of apple?"


def test_the_right_number_after_finding_the_word_earns_one() -> None:
    task = "apple"
    right = answer_of(task)
    assert right == number_of(code_of(task))
    assert reward(Episode(task, found=[task], got=[code_of(task)], final_output=str(right))) == 1.0
    # the right number without asking `find` is a guess: no reward
    assert reward(Episode(task, found=[], final_output=str(right))) == 0.0
    wrong = str(right % 40 + 1)
    assert reward(Episode(task, found=[task, task], final_output=wrong)) == 0.1
    assert reward(Episode(task, found=[code_of(task)], final_output="")) == 0.0


def test_the_agent_must_call_a_tool_every_turn_and_ends_on_get() -> None:
    agent = build_agent(Episode("apple"), "gpt-4o-mini", ModelSettings(tool_choice="required"))
    assert [t.name for t in agent.tools] == ["find", "get"]
    assert agent.reset_tool_choice is False
    assert agent.tool_use_behavior == StopAtTools(stop_at_tool_names=["get"])
    find, get = agent.tools
    assert find.params_json_schema["properties"]["word"]["enum"] == choices_of("apple")  # type: ignore[union-attr]
    assert get.params_json_schema["properties"]["code"]["enum"] == choices_of("apple")  # type: ignore[union-attr]
