"""`SlotPool`: the books of one pool of equal slots — which key each slot holds, who pins it, and
which slot goes next when space runs out.

Every pin count in hicache is taken and released here, through `Lease` objects: a holder (a
request waiting for its load, a copy in flight, an L3 put) gets a lease on its slots and releases
it exactly once. A pinned slot is never evicted or reused.

Invariants (checked by `check`):
- a slot is in exactly one of: free, reserved (allocated, not yet published), published;
- every published slot is in the LRU list (oldest first); eviction passes over pinned ones;
- the index maps each published key to its slot and nothing else.

The pool is not thread-safe: only the engine thread calls it. Keys are looked up in batches
through `KeyIndex`, and pins, LRU order and the free list are kept by the slot books
(`hicache.core.native.books`): both compiled where a C compiler is present, so that a lookup of a
thousand keys costs tens of microseconds and a store of 64 pages a few.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from hicache.core.eviction import DEFAULT_POLICY
from hicache.core.native.books import slot_books
from hicache.core.native.index import key_index

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
        """Move the last `n` slots, with their pins, into a new lease (no pin is taken or
        dropped). Raises ValueError on a released lease or one with fewer slots. The slot list
        shrinks in place: O(n), however large the lease (the L3's fetch reserve is split this
        way at every fetch)."""
        if self._pool is None or not 0 <= n <= len(self.slots):
            raise ValueError(
                f"cannot split {n} slots off a lease of {len(self.slots)} (held: {self.held})"
            )
        keep = len(self.slots) - n
        taken = self.slots[keep:]
        del self.slots[keep:]
        return Lease(self._pool, taken)

    def absorb(self, other: Lease) -> None:
        """Move `other`'s slots and pins into this lease (its slot list grows in place); `other`
        is left released and empty."""
        if self._pool is None or other._pool is not self._pool:
            raise ValueError("leases of different pools, or a released one, cannot be merged")
        self.slots.extend(other.slots)
        other._pool, other.slots = None, []


class SlotPool:
    """`capacity` slots indexed by 16-byte key, with pins and eviction of unpinned slots by a
    policy (LRU unless told otherwise)."""

    def __init__(
        self,
        capacity: int,
        on_evict: EvictHook | None = None,
        *,
        compiled: bool = True,
        policy: str = DEFAULT_POLICY,
    ) -> None:
        """`compiled=False` keeps the books and the index in Python (tests compare the two).
        `policy` names the eviction policy (`hicache.core.eviction`); LRU's books are compiled, the
        others' are kept in Python over the same index."""
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.policy = policy
        self._index = key_index(capacity, compiled=compiled)
        self._books = slot_books(capacity, self._index, policy)
        self._on_evict = on_evict
        self.evicted = 0

    # -- lookups --------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> list[int | None]:
        """The slot of each key, or None."""
        return self._index.lookup(keys)

    def split(self, keys: Sequence[bytes]) -> tuple[list[int], list[int]]:
        """The slots of the keys held (in order), and the positions in `keys` of the others."""
        return self._index.split(keys)

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
        return self._books.key_of(slot)

    def keys_of(self, slots: Sequence[int]) -> list[bytes]:
        """The keys of published `slots`."""
        return self._books.keys_of(slots)

    # -- pins -----------------------------------------------------------------------------------

    def lease(self, slots: list[int]) -> Lease:
        """Pin published `slots` (distinct) until the returned lease is released."""
        self._books.pin(slots)
        return Lease(self, slots)

    def _unpin(self, slots: list[int]) -> None:
        """Drop one pin of each slot (a lease's release). Idle slots become the most recently
        used, from the last slot to the first: a sequence's first pages end up most recent, so
        its tail is evicted before its head. Reserved slots never published go back to the free
        list. Raises RuntimeError (changing nothing) if a slot holds no pin."""
        self._books.unpin(slots)

    # -- allocation -----------------------------------------------------------------------------

    def reserve(self, n: int) -> Lease:
        """Up to `n` fresh slots, pinned by the returned lease, evicting unpinned slots if needed.

        Eviction takes the least recently used unpinned slots (pinned ones met on the way are in
        use, so they become most recent) and tells `on_evict` their keys. The slots hold no key
        until `publish`; a lease released before that returns them to the free list. Fewer than
        `n` come back when every other slot is pinned.
        """
        slots, evicted = self._books.reserve(n)
        if evicted:
            self.evicted += evicted
            if self._on_evict is not None:  # the keys are made only for a hook that takes them
                self._on_evict(self._books.evicted_keys())
        return Lease(self, slots)

    def publish(self, slots: Sequence[int], keys: Sequence[bytes]) -> list[int]:
        """Make reserved `slots` findable under `keys`. Returns the slots whose key was new.

        A key that another slot already holds is not published twice: its reserved slot stays
        unpublished and returns to the free list when its lease is released. Raises
        RuntimeError (publishing nothing) if a slot is not reserved.
        """
        if not slots:
            return []
        return self._books.publish(slots, keys)

    # -- accounting -----------------------------------------------------------------------------

    @property
    def used(self) -> int:
        """Slots that hold a key."""
        return len(self._index)

    @property
    def pinned(self) -> int:
        """Slots that somebody pins."""
        return self._books.pinned

    @property
    def free(self) -> int:
        return self._books.free

    def lru(self) -> list[int]:
        """Published slots, least recently used first (tests and tools)."""
        return self._books.lru()

    def check(self) -> None:
        """Verify the invariants; raises AssertionError naming the first one broken (tests)."""
        books = self._books
        free_list, lru = books.free_list(), books.lru()
        free, in_lru = set(free_list), set(lru)
        if len(free) != len(free_list):
            raise AssertionError("a slot is on the free list twice")
        if len(in_lru) != len(lru):
            raise AssertionError("a slot is in the LRU list twice")
        for s in range(self.capacity):
            key = books.key_of(s)
            published, refs = key is not None, books.refs(s)
            if s in free and (published or refs):
                raise AssertionError(f"free slot {s} is published or pinned")
            if published and self._index.get(key) != s:  # type: ignore[arg-type]
                raise AssertionError(f"slot {s} is not indexed under its key")
            if published != (s in in_lru):
                raise AssertionError(f"slot {s}: published is {published}, in LRU is not")
            if not published and s not in free and refs == 0:
                raise AssertionError(f"slot {s} is lost: not free, not published, not pinned")
        if len(self._index) != len(lru):
            raise AssertionError("the index and the slots disagree")
