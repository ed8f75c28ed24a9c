"""`GET /metrics`: Prometheus' text format (`proxy.telemetry.metrics` says what is in it).

Counts, latencies and states, never prompt text. Who may scrape it once API keys exist is
`RLPROXY_METRICS_AUTH` (`open` by default; `inference` or `admin` to require a key).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from proxy.api.deps import TelemetryDep

router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics(telemetry: TelemetryDep) -> Response:
    return Response(await telemetry.metrics.render(), media_type=CONTENT_TYPE_LATEST)
