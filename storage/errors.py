"""Exceptions the store raises on purpose.

    StoreError
     ├── StoreClosed            a write was submitted after `Store.close()`
     ├── TrajectoryNotFound     an end/reward named a trajectory that does not exist
     └── InvalidRecord          a CallRecord breaks the contract (bad status, missing id, ...)

Database driver errors (SQLAlchemy's `DBAPIError` and subclasses) are not wrapped: they reach the
caller as raised, so nothing about a failed commit is hidden.
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
