"""The one runtime builder: settings in, the store, engine, services and scorer a process needs.

    async with open_runtime(settings) as rt:                 # the store alone
    async with open_runtime(settings, scoring=True) as rt:   # score: + the scorer (and the local
                                                             #   engine when it is the judge)
    async with open_runtime(settings, serving=True) as rt:   # serve: + engine, chat, adapters,
                                                             #   background tasks, trainer child,
                                                             #   telemetry (proxy.telemetry)

`keys`, `status`, `export` and `train` need only the store and open it without this module
(`proxy.database`), so they load no engine. Every command opens the store the same way
(`proxy.database.open_store`: one URL, one retry window), builds the judge the same way and
stops what it started in reverse order. `rlproxy serve` puts the runtime on the app in its
lifespan; routes reach it only through `proxy.api.deps`. This module imports no HTTP code.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from proxy.adapters.closeness import ClosenessCheck
from proxy.adapters.deployment import (
    LeaseKeeper,
    SharedVersions,
    default_replica_id,
    trainer_lease_name,
    trainer_presence_name,
)
from proxy.adapters.forgetting import ForgettingCheck, Render, forgetting_config
from proxy.adapters.manager import AdapterManager
from proxy.adapters.publisher import Publisher
from proxy.adapters.registry import ServedModels
from proxy.adapters.rollout import rollout_config
from proxy.chat.budget import BudgetRule
from proxy.chat.request import RequestLimits
from proxy.chat.service import ChatService
from proxy.chat.upstream import UpstreamChat
from proxy.database import open_store
from proxy.engines.base import Engine
from proxy.redact import Redactor
from proxy.settings import Settings
from proxy.telemetry.background import BackgroundWatch
from proxy.telemetry.metrics import Metrics, Sources
from proxy.telemetry.telemetry import Telemetry, open_telemetry
from proxy.trainer_child import TrainerProcess
from storage.held_out import HeldOutSplit
from storage.store import Store
from trainer.scoring import (
    ChatComplete,
    Grouping,
    Judge,
    LiteLLMJudge,
    LocalJudge,
    Scorer,
    ScoresWanted,
)

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
    grouping: Grouping | None = None
    """Forms groups and scores the rewarded ones, with no judge (serving, scoring on or off)."""
    served: Served | None = None
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    """Background loops (idle closing, scoring, publishing), cancelled on close."""
    redact: Redactor = field(default_factory=Redactor)
    """Scrubs credentials from provider errors, stored error texts and the trainer's log tail."""
    telemetry: Telemetry | None = None
    """Metrics, spans and Langfuse scores (serving only)."""
    background: BackgroundWatch | None = None
    """What the judge, the trainer and the engine's background rows cost (serving only)."""


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
        if serving or (scoring and not settings.judge.model):
            engine = await stack.enter_async_context(policy_engine(settings))
        if serving:  # closed after the background tasks stop, so their last scores still go out
            rt.telemetry = await stack.enter_async_context(
                open_telemetry(settings, metrics or Metrics(), os.environ)
            )
        stack.push_async_callback(_cancel, rt.tasks)  # before the engine and the store stop
        if serving:
            rt.served = await _serve(settings, store, engine, stack, redact, rt.telemetry)
        if serving or scoring:
            judge_complete = None
            if not settings.judge.model:
                registry = rt.served.registry if rt.served else ServedModels(settings.model_name)
                # The judge's own service: it has no record sink, so judge calls never become
                # calls (nor training data); its requests give way to users' (serving first).
                judge_chat = ChatService(
                    engine,
                    registry,
                    engine.tokenizer,
                    max_n=1,
                    tool_format=settings.tool_format,
                    background=True,
                )
                judge_complete = judge_chat.complete_json
            rt.scorer = build_scorer(settings, store, judge_complete)
            if serving:
                rt.scorer.wanted = scores_wanted(settings, store, rt.telemetry)
        if serving or scoring:
            # Left to the judge when one runs and is asked to judge rewarded groups too, and in
            # `rlproxy score`, whose scorer marks them scored and lists them with the rest.
            settle = serving and not (settings.judge.scoring and settings.judge.explicit_groups)
            rt.grouping = Grouping(store, settings.groups.grouper(), settle_explicit=settle)
        if rt.telemetry is not None and rt.served is not None:
            _observe(settings, rt, rt.telemetry, rt.served)
        if serving:
            _start_background(settings, rt)
        yield rt


@asynccontextmanager
async def policy_engine(settings: Settings) -> AsyncIterator[Any]:
    """The engine that generates the policy's tokens (RLPROXY_ENGINE), started."""
    factory = vllm_engine if settings.engine == "vllm" else local_engine
    async with factory(settings) as engine:
        yield engine


