"""A version held back before it served, as the adapters table records it, for every reader.

The publisher holds a version the forgetting check failed (`proxy.adapters.forgetting`). Its row
gets status "rejected" (so the publisher never serves it, as a rolled-back one: see
`publisher._refused_by_rollout`), the reason in `error`, and in `rollout` the state "held" with
the check's verdict (`held_rollout`). `GET /rl/adapters`, the dashboard and `rlproxy status` show
it as "held" (`shown_status`). Only the version serving before keeps serving; activating a held
version by hand (`POST /rl/adapters/N/activate`) still works.

No torch and no engine here: `rlproxy status`, which loads neither, reads it too.
"""

from __future__ import annotations

from typing import Any

from storage.records import AdapterRecord

HELD = "held"
FORGETTING, CHECK_FAILED = "forgetting", "check_failed"
"""Why a version was held: it forgot general answers, or the check itself failed."""


def held_rollout(verdict: dict[str, Any]) -> dict[str, Any]:
    """The `rollout` column of a held version: its state and the check's verdict."""
    return {"state": HELD, "check": "forgetting", "verdict": verdict}


def held_record(record: AdapterRecord) -> dict[str, Any] | None:
    """The forgetting check's verdict if `record` is a version it held, else None."""
    rollout = record.rollout or {}
    if record.status != "rejected" or rollout.get("state") != HELD:
        return None
    verdict = rollout.get("verdict")
    return verdict if isinstance(verdict, dict) else {}


def shown_status(record: AdapterRecord) -> str:
    """The status readers show: the record's, or "held" for a version the check held."""
    return HELD if held_record(record) is not None else record.status
