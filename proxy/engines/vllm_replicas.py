"""The vLLM servers behind the `vllm` engine: which are up, which takes the next request, and
each one's LoRA admin calls.

    pool = ReplicaPool(urls, client, on_rejoin=reload_adapters)   # URLs: server roots (a
                                                                   # trailing /v1 is dropped)
    replica = pool.pick(affinity=lambda: "session:9f2c")  # the conversation's replica
                                               # (rendezvous hashing), or the least busy one
                                               # (see below); the key computed only if needed
    await pool.load_lora(replica, "rlproxy@3", "/data/checkpoints/rlproxy/0003")
    asyncio.create_task(pool.watch(2.0))       # GET /health on each; out when failing, back in
                                               # (after `on_rejoin` reloaded its adapters) once
                                               # it answers again

Outstanding work is counted in tokens: a request adds `n * max_tokens` when it starts on a
replica, each token that arrives takes one off, and whatever is left goes when it ends. A replica
that fails its probe, refuses a connection or dies mid-answer leaves the rotation at once; it comes
back only after its probe answers 200 and every adapter rlproxy serves was loaded on it again.

**Affinity.** Each vLLM keeps its own prefix cache, so the turns of one conversation should reach
the same replica: a request with an affinity key (`proxy.chat.affinity`: the trajectory id, its
`prompt_cache_key`, a coding agent's session header, or the conversation's task signature) goes
to the replica that key ranks first among the healthy ones (rendezvous hashing: a replica that
leaves or joins moves only the conversations it ranks first). It goes to the least busy replica
instead when that replica has more than `affinity_slack` requests in flight beyond the least
busy one's, and without a key. Requests in flight, not outstanding tokens, measure "busy" here:
coding agents ask for budgets of tens of thousands of tokens and end after a few hundred, so owed
tokens say little about how long a replica will stay busy.

**Prefix cache figures.** Every `metrics_interval_s` the health round also reads each healthy
replica's `GET /metrics` (Prometheus text) for vLLM's counters `vllm:prefix_cache_queries` and
`vllm:prefix_cache_hits` (prompt tokens looked up in the cache, and found there; rendered with
`_total`, one series per engine core, summed here; `vllm/v1/metrics/loggers.py`, vLLM 0.32 and
0.33). A replica that restarted starts them from 0 again.

The vLLM side, read from its source (vllm-project/vllm):
- `GET /health`: 200 with an empty body, 503 once the engine is dead
  (`vllm/entrypoints/serve/instrumentator/health.py`).
- `POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"}` and
  `POST /v1/unload_lora_adapter {"lora_name"}`, present only with
  `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` (`vllm/entrypoints/serve/lora/api_router.py`). Success
  is a 200 whose body is a plain sentence; errors are `{"error": {"message", "type", "param",
  "code"}}` with the HTTP status as an integer `code`
  (`vllm/entrypoints/serve/utils/error_response.py`). A name already loaded is a 400 unless
  `load_inplace`, a path with no adapter a 404, an adapter the loader refuses (modules_to_save,
  DoRA, bias, a rank over `--max-lora-rank`: `vllm/lora/peft_helper.py`) a 500, an unknown name
  to unload a 404 (`vllm/entrypoints/openai/models/serving.py`).
- `GET /v1/models`: the base model's card (with `max_model_len`, and `root`: what `--model`
  named, a folder or a hub id) and one card per LoRA, whose `parent` names the base.
- Routes that do not exist (the LoRA routes without `VLLM_ALLOW_RUNTIME_LORA_UPDATING`) are
  FastAPI's 404 `{"detail": "Not Found"}`, not vLLM's error body: that is how a replica without
  runtime LoRA loading is told apart from one where a name is merely unknown.

A replica that answers but is set up in a way rlproxy cannot train through (another model,
no LoRA routes) is `ReplicaMisconfigured`: it never joins the rotation, and at start rlproxy
refuses to run with the fix in the message (`proxy.engines.vllm`).

This module speaks HTTP to vLLM (the engine's pooled `aiohttp` session, `proxy.engines.vllm`) and
keeps replica state; it knows nothing of prompts or tokens.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from proxy.engines.http_streams import TRANSPORT_ERRORS, PooledSession, json_bytes

logger = logging.getLogger(__name__)


def server_root(url: str) -> str:
    """The server's root URL: no trailing slash and no `/v1`, which users write because OpenAI
    base URLs end with it (rlproxy adds `/v1/...` itself, and vLLM's `/health` is at the root)."""
    root = url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
        logger.warning(
            "RLPROXY_VLLM_URLS: %s ends in /v1; using %s (the server's root: rlproxy adds /v1 "
            "itself, and vLLM's /health is at the root)",
            url,
            root,
        )
    return root


@dataclass
class Replica:
    url: str  # the server's root URL: no trailing slash, no /v1
    healthy: bool = False
    outstanding: int = 0  # tokens still owed to the requests in flight here
    in_flight: int = 0
    served: int = 0  # requests started here
    loras: set[str] = field(default_factory=set)  # vLLM names this engine loaded here
    last_error: str | None = None
    misconfigured: str | None = None  # why it may not join, with the fix (ReplicaMisconfigured)
    cache: PrefixCacheCounts | None = None  # vLLM's prefix cache counters (None: not read yet)

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "misconfigured": self.misconfigured,
            "in_flight": self.in_flight,
            "outstanding_tokens": self.outstanding,
            "served": self.served,
            "adapters": sorted(self.loras),
            "last_error": self.last_error,
            "prefix_cache": None if self.cache is None else self.cache.describe(),
        }


