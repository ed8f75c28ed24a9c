"""Opening the store the way every rlproxy process does: one URL, one retry window, the
credential scrubber handed in.

    store = await open_store(settings, Redactor.for_settings(settings))
    async with opened_store(settings) as store:   # the data folder made, the store closed after
        ...

`proxy.runtime.open_runtime` opens it so for `serve` and `score`; the commands that only read or
write rows (`rlproxy train`, `keys`, `status`, `export`) open it directly, without loading the
serving stack (torch, the engines, the grammars: seconds at every start). What it is not: the
store itself (`storage.store.Store` owns every read, write and migration), nor anything that
serves.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from proxy.redact import Redactor
from proxy.settings import Settings
from storage.store import Store

logger = logging.getLogger(__name__)


async def open_store(settings: Settings, redact: Redactor) -> Store:
    """The store every command uses; `redact` scrubs error texts and params before writing."""
    url = settings.resolved_database_url
    store = await Store.open(
        url,
        retry_window_s=settings.retry_window_s,
        probe_interval_s=settings.storage_probe_s,
        redact=redact,
    )
    logger.info("storing every call in %s (%s)", redacted_url(url), store.dialect)
    return store


@asynccontextmanager
async def opened_store(settings: Settings) -> AsyncIterator[Store]:
    """The store of a command that needs nothing else: the data folder made, the store closed."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    store = await open_store(settings, Redactor.for_settings(settings))
    try:
        yield store
    finally:
        await store.close()


def redacted_url(url: str) -> str:
    """`url` with its user and password hidden (for logs)."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.split("@", 1)[1]
    return scheme + sep + rest
