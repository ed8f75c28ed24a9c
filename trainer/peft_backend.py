"""The PEFT/torch trainer backend: one GRPO optimizer step at a time on a LoRA, CPU or CUDA.

`PeftTrainer` owns its own copy of the base model (any causal-LM folder transformers loads:
float32 on CPU, bfloat16 on CUDA by default, `TrainerConfig.dtype`) wrapped in a PEFT LoRA, and
an AdamW optimizer over the LoRA parameters only (float32 either way). `train_step` takes
`TrainingExample`s (exact stored token ids, stored logprobs, advantages, weights) and makes
exactly one optimizer step; `save` writes a checkpoint the serving engine (or vLLM) can load
(`trainer.checkpoints`); `load` resumes from one. `trainer.backends.open_trainer` picks the
backend the config names; this module knows nothing of the Unsloth one.

How a step runs: each example is one row `prompt + completion` (a packed example, several turns
of one trajectory, has the tool results and scaffolding between its turns in its completion,
masked out of the loss: `trainer.packing`). A row longer than `max_seq_len` (by default the base
model's context) is never cut: it is left out of the step and counted (`StepMetrics.too_long`),
since a prompt cut from the left is a context the policy never saw and its stored logprobs would
not match. Rows are ordered by prompt, then length, so that the members of a group (which share
their prompt) sit together, and cut into micro-batches of at most `micro_batch_size` rows and
`micro_batch_tokens` tokens run (a longer row goes alone). In each micro-batch the prompt tokens
every row shares run once (`share_prompt_prefix`): the micro-batch is one sequence, the shared
prefix and then each row's rest, under an attention mask where each rest sees the prefix and
itself, with positions that go on from the prefix's (`_packed`); the gradient flows back into
the prefix from every row, so the result is the same as running every row in full, and with no
key/value cache gradient checkpointing can recompute it. Rows without a shared prefix run side
by side, right-padded (`_padded`). The decoder's last hidden states are kept only where a
completion token is predicted, and those go through the LM head in chunks of `logprob_chunk`
positions, each recomputed in the backward (`trainer.logprobs`): no (T, V) logits ever exist,
for the prompt or for the whole completion. Per-token weights are computed once over the whole
batch (`grpo.sample_row_weights`), so the micro-batch losses add up to exactly the full-batch
loss, including the per-sample averaging. With kl_beta > 0 a reference pass runs with the
adapter disabled, under no_grad. `gradient_checkpointing` recomputes layer activations in the
backward, in passes of `checkpoint_min_tokens` tokens or more (a short pass keeps its small
activations and skips the recomputation). With glibc, allocations of `mmap_threshold` bytes
(1 MiB) and more get pages of their own and freed heap memory goes back to the system after
each step (`release_memory`): by default glibc keeps the freed activations of a long row in the
heap, which is most of a CPU step's resident memory.

A CPU step's time goes mostly to matmuls and elementwise ops (and their backward) that grow
with the tokens run through the decoder, so the prompt a group's rows share runs once; the
log-softmax is one fused cross-entropy and AdamW one fused kernel (the step's figures beside
TRL's: docs/benchmarks/grpo.md).

Data-parallel (`trainer.distributed`, `rlproxy train` under torchrun): given a `collective`,
rank 0's `train_step` first broadcasts the examples to the other ranks, every rank runs its
share of the rows (`step_shard`), the LoRA gradients and the step's sums are all-reduced, and
every rank makes the same AdamW update; `load` and `reset_adapter` on rank 0 send the weights
and optimizer state to the others (`apply_state`).

It is not the background loop: it reads no database, forms no groups and computes no
advantages; it never serves requests (the engine loads the checkpoints it writes).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import ctypes.util
import json
import logging
import math
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.cache_utils import DynamicLayer

from trainer import checkpoints
from trainer.config import TrainerConfig
from trainer.distributed import Collective, all_reduce_gradients, shard
from trainer.grpo import TrainingExample, grpo_loss, sample_row_weights
from trainer.logprobs import chunked_logprobs, lm_head_logits

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepMetrics:
    step: int  # optimizer steps done, this one included (the checkpoint version it would get)
    loss: float  # the full-batch GRPO loss before the update
    samples: int  # distinct sample ids
    turns: int  # examples (rows; the turns of a packed row count once)
    tokens: int  # completion tokens trained on
    forward_tokens: int  # prompt + completion tokens through forward and backward (no padding)
    computed_tokens: int  # tokens actually run (a shared prompt prefix once per micro-batch)
    seconds: float
    tokens_per_s: float  # forward_tokens / seconds
    grad_norm: float  # global norm before clipping
    clip_fraction: float  # token means over completion tokens
    ratio_mean: float
    kl: float  # k3 KL to the base; 0 when kl_beta == 0 (no reference pass)
    too_long: int  # turns left out: longer than max_seq_len (never cut)
    is_weight_mean: float = 1.0  # truncated importance weights ('tis'; 1 with 'ppo')
    is_capped_fraction: float = 0.0  # tokens whose pi_old / mu reached tis_cap

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Pass(NamedTuple):
    """One forward's inputs: `_padded` rows or one `_packed` sequence (see there)."""

    input_ids: torch.Tensor
    attention: torch.Tensor
    positions: torch.Tensor | None
    keep: torch.Tensor  # which positions predict a trained completion token
    targets: torch.Tensor  # the token each position predicts