@dataclass(frozen=True)
class PrefixCacheCounts:
    """vLLM's prefix cache counters, in prompt tokens: looked up (`queries`) and found (`hits`)."""

    queries: int
    hits: int

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None

    def describe(self) -> dict[str, Any]:
        return {"query_tokens": self.queries, "hit_tokens": self.hits, "hit_rate": self.hit_rate}

    @classmethod
    def parse(cls, text: str) -> PrefixCacheCounts | None:
        """From Prometheus' text format: every series of `vllm:prefix_cache_queries(_total)` and
        `vllm:prefix_cache_hits(_total)`, summed. None when the page has neither."""
        found: dict[str, float] = {}
        for line in text.splitlines():
            if not line.startswith("vllm:prefix_cache_"):
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
            if name not in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
                continue
            try:
                value = float(line.rsplit("}", 1)[-1].split()[0])
            except (IndexError, ValueError):
                continue
            found[name] = found.get(name, 0.0) + value
        if not found:
            return None
        return cls(
            int(found.get("vllm:prefix_cache_queries", 0)),
            int(found.get("vllm:prefix_cache_hits", 0)),
        )


def rendezvous_score(key: str, url: str) -> int:
    """Where `url` ranks for `key`: the replica with the highest score takes the key."""
    digest = hashlib.blake2b(f"{key}|{url}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class ReplicaRefused(Exception):
    """A replica answered a LoRA admin call with an error (vLLM's status, type and message)."""

    def __init__(self, url: str, status: int, message: str, type_: str | None = None) -> None:
        super().__init__(f"{url}: {status} {type_ or ''}: {message}".replace(" :", ":"))
        self.status = status
        self.message = message
        self.type = type_

    @classmethod
    def of(cls, url: str, status: int, content: bytes) -> ReplicaRefused:
        """From an error answer's status and body."""
        message, type_ = error_message(status, content)
        return cls(url, status, message, type_)


class ReplicaMisconfigured(Exception):
    """A replica that answers but is set up so that rlproxy cannot serve or train through it
    (another base model, no runtime LoRA loading). The message says what to change."""


def fix_for(refusal: str) -> str | None:
    """What to change when vLLM refused an adapter for a reason of its own setup; None when
    the refusal is the adapter's (read from vLLM's messages: `vllm/lora/peft_helper.py`,
    `vllm/v1/worker/lora_model_runner_mixin.py`, `LoRAAdapterNotFoundError`)."""
    if "max_lora_rank" in refusal:
        return (
            "start vLLM with --max-lora-rank at least the adapter's rank (one of 1, 8, 16, 32, "
            "64, 128, 256, 320, 512), or train with a lower lora_rank (RLPROXY_TRAINER)"
        )
    if "LoRA is not enabled" in refusal:
        return "start vLLM with --enable-lora"
    if "No adapter found" in refusal:
        return (
            "vLLM reads the adapter from its own disk: share the data directory with it, or set "
            "RLPROXY_VLLM_DATA_DIR to where vLLM sees rlproxy's data directory"
        )
    return None


def error_message(status: int, content: bytes) -> tuple[str, str | None]:
    """vLLM's error body `{"error": {"message", "type", ...}}` as (message, type); the raw
    text when the body is something else."""
    try:
        info = json.loads(content).get("error")
    except (ValueError, AttributeError):
        info = None
    if isinstance(info, dict) and isinstance(info.get("message"), str):
        return info["message"], info.get("type")
    return content.decode("utf-8", "replace")[:500] or f"HTTP {status}", None


class ReplicaPool:
    def __init__(
        self,
        urls: list[str],
        http: PooledSession,
        *,
        on_rejoin: Callable[[Replica], Awaitable[None]] | None = None,
        probe_timeout_s: float = 2.0,
        affinity: bool = True,
        affinity_slack: int = 4,
        metrics_interval_s: float = 10.0,
    ) -> None:
        if not urls:
            raise ValueError("the vllm engine needs at least one server URL (RLPROXY_VLLM_URLS)")
        self.replicas = [Replica(server_root(url)) for url in urls]
        self.http = http  # the engine's pooled session (made on first use, in the running loop)
        self.on_rejoin = on_rejoin
        self.probe_timeout_s = probe_timeout_s
        self.affinity = affinity
        self.affinity_slack = affinity_slack
        self.metrics_interval_s = metrics_interval_s
        self.routed = {"affinity": 0, "spilled": 0, "least_busy": 0}
        """How `pick` chose: the key's replica, the least busy one because the key's replica
        was too busy, the least busy one because there was no key (or affinity is off)."""
        self._turn = 0  # breaks ties between equally loaded replicas, in turn
        self._metrics_read = 0.0  # when the counters were last read (monotonic)

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    def pick(
        self,
        exclude: set[str] = frozenset(),  # type: ignore[assignment]
        affinity: Callable[[], str] | None = None,
    ) -> Replica | None:
        """The healthy replica the key `affinity()` ranks first, unless it has more than
        `affinity_slack` requests in flight beyond the least busy one's; else (or without a key)
        the one with the least outstanding work. None: none is left. The key is computed only
        when there is a choice to make: affinity on and more than one replica ready."""
        ready = [r for r in self.replicas if r.healthy and r.url not in exclude]
        if not ready:
            return None
        self._turn += 1
        n = len(self.replicas)
        least = min(
            ready,
            key=lambda r: (r.outstanding, r.in_flight, (self.replicas.index(r) - self._turn) % n),
        )
        if affinity is None or not self.affinity:
            self.routed["least_busy"] += 1
            return least
        if len(ready) == 1:  # the key's replica whatever the key: no need to compute it
            self.routed["affinity"] += 1
            return least
        key = affinity()
        chosen = max(ready, key=lambda r: rendezvous_score(key, r.url))
        if chosen.in_flight > min(r.in_flight for r in ready) + self.affinity_slack:
            self.routed["spilled"] += 1
            return least
        self.routed["affinity"] += 1
        return chosen

    def prefix_cache(self) -> PrefixCacheCounts | None:
        """The counters of every replica read so far, summed (None: none read yet)."""
        read = [r.cache for r in self.replicas if r.cache is not None]
        if not read:
            return None
        return PrefixCacheCounts(sum(c.queries for c in read), sum(c.hits for c in read))

    def mark_down(self, replica: Replica, why: str) -> None:
        if replica.healthy:
            logger.warning("vLLM replica %s taken out of rotation: %s", replica.url, why)
        replica.healthy = False
        replica.last_error = why

    # ----------------------------------------------------------------- health

    async def probe(self, replica: Replica) -> bool:
        try:
            status, _ = await self._call("GET", replica, "/health", self.probe_timeout_s)
        except TRANSPORT_ERRORS as exc:
            replica.last_error = f"health probe failed: {type(exc).__name__}: {exc}"
            return False
        if status != 200:
            replica.last_error = f"health probe answered {status} (GET {replica.url}/health)"
        return status == 200

    async def check(self, replica: Replica) -> None:
        """Probe one replica; take it out if it fails, let it back in (adapters reloaded
        first) if it was out and answers."""
        ok = await self.probe(replica)
        if not ok:
            self.mark_down(replica, replica.last_error or "health probe failed")
            return
        if replica.healthy:
            return
        try:
            if self.on_rejoin is not None:
                await self.on_rejoin(replica)
        except ReplicaMisconfigured as exc:  # it stays out until it is set up otherwise
            if replica.misconfigured != str(exc):
                logger.error("vLLM replica %s may not serve: %s", replica.url, exc)
            replica.misconfigured = replica.last_error = str(exc)
            return
        except Exception as exc:  # it stays out; the next probe tries again
            replica.last_error = f"rejoining failed: {exc}"
            logger.warning("vLLM replica %s answers but could not rejoin: %s", replica.url, exc)
            return
        replica.healthy = True
        replica.last_error = replica.misconfigured = None
        logger.info("vLLM replica %s is in rotation", replica.url)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(r) for r in self.replicas))
        now = time.monotonic()
        if now - self._metrics_read >= self.metrics_interval_s:
            self._metrics_read = now
            await asyncio.gather(*(self.read_metrics(r) for r in self.healthy()))

    async def read_metrics(self, replica: Replica) -> None:
        """Read `replica`'s prefix cache counters from its `/metrics`; a failure keeps the last
        ones (the health probe, not this, decides whether a replica serves)."""
        try:
            status, content = await self._call("GET", replica, "/metrics", self.probe_timeout_s)
        except TRANSPORT_ERRORS as exc:
            logger.warning("vLLM replica %s: /metrics not read: %r", replica.url, exc)
            return
        if status == 200:
            replica.cache = PrefixCacheCounts.parse(content.decode("utf-8", "replace"))

    async def watch(self, interval_s: float) -> None:
        """Probe every replica every `interval_s` seconds, forever (cancel to stop)."""
        while True:
            try:
                await self.check_all()
            except Exception:  # a probe must never end the loop
                logger.exception("vLLM health round failed; trying again")
            await asyncio.sleep(interval_s)

    # ----------------------------------------------------------------- LoRA admin

    async def load_lora(self, replica: Replica, name: str, path: str) -> None:
        """Load `name` from `path` on `replica`. A 400 saying the name is already loaded counts
        as loaded: names are versions (`POLICY@N`), and a version's folder never changes."""
        body = {"lora_name": name, "lora_path": path}
        status, content = await self._call("POST", replica, "/v1/load_lora_adapter", body=body)
        if status != 200:
            refused = ReplicaRefused.of(replica.url, status, content)
            if not (status == 400 and "already been loaded" in refused.message):
                raise refused
        replica.loras.add(name)

    async def unload_lora(self, replica: Replica, name: str) -> None:
        """Unload `name` from `replica`; a 404 (not loaded there) counts as done."""
        body = {"lora_name": name}
        status, content = await self._call("POST", replica, "/v1/unload_lora_adapter", body=body)
        if status not in (200, 404):
            raise ReplicaRefused.of(replica.url, status, content)
        replica.loras.discard(name)

    async def has_lora_routes(self, replica: Replica) -> bool:
        """Whether `replica` loads LoRAs at runtime: unloading a name never loaded is vLLM's 404
        error there, and FastAPI's bare 404 where the route does not exist."""
        body = {"lora_name": "rlproxy-probe-never-loaded"}
        status, content = await self._call("POST", replica, "/v1/unload_lora_adapter", body=body)
        if status != 404:
            return True
        try:
            return "error" in json.loads(content)
        except ValueError:
            return False

    async def models(self, replica: Replica) -> list[dict[str, Any]]:
        """The cards of `GET /v1/models` (the base model and the LoRAs loaded there)."""
        status, content = await self._call("GET", replica, "/v1/models", self.probe_timeout_s * 5)
        if status != 200:
            raise ReplicaRefused.of(replica.url, status, content)
        data = json.loads(content).get("data")
        return [card for card in data if isinstance(card, dict)] if isinstance(data, list) else []

    async def _call(
        self,
        method: str,
        replica: Replica,
        path: str,
        timeout_s: float | None = None,
        body: dict[str, Any] | None = None,
    ) -> tuple[int, bytes]:
        """One admin or probe request to `replica`: its status and whole body. Raises one of
        `TRANSPORT_ERRORS` when the replica cannot be reached or breaks off."""
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s is not None else None
        headers = {"content-type": "application/json"} if body is not None else None
        data = json_bytes(body) if body is not None else None
        async with self.http().request(
            method, f"{replica.url}{path}", data=data, headers=headers, timeout=timeout
        ) as response:
            return response.status, await response.read()
