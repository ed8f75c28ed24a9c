"""GRPO: the group advantage and the clipped policy loss, as small pure functions.

Exactly this variant is implemented:

- Advantage (`group_advantages`): A_i = (r_i - mean(r)) / (std(r) + eps) with the *population*
  standard deviation (divide by n, not n - 1), as in DeepSeekMath's GRPO; `scale_by_std=False`
  gives the unscaled A_i = r_i - mean(r) (Dr. GRPO). A group whose rewards are all equal carries
  no signal: it is skipped (`None`) and the caller counts it.
- Cohort advantage (`leave_one_out_advantages`), for a group whose members are different tasks
  (live traffic, where every task is asked once: `storage.grouping`'s cohort source):
  A_i = r_i - mean_{j != i}(r_j), not divided by a std (RLOO's baseline: Kool et al. 2019;
  Ahmadian et al. 2024). Why this and not the same-task rule: the members' tasks differ in
  difficulty, so part of each reward is "got an easy task". A baseline that does not depend on
  the member's own answer (the others' mean) leaves the policy gradient unbiased whatever the
  mix of tasks: the easy-task share multiplies E[grad log pi] = 0 and averages out, adding
  variance but teaching nothing wrong. Dividing by the cohort's std would scale the step by how
  mixed the tasks happened to be (a cohort of hard tasks with one lucky success would push that
  success hardest), so it is left out; a same-task group, whose comparison is cleaner, keeps its
  std scaling and so weighs more in a step that holds both.
- Policy term (`grpo_loss`): the PPO clipped surrogate per sampled assistant token,
  min(r_t A, clip(r_t, 1 - epsilon, 1 + epsilon) A) with r_t = exp(logp_new - logp_old), where
  logp_old are the logprobs stored at sampling time (one optimisation step per batch of samples,
  so the ratio measures how far the policy moved since the sample was drawn).
- Off-policy correction (optional, `behaviour_logprobs`): decoupled PPO with truncated
  importance sampling. Then `old_logprobs` are the trainer's own logprobs pi_old at the step's
  start (the proximal policy: the clip's trust region is around the weights being updated) and
  each token's policy term is multiplied by w_t = min(exp(logp_old - logp_behaviour), cap), no
  gradient through w (`truncated_importance_weights`; Yao et al. 2025's TIS, AReaL's decoupled
  loss). With one optimizer step per batch pi_theta = pi_old when the gradient is taken, so the
  ratio is 1 and the gradient is w_t A grad log pi: unlike the clipped ratio against the stored
  logprobs, a token the policy has moved away from since sampling keeps its gradient, and no
  token weighs more than `cap`. When the stored and the trainer's logprobs agree, w = 1 and
  the loss and its gradient are the plain variant's.
- Optional KL to the reference model (the base, adapter disabled) with Schulman's k3 estimator,
  exp(ref - new) - (ref - new) - 1, weighted by `kl_beta` (0 turns it off; the default).
- Reduction: the per-token loss is averaged over each *sample's* masked tokens first, then over
  samples, so a long trajectory does not outweigh a short one. A sample may span several rows
  (one row per assistant turn of one trajectory, or several turns packed into one row):
  `sample_ids` says which sample each row belongs to, and all turns of one sample average
  together and count once.

Layout: every tensor is (B, T), one row per assistant turn (or packed turns), aligned so that
position t holds the logprob of target token t (see `token_logprobs`); `mask` is 1 on sampled
assistant tokens and 0 on prompt, tool, user and padding tokens, whose values may be anything
(even NaN).

This module knows nothing about models, tokenizers, the database or checkpoints;
`trainer.peft_backend` feeds it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TrainingExample:
    """One assistant turn to train on, with the exact token ids stored when it was sampled; or
    several turns of one trajectory packed into one row (`trainer.packing`)."""

    sample_id: str  # the trajectory (or shadow sample) it came from; its turns average together
    prompt_ids: list[int]  # the exact prompt token ids of this turn
    completion_ids: list[int]  # the exact sampled completion token ids of this turn
    old_logprobs: list[float]  # logprobs stored at sampling time, one per completion token
    advantage: float  # the sample's group advantage (same for every turn of the sample)
    weight: float = 1.0  # multiplies the sample's loss (< 1: its group was stale, down-weighted)
    behaviour_version: int = 0  # the adapter version that sampled it (0: the base model)
    logprobs_masked: bool = False  # old_logprobs were taken after a grammar's mask (vLLM)
    # Which completion_ids were sampled and are trained on; None: all of them. A packed row's
    # completion_ids also hold what came between its turns (tool results, the template's
    # scaffolding): False there, and old_logprobs holds a placeholder (0.0) at those positions.
    completion_mask: tuple[bool, ...] | None = None


def group_advantages(
    rewards: Sequence[float], *, scale_by_std: bool = True, eps: float = 1e-6
) -> list[float] | None:
    """Advantages of one group's members, or None when the group has no variance to learn from.

    None for fewer than two members or all-equal rewards; ValueError for a non-finite reward or
    rewards too large to normalise.
    """
    values = [float(r) for r in rewards]
    if any(not math.isfinite(v) for v in values):
        raise ValueError(f"rewards must be finite numbers, got {values}")
    if len(values) < 2 or max(values) == min(values):
        return None
    n = len(values)
    mean = math.fsum(v / n for v in values)  # divided first: a sum of huge rewards overflows
    centred = [v - mean for v in values]
    if not scale_by_std:
        advantages = centred
    else:
        scale = max(abs(c) for c in centred)  # > 0: not all rewards are equal
        std = scale * math.sqrt(math.fsum((c / scale) ** 2 for c in centred) / n)  # population
        advantages = [c / (std + eps) for c in centred]
    if not all(math.isfinite(a) for a in advantages):
        raise ValueError(f"rewards {values} are too large to turn into advantages")
    return advantages


def leave_one_out_advantages(rewards: Sequence[float]) -> list[float] | None:
    """A_i = r_i - mean of the other members' rewards: the advantage of a cohort of different
    tasks (see the module's text). None for fewer than two members or all-equal rewards."""
    values = [float(r) for r in rewards]
    if any(not math.isfinite(v) for v in values):
        raise ValueError(f"rewards must be finite numbers, got {values}")
    if len(values) < 2 or max(values) == min(values):
        return None
    n = len(values)
    scale = max(abs(v) for v in values)  # > 0: not all rewards are equal (so not all zero)
    total = math.fsum(v / scale for v in values)
    advantages = [scale * (v / scale - (total - v / scale) / (n - 1)) for v in values]
    if not all(math.isfinite(a) for a in advantages):
        raise ValueError(f"rewards {values} are too large to turn into advantages")
    return advantages


def token_logprobs(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """log p(target) under `logits`: (B, T, V), (B, T) -> (B, T), computed in float32.

    The caller aligns the two: logits at position t must be the ones that predict target t
    (for a causal LM's output, `logits[:, :-1]` against `input_ids[:, 1:]`).
    """
    # log p(target) = -cross_entropy(logits, target): one fused log-softmax and pick whose
    # backward (softmax - one_hot) is a single (B, T, V) pass; a gather minus a logsumexp
    # costs a second (B, T, V) pass and a zero-filled scatter in the backward.
    flat = logits.float().reshape(-1, logits.shape[-1])
    picked = -torch.nn.functional.cross_entropy(flat, target_ids.reshape(-1), reduction="none")
    return picked.reshape(target_ids.shape)


def sample_row_weights(token_counts: torch.Tensor, sample_ids: torch.Tensor) -> torch.Tensor:
    """Per-token weight of each row so that sum(weight * token_loss) is the mean over samples
    of each sample's mean token loss: (B,), (B,) -> (B,).

    A row of sample s gets 1 / (S * n_s), where n_s counts the masked tokens of all rows of s
    and S the samples with at least one token. Rows without tokens get 0.
    """
    counts = token_counts.to(torch.float64)
    if counts.numel() == 0:
        return counts.float()
    _, inverse = torch.unique(sample_ids.to(counts.device), return_inverse=True)
    per_sample = torch.zeros(int(inverse.max()) + 1, dtype=torch.float64, device=counts.device)
    per_sample = per_sample.index_add(0, inverse, counts)  # n_s
    num_samples = int((per_sample > 0).sum())
    n_row = per_sample[inverse]
    weights = torch.where(n_row > 0, 1.0 / (max(num_samples, 1) * n_row.clamp(min=1)), 0.0)
    return weights.float()


def truncated_importance_weights(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float,
) -> torch.Tensor:
    """min(pi_old / mu, cap) per token, without gradient: (B, T), (B, T), (B, T) -> (B, T).

    proximal_logprobs: the trainer's logprobs at the step's start; behaviour_logprobs: those
    stored at sampling time. 0 where `mask` is off (whatever the inputs hold there).
    """
    if not cap > 0:
        raise ValueError(f"the importance weight cap must be > 0, got {cap}")
    mask = mask.bool()
    with torch.no_grad():
        prox = torch.where(mask, proximal_logprobs.float(), 0.0)
        behaviour = torch.where(mask, behaviour_logprobs.to(prox), 0.0)
        # exp of the difference, capped in log space first: no overflow for a huge gap.
        log_ratio = torch.clamp(prox - behaviour, max=math.log(cap))
        return torch.where(mask, torch.exp(log_ratio), 0.0)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon: float = 0.2,
    kl_beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    sample_ids: torch.Tensor | None = None,
    row_weights: torch.Tensor | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
    tis_cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO loss (to minimise) of a batch of rows, and token-mean metrics.

    logprobs (B, T): current policy, with gradient; old_logprobs (B, T): stored at sampling time
    (with behaviour_logprobs: the trainer's own at the step's start, the ratio's reference);
    advantages (B,) or (B, T); mask (B, T) bool or 0/1; ref_logprobs (B, T): the reference
    model's, needed when kl_beta > 0. sample_ids (B,) ints: which sample each row belongs to
    (default: every row is its own sample). row_weights (B,): the per-token weight of each row,
    by default `sample_row_weights` of this batch; a trainer that splits one batch into
    micro-batches passes each micro-batch its slice of the full batch's weights, so that the
    micro-batch losses add up to exactly the full-batch loss. behaviour_logprobs (B, T): the
    logprobs stored at sampling time when `old_logprobs` are the trainer's own at the step's
    start; each token's policy term is then weighted by min(pi_old / mu, tis_cap).

    Metrics are plain token means over the masked tokens of this call (not sample-weighted):
    `clip_fraction` (tokens whose clipped term is active and thus has no gradient),
    `ratio_mean`, `kl` (k3, 0 when not computed), `is_weight_mean` and `is_capped_fraction`
    (the truncated importance weights and the tokens at the cap; 1 and 0 without
    behaviour_logprobs) and `tokens` (the count, to combine calls).
    """
    if kl_beta < 0:
        raise ValueError(f"kl_beta must be >= 0, got {kl_beta}")
    if kl_beta > 0 and ref_logprobs is None:
        raise ValueError("kl_beta > 0 needs ref_logprobs (the reference model's logprobs)")
    mask = mask.bool()
    rows = mask.shape[0]
    if row_weights is None:
        if sample_ids is None:
            sample_ids = torch.arange(rows, device=mask.device)
        row_weights = sample_row_weights(mask.sum(dim=1), sample_ids)
    weights = torch.where(mask, row_weights.to(logprobs.device, torch.float32)[:, None], 0.0)

    # Zero the masked positions before any arithmetic: garbage there (inf, NaN) must not leak
    # into the loss or, through 0 * NaN, into the gradients.
    new = torch.where(mask, logprobs.float(), 0.0)
    old = torch.where(mask, old_logprobs.to(new), 0.0)
    adv = advantages.to(new)
    adv = adv[:, None].expand_as(new) if adv.dim() == 1 else adv

    ratio = torch.exp(new - old)  # (B, T)
    clipped = torch.clamp(ratio, 1.0 - epsilon, 1.0 + epsilon)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    is_weights = None
    if behaviour_logprobs is not None:
        is_weights = truncated_importance_weights(old, behaviour_logprobs, mask, cap=tis_cap)
        surrogate = surrogate * is_weights
    per_token = -surrogate

    kl = torch.zeros_like(new)
    if ref_logprobs is not None:
        ref = torch.where(mask, ref_logprobs.to(new), 0.0)
        delta = ref - new
        kl = torch.exp(delta) - delta - 1.0  # k3: unbiased, always >= 0
        if kl_beta > 0:
            per_token = per_token + kl_beta * kl

    loss = (per_token * weights).sum()

    with torch.no_grad():
        tokens = int(mask.sum())
        denom = max(tokens, 1)
        is_clipped = ((ratio > 1.0 + epsilon) & (adv > 0)) | ((ratio < 1.0 - epsilon) & (adv < 0))
        metrics = {
            "clip_fraction": float((is_clipped & mask).sum()) / denom,
            "ratio_mean": float(ratio[mask].sum()) / denom,
            "kl": float(kl[mask].sum()) / denom,
            "is_weight_mean": 1.0,
            "is_capped_fraction": 0.0,
            "tokens": float(tokens),
        }
        if is_weights is not None and behaviour_logprobs is not None and tokens:
            capped = (old - behaviour_logprobs.to(old)) >= math.log(tis_cap)
            metrics["is_weight_mean"] = float(is_weights[mask].sum()) / denom
            metrics["is_capped_fraction"] = float((capped & mask).sum()) / denom
    return loss, metrics
