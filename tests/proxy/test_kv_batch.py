"""The running batch's cache bookkeeping: rows joining, growing and leaving in a buffer with
spare room (`GrowingLayer`) hold exactly what transformers' concatenating `DynamicLayer`
holds, and a join or a leave that fits the room copies only the rows that move.

Hand-made tensors; the engine's outputs over the same code are tested with the real model in
test_prefix_cache.py and test_prefill_scheduling.py.
"""

from __future__ import annotations

import random

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from proxy.engines.kv_batch import GrowingLayer, KVBatch, fill_holes

LAYERS, HEADS, DIM = 2, 3, 4


def cache_of(layer_type: type, rows: int, length: int, seed: int) -> KVBatch:
    """`rows` rows of `length` positions, the first row full, the others left-padded."""
    gen = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    cache.layers = [layer_type() for _ in range(LAYERS)]
    mask = torch.ones(rows, length, dtype=torch.long)
    for b in range(1, rows):
        mask[b, : b % length] = 0
    for layer in cache.layers:
        k = torch.randn(rows, HEADS, length, DIM, generator=gen) * mask[:, None, :, None]
        v = torch.randn(rows, HEADS, length, DIM, generator=gen) * mask[:, None, :, None]
        layer.update(k, v)
    return KVBatch(cache, mask)


def assert_same(growing: KVBatch, plain: KVBatch) -> None:
    assert torch.equal(growing.mask, plain.mask)
    for g, p in zip(growing.cache.layers, plain.cache.layers, strict=True):
        assert torch.equal(g.keys, p.keys) and torch.equal(g.values, p.values)


def step(batch: KVBatch, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch.grow()
    for layer in batch.cache.layers:
        layer.update(
            torch.randn(batch.size, HEADS, 1, DIM, generator=gen),
            torch.randn(batch.size, HEADS, 1, DIM, generator=gen),
        )


def test_fill_holes_moves_only_rows_from_beyond_the_kept_count() -> None:
    assert fill_holes(8, [0, 1, 2, 3, 4, 5, 6]) == [0, 1, 2, 3, 4, 5, 6]
    assert fill_holes(8, [1, 2, 5, 7]) == [5, 1, 2, 7]
    assert fill_holes(4, [3]) == [3]


def test_joins_steps_and_leaves_hold_what_concatenation_holds() -> None:
    rng = random.Random(0)
    growing = cache_of(GrowingLayer, 2, 6, seed=1)
    plain = cache_of(DynamicLayer, 2, 6, seed=1)
    for n in range(120):
        action = rng.random()
        if action < 0.25 and growing.size < 10:  # a newcomer, shorter or longer than the batch
            rows, length = rng.randint(1, 3), rng.randint(1, growing.mask.shape[1] + 12)
            growing.stack(cache_of(GrowingLayer, rows, length, seed=100 + n), max_rows=10)
            plain.stack(cache_of(DynamicLayer, rows, length, seed=100 + n))
        elif action < 0.45 and growing.size > 1:  # some rows finish
            kept = sorted(rng.sample(range(growing.size), rng.randint(1, growing.size - 1)))
            order = growing.keep(kept)
            assert sorted(order) == kept
            assert plain.keep(order) == order  # the plain batch, put in the same order
        else:
            step(growing, seed=n)
            step(plain, seed=n)
        assert_same(growing, plain)


def test_a_join_that_fits_the_room_copies_no_row_already_in_the_batch() -> None:
    batch = cache_of(GrowingLayer, 1, 40, seed=1)
    batch.stack(cache_of(GrowingLayer, 1, 40, seed=2), max_rows=8)  # a new buffer, room for 8
    layer = batch.cache.layers[0]
    buffer = layer._key_buffer
    first_row = layer.keys[0].clone()
    for n in range(3):  # shorter, then longer (the batch widens to the left), in place
        batch.stack(cache_of(GrowingLayer, 1, 30 + 8 * n, seed=3 + n), max_rows=8)
        assert layer._key_buffer is buffer
    assert torch.equal(layer.keys[0, :, -40:], first_row)
    order = batch.keep([0, 2, 3, 4])  # row 1 leaves: the last row takes its place
    assert order == [0, 4, 2, 3] and layer._key_buffer is buffer


def test_a_tensor_put_in_from_outside_is_copied_never_written() -> None:
    batch = cache_of(GrowingLayer, 2, 5, seed=1)
    layer = batch.cache.layers[0]
    outside = layer.keys.clone()
    layer.keys, layer.values = outside, outside.clone()  # as transformers' own methods do
    before = outside.clone()
    step(batch, seed=1)
    batch.stack(cache_of(GrowingLayer, 1, 9, seed=2), max_rows=4)
    batch.keep([1, 2])
    assert torch.equal(outside, before)
