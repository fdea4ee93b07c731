"""The books of a `SlotPool`: pins (handed out as `Lease`s), LRU order, the free stack, the
key of each slot, and the eviction hook.

`slot_books(capacity, index)` gives `CompiledBooks` (``slotbook.c``, sharing the compiled key
index's table) where the key index is compiled, and `PythonBooks` otherwise (`PolicyBooks` for
an eviction policy other than LRU). They do exactly the same thing — the tests drive them side by
side and compare — and the compiled one does it in one C call per operation instead of a few
Python operations per slot (a 64-page store: ~10 µs instead of ~150 µs).

`SlotPool` (hicache/core/slots.py) binds the books' ``lease``, ``reserve``, ``publish``,
``key_of`` and ``keys_of`` as its own methods (their contracts are stated there), and a
`Lease`'s release calls the books' ``unpin``: in the compiled books each of these is one Python
call around one C call. Slot lists go in and come out as lists of ints. Engine thread only.
"""

from __future__ import annotations

import ctypes
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from itertools import compress, islice

import numpy as np

from hicache.core import native
from hicache.core.eviction import DEFAULT_POLICY, EvictionPolicy, make_policy
from hicache.core.marks import mark
from hicache.core.native.index import KEY_BYTES, KeyIndex, _bad_keys, _TableIndex

__all__ = [
    "Books",
    "CompiledBooks",
    "EvictHook",
    "Lease",
    "PolicyBooks",
    "PythonBooks",
    "slot_books",
]

EvictHook = Callable[[list[bytes]], None]

_FREE, _RESERVED, _PUBLISHED = 0, 1, 2


class _Struct(ctypes.Structure):
    """``Books`` of slotbook.c."""

    _fields_ = [
        ("table", ctypes.c_void_p),
        ("mask", ctypes.c_uint64),
        ("index_len", ctypes.c_void_p),
        ("cap", ctypes.c_int64),
        ("refs", ctypes.c_void_p),
        ("state", ctypes.c_void_p),
        ("keys", ctypes.c_void_p),
        ("prev", ctypes.c_void_p),
        ("next", ctypes.c_void_p),
        ("head", ctypes.c_int32),
        ("tail", ctypes.c_int32),
        ("lru_len", ctypes.c_int64),
        ("free_stack", ctypes.c_void_p),
        ("n_free", ctypes.c_int64),
    ]


class Lease:
    """Pins on a list of slots, released exactly once (further releases do nothing)."""

    __slots__ = ("_books", "slots")

    def __init__(self, books: Books, slots: list[int]) -> None:
        self._books: Books | None = books
        self.slots = slots

    @property
    def held(self) -> bool:
        return self._books is not None

    def release(self) -> None:
        """Drop the pins (the books' ``unpin``); slots nobody pins any more become evictable
        (the first most recent)."""
        books, self._books = self._books, None
        if books is not None:
            books.unpin(self.slots)

    def __len__(self) -> int:
        return len(self.slots)

    def split(self, n: int) -> Lease:
        """Move the last `n` slots, with their pins, into a new lease (no pin is taken or
        dropped). Raises ValueError on a released lease or one with fewer slots. The slot list
        shrinks in place: O(n), however large the lease (the L3's fetch reserve is split this
        way at every fetch)."""
        if self._books is None or not 0 <= n <= len(self.slots):
            raise ValueError(
                f"cannot split {n} slots off a lease of {len(self.slots)} (held: {self.held})"
            )
        keep = len(self.slots) - n
        taken = self.slots[keep:]
        del self.slots[keep:]
        return Lease(self._books, taken)

    def absorb(self, other: Lease) -> None:
        """Move `other`'s slots and pins into this lease (its slot list grows in place); `other`
        is left released and empty."""
        if self._books is None or other._books is not self._books:
            raise ValueError("leases of different pools, or a released one, cannot be merged")
        self.slots.extend(other.slots)
        other._books, other.slots = None, []


def _over_unpinned() -> RuntimeError:
    return RuntimeError("hicache: a slot was unpinned more often than pinned")