@dataclass(frozen=True)
class _Row:
    input_ids: list[int]  # prompt + completion
    first: int  # index in input_ids of the first completion token
    old_logprobs: list[float]  # one per completion token (placeholders where mask is False)
    mask: list[bool]  # per completion token: sampled, trained on (False between packed turns)
    advantage: float
    recompute_old: bool = False  # the stored logprobs are not the policy's (masked_logprobs)


METRIC_MEANS = ("clip_fraction", "ratio_mean", "kl", "is_weight_mean", "is_capped_fraction")
"""`grpo_loss` metrics that are token means: combined over micro-batches by token count."""

MIN_SHARED_PREFIX = 8
"""Shorter common prefixes are not worth the extra forward call of sharing them."""


def model_context(model_dir: Path) -> int:
    """The longest sequence the model in `model_dir` was made for (`max_position_embeddings`;
    SmolLM2-135M: 8,192)."""
    config = AutoConfig.from_pretrained(str(model_dir))
    config = getattr(config, "text_config", None) or config  # multimodal wrappers
    context = getattr(config, "max_position_embeddings", None)
    if not isinstance(context, int) or context < 2:
        raise ValueError(
            f"the model in {model_dir} declares no max_position_embeddings: set the trainer's "
            "max_seq_len (RLPROXY_TRAINER) to the context it was trained for"
        )
    return context


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`TrainerConfig.dtype` on this device: 'auto' is bfloat16 on CUDA, float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


