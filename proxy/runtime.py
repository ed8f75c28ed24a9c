"""The one runtime builder: settings in, the store, engine, services and scorer a process needs.

    async with open_runtime(settings) as rt:                 # export, train: the store
    async with open_runtime(settings, scoring=True) as rt:   # score: + the scorer (and the local
                                                             #   engine when it is the judge)
    async with open_runtime(settings, serving=True) as rt:   # serve: + engine, chat, adapters,
                                                             #   background tasks, trainer child,
                                                             #   telemetry (proxy.telemetry)

Every command opens the store the same way (one URL, one retry window), builds the judge the same
way and stops what it started in reverse order. `rlproxy serve` puts the runtime on the app in
its lifespan; routes reach it only through `proxy.api.deps`. This module imports no HTTP code:
the trainer process may use it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from proxy.adapters.manager import AdapterManager
from proxy.adapters.publisher import Publisher
from proxy.adapters.registry import ServedModels
from proxy.chat.request import RequestLimits
from proxy.chat.service import ChatService
from proxy.chat.upstream import UpstreamChat
from proxy.cli.trainer_process import TrainerProcess
from proxy.engines.base import Engine
from proxy.redact import Redactor
from proxy.settings import Settings
from proxy.telemetry.metrics import Metrics, Sources
from proxy.telemetry.telemetry import Telemetry, open_telemetry
from storage.grouping import SignatureGrouper
from storage.store import Store
from trainer.rewards.litellm_judge import LiteLLMJudge
from trainer.rewards.local_judge import ChatComplete, LocalJudge
from trainer.rewards.ruler import DEFAULT_RUBRIC, Judge
from trainer.rewards.scoring import Scorer, ScoringConfig

logger = logging.getLogger(__name__)


@dataclass
class Served:
    """What serving adds to a runtime: everything the HTTP routes call."""

    engine: Engine
    registry: ServedModels
    chat: ChatService
    adapters: AdapterManager
    publisher: Publisher
    upstream: UpstreamChat | None = None
    trainer: TrainerProcess | None = None
    """The supervised trainer child (None with RLPROXY_TRAIN=false)."""


@dataclass
class Runtime:
    settings: Settings
    store: Store
    scorer: Scorer | None = None
    served: Served | None = None
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    """Background loops (idle closing, scoring, publishing), cancelled on close."""
    redact: Redactor = field(default_factory=Redactor)
    """Scrubs credentials from provider errors, stored error texts and the trainer's log tail."""
    telemetry: Telemetry | None = None
    """Metrics, spans and Langfuse scores (serving only)."""


@asynccontextmanager
async def open_runtime(
    settings: Settings,
    *,
    scoring: bool = False,
    serving: bool = False,
    metrics: Metrics | None = None,
) -> AsyncIterator[Runtime]:
    """`metrics`: the app's registry (serving); a fresh one when not given."""
    async with AsyncExitStack() as stack:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        redact = Redactor.for_settings(settings)
        store = await open_store(settings, redact)
        stack.push_async_callback(store.close)
        rt = Runtime(settings, store, redact=redact)
        engine: Any = None
        if serving or (scoring and not settings.judge_model):
            engine = await stack.enter_async_context(local_engine(settings))
        if serving:  # closed after the background tasks stop, so their last scores still go out
            rt.telemetry = await stack.enter_async_context(
                open_telemetry(settings, metrics or Metrics(), os.environ)
            )
        stack.push_async_callback(_cancel, rt.tasks)  # before the engine and the store stop
        if serving:
            rt.served = await _serve(settings, store, engine, stack, redact, rt.telemetry)
        if serving or scoring:
            judge_complete = None
            if not settings.judge_model:
                registry = rt.served.registry if rt.served else ServedModels(settings.model_name)
                # The judge's own service: it has no record sink, so judge calls never become
                # calls (nor training data).
                judge_chat = ChatService(engine, registry, engine.tokenizer, max_n=1)
                judge_complete = judge_chat.complete_json
            rt.scorer = build_scorer(settings, store, judge_complete)
        if rt.telemetry is not None and rt.served is not None:
            _observe(settings, rt, rt.telemetry, rt.served)
        if serving:
            _start_background(settings, rt)
        yield rt


async def open_store(settings: Settings, redact: Redactor) -> Store:
    """The store every command uses; `redact` scrubs error texts and params before writing."""
    url = settings.resolved_database_url
    store = await Store.open(
        url,
        retry_window_s=settings.retry_window_s,
        probe_interval_s=settings.storage_probe_s,
        redact=redact,
    )
    logger.info("storing every call in %s (%s)", _redact(url), store.dialect)
    return store


@asynccontextmanager
async def local_engine(settings: Settings) -> AsyncIterator[Any]:
    """The embedded model on the local engine, started; stopped on exit."""
    from proxy.engines.loader import load_model
    from proxy.engines.local import LocalEngine

    loaded = await asyncio.to_thread(load_model, settings.model_dir or settings.data_dir)
    engine = LocalEngine(loaded, max_batch_size=settings.max_batch_size)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


