"""`/rl/adapters`: adapter versions (status, step metrics), load one, make one current.

GET  /rl/adapters                  every version: loaded/active/canary, status, error, metrics,
                                   rollout (canary state and every decision with its figures);
                                   `rollout` at the top: on or off, the canary running, the test
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

from proxy.adapters.manager import AdapterManager
from proxy.adapters.publisher import Publisher
from proxy.api.body import TextJSONRoute
from proxy.api.deps import Adapters, PublisherDep, StoreDep

router = APIRouter(prefix="/rl/adapters", route_class=TextJSONRoute)


@router.get("")
async def list_adapters(
    adapters: Adapters, store: StoreDep, publisher: PublisherDep
) -> dict[str, object]:
    records = {a.version: a for a in await store.list_adapters(adapters.registry.policy)}
    data: list[dict[str, Any]] = []
    for item in adapters.describe():
        record = records.pop(int(item["version"]), None)  # type: ignore[call-overload]
        data.append({**item, **_record_fields(record)})
    for version, record in sorted(records.items()):  # recorded, but the folder is gone
        data.append(
            {
                "version": version,
                "id": adapters.registry.version_id(version),
                "path": adapters.shown_path(version),
                "loaded": False,
                "active": False,
                "canary": False,
                **_record_fields(record),
            }
        )
    return {
        "object": "list",
        "data": sorted(data, key=lambda d: d["version"]),
        "rollout": _rollout(adapters, publisher),
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
            "margin": test.margin,
            "alpha": test.alpha,
            "looks": test.looks(),
            "reward_policy": rollout.config.reward_policy,
        },
    }


def _record_fields(record: Any) -> dict[str, Any]:
    if record is None:
        return {
            "status": "written",
            "error": None,
            "metrics": None,
            "activated_at": None,
            "rollout": None,
        }
    fields = asdict(record)
    keys = ("status", "error", "metrics", "created_at", "activated_at", "rollout")
    return {k: fields[k] for k in keys}


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
