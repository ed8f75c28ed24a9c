"""The local engine's prefix cache: key/value tensors of finished requests, kept for the next one.

Agents resend their whole history on every call, so the prompt of turn k+1 usually starts with
the prompt of turn k, the answer it got (the generated tokens, not only the prompt) and then a few
new tokens. The engine stores each finished row's key/value tensors here under its token ids; a
new request looks up the entry that shares the longest prefix with its prompt and prefills only
the tokens after it.

What this module is:
- entries keyed by `(adapter identity, token ids)`. The identity changes on every adapter load
  (the engine gives each load a serial number), so a version loaded again under the same name
  never finds the KV of the weights it replaced; `drop` removes an unloaded adapter's entries;
- spans of KV shared between entries: an entry is a chain of `KVSpan`s, and a request that hit
  an entry stores its own entry as the hit's spans plus one new span for what it computed. A
  long session holds each token's KV once, however many turns it has; `bytes` counts every
  allocation once;
- bounded: least recently used entries go first once the allocations pass `max_bytes`, and an
  entry not used for `ttl_s` expires. `max_bytes` 0 turns the cache off;
- lookup is a longest-common-prefix scan over the entries (tens to hundreds), done on tensors.

What it is not: it never runs the model, and knows nothing of batches or padding (the engine
slices rows in and out; `proxy/engines/kv_batch.py` does the padding). Tensors are (1, H, T, D)
per layer and are never written to after they are stored: transformers' `DynamicCache` grows by
`torch.cat`, which allocates new tensors, so a cache row built on an entry's tensors leaves them
as they were.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch


class _Block:
    """One allocation of KV tensors; spans that are views of it share it (counted once)."""

    __slots__ = ("length", "nbytes")

    def __init__(self, length: int, nbytes: int) -> None:
        self.length = length
        self.nbytes = nbytes


@dataclass(frozen=True)
class KVSpan:
    """Key/value tensors of consecutive positions, one (1, H, T, D) pair per layer."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    block: _Block

    @classmethod
    def copy_of(cls, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> KVSpan:
        """A span that owns copies of `keys`/`values` (views of a batch would pin the batch)."""
        k = tuple(t.clone() for t in keys)
        v = tuple(t.clone() for t in values)
        nbytes = sum(t.numel() * t.element_size() for t in (*k, *v))
        return cls(k, v, _Block(int(k[0].shape[2]), nbytes))

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[2])

    def head(self, n: int) -> KVSpan:
        """Its first `n` positions, as views of the same allocation."""
        if n >= self.length:
            return self
        return KVSpan(
            tuple(t[:, :, :n] for t in self.keys),
            tuple(t[:, :, :n] for t in self.values),
            self.block,
        )

    def detached(self) -> KVSpan:
        """This span, copied if it is only part of its allocation: a stored entry that kept a
        view would hold the whole allocation alive (and count it) for a few of its positions."""
        if self.length == self.block.length:
            return self
        return KVSpan.copy_of(self.keys, self.values)


def head_of(spans: Sequence[KVSpan], n: int) -> tuple[KVSpan, ...]:
    """The spans that cover the first `n` positions of a chain (the last one cut)."""
    out: list[KVSpan] = []
    left = n
    for span in spans:
        if left <= 0:
            break
        out.append(span.head(left))
        left -= span.length
    return tuple(out)


@dataclass(eq=False)  # entries are compared by identity
class _Entry:
    key: Hashable
    ids: torch.Tensor  # (T,) int64: the tokens whose KV the spans hold
    spans: tuple[KVSpan, ...]
    last_used: float

    def __post_init__(self) -> None:
        assert sum(s.length for s in self.spans) == len(self.ids), "spans must cover the ids"


@dataclass(frozen=True)
class Hit:
    """The longest stored prefix of a prompt: its first `length` tokens' KV."""

    length: int
    spans: tuple[KVSpan, ...]  # exactly `length` positions


@dataclass
class CacheStats:
    prompt_tokens: int = 0  # prompt tokens of every lookup
    hit_tokens: int = 0  # of those, the ones whose KV came from the cache (counted by the engine)
    inserted: int = 0
    evicted: int = 0  # entries dropped for room (least recently used first)
    expired: int = 0  # entries dropped for being unused for `ttl_s`
    dropped: int = 0  # entries of unloaded adapters


