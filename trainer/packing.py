"""Pack the turns of one trajectory into one training row.

An agent's trajectory is a chain of calls, each one's prompt the previous prompt, the previous
answer and what came back (a tool result, the user's next message). Trained turn by turn, every
row runs its whole prompt again: a trajectory of n turns costs about n times its first prompt,
and the cost of a step grows with the square of the episode's length. When turn k + 1's stored
prompt begins with exactly the tokens of turn k's prompt and sampled completion, one row
`prompt_1 + completion_1 + (what came between) + completion_2 + ...` holds both turns: a causal
model gives every completion token the same logprob it gets in its own row (the context before
it is the same tokens), so the loss and its gradient do not change (beyond float rounding), and
the prompt runs once.

A turn is not packed onto the one before when the tokens differ: a chat template that renders
the previous answer differently from how it was sampled (another tokenization of the same text:
the sampler may pick `f` + `ind` where the tokenizer writes `find`; a template that drops
earlier reasoning; a coding agent that compacted its history, whose next prompt is a summary:
`storage.records.TurnView.history_rewritten`), or when anything the loss reads differs between
the turns (sample, advantage, weight, the version that sampled it, how its logprobs were
stored), or when the row would exceed `max_len`. Such a turn starts a row of its own, exactly as
without packing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from trainer.grpo import TrainingExample


def pack_turns(turns: Sequence[TrainingExample], max_len: int) -> list[TrainingExample]:
    """`turns` in order (one trajectory's, or several trajectories' one after another), with each
    turn that continues the row before it exactly folded into that row; see the module."""
    rows: list[TrainingExample] = []
    for turn in turns:
        if rows and _continues(rows[-1], turn, max_len):
            rows[-1] = _append(rows[-1], turn)
        else:
            rows.append(turn)
    return rows


def _continues(row: TrainingExample, turn: TrainingExample, max_len: int) -> bool:
    if (row.sample_id, row.advantage, row.weight, row.behaviour_version, row.logprobs_masked) != (
        turn.sample_id,
        turn.advantage,
        turn.weight,
        turn.behaviour_version,
        turn.logprobs_masked,
    ):
        return False
    if len(turn.prompt_ids) + len(turn.completion_ids) > max_len:
        return False
    seen = len(row.prompt_ids) + len(row.completion_ids)
    return (
        len(turn.prompt_ids) >= seen
        and turn.prompt_ids[: len(row.prompt_ids)] == row.prompt_ids
        and turn.prompt_ids[len(row.prompt_ids) : seen] == row.completion_ids
    )


def _append(row: TrainingExample, turn: TrainingExample) -> TrainingExample:
    between = turn.prompt_ids[len(row.prompt_ids) + len(row.completion_ids) :]
    mask = list(row.completion_mask or [True] * len(row.completion_ids))
    return replace(
        row,
        completion_ids=[*row.completion_ids, *between, *turn.completion_ids],
        old_logprobs=[*row.old_logprobs, *[0.0] * len(between), *turn.old_logprobs],
        completion_mask=tuple([*mask, *[False] * len(between), *[True] * len(turn.completion_ids)]),
    )


def turns_in(example: TrainingExample) -> int:
    """How many turns a row holds (1 unless packed): the runs of sampled tokens in its mask."""
    mask = example.completion_mask
    if mask is None:
        return 1
    return sum(1 for i, sampled in enumerate(mask) if sampled and (i == 0 or not mask[i - 1]))
