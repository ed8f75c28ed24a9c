"""Exceptions the store raises on purpose.

    StoreError
     ├── StoreClosed            a write was submitted after `Store.close()`
     ├── TrajectoryNotFound     an end/reward named a trajectory that does not exist
     ├── InvalidRecord          a CallRecord breaks the contract (bad status, missing id, ...)
     └── StoreUnavailable       the database takes no writes (disk full, read-only, unreachable)

Database driver errors (SQLAlchemy's `DBAPIError` and subclasses) are not wrapped, with one
exception: a failure that says the database takes no writes at all (`storage.health`) becomes
`StoreUnavailable`, its cause chained, so callers can answer "try later" without knowing drivers.
"""

from __future__ import annotations


class StoreError(Exception):
    pass


class StoreClosed(StoreError):
    pass


class TrajectoryNotFound(StoreError, KeyError):
    def __init__(self, trajectory_id: str) -> None:
        super().__init__(trajectory_id)
        self.trajectory_id = trajectory_id

    def __str__(self) -> str:
        return f"no trajectory with id {self.trajectory_id!r}"


class InvalidRecord(StoreError, ValueError):
    pass


class StoreUnavailable(StoreError):
    """The write was not committed because the database takes no writes right now."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"the database cannot be written: {reason} ({detail})")
        self.reason = reason
        self.detail = detail
