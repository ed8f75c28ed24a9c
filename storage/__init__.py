"""rlproxy's database: SQLAlchemy models, migrations and the one store API.

Everything outside this package talks to the database through `Store`; records go in and come
out as the plain dataclasses of `storage.records`. The rules that decide which trajectory a call
joins (`storage.linking`) and which group a trajectory joins (`storage.grouping`) live here too:
both run inside the store's write transaction. This package imports neither `proxy` nor
`trainer` (enforced by `make lint`).
"""

from storage.errors import InvalidRecord, StoreClosed, StoreError, TrajectoryNotFound
from storage.records import (
    CallRecord,
    ChoiceRecord,
    JudgeCheckRecord,
    LinkDecision,
    LinkKeys,
    RewardRecord,
    StoredCall,
    TrajectoryDetail,
    TrajectoryPage,
    TrajectoryState,
    TrajectorySummary,
    TurnView,
)
from storage.store import Store

__all__ = [
    "CallRecord",
    "ChoiceRecord",
    "InvalidRecord",
    "JudgeCheckRecord",
    "LinkDecision",
    "LinkKeys",
    "RewardRecord",
    "Store",
    "StoreClosed",
    "StoreError",
    "StoredCall",
    "TrajectoryDetail",
    "TrajectoryNotFound",
    "TrajectoryPage",
    "TrajectoryState",
    "TrajectorySummary",
    "TurnView",
]
