"""Fixtures of the `vllm` engine's unit tests (test_vllm_engine.py, test_vllm_routing.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from tests.fakes.vllm_wire import Replicas, loopback_engines


@pytest_asyncio.fixture(loop_scope="function")
async def replicas() -> AsyncIterator[Replicas]:
    """`await replicas(handler, (A, B))`: an engine over one loopback server per name, in order;
    servers and engine are closed after the test."""
    async with loopback_engines() as make:
        yield make


@pytest.fixture(scope="module")
def chat_tokenizer(model_data_dir: Any) -> Any:
    """The embedded model's tokenizer and chat template (no weights): what rlproxy renders
    prompts with in front of vLLM."""
    from transformers import AutoTokenizer

    from proxy.engines.loader import ensure_fp32_cache

    return AutoTokenizer.from_pretrained(str(ensure_fp32_cache(model_data_dir)))
