"""`GET /v1/models`, `GET /v1/models/{id}` and `GET /health`.

The list holds the policy's names (the registry) and then the upstream names, if any.
"""

from __future__ import annotations

from fastapi import APIRouter

from proxy.api.deps import EngineDep, Registry, Upstream

router = APIRouter()


@router.get("/v1/models")
async def list_models(registry: Registry, upstream: Upstream) -> dict[str, object]:
    data = [registry.model_object(m) for m in registry.model_ids()]
    if upstream is not None:
        data += [_upstream_object(m, registry.created) for m in upstream.model_ids()]
    return {"object": "list", "data": data}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, registry: Registry, upstream: Upstream) -> dict[str, object]:
    if upstream is not None and upstream.serves(model_id):
        return _upstream_object(model_id, registry.created)
    return registry.model_object(model_id)


def _upstream_object(model_id: str, created: int) -> dict[str, object]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "upstream"}


@router.get("/health")
async def health(registry: Registry, engine: EngineDep) -> dict[str, object]:
    state = engine.health()
    return {
        "status": "ok" if state.ok else "degraded",
        "model": registry.policy,
        "active_version": registry.active,
        "engine": state.detail,
    }
