"""`GET /v1/models`, `GET /v1/models/{id}` and `GET /health`."""

from __future__ import annotations

from fastapi import APIRouter, Request

from proxy.routes.deps import Registry

router = APIRouter()


@router.get("/v1/models")
async def list_models(registry: Registry) -> dict[str, object]:
    return {"object": "list", "data": [registry.model_object(m) for m in registry.model_ids()]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, registry: Registry) -> dict[str, object]:
    return registry.model_object(model_id)


@router.get("/health")
async def health(request: Request, registry: Registry) -> dict[str, object]:
    engine = request.app.state.engine.health()
    return {
        "status": "ok" if engine.ok else "degraded",
        "model": registry.policy,
        "active_version": registry.active,
        "engine": engine.detail,
    }
