"""How many versions behind the trainer a group was generated, and what a step does with it.

Pure rules; `trainer.loop` applies them to the groups it collects for a step.

Versions. A sample's behaviour version is the adapter version that served it
(`calls.adapter_version`, carried into `TrainingExample.behaviour_version`); the base model,
which serves while no adapter is active, is version 0, the same function as the fresh LoRA the
trainer starts from (its B matrices are zero). The trainer steps from `TrainingLoop
.weights_version`, the version whose weights it holds: the parent of the version the step writes.

Versions behind = optimizer steps between the behaviour weights and the weights the step starts
from, along the checkpoint lineage (each version's trainer state records its parent,
`trainer.checkpoints.parent_version`). While training runs straight on that is simply
`current - behaviour`. When a canary was rolled back the trainer continues from an older
version, and the rolled-back branch is off its lineage: a sample served by the losing canary is
as many steps away as the path through the versions' common ancestor. Whether a pinned
`NAME@N`, a canary's share or the active version served a sample makes no difference: only the
weights do.

Each sample (turn) is as stale as the version that served it, and the rule applies to each
alone. A group's advantages are taken over all its members' rewards first, stale ones included
(a reward says how hard the task was whichever weights earned it, and the baseline does not
depend on the action it is compared with), so dropping a stale member leaves its fresh
neighbours' advantages as they were. A group is dropped only when every sample is. Before
2026-12-07 a group was as stale as its stalest sample and dropped whole: while a trained version
serves, the base answers the watch's share of conversations (`proxy.adapters.rollout`), so at a
share of 0.1 more than half of the groups of 8 held one base member, and every such group was
dropped once the trainer was K versions past the base (measured on serve's defaults:
`bench/heldout_rerun_proof.py`).

Rule (`staleness_weight`): with a bound K (`max_staleness`; None: no bound), a sample at most K
versions behind trains with weight 1. A staler one is left out (policy "drop": weight 0) or,
with policy "downweight", trains with weight `stale_weight ** (behind - K)`: each version past
the bound multiplies its loss by `stale_weight` again, so a far older sample counts for little.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

STALE_POLICIES = frozenset({"drop", "downweight"})


def lineage(version: int, parent_of: Callable[[int], int]) -> dict[int, int]:
    """`version` and each of its ancestors down to 0 (fresh weights), with the number of steps
    from each to `version`. `parent_of(v)` must be in [0, v) for v > 0."""
    out: dict[int, int] = {}
    current, steps = max(version, 0), 0
    while current not in out:
        out[current] = steps
        if current == 0:
            break
        parent = parent_of(current)
        if not 0 <= parent < current:
            raise ValueError(f"version {current} has parent {parent}: parents come before")
        current, steps = parent, steps + 1
    return out


def versions_behind(
    behaviour: int | None, ancestors: Mapping[int, int], parent_of: Callable[[int], int]
) -> int:
    """Optimizer steps between `behaviour` (None: the base model, 0) and the version whose
    `lineage` is `ancestors`, through their common ancestor."""
    current, steps = max(behaviour or 0, 0), 0
    while current not in ancestors:  # 0 is in every lineage: this ends
        parent = parent_of(current)
        if not 0 <= parent < current:
            raise ValueError(f"version {current} has parent {parent}: parents come before")
        current, steps = parent, steps + 1
    return steps + ancestors[current]


def samples_behind(
    behaviour_versions: Iterable[int | None],
    ancestors: Mapping[int, int],
    parent_of: Callable[[int], int],
) -> list[int]:
    """Versions behind of each sample, in order."""
    return [versions_behind(v, ancestors, parent_of) for v in behaviour_versions]


def staleness_weight(
    behind: int, *, max_staleness: int | None, policy: str, stale_weight: float
) -> float:
    """The weight a sample `behind` versions behind trains with: 1 within the bound, else 0
    ("drop") or `stale_weight ** (behind - max_staleness)` ("downweight")."""
    if policy not in STALE_POLICIES:
        raise ValueError(f"stale policy must be one of {sorted(STALE_POLICIES)}, got {policy!r}")
    if max_staleness is None or behind <= max_staleness:
        return 1.0
    if policy == "drop":
        return 0.0
    return float(stale_weight ** (behind - max_staleness))
