"""RULER on a group whose members are different tasks (a cohort of one agent's one-off tasks).

The rule (`trainer.scoring.ruler.different_tasks`): a member's task is its messages up to and
including the first user message (system prompt, first user message: what the task signature
hashes) and its tool schemas; a group whose members do not all have the same task gets the
different-task prompt, every other group today's same-task prompt.
"""

from __future__ import annotations

import copy
import random
from typing import Any

from trainer.scoring.canaries import make_canary
from trainer.scoring.ruler import (
    DEFAULT_RUBRIC,
    JudgeGroup,
    JudgeMember,
    build_judge_messages,
    different_tasks,
    task_length,
)

SYSTEM = {"role": "system", "content": "You answer with the tools. Today is 2026-12-05."}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "find",
            "description": "Get the code of a word.",
            "parameters": {
                "type": "object",
                "properties": {"word": {"type": "string", "enum": ["lime", "pink", "oak"]}},
                "required": ["word"],
            },
        },
    }
]


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def said(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def other_tools(choice: str) -> list[dict[str, Any]]:
    """TOOLS with another task's choices in the schema (as the lookup agent's live tasks)."""
    tools = copy.deepcopy(TOOLS)
    tools[0]["function"]["parameters"]["properties"]["word"]["enum"] = [choice, "pink", "oak"]
    return tools


def cohort() -> JudgeGroup:
    """Three different tasks of one agent: one system prompt, three first user messages."""
    members = [
        JudgeMember("t-0", [SYSTEM, user("What is the code of lime? (task alpha)"), said("pink")]),
        JudgeMember(
            "t-1",
            [
                SYSTEM,
                user("What is the code of oak? (task bravo)"),
                said("Let me look (bravo)."),
                user("Go on."),
                said("It is 12 (bravo done)."),
            ],
        ),
        JudgeMember("t-2", [SYSTEM, user("What is the code of fig? (task charlie)"), said("no")]),
    ]
    return JudgeGroup("cohort-1", members, TOOLS)


# ----------------------------------------------------------------------------- the rule


def test_a_task_is_the_messages_up_to_the_first_user_message() -> None:
    assert task_length([SYSTEM, user("q"), said("a"), user("more"), said("b")]) == 2
    assert task_length([user("q"), said("a")]) == 1
    # no user message: the messages before the first assistant message
    assert task_length([SYSTEM, said("a")]) == 1
    # never the whole conversation: the member keeps its last message to show
    assert task_length([SYSTEM, user("q")]) == 1
    assert task_length([]) == 0


def test_members_with_one_task_are_not_different_tasks() -> None:
    first = JudgeMember("a", [SYSTEM, user("q"), said("one")])
    longer = JudgeMember("b", [SYSTEM, user("q"), said("two"), user("more"), said("three")])
    assert not different_tasks([first, longer])
    assert not different_tasks([first])
    assert not different_tasks([])
    # the group's tools stand for a member that carries none
    own = JudgeMember("c", [SYSTEM, user("q"), said("x")], TOOLS)
    assert not different_tasks([first, own], TOOLS)
    assert different_tasks([first, own], None)


def test_another_first_user_message_system_prompt_or_tool_schema_is_another_task() -> None:
    base = JudgeMember("a", [SYSTEM, user("q"), said("one")], TOOLS)
    asked = JudgeMember("b", [SYSTEM, user("another q"), said("one")], TOOLS)
    instructed = JudgeMember("c", [{**SYSTEM, "content": "Be brief."}, user("q"), said("1")], TOOLS)
    schema = JudgeMember("d", [SYSTEM, user("q"), said("one")], other_tools("fig"))
    for other in (asked, instructed, schema):
        assert different_tasks([base, other]), other.member_id
    assert different_tasks(cohort().members)


# ----------------------------------------------------------------------------- the prompt


def test_the_cohort_prompt_says_each_member_is_its_own_task_scored_against_itself() -> None:
    system, prompt = build_judge_messages(cohort())
    assert DEFAULT_RUBRIC in system["content"]
    for text in (system["content"], prompt["content"]):
        assert "different task" in text
        assert "its own task" in text
        assert "same task" not in text
    assert "not against" in system["content"]  # not against the others' tasks


def test_the_cohort_prompt_shows_each_member_with_its_own_task() -> None:
    text = build_judge_messages(cohort())[1]["content"]
    assert "<shared_context>" not in text
    tags = [text.index(f'<trajectory id="{i}">') for i in ("1", "2", "3")]
    assert tags == sorted(tags)
    # the system prompt is each member's own: shown in each, never factored out
    assert text.count(SYSTEM["content"]) == 3
    blocks = [text[start:end] for start, end in zip(tags, [*tags[1:], len(text)], strict=True)]
    for block, name in zip(blocks, ("alpha", "bravo", "charlie"), strict=True):
        task = block[block.index("<task>") : block.index("</task>")]
        assert SYSTEM["content"] in task and f"(task {name})" in task
        assert block.index("</task>") < block.index("[assistant]")
        for other in {"alpha", "bravo", "charlie"} - {name}:
            assert f"(task {other})" not in block
    # what came after the task is shown whole, in order
    bravo = [blocks[1].index(s) for s in ("(bravo).", "Go on.", "(bravo done)")]
    assert bravo == sorted(bravo) and blocks[1].index("</task>") < bravo[0]


def test_the_cohort_prompt_shows_shared_tools_once_and_differing_tools_per_member() -> None:
    text = build_judge_messages(cohort())[1]["content"]
    assert text.count('"name": "find"') == 1 and text.index("<tools>") < text.index("<trajectory")
    group = cohort()
    for member, choice in zip(group.members, ("lime", "kiwi", "fig"), strict=True):
        member.tools = other_tools(choice)
    text = build_judge_messages(group)[1]["content"]
    assert text.count('"name": "find"') == 3
    for n, choice in enumerate(("lime", "kiwi", "fig"), start=1):
        block = text[text.index(f'<trajectory id="{n}">') :]
        block = block[: block.index("</trajectory>")]
        task = block[block.index("<task>") : block.index("</task>")]
        assert f'"{choice}"' in task and "<tools>" in task


def test_one_task_with_per_member_tools_keeps_the_same_task_prompt() -> None:
    shared = JudgeGroup(
        "g",
        [JudgeMember(str(n), [SYSTEM, user("q"), said(f"answer {n}")], TOOLS) for n in range(2)],
        TOOLS,
    )
    answers = [[SYSTEM, user("q"), said(f"answer {n}")] for n in range(2)]
    bare = JudgeGroup("g", [JudgeMember(str(n), m) for n, m in enumerate(answers)], TOOLS)
    assert build_judge_messages(shared) == build_judge_messages(bare)
    system, prompt = build_judge_messages(bare)
    assert "same task" in system["content"] and "same task" in prompt["content"]
    assert "<shared_context>" in prompt["content"] and "<task>" not in prompt["content"]


def test_a_canary_keeps_its_members_own_tools() -> None:
    """In a cohort whose members carry their own tool schemas, a canary built on a member shows
    that member's task, tools included, like any other member."""
    group = cohort()
    for member, choice in zip(group.members, ("lime", "kiwi", "fig"), strict=True):
        member.tools = other_tools(choice)
    canary = make_canary(group.members, "empty", random.Random(0))
    assert canary is not None
    base = next(m for m in group.members if m.messages[:-1] == canary.messages[:-1])
    assert canary.tools == base.tools and canary.tools is not base.tools
