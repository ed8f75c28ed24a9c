"""The running batch's key/value cache and attention mask, left-padded, growing and shrinking.

Rows join (a newcomer's prefilled cache is left-padded to the batch's length and stacked under
it), grow by one position per decode step, and leave (`batch_select_indices`); columns that are
padding for every remaining row are trimmed. Pure tensor bookkeeping: no model, no sampling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class KVBatch:
    cache: Any  # a transformers DynamicCache (its layers hold .keys / .values)
    mask: torch.Tensor  # (B, L): 1 = real token, 0 = left padding

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])

    def stack(self, other: KVBatch) -> None:
        """Append `other`'s rows below this batch's, left-padding the shorter one."""
        length = max(self.mask.shape[1], other.mask.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([left_pad(mine.keys, length), left_pad(theirs.keys, length)])
            mine.values = torch.cat(
                [left_pad(mine.values, length), left_pad(theirs.values, length)]
            )
        self.mask = torch.cat([left_pad(self.mask, length), left_pad(other.mask, length)])

    def grow(self) -> torch.Tensor:
        """Extend the mask by one real position per row; return the new tokens' positions (B, 1)."""
        ones = torch.ones((self.size, 1), dtype=self.mask.dtype, device=self.mask.device)
        self.mask = torch.cat([self.mask, ones], dim=1)
        return self.mask.sum(-1, keepdim=True) - 1

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (indices into the batch), then drop all-padding leading columns."""
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        real = self.mask.any(dim=0).nonzero()
        start = int(real[0]) if len(real) else 0
        if start == 0:
            return
        for layer in self.cache.layers:
            layer.keys = layer.keys[:, :, start:, :]
            layer.values = layer.values[:, :, start:, :]
        self.mask = self.mask[:, start:]


def left_pad(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Left-pad dim 2 of a (B, H, L, D) cache tensor, or dim 1 of a (B, L) mask, with zeros."""
    dim = 2 if tensor.dim() == 4 else 1
    missing = length - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)
