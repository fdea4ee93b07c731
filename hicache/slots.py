"""`SlotPool`: the books of one pool of equal slots — which key each slot holds, who pins it, and
which slot goes next when space runs out.

Every pin count in hicache is taken and released here, through `Lease` objects: a holder (a
request waiting for its load, a copy in flight, an L3 put) gets a lease on its slots and releases
it exactly once. A pinned slot is never evicted or reused.

Invariants (checked by `check`):
- a slot is in exactly one of: free, reserved (allocated, not yet published), published;
- every published slot is in the LRU list (oldest first); eviction passes over pinned ones;
- the index maps each published key to its slot and nothing else.

The pool is not thread-safe: only the engine thread calls it. Keys are looked up, added and removed
in batches through `KeyIndex` (compiled where a C compiler is present), pins through numpy, so
that a lookup of a thousand keys costs tens of microseconds.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from itertools import compress, islice

import numpy as np

from hicache.native.index import key_index

EvictHook = Callable[[list[bytes]], None]


class Lease:
    """Pins on a list of slots, released exactly once (further releases do nothing)."""

    __slots__ = ("_pool", "slots")

    def __init__(self, pool: SlotPool, slots: list[int]) -> None:
        self._pool: SlotPool | None = pool
        self.slots = slots

    @property
    def held(self) -> bool:
        return self._pool is not None

    def release(self) -> None:
        """Drop the pins; slots nobody pins any more become evictable (the first most recent)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._unpin(self.slots)

    def __len__(self) -> int:
        return len(self.slots)

    def split(self, n: int) -> Lease:
        """Move the first `n` slots, with their pins, into a new lease (no pin is taken or
        dropped). Raises ValueError on a released lease or one with fewer slots."""
        if self._pool is None or n > len(self.slots):
            raise ValueError(
                f"cannot split {n} slots off a lease of {len(self.slots)} (held: {self.held})"
            )
        taken, self.slots = self.slots[:n], self.slots[n:]
        return Lease(self._pool, taken)

    def absorb(self, other: Lease) -> None:
        """Move `other`'s slots and pins into this lease; `other` is left released and empty."""
        if self._pool is None or other._pool is not self._pool:
            raise ValueError("leases of different pools, or a released one, cannot be merged")
        self.slots = self.slots + other.slots
        other._pool, other.slots = None, []


