"""Count and time every HTTP request for `/metrics` (`proxy.telemetry.metrics`).

The outermost middleware but the request id: it sees every answer, those the auth, body-size
and rate limits give before routing included. A request is labelled by its route template
(`/rl/trajectories/{trajectory_id}`, never the raw path, so ids do not become label values),
its method, its status and, for a chat request, the model it asked for (`label_model`, called
by the route once the body is parsed). The duration runs to the response's last byte, so a
stream is timed to its `[DONE]`.
"""

from __future__ import annotations

import time

from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.telemetry.metrics import Metrics

MODEL_KEY = "metrics_model"


def label_model(scope: Scope, model: str) -> None:
    """The requested model, for this request's metrics labels."""
    scope.setdefault("state", {})[MODEL_KEY] = model


class HttpMetricsMiddleware:
    def __init__(self, app: ASGIApp, *, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # an exception escaped before any response started

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            # An unknown model is a 404: its name is the client's to invent, not a label value.
            model = None if status == 404 else scope.get("state", {}).get(MODEL_KEY)
            self.metrics.observe_http(
                route_template(scope),
                scope["method"],
                status,
                model,
                time.perf_counter() - started,
            )


def route_template(scope: Scope) -> str:
    """The path template of the route that served the request; for one answered before routing
    (a 401, 413 or 429), the route it would have gone to; "unmatched" for unknown paths."""
    route = scope.get("route")
    if route is None:
        router = getattr(scope.get("app"), "router", None)
        for candidate in getattr(router, "routes", ()):
            match, _ = candidate.matches(scope)
            if match == Match.FULL:
                route = candidate
                break
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"
