"""vLLM-shaped answers on loopback for the `vllm` engine's unit tests
(tests/proxy/test_vllm_engine.py, tests/proxy/test_vllm_routing.py): SSE chunks as vLLM's
`/v1/completions` streams them, a health handler, and engines over one loopback server per
replica (`tests/fakes/loopback_http.py`), so the engine's own HTTP client, pool and stream
reading are what run.

    async with loopback_engines() as replicas:  # the `replicas` fixture (tests/proxy/conftest.py)
        engine = await started(await replicas(handler, (A, B)))
        events = await collect(engine, request())
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from aiohttp import web

from proxy.engines.base import GenerationRequest, SamplingParams
from proxy.engines.vllm import VLLMEngine
from tests.fakes.loopback_http import Handler, Req, serve

A, B = "http://a:8000", "http://b:8000"
PROMPT = [1, 2, 3]


class FakeTokenizer:
    eos_token_id = 2
    unk_token_id = 0
    model_max_length = 4096

    def convert_tokens_to_ids(self, token: str) -> int:
        return 1 if token == "<|im_start|>" else 0


def sse(*chunks: dict[str, Any], done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(c)}\n\n" for c in chunks]
    return ("".join(lines) + ("data: [DONE]\n\n" if done else "")).encode()


def chunk(
    index: int,
    ids: list[int],
    lps: list[float],
    text: str,
    finish: str | None = None,
    model: str = "m",
    **extra: Any,
) -> dict[str, Any]:
    tops = [{f"token_id:{t}": lp, "token_id:99": -0.1} for t, lp in zip(ids, lps, strict=True)]
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 0,
        "model": model,
        "choices": [
            {
                "index": index,
                "text": text,
                "logprobs": {
                    "text_offset": [0] * len(ids),
                    "token_logprobs": lps,
                    "tokens": [f"token_id:{t}" for t in ids],
                    "top_logprobs": tops,
                },
                "finish_reason": finish,
                "stop_reason": None,
                "token_ids": ids,
                **extra,
            }
        ],
    }


def answer(ids: list[int], lps: list[float], texts: list[str], finish: str = "length") -> bytes:
    chunks = []
    for k, (t, lp, text) in enumerate(zip(ids, lps, texts, strict=True)):
        extra = {"prompt_token_ids": PROMPT} if k == 0 else {"prompt_token_ids": None}
        last = k == len(ids) - 1
        chunks.append(chunk(0, [t], [lp], text, finish if last else None, **extra))
    return sse(*chunks)


Replicas = Callable[..., Awaitable[VLLMEngine]]


def health_ok(request: Req) -> httpx.Response | None:
    if request.path == "/health":
        return httpx.Response(200)
    if request.path == "/v1/models":
        card = {"id": "base", "object": "model", "parent": None, "max_model_len": 2048}
        return httpx.Response(200, json={"object": "list", "data": [card]})
    return None


@asynccontextmanager
async def loopback_engines() -> AsyncIterator[Replicas]:
    """`await replicas(handler, (A, B))`: an engine over one loopback server per name, in order;
    servers and engines are closed when the block ends."""
    runners: list[web.AppRunner] = []
    engines: list[VLLMEngine] = []

    async def make(
        handler: Handler, names: tuple[str, ...] = (A, B), suffix: str = "", **kw: Any
    ) -> VLLMEngine:
        urls = []
        for name in names:
            runner, url = await serve(name, handler)
            runners.append(runner)
            urls.append(url + suffix)
        engine = VLLMEngine(urls, FakeTokenizer(), policy="rlproxy", **kw)
        engines.append(engine)
        return engine

    try:
        yield make
    finally:
        for engine in engines:
            await engine.stop()
        for runner in runners:
            await runner.cleanup()


def request(**params: Any) -> GenerationRequest:
    return GenerationRequest(PROMPT, SamplingParams(max_tokens=3, **params), request_id="r1")


async def collect(engine: VLLMEngine, req: GenerationRequest) -> list[Any]:
    return [event async for event in engine.generate(req)]


async def started(engine: VLLMEngine) -> VLLMEngine:
    await engine.pool.check_all()
    await engine._learn_model(engine.pool.replicas[0])
    return engine
