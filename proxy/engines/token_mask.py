"""Token masks: what the local engine's decode loop applies for a row that follows a grammar.

    info = build_tokenizer_info(tokenizer)              # once per engine
    bitmask = allocate_bitmask(batch_size, info)        # (B, ceil(V/32)) int32, all allowed
    each step:  row.fill_bitmask(bitmask, i)            # for each constrained row i
                apply_bitmask(logits, bitmask, rows)    # logits (B, V) -> -inf where banned

What it is not: it builds no grammar and knows nothing of schemas, tools or tool-call formats;
the grammars and the row constraints that fill a row's bits are `proxy.chat.grammar`'s, and
reach the engine as `GenerationRequest.grammar`. `GrammarError` lives here because both sides
raise it: the grammar builders for a bad schema, a row constraint for a grammar that validated
but cannot be followed; either way the request fails alone with a 400.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
import torch


class GrammarError(ValueError):
    """A schema, tool list or tool_choice that cannot be turned into a grammar, or a grammar
    that cannot be followed while generating (HTTP 400)."""


def build_tokenizer_info(tokenizer: Any, n_vocab: int | None = None) -> llguidance.LLTokenizer:
    """llguidance's view of the tokenizer (~0.6 s; build once per engine).

    `n_vocab` overrides the vocabulary size, e.g. with the model's logits width when the
    embedding matrix is padded beyond the tokenizer's vocabulary.
    """
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab)


def allocate_bitmask(batch_size: int, info: llguidance.LLTokenizer) -> torch.Tensor:
    """A (B, ceil(V/32)) int32 bitmask with every token allowed (bit set = allowed)."""
    return torch.full((batch_size, (info.vocab_size + 31) // 32), -1, dtype=torch.int32)


# Byte value -> its 8 bits as additive logit biases (0 = allowed, -inf = banned), lowest bit first:
# (256, 8). Viewing the int32 words as bytes assumes a little-endian machine (x86, ARM).
_BYTE_BIAS = torch.where(
    ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1).bool(), 0.0, float("-inf")
)


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None
) -> None:
    """Set banned tokens' logits to -inf, in place.

    logits (B, V) float; bitmask (B, W) int32 with 32 tokens per word, bit set = allowed. `rows`,
    if given, limits the masking to those rows (unconstrained rows stay untouched). V and 32*W
    need not agree: tokens beyond the bitmask (a padded embedding) are banned, bits beyond V are
    ignored. One table lookup and one add over the batch's logits.
    """
    if rows is not None:
        if not rows:
            return
        index = torch.as_tensor(list(rows), dtype=torch.long, device=logits.device)
        sub = logits.index_select(0, index)
        apply_bitmask(sub, bitmask.index_select(0, index.to(bitmask.device)))
        logits.index_copy_(0, index, sub)
        return
    batch, vocab = logits.shape
    table = _BYTE_BIAS.to(device=logits.device, dtype=logits.dtype)
    words = bitmask.to(logits.device).contiguous()
    bias = table[words.view(torch.uint8).int()].reshape(batch, -1)  # (B, 32*W)
    width = bias.shape[1]
    if width >= vocab:
        logits.add_(bias[:, :vocab])
    else:
        logits[:, :width].add_(bias)
        logits[:, width:] = float("-inf")
