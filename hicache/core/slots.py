"""`SlotPool`: the books of one pool of equal slots — which key each slot holds, who pins it, and
which slot goes next when space runs out.

Every pin count in hicache is taken and released here, through `Lease` objects: a holder (a
request waiting for its load, a copy in flight, an L3 put) gets a lease on its slots and releases
it exactly once. A pinned slot is never evicted or reused.

Invariants (checked by `check`):
- a slot is in exactly one of: free, reserved (allocated, not yet published), published;
- every published slot is in the LRU list (oldest first); eviction passes over pinned ones;
- the index maps each published key to its slot and nothing else.

The pool is not thread-safe: only the engine thread calls it. Layering: keys are looked up in
batches through `KeyIndex` (`hicache.core.native.index`), and pins, leases, LRU order, the free
list and the eviction hook are kept by the slot books (`hicache.core.native.books`), both
compiled where a C compiler is present (a lookup of a thousand keys costs tens of microseconds,
a store of 64 pages a few). The pool adds no layer of its own on the engine thread's path: it
binds the index's and the books' methods as its own attributes, so a lookup, a lease, a reserve
or a publish is one Python call around one C call, and a lease's release two.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from hicache.core.eviction import DEFAULT_POLICY
from hicache.core.native.books import Books, EvictHook, Lease, slot_books
from hicache.core.native.index import key_index
from hicache.core.shares import Shares, TenantBooks

__all__ = ["EvictHook", "Lease", "SlotPool"]


class SlotPool:
    """`capacity` slots indexed by 16-byte key, with pins and eviction of unpinned slots by a
    policy (LRU unless told otherwise).

    Operations (bound in `__init__` to the index's and the books' methods; contracts here):

    - ``lookup(keys) -> list[int | None]``: the slot of each key, or None.
    - ``split(keys) -> (slots, missing)``: the slots of the keys held (in order), and the
      positions in `keys` of the others.
    - ``prefix(keys) -> list[int]``: slots of the longest leading run of `keys` that this pool
      holds (keys after the first miss are never looked up).
    - ``walk(prev, pages) -> (keys, slots) | None``: hash `pages` (int32 [n, page_tokens])
      chained from key `prev` while this pool holds their keys: the keys hashed (up to the pair
      with the first miss) and the slots of the leading run held. None where the compiled
      helpers are missing.
    - ``slot_of(key) -> int | None``; ``key in pool``.
    - ``key_of(slot) -> bytes | None``; ``keys_of(slots) -> list[bytes]``: the keys of
      published `slots`.
    - ``lease(slots) -> Lease``: pin published `slots` (distinct) until the returned lease is
      released. The release drops one pin of each slot; idle slots become the most recently
      used, from the last slot to the first (a sequence's first pages end up most recent, so its
      tail is evicted before its head); reserved slots never published go back to the free list.
      Releasing a slot that holds no pin raises RuntimeError, changing nothing.
    - ``reserve(n) -> Lease``: up to `n` fresh slots, pinned by the returned lease, evicting
      unpinned slots if needed. Eviction takes the least recently used unpinned slots (pinned
      ones met on the way are in use, so they become most recent), counts them in `evicted` and
      tells `on_evict` their keys. The slots hold no key until ``publish``; a lease released
      before that returns them to the free list. Fewer than `n` come back when every other slot
      is pinned.
    - ``publish(slots, keys) -> list[int]``: make reserved `slots` findable under `keys`;
      returns the slots whose key was new. A key that another slot already holds is not
      published twice: its reserved slot stays unpublished and returns to the free list when its
      lease is released. Raises RuntimeError (publishing nothing) if a slot is not reserved.
    """

    lookup: Callable[[Sequence[bytes]], list[int | None]]
    split: Callable[[Sequence[bytes]], tuple[list[int], list[int]]]
    prefix: Callable[[Sequence[bytes]], list[int]]
    walk: Callable[[bytes, np.ndarray], tuple[list[bytes], list[int]] | None]
    slot_of: Callable[[bytes], int | None]
    key_of: Callable[[int], bytes | None]
    keys_of: Callable[[Sequence[int]], list[bytes]]
    lease: Callable[[list[int]], Lease]
    reserve: Callable[[int], Lease]
    publish: Callable[[Sequence[int], Sequence[bytes]], list[int]]
    publish_as: Callable[[Sequence[int], Sequence[bytes], bytes], list[int]]
    """``publish_as(slots, keys, seed)``: `publish` for the tenant of the request whose chain
    seed is `seed` (`hicache.core.shares`; without tenants' shares, `publish`)."""
    settle: Callable[[], None]
    """Evict what tenants hold past their quotas since their pages went idle (between two
    engine calls; nothing without tenants' shares)."""
    reserve_as: Callable[[int, bytes], Lease]
    """``reserve_as(n, seed)``: `reserve` for the tenant of chain seed `seed`, which may evict
    its own pages within its share (without tenants' shares, `reserve`)."""

    def __init__(
        self,
        capacity: int,
        on_evict: EvictHook | None = None,
        *,
        compiled: bool = True,
        policy: str = DEFAULT_POLICY,
        shares: Shares | None = None,
    ) -> None:
        """`compiled=False` keeps the books and the index in Python (tests compare the two).
        `policy` names the eviction policy (`hicache.core.eviction`); LRU's books are compiled, the
        others' are kept in Python over the same index. `shares`: the tenants' shares and quotas
        (`hicache.core.shares`), kept by LRU per tenant in Python books."""
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.policy = policy
        index = self._index = key_index(capacity, compiled=compiled)
        books: Books
        if shares is not None:
            books = TenantBooks(capacity, index, shares, on_evict)
        else:
            books = slot_books(capacity, index, policy, on_evict)
        self._books = books
        # the operations, bound: no call of the pool's own between the caller and the C call
        self.lookup = index.lookup
        self.split = index.split
        self.prefix = index.prefix
        self.walk = index.walk
        self.slot_of = index.get
        self.key_of = books.key_of
        self.keys_of = books.keys_of
        self.lease = books.lease
        self.reserve = books.reserve
        self.publish = publish = books.publish
        self.publish_as = getattr(books, "publish_as", None) or (
            lambda slots, keys, _seed: publish(slots, keys)
        )
        reserve = books.reserve
        self.reserve_as = getattr(books, "reserve_as", None) or (lambda n, _seed: reserve(n))
        self.settle = getattr(books, "settle", None) or _nothing
        self.shares = shares

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    @property
    def evicted(self) -> int:
        """Slots evicted so far."""
        return self._books.evicted

    def tenant_stats(self) -> dict[str, int]:
        """Per tenant with shares (`shares`): ``tenant_host_pages_<name>`` (slots it holds) and
        ``tenant_host_evicted_<name>`` (its slots evicted so far); empty without shares."""
        books = self._books
        if not isinstance(books, TenantBooks):
            return {}
        out: dict[str, int] = {}
        for t, name in enumerate(books.shares.names):
            name = name or "none"
            out[f"tenant_host_pages_{name}"] = books.used[t]
            out[f"tenant_host_evicted_{name}"] = books.evicted_of[t]
        return out

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


def _nothing() -> None:
    """`settle` of books without tenants' quotas."""
