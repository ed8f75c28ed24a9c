"""`GET /v1/models`, `GET /v1/models/{id}` and `GET /health`.

The list holds the policy's names (the registry) and then the upstream names, if any. As in
vLLM's `/v1/models`, each policy entry names the base model in `root` (RLPROXY_BASE_MODEL as
given, or the embedded model) and a version's `parent` is `NAME@base`; `/health` says
`base_model` too, so an operator sees which model was loaded.

`/health` answers 200 with `"status": "ok"` when the server can serve calls, and 503 with
`"status": "degraded"` and a `reason` when it cannot: the engine stopped, or the database takes
no writes (every call is stored before it is answered, so none can be). A 503 is what load
balancers and orchestrators take out of rotation; the body says why. The trainer child's state
is reported under "trainer" but never degrades the status: a crashing trainer does not stop
serving (it is restarted with backoff; see `proxy.trainer_child`).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from proxy.api.auth import Caller
from proxy.api.deps import EngineDep, Registry, StoreDep, TrainerDep, Upstream

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
async def health(
    registry: Registry, engine: EngineDep, store: StoreDep, trainer: TrainerDep, caller: Caller
) -> JSONResponse:
    """ok (200) or degraded (503, with the reason) for load balancers; the details (engine,
    storage, trainer with its log tail) only to an admin key, or to anyone without keys."""
    state, storage = engine.health(), store.health
    problems = [] if state.ok else ["the engine is not running"]
    if not storage.writable:
        problems.append(storage.describe())
    body: dict[str, object] = {"status": "degraded" if problems else "ok"}
    if problems:
        body["reason"] = "; ".join(problems)
    body |= {
        "model": registry.policy,
        "base_model": registry.base_model,
        "active_version": registry.active,
    }
    if caller.is_admin:
        body |= {
            "engine": state.detail,
            "storage": {
                "writable": storage.writable,
                "reason": storage.reason,
                "error": storage.error,
                "since": storage.since,
            },
            "trainer": trainer.status() if trainer is not None else {"state": "off"},
        }
    return JSONResponse(body, status_code=503 if problems else 200)
