"""The `local` engine: transformers + PEFT, fp32 on CPU (CUDA when present), dynamic batching.

One worker thread owns the model and runs a hand-written decode loop over a `DynamicCache`:
requests that arrive while others are decoding are prefilled, left-padded and merged into the
running batch between two steps, so concurrent requests share forward passes instead of queueing
behind each other; newcomers with the same prompt (a request's `n` choices, a group's runs of
one task) are prefilled once. Rows that finish leave the batch (`batch_select_indices`). Each
row carries its own sampling parameters, random generator, constraint (grammar) and LoRA
adapter; a batch that mixes adapters runs through PEFT's `adapter_names`.

A finished row's key/value tensors (prompt and generated tokens) stay in the prefix cache
(`prefix_cache.py`) under its adapter's identity, which changes on every load; a later prompt
that starts with the same tokens on the same loaded weights prefills only what follows (an
agent's next turn: its history, the answer it got, the new message).

Newcomers are admitted first come first served until the tokens they still have to run (after
their cached prefix) reach `prefill_tokens` (always at least one), so a burst of long new
prompts is prefilled a few at a time, the running rows taking a decode step between passes, and
the first to arrive is answered first. Admitted rows are prefilled in groups of similar length
still to run, each on top of its cached prefix; a long prompt with nothing cached runs alone,
so that its attention needs no mask and takes the causal kernel, and a cached prefix too short
to pay for the mask it needs is not used (`prefill_plan.py`). On CPU the model's attention
reads grouped-query heads in place (`attention.py`).

Adapter loads and unloads run on the worker thread between two steps. A request keeps the
adapter it started with: an unload waits until no request in flight (queued, decoding, or not yet
read to the end) uses it, then frees its weights. So does a teacher-forced pass
(`forced_logprobs`: the whole next-token distribution along a given answer, under the base and
loaded adapters, for the forgetting check): one short forward pass, nothing sampled or cached.

The engine knows nothing about chat messages, tools or HTTP: it takes token ids and returns
token ids, logprobs and text deltas.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import warnings
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from proxy.engines.attention import use_cpu_attention
from proxy.engines.base import (
    ChoiceFinished,
    EngineError,
    EngineEvent,
    EngineHealth,
    GenerationRequest,
    RequestInputError,
    TokenEvent,
)
from proxy.engines.kv_batch import ROOM, KVBatch, growing_cache
from proxy.engines.loader import LoadedModel
from proxy.engines.prefill_plan import prefill_costs, prefill_groups, worth_reusing
from proxy.engines.prefix_cache import Hit, KVSpan, PrefixCache, head_of
from proxy.engines.sampling import RowSampler
from proxy.engines.token_mask import (
    GrammarError,
    allocate_bitmask,
    apply_bitmask,
    build_tokenizer_info,
)

logger = logging.getLogger(__name__)

BASE_NAME = "__base__"  # PEFT's name for "no adapter" inside `adapter_names`
BASE_KEY: Hashable = ("base",)  # the prefix cache's key for the base model's KV


@dataclass
class _Job:
    """One generation request: its rows report to one asyncio queue."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[EngineEvent | BaseException]
    cancelled: bool = False
    rows_left: int = 0
    queued_at: float = field(default_factory=time.monotonic)
    promoted: bool = False  # background work that waited `background_max_wait_s`: runs as a user's
    whole: bool = False  # a background prompt the prefix cache cannot hold: prefilled in one pass

    @property
    def foreground(self) -> bool:
        """A user's request (or background work that waited too long): never paused."""
        return not self.request.background or self.promoted


@dataclass
class _Row:
    """One choice being decoded."""

    job: _Job
    index: int
    prompt_ids: list[int]
    sampler: RowSampler
    constraint: Any | None
    stop_token_ids: frozenset[int]
    cache_key: Hashable = BASE_KEY  # the identity of the weights that serve it (prefix cache)
    # The ids its (next) prefill runs: the prompt; for a paused row, prompt + generated so far.
    context: list[int] = field(default_factory=list)
    hit: Hit | None = None  # its prompt's cached prefix, from admission until its prefill
    # Its prompt's KV as the prefix cache stored it (the cache on), weakly: a row never keeps
    # KV the cache has let go, so the cache's byte bound holds while rows decode.
    prefix: tuple[weakref.ref[KVSpan], ...] = ()
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""  # visible text decoded so far (stop strings removed at the end)
    decoded: int = 0  # completion ids whose text is already in `text`
    emitted: int = 0  # characters of `text` already sent
    finish_reason: str | None = None
    stop_hit: str | None = None  # the stop string that ended the row, if one did

    @property
    def adapter(self) -> str | None:
        return self.job.request.adapter


@dataclass
class BackgroundFigures:
    """Background work (the local judge's requests) since the engine started."""

    pauses: int = 0
    """Rows taken out of the batch because a user's request arrived (resumed later)."""
    promoted: int = 0
    """Requests that waited `background_max_wait_s` and then ran beside users' requests."""
    chunks: int = 0
    """Prefill passes that ran one chunk of a long background prompt into the prefix cache."""
    tokens: int = 0
    """Tokens sampled for background rows."""
    busy_s: float = 0.0
    """Engine time spent on background rows (each pass's time, by their share of its rows)."""


@dataclass
class _Control:
    """A command for the worker thread (adapter load/unload), answered through a future."""

    action: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


