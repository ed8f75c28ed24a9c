"""Scoring: closed trajectories into groups, groups judged, and the reward each member trains on.

    grouping = Grouping(store, grouper)        # the one way groups are formed (`grouping`)
    scorer = Scorer(store, judge, config)      # ready groups judged by RULER (`scoring`)
    group = await read_group(store, gid, "explicit")   # members' training rewards (`rewards`)

The room holds grouping (`grouping`), RULER (`ruler`, per-turn judging in `turns`), the judges
it can ask (`litellm_judge`, `local_judge`), the checks that keep a judge honest
(`judge_checks`, `canaries`, `judge_stats`), the scorer, and the reward policy (`rewards`).
Everything outside the room comes in through this package: the import contracts forbid reaching
into its modules.

Runs in the serving process (and in `rlproxy score`); the trainer process reads rewards through
`read_group`. Imports no part of `proxy` (the local judge is handed a function that completes
chat requests) and no training code: no torch.
"""

from trainer.scoring.canaries import KINDS as CANARY_KINDS
from trainer.scoring.canaries import CanaryKind
from trainer.scoring.grouping import Grouping, GroupingPass
from trainer.scoring.judge_checks import (
    GateDecision,
    JudgeChecker,
    JudgeChecksConfig,
    agreement_figures,
    canary_figures,
    drift_report,
    gate_decision,
)
from trainer.scoring.litellm_judge import LiteLLMJudge
from trainer.scoring.local_judge import ChatComplete, LocalJudge
from trainer.scoring.rewards import (
    REWARD_POLICIES,
    RewardPolicy,
    choose_rewards,
    pick_reward,
    read_group,
    version_rewards,
)
from trainer.scoring.ruler import DEFAULT_RUBRIC, Judge, JudgeGroup, JudgeMember, rubric_hash
from trainer.scoring.scoring import Scorer, ScoresWanted, ScoringConfig

__all__ = [
    "CANARY_KINDS",
    "DEFAULT_RUBRIC",
    "REWARD_POLICIES",
    "CanaryKind",
    "ChatComplete",
    "GateDecision",
    "Grouping",
    "GroupingPass",
    "Judge",
    "JudgeChecker",
    "JudgeChecksConfig",
    "JudgeGroup",
    "JudgeMember",
    "LiteLLMJudge",
    "LocalJudge",
    "RewardPolicy",
    "Scorer",
    "ScoresWanted",
    "ScoringConfig",
    "agreement_figures",
    "canary_figures",
    "choose_rewards",
    "drift_report",
    "gate_decision",
    "pick_reward",
    "read_group",
    "rubric_hash",
    "version_rewards",
]
