"""rlproxy's Prometheus metrics: one registry per app, rendered by `GET /metrics`.

    metrics = Metrics()                       # counters and histograms, no I/O
    metrics.observe_call(record)              # one stored chat call
    metrics.watch(Sources(store, engine, registry, adapters), cache_s=5)
    body = await metrics.render()             # Prometheus text format

Two kinds of figures:

- events, counted where they happen: HTTP requests (route template, method, status, requested
  model), stored chat calls (model, engine, how they ended), their latency, time to first token
  and tokens, store commits (seconds, payloads per commit), judge runs (seconds, retries,
  failures), rewards, and telemetry's own losses (spans dropped, Langfuse scores failed);
- state, read when scraped: the engine's rows running and queued, its tokens/s, the store's
  writer, the active adapter version and swap count, the forgetting check's held versions and
  the divergence of the version it checked last (`proxy.adapters.forgetting`), and, from the
  database, the trajectories
  still open, the groups still forming, ready or being scored, and the trainer's newest step
  (loss, mean reward, tokens/s, step time, staleness) with its run's counts of groups trained on
  and dropped or down-weighted for staleness (`StaleGroups`). The database figures are index
  ranges over the rows still in the pipeline and one row (`Store.live_counts`,
  `Store.latest_adapter`), whatever the history, cached `cache_s` seconds: a scrape storm costs
  one read per `cache_s`. Closed trajectories and judged groups are counted as events instead
  (`rlproxy_rewards_total`, `rlproxy_judge_groups_total`): counting them in the tables would
  scan the tables.

Counts only: no label or value carries prompt text. Labels that come from clients (the requested
model) are bounded: past `MAX_MODELS` distinct names, the rest count as "other".
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from storage.records import AdapterRecord, CallRecord, JudgeOutcome
from storage.store import LIVE_GROUPS, LIVE_TRAJECTORIES, Store

if TYPE_CHECKING:
    from proxy.adapters.forgetting import ForgettingCheck
    from proxy.adapters.manager import AdapterManager
    from proxy.adapters.registry import ServedModels
    from proxy.engines.base import Engine

logger = logging.getLogger(__name__)

MAX_MODELS = 64
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
COMMIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 500)
JUDGE_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TRAINER_FIGURES = {
    # metric suffix -> (key in the adapter's step metrics, help)
    "loss": ("loss", "GRPO loss of the newest training step (before its update)."),
    "mean_reward": ("mean_reward", "Mean reward of the groups the newest step trained on."),
    "tokens_per_second": ("tokens_per_s", "Forward tokens per second of the newest step."),
    "step_seconds": ("step_seconds", "Wall time of the newest training step."),
    "grad_norm": ("grad_norm", "Gradient norm of the newest step (before clipping)."),
    "kl": ("kl", "KL to the base of the newest step (0 without a KL term)."),
    "staleness_max": (
        "staleness_max",
        "Versions behind the trainer's weights of the stalest sample the newest step trained on.",
    ),
    "importance_weight_mean": (
        "is_weight_mean",
        "Mean truncated importance weight min(pi_old / mu, cap) of the newest step's tokens "
        "(1 unless off_policy_correction is 'tis').",
    ),
    "turns_too_long": (
        "too_long",
        "Turns the newest step left out for being longer than the trainer's max_seq_len (never "
        "cut).",
    ),
}


@dataclass(frozen=True)
class StaleGroups:
    """The staleness bound's counts over the trainer's whole run, from the newest step's metrics
    (`trainer.loop` carries them from checkpoint to checkpoint)."""

    trained: int
    """Groups training steps used (down-weighted ones included)."""
    dropped: int
    """Usable groups dropped for being more than max_staleness versions behind (every sample)."""
    downweighted: int
    """Groups past the bound that trained with a weight below 1."""

    @property
    def dropped_share(self) -> float:
        """Of the usable groups the trainer took (trained or dropped), the share dropped."""
        taken = self.trained + self.dropped
        return self.dropped / taken if taken else 0.0

    @classmethod
    def from_step(cls, metrics: dict[str, Any] | None) -> StaleGroups | None:
        """None for a step written before the trainer counted them."""
        m = metrics or {}
        keys = ("groups_trained_total", "stale_dropped_total", "stale_downweighted_total")
        if not all(isinstance(m.get(k), int) for k in keys):
            return None
        return cls(*(int(m[k]) for k in keys))


@dataclass
class Sources:
    """What the scrape-time figures read: the serving runtime's parts."""

    store: Store
    engine: Engine
    registry: ServedModels
    adapters: AdapterManager
    forgetting: ForgettingCheck | None = None
    """The publisher's forgetting check (None: off)."""


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(
            "rlproxy_http_requests",
            "HTTP requests answered, by route template, method, status code and the model a "
            "chat request asked for (empty for other routes).",
            ["route", "method", "status", "model"],
            registry=r,
        )
        self.http_duration = Histogram(
            "rlproxy_http_request_duration_seconds",
            "From the request's arrival to its response's last byte (a stream's [DONE]).",
            ["route", "method"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.calls = Counter(
            "rlproxy_chat_calls",
            "Chat calls stored, by requested model, engine (local, vllm, upstream), how they "
            "ended (completed, error, client_disconnected) and the wire protocol they came in by "
            "(chat, responses, messages).",
            ["model", "engine", "status", "protocol"],
            registry=r,
        )
        self.call_duration = Histogram(
            "rlproxy_chat_call_duration_seconds",
            "A stored call's latency: arrival to its last token (or its failure).",
            ["model", "engine"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "rlproxy_chat_time_to_first_token_seconds",
            "Arrival to the first generated token, for calls that generated one (upstream: the "
            "first streamed chunk).",
            ["model", "engine"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "rlproxy_chat_prompt_tokens",
            "Prompt tokens of stored calls.",
            ["model", "engine"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "rlproxy_chat_completion_tokens",
            "Completion tokens of stored calls (every returned choice).",
            ["model", "engine"],
            registry=r,
        )
        self.commit_duration = Histogram(
            "rlproxy_store_commit_duration_seconds",
            "One group commit of the store's writer: begin to committed.",
            buckets=COMMIT_BUCKETS,
            registry=r,
        )
        self.commit_size = Histogram(
            "rlproxy_store_commit_batch_size",
            "Writes (calls, rewards, ...) committed together in one transaction.",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.judge_duration = Histogram(
            "rlproxy_judge_duration_seconds",
            "RULER's judging of one group, retries included.",
            ["judge"],
            buckets=JUDGE_BUCKETS,
            registry=r,
        )
        self.judge_groups = Counter(
            "rlproxy_judge_groups",
            "Groups the judge scored or failed on (a failure is stored with its reason).",
            ["judge", "status"],
            registry=r,
        )
        self.judge_retries = Counter(
            "rlproxy_judge_retries",
            "Judge calls retried after an invalid reply or a failed call.",
            ["judge"],
            registry=r,
        )
        self.rewards = Counter(
            "rlproxy_rewards",
            "Explicit rewards posted to /rl/trajectories/{id}/reward.",
            registry=r,
        )
        self.spans = Counter(
            "rlproxy_telemetry_spans",
            "Chat spans by destination (otlp, langfuse) and outcome: exported, "
            "dropped_queue_full (the export queue was full: a slow or dead collector), "
            "export_failed (the collector refused the batch or never answered).",
            ["destination", "outcome"],
            registry=r,
        )
        self.langfuse_scores = Counter(
            "rlproxy_langfuse_scores",
            "Scores for Langfuse by outcome: sent, dropped (queue full), failed.",
            ["outcome"],
            registry=r,
        )
        self.telemetry_errors = Counter(
            "rlproxy_telemetry_errors",
            "Failures inside telemetry itself (logged; the call they were about is unaffected).",
            ["where"],
            registry=r,
        )
        self.caller_limit_redis_errors = Counter(
            "rlproxy_caller_limit_redis_errors",
            "Requests the shared rate limit's Redis (RLPROXY_REDIS_URL) did not count: it failed "
            "or timed out (the replica then counts callers with its own bucket for 5 s), or all "
            "of the replica's connections to it were busy (that request alone counted locally).",
            registry=r,
        )
        self._models: set[str] = set()
        self._models_lock = threading.Lock()
        self._state = _StateCollector()
        r.register(self._state)

    # --- events ----------------------------------------------------------------------------

    def model_label(self, model: str | None) -> str:
        """`model` as a label value: at most MAX_MODELS distinct names, then "other"."""
        if not model:
            return ""
        with self._models_lock:
            if model in self._models:
                return model
            if len(self._models) < MAX_MODELS:
                self._models.add(model)
                return model
        return "other"

    def observe_http(
        self, route: str, method: str, status: int, model: str | None, seconds: float
    ) -> None:
        self.http_requests.labels(route, method, str(status), self.model_label(model)).inc()
        self.http_duration.labels(route, method).observe(seconds)

    def observe_call(self, record: CallRecord) -> None:
        model, engine = self.model_label(record.model_requested), record.engine
        self.calls.labels(model, engine, record.status, record.protocol).inc()
        self.call_duration.labels(model, engine).observe(record.latency_s)
        if record.time_to_first_token_s is not None:
            self.ttft.labels(model, engine).observe(record.time_to_first_token_s)
        prompt, completion = record.token_counts()
        if prompt:
            self.prompt_tokens.labels(model, engine).inc(prompt)
        if completion:
            self.completion_tokens.labels(model, engine).inc(completion)

    def observe_commit(self, payloads: int, seconds: float) -> None:
        self.commit_size.observe(payloads)
        self.commit_duration.observe(seconds)

    def observe_judge(self, outcome: JudgeOutcome) -> None:
        if outcome.judge_model == "explicit":  # every member had a reward: no judge call
            return
        judge = outcome.judge_model
        self.judge_groups.labels(judge, outcome.status).inc()
        if outcome.latency_s is not None:
            self.judge_duration.labels(judge).observe(outcome.latency_s)
        if outcome.attempts and outcome.attempts > 1:
            self.judge_retries.labels(judge).inc(outcome.attempts - 1)

    def count_spans(self, destination: str, outcome: str, n: int) -> None:
        self.spans.labels(destination, outcome).inc(n)

    def count_scores(self, outcome: str, n: int) -> None:
        self.langfuse_scores.labels(outcome).inc(n)

    # --- state -----------------------------------------------------------------------------

    def watch(self, sources: Sources, *, cache_s: float = 5.0) -> None:
        """Read these parts at every scrape (the database figures at most every `cache_s`)."""
        self._state.sources = sources
        self._state.cache_s = cache_s

    async def render(self) -> bytes:
        """Everything, in Prometheus' text format (database figures refreshed if stale)."""
        await self._state.refresh()
        return generate_latest(self.registry)


ALL_STATUSES_EVERY_S = 60.0
"""How often the finished rows (closed trajectories, scored groups) are re-counted: a walk of
the status indexes, so seldom, whatever the scrape interval."""


class _StateCollector:
    """The figures read at scrape time (a custom collector on the app's registry)."""

    def __init__(self) -> None:
        self.sources: Sources | None = None
        self.cache_s = 5.0
        self._counts: dict[str, dict[str, int]] | None = None
        self._all: dict[str, dict[str, int]] | None = None  # every status, re-read each minute
        self._all_fetched = -float("inf")
        self._latest: AdapterRecord | None = None
        self._fetched = -float("inf")
        self._lock = asyncio.Lock()
        self._tokens: deque[tuple[float, int]] = deque()

    async def refresh(self) -> None:
        s = self.sources
        if s is None or time.monotonic() - self._fetched < self.cache_s:
            return
        async with self._lock:  # one query per cache period, however many scrapes wait
            if time.monotonic() - self._fetched < self.cache_s:
                return
            try:
                self._counts = await s.store.live_counts()
                if time.monotonic() - self._all_fetched >= max(ALL_STATUSES_EVERY_S, self.cache_s):
                    self._all_fetched = time.monotonic()
                    self._all = await s.store.status_counts()
                self._latest = await s.store.latest_adapter(s.registry.policy)
            except Exception:
                logger.exception("reading the database figures for /metrics failed")
            self._fetched = time.monotonic()

    def describe(self) -> Iterable[Metric]:
        return ()  # the families depend on what is watched; nothing to check at register time

    def collect(self) -> Iterator[Metric]:
        s = self.sources
        if s is None:
            return
        yield from self._engine(s.engine.health().detail)
        yield from self._store(s.store)
        yield from self._adapters(s)
        if s.forgetting is not None:
            yield from _forgetting(s.forgetting)
        if self._counts is not None:
            yield _by_status(
                "rlproxy_trajectories",
                "Trajectories by status (open: as fresh as the cache; closed: re-counted every "
                "minute).",
                LIVE_TRAJECTORIES,
                {**(self._all or {}).get("trajectories", {}), **self._counts["trajectories"]},
            )
            yield _by_status(
                "rlproxy_groups",
                "Groups by status (forming, ready, scoring: as fresh as the cache; the others: "
                "re-counted every minute).",
                LIVE_GROUPS,
                {**(self._all or {}).get("groups", {}), **self._counts["groups"]},
            )
        if self._latest is not None:
            yield from _trainer(self._latest)

    def _engine(self, detail: dict[str, Any]) -> Iterator[Metric]:
        for key, name, help_ in (
            ("running_rows", "running_rows", "Rows decoding in the engine's batch now."),
            ("queued_rows", "queued_rows", "Rows (choices) waiting for room in the batch."),
            ("waiting_requests", "waiting_requests", "Requests waiting for room in the batch."),
        ):
            if key in detail:
                yield GaugeMetricFamily(f"rlproxy_engine_{name}", help_, value=detail[key])
        if "steps" in detail:
            yield CounterMetricFamily(
                "rlproxy_engine_steps", "Decode steps the engine ran.", value=detail["steps"]
            )
        if "prefill_rows_shared" in detail:
            yield CounterMetricFamily(
                "rlproxy_engine_prefill_rows_shared",
                "Rows whose prompt the engine did not prefill again: another row of the same "
                "prefill had the same prompt and adapter (n choices, a group's runs).",
                value=detail["prefill_rows_shared"],
            )
        for key, name, help_ in (
            (
                "prefix_cache_query_tokens",
                "query_tokens",
                "Prompt tokens looked up in the engine's prefix cache (vllm: vLLM's "
                "vllm:prefix_cache_queries summed over the replicas, as last read).",
            ),
            (
                "prefix_cache_hit_tokens",
                "hit_tokens",
                "Prompt tokens found in the engine's prefix cache, not prefilled again (vllm: "
                "vLLM's vllm:prefix_cache_hits summed over the replicas, as last read).",
            ),
        ):
            if detail.get(key) is not None:
                yield CounterMetricFamily(
                    f"rlproxy_engine_prefix_cache_{name}", help_, value=detail[key]
                )
        cache = detail.get("prefix_cache")
        if isinstance(cache, dict) and cache.get("max_bytes") is not None:  # the local engine's
            yield GaugeMetricFamily(
                "rlproxy_engine_prefix_cache_bytes",
                "Bytes of key/value tensors the local engine's prefix cache holds "
                "(RLPROXY_PREFIX_CACHE_BYTES bounds it).",
                value=cache["bytes"],
            )
            yield GaugeMetricFamily(
                "rlproxy_engine_prefix_cache_entries",
                "Entries (token sequences with their KV) in the local engine's prefix cache.",
                value=cache["entries"],
            )
            dropped = CounterMetricFamily(
                "rlproxy_engine_prefix_cache_dropped",
                "Prefix cache entries dropped: for room (least recently used first) or for age "
                "(unused for RLPROXY_PREFIX_CACHE_TTL_S).",
                labels=["reason"],
            )
            dropped.add_metric(["room"], cache["evicted"])
            dropped.add_metric(["age"], cache["expired"])
            yield dropped
        tokens = detail.get("tokens")
        if tokens is not None:
            yield CounterMetricFamily(
                "rlproxy_engine_tokens", "Tokens the engine sampled (every row).", value=tokens
            )
            rate = self._rate(tokens)
            if rate is not None:
                yield GaugeMetricFamily(
                    "rlproxy_engine_tokens_per_second",
                    "Tokens sampled per second, between this scrape and the oldest of the last "
                    "minute (use rate(rlproxy_engine_tokens_total) in queries).",
                    value=rate,
                )

    def _rate(self, tokens: int) -> float | None:
        now, samples = time.monotonic(), self._tokens
        if not samples or now - samples[-1][0] >= 1.0:
            samples.append((now, tokens))
        while len(samples) > 2 and now - samples[1][0] >= 60.0:
            samples.popleft()
        t0, n0 = samples[0]
        return (tokens - n0) / (now - t0) if now - t0 >= 1.0 else None

    def _store(self, store: Store) -> Iterator[Metric]:
        stats = store.writer_stats
        yield GaugeMetricFamily(
            "rlproxy_store_writable",
            "1 while the database takes writes; 0 while chat requests get 503 (see /health).",
            value=1 if store.health.writable else 0,
        )
        yield CounterMetricFamily(
            "rlproxy_store_commits", "Transactions the writer committed.", value=stats.commits
        )
        yield CounterMetricFamily(
            "rlproxy_store_failed_batches",
            "Batches that failed (rerun one write at a time, or failed whole).",
            value=stats.failed_batches,
        )

    def _adapters(self, s: Sources) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "rlproxy_adapter_active_version",
            "The adapter version the policy name serves (0: the base model).",
            value=s.registry.active or 0,
        )
        yield GaugeMetricFamily(
            "rlproxy_adapter_loaded_versions",
            "Adapter versions loaded in the engine.",
            value=len(s.registry.loaded_versions()),
        )
        yield CounterMetricFamily(
            "rlproxy_adapter_swaps",
            "Activations that changed the version the policy name serves.",
            value=s.adapters.swaps,
        )


def _forgetting(check: ForgettingCheck) -> Iterator[Metric]:
    """The forgetting check's alarm: versions held (by this replica, since it started) and the
    divergence of the version it checked last, beside the limit."""
    held = CounterMetricFamily(
        "rlproxy_versions_held",
        "New adapter versions held back instead of served, by reason: forgetting (their mean "
        "KL to the base on the general prompts was over RLPROXY_FORGETTING_MAX_KL), "
        "check_failed (the check itself failed). Alert on any increase.",
        labels=["reason"],
    )
    for reason, count in check.held.items():
        held.add_metric([reason], count)
    yield held
    outcomes = CounterMetricFamily(
        "rlproxy_forgetting_checks",
        "Forgetting checks of new adapter versions by outcome: passed, held, skipped (the "
        "engine cannot teacher-force: vllm).",
        labels=["outcome"],
    )
    for outcome, count in check.outcomes.items():
        outcomes.add_metric([outcome], count)
    yield outcomes
    yield GaugeMetricFamily(
        "rlproxy_forgetting_max_kl",
        "The forgetting check's limit: mean KL(base || version) per answer token, nats.",
        value=check.config.max_kl,
    )
    last = check.last
    if last is None or last.divergence is None:
        return
    yield GaugeMetricFamily(
        "rlproxy_forgetting_divergence",
        "Mean KL(base || version) per answer token on the general prompts (nats) of the version "
        "checked last (rlproxy_forgetting_checked_version); over rlproxy_forgetting_max_kl it "
        "was held.",
        value=last.divergence.mean_kl,
    )
    yield GaugeMetricFamily(
        "rlproxy_forgetting_checked_version",
        "The adapter version the forgetting check measured last.",
        value=last.version,
    )


def _by_status(name: str, help_: str, statuses: Iterable[str], counts: dict[str, int]) -> Metric:
    family = GaugeMetricFamily(name, help_, labels=["status"])
    for status in dict.fromkeys([*statuses, *counts]):
        family.add_metric([status], counts.get(status, 0))
    return family


def _trainer(record: AdapterRecord) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "rlproxy_trainer_version",
        "The newest adapter version the trainer recorded.",
        value=record.version,
    )
    yield GaugeMetricFamily(
        "rlproxy_trainer_last_step_timestamp_seconds",
        "When the newest version was recorded (epoch seconds).",
        value=record.created_at,
    )
    figures = record.metrics or {}
    for suffix, (key, help_) in TRAINER_FIGURES.items():
        value = figures.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            yield GaugeMetricFamily(f"rlproxy_trainer_{suffix}", help_, value=value)
    too_long = figures.get("too_long_total")
    if isinstance(too_long, int) and not isinstance(too_long, bool):
        yield CounterMetricFamily(
            "rlproxy_trainer_turns_too_long",
            "Turns the trainer left out over its run (as of its newest version) for being longer "
            "than its max_seq_len: trained whole or not at all, never cut from the left.",
            value=too_long,
        )
    stale_samples = figures.get("stale_samples_dropped_total")
    if isinstance(stale_samples, int) and not isinstance(stale_samples, bool):
        yield CounterMetricFamily(
            "rlproxy_trainer_stale_samples_dropped",
            "Samples (turns) more than max_staleness versions behind the trainer's weights that "
            "its steps left out of the loss over its run (as of its newest version), in groups "
            "whose other samples trained.",
            value=stale_samples,
        )
    stale = StaleGroups.from_step(figures)
    if stale is None:
        return
    yield CounterMetricFamily(
        "rlproxy_trainer_groups_trained",
        "Groups the trainer's steps used over its run (as of its newest version).",
        value=stale.trained,
    )
    by_action = CounterMetricFamily(
        "rlproxy_trainer_stale_groups",
        "Groups more than max_staleness versions behind the trainer's weights, over its run (as "
        "of its newest version): dropped, or trained down-weighted (stale_policy).",
        labels=["action"],
    )
    by_action.add_metric(["dropped"], stale.dropped)
    by_action.add_metric(["downweighted"], stale.downweighted)
    yield by_action
    yield GaugeMetricFamily(
        "rlproxy_trainer_stale_dropped_share",
        "Of the usable groups the trainer took over its run, the share dropped for staleness.",
        value=stale.dropped_share,
    )