@asynccontextmanager
async def vllm_engine(settings: Settings) -> AsyncIterator[Any]:
    """vLLM servers (RLPROXY_VLLM_URLS) behind the token-level contract; the tokenizer is the
    served model's, read here (rlproxy renders and tokenizes every prompt itself)."""
    from proxy.engines.vllm import VLLMEngine

    tokenizer, stops = await asyncio.to_thread(policy_tokenizer, settings)
    path_map = None
    if settings.vllm.data_dir:
        path_map = (str(settings.data_dir.resolve()), settings.vllm.data_dir)
    engine = VLLMEngine(
        settings.vllm.urls,
        tokenizer,
        policy=settings.model_name,
        served_model=settings.vllm.model,
        path_map=path_map,
        timeout_s=settings.vllm.timeout_s,
        health_interval_s=settings.vllm.health_interval_s,
        affinity=settings.vllm.affinity,
        affinity_slack=settings.vllm.affinity_slack,
        stop_ids=stops,
        # vLLM must serve this model: RLPROXY_BASE_MODEL as given, the folder rlproxy reads.
        base_models=tuple(n for n in (settings.base_model, tokenizer.name_or_path) if n),
    )
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


def policy_tokenizer(settings: Settings) -> tuple[Any, list[int]]:
    """The served model's tokenizer (with its chat template) and stop ids, from the folder
    RLPROXY_BASE_MODEL resolves to (the embedded model's when unset); no weights are loaded."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer, GenerationConfig

    from proxy.engines.loader import resolve_model_dir, stop_token_ids

    folder = resolve_model_dir(settings.base_model, settings.model_dir or settings.data_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    try:
        generation = GenerationConfig.from_pretrained(str(folder))
    except OSError:  # no generation_config.json: EOS and <|im_start|> only
        generation = None
    stops = stop_token_ids(SimpleNamespace(generation_config=generation), tokenizer)  # type: ignore[arg-type]
    return tokenizer, sorted(stops)


@asynccontextmanager
async def local_engine(settings: Settings) -> AsyncIterator[Any]:
    """The embedded model on the local engine, started; stopped on exit."""
    from proxy.engines.loader import load_model
    from proxy.engines.local import LocalEngine

    loaded = await asyncio.to_thread(
        load_model, settings.model_dir or settings.data_dir, base_model=settings.base_model
    )
    engine = LocalEngine(
        loaded,
        max_batch_size=settings.max_batch_size,
        prefill_tokens=settings.prefill_tokens,
        prefix_cache_bytes=settings.prefix_cache_bytes,
        prefix_cache_ttl_s=settings.prefix_cache_ttl_s,
        serving_first=settings.serving_first,
        background_idle_s=settings.background_idle_s,
        background_max_wait_s=settings.background_max_wait_s,
        background_prefill_tokens=settings.background_prefill_tokens,
    )
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
    if settings.judge.model:
        key_env = settings.judge.api_key_env
        judge = LiteLLMJudge(
            settings.judge.model,
            api_base=settings.judge.api_base,
            api_key=os.environ.get(key_env) if key_env else None,
            timeout_s=settings.judge.timeout_s,
        )
        logger.info("RULER judge: %s", settings.judge.model)
    else:
        if judge_complete is None:
            raise ValueError("no judge model is configured and no local model to judge with")
        judge = LocalJudge(judge_complete, settings.model_name)
        logger.warning(
            "RULER judge: the local model (%s). A 135M judge is a placeholder for trying the "
            "loop out, not a useful judge: set RLPROXY_JUDGE_MODEL for real scores. It costs "
            "the serving engine's time (one or two calls a group, tens of seconds each on a "
            "2-core CPU), taken only while no user's request waits; once it fails its checks it "
            "judges one group every RLPROXY_JUDGE_RETRY_S",
            judge.model,
        )
    return Scorer(store, judge, settings.scoring_config())


NO_TRAINER = (
    "nothing uses the scores: this server runs no trainer (RLPROXY_TRAIN=false), no replica or "
    "`rlproxy train` trains on this database, and no telemetry receives scores. Start a trainer, "
    "run `rlproxy score`, or set RLPROXY_SCORING=true"
)


def scores_wanted(
    settings: Settings, store: Store, telemetry: Telemetry | None
) -> ScoresWanted | None:
    """Serving's test of whether judging helps anyone (None: always): RLPROXY_SCORING=true, a
    trainer here or a scores reader (Langfuse); else, with `auto`, a trainer elsewhere on the
    database (the trainer lease of a replica, or a running `rlproxy train`'s announcement)."""
    scores_read = telemetry is not None and telemetry.scores is not None
    if settings.judge.scoring is True or settings.trainer.enabled or scores_read:
        return None
    names = (trainer_lease_name(settings.model_name), trainer_presence_name(settings.model_name))

    async def why_not() -> str | None:
        now = time.time()
        for name in names:
            lease = await store.get_lease(name)
            if lease is not None and lease.expires_at > now:
                return None
        return NO_TRAINER

    return why_not


async def _serve(
    settings: Settings,
    store: Store,
    engine: Any,
    stack: AsyncExitStack,
    redact: Redactor,
    telemetry: Telemetry | None = None,
) -> Served:
    record = store.record_call if telemetry is None else telemetry.recorder(store.record_call)
    registry = ServedModels(
        policy=settings.model_name,
        aliases=tuple(settings.aliases),
        base_model=settings.base_model_name,
        patterns={"messages": tuple(settings.messages_model_patterns)},
    )
    replica_id = settings.replica_id or default_replica_id()
    # Heartbeats say which versions this replica keeps; a version is unloaded from a shared
    # engine (vLLM) only when no other live replica keeps it. One is written each poll: a
    # heartbeat counts as live for three polls (at least a lease), so one late poll is no death.
    stale_s = max(settings.lease_s, 3 * settings.adapter_poll_s)
    shared = SharedVersions(store, settings.model_name, replica_id, stale_s=stale_s)
    if settings.engine == "vllm":  # a vLLM server that rejoins keeps what others serve on it
        engine.needed_elsewhere = shared.adapters_needed_elsewhere
    adapters = AdapterManager(
        engine,
        registry,
        settings.checkpoints_dir,
        keep_previous=settings.keep_adapters,
        shared=shared if settings.engine == "vllm" else None,
    )
    chat = ChatService(
        engine,
        registry,
        engine.tokenizer,
        max_n=settings.limits.max_n,
        budget=BudgetRule(settings.output_budget, settings.resolved_default_max_tokens),
        record=record,
        shadow_samples=settings.groups.shadow_samples,
        shadow_turns=settings.groups.shadow_turns,
        limits=RequestLimits(**settings.limits.request_bounds()),
        max_queued_rows=settings.limits.max_queued_rows,
        tool_format=settings.tool_format,
        held_out=HeldOutSplit(settings.eval.share),
    )
    forgetting = forgetting_config(settings.forgetting)
    publisher = Publisher(
        adapters,
        store,
        rollout_config(settings.rollout, settings.reward_policy),
        replica_id=replica_id,
        lease_s=settings.lease_s,
        shared=shared,
        forgetting=None
        if forgetting is None
        else ForgettingCheck(engine, rendered_by(chat), forgetting),
        closeness=ClosenessCheck(engine, store),
    )
    served = Served(engine, registry, chat, adapters, publisher)
    if settings.publish_adapters:
        await served.publisher.check()  # a restart serves the newest good version
        stack.push_async_callback(served.publisher.leave)
    if settings.trainer.enabled:
        lease = LeaseKeeper(
            store, trainer_lease_name(settings.model_name), replica_id, settings.lease_s
        )
        served.trainer = TrainerProcess(settings, redact=redact, lease=lease)
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
        stack.push_async_callback(upstream.aclose)  # the direct path's pooled connections
        served.upstream = UpstreamChat(upstream, record=record)
        logger.info("upstream models: %s", ", ".join(settings.upstream_models))
    return served


def rendered_by(chat: ChatService) -> Render:
    """A conversation's prompt ids as the chat service renders them (the model's template)."""

    def render(messages: Sequence[Mapping[str, Any]]) -> list[int]:
        text = chat.template.render(messages, None)
        return list(chat.tokenizer.encode(text, add_special_tokens=False))

    return render


def _observe(settings: Settings, rt: Runtime, telemetry: Telemetry, served: Served) -> None:
    """Metrics read the serving parts at scrape time and hear every commit; scored groups reach
    telemetry (judge figures, Langfuse scores)."""
    sources = Sources(
        rt.store, served.engine, served.registry, served.adapters, served.publisher.forgetting
    )
    telemetry.metrics.watch(sources, cache_s=settings.telemetry.metrics_cache_s)
    rt.store.observe_commits(telemetry.metrics.observe_commit)
    if rt.scorer is not None:
        rt.scorer.on_scored = telemetry.group_scored


def _start_background(settings: Settings, rt: Runtime) -> None:
    rt.tasks.append(asyncio.create_task(close_idle_trajectories(rt.store, settings)))
    if rt.grouping is not None:  # whether scoring is on or not: grouping needs no judge
        rt.tasks.append(asyncio.create_task(rt.grouping.run(settings.judge.scoring_interval_s)))
    if settings.judge.scoring and rt.scorer is not None:
        rt.tasks.append(asyncio.create_task(rt.scorer.run(settings.judge.scoring_interval_s)))
    if settings.publish_adapters and rt.served is not None:
        rt.tasks.append(asyncio.create_task(rt.served.publisher.run(settings.adapter_poll_s)))
    if rt.served is not None:
        rt.background = watch_background(settings, rt, rt.served)
        rt.tasks.append(asyncio.create_task(rt.background.run()))


def watch_background(settings: Settings, rt: Runtime, served: Served) -> BackgroundWatch:
    trainer, scorer = served.trainer, rt.scorer if settings.judge.scoring else None
    # The local engine reports its background rows; an engine without any (vLLM) reports None.
    engine_background = getattr(served.engine, "background_health", lambda: None)
    return BackgroundWatch(
        engine_background=engine_background,
        trainer_pid=lambda: None if trainer is None else trainer.status().get("pid"),
        judge=lambda: None if scorer is None else scorer.status(),
    )


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
