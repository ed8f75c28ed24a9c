"""rlproxy's database: SQLAlchemy models, migrations and the one store API.

Everything outside this package talks to the database through `Store`; records go in and come
out as the plain dataclasses of `storage.records`. This package does not import `proxy` or
`trainer`: the trajectory-linking policy is handed to `Store.open` as a `Linker`.
"""

from storage.errors import InvalidRecord, StoreClosed, StoreError, TrajectoryNotFound
from storage.linker import ExplicitIdsOnly, Linker
from storage.records import (
    CallRecord,
    ChoiceRecord,
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
    "ExplicitIdsOnly",
    "InvalidRecord",
    "LinkDecision",
    "LinkKeys",
    "Linker",
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
