"""Running requests on a real `LocalEngine` in tests: to the end, or admitted in one step."""

from __future__ import annotations

import asyncio
import threading

from proxy.engines.base import ChoiceFinished, GenerationRequest
from proxy.engines.local import LocalEngine


async def run(engine: LocalEngine, request: GenerationRequest) -> dict[int, ChoiceFinished]:
    """Each choice's finished record, by its index."""
    finished: dict[int, ChoiceFinished] = {}
    async for event in engine.generate(request):
        if isinstance(event, ChoiceFinished):
            finished[event.index] = event
    return finished


async def admitted_together(
    engine: LocalEngine, requests: list[GenerationRequest]
) -> list[dict[int, ChoiceFinished]]:
    """Run `requests` so that all of them are waiting before the engine's worker looks at any:
    its worker is held by a control command until all of them are queued."""
    release = threading.Event()
    held = asyncio.ensure_future(engine._control(release.wait))
    tasks = [asyncio.ensure_future(run(engine, r)) for r in requests]
    while engine.queued_rows() < sum(r.n for r in requests):
        await asyncio.sleep(0.01)
    release.set()
    await held
    return list(await asyncio.gather(*tasks))