class CompiledBooks:
    """The books in C (slotbook.c) over numpy arrays, next to the compiled key index. Methods
    and their contracts: `SlotPool`'s (``lease``, ``reserve``, ``publish``, ...), and
    ``unpin(slots)``, a lease's release."""

    def __init__(
        self, capacity: int, index: _TableIndex, lib: ctypes.CDLL, on_evict: EvictHook | None
    ) -> None:
        self.capacity = capacity
        self.on_evict = on_evict
        self.evicted = 0
        """Slots evicted so far."""
        self._refs = np.zeros(capacity, dtype=np.int32)
        self._state = np.zeros(capacity, dtype=np.uint8)
        self._keys = np.zeros(capacity, dtype=f"V{KEY_BYTES}")
        self._links = np.full((2, capacity), -1, dtype=np.int32)  # prev, next
        self._free_stack = np.arange(capacity - 1, -1, -1, dtype=np.int32)
        table, mask = index.table
        self._count = index.count  # kept alive with the struct that points at it
        self._b = _Struct(
            table,
            mask,
            index.count.ctypes.data,
            capacity,
            self._refs.ctypes.data,
            self._state.ctypes.data,
            self._keys.ctypes.data,
            self._links[0].ctypes.data,
            self._links[1].ctypes.data,
            -1,
            -1,
            0,
            self._free_stack.ctypes.data,
            capacity,
        )
        self._ref = ctypes.byref(self._b)
        self._pin_c, self._unpin_c = lib.hicache_books_pin, lib.hicache_books_unpin
        self._reserve_c, self._publish_c = lib.hicache_books_reserve, lib.hicache_books_publish
        self._lru_c = lib.hicache_books_lru
        self._out = array("i", bytes(4 * max(capacity, 1)))  # reserve's slots
        self._fresh = array("B", bytes(max(capacity, 1)))  # publish's new-key flags
        self._fresh_at = self._fresh.buffer_info()[0]
        self._evicted = np.zeros(max(capacity, 1), dtype=f"V{KEY_BYTES}")
        self._n_evicted = ctypes.c_int64()
        # reserve's arguments that never change, made once (each costs ~1 µs to make)
        self._reserve_out = (
            self._out.buffer_info()[0],
            self._evicted.ctypes.data,
            ctypes.byref(self._n_evicted),
        )

    def lease(self, slots: list[int]) -> Lease:
        if slots:
            ids = array("i", slots)  # a name keeps it alive through the call
            if self._pin_c(self._ref, ids.buffer_info()[0], len(ids)):
                raise ValueError(f"slots out of range 0..{self.capacity - 1}: {list(slots)[:8]}")
        return Lease(self, slots)

    def unpin(self, slots: Sequence[int]) -> None:
        if not slots:
            return
        ids = array("i", slots)
        if self._unpin_c(self._ref, ids.buffer_info()[0], len(ids)):
            raise _over_unpinned()

    def reserve(self, n: int) -> Lease:
        got = self._reserve_c(self._ref, min(n, self.capacity), *self._reserve_out)
        lease = Lease(self, self._out[:got].tolist())  # before the hook, which may call us
        evicted = self._n_evicted.value
        if evicted:
            mark("host.evict.lru")
            self.evicted += evicted
            if self.on_evict is not None:  # the keys are made only for a hook that takes them
                self.on_evict(self._evicted[:evicted].tolist())
        return lease

    def publish(self, slots: Sequence[int], keys: Sequence[bytes]) -> list[int]:
        n = len(slots)
        if not n:
            return []
        if len(keys) != n:
            raise ValueError(f"{len(keys)} keys but {n} slots")
        packed = b"".join(keys)
        if len(packed) != KEY_BYTES * n:
            raise _bad_keys()
        ids = array("i", slots)
        done = self._publish_c(self._ref, ids.buffer_info()[0], packed, n, self._fresh_at)
        if done < 0:
            raise RuntimeError(f"hicache: slot {slots[-1 - done]} is not reserved (published?)")
        return list(compress(slots, self._fresh[:n]))

    def key_of(self, slot: int) -> bytes | None:
        return self._keys[slot].tobytes() if self._state[slot] == _PUBLISHED else None

    def keys_of(self, slots: Sequence[int]) -> list[bytes]:
        """Keys of published `slots`."""
        return self._keys[np.asarray(slots, dtype=np.int64)].tolist()

    def refs(self, slot: int) -> int:
        return int(self._refs[slot])

    @property
    def pinned(self) -> int:
        return int(np.count_nonzero(self._refs))

    @property
    def free(self) -> int:
        return int(self._b.n_free)

    def free_list(self) -> list[int]:
        return self._free_stack[: self._b.n_free].tolist()

    def lru(self) -> list[int]:
        out = array("i", bytes(4 * max(self._b.lru_len, 1)))
        n = self._lru_c(self._ref, out.buffer_info()[0])
        return out[:n].tolist()


