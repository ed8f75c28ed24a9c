"""Per-row token sampling: penalties, temperature, top-p, a seeded generator per row.

The logprobs the engine reports are taken before anything here touches the logits; this module
only decides which token is drawn.
"""

from __future__ import annotations

import secrets

import torch

from proxy.engines.base import SamplingParams

GREEDY_BELOW = 1e-30
"""Temperatures under this sample greedily: logits divided by them overflow float32 (the
distribution they ask for is the greedy one anyway). Decided once per row, not per token."""
SEED_SPACE = 2**64
"""A generator's seed is 64 bits; any integer seed is taken modulo this, so `seed + i` (row i of
a request) can never be out of range."""


class RowSampler:
    """Draws tokens for one choice. temperature 0 (or under GREEDY_BELOW) means greedy."""

    def __init__(self, params: SamplingParams, *, seed: int | None, device: torch.device) -> None:
        self.params = params
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed % SEED_SPACE if seed is not None else secrets.randbits(63))

    def sample(self, logits: torch.Tensor, generated: list[int]) -> int:
        """`logits`: (V,) for this row, already masked by any grammar (-inf where forbidden)."""
        p = self.params
        if generated and (p.presence_penalty or p.frequency_penalty):
            ids = torch.tensor(generated, dtype=torch.long, device=logits.device)
            counts = torch.zeros_like(logits).scatter_add_(
                0, ids, torch.ones_like(ids, dtype=logits.dtype)
            )
            logits = (
                logits
                - p.frequency_penalty * counts
                - p.presence_penalty * (counts > 0).to(logits.dtype)
            )
        if p.temperature < GREEDY_BELOW:  # 0, or so small that logits / it overflow
            return int(torch.argmax(logits))
        if 0 < p.top_k < logits.shape[-1]:  # keep the k most likely tokens (ties at the k-th too)
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            cumulative = sorted_probs.cumsum(-1)
            # keep the smallest prefix whose mass reaches top_p (always at least one token:
            # a top_p below float32's smallest number, 5e-324, compares as 0 and cuts them all)
            cut = (cumulative - sorted_probs) >= p.top_p
            cut[0] = False
            sorted_probs = sorted_probs.masked_fill(cut, 0.0)
            choice = torch.multinomial(sorted_probs, 1, generator=self.generator)
            return int(order[choice])
        return int(torch.multinomial(probs, 1, generator=self.generator))
