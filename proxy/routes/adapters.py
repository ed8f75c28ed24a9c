"""`/rl/adapters`: list adapter versions, load one, make one current (roll back or forward)."""

from __future__ import annotations

from fastapi import APIRouter

from proxy.routes.deps import Adapters

router = APIRouter(prefix="/rl/adapters")


@router.get("")
async def list_adapters(adapters: Adapters) -> dict[str, object]:
    return {"object": "list", "data": adapters.describe()}


@router.post("/{version}/load")
async def load_adapter(version: int, adapters: Adapters) -> dict[str, object]:
    await adapters.load(version)
    return {"version": version, "loaded": True}


@router.post("/{version}/activate")
async def activate_adapter(version: int, adapters: Adapters) -> dict[str, object]:
    await adapters.activate(version)
    return {"version": version, "active": True}
