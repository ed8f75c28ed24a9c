"""`GET /v1/models`, `GET /v1/models/{id}` and `GET /health`.

The list holds the policy's names (the registry) and then the upstream names, if any.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from proxy.routes.deps import Registry

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request, registry: Registry) -> dict[str, object]:
    data = [registry.model_object(m) for m in registry.model_ids()]
    upstream = getattr(request.app.state, "upstream", None)
    if upstream is not None:
        data += [_upstream_object(m, registry.created) for m in upstream.model_ids()]
    return {"object": "list", "data": data}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request, registry: Registry) -> dict[str, object]:
    upstream = getattr(request.app.state, "upstream", None)
    if upstream is not None and upstream.serves(model_id):
        return _upstream_object(model_id, registry.created)
    return registry.model_object(model_id)


def _upstream_object(model_id: str, created: int) -> dict[str, object]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "upstream"}


@router.get("/health")
async def health(request: Request, registry: Registry) -> dict[str, object]:
    engine = request.app.state.engine.health()
    return {
        "status": "ok" if engine.ok else "degraded",
        "model": registry.policy,
        "active_version": registry.active,
        "engine": engine.detail,
    }