class SlotPool:
    """`capacity` slots indexed by 16-byte key, with pins and LRU eviction of unpinned slots."""

    def __init__(self, capacity: int, on_evict: EvictHook | None = None) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._index = key_index(capacity)
        self._key: list[bytes | None] = [None] * capacity
        self._refs = np.zeros(capacity, dtype=np.int32)
        self._published = np.zeros(capacity, dtype=bool)
        self._lru: OrderedDict[int, None] = OrderedDict()  # published slots, oldest first
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._on_evict = on_evict
        self.evicted = 0

    # -- lookups --------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> list[int | None]:
        """The slot of each key, or None."""
        return self._index.lookup(keys)

    def prefix(self, keys: Sequence[bytes]) -> list[int]:
        """Slots of the longest leading run of `keys` that this pool holds (keys after the first
        miss are never looked up)."""
        return self._index.prefix(keys)

    def walk(self, prev: bytes, pages: np.ndarray) -> tuple[list[bytes], list[int]] | None:
        """Hash `pages` (int32 [n, page_tokens]) chained from key `prev` while this pool holds
        their keys: the keys hashed (up to the pair with the first miss) and the slots of the
        leading run held. None where the compiled helpers are missing."""
        return self._index.walk(prev, pages)

    def slot_of(self, key: bytes) -> int | None:
        return self._index.get(key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def key_of(self, slot: int) -> bytes | None:
        return self._key[slot]

    # -- pins -----------------------------------------------------------------------------------

    def lease(self, slots: list[int]) -> Lease:
        """Pin published `slots` (distinct) until the returned lease is released."""
        self._pin(slots)
        return Lease(self, slots)

    def _pin(self, slots: list[int]) -> None:
        if slots:
            self._refs[np.asarray(slots, dtype=np.int64)] += 1

    def _unpin(self, slots: list[int]) -> None:
        if not slots:
            return
        idx = np.asarray(slots, dtype=np.int64)
        refs = self._refs
        refs[idx] -= 1
        if refs[idx].min() < 0:
            raise RuntimeError("hicache: a slot was unpinned more often than pinned")
        # Idle slots become the most recently used, from the last slot to the first: a sequence's
        # first pages end up most recent, so its tail is evicted before its head.
        idle = idx[refs[idx] == 0][::-1]
        published = self._published[idle]
        deque(map(self._lru.move_to_end, idle[published].tolist()), maxlen=0)
        self._free.extend(idle[~published].tolist())  # reserved, never published

    # -- allocation -----------------------------------------------------------------------------

    def reserve(self, n: int) -> Lease:
        """Up to `n` fresh slots, pinned by the returned lease, evicting unpinned slots if needed.

        The slots hold no key until `publish`; a lease released before that returns them to the
        free list. Fewer than `n` come back when every other slot is pinned.
        """
        free = self._free
        take = min(n, len(free))
        slots = free[len(free) - take :][::-1]  # the free list is a stack: last in, first out
        del free[len(free) - take :]
        if take < n:
            slots += self._evict(n - take)
        self._pin(slots)
        return Lease(self, slots)

    def _evict(self, n: int) -> list[int]:
        """Unpublish up to `n` unpinned slots, least recently used first, and return them.

        Pinned slots met on the way are in use, so recently used: they move to the end of the
        LRU list. Looks at each slot at most once; fewer than `n` come back when all are pinned.
        """
        lru, refs, key_of = self._lru, self._refs, self._key
        chosen: list[int] = []
        unseen = len(lru)
        while len(chosen) < n and unseen:
            window = min(unseen, 2 * (n - len(chosen)) + 8)
            cand = np.fromiter(islice(lru, window), dtype=np.int64, count=window)
            pinned = refs[cand] != 0
            free_at = np.flatnonzero(~pinned)
            need = n - len(chosen)
            seen = int(free_at[need - 1]) + 1 if len(free_at) >= need else window
            unseen -= seen
            take = cand[:seen][~pinned[:seen]].tolist()
            deque(map(lru.move_to_end, cand[:seen][pinned[:seen]].tolist()), maxlen=0)
            deque(map(lru.pop, take), maxlen=0)
            chosen += take
        if not chosen:
            return chosen
        evicted = [key_of[s] for s in chosen]
        for s in chosen:
            key_of[s] = None
        self._published[chosen] = False
        self._index.remove(evicted)  # type: ignore[arg-type]
        self.evicted += len(evicted)
        if self._on_evict is not None:
            self._on_evict(evicted)  # type: ignore[arg-type]
        return chosen

    def publish(self, slots: Sequence[int], keys: Sequence[bytes]) -> list[int]:
        """Make reserved `slots` findable under `keys`. Returns the slots whose key was new.

        A key that another slot already holds is not published twice: its reserved slot stays
        unpublished and returns to the free list when its lease is released.
        """
        if not slots:
            return []
        key_of = self._key
        for s in slots:
            if key_of[s] is not None:
                raise RuntimeError(f"hicache: slot {s} is published already")
        new = self._index.insert(keys, slots)
        fresh = list(compress(slots, new))
        for s, k in zip(fresh, compress(keys, new)):
            key_of[s] = k
        self._lru.update(dict.fromkeys(fresh))
        self._published[fresh] = True
        return fresh

    # -- accounting -----------------------------------------------------------------------------

    @property
    def used(self) -> int:
        """Slots that hold a key."""
        return len(self._index)

    @property
    def pinned(self) -> int:
        """Slots that somebody pins."""
        return int(np.count_nonzero(self._refs))

    @property
    def free(self) -> int:
        return len(self._free)

    def check(self) -> None:
        """Verify the invariants; raises AssertionError naming the first one broken (tests)."""
        refs, key = self._refs, self._key
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a slot is on the free list twice")
        for s in range(self.capacity):
            published = key[s] is not None
            if published != self._published[s]:
                raise AssertionError(f"slot {s}: published flag disagrees with its key")
            if s in free and (published or refs[s]):
                raise AssertionError(f"free slot {s} is published or pinned")
            if published and self._index.get(key[s]) != s:  # type: ignore[arg-type]
                raise AssertionError(f"slot {s} is not indexed under its key")
            if published != (s in self._lru):
                raise AssertionError(f"slot {s}: published is {published}, in LRU is not")
            if not published and s not in free and refs[s] == 0:
                raise AssertionError(f"slot {s} is lost: not free, not published, not pinned")
        if len(self._index) != sum(k is not None for k in key):
            raise AssertionError("the index and the slots disagree")
