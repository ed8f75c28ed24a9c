"""Typed FastAPI dependencies: the only way routes reach the runtime the lifespan opened.

    async def route(chat: Chat, store: StoreDep) -> ...

The lifespan puts one `proxy.runtime.Runtime` on the app; every dependency below reads a part
of it. No route reads `app.state` itself.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from proxy.adapters.manager import AdapterManager
from proxy.adapters.publisher import Publisher
from proxy.adapters.registry import ServedModels
from proxy.chat.service import ChatService
from proxy.chat.upstream import UpstreamChat
from proxy.engines.base import Engine
from proxy.errors import StorageUnavailableError
from proxy.runtime import Runtime, Served
from proxy.settings import Settings
from proxy.telemetry.telemetry import Telemetry
from proxy.trainer_child import TrainerProcess
from storage.store import Store
from trainer.scoring import Scorer

RUNTIME_KEY = "runtime"

# The dependencies below are `async def` on purpose: FastAPI runs a plain `def` dependency in its
# thread pool, a thread hop per dependency per request for what is an attribute read.


async def get_runtime(request: Request) -> Runtime:
    runtime: Runtime = getattr(request.app.state, RUNTIME_KEY)
    return runtime


async def get_served(runtime: Annotated[Runtime, Depends(get_runtime)]) -> Served:
    if runtime.served is None:
        raise RuntimeError("the runtime was opened without serving")
    return runtime.served


async def get_scorer(runtime: Annotated[Runtime, Depends(get_runtime)]) -> Scorer:
    if runtime.scorer is None:
        raise RuntimeError("the runtime was opened without a scorer")
    return runtime.scorer


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
ServedDep = Annotated[Served, Depends(get_served)]


async def _settings(runtime: RuntimeDep) -> Settings:
    return runtime.settings


async def _store(runtime: RuntimeDep) -> Store:
    return runtime.store


async def _chat(served: ServedDep) -> ChatService:
    return served.chat


async def _upstream(served: ServedDep) -> UpstreamChat | None:
    return served.upstream


async def _registry(served: ServedDep) -> ServedModels:
    return served.registry


async def _adapters(served: ServedDep) -> AdapterManager:
    return served.adapters


async def _publisher(served: ServedDep) -> Publisher:
    return served.publisher


async def _engine(served: ServedDep) -> Engine:
    return served.engine


async def _trainer(served: ServedDep) -> TrainerProcess | None:
    return served.trainer


async def _telemetry(runtime: RuntimeDep) -> Telemetry:
    if runtime.telemetry is None:
        raise RuntimeError("the runtime was opened without serving")
    return runtime.telemetry


async def require_writable_store(runtime: RuntimeDep) -> None:
    """A 503 (`storage_unavailable`) before any work when the database takes no writes: a call
    that cannot be stored is not made. Declared on the routes that generate."""
    health = runtime.store.health
    if not health.writable:
        raise StorageUnavailableError(health.describe())


async def _generating(runtime: RuntimeDep) -> Runtime:
    """The runtime of a route that generates, after `require_writable_store`'s check.

    One dependency for the chat-completions route, which runs on every call: FastAPI resolves
    each dependency per request (its cache key, its signature's parameters), a cost the event
    loop pays per dependency, so this route has one instead of six."""
    await require_writable_store(runtime)
    await get_served(runtime)  # refuses a runtime opened without serving
    return runtime


SettingsDep = Annotated[Settings, Depends(_settings)]
StoreDep = Annotated[Store, Depends(_store)]
Generating = Annotated[Runtime, Depends(_generating)]
"""The runtime, for a route that generates: 503 first if the store takes no writes."""
Chat = Annotated[ChatService, Depends(_chat)]
Upstream = Annotated[UpstreamChat | None, Depends(_upstream)]
Registry = Annotated[ServedModels, Depends(_registry)]
Adapters = Annotated[AdapterManager, Depends(_adapters)]
PublisherDep = Annotated[Publisher, Depends(_publisher)]
EngineDep = Annotated[Engine, Depends(_engine)]
TrainerDep = Annotated[TrainerProcess | None, Depends(_trainer)]
ScorerDep = Annotated[Scorer, Depends(get_scorer)]
TelemetryDep = Annotated[Telemetry, Depends(_telemetry)]


def request_id(request: Request) -> str:
    return str(request.scope.get("state", {}).get("request_id", ""))