class PeftTrainer:
    backend = "peft"

    def __init__(
        self,
        model_dir: Path,
        config: TrainerConfig,
        *,
        device: str | None = None,
        collective: Collective | None = None,
    ) -> None:
        """Load the causal LM in `model_dir` (for the embedded model, the fp32 folder of
        proxy.engines.loader.ensure_fp32_cache) and put a fresh LoRA on it. `collective`: this
        rank's place among data-parallel ranks (`trainer.distributed.from_env`); None for one
        process. Its device is the default device."""
        if config.backend != self.backend:
            raise ValueError(
                f"this config asks for the {config.backend!r} backend; build the trainer with "
                "trainer.backends.open_trainer(model_dir, config)"
            )
        self.config = config
        self.model_dir = Path(model_dir)
        if device is None and collective is not None:
            device = str(collective.device)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.max_seq_len = config.max_seq_len or model_context(self.model_dir)
        """Longest row trained on: `max_seq_len`, or the base model's context when unset."""
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.release_memory == "mmap":
            # Process-wide, and for good: the trainer runs in a process of its own. glibc's
            # default threshold grows up to 32 MB as large blocks are freed, after which a long
            # row's activations come from the heap and stay there once freed. At 1 MiB a short
            # row's tensors still reuse the heap (fresh pages for each cost up to 1.3x the CPU
            # time of a short step at 64 KiB) while a long pass's activations of several MB
            # get pages of their own.
            set_mmap_threshold(config.mmap_threshold)
        if config.release_memory != "off" and _glibc("malloc_trim", 0) is None:
            logger.warning(
                "release_memory %r: malloc_trim is not available (the C library is not glibc), "
                "so freed heap pages are not handed back after each step",
                config.release_memory,
            )
        with self._rng(config.seed):  # the LoRA A init is random: make it reproducible
            self.model: PeftModel = self._load_model()
        # Padding is masked out of attention and loss, so any id does; the model's own is tidiest.
        self.pad_id = int(getattr(self.model.get_base_model().config, "pad_token_id", 0) or 0)
        self.model.eval()
        self._initial_adapter = self.adapter_state()  # the fresh LoRA, for `reset_adapter`
        self._share_prefix = self._can_share_prefix()
        # The modules transformers' checkpointing switch is on in (each decoder layer); a pass
        # below checkpoint_min_tokens turns them off for itself (`_checkpoint_pass`). Unsloth's
        # offloading checkpointing is its own: every pass there, as configured.
        self._checkpointed = (
            [m for m in self.model.modules() if getattr(m, "gradient_checkpointing", False) is True]
            if self.backend == "peft"
            else []
        )
        self._logits_fn = lm_head_logits(self.model.get_base_model())
        self._params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        # One fused kernel per step instead of a loop of small ops per LoRA matrix.
        self.optimizer = torch.optim.AdamW(
            list(self._params.values()),
            lr=config.learning_rate,
            weight_decay=config.weight_decay,
            fused=True,
        )
        self.step = 0
        self.last_metrics: StepMetrics | None = None
        self.collective = collective
        """Set for `rlproxy train` under torchrun (`trainer.distributed`); None: one process."""
        logger.info(
            "LoRA trainer (%s) on %s in %s: %.2f M trainable parameters (r=%d on %s), rows up to "
            "%d tokens",
            self.backend,
            self.device,
            str(self.dtype).removeprefix("torch."),
            sum(p.numel() for p in self._params.values()) / 1e6,
            config.lora_rank,
            ",".join(config.target_modules),
            self.max_seq_len,
        )

    def _load_model(self) -> PeftModel:
        """The base model in `self.dtype` on `self.device`, with a fresh LoRA on it."""
        config = self.config
        base = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=self.dtype)
        if config.gradient_checkpointing:
            # Non-reentrant: gradients reach the LoRA inside each checkpointed layer even
            # though the layer's input (the frozen embeddings, for layer 0) needs none.
            base.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        lora = LoraConfig(
            task_type=TaskType.CAUSAL_LM,
            r=config.lora_rank,
            lora_alpha=config.lora_alpha,
            lora_dropout=config.lora_dropout,
            target_modules=list(config.target_modules),
            # What vLLM's LoRA loader accepts: no bias, no modules_to_save, no DoRA.
            bias="none",
        )
        model: PeftModel = get_peft_model(base, lora)  # type: ignore[assignment]
        model.to(self.device)  # type: ignore[arg-type]
        return model

    def _can_share_prefix(self) -> bool:
        """Sharing packs rows after their common prefix into one sequence under a mask of its
        own (`_packed`): that needs attention that takes such a mask (sdpa or eager) and full
        causal attention in every layer, which a plain growing key/value cache in every layer
        shows (not a sliding-window, chunked or recurrent one, where the mask would differ)."""
        if not self.config.share_prompt_prefix:
            return False
        if self._attention() not in ("sdpa", "eager"):
            return False
        probe = torch.tensor([[self.pad_id]], device=self.device)
        with torch.no_grad():
            cache = self.model(input_ids=probe, use_cache=True, logits_to_keep=1).past_key_values
        layers = list(getattr(cache, "layers", None) or [])
        return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)

    def _attention(self) -> str:
        """The attention implementation transformers runs ('sdpa', 'eager', ...)."""
        config = getattr(self.model.get_base_model(), "config", None)
        return str(getattr(config, "_attn_implementation", ""))

    # ----------------------------------------------------------------- training

    def train_step(self, examples: Sequence[TrainingExample]) -> StepMetrics:
        """One AdamW step on the GRPO loss of all `examples` (gradients accumulate over
        micro-batches; the result equals one full-batch step). Data-parallel, on rank 0: the
        examples go to every rank first, and all of them make this step together; an error
        only this rank meets on the way is `trainer.distributed.OutOfStep` (exit, never retry)."""
        if not examples:
            raise ValueError("train_step needs at least one example")
        if self.collective is not None and self.collective.leader:
            with self.collective.lockstep():
                self.collective.broadcast(("step", self.step, list(examples)))
        return self.step_shard(examples)

    def step_shard(self, examples: Sequence[TrainingExample]) -> StepMetrics:
        """The step of `train_step` on this rank's share of the rows (all of them in one
        process); the gradients and the metrics' sums are all-reduced over the ranks."""
        if not examples:
            raise ValueError("train_step needs at least one example")
        start = time.perf_counter()
        rows = [self._prepare(e) for e in examples]  # checks every example, kept or not
        fits = [len(r.input_ids) <= self.max_seq_len for r in rows]
        too_long = fits.count(False)
        if too_long:
            logger.warning(
                "%d of %d turns are longer than max_seq_len (%d tokens): left out, not cut",
                too_long,
                len(rows),
                self.max_seq_len,
            )
        if not any(fits):
            raise ValueError(
                f"all {len(rows)} turns are longer than max_seq_len ({self.max_seq_len} tokens, "
                f"the longest {max(len(r.input_ids) for r in rows)}): nothing to train on; raise "
                "max_seq_len up to the model's context"
            )
        examples = [e for e, ok in zip(examples, fits, strict=True) if ok]
        rows = [r for r, ok in zip(rows, fits, strict=True) if ok]
        sample_index: dict[str, int] = {}
        sample_ids = torch.tensor(
            [sample_index.setdefault(e.sample_id, len(sample_index)) for e in examples]
        )
        counts = torch.tensor([sum(r.mask) for r in rows])
        # (N,) per-token weight of each row: per-sample averaging, times the sample's own weight
        # (below 1 for a down-weighted stale group)
        weights = sample_row_weights(counts, sample_ids) * torch.tensor(
            [float(e.weight) for e in examples]
        )
        # Same prompts side by side (shared in one micro-batch), shortest rows first within one.
        order = sorted(
            range(len(rows)),
            key=lambda i: (rows[i].input_ids[: rows[i].first], len(rows[i].input_ids)),
        )
        group = self.collective
        if group is not None:  # this rank's contiguous run of rows, about 1/N of the tokens
            order = order[
                shard([len(rows[i].input_ids) for i in order], group.world_size, group.rank)
            ]

        loss_sum = 0.0
        computed = 0
        totals: dict[str, float] = defaultdict(float)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        # Data-parallel: the examples' checks above failed on every rank alike, and so does the
        # finiteness check below (on summed values); an error in between is this rank's alone.
        lockstep = group.lockstep if group is not None else contextlib.nullcontext
        try:
            with lockstep():
                with self._rng(self.config.seed + self.step):  # per-step dropout, as on resume
                    for chunk in self._micro_batches(order, rows):
                        loss, metrics = self._micro_batch([rows[i] for i in chunk], weights[chunk])
                        computed += int(metrics["computed_tokens"])
                        loss.backward()  # type: ignore[no-untyped-call]
                        loss_sum += float(loss.detach())
                        for key in METRIC_MEANS:
                            totals[key] += metrics[key] * metrics["tokens"]
                        totals["tokens"] += metrics["tokens"]
                if group is not None:
                    # The shards' losses add up to the full batch's (weights over the whole
                    # batch): summed gradients are the full batch's gradient on every rank.
                    all_reduce_gradients(self._params.values(), group)
                    keys = ["tokens", *METRIC_MEANS]
                    summed = group.sum_floats([loss_sum, computed, *(totals[k] for k in keys)])
                    loss_sum, computed = summed[0], int(summed[1])
                    totals.update(zip(keys, summed[2:], strict=True))
                grad_norm = float(
                    torch.nn.utils.clip_grad_norm_(
                        list(self._params.values()), self.config.max_grad_norm
                    )
                )
            if not math.isfinite(grad_norm) or not math.isfinite(loss_sum):
                # One NaN update would poison the adapter for good: refuse the step instead.
                raise FloatingPointError(
                    f"non-finite loss {loss_sum} or gradient norm {grad_norm}; step skipped"
                )
            with lockstep():  # a rank whose update failed would train on other weights
                self.optimizer.step()
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            self.model.eval()
            if self.config.release_memory != "off":
                # 1 or 0 says only whether pages went back; a missing malloc_trim was warned
                # about when the trainer started.
                _glibc("malloc_trim", 0)
        self.step += 1

        seconds = time.perf_counter() - start
        tokens = int(totals["tokens"])
        forward_tokens = sum(len(r.input_ids) for r in rows)
        self.last_metrics = StepMetrics(
            step=self.step,
            loss=loss_sum,
            samples=len(sample_index),
            turns=len(rows),
            tokens=tokens,
            forward_tokens=forward_tokens,
            computed_tokens=computed,
            seconds=seconds,
            tokens_per_s=forward_tokens / seconds if seconds > 0 else 0.0,
            grad_norm=grad_norm,
            clip_fraction=totals["clip_fraction"] / max(tokens, 1),
            ratio_mean=totals["ratio_mean"] / max(tokens, 1),
            kl=totals["kl"] / max(tokens, 1),
            is_weight_mean=totals["is_weight_mean"] / max(tokens, 1),
            is_capped_fraction=totals["is_capped_fraction"] / max(tokens, 1),
            too_long=too_long,
        )
        logger.info("train step %d: %s", self.step, self.last_metrics)
        return self.last_metrics

    def _prepare(self, example: TrainingExample) -> _Row:
        prompt, completion = list(example.prompt_ids), list(example.completion_ids)
        old = [float(x) for x in example.old_logprobs]
        if not completion:
            raise ValueError(f"sample {example.sample_id}: a turn without completion tokens")
        if not prompt:
            raise ValueError(f"sample {example.sample_id}: a turn needs at least one prompt token")
        if len(old) != len(completion):
            raise ValueError(
                f"sample {example.sample_id}: {len(old)} old logprobs for "
                f"{len(completion)} completion tokens; store one logprob per sampled token"
            )
        if not all(math.isfinite(x) for x in old):
            raise ValueError(f"sample {example.sample_id}: old logprobs must be finite")
        mask = [True] * len(completion)
        if example.completion_mask is not None:
            mask = [bool(x) for x in example.completion_mask]
            if len(mask) != len(completion) or not mask[0]:
                raise ValueError(
                    f"sample {example.sample_id}: completion_mask needs one flag per completion "
                    "token and a sampled first token"
                )
        if not (math.isfinite(example.weight) and example.weight >= 0):
            raise ValueError(
                f"sample {example.sample_id}: weight must be >= 0, got {example.weight}"
            )
        recompute = example.logprobs_masked and self.config.masked_logprobs == "trainer"
        return _Row(
            prompt + completion,
            len(prompt),
            old,
            mask,
            float(example.advantage),
            recompute,
        )

    def _micro_batches(self, order: list[int], rows: list[_Row]) -> Iterator[list[int]]:
        """`order` cut into runs of at most `micro_batch_size` rows whose forward runs at most
        `micro_batch_tokens` tokens (`_pass_tokens`); a row longer than that goes alone."""
        budget = self.config.micro_batch_tokens
        batch: list[int] = []
        for i in order:
            full = len(batch) >= self.config.micro_batch_size
            if batch and (
                full
                or (
                    budget is not None
                    and self._pass_tokens([rows[j] for j in [*batch, i]]) > budget
                )
            ):
                yield batch
                batch = []
            batch.append(i)
        if batch:
            yield batch

    def _pass_tokens(self, rows: list[_Row]) -> int:
        """Tokens one forward over `rows` runs: their common prefix once and each row's rest
        (`_packed`), or every row padded to the longest (`_padded`)."""
        shared = self._shared_prefix(rows)
        if shared:
            return shared + sum(len(r.input_ids) - shared for r in rows)
        return len(rows) * max(len(r.input_ids) for r in rows)

    def _micro_batch(
        self, rows: list[_Row], row_weights: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        shared = self._shared_prefix(rows)  # P: the leading tokens every row has, run once
        batch = len(rows)
        length = max(len(r.input_ids) for r in rows) - shared  # S: the longest row's rest
        rests = [r.input_ids[shared:] for r in rows]
        # keep[b, p]: rest position p predicts a completion token (p + 1), so p runs from
        # first - 1 (in rest coordinates, first - 1 - P; P <= first - 1 by construction).
        keep = torch.zeros((batch, length), dtype=torch.bool)  # (B, S)
        old = torch.zeros((batch, length), dtype=torch.float32)
        targets = torch.zeros((batch, length), dtype=torch.long)  # target of p is token p + 1
        for b, (row, rest) in enumerate(zip(rows, rests, strict=True)):
            span = slice(row.first - 1 - shared, row.first - 1 - shared + len(row.old_logprobs))
            keep[b, span] = torch.tensor(row.mask)
            old[b, span] = torch.tensor(row.old_logprobs)
            targets[b, : len(rest) - 1] = torch.tensor(rest[1:])
        if shared:
            forward = self._packed(rows[0].input_ids[:shared], rests, keep, targets)
        else:
            forward = self._padded(rests, keep, targets)
        self._checkpoint_pass(forward[0].numel())
        keep, old = keep.to(self.device), old.to(self.device)
        advantages = torch.tensor([r.advantage for r in rows], device=self.device)

        def logprobs() -> torch.Tensor:  # (B, S): the kept positions' logprobs, 0 elsewhere
            flat = self._logprobs(*forward)  # (N,), in the row-major order of `keep`
            return torch.zeros(keep.shape, dtype=flat.dtype, device=flat.device).masked_scatter(
                keep, flat
            )

        ref = None
        if self.config.kl_beta > 0:
            with torch.no_grad(), self.model.disable_adapter():
                ref = logprobs()
        new = logprobs()
        if any(r.recompute_old for r in rows):
            # Logprobs stored after a grammar's mask: this forward's (the weights at the step's
            # start, one optimizer step per batch) are the ratio's reference for those rows.
            recompute = torch.tensor([r.recompute_old for r in rows], device=self.device)
            old = torch.where(recompute[:, None], new.detach().to(old.dtype), old)
        # 'tis': the clip is around the weights at the step's start, which are the weights this
        # forward ran with (one optimizer step per batch), and the stored logprobs only weight
        # each token, capped (trainer.grpo). With lora_dropout > 0, pi_old is this forward's,
        # dropout included.
        tis = self.config.off_policy_correction == "tis"
        loss, metrics = grpo_loss(
            new,
            new.detach() if tis else old,
            advantages,
            keep,
            epsilon=self.config.epsilon,
            kl_beta=self.config.kl_beta,
            row_weights=row_weights.to(self.device),
            ref_logprobs=ref,
            behaviour_logprobs=old if tis else None,
            tis_cap=self.config.tis_cap,
        )
        metrics["computed_tokens"] = float(shared + sum(len(r) for r in rests))
        return loss, metrics

    def _checkpoint_pass(self, tokens: int) -> None:
        """Checkpoint the coming pass's layers only if it runs `checkpoint_min_tokens` tokens or
        more: a short pass's activations are small, and recomputing them costs about a third of
        its compute. The switch is read when each layer's forward runs; the backward recomputes
        what its forward checkpointed, whatever the switch says by then."""
        on = tokens >= self.config.checkpoint_min_tokens
        for module in self._checkpointed:
            setattr(module, "gradient_checkpointing", on)  # noqa: B010 (nn.Module's typing)

    def _padded(self, rests: list[list[int]], keep: torch.Tensor, targets: torch.Tensor) -> _Pass:
        """Rows side by side, right-padded: input_ids (B, S), attention (B, S)."""
        input_ids = torch.full(keep.shape, self.pad_id, dtype=torch.long)
        attention = torch.zeros(keep.shape, dtype=torch.long)
        for b, rest in enumerate(rests):
            input_ids[b, : len(rest)] = torch.tensor(rest)
            attention[b, : len(rest)] = 1
        return _Pass(
            input_ids.to(self.device),
            attention.to(self.device),
            None,
            keep.to(self.device),
            targets.to(self.device),
        )

    def _packed(
        self, prefix: list[int], rests: list[list[int]], keep: torch.Tensor, targets: torch.Tensor
    ) -> _Pass:
        """One sequence `prefix + rest_0 + rest_1 + ...` (1, L): every rest attends to the
        prefix and, causally, to itself, never to another row's rest, and its positions go on
        from the prefix's, so each row sees exactly its own tokens as in a forward of its own.
        The prefix runs once and its gradient is the sum of the rows', with no padding and no
        key/value cache, so gradient checkpointing can recompute it. Mask (1, 1, L, L): True
        where a query may attend (sdpa), or 0 / the dtype's minimum added to the scores
        (eager)."""
        p = len(prefix)
        lengths = [len(r) for r in rests]
        total = p + sum(lengths)
        segment = torch.zeros(total, dtype=torch.long)  # 0: the prefix, b + 1: row b's rest
        positions = torch.arange(total)
        start = p
        for b, n in enumerate(lengths):
            segment[start : start + n] = b + 1
            positions[start : start + n] = torch.arange(p, p + n)
            start += n
        index = torch.arange(total)
        causal = index[None, :] <= index[:, None]  # (L, L): key <= query
        visible = causal & ((segment[None, :] == 0) | (segment[None, :] == segment[:, None]))
        mask: torch.Tensor = visible
        if self._attention() == "eager":
            mask = torch.zeros(visible.shape, dtype=self.dtype).masked_fill(
                ~visible, torch.finfo(self.dtype).min
            )
        flat_keep = torch.cat(
            [torch.zeros(p, dtype=torch.bool)] + [keep[b, :n] for b, n in enumerate(lengths)]
        )
        flat_targets = torch.cat(
            [torch.zeros(p, dtype=torch.long)] + [targets[b, :n] for b, n in enumerate(lengths)]
        )
        ids = torch.tensor(prefix + [t for r in rests for t in r])
        return _Pass(
            ids[None].to(self.device),
            mask[None, None].to(self.device),
            positions[None].to(self.device),
            flat_keep[None].to(self.device),
            flat_targets[None].to(self.device),
        )

    def _shared_prefix(self, rows: list[_Row]) -> int:
        """How many leading tokens all `rows` share and may run once: at most up to the first
        position whose logits are needed (first - 1); 0 when not worth it or not possible."""
        if not self._share_prefix or len(rows) < 2:
            return 0
        limit = min(r.first for r in rows) - 1
        if limit < MIN_SHARED_PREFIX:
            return 0
        heads = torch.tensor([r.input_ids[:limit] for r in rows])  # (B, limit)
        same = (heads == heads[0]).all(dim=0)  # (limit,)
        shared = int(same.long().cumprod(0).sum())
        return shared if shared >= MIN_SHARED_PREFIX else 0

    def _logprobs(
        self,
        input_ids: torch.Tensor,
        attention: torch.Tensor,
        positions: torch.Tensor | None,
        keep: torch.Tensor,
        targets: torch.Tensor,
    ) -> torch.Tensor:
        """(N,) logprobs of the targets at the N `keep` positions, in row-major order.

        input_ids, keep, targets (B, T); attention (B, T), or (B, 1, T, T) for a packed
        sequence with its `positions` (B, T). Only the kept positions' hidden states go on,
        through the LM head in chunks (`trainer.logprobs`).
        """
        hidden = self._hidden_states(input_ids, attention, positions)[keep]  # (N, H)
        return chunked_logprobs(
            hidden, self._logits_fn, targets[keep], chunk=self.config.logprob_chunk
        )

    def _hidden_states(
        self, input_ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """(B, T, H) last hidden states of the decoder (the model without its LM head)."""
        decoder: torch.nn.Module = self.model.get_base_model().get_decoder()  # type: ignore[operator]
        out = decoder(
            input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=False
        )
        hidden: torch.Tensor = out.last_hidden_state
        return hidden

    @contextlib.contextmanager
    def _rng(self, seed: int) -> Iterator[None]:
        """Seed torch's RNG inside the block and restore the caller's RNG state after it."""
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            yield

    # ----------------------------------------------------------------- checkpoints

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The LoRA weights, keyed exactly as PEFT's save_pretrained writes them."""
        state = get_peft_model_state_dict(self.model)
        return {k: v.detach().to("cpu").clone() for k, v in state.items()}

    def adapter_config(self) -> dict[str, Any]:
        """PEFT's adapter_config.json content, as save_pretrained writes it (inference mode)."""
        config = copy.deepcopy(self.model.peft_config["default"])
        config.inference_mode = True
        config.base_model_name_or_path = str(self.model_dir)
        data = config.to_dict()
        data = {k: sorted(v) if isinstance(v, set) else v for k, v in data.items()}
        return dict(json.loads(json.dumps(data)))  # JSON-ready (enums become their values)

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """AdamW's per-parameter state as tensors named `<parameter name>.<state key>`."""
        return checkpoints.optimizer_tensors(self.optimizer, self._params)

    def save(self, root: Path, trainer_state: dict[str, Any] | None = None) -> Path:
        """Write checkpoint version `self.step` under `root`; `trainer_state` (for example the
        group ids used so far) is stored beside the trainer's own step, config and metrics."""
        state: dict[str, Any] = {
            "config": self.config.to_dict(),
            "seed": self.config.seed,
            "metrics": self.last_metrics.to_dict() if self.last_metrics else None,
            "base_model": str(self.model_dir),
            **(trainer_state or {}),
        }
        return checkpoints.write_checkpoint(
            root,
            self.step,
            self.adapter_state(),
            self.adapter_config(),
            state,
            self.optimizer_state(),
        )

    def reset_adapter(self) -> None:
        """Back to the LoRA weights this trainer started with and an empty optimizer state
        (the step counter stays: version numbers never go back)."""
        set_peft_model_state_dict(self.model, self._initial_adapter)
        self.optimizer.state.clear()
        logger.info("LoRA weights reset to their initial values")
        self.sync_followers()

    def sync_followers(self) -> None:
        """Data-parallel, on rank 0: send the LoRA weights, optimizer state and step to the
        other ranks (`apply_state` there). Nothing in one process."""
        if self.collective is None or not self.collective.leader:
            return
        optimizer = {k: v.detach().to("cpu") for k, v in self.optimizer_state().items()}
        self.collective.broadcast(("sync", self.step, self.adapter_state(), optimizer))

    def apply_state(
        self, lora: dict[str, torch.Tensor], optimizer: dict[str, torch.Tensor], step: int
    ) -> None:
        """Take LoRA weights, optimizer state and step as `sync_followers` sends them."""
        set_peft_model_state_dict(self.model, lora)
        self.optimizer.state.clear()
        checkpoints.load_optimizer_tensors(self.optimizer, self._params, optimizer)
        self.step = step

    def load(self, path: Path) -> dict[str, Any]:
        """Resume from a checkpoint folder: LoRA weights, optimizer state and step.

        Returns its trainer state. The LoRA shape (rank, alpha, target modules) must match this
        trainer's config; other fields (learning rate, epsilon, ...) may have changed.
        """
        checkpoints.validate_checkpoint(path)
        saved = checkpoints.read_adapter_config(path)
        expected = self.adapter_config()
        for key in ("r", "lora_alpha", "target_modules", "peft_type"):
            if saved.get(key) != expected.get(key):
                raise ValueError(
                    f"checkpoint {path} has {key}={saved.get(key)!r} but this trainer is "
                    f"configured with {expected.get(key)!r}; resume with the same LoRA shape"
                )
        weights = checkpoints.read_adapter_state(path)
        mismatch = set(weights) ^ set(get_peft_model_state_dict(self.model))
        if mismatch:
            raise checkpoints.CheckpointError(
                f"checkpoint {path} does not fit this model's LoRA: {sorted(mismatch)[:3]}"
            )
        set_peft_model_state_dict(self.model, weights)
        checkpoints.load_optimizer_tensors(
            self.optimizer, self._params, checkpoints.read_optimizer_state(path)
        )
        state = checkpoints.read_trainer_state(path)
        self.step = int(state["step"])
        logger.info("resumed LoRA training from %s at step %d", path, self.step)
        self.sync_followers()
        return state


M_MMAP_THRESHOLD = -3
"""mallopt's parameter number for the mmap threshold (glibc's malloc.h)."""


def set_mmap_threshold(size: int) -> bool:
    """Give every allocation of `size` bytes or more pages of its own, returned to the system
    when freed (glibc's `mallopt(M_MMAP_THRESHOLD, size)`, which also stops glibc from raising
    the threshold as large blocks are freed). Process-wide. True when it took effect; otherwise
    a warning says so and the heap keeps glibc's defaults."""
    return mallopt(M_MMAP_THRESHOLD, size, "M_MMAP_THRESHOLD")


def mallopt(param: int, value: int, name: str) -> bool:
    """glibc's `mallopt(param, value)` (`name`: the parameter's name in malloc.h, for the log).
    True when glibc took the setting (mallopt returns 1); a warning naming the setting that did
    not take effect when it refused it (0) or the C library has no mallopt (not glibc)."""
    result = _glibc("mallopt", param, value)
    if result == 1:
        logger.info("glibc malloc: %s set to %d", name, value)
        return True
    if result is None:
        logger.warning(
            "mallopt(%s, %d) did not take effect: the C library has no mallopt (not glibc)",
            name,
            value,
        )
    else:
        logger.warning("mallopt(%s, %d) did not take effect: glibc refused it", name, value)
    return False


def _glibc(function: str, *args: int) -> int | None:
    """glibc's `function` (mallopt, malloc_trim) called with int arguments: its int result;
    None where the C library has no such function (it is another)."""
    try:
        call = getattr(ctypes.CDLL(ctypes.util.find_library("c")), function)
    except (OSError, AttributeError, TypeError):
        return None
    call.restype = ctypes.c_int
    return int(call(*args))