class LocalEngine:
    """Dynamic-batching generation on the embedded model. Thread-safe async facade."""

    kind = "local"
    logprobs_after_grammar = False  # the sampler masks a copy; logprobs are the model's own

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_batch_size: int = 16,
        prefill_tokens: int = 2048,
        prefix_cache_bytes: int = 0,
        prefix_cache_ttl_s: float = 1800.0,
        serving_first: bool = True,
        background_idle_s: float = 0.5,
        background_max_wait_s: float = 600.0,
        background_prefill_tokens: int = 256,
    ) -> None:
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.base_model = loaded.model
        self.model: Any = loaded.model  # becomes a PeftModel on the first adapter load
        self.max_batch_size = max_batch_size
        self.prefill_tokens = max(1, prefill_tokens)
        use_cpu_attention(loaded.model)
        self._costs = prefill_costs(loaded.model)
        self.max_context = int(getattr(loaded.model.config, "max_position_embeddings", 2048))
        self.vocab_size = int(loaded.model.config.vocab_size)
        # The loader's stop ids (EOS, the generation config's, <|im_start|> for ChatML).
        self.stop_token_ids = loaded.stop_token_ids or frozenset({self.tokenizer.eos_token_id})
        self._adapters: dict[str, str] = {}  # name -> path
        # Each load's serial number: the prefix cache keys KV by it, never by the name alone,
        # so weights loaded again under a name never meet the KV of the ones they replaced.
        self._adapter_loads: dict[str, int] = {}
        self._loads = 0
        self.prefix_cache = PrefixCache(max(0, prefix_cache_bytes), prefix_cache_ttl_s)
        # Full-attention layers only (a sliding window's cache is cut and rolled): their KV can
        # be cached and shared, and decode steps append into spare room (`GrowingLayer`).
        self.plain_layers = _plain_cache_layers(loaded.model.config)
        if prefix_cache_bytes > 0 and not self.plain_layers:
            logger.warning("prefix cache off: the model's cache layers are not all DynamicLayer")
            self.prefix_cache.max_bytes = 0
        self._pending_unload: set[str] = set()
        # Requests in flight per adapter (from `generate` until its stream closes), and the lock
        # that keeps that count and `_adapters` consistent between the loop and the worker.
        self._in_use: Counter[str] = Counter()
        self._adapter_lock = threading.Lock()
        self._inbox: queue.Queue[_Job | _Control | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._waiting: list[_Job] = []
        # Rows of the jobs in the inbox and in `_waiting`: counted by `generate` on the event
        # loop, discounted by the worker when a job leaves `_waiting` (started, failed, dropped).
        self._queued = 0
        self._queued_lock = threading.Lock()
        self._rows: list[_Row] = []
        self._batch: KVBatch | None = None  # cache and mask of `_rows`, in the same order
        self._grammar_info: Any | None = None  # llguidance's tokenizer view, built on first use
        self.steps = 0
        self.tokens = 0  # tokens sampled, every row and request (for tokens/s)
        self.prefill_rows_shared = 0  # rows whose prompt another row of their prefill ran
        # Background work (requests marked `background`: the local judge) gives way to users'.
        self.serving_first = serving_first
        self.background_idle_s = background_idle_s
        self.background_max_wait_s = background_max_wait_s
        self.background_prefill_tokens = max(1, background_prefill_tokens)
        self._paused: list[_Row] = []  # background rows taken out of the batch for a user's
        self._last_foreground = 0.0  # monotonic time a user's request last ran or waited
        self.background = BackgroundFigures()
        self.last_error: str | None = None

    # ----------------------------------------------------------------- async facade

    async def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rlproxy-engine", daemon=True)
            self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._inbox.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None

    def health(self) -> EngineHealth:
        alive = self._thread is not None and self._thread.is_alive()
        return EngineHealth(
            ok=alive,
            detail={
                "running_rows": len(self._rows),
                "waiting_requests": len(self._waiting) + self._inbox.qsize(),
                "queued_rows": self._queued,
                "steps": self.steps,
                "tokens": self.tokens,
                "prefill_rows_shared": self.prefill_rows_shared,
                # Prompt tokens looked up and found (the names the vllm engine reports too).
                "prefix_cache_query_tokens": self.prefix_cache.stats.prompt_tokens,
                "prefix_cache_hit_tokens": self.prefix_cache.stats.hit_tokens,
                "prefix_cache": self.prefix_cache.health(),
                "background": self.background_health(),
                "adapters": sorted(self._adapters),
                "device": str(self.device),
                "last_error": self.last_error,
            },
        )

    def queued_rows(self) -> int:
        return self._queued

    def background_health(self) -> dict[str, Any]:
        """Background work now (rows running, paused, requests waiting) and since the start."""
        return {
            "serving_first": self.serving_first,
            "running_rows": sum(1 for row in self._rows if row.job.request.background),
            "paused_rows": len(self._paused),
            "waiting_requests": sum(1 for job in list(self._waiting) if job.request.background),
            **asdict(self.background),
        }

    def _count_queued(self, job: _Job, sign: int) -> None:
        """Count (+1) or discount (-1) `job`'s rows as queued; background work is not counted:
        users' requests are never refused (`max_queued_rows`) for judge work parked here."""
        if job.request.background:
            return
        with self._queued_lock:
            self._queued += sign * job.request.n

    async def generate(self, request: GenerationRequest) -> AsyncIterator[EngineEvent]:
        adapter = request.adapter
        if adapter is not None:
            with self._adapter_lock:
                if adapter not in self._adapters or adapter in self._pending_unload:
                    raise EngineError(f"adapter {adapter!r} is not loaded")
                self._in_use[adapter] += 1
        loop = asyncio.get_running_loop()
        job = _Job(request=request, loop=loop, events=asyncio.Queue(), rows_left=request.n)
        self._count_queued(job, +1)
        self._inbox.put(job)
        try:
            while job.rows_left > 0:
                event = await job.events.get()
                if isinstance(event, BaseException):
                    raise event
                if isinstance(event, ChoiceFinished):
                    job.rows_left -= 1
                yield event
        finally:
            # Closing the stream early (client gone, task cancelled) stops its rows.
            job.cancelled = True
            if adapter is not None:
                with self._adapter_lock:
                    self._in_use[adapter] -= 1
                    if self._in_use[adapter] <= 0:
                        del self._in_use[adapter]

    async def load_adapter(self, name: str, path: str) -> None:
        await self._control(lambda: self._load_adapter(name, path))

    async def unload_adapter(self, name: str) -> None:
        await self._control(lambda: self._unload_adapter(name))

    async def forced_logprobs(
        self, prompt_ids: list[int], answer_ids: list[int], adapters: Sequence[str | None]
    ) -> torch.Tensor:
        """`TeacherForcing`: the log-distribution each of `adapters` (None: the base model)
        gives at each position of `answer_ids` after `prompt_ids`, (A, T, V) float32 on the
        CPU. One forward pass of A rows on the worker thread, between two decode steps."""
        names = list(adapters)
        return await self._control(lambda: self._forced_logprobs(prompt_ids, answer_ids, names))

    async def _control(self, action: Callable[[], Any]) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._inbox.put(_Control(action=action, loop=loop, future=future))
        return await future

    # ----------------------------------------------------------------- worker thread

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stopping:
            try:
                self._drain_inbox(wait=self._idle_wait())
                self._unload_unused()
                if self._users_present():
                    self._last_foreground = time.monotonic()
                self._give_way()
                self._admit()
                if self._rows:
                    self._step()
            except Exception as exc:  # keep serving: fail the running jobs, reset the batch
                logger.exception("engine step failed; failing %d running rows", len(self._rows))
                self.last_error = repr(exc)
                self._fail_all(EngineError(f"generation failed: {exc}"))

    def _drain_inbox(self, *, wait: float | None) -> None:
        """Move what arrived into `_waiting` (controls run at once); wait up to `wait` seconds
        for the first item (None: do not wait)."""
        while True:
            try:
                item = self._inbox.get(block=wait is not None, timeout=wait)
            except queue.Empty:
                return
            wait = None
            if item is None:
                return
            if isinstance(item, _Control):
                self._run_control(item)
            else:
                self._waiting.append(item)

    def _run_control(self, control: _Control) -> None:
        try:
            result = control.action()
        except Exception as exc:
            control.loop.call_soon_threadsafe(_set_exception, control.future, exc)
        else:
            control.loop.call_soon_threadsafe(_set_result, control.future, result)

    def _load_adapter(self, name: str, path: str) -> None:
        from peft import PeftModel

        with self._adapter_lock:
            if name in self._adapters:  # asked for again before a pending unload happened
                self._pending_unload.discard(name)
                return
        start = time.perf_counter()
        if self.model is self.base_model:
            self.model = PeftModel.from_pretrained(
                self.base_model, path, adapter_name=name, is_trainable=False
            )
        else:
            self.model.load_adapter(path, adapter_name=name, is_trainable=False)
        self.model.eval()
        self._loads += 1
        self._adapter_loads[name] = self._loads
        with self._adapter_lock:
            self._adapters[name] = path
        logger.info("adapter %s loaded from %s in %.3f s", name, path, time.perf_counter() - start)

    def _unload_adapter(self, name: str) -> None:
        with self._adapter_lock:
            if name not in self._adapters:
                raise KeyError(f"adapter {name!r} is not loaded")
            self._pending_unload.add(name)  # no new request may start on it from now on
        self._unload_unused()

    def _unload_unused(self) -> None:
        """Free the adapters waiting to be unloaded that no request uses any more."""
        for name in list(self._pending_unload):
            with self._adapter_lock:
                busy = self._in_use.get(name, 0) > 0
            # A request whose stream closed early still has rows in the batch until the next
            # step retires them as cancelled.
            rows = [*self._rows, *self._paused]
            if not busy and not any(row.adapter == name for row in rows):
                self._delete_adapter(name)

    def _delete_adapter(self, name: str) -> None:
        self.prefix_cache.drop(self._cache_key(name))
        self._adapter_loads.pop(name, None)
        with self._adapter_lock:
            self._adapters.pop(name, None)
            self._pending_unload.discard(name)
        if not self._adapters:
            # PEFT refuses to delete the last adapter; drop the wrapper instead.
            self.model = self.base_model = self.model.unload()
        else:
            with warnings.catch_warnings():
                # PEFT then names another adapter "active"; rows name theirs in `adapter_names`.
                warnings.simplefilter("ignore", UserWarning)
                self.model.delete_adapter(name)
        logger.info("adapter %s unloaded", name)

    def _forced_logprobs(
        self, prompt_ids: list[int], answer_ids: list[int], adapters: list[str | None]
    ) -> torch.Tensor:
        if not prompt_ids or not answer_ids or not adapters:
            raise ValueError("teacher forcing needs a prompt, an answer and at least one adapter")
        with self._adapter_lock:
            missing = [
                a
                for a in adapters
                if a is not None and (a not in self._adapters or a in self._pending_unload)
            ]
        if missing:
            raise EngineError(f"adapter {missing[0]!r} is not loaded")
        # (A, P + T - 1): the answer's last token is predicted, never fed
        ids = torch.tensor([prompt_ids + answer_ids[:-1]] * len(adapters), dtype=torch.long)
        names = [a or BASE_NAME for a in adapters]
        kwargs = {} if self.model is self.base_model else {"adapter_names": names}
        out = self.model(
            input_ids=ids.to(self.device),
            use_cache=False,
            logits_to_keep=len(answer_ids),  # positions P-1 .. P+T-2 predict the T answer tokens
            **kwargs,
        )
        return torch.log_softmax(out.logits.float(), dim=-1).cpu()  # (A, T, V)

    # ----------------------------------------------------------------- users first

    def _foreground_waiting(self) -> bool:
        """Whether work that runs now waits: a user's request, or promoted background work."""
        return any(job.foreground for job in self._waiting)

    def _users_waiting(self) -> bool:
        return any(not job.request.background for job in self._waiting)

    def _users_present(self) -> bool:
        """Whether a user's request runs or waits (promoted background work is not a user)."""
        return self._users_waiting() or any(not row.job.request.background for row in self._rows)

    def _background_pending(self) -> bool:
        return bool(self._paused) or any(job.request.background for job in self._waiting)

    def _background_turn(self, now: float) -> bool:
        """Whether background work may run now: no user's request runs or waits, and none has
        for `background_idle_s` (an agent's next call usually follows within that)."""
        if not self.serving_first:
            return True
        if self._users_present():
            return False
        return now - self._last_foreground >= self.background_idle_s

    def _idle_wait(self) -> float | None:
        """How long the worker may wait for the inbox: not at all while there is work it can
        do now; until background work's turn comes; else half a second."""
        if self._rows or self._foreground_waiting():
            return None
        if not self._background_pending():
            return 0.5
        now = time.monotonic()
        if self._background_turn(now) or self._overdue(now):
            return None
        return max(0.01, min(0.5, self._last_foreground + self.background_idle_s - now))

    def _overdue(self, now: float) -> bool:
        jobs = [*self._waiting, *(row.job for row in self._paused)]
        return any(not j.foreground and self._waited_too_long(j, now) for j in jobs)

    def _waited_too_long(self, job: _Job, now: float) -> bool:
        return self.serving_first and now - job.queued_at >= self.background_max_wait_s

    def _promote_overdue(self, now: float) -> None:
        """Background work that waited `background_max_wait_s` runs as a user's would: under
        endless traffic the judge still gets a bounded share."""
        jobs = {id(j): j for j in [*self._waiting, *(row.job for row in self._paused)]}
        for job in jobs.values():
            if not job.foreground and self._waited_too_long(job, now):
                job.promoted = True
                self.background.promoted += 1
                logger.info(
                    "background request %s waited %.0f s: it runs beside users' requests now",
                    job.request.request_id,
                    now - job.queued_at,
                )

    def _give_way(self) -> None:
        """A user's request waits: take the background rows out of the batch. Their KV so far
        goes to the prefix cache, so resuming them later prefills only a token or so. With the
        prefix cache off, running background rows finish (pausing would throw their KV away);
        only new background work waits."""
        if not self.serving_first or not self._users_waiting():
            return
        if not self.prefix_cache.enabled:
            return  # their KV would be lost and recomputed whole: new work waits, theirs runs
        positions = [i for i, row in enumerate(self._rows) if not row.job.foreground]
        if not positions:
            return
        paused = self._leave_batch(positions)
        for row in paused:
            row.context = row.prompt_ids + row.completion_ids
            row.prefix = ()
        self._paused.extend(paused)
        self.background.pauses += len(paused)

    def _drop_paused_if_cancelled(self, row: _Row) -> bool:
        if row.job.cancelled:
            row.finish_reason = "cancelled"
            _post(row.job, [self._finished(row)])
        return row.job.cancelled

    def _chunked(self, job: _Job, key: Hashable, ids: list[int]) -> bool:
        """For background work with more than `background_prefill_tokens` of `ids` to prefill:
        prefill the next chunk into the prefix cache and return True (it is admitted once the
        rest fits in one chunk), so that a user's request never waits behind a long background
        prefill. False: nothing to do, admit it (or the prefix cache is off: no chunks)."""
        if job.foreground or job.whole or not self.serving_first or not self.prefix_cache.enabled:
            return False
        hit = self.prefix_cache.lookup(key, ids)
        done = hit.length if hit else 0
        if len(ids) - done <= self.background_prefill_tokens:
            return False
        chunk = ids[: done + self.background_prefill_tokens]
        row = _Row(
            job=job,
            index=0,
            prompt_ids=chunk,
            sampler=RowSampler(job.request.params, seed=None, device=self.device),
            constraint=None,
            stop_token_ids=self.stop_token_ids,
            cache_key=key,
            context=chunk,
        )
        started = time.perf_counter()
        self._prefill_group([row], [hit])
        self.background.chunks += 1
        self.background.busy_s += time.perf_counter() - started
        held = self.prefix_cache.lookup(key, ids)
        if held is None or held.length < len(chunk) - 1:
            # The cache could not keep it (the prompt's KV passes its bound): one whole prefill.
            job.whole = True
            logger.info(
                "background request %s: its prompt's KV does not stay in the prefix cache; "
                "it is prefilled whole",
                job.request.request_id,
            )
        return True

    # ----------------------------------------------------------------- batching

    def _admit(self) -> None:
        """Prefill waiting requests, first come first served, while they fit the batch and the
        pass's token budget, and merge them into the running batch. Users' requests go first:
        background work (paused rows, then requests) only on its turn (`_background_turn`)."""
        now = time.monotonic()
        self._waiting = [job for job in self._waiting if not self._drop_if_cancelled(job)]
        self._paused = [row for row in self._paused if not self._drop_paused_if_cancelled(row)]
        self._promote_overdue(now)
        turn = self._background_turn(now)
        new_rows: list[_Row] = []
        budget = self.prefill_tokens
        # Each prompt (and weights) admitted this pass, with its cached prefix: the prefill runs
        # it once however many rows ask, so it is looked up and paid for once.
        hits: dict[tuple[tuple[int, ...], Hashable], Hit | None] = {}
        if not self.serving_first:  # one queue, first come first served
            self._admit_jobs(list(self._waiting), new_rows, hits, budget)
        elif not turn:  # users' requests; paused rows of promoted work resume beside them
            self._admit_jobs([j for j in self._waiting if j.foreground], new_rows, hits, budget)
            for row in [r for r in self._paused if r.job.foreground]:
                if self._batch_full(new_rows, 1):
                    break
                self._paused.remove(row)
                row.hit = self._usable_hit(row.cache_key, row.context)
                new_rows.append(row)
        else:  # background work's turn: paused rows first (they came first), then requests
            for row in list(self._paused):
                if self._batch_full(new_rows, 1):
                    break
                if self._chunked(row.job, row.cache_key, row.context):
                    break
                hit = self._usable_hit(row.cache_key, row.context)
                cost = len(row.context) - (hit.length if hit else 0)
                if new_rows and cost > budget:
                    break
                self._paused.remove(row)
                budget -= cost
                row.hit = hit
                new_rows.append(row)
            else:
                self._admit_jobs(list(self._waiting), new_rows, hits, budget, chunked=True)
        if not new_rows:
            return
        started = time.perf_counter()
        try:
            logits, batch = self._prefill(new_rows)
            if self._batch is None:
                self._batch = batch
            else:
                self._batch.stack(batch, max_rows=self.max_batch_size)
        except Exception as exc:  # the rows admitted this pass are in no list `_fail_all` reads
            for job in {id(row.job): row.job for row in new_rows}.values():
                _fail(job, EngineError(f"generation failed: {exc}"))
            raise
        self._rows.extend(new_rows)
        self._sample_and_emit(new_rows, logits)
        self._count_background(new_rows, time.perf_counter() - started)

    def _batch_full(self, new_rows: list[_Row], n: int) -> bool:
        """Whether `n` more rows would pass the batch size (one request always fits alone)."""
        running = len(self._rows) + len(new_rows)
        return running + n > self.max_batch_size and running > 0

    def _admit_jobs(
        self,
        jobs: list[_Job],
        new_rows: list[_Row],
        hits: dict[tuple[tuple[int, ...], Hashable], Hit | None],
        budget: int,
        *,
        chunked: bool = False,
    ) -> None:
        """Admit `jobs` in order until the batch or the pass's token budget is full; with
        `chunked`, a long background prompt first runs into the prefix cache chunk by chunk."""
        for job in jobs:
            if self._batch_full(new_rows, job.request.n):
                return
            if chunked:
                key = self._cache_key(job.request.adapter)
                if self._chunked(job, key, job.request.prompt_ids):
                    return
            budget, taken = self._admit_job(job, new_rows, hits, budget)
            if not taken:
                return

    def _admit_job(
        self,
        job: _Job,
        new_rows: list[_Row],
        hits: dict[tuple[tuple[int, ...], Hashable], Hit | None],
        budget: int,
    ) -> tuple[int, bool]:
        """Take `job` out of `_waiting` into `new_rows` if its prefill fits what is left of the
        pass's token budget; returns the budget left and whether it was taken (or failed)."""
        key = (tuple(job.request.prompt_ids), self._cache_key(job.request.adapter))
        seen = key in hits
        hit = hits[key] if seen else self._usable_hit(key[1], job.request.prompt_ids)
        cost = 0 if seen else len(job.request.prompt_ids) - (hit.length if hit else 0)
        if new_rows and cost > budget:
            return budget, False
        self._waiting.remove(job)
        self._count_queued(job, -1)
        try:
            rows = self._rows_for(job)
        except Exception as exc:  # this request's own parameters or grammar: it fails alone
            logger.exception("request %s could not start", job.request.request_id)
            _fail(job, _failure("generation could not start", exc))
            return budget, True
        hits[key] = hit
        for row in rows:
            row.hit = hit
        new_rows.extend(rows)
        return budget - cost, True

    def _count_background(self, rows: list[_Row], seconds: float) -> None:
        """Charge background work its share of a pass over `rows` that took `seconds`."""
        background = sum(1 for row in rows if row.job.request.background)
        if background:
            self.background.busy_s += seconds * background / len(rows)

    def _usable_hit(self, key: Hashable, prompt_ids: list[int]) -> Hit | None:
        """The prompt's cached prefix, unless prefilling on top of it costs more than the
        whole prompt (`worth_reusing`)."""
        hit = self.prefix_cache.lookup(key, prompt_ids)
        if hit and not worth_reusing(hit.length, len(prompt_ids), *self._costs):
            return None
        return hit

    def _drop_if_cancelled(self, job: _Job) -> bool:
        if job.cancelled:
            self._count_queued(job, -1)
            prompt = list(job.request.prompt_ids)
            adapter = job.request.adapter
            _post(
                job,
                [
                    ChoiceFinished(i, "cancelled", prompt, [], [], "", adapter)
                    for i in range(job.request.n)
                ],
            )
        return job.cancelled

    def _rows_for(self, job: _Job) -> list[_Row]:
        req = job.request
        rows = []
        for i in range(req.n):
            seed = None if req.params.seed is None else req.params.seed + i
            prompt = list(req.prompt_ids)
            rows.append(
                _Row(
                    job=job,
                    index=i,
                    prompt_ids=prompt,
                    context=prompt,
                    sampler=RowSampler(req.params, seed=seed, device=self.device),
                    constraint=self._new_constraint(req.grammar),
                    stop_token_ids=self.stop_token_ids,
                    cache_key=self._cache_key(req.adapter),
                )
            )
        return rows

    def _new_constraint(self, compiled: Any | None) -> Any | None:
        if compiled is None:
            return None
        if self._grammar_info is None:
            self._grammar_info = build_tokenizer_info(self.tokenizer, n_vocab=self.vocab_size)
        return compiled.new_row(self._grammar_info)

    def _cache_key(self, adapter: str | None) -> Hashable:
        """The prefix cache's key for the weights serving `adapter`: its name and load serial."""
        if adapter is None:
            return BASE_KEY
        return (adapter, self._adapter_loads.get(adapter))

    def _adapter_names(self, rows: list[_Row]) -> dict[str, Any]:
        if self.model is self.base_model:
            return {}
        return {"adapter_names": [row.adapter or BASE_NAME for row in rows]}

    def _prefill(self, rows: list[_Row]) -> tuple[torch.Tensor, KVBatch]:
        """Run the prompts of newcomers, on top of their cached prefixes. Returns last-position
        logits (B, V) and the rows' cache, in the order of `rows`.

        Rows with the same prompt and weights (a request's `n` choices; the runs of one task
        that a group practises at once) run once: their cache rows and logits are copies."""
        run: list[_Row] = []  # the rows the model runs: the first of each prompt and weights
        seen: dict[tuple[tuple[int, ...], Hashable], int] = {}
        inverse = []  # each row's index in `run`
        for row in rows:
            key = (tuple(row.context), row.cache_key)
            if key not in seen:
                seen[key] = len(run)
                run.append(row)
            inverse.append(seen[key])
        hits = [row.hit for row in run]
        to_run = [
            len(row.context) - (hit.length if hit else 0)
            for row, hit in zip(run, hits, strict=True)
        ]
        order: list[int] = []  # run indices in the order the groups' outputs are stacked
        logits_parts: list[torch.Tensor] = []
        batch: KVBatch | None = None
        for group in prefill_groups(to_run, cached=[hit is not None for hit in hits]):
            logits, part = self._prefill_group([run[i] for i in group], [hits[i] for i in group])
            order.extend(group)
            logits_parts.append(logits)
            if batch is None:
                batch = part
            else:
                batch.stack(part)
        assert batch is not None
        logits = torch.cat(logits_parts)
        self.prefill_rows_shared += len(rows) - len(run)
        at = {run_index: position for position, run_index in enumerate(order)}
        select = [at[i] for i in inverse]
        if select != list(range(len(order))):
            index = torch.tensor(select, dtype=torch.long, device=self.device)
            batch.cache.batch_select_indices(index)
            batch.mask, logits = batch.mask[index], logits[index]
        for row, i in zip(rows, inverse, strict=True):
            row.prefix, row.hit = run[i].prefix, None
        return logits, batch

    def _prefill_group(
        self, run: list[_Row], hits: list[Hit | None]
    ) -> tuple[torch.Tensor, KVBatch]:
        """One forward pass over rows whose tokens still to run have similar lengths.

        Every row runs its last S tokens (S: the most any row of the group has left to run);
        what comes before them is read from its cache hit, left-padded to the longest. A row
        with fewer than S tokens left to run recomputes a few cached ones; a row shorter than S
        is left-padded. The real positions of every row stay contiguous on the right."""
        lengths = [len(row.context) for row in run]
        cached = [hit.length if hit else 0 for hit in hits]
        width = max(n - c for n, c in zip(lengths, cached, strict=True))  # S
        past = [max(0, n - width) for n in lengths]  # cached positions each row reads
        past_width = max(past)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(run), width), pad, dtype=torch.long)
        mask = torch.zeros((len(run), past_width + width), dtype=torch.long)
        for b, row in enumerate(run):
            fresh = row.context[past[b] :]
            ids[b, width - len(fresh) :] = torch.tensor(fresh, dtype=torch.long)
            mask[b, past_width + width - lengths[b] :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, past_width:]
        cache = self._empty_cache()
        if past_width:
            _fill_cache(
                cache,
                [head_of(hit.spans, p) if hit else () for hit, p in zip(hits, past, strict=True)],
                past_width,
                room=width + ROOM,
            )
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **self._adapter_names(run),
        )
        stats = self.prefix_cache.stats
        stats.prompt_tokens += sum(lengths)
        stats.hit_tokens += sum(past)
        batch = KVBatch(out.past_key_values, mask)
        if self.prefix_cache.enabled:
            total = past_width + width
            for b, (row, hit) in enumerate(zip(run, hits, strict=True)):
                first = total - lengths[b] + past[b]  # the first column this pass computed
                fresh_span = KVSpan.copy_of(
                    [layer.keys[b : b + 1, :, first:] for layer in batch.cache.layers],
                    [layer.values[b : b + 1, :, first:] for layer in batch.cache.layers],
                )
                reused = head_of(hit.spans, past[b]) if hit else ()
                spans = (*(span.detached() for span in reused), fresh_span)
                self.prefix_cache.insert(row.cache_key, row.context, spans)
                row.prefix = tuple(weakref.ref(span) for span in spans)
        return out.logits[:, -1, :].float(), batch

    def _empty_cache(self) -> DynamicCache:
        config = self.base_model.config
        return growing_cache(config) if self.plain_layers else DynamicCache(config=config)

    def _step(self) -> None:
        """One decode step for every running row: feed its last sampled token."""
        assert self._batch is not None
        started = time.perf_counter()
        rows = list(self._rows)
        ids = torch.tensor([[row.completion_ids[-1]] for row in self._rows], dtype=torch.long)
        positions = self._batch.grow()
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=self._batch.mask,
            position_ids=positions,
            past_key_values=self._batch.cache,
            use_cache=True,
            **self._adapter_names(self._rows),
        )
        self._batch.cache = out.past_key_values
        self.steps += 1
        self._sample_and_emit(self._rows, out.logits[:, -1, :].float())
        self._count_background(rows, time.perf_counter() - started)

    def _sample_and_emit(self, rows: list[_Row], logits: torch.Tensor) -> None:
        """Sample one token per row from `logits` (B, V), emit events, retire finished rows."""
        logprobs_all = torch.log_softmax(logits, dim=-1)  # raw policy logprobs, (B, V)
        failed: dict[int, BaseException] = {}  # id(job) -> why: a failing row fails its job only
        constrained = [b for b, row in enumerate(rows) if row.constraint is not None]
        if constrained:
            info: Any = self._grammar_info  # built by _new_constraint for these rows
            bitmask = allocate_bitmask(len(rows), info)
            for b in constrained:
                constraint: Any = rows[b].constraint
                try:
                    constraint.fill_bitmask(bitmask, b)
                except Exception as exc:
                    failed.setdefault(id(rows[b].job), exc)
            logits = logits.clone()
            apply_bitmask(logits, bitmask, rows=constrained)
        by_job: dict[int, tuple[_Job, list[EngineEvent]]] = {}
        for b, row in enumerate(rows):
            events = by_job.setdefault(id(row.job), (row.job, []))[1]
            if row.job.cancelled:
                row.finish_reason = "cancelled"
                events.append(self._finished(row))
                continue
            if id(row.job) in failed:
                row.finish_reason = "error"
                continue
            try:
                events.extend(self._advance_row(row, b, logits, logprobs_all))
            except Exception as exc:
                failed.setdefault(id(row.job), exc)
                row.finish_reason = "error"
        for job, events in by_job.values():
            if id(job) in failed:
                why = failed[id(job)]
                logger.error("request %s failed alone: %r", job.request.request_id, why)
                job.cancelled = True  # its other rows leave the batch at the next step
                _fail(job, _failure("generation failed", why))
            else:
                _post(job, events)
        self._retire([b for b, row in enumerate(rows) if row.finish_reason is not None], rows)

    def _advance_row(
        self, row: _Row, b: int, logits: torch.Tensor, logprobs_all: torch.Tensor
    ) -> list[EngineEvent]:
        """Sample row `b`'s next token from `logits` (B, V); return its events."""
        token = row.sampler.sample(logits[b], row.completion_ids)
        self.tokens += 1
        if row.job.request.background:
            self.background.tokens += 1
        logprob = float(logprobs_all[b, token])
        row.completion_ids.append(token)
        row.logprobs.append(logprob)
        top: tuple[tuple[int, float], ...] = ()
        if row.sampler.params.top_logprobs:
            values, indices = logprobs_all[b].topk(row.sampler.params.top_logprobs)
            top = tuple(zip(indices.tolist(), values.tolist(), strict=True))
        if row.constraint is not None:
            row.constraint.consume(token)
        delta = self._advance_text(row, token)
        events: list[EngineEvent] = [TokenEvent(row.index, token, logprob, delta, top)]
        if row.finish_reason is not None:
            events.append(self._finished(row))
        return events

    def _advance_text(self, row: _Row, token: int) -> str:
        """Update the row's text and finish state after `token`; return the newly visible text."""
        params = row.sampler.params
        grammar_done = row.constraint is not None and row.constraint.is_stopped()
        if token in row.stop_token_ids or grammar_done:
            row.finish_reason = "stop"
        elif len(row.completion_ids) >= params.max_tokens:
            row.finish_reason = "length"  # (a stop string found below still wins)
        # Decode only the ids not yet in `text` (byte-level BPE: pieces concatenate exactly),
        # unless they end inside a UTF-8 sequence: then wait for the next token's bytes (or, if
        # the row ends here, drop the incomplete character).
        piece = str(
            self.tokenizer.decode(row.completion_ids[row.decoded :], skip_special_tokens=True)
        )
        if row.finish_reason is not None:
            piece = piece.rstrip("\ufffd")
        if not piece.endswith("\ufffd"):
            row.text += piece
            row.decoded = len(row.completion_ids)
        text = row.text
        for stop in params.stop:
            at = text.find(stop, max(0, row.emitted - len(stop)))
            if at != -1:
                row.text = text[:at]
                row.finish_reason = "stop"
                row.stop_hit = stop
        visible = len(row.text)
        if row.finish_reason is None:
            visible -= _held_back(row.text, params.stop)
        if visible <= row.emitted:
            return ""
        delta = row.text[row.emitted : visible]
        row.emitted = visible
        return delta

    def _finished(self, row: _Row) -> ChoiceFinished:
        return ChoiceFinished(
            index=row.index,
            finish_reason=row.finish_reason or "stop",
            prompt_token_ids=row.prompt_ids,
            completion_token_ids=list(row.completion_ids),
            completion_logprobs=list(row.logprobs),
            text=row.text,
            adapter=row.adapter,
            stop=row.stop_hit,
        )

    def _retire(self, finished: list[int], rows: list[_Row]) -> None:
        """Drop finished rows from the running batch (and their cache rows), keeping their KV
        in the prefix cache."""
        if not finished:
            return
        done = {id(rows[b]) for b in finished}
        positions = [i for i, row in enumerate(self._rows) if id(row) in done]
        if not positions:
            return
        self._leave_batch(positions)
        self._unload_unused()

    def _leave_batch(self, positions: list[int]) -> list[_Row]:
        """Take the rows at `positions` out of the running batch (and their cache rows), their
        KV kept in the prefix cache (finished rows, and paused ones to resume from); return
        them."""
        if self.prefix_cache.enabled:
            self._cache_rows(positions)
        leaving = set(positions)
        gone = [self._rows[i] for i in positions]
        keep = [i for i in range(len(self._rows)) if i not in leaving]
        if not keep:
            self._rows, self._batch = [], None
        else:
            assert self._batch is not None
            order = self._batch.keep(keep)
            self._rows = [self._rows[i] for i in order]
        return gone

    def _cache_rows(self, positions: list[int]) -> None:
        """Store the KV of the batch rows at `positions` (prompt and generated tokens)."""
        assert self._batch is not None
        mask, layers = self._batch.mask, self._batch.cache.layers
        width = int(mask.shape[1])
        for i in positions:
            row = self._rows[i]
            if row.finish_reason == "error" or not row.prefix:
                continue
            if row.cache_key != self._cache_key(row.adapter):
                continue  # its weights were unloaded meanwhile (cannot happen while it runs)
            real = int(mask[i].sum())  # prompt + generated tokens fed (not the last sampled)
            start = width - real + len(row.context)  # the first column its prefill did not run
            if start >= width:
                continue  # nothing generated was fed: the prefill stored the prompt already
            held = [ref() for ref in row.prefix]
            prefix = [span for span in held if span is not None]
            if len(prefix) < len(held):  # evicted while it decoded: copy the whole row
                prefix, start = [], width - real
            tail = KVSpan.copy_of(
                [layer.keys[i : i + 1, :, start:] for layer in layers],
                [layer.values[i : i + 1, :, start:] for layer in layers],
            )
            ids = (row.prompt_ids + row.completion_ids)[:real]
            self.prefix_cache.insert(row.cache_key, ids, (*prefix, tail))

    def _fail_all(self, error: BaseException) -> None:
        jobs = {id(r.job): r.job for r in [*self._rows, *self._paused]}
        jobs.update({id(j): j for j in self._waiting})
        for job in self._waiting:
            self._count_queued(job, -1)
        for job in jobs.values():
            _fail(job, error)
        self._rows, self._waiting, self._batch, self._paused = [], [], None, []