def build_scorer(
    settings: Settings,
    store: Store,
    judge_complete: ChatComplete | None,
) -> Scorer:
    """RULER's scorer with the configured judge (the local model when none is configured)."""
    judge: Judge
    if settings.judge_model:
        key_env = settings.judge_api_key_env
        judge = LiteLLMJudge(
            settings.judge_model,
            api_base=settings.judge_api_base,
            api_key=os.environ.get(key_env) if key_env else None,
            timeout_s=settings.judge_timeout_s,
        )
        logger.info("RULER judge: %s", settings.judge_model)
    else:
        if judge_complete is None:
            raise ValueError("no judge model is configured and no local model to judge with")
        judge = LocalJudge(judge_complete, settings.model_name)
        logger.warning(
            "RULER judge: the local model (%s). A 135M judge is a placeholder for trying the "
            "loop out, not a useful judge: set RLPROXY_JUDGE_MODEL for real scores",
            judge.model,
        )
    grouper = SignatureGrouper(
        min_size=settings.group_min_size,
        max_size=settings.group_max_size,
        window_s=settings.group_window_s,
        cohort=settings.group_cohort,
    )
    config = ScoringConfig(
        rubric=settings.judge_rubric or DEFAULT_RUBRIC,
        rubrics=dict(settings.judge_rubrics),
        judge_explicit_groups=settings.judge_explicit_groups,
        reward_policy=settings.reward_policy,
        lease_s=settings.scoring_lease_s,
    )
    return Scorer(store, judge, grouper, config)


async def _serve(
    settings: Settings,
    store: Store,
    engine: Any,
    stack: AsyncExitStack,
    redact: Redactor,
    telemetry: Telemetry | None = None,
) -> Served:
    record = store.record_call if telemetry is None else telemetry.recorder(store.record_call)
    registry = ServedModels(policy=settings.model_name, aliases=tuple(settings.aliases))
    adapters = AdapterManager(
        engine, registry, settings.checkpoints_dir, keep_previous=settings.keep_adapters
    )
    chat = ChatService(
        engine,
        registry,
        engine.tokenizer,
        max_n=settings.max_n,
        default_max_tokens=settings.default_max_tokens,
        record=record,
        shadow_samples=settings.shadow_samples,
        shadow_turns=settings.shadow_turns,
        limits=RequestLimits(
            max_messages=settings.max_messages,
            max_schema_depth=settings.max_schema_depth,
            max_schema_nodes=settings.max_schema_nodes,
        ),
        max_queued_rows=settings.max_queued_rows,
    )
    served = Served(engine, registry, chat, adapters, Publisher(adapters, store))
    if settings.publish_adapters:
        await served.publisher.check()  # a restart serves the newest good version
    if settings.train:
        served.trainer = TrainerProcess(settings, redact=redact)
        served.trainer.start()
        stack.push_async_callback(served.trainer.stop)
    if settings.upstream_models:
        from proxy.engines.upstream import UpstreamEngine

        upstream = UpstreamEngine(
            settings.upstream_models,
            timeout_s=settings.upstream_timeout_s,
            redact=redact,
        )
        upstream.start()
        served.upstream = UpstreamChat(upstream, record=record)
        logger.info("upstream models: %s", ", ".join(settings.upstream_models))
    return served


def _observe(settings: Settings, rt: Runtime, telemetry: Telemetry, served: Served) -> None:
    """Metrics read the serving parts at scrape time and hear every commit; scored groups reach
    telemetry (judge figures, Langfuse scores)."""
    sources = Sources(rt.store, served.engine, served.registry, served.adapters)
    telemetry.metrics.watch(sources, cache_s=settings.metrics_cache_s)
    rt.store.observe_commits(telemetry.metrics.observe_commit)
    if rt.scorer is not None:
        rt.scorer.on_scored = telemetry.group_scored


def _start_background(settings: Settings, rt: Runtime) -> None:
    rt.tasks.append(asyncio.create_task(close_idle_trajectories(rt.store, settings)))
    if settings.scoring and rt.scorer is not None:
        rt.tasks.append(asyncio.create_task(rt.scorer.run(settings.scoring_interval_s)))
    if settings.publish_adapters and rt.served is not None:
        rt.tasks.append(asyncio.create_task(rt.served.publisher.run(settings.adapter_poll_s)))


async def close_idle_trajectories(store: Store, settings: Settings) -> None:
    """Close trajectories idle for longer than the configured timeout, once in a while."""
    interval = max(1.0, min(60.0, settings.trajectory_idle_timeout_s / 4))
    while True:
        await asyncio.sleep(interval)
        try:
            closed = await store.close_idle(settings.trajectory_idle_timeout_s)
            if closed:
                logger.info("closed %d idle trajectories", len(closed))
        except Exception:
            logger.exception("closing idle trajectories failed; retrying later")


async def _cancel(tasks: list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _redact(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.split("@", 1)[1]
    return scheme + sep + rest
