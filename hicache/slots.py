"""`SlotPool`: the books of one pool of equal slots — which key each slot holds, who pins it, and
which slot goes next when space runs out.

Every pin count in hicache is taken and released here, through `Lease` objects: a holder (a
request waiting for its load, a copy in flight, an L3 put) gets a lease on its slots and releases
it exactly once. A pinned slot is never evicted or reused.

Invariants (checked by `check`):
- a slot is in exactly one of: free, reserved (allocated, not yet published), published;
- every published slot is in the LRU list (oldest first); eviction passes over pinned ones;
- the index maps each published key to its slot and nothing else.

The pool is not thread-safe: only the engine thread calls it. Bulk operations run through C-level
`map` calls and numpy so that a lookup of a thousand keys costs tens of microseconds.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from itertools import takewhile
from operator import is_not

import numpy as np

EvictHook = Callable[[list[bytes]], None]
_not_none = partial(is_not, None)


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


class SlotPool:
    """`capacity` slots indexed by 16-byte key, with pins and LRU eviction of unpinned slots."""

    def __init__(self, capacity: int, on_evict: EvictHook | None = None) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.index: dict[bytes, int] = {}
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
        return list(map(self.index.get, keys))

    def prefix(self, keys: Sequence[bytes]) -> list[int]:
        """Slots of the longest leading run of `keys` that this pool holds."""
        # stops at the first miss, at C speed: keys after it are never looked up
        return list(takewhile(_not_none, map(self.index.get, keys)))  # type: ignore[arg-type]

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

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
        free, lru = self._free, self._lru
        take = min(n, len(free))
        slots = [free.pop() for _ in range(take)]
        evicted: list[bytes] = []
        rotated = 0
        while len(slots) < n and rotated < len(lru):
            s, _ = lru.popitem(last=False)
            if self._refs[s]:  # pinned: in use, so recently used; look further
                lru[s] = None
                rotated += 1
                continue
            k = self._key[s]
            del self.index[k]  # type: ignore[arg-type]
            self._key[s] = None
            self._published[s] = False
            evicted.append(k)  # type: ignore[arg-type]
            slots.append(s)
        if evicted:
            self.evicted += len(evicted)
            if self._on_evict is not None:
                self._on_evict(evicted)
        self._pin(slots)
        return Lease(self, slots)

    def publish(self, slots: Iterable[int], keys: Iterable[bytes]) -> list[int]:
        """Make reserved `slots` findable under `keys`. Returns the slots whose key was new.

        A key that another slot already holds is not published twice: its reserved slot stays
        unpublished and returns to the free list when its lease is released.
        """
        index, key_of, fresh = self.index, self._key, []
        for s, k in zip(slots, keys):
            if key_of[s] is not None:
                raise RuntimeError(f"hicache: slot {s} is published already")
            if k in index:
                continue
            index[k] = s
            key_of[s] = k
            self._lru[s] = None
            fresh.append(s)
        self._published[fresh] = True
        return fresh

    # -- accounting -----------------------------------------------------------------------------

    @property
    def used(self) -> int:
        """Slots that hold a key."""
        return len(self.index)

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
            if published and self.index.get(key[s]) != s:  # type: ignore[arg-type]
                raise AssertionError(f"slot {s} is not indexed under its key")
            if published != (s in self._lru):
                raise AssertionError(f"slot {s}: published is {published}, in LRU is not")
            if not published and s not in free and refs[s] == 0:
                raise AssertionError(f"slot {s} is lost: not free, not published, not pinned")
        if len(self.index) != sum(k is not None for k in key):
            raise AssertionError("the index and the slots disagree")