class PythonBooks:
    """The same books in Python (an OrderedDict for the LRU list), where nothing is compiled."""

    def __init__(self, capacity: int, index: KeyIndex, on_evict: EvictHook | None) -> None:
        self.capacity = capacity
        self.on_evict = on_evict
        self.evicted = 0
        """Slots evicted so far."""
        self._index = index
        self._key: list[bytes | None] = [None] * capacity
        self._refs = np.zeros(capacity, dtype=np.int32)
        self._published = np.zeros(capacity, dtype=bool)
        self._lru: OrderedDict[int, None] = OrderedDict()  # published slots, oldest first
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._evict_mark = "host.evict.lru"

    def lease(self, slots: list[int]) -> Lease:
        self._pin(slots)
        return Lease(self, slots)

    def _pin(self, slots: Sequence[int]) -> None:
        if slots:
            self._refs[np.asarray(slots, dtype=np.int64)] += 1

    def unpin(self, slots: Sequence[int]) -> None:
        if not slots:
            return
        idx = np.asarray(slots, dtype=np.int64)
        refs = self._refs
        if refs[idx].min() <= 0:
            raise _over_unpinned()
        refs[idx] -= 1
        # from the last slot to the first: a sequence's first pages end up most recent
        self._went_idle(idx[refs[idx] == 0][::-1])

    def _went_idle(self, idle: np.ndarray) -> None:
        """`idle` (slots, in the order they became idle) hold no pin now: the published ones
        become the most recently used, the others (reserved, never published) are free."""
        published = self._published[idle]
        deque(map(self._lru.move_to_end, idle[published].tolist()), maxlen=0)
        self._free.extend(idle[~published].tolist())  # reserved, never published

    def reserve(self, n: int) -> Lease:
        free = self._free
        take = min(n, len(free))
        slots = free[len(free) - take :][::-1]  # the free list is a stack: last in, first out
        del free[len(free) - take :]
        evicted: list[bytes] = []
        if take < n:
            chosen = self._evict(n - take)
            evicted = [self._key[s] for s in chosen]  # type: ignore[misc]
            for s in chosen:
                self._key[s] = None
            self._published[chosen] = False
            self._index.remove(evicted)
            slots += chosen
        self._pin(slots)
        if evicted:
            mark(self._evict_mark)
            self.evicted += len(evicted)
            if self.on_evict is not None:
                self.on_evict(evicted)
        return Lease(self, slots)

    def _evict(self, n: int) -> list[int]:
        """Up to `n` unpinned slots from the LRU head, taken off the list; pinned slots met on
        the way move to the end. Looks at each slot at most once."""
        lru, refs = self._lru, self._refs
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
        return chosen

    def publish(self, slots: Sequence[int], keys: Sequence[bytes]) -> list[int]:
        key_of = self._key
        for s in slots:
            if key_of[s] is not None:
                raise RuntimeError(f"hicache: slot {s} is not reserved (published?)")
        new = self._index.insert(keys, slots)
        fresh = list(compress(slots, new))
        for s, k in zip(fresh, compress(keys, new)):
            key_of[s] = k
        self._lru.update(dict.fromkeys(fresh))
        self._published[fresh] = True
        return fresh

    def key_of(self, slot: int) -> bytes | None:
        return self._key[slot]

    def keys_of(self, slots: Sequence[int]) -> list[bytes]:
        return [self._key[s] for s in slots]  # type: ignore[misc]

    def refs(self, slot: int) -> int:
        return int(self._refs[slot])

    @property
    def pinned(self) -> int:
        return int(np.count_nonzero(self._refs))

    @property
    def free(self) -> int:
        return len(self._free)

    def free_list(self) -> list[int]:
        return list(self._free)

    def lru(self) -> list[int]:
        return list(self._lru)


