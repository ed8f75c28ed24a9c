"""Langfuse: trajectories as traces, calls as generations, rewards and RULER scores as scores.

    config = LangfuseConfig.from_env(os.environ)      # None unless both keys are set
    exporter = config.span_exporter()                 # spans -> {host}/api/public/otel/v1/traces
    scores = LangfuseScores(config, count=...)        # scores -> POST {host}/api/public/scores
    scores.start(); scores.add(score(...)); await scores.close()

This speaks the HTTP protocol the `langfuse` Python SDK (5.0) speaks, without the SDK: its span
processor is a `BatchSpanProcessor` exporting OTLP/HTTP (protobuf, gzip) to
`/api/public/otel/v1/traces` with Basic auth (public key : secret key) and the
`x-langfuse-ingestion-version: 4` header, and its score consumer posts JSON lists of scores to
`/api/public/scores` (answered 202, or 207 with the rejected ones). Doing it here keeps the
spans on rlproxy's own tracer provider with the records' own timestamps, and keeps the SDK's
process-wide singletons, global tracer provider and exit hooks out of the server.
https://langfuse.com/integrations/native/opentelemetry, https://api.reference.langfuse.com.

Scores are queued and sent by one background task in batches; a full queue drops (and counts)
a score, a failed batch is retried twice (transport errors, 429, 5xx) and then counted as
failed. Nothing here ever waits on Langfuse inside a request.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

logger = logging.getLogger(__name__)

DEFAULT_HOST = "https://cloud.langfuse.com"
OTLP_PATH = "/api/public/otel/v1/traces"
SCORES_PATH = "/api/public/scores"

ScoreCounter = Callable[[str, int], None]
"""`count(outcome, n)`: outcome is "sent", "dropped" (queue full) or "failed"."""


@dataclass(frozen=True)
class LangfuseConfig:
    public_key: str
    secret_key: str = field(repr=False)
    host: str = DEFAULT_HOST
    timeout_s: float = 5.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> LangfuseConfig | None:
        """From the SDK's own variables: `LANGFUSE_PUBLIC_KEY`, `LANGFUSE_SECRET_KEY`,
        `LANGFUSE_HOST` (or `LANGFUSE_BASE_URL`; default Langfuse Cloud) and `LANGFUSE_TIMEOUT`
        (seconds per request, default 5). None without both keys."""
        public, secret = environ.get("LANGFUSE_PUBLIC_KEY"), environ.get("LANGFUSE_SECRET_KEY")
        if not public or not secret:
            return None
        host = environ.get("LANGFUSE_HOST") or environ.get("LANGFUSE_BASE_URL") or DEFAULT_HOST
        try:
            timeout_s = float(environ.get("LANGFUSE_TIMEOUT") or 5.0)
        except ValueError:
            timeout_s = 5.0
        return cls(public, secret, host.rstrip("/"), timeout_s)

    @property
    def headers(self) -> dict[str, str]:
        token = base64.b64encode(f"{self.public_key}:{self.secret_key}".encode()).decode()
        return {
            "Authorization": f"Basic {token}",
            "x-langfuse-public-key": self.public_key,
            "x-langfuse-sdk-name": "rlproxy",
        }

    def span_exporter(self) -> SpanExporter:
        from opentelemetry.exporter.otlp.proto.http import Compression
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(
            endpoint=self.host + OTLP_PATH,
            # Ingestion version 4: spans are readable at once (what the SDK sends).
            headers={**self.headers, "x-langfuse-ingestion-version": "4"},
            compression=Compression.Gzip,
            timeout=self.timeout_s,
        )


def score(
    *,
    name: str,
    value: float,
    trace_id: str,
    key: str,
    comment: str | None = None,
    observation_id: str | None = None,
    metadata: dict[str, Any] | None = None,
    at: float | None = None,
) -> dict[str, Any]:
    """One score as the public API takes it. `key` names the event it records (a reward's id,
    a judge score's group and member): the same key gives the same score id, so a score sent
    twice is one score."""
    body: dict[str, Any] = {
        "id": hashlib.sha256(key.encode()).hexdigest()[:32],
        "traceId": trace_id,
        "name": name,
        "value": float(value),
        "dataType": "NUMERIC",
        "timestamp": datetime.fromtimestamp(at, UTC).isoformat()
        if at
        else datetime.now(UTC).isoformat(),
    }
    if observation_id:
        body["observationId"] = observation_id
    if comment:
        body["comment"] = comment
    if metadata:
        body["metadata"] = metadata
    return body


class LangfuseScores:
    def __init__(
        self,
        config: LangfuseConfig,
        *,
        count: ScoreCounter,
        max_queue: int = 1000,
        batch: int = 50,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.config = config
        self._count = count
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=max_queue)
        self._batch = batch
        self._client = httpx.AsyncClient(
            base_url=config.host,
            headers=config.headers,
            timeout=config.timeout_s,
            transport=transport,
        )
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="langfuse-scores")

    def add(self, body: dict[str, Any]) -> None:
        """Queue a score; never waits. A full queue (Langfuse slow or gone) drops it, counted."""
        try:
            self._queue.put_nowait(body)
        except asyncio.QueueFull:
            self._count("dropped", 1)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (for at most `timeout_s`), then stop."""
        if self._task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._queue.join(), timeout_s)
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._client.aclose()

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self._batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                await self._send(batch)
            finally:
                for _ in batch:
                    self._queue.task_done()

    async def _send(self, batch: list[dict[str, Any]]) -> None:
        for attempt in range(3):
            try:
                response = await self._client.post(SCORES_PATH, json=batch)
            except httpx.HTTPError as exc:
                why = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code == 207:  # some accepted, some rejected: not retried
                    self._partial(batch, response)
                    return
                if response.is_success:
                    self._count("sent", len(batch))
                    return
                why = f"HTTP {response.status_code}: {response.text[:200]}"
                if response.status_code != 429 and response.status_code < 500:
                    break
            if attempt < 2:
                await asyncio.sleep(0.5 * 2**attempt)
        logger.warning("Langfuse did not take %d scores (%s); they are dropped", len(batch), why)
        self._count("failed", len(batch))

    def _partial(self, batch: list[dict[str, Any]], response: httpx.Response) -> None:
        try:
            body = response.json()
            accepted, rejected = int(body["accepted"]), int(body["rejected"])
        except (ValueError, KeyError, TypeError):
            accepted, rejected = 0, len(batch)
        logger.warning("Langfuse rejected %d of %d scores: %s", rejected, len(batch), response.text)
        self._count("sent", accepted)
        self._count("failed", rejected)
