"""Request bodies that are JSON text: the one check every JSON route gets before parsing.

JSON may spell a lone surrogate (`"\\ud800"`): valid JSON, but not Unicode text. Python parses it
into a `str` that cannot be encoded, so it would pass validation and fail much later, when the
call is stored or logged (a 500 after the whole generation). `TextJSONRoute` refuses such a body
with a 400 up front. The cost is one substring search per body; only a body that spells a
surrogate escape at all (`\\ud8..` to `\\udf..`, as a valid emoji pair also does) is decoded and
walked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from proxy.errors import InvalidRequestError

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class TextJSONRoute(APIRoute):
    """An `APIRoute` whose JSON body must be Unicode text (no lone surrogates)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            if request.method in ("POST", "PUT", "PATCH"):
                path = lone_surrogate_path(await request.body())  # cached for the handler
                if path is not None:
                    raise InvalidRequestError(
                        f"Invalid value for '{path}': it holds a lone surrogate (a \\ud800-\\udfff "
                        "escape without its pair), which is not Unicode text.",
                        param=path or None,
                    )
            return await handler(request)

        return checked


def lone_surrogate_path(body: bytes) -> str | None:
    """Where the first lone surrogate of a JSON body is ("messages.0.content"), "" for the top
    level, or None when there is none (or the body is not JSON: the route's parser says so)."""
    if not _SURROGATE_ESCAPE.search(body):
        return None
    try:
        value = json.loads(body)
    except ValueError:
        return None
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if not _is_text(item):
                return path
        elif isinstance(item, dict):
            for key, child in item.items():
                if not _is_text(key):
                    return path
                stack.append((f"{path}.{key}" if path else key, child))
        elif isinstance(item, list):
            stack.extend((f"{path}.{i}" if path else str(i), c) for i, c in enumerate(item))
    return None


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
