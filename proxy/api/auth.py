"""Who is calling: API keys, scopes, and the principal every request carries.

A key reads `rlp-<id>-<secret>` (`storage.api_keys`: only a salted hash of the secret is
stored; `rlproxy keys create` prints the key once). Once any key exists, every route but
`/health` and the dashboard's static page (`/dashboard`, which holds no data) needs one, sent
as `Authorization: Bearer <key>` (what every OpenAI SDK sends); `/metrics` (counts, no text)
needs what RLPROXY_METRICS_AUTH says (`open` by default):

    inference   /v1/*; reading, rewarding and ending its own trajectories; reading its own groups
    admin       all of that for every key's data, adapter load/activate/unload, scoring a group
                on demand, and the API docs (/docs, /redoc, /openapi.json)

With no key the server is open, and `proxy.api.app` refuses to serve beyond loopback unless
`--insecure-no-auth` says so. `AuthMiddleware` runs before routing, so unknown paths, the docs
and streamed bodies are all behind it; it puts the `Principal` in `scope["state"]`, where routes
read it through the `Caller` dependency and the rate limiter finds it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import Depends, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.errors import APIError
from storage.api_keys import ApiKeyRecord, KeyScope, client_ref, split_key
from storage.store import Store

logger = logging.getLogger(__name__)

PRINCIPAL_KEY = "principal"
Required = Literal["open", "inference", "admin"]


@dataclass(frozen=True)
class Principal:
    """The caller of one request.

    `key_id` is the rlproxy key it presented, or None when the server has no keys (open mode:
    every caller may do everything). `client_ref` names the caller in stored calls: the key id,
    or in open mode a salted hash of whatever bearer token it sent (None if it sent none).
    """

    key_id: str | None
    scope: KeyScope | Literal["anonymous"]
    name: str = ""
    client_ref: str | None = None

    @property
    def is_admin(self) -> bool:
        return self.scope == "admin"

    @property
    def owner(self) -> str | None:
        """The owner written on the trajectories this caller creates (None in open mode)."""
        return self.key_id

    @property
    def sees_all(self) -> bool:
        """True when reads are not restricted to this caller's own trajectories and groups (an
        admin key, or anyone in open mode)."""
        return self.is_admin

    def visible_owner(self) -> str | None:
        """The owner filter for this caller's reads (None: no filter)."""
        if self.sees_all:
            return None
        if self.key_id is None:  # anonymous: reaches only open routes, which read no rows
            raise PermissionError("an anonymous caller reads no trajectories or groups")
        return self.key_id

    def may_see(self, owner: str | None) -> bool:
        return self.sees_all or owner == self.key_id


class AuthenticationError(APIError):
    status_code = 401
    type = "invalid_request_error"
    default_code = "invalid_api_key"


class PermissionDeniedError(APIError):
    status_code = 403
    type = "invalid_request_error"
    default_code = "permission_denied"


ANONYMOUS = Principal(key_id=None, scope="anonymous", name="anonymous")
"""A caller on an open route, with keys defined, that sent no valid key."""


def required_scope(method: str, path: str, metrics: Required = "open") -> Required:
    """What a route needs. Anything not listed (unknown paths included) needs a valid key.
    `metrics`: what `GET /metrics` needs (RLPROXY_METRICS_AUTH)."""
    if path == "/metrics":
        return metrics
    if path == "/health" or path == "/dashboard" or path.startswith("/dashboard/"):
        return "open"  # the dashboard's page and files hold no data; its fetches send a key
    if path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
        return "admin"
    reading = method in ("GET", "HEAD", "OPTIONS")
    if path.startswith("/rl/adapters") or path.startswith("/rl/groups"):
        return "inference" if reading else "admin"
    return "inference"


