"""`GET /dashboard`: the page that shows the loop learning, and its three static files.

    GET /dashboard                  the page (one HTML document, hash routes for its views)
    GET /dashboard/{asset}          dashboard.css, dashboard.js

The page holds no data: its script reads the JSON routes (`/health`, `/v1/models`,
`/rl/stats`, `/rl/trajectories`, `/rl/groups`, `/rl/adapters`) every few seconds, with the API
key the user typed (kept in the browser's localStorage) once the server answers 401. So these
paths are open (`proxy.api.auth.required_scope`); everything the page shows still needs a key.
The files ship inside the package (`proxy/api/static/`), with no build step. Stored text is put
on the page as text, never as markup, and the Content-Security-Policy allows this origin's
script and styles only.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from proxy.errors import NotFoundError

router = APIRouter(prefix="/dashboard")

ASSETS = {
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
}
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _asset(name: str) -> Response:
    if name not in ASSETS:
        raise NotFoundError(f"No dashboard file '{name}'.", param="asset", code="not_found")
    body = resources.files("proxy.api").joinpath("static", name).read_bytes()
    return Response(body, media_type=ASSETS[name], headers=HEADERS)


@router.get("", include_in_schema=False)
async def page() -> Response:
    return _asset("dashboard.html")


@router.get("/{asset}", include_in_schema=False)
async def asset(asset: str) -> Response:
    return _asset(asset)