class PolicyBooks(PythonBooks):
    """The Python books with the eviction order kept by a policy of `hicache.core.eviction` instead
    of the LRU list. The compiled index still answers every lookup (a `match` costs the same);
    only the stores and releases pay a few Python operations per page.

    The policy sees page keys, not slots (a slot holds many keys over time, and a policy's
    memory of pages it gave up must not carry over to the slot's next page). A published slot
    enters the policy when it first becomes idle (its store's lease released), so the policy
    sees a request's new pages inserted, then its held pages touched, from last to first: the
    order the trace tool's simulations use. Until then it is pinned, so never a victim; `lru`
    lists it after the policy's order.
    """

    def __init__(
        self,
        capacity: int,
        index: KeyIndex,
        policy: EvictionPolicy,
        on_evict: EvictHook | None,
    ) -> None:
        super().__init__(capacity, index, on_evict)
        self._policy = policy
        self._evict_mark = f"host.evict.{policy.name}"
        self._fresh: set[int] = set()  # published, not yet idle
        self._slot_of: dict[bytes, int] = {}  # the slot of each published key

    def unpin(self, slots: Sequence[int]) -> None:
        if not slots:
            return
        idx = np.asarray(slots, dtype=np.int64)
        refs = self._refs
        if refs[idx].min() <= 0:
            raise _over_unpinned()
        refs[idx] -= 1
        policy, fresh, key_of = self._policy, self._fresh, self._key
        for s in idx[refs[idx] == 0][::-1].tolist():
            if not self._published[s]:
                self._free.append(s)  # reserved, never published
            elif s in fresh:
                fresh.discard(s)
                policy.insert(key_of[s])
            else:
                policy.touch(key_of[s])

    def _evict(self, n: int) -> list[int]:
        policy, refs, slot_of = self._policy, self._refs, self._slot_of

        def busy(key: bytes) -> bool:
            return refs[slot_of[key]] != 0

        chosen: list[int] = []
        while len(chosen) < n:
            key = policy.victim(busy)
            if key is None:
                break
            policy.remove(key)
            chosen.append(slot_of.pop(key))  # type: ignore[call-overload]
        return chosen

    def publish(self, slots: Sequence[int], keys: Sequence[bytes]) -> list[int]:
        fresh = super().publish(slots, keys)
        key_of, slot_of = self._key, self._slot_of
        for s in fresh:  # the parent put them in the LRU list; here they wait to be idle
            del self._lru[s]
            slot_of[key_of[s]] = s  # type: ignore[index]
        self._fresh.update(fresh)
        return fresh

    def lru(self) -> list[int]:
        slot_of = self._slot_of
        order = self._policy.order()
        return [*(slot_of[k] for k in order), *sorted(self._fresh)]  # type: ignore[index]


Books = CompiledBooks | PythonBooks | PolicyBooks


def slot_books(
    capacity: int,
    index: KeyIndex,
    policy: str = DEFAULT_POLICY,
    on_evict: EvictHook | None = None,
) -> Books:
    """Books for `capacity` slots over `index`, evicting by `policy`: LRU in compiled books
    where the index is compiled (they share its table), any policy in Python otherwise.
    `on_evict` is told the keys of the slots each ``reserve`` evicts."""
    if policy != DEFAULT_POLICY:
        return PolicyBooks(capacity, index, make_policy(policy, capacity), on_evict)
    lib = native.library()
    if isinstance(index, _TableIndex) and lib is not None:
        return CompiledBooks(capacity, index, lib, on_evict)
    return PythonBooks(capacity, index, on_evict)