class KeyRing:
    """The keys the server knows, read from the store and refreshed every `refresh_s`.

    A key created or revoked by `rlproxy keys` in another process takes effect here within
    `refresh_s` (an unknown key id triggers an early refresh, at most once a second).
    Authentication is on once any key has ever been created, revoked ones included, so revoking
    the last key never opens the server.
    """

    def __init__(self, refresh_s: float = 5.0) -> None:
        self.refresh_s = refresh_s
        self._store: Store | None = None
        self._keys: dict[str, ApiKeyRecord] = {}
        self._salt = ""
        self._loaded_at = -float("inf")
        self._lock = asyncio.Lock()

    async def open(self, store: Store) -> None:
        self._store = store
        self._salt = await store.installation_salt()
        await self._reload()

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    async def _reload(self) -> None:
        assert self._store is not None, "KeyRing.open was not called"
        keys = await self._store.list_api_keys()
        self._keys = {k.id: k for k in keys}
        self._loaded_at = time.monotonic()

    async def _refresh(self, min_age_s: float) -> None:
        if time.monotonic() - self._loaded_at < min_age_s:
            return
        async with self._lock:
            if time.monotonic() - self._loaded_at >= min_age_s:
                await self._reload()

    async def authenticate(self, authorization: str | None) -> Principal:
        """The caller behind an `Authorization` header; raises `AuthenticationError`."""
        await self._refresh(self.refresh_s)
        token = _bearer(authorization)
        if not self.enabled:
            ref = client_ref(self._salt, token) if token else None
            return Principal(key_id=None, scope="admin", name="open", client_ref=ref)
        if token is None:
            raise AuthenticationError(
                "You didn't provide an API key. Send it as `Authorization: Bearer <key>` or "
                "`x-api-key: <key>` (the OpenAI and Anthropic SDKs do this with api_key=...); "
                "`rlproxy keys create` makes one."
            )
        parts = split_key(token)
        if parts is None:
            raise AuthenticationError(f"Incorrect API key provided: {_masked(token)}.")
        key_id, secret = parts
        if key_id not in self._keys:
            await self._refresh(1.0)
        record = self._keys.get(key_id)
        if record is None or not record.matches(secret):
            raise AuthenticationError(f"Incorrect API key provided: {_masked(token)}.")
        if not record.active:
            raise AuthenticationError(f"The API key {_masked(token)} has been revoked.")
        return Principal(
            key_id=record.id, scope=record.scope, name=record.name, client_ref=record.id
        )


def _authorization(scope: Scope) -> str | None:
    """The `Authorization` header, or a key sent as `x-api-key` (Anthropic's SDKs) as if it
    came as `Bearer`: one key works for every protocol."""
    headers = dict(scope.get("headers") or ())
    raw = headers.get(b"authorization")
    if raw is not None:
        return str(raw.decode("latin-1"))
    key = headers.get(b"x-api-key")
    return None if key is None else "Bearer " + key.decode("latin-1").strip()


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _masked(token: str) -> str:
    """Enough of a key to recognise it, never enough to use it (as OpenAI's messages do)."""
    return f"{token[:8]}...{token[-4:]}" if len(token) > 16 else "***"


class AuthMiddleware:
    """Authenticate every HTTP request before routing; refuse what its scope does not allow."""

    def __init__(self, app: ASGIApp, *, keys: KeyRing, metrics: Required = "open") -> None:
        self.app = app
        self.keys = keys
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        need = required_scope(scope["method"], scope["path"], self.metrics)
        try:
            principal = await self.keys.authenticate(_authorization(scope))
            if need == "admin" and not principal.is_admin:
                raise PermissionDeniedError(
                    f"This key has the `{principal.scope}` scope; {scope['method']} "
                    f"{scope['path']} needs an `admin` key."
                )
        except APIError as exc:
            if need == "open":
                # An open route still learns who calls, when it can: /health shows its details
                # (engine, storage, trainer) to an admin or in open mode, to nobody else.
                principal = ANONYMOUS
            else:
                extra = {"www-authenticate": "Bearer"} if exc.status_code == 401 else None
                response = JSONResponse(exc.body(), status_code=exc.status_code, headers=extra)
                await response(scope, receive, send)
                return
        scope.setdefault("state", {})[PRINCIPAL_KEY] = principal
        await self.app(scope, receive, send)


async def get_caller(request: Request) -> Principal:  # async: no thread-pool hop
    principal = request.scope.get("state", {}).get(PRINCIPAL_KEY)
    if principal is None:  # only an app built without the middleware (unit tests)
        return Principal(key_id=None, scope="admin", name="open")
    assert isinstance(principal, Principal)
    return principal


Caller = Annotated[Principal, Depends(get_caller)]