@dataclass
class PrefixCache:
    """Longest-prefix KV lookup by adapter identity, bounded by bytes, LRU, with a TTL."""

    max_bytes: int
    ttl_s: float = 1800.0
    clock: Callable[[], float] = time.monotonic
    stats: CacheStats = field(default_factory=CacheStats)
    _entries: list[_Entry] = field(default_factory=list)
    _blocks: dict[int, tuple[_Block, int]] = field(default_factory=dict)  # id -> (block, refs)
    _bytes: int = 0  # kept as entries come and go: `health` reads it from another thread
    _expired_at: float = float("-inf")

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def bytes(self) -> int:
        """Bytes of every allocation some entry holds (a shared span counted once)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: Hashable, prompt_ids: Sequence[int]) -> Hit | None:
        """The longest stored prefix of `prompt_ids` under `key`, at most all but its last token
        (the model must run that one for the logits of the first new token)."""
        if not self.enabled or len(prompt_ids) < 2:
            return None
        self.expire()
        ids = torch.tensor(prompt_ids, dtype=torch.long)
        limit = len(prompt_ids) - 1
        best: _Entry | None = None
        best_length = 0
        for entry in self._entries:
            if entry.key != key or entry.ids[0] != ids[0]:
                continue
            length = _common_prefix(entry.ids, ids, limit)
            if length > best_length:
                best, best_length = entry, length
        if best is None:
            return None
        best.last_used = self.clock()
        return Hit(best_length, head_of(best.spans, best_length))

    def insert(self, key: Hashable, ids: Sequence[int], spans: Sequence[KVSpan]) -> None:
        """Store `spans` (the KV of `ids`) under `key`; entries it extends are replaced by it."""
        if not self.enabled or not ids:
            return
        self.expire()
        now = self.clock()
        new = torch.tensor(ids, dtype=torch.long)
        for entry in list(self._entries):
            if entry.key != key:
                continue
            shorter, longer = sorted((entry.ids, new), key=len)
            if _common_prefix(shorter, longer, len(shorter)) == len(shorter):
                if longer is entry.ids:  # already held by a longer entry
                    entry.last_used = now
                    return
                self._remove(entry)  # the new entry extends it: keep one
        self._add(_Entry(key, new, tuple(spans), now))
        self.stats.inserted += 1
        self._evict()

    def drop(self, key: Hashable) -> None:
        """Forget every entry of `key` (an adapter that was unloaded)."""
        for entry in [e for e in self._entries if e.key == key]:
            self._remove(entry)
            self.stats.dropped += 1

    def expire(self) -> None:
        """Drop entries not used for `ttl_s` (looked at once a second at most)."""
        now = self.clock()
        if now - self._expired_at < 1.0:
            return
        self._expired_at = now
        cutoff = now - self.ttl_s
        for entry in [e for e in self._entries if e.last_used < cutoff]:
            self._remove(entry)
            self.stats.expired += 1

    def clear(self) -> None:
        for entry in list(self._entries):
            self._remove(entry)

    def health(self) -> dict[str, object]:
        s = self.stats
        return {
            "enabled": self.enabled,
            "max_bytes": self.max_bytes,
            "bytes": self.bytes,
            "entries": len(self._entries),
            "ttl_s": self.ttl_s,
            "query_tokens": s.prompt_tokens,
            "hit_tokens": s.hit_tokens,
            "hit_rate": round(s.hit_tokens / s.prompt_tokens, 4) if s.prompt_tokens else None,
            "evicted": s.evicted,
            "expired": s.expired,
        }

    def _evict(self) -> None:
        while self._entries and self.bytes > self.max_bytes:
            oldest = min(self._entries, key=lambda e: e.last_used)
            self._remove(oldest)
            self.stats.evicted += 1

    def _add(self, entry: _Entry) -> None:
        self._entries.append(entry)
        for block in {id(s.block): s.block for s in entry.spans}.values():
            held, refs = self._blocks.get(id(block), (block, 0))
            self._blocks[id(block)] = (held, refs + 1)
            if refs == 0:
                self._bytes += block.nbytes

    def _remove(self, entry: _Entry) -> None:
        self._entries.remove(entry)
        for block_id in {id(s.block) for s in entry.spans}:
            block, refs = self._blocks[block_id]
            if refs <= 1:
                del self._blocks[block_id]
                self._bytes -= block.nbytes
            else:
                self._blocks[block_id] = (block, refs - 1)


def _common_prefix(a: torch.Tensor, b: torch.Tensor, limit: int) -> int:
    """How many leading ids `a` and `b` share, at most `limit`."""
    n = min(len(a), len(b), limit)
    if n <= 0:
        return 0
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n
