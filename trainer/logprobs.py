"""Log-probabilities of chosen tokens from a model's last hidden states, in bounded memory.

    flat = chunked_logprobs(hidden, lm_head, targets, chunk=1024)   # (N, H), (N,) -> (N,)

A causal LM's logits are (tokens x vocabulary): for SmolLM2 (V = 49,152) 197 kB per token in
float32, 786 MB for one 4,000-token row, and as much again for the log-softmax and for its
gradient. The trainer needs only one number per sampled completion token, log p(target), so the
backends hand this module the hidden states of exactly those N positions (prompt positions are
never projected) and it projects them through the LM head `chunk` positions at a time: each
chunk's (chunk, V) logits are built, reduced to (chunk,) log-probabilities by one fused
cross-entropy (log-softmax and pick, float32) and dropped. Under autograd each chunk runs
inside `torch.utils.checkpoint` (non-reentrant): the forward keeps only the chunk's hidden
states, and the backward projects the chunk again to get its gradient. So at most one
(chunk, V) block of logits and its gradient exist at a time, whatever N is: the peak is
chunk x V x 4 bytes x about 3 (logits, softmax, gradient), 600 MB at the default 1,024
positions, instead of growing with N. The price is one more LM-head matmul per chunk in the
backward.

Only the positions are chunked, not the vocabulary: one row of V float32 logits is 197 kB, so a
vocabulary split would save nothing at these chunk sizes, and one fused cross-entropy per chunk
is the fastest CPU path (`trainer.grpo.token_logprobs`).

The model family's transform after the LM head (Cohere's `logit_scale`, Granite's
`logits_scaling`, Gemma's `final_logit_softcapping`) is applied by `final_logits`, as
transformers' forwards apply it, since the backends take hidden states, not the model's logits.

This module knows nothing of rows, padding, prompts or the loss: `trainer.peft_backend` feeds it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from trainer.grpo import token_logprobs

LogitsFn = Callable[[torch.Tensor], torch.Tensor]
"""(n, H) hidden states -> (n, V) logits: the LM head and the family's final transform."""


def chunked_logprobs(
    hidden: torch.Tensor, logits_fn: LogitsFn, targets: torch.Tensor, *, chunk: int
) -> torch.Tensor:
    """log p(target) for each position: (N, H), (N,) -> (N,) float32, `chunk` positions at a
    time; with gradient through `hidden` (and the head's parameters, if they train) when
    autograd is on, each chunk recomputed in the backward."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if hidden.shape[0] == 0:
        return torch.zeros(0, dtype=torch.float32, device=hidden.device)
    grad = torch.is_grad_enabled() and hidden.requires_grad
    parts = []
    for i in range(0, hidden.shape[0], chunk):
        h, t = hidden[i : i + chunk], targets[i : i + chunk]
        if grad:
            part = checkpoint(_chunk_logprobs, h, t, logits_fn, use_reentrant=False)
        else:
            part = _chunk_logprobs(h, t, logits_fn)
        parts.append(part)
    return torch.cat(parts)


def _chunk_logprobs(h: torch.Tensor, t: torch.Tensor, logits_fn: LogitsFn) -> torch.Tensor:
    return token_logprobs(logits_fn(h), t)  # (n, V) lives only inside this call


def lm_head_logits(model: Any) -> LogitsFn:
    """The LM head of a transformers causal LM (a PEFT model's too) with its family's final
    transform: hidden states to the logits the model's own forward would return."""
    head = model.get_output_embeddings()
    config = model.config if hasattr(model, "config") else model.get_base_model().config
    return lambda h: final_logits(head(h).float(), config)


def final_logits(logits: torch.Tensor, config: Any) -> torch.Tensor:
    """The model family's transform after `lm_head`, as transformers' forwards apply it:
    Cohere multiplies by `logit_scale` (models/cohere), Granite divides by `logits_scaling`
    (models/granite), Gemma 2/3 soft-cap with `final_logit_softcapping` (models/gemma2)."""
    model_type = str(getattr(config, "model_type", ""))
    if model_type.startswith("cohere") and getattr(config, "logit_scale", None):
        logits = logits * config.logit_scale
    if model_type.startswith("granite") and getattr(config, "logits_scaling", None):
        logits = logits / config.logits_scaling
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits
