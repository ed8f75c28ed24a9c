"""The running batch's key/value cache and attention mask, left-padded, growing and shrinking.

Rows join (a newcomer's prefilled cache is left-padded to the batch's length and stacked under
it), grow by one position per decode step, and leave (`batch_select_indices`); columns that are
padding for every remaining row are trimmed. Pure tensor bookkeeping: no model, no sampling.

`GrowingLayer` is transformers' `DynamicLayer` with room to grow: a decode step writes its one
new position into spare room of a buffer instead of concatenating the whole cache into a new
tensor (`torch.cat` copies every layer's keys and values every step). Keys and values handed
out are views of the buffer; a tensor put in from outside (`stack`, `keep`, a prefix cache's
past) is copied into a new buffer at the next update, so it is never written to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

ROOM = 64
"""Positions a buffer gets beyond what it holds, plus an eighth of its length (amortised)."""


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` that appends into a buffer with spare room (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        length = self.get_seq_length()
        if not self._appendable(length + new, key_states.shape[0]):
            self._reallocate(length, length + new + ROOM + (length + new) // 8, key_states)
        assert self._key_buffer is not None and self._value_buffer is not None
        self._key_buffer[:, :, length : length + new] = key_states
        self._value_buffer[:, :, length : length + new] = value_states
        self.keys = self._key_buffer[:, :, : length + new]
        self.values = self._value_buffer[:, :, : length + new]
        return self.keys, self.values

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Hold `keys`/`values` (B, H, capacity, D) as the buffers, their first `length`
        positions filled: the caller built them with room for the next update."""
        self.lazy_initialization(keys, values)
        self._key_buffer, self._value_buffer = keys, values
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]

    def _appendable(self, needed: int, batch: int) -> bool:
        """Whether `keys`/`values` are still the start of the buffers, with room for `needed`."""
        k, v, keys, values = self._key_buffer, self._value_buffer, self.keys, self.values
        if k is None or v is None or keys is None or values is None or keys.numel() == 0:
            return False
        return (
            needed <= k.shape[2]
            and k.shape[0] == batch == keys.shape[0]
            and keys.data_ptr() == k.data_ptr()
            and values.data_ptr() == v.data_ptr()
            and keys.stride() == k.stride()
        )

    def _reallocate(self, length: int, capacity: int, like: torch.Tensor) -> None:
        b, h, _, d = like.shape
        keys = like.new_empty((b, h, capacity, d))
        values = like.new_empty((b, h, capacity, d))
        if length:
            assert self.keys is not None and self.values is not None
            keys[:, :, :length] = self.keys
            values[:, :, :length] = self.values
        self._key_buffer, self._value_buffer = keys, values


def growing_cache(config: Any) -> DynamicCache:
    """An empty `DynamicCache` of `GrowingLayer`s (the model's layers must all be full
    attention: `LocalEngine` checks)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() for _ in cache.layers]
    return cache


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