def _fill_cache(
    cache: DynamicCache, pasts: list[tuple[KVSpan, ...]], width: int, room: int
) -> None:
    """Put each row's cached KV (a chain of spans, maybe none) into an empty cache of
    `GrowingLayer`s, right-aligned in `width` positions (zeros on the left), with `room` spare
    positions after them for the pass that follows: one copy of the cached tensors."""
    sample = next(spans for spans in pasts if spans)[0].keys[0]  # (1, H, T, D)
    shape = (len(pasts), sample.shape[1], width + room, sample.shape[3])
    lengths = [sum(span.length for span in spans) for spans in pasts]
    padded = any(n < width for n in lengths)
    layer: Any
    for index, layer in enumerate(cache.layers):
        keys = sample.new_zeros(shape) if padded else sample.new_empty(shape)
        values = sample.new_zeros(shape) if padded else sample.new_empty(shape)
        for b, spans in enumerate(pasts):
            at = width - lengths[b]
            for span in spans:
                keys[b, :, at : at + span.length] = span.keys[index][0]
                values[b, :, at : at + span.length] = span.values[index][0]
                at += span.length
        layer.adopt(keys, values, width)


def _plain_cache_layers(config: Any) -> bool:
    """Whether the model's DynamicCache layers are all full-attention `DynamicLayer`s (their
    tensors only grow, so cached spans can be shared; a sliding window's are cut and rolled)."""
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=config).layers)


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters might be the start of a stop string (not yet visible)."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                longest = max(longest, k)
                break
    return longest


def _fail(job: _Job, error: BaseException) -> None:
    job.loop.call_soon_threadsafe(job.events.put_nowait, error)


def _post(job: _Job, events: list[EngineEvent]) -> None:
    def deliver() -> None:
        for event in events:
            job.events.put_nowait(event)

    job.loop.call_soon_threadsafe(deliver)


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def _failure(what: str, exc: BaseException) -> EngineError:
    """The error one request fails with: its own input (a grammar it cannot follow) or not."""
    if isinstance(exc, GrammarError):
        return RequestInputError(f"{what}: {exc}")
    return EngineError(f"{what}: {exc}")
