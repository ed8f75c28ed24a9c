"""The running batch's key/value cache and attention mask, left-padded, growing and shrinking.

Rows join (a newcomer's prefilled cache is left-padded to the batch's length and stacked under
it), grow by one position per decode step, and leave; columns that are padding for every
remaining row are trimmed. Pure tensor bookkeeping: no model, no sampling.

`GrowingLayer` is transformers' `DynamicLayer` over a buffer with room on every side that
needs it: spare columns on the right (a decode step writes its one new position there instead
of `torch.cat`-ing the whole cache into a new tensor), spare columns on the left (a newcomer
longer than the batch widens it without moving anyone) and spare rows (a newcomer is written
into them). A row that leaves is replaced by the batch's last row (one row copied) and a
trimmed column just moves the view. Only when the buffer has no room left is everything copied,
once, into a larger one: a join or a leave never copies the whole batch (on long sessions that
copy ran to a gigabyte a time).

Keys and values handed out are views of the buffer; a tensor put in from outside (a prefix
cache's past, transformers' own `batch_select_indices`) is copied into a new buffer at the next
update, so it is never written to. Padding columns hold zeros (never uninitialised memory: a
masked NaN still poisons attention).
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
    """A `DynamicLayer` over a buffer with spare rows and columns (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._key_buffer: torch.Tensor | None = None  # (rows, H, columns, D)
        self._value_buffer: torch.Tensor | None = None
        self._start = 0  # the buffer column where `keys` begins
        self._view: torch.Tensor | None = None  # the `keys` last handed out

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, new = key_states.shape[0], key_states.shape[-2]
        length = self.get_seq_length()
        if not (self._owns() and self._rows() == rows and self._room_right() >= new):
            self._reallocate(rows, rows, 0, new + ROOM + (length + new) // 8, key_states)
        assert self._key_buffer is not None and self._value_buffer is not None
        at = self._start + length
        self._key_buffer[:rows, :, at : at + new] = key_states
        self._value_buffer[:rows, :, at : at + new] = value_states
        return self._set_view(rows, length + new)

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Hold `keys`/`values` (B, H, capacity, D) as the buffers, their first `length`
        positions filled: the caller built them with room for the next update."""
        self.lazy_initialization(keys, values)
        self._key_buffer, self._value_buffer, self._start = keys, values, 0
        self._set_view(keys.shape[0], length)

    def join(self, keys: torch.Tensor, values: torch.Tensor, max_rows: int) -> None:
        """Add rows `keys`/`values` (R, H, W, D: right-aligned, zeros on the left) below this
        layer's, left-padding whichever is shorter; in the buffer's spare room when it has
        enough, else in a new buffer (with room for up to `max_rows` rows)."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        rows, width = self._rows(), self.get_seq_length()
        added, their_width = keys.shape[0], keys.shape[2]
        wider = max(0, their_width - width)
        if not (
            self._owns()
            and self._key_buffer is not None
            and rows + added <= self._key_buffer.shape[0]
            and self._start >= wider
        ):
            total = max(rows + added, max_rows)
            self._reallocate(rows, total, wider + ROOM + width // 4, ROOM + width // 8, keys)
        kb, vb = self._key_buffer, self._value_buffer
        assert kb is not None and vb is not None
        if wider:  # the batch widens to the left: zeros for the rows already in it
            kb[:rows, :, self._start - wider : self._start] = 0
            vb[:rows, :, self._start - wider : self._start] = 0
            self._start -= wider
        width += wider
        first = self._start + width - their_width  # the newcomers' first real column
        kb[rows : rows + added, :, self._start : first] = 0
        vb[rows : rows + added, :, self._start : first] = 0
        kb[rows : rows + added, :, first : self._start + width] = keys
        vb[rows : rows + added, :, first : self._start + width] = values
        self._set_view(rows + added, width)

    def keep_rows(self, order: list[int]) -> None:
        """Keep the rows `order` names, the row `order[i]` in position i: each either already
        there or taken from beyond the kept rows (`fill_holes`), so one row is copied per
        position that changes and none is overwritten before it is read."""
        if not self._owns():  # a tensor put in from outside: select (a copy, like transformers)
            assert self.keys is not None and self.values is not None
            index = torch.tensor(order, dtype=torch.long, device=self.keys.device)
            self.keys, self.values = self.keys[index], self.values[index]
            return
        kb, vb = self._key_buffer, self._value_buffer
        assert kb is not None and vb is not None
        width = self.get_seq_length()
        columns = slice(self._start, self._start + width)
        for slot, row in enumerate(order):
            if row != slot:
                assert row >= len(order), "a row may only move into a freed place"
                kb[slot, :, columns] = kb[row, :, columns]
                vb[slot, :, columns] = vb[row, :, columns]
        self._set_view(len(order), width)

    def trim_left(self, columns: int) -> None:
        """Forget the first `columns` positions of every row (padding for all of them)."""
        if self._owns():
            self._start += columns
            self._set_view(self._rows(), self.get_seq_length() - columns)
        else:
            assert self.keys is not None and self.values is not None
            self.keys = self.keys[:, :, columns:]
            self.values = self.values[:, :, columns:]

    def _owns(self) -> bool:
        """Whether `keys` is still the view of the buffer this layer handed out."""
        return self._key_buffer is not None and self.keys is self._view

    def _rows(self) -> int:
        return int(self.keys.shape[0]) if self.keys is not None and self.keys.dim() == 4 else 0

    def _room_right(self) -> int:
        assert self._key_buffer is not None
        return int(self._key_buffer.shape[2]) - self._start - self.get_seq_length()

    def _set_view(self, rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._key_buffer is not None and self._value_buffer is not None
        at = self._start
        keys = self._key_buffer[:rows, :, at : at + length]
        values = self._value_buffer[:rows, :, at : at + length]
        self.keys, self.values, self._view = keys, values, keys
        return keys, values

    def _reallocate(
        self, rows: int, capacity: int, left: int, right: int, like: torch.Tensor
    ) -> None:
        """Copy the first `rows` rows of the keys/values held into new buffers of `capacity`
        rows, with `left` and `right` spare columns (heads, head size, dtype: `like`'s). The
        spare room is left uninitialised: every column is written before a view shows it."""
        length = self.get_seq_length()
        shape = (capacity, like.shape[1], left + length + right, like.shape[3])
        keys, values = like.new_empty(shape), like.new_empty(shape)
        if rows and length:
            assert self.keys is not None and self.values is not None
            keys[:rows, :, left : left + length] = self.keys[:rows]
            values[:rows, :, left : left + length] = self.values[:rows]
        self._key_buffer, self._value_buffer, self._start = keys, values, left
        self._set_view(rows, length)


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

    def stack(self, other: KVBatch, max_rows: int = 0) -> None:
        """Append `other`'s rows below this batch's, left-padding the shorter one (`max_rows`:
        the most rows the batch will hold, so that a new buffer has room for them)."""
        length = max(self.mask.shape[1], other.mask.shape[1])
        growing = self._growing()
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            if growing:
                mine.join(theirs.keys, theirs.values, max_rows)
                continue
            mine.keys = torch.cat([left_pad(mine.keys, length), left_pad(theirs.keys, length)])
            mine.values = torch.cat(
                [left_pad(mine.values, length), left_pad(theirs.values, length)]
            )
        self.mask = torch.cat([left_pad(self.mask, length), left_pad(other.mask, length)])

    def _growing(self) -> bool:
        """Whether the cache's layers are `GrowingLayer`s (they are all or none: `growing_cache`),
        whose rows join and leave in place."""
        layers = self.cache.layers
        return bool(layers) and all(isinstance(layer, GrowingLayer) for layer in layers)

    def grow(self) -> torch.Tensor:
        """Extend the mask by one real position per row; return the new tokens' positions (B, 1)."""
        ones = torch.ones((self.size, 1), dtype=self.mask.dtype, device=self.mask.device)
        self.mask = torch.cat([self.mask, ones], dim=1)
        return self.mask.sum(-1, keepdim=True) - 1

    def keep(self, rows: list[int]) -> list[int]:
        """Keep only `rows` (indices into the batch), then drop all-padding leading columns.
        Returns the old index of the row now in each position: growing layers fill a leaving
        row's place with one of the last rows instead of moving every row below it."""
        layers, growing = self.cache.layers, self._growing()
        if growing:
            order = fill_holes(self.size, rows)
            for layer in layers:
                layer.keep_rows(order)
        else:
            order = rows
            self.cache.batch_select_indices(torch.tensor(rows, device=self.mask.device))
        self.mask = self.mask[torch.tensor(order, dtype=torch.long, device=self.mask.device)]
        real = self.mask.any(dim=0).nonzero()
        start = int(real[0]) if len(real) else 0
        if start:
            for layer in layers:
                if growing:
                    layer.trim_left(start)
                else:
                    layer.keys = layer.keys[:, :, start:, :]
                    layer.values = layer.values[:, :, start:, :]
            self.mask = self.mask[:, start:]
        return order


def fill_holes(size: int, rows: list[int]) -> list[int]:
    """An order of the kept `rows` (of `size`) in which a row stays where it is unless its
    place is beyond the kept count: those fill, in turn, the places of the rows that leave."""
    kept = set(rows)
    count = len(kept)
    movers = iter(sorted(i for i in kept if i >= count))
    return [i if i in kept else next(movers) for i in range(count)]


def left_pad(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Left-pad dim 2 of a (B, H, L, D) cache tensor, or dim 1 of a (B, L) mask, with zeros."""
    dim = 2 if tensor.dim() == 4 else 1
    missing = length - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)
