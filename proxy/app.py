"""The app factory: settings in, a FastAPI app with its engine, registry and services out.

Nothing is built at import time. `create_app(settings)` wires the parts; the lifespan loads the
model, starts the engine, and stops it on shutdown. Tests may pass a ready engine and tokenizer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.adapters import AdapterManager
from proxy.chat import ChatService
from proxy.errors import APIError, error_body
from proxy.local_judge import LocalJudge
from proxy.publisher import Publisher
from proxy.recording import CallRecorder
from proxy.registry import ServedModels
from proxy.routes import adapters as adapter_routes
from proxy.routes import chat as chat_routes
from proxy.routes import groups as group_routes
from proxy.routes import models as model_routes
from proxy.routes import rl as rl_routes
from proxy.settings import Settings
from proxy.trainer_process import TrainerProcess
from proxy.upstream import UpstreamEngine
from storage.store import Store
from trainer.ruler import Judge
from trainer.scoring import Scorer

logger = logging.getLogger(__name__)


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from proxy.engine.loader import load_model
        from proxy.engine.local import LocalEngine

        settings.data_dir.mkdir(parents=True, exist_ok=True)
        loaded = load_model(settings.model_dir or settings.data_dir)
        engine = LocalEngine(loaded, max_batch_size=settings.max_batch_size)
        await engine.start()
        registry = ServedModels(policy=settings.model_name, aliases=tuple(settings.aliases))
        store = await open_store(settings)
        idle_closer = asyncio.create_task(close_idle_trajectories(store, settings))
        app.state.engine = engine
        app.state.registry = registry
        app.state.adapters = AdapterManager(engine, registry, settings.checkpoints_dir)
        app.state.chat = ChatService(
            engine,
            registry,
            loaded.tokenizer,
            max_n=settings.max_n,
            default_max_tokens=settings.default_max_tokens,
            sink=CallRecorder(store),
            shadow_samples=settings.shadow_samples,
            shadow_turns=settings.shadow_turns,
        )
        judge_chat = ChatService(engine, registry, loaded.tokenizer, max_n=1)
        app.state.scorer = build_scorer(settings, store, judge_chat)
        scoring = None
        if settings.scoring:
            scoring = asyncio.create_task(app.state.scorer.run(settings.scoring_interval_s))
        app.state.store = store
        app.state.publisher = Publisher(app.state.adapters, store)
        background = [idle_closer]
        if scoring is not None:
            background.append(scoring)
        if settings.publish_adapters:
            await app.state.publisher.check()  # a restart serves the newest good version
            background.append(asyncio.create_task(app.state.publisher.run(settings.adapter_poll_s)))
        trainer = TrainerProcess(settings) if settings.train else None
        if trainer is not None:
            trainer.start()
        app.state.upstream = None
        if settings.upstream_models:
            app.state.upstream = UpstreamEngine(
                settings.upstream_models,
                sink=store.record_call,
                timeout_s=settings.upstream_timeout_s,
            )
            app.state.upstream.start()
            logger.info("upstream models: %s", ", ".join(settings.upstream_models))
        logger.info(
            "serving %s (aliases: %s) on the local engine; data directory %s",
            settings.model_name,
            ", ".join(settings.aliases) or "none",
            settings.data_dir.resolve(),
        )
        try:
            yield
        finally:
            if trainer is not None:
                await asyncio.to_thread(trainer.stop)
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await engine.stop()
            await store.close()

    if settings.public_bind:
        logger.warning(
            "listening on %s: rlproxy has no authentication yet, so anyone who can reach this "
            "address can call the model and the /rl admin routes",
            settings.host,
        )
    app = FastAPI(title="rlproxy", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.include_router(chat_routes.router)
    app.include_router(model_routes.router)
    app.include_router(adapter_routes.router)
    app.include_router(rl_routes.router)
    app.include_router(group_routes.router)
    install_error_handlers(app)
    app.add_middleware(RequestIdMiddleware)
    return app


async def open_store(settings: Settings) -> Store:
    from trainer.linking import PrefixLinker

    url = settings.resolved_database_url
    store = await Store.open(url, linker=PrefixLinker(retry_window_s=settings.retry_window_s))
    logger.info("storing every call in %s (%s)", _redact(url), store.dialect)
    return store


def build_scorer(settings: Settings, store: Store, judge_chat: ChatService | None) -> Scorer:
    """RULER's scorer with the configured judge (the local model when none is configured)."""
    from trainer.grouping import SignatureGrouper
    from trainer.litellm_judge import LiteLLMJudge
    from trainer.ruler import DEFAULT_RUBRIC
    from trainer.scoring import Scorer, ScoringConfig

    judge: Judge
    if settings.judge_model:
        key_env = settings.judge_api_key_env
        judge = LiteLLMJudge(
            settings.judge_model,
            api_base=settings.judge_api_base,
            api_key=os.environ.get(key_env) if key_env else None,
            timeout_s=settings.judge_timeout_s,
        )
        logger.info("RULER judge: %s", settings.judge_model)
    else:
        if judge_chat is None:
            raise ValueError("no judge model is configured and no local model to judge with")
        judge = LocalJudge(judge_chat, settings.model_name)
        logger.warning(
            "RULER judge: the local model (%s). A 135M judge is a placeholder for trying the "
            "loop out, not a useful judge: set RLPROXY_JUDGE_MODEL for real scores",
            judge.model,
        )
    grouper = SignatureGrouper(
        min_size=settings.group_min_size,
        max_size=settings.group_max_size,
        window_s=settings.group_window_s,
        cohort=settings.group_cohort,
    )
    config = ScoringConfig(
        rubric=settings.judge_rubric or DEFAULT_RUBRIC,
        rubrics=dict(settings.judge_rubrics),
        judge_explicit_groups=settings.judge_explicit_groups,
        reward_policy=settings.reward_policy,
    )
    return Scorer(store, judge, grouper, config)


async def close_idle_trajectories(store: Store, settings: Settings) -> None:
    """Close trajectories idle for longer than the configured timeout, once in a while."""
    interval = max(1.0, min(60.0, settings.trajectory_idle_timeout_s / 4))
    while True:
        await asyncio.sleep(interval)
        try:
            closed = await store.close_idle(settings.trajectory_idle_timeout_s)
            if closed:
                logger.info("closed %d idle trajectories", len(closed))
        except Exception:
            logger.exception("closing idle trajectories failed; retrying later")


def _redact(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.split("@", 1)[1]
    return scheme + sep + rest


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first: dict[str, Any] = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            message = "We could not parse the JSON body of your request."
            param, code = None, "invalid_json"
        elif first.get("type") == "missing":
            message = f"Missing required parameter: '{param}'."
            code = "missing_required_parameter"
        else:
            message = f"Invalid value for '{param}': {first.get('msg', 'invalid')}"
            code = "invalid_value"
        return JSONResponse(
            error_body(message, "invalid_request_error", param, code), status_code=400
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"Unknown request URL: {request.method} {request.url.path}."
        return JSONResponse(error_body(message, kind, None, code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(
            error_body(
                "The server had an error while processing your request.",
                "server_error",
                None,
                "server_error",
            ),
            status_code=500,
        )


class RequestIdMiddleware:
    """Give every request an id (`x-request-id` on every response, errors included)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = f"req_{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = rid
        raw = rid.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", raw)]
            await send(message)

        await self.app(scope, receive, send_with_id)
