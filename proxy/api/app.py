"""The app factory: settings in, a FastAPI app out.

Nothing is built at import time. `create_app(settings)` installs the routes, the error handlers
and the request-id middleware; its lifespan opens the serving runtime (`proxy.runtime`: store,
engine, services, background tasks, trainer child) and closes it on shutdown. Routes reach the
runtime only through the typed dependencies of `proxy.api.deps`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.api.auth import AuthMiddleware, KeyRing
from proxy.api.deps import RUNTIME_KEY
from proxy.api.error_shapes import AnthropicErrorsMiddleware
from proxy.api.http_metrics import HttpMetricsMiddleware
from proxy.api.limits import CallerLimitsMiddleware
from proxy.api.redis_limits import RedisTokenBucket
from proxy.api.routes import adapters as adapter_routes
from proxy.api.routes import completions as completion_routes
from proxy.api.routes import dashboard as dashboard_routes
from proxy.api.routes import evaluation as evaluation_routes
from proxy.api.routes import groups as group_routes
from proxy.api.routes import judge as judge_routes
from proxy.api.routes import messages as message_routes
from proxy.api.routes import metrics as metrics_routes
from proxy.api.routes import models as model_routes
from proxy.api.routes import responses as response_routes
from proxy.api.routes import stats as stats_routes
from proxy.api.routes import trajectories as trajectory_routes
from proxy.errors import APIError, StorageUnavailableError, error_body
from proxy.runtime import open_runtime
from proxy.settings import Settings
from proxy.telemetry.metrics import Metrics
from storage.errors import StoreUnavailable

logger = logging.getLogger(__name__)


def create_app(settings: Settings) -> FastAPI:
    keys = KeyRing(refresh_s=settings.key_refresh_s)
    metrics = Metrics()  # this app's own registry
    shared_rate = None
    if settings.limits.redis_url and settings.limits.caller_requests_per_minute:
        shared_rate = RedisTokenBucket(
            settings.limits.redis_url,
            settings.limits.caller_requests_per_minute,
            on_error=metrics.caller_limit_redis_errors.inc,
        )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with open_runtime(settings, serving=True, metrics=metrics) as runtime:
            await keys.open(runtime.store)
            check_exposure(settings, keys)
            setattr(app.state, RUNTIME_KEY, runtime)
            logger.info(
                "serving %s (aliases: %s) on the %s engine; data directory %s",
                settings.model_name,
                ", ".join(settings.aliases) or "none",
                settings.engine,
                settings.data_dir.resolve(),
            )
            try:
                yield
            finally:
                if shared_rate is not None:
                    await shared_rate.aclose()

    # FastAPI's own OpenTelemetry is off: rlproxy sends its spans and metrics itself
    # (`proxy.telemetry`), and with FastAPI's on every request asked whether a global provider
    # had been set (event-loop time on every request) and would trace a second time if one had.
    app = FastAPI(
        title="rlproxy",
        version="0.1.0",
        lifespan=lifespan,
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.include_router(completion_routes.router)
    app.include_router(response_routes.router)
    app.include_router(message_routes.router)
    app.include_router(model_routes.router)
    app.include_router(adapter_routes.router)
    app.include_router(trajectory_routes.router)
    app.include_router(group_routes.router)
    app.include_router(judge_routes.router)
    app.include_router(stats_routes.router)
    app.include_router(evaluation_routes.router)
    app.include_router(dashboard_routes.router)
    app.include_router(metrics_routes.router)
    install_error_handlers(app)
    # Starlette runs the middleware added last first: request id, metrics (which see every
    # answer), body size, auth, then limits (which need the caller the auth middleware found).
    app.add_middleware(
        CallerLimitsMiddleware,
        per_minute=settings.limits.caller_requests_per_minute,
        concurrency=settings.limits.caller_concurrency,
        by_address=settings.limits.caller_address_limits,
        rate=shared_rate,
    )
    app.add_middleware(AuthMiddleware, keys=keys, metrics=settings.telemetry.metrics_auth)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.limits.max_body_bytes)
    app.add_middleware(HttpMetricsMiddleware, metrics=metrics)
    app.add_middleware(AnthropicErrorsMiddleware)  # sees every error, knows the request id
    app.add_middleware(RequestIdMiddleware)
    return app


class UnsafeExposure(RuntimeError):
    """Serving beyond loopback with no API keys, without saying so."""


def check_exposure(settings: Settings, keys: KeyRing) -> None:
    """No keys means no authentication: that is served on loopback only, unless the operator
    passed `--insecure-no-auth` (RLPROXY_INSECURE_NO_AUTH), which is logged loudly."""
    if keys.enabled or not settings.public_bind:
        return
    if not settings.insecure_no_auth:
        raise UnsafeExposure(
            f"refusing to listen on {settings.host} with no API keys: anyone who can reach it "
            "could read every stored call and roll the model back. Create a key first "
            "(`rlproxy keys create --name admin --scope admin`), bind to 127.0.0.1, or pass "
            "--insecure-no-auth if something in front of rlproxy authenticates callers."
        )
    logger.warning(
        "listening on %s with no API keys (--insecure-no-auth): anyone who can reach this "
        "address can call the model, read every stored call and use the /rl admin routes",
        settings.host,
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(StoreUnavailable)
    async def store_unavailable(request: Request, exc: StoreUnavailable) -> JSONResponse:
        # A write failed because the database takes none (the store's health now says so).
        error = StorageUnavailableError(str(exc))
        return JSONResponse(error.body(), status_code=error.status_code)

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
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
            exc.status_code
        )
        message = str(exc.detail)
        headers = {k.lower(): v for k, v in (exc.headers or {}).items()}
        if exc.status_code == 404:
            message = f"Unknown request URL: {request.method} {request.url.path}."
        if exc.status_code == 405:  # every method of the path, not just its first route's
            headers["allow"] = ", ".join(allowed_methods(app, request.scope))
        return JSONResponse(
            error_body(message, kind, None, code), status_code=exc.status_code, headers=headers
        )

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


def allowed_methods(app: FastAPI, scope: Scope) -> list[str]:
    """The methods some route of this path takes (Starlette's own 405 names only those of the
    first route that matched the path: `GET /v1/responses/{id}` hid its `DELETE`)."""
    methods: set[str] = set()
    routes = list(app.router.routes)
    while routes:
        route = routes.pop()
        if isinstance(route, Route):
            if route.matches(scope)[0] != Match.NONE:
                methods |= route.methods or set()
        elif (included := getattr(route, "original_router", None)) is not None:
            routes += included.routes  # a router FastAPI includes lazily
    return sorted(methods)


class BodySizeLimitMiddleware:
    """Refuse a request body over `max_bytes` with a 413 before it is parsed or stored.

    A declared `content-length` over the limit is answered at once; a body that streams past it
    (chunked) stops being read, and the route's body parsing ends in the same 413.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            response = JSONResponse(
                error_body(self._message(), "invalid_request_error", None, "request_too_large"),
                status_code=413,
            )
            await response(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise StarletteHTTPException(413, detail=self._message())
            return message

        await self.app(scope, limited, send)

    def _message(self) -> str:
        return (
            f"The request body is larger than this server's limit of {self.max_bytes} bytes "
            "(RLPROXY_MAX_BODY_BYTES)."
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
