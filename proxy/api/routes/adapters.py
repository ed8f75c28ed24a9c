"""`/rl/adapters`: adapter versions (status, step metrics), load one, make one current.

GET  /rl/adapters                  every version: loaded/active/canary, status ("held": the
                                   forgetting check held it), error, metrics, rollout (canary
                                   state and every decision with its figures), forgetting (the
                                   check's verdict and figures); at the top, `rollout` (on or
                                   off, the canary running, the test, the watch) and
                                   `forgetting` (on or off, its limit, whether this engine can
                                   run it)
POST /rl/adapters/{version}/load   load into the engine (validated first)
POST /rl/adapters/{version}/unload unload from the engine (not the active version; requests in
                                   flight on it finish first)
POST /rl/adapters/{version}/activate
                                   serve it under the policy name (roll back or forward);
                                   version 0 goes back to the base model
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter

from proxy.adapters.forgetting import Verdict
from proxy.adapters.held import held_record, shown_status
from proxy.adapters.manager import AdapterManager
from proxy.adapters.publisher import Publisher
from proxy.api.body import TextJSONRoute
from proxy.api.deps import Adapters, PublisherDep, StoreDep
from storage.records import AdapterRecord

router = APIRouter(prefix="/rl/adapters", route_class=TextJSONRoute)


@router.get("")
async def list_adapters(
    adapters: Adapters, store: StoreDep, publisher: PublisherDep
) -> dict[str, object]:
    records = {a.version: a for a in await store.list_adapters(adapters.registry.policy)}
    checked = publisher.forgetting.verdicts if publisher.forgetting is not None else {}
    data: list[dict[str, Any]] = []
    for item in adapters.describe():
        version = int(item["version"])  # type: ignore[call-overload]
        record = records.pop(version, None)
        data.append({**item, **_record_fields(record, checked.get(version))})
    for version, record in sorted(records.items()):  # recorded, but the folder is gone
        data.append(
            {
                "version": version,
                "id": adapters.registry.version_id(version),
                "path": adapters.shown_path(version),
                "loaded": False,
                "active": False,
                "canary": False,
                **_record_fields(record, checked.get(version)),
            }
        )
    return {
        "object": "list",
        "data": sorted(data, key=lambda d: d["version"]),
        "rollout": _rollout(adapters, publisher),
        "forgetting": {"enabled": False}
        if publisher.forgetting is None
        else publisher.forgetting.describe(),
    }


def _rollout(adapters: AdapterManager, publisher: Publisher) -> dict[str, Any]:
    rollout = publisher.rollout
    if rollout is None:
        return {"enabled": False}
    canary = adapters.registry.canary
    test = rollout.config.test
    return {
        "enabled": True,
        "share": rollout.config.share,
        "canary": None if canary is None else canary.version,
        "baseline": adapters.registry.active or 0,
        "test": {
            **test.describe(),
            "reward_policy": rollout.config.reward_policy,
            "max_calls": rollout.config.max_calls,
            "evidence_wait_s": rollout.config.evidence_wait_s,
        },
        "watch": {
            "share": rollout.config.watch_share,
            "on": adapters.registry.watch_share > 0 and adapters.registry.active is not None,
            "roll_back_at_llr": round(rollout.config.watch_test.roll_back_at, 4),
            "latest": rollout.watch_figures,
        },
    }


def _record_fields(record: AdapterRecord | None, verdict: Verdict | None) -> dict[str, Any]:
    """A version's row as shown; `verdict`: the forgetting check's, when this replica ran it
    (a held version's is also in its row, so every replica shows it)."""
    checked = None if verdict is None else verdict.to_dict()
    if record is None:
        return {
            "status": "written",
            "error": None,
            "metrics": None,
            "activated_at": None,
            "rollout": None,
            "forgetting": checked,
        }
    fields = asdict(record)
    keys = ("error", "metrics", "created_at", "activated_at", "rollout")
    return {
        "status": shown_status(record),
        **{k: fields[k] for k in keys},
        "forgetting": checked or held_record(record),
    }


@router.post("/{version}/load")
async def load_adapter(version: int, adapters: Adapters) -> dict[str, object]:
    await adapters.load(version)
    return {"version": version, "loaded": True}


@router.post("/{version}/unload")
async def unload_adapter(version: int, adapters: Adapters) -> dict[str, object]:
    was_loaded = await adapters.unload(version)
    return {"version": version, "loaded": False, "was_loaded": was_loaded}


@router.post("/{version}/activate")
async def activate_adapter(
    version: int, adapters: Adapters, publisher: PublisherDep
) -> dict[str, object]:
    await adapters.activate(version or None)
    await publisher.note_activation(version or None)
    return {"version": version, "active": True}
