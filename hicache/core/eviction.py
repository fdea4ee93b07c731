"""Eviction policies for bounded tiers: which held page goes next when space runs out.

A policy keeps an order over the keys a tier holds (slots of the host tier, page ids in the trace
tool, object names in a store tier) and nothing else: the tier owns the pages, the pins and the
index. The tier tells the policy what happens, and asks it for victims:

- ``insert(key, weight)``: the tier now holds `key` (a page stored here);
- ``touch(key)``: `key` was used again (a hit, or a page pinned by a request and now idle);
- ``remove(key)``: the tier no longer holds `key` (evicted, or dropped for another reason);
- ``victim(busy)``: the key to evict next, skipping keys for which ``busy(key)`` is true (pinned
  pages); None when every key is busy. It does not remove the key: the tier calls ``remove``.

Every call is O(1) amortised per key (busy keys met by ``victim`` are moved out of the way, so
each is passed over once until it is touched again), with no allocation beyond the policy's own
tables. A request's pages reach a policy from its last page to its first (the order the host
tier releases them in), so that where the order is by recency a prompt's head outlives its tail:
a page whose parent is gone is worthless, so the parent must go last.

``weight`` is what losing the page costs compared with an ordinary page (1.0): more for a page
that carries a hybrid model's state, less for one that a lower tier also holds. Policies that do
not use it accept and ignore it.

Policies are registered by name (`register_policy`) and built by `make_policy(name, capacity)`;
a tier's ``policy:`` field names one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import TypeVar

from hicache.core.marks import mark

K = Hashable
Busy = Callable[[K], bool]

DEFAULT_POLICY = "lru"


def _never(_key: K) -> bool:
    return False


class EvictionPolicy(ABC):
    """The order in which a bounded tier gives up its keys (see the module doc)."""

    name: str = ""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: K, weight: float = 1.0) -> None:
        """The tier now holds `key` (not held before)."""

    @abstractmethod
    def touch(self, key: K) -> None:
        """`key`, held, was used again."""

    @abstractmethod
    def remove(self, key: K) -> None:
        """The tier no longer holds `key` (held)."""

    @abstractmethod
    def victim(self, busy: Busy = _never) -> K | None:
        """The key to evict next among those not `busy`; None if there is none."""

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def order(self) -> list[K]:
        """Every held key, the next victim first (as far as the policy knows it now)."""


_REGISTRY: dict[str, type[EvictionPolicy]] = {}

P = TypeVar("P", bound=type[EvictionPolicy])


def register_policy(name: str) -> Callable[[P], P]:
    """Class decorator: make a policy available under `name` (a tier's ``policy:``)."""

    def add(cls: P) -> P:
        if name in _REGISTRY:
            raise ValueError(f"eviction policy {name!r} is registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return add


def policy_names() -> list[str]:
    """The registered policies' names, in registration order."""
    return list(_REGISTRY)


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """A fresh policy `name` for a tier of `capacity` keys; ValueError names the known ones."""
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(_REGISTRY)}")
    return cls(capacity)


def _first_idle(queue: OrderedDict[K, None], busy: Busy) -> K | None:
    """The oldest key of `queue` that is not busy; busy keys met on the way go to the young end
    (they are in use, so recently used), so each is passed over once."""
    for _ in range(len(queue)):
        key = next(iter(queue))
        if not busy(key):
            return key
        queue.move_to_end(key)
    return None


@register_policy("lru")
class LRU(EvictionPolicy):
    """Least recently used first. The host tier runs it in compiled books (slotbook.c) with the
    same semantics; this one serves the trace tool and tiers without compiled books."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._q: OrderedDict[K, None] = OrderedDict()  # oldest first

    def insert(self, key: K, weight: float = 1.0) -> None:
        self._q[key] = None

    def touch(self, key: K) -> None:
        self._q.move_to_end(key)

    def remove(self, key: K) -> None:
        del self._q[key]

    def victim(self, busy: Busy = _never) -> K | None:
        return _first_idle(self._q, busy)

    def __contains__(self, key: object) -> bool:
        return key in self._q

    def __len__(self) -> int:
        return len(self._q)

    def order(self) -> list[K]:
        return list(self._q)


class _Ghosts:
    """Keys recently given up, oldest first, at most `limit` of them (a bounded FIFO)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._q: OrderedDict[K, None] = OrderedDict()

    def add(self, key: K) -> None:
        if self.limit <= 0:
            return
        self._q[key] = None
        self._q.move_to_end(key)
        if len(self._q) > self.limit:
            self._q.popitem(last=False)

    def take(self, key: K) -> bool:
        """Whether `key` was a ghost (it is not any more)."""
        return self._q.pop(key, 0) is None

    def __len__(self) -> int:
        return len(self._q)


@register_policy("arc")
class ARC(EvictionPolicy):
    """Adaptive replacement (Megiddo and Modha): a recency list T1 (seen once) and a frequency
    list T2 (seen again), with ghost lists B1, B2 of what each gave up; a hit on a ghost moves
    the target size `p` of T1 towards the list that would have kept it."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.p = 0
        self._t1: OrderedDict[K, None] = OrderedDict()
        self._t2: OrderedDict[K, None] = OrderedDict()
        self._b1, self._b2 = _Ghosts(capacity), _Ghosts(capacity)

    def insert(self, key: K, weight: float = 1.0) -> None:
        b1, b2 = len(self._b1), len(self._b2)
        if self._b1.take(key):
            self.p = min(self.capacity, self.p + max(1, b2 // max(1, b1)))
            self._t2[key] = None
        elif self._b2.take(key):
            self.p = max(0, self.p - max(1, b1 // max(1, b2)))
            self._t2[key] = None
        else:
            self._t1[key] = None

    def touch(self, key: K) -> None:
        if self._t1.pop(key, 0) is None:
            self._t2[key] = None
        else:
            self._t2.move_to_end(key)

    def remove(self, key: K) -> None:
        if self._t1.pop(key, 0) is None:
            self._b1.add(key)
        else:
            del self._t2[key]
            self._b2.add(key)

    def victim(self, busy: Busy = _never) -> K | None:
        t1_first = len(self._t1) > 0 and len(self._t1) >= max(1, self.p)
        lists = (self._t1, self._t2) if t1_first else (self._t2, self._t1)
        for q in lists:
            key = _first_idle(q, busy)
            if key is not None:
                return key
        return None

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def order(self) -> list[K]:
        t1_first = len(self._t1) > 0 and len(self._t1) >= max(1, self.p)
        a, b = (self._t1, self._t2) if t1_first else (self._t2, self._t1)
        return [*a, *b]


class _FifoWithGhosts(EvictionPolicy):
    """S3-FIFO's structure (Yang et al.): new keys enter a small FIFO (a tenth of the capacity);
    one used again while there moves to the main FIFO when it reaches the small FIFO's end,
    the others leave and are remembered as ghosts (as many as the capacity); a ghost that comes
    back enters the main FIFO directly. The main FIFO gives each key as many second chances as
    it was used (up to 3)."""

    SMALL_SHARE = 0.1
    MAX_FREQ = 3

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._small: OrderedDict[K, None] = OrderedDict()
        self._main: OrderedDict[K, None] = OrderedDict()
        self._freq: dict[K, int] = {}
        self._ghosts = _Ghosts(capacity)
        self._small_cap = max(1, round(self.SMALL_SHARE * capacity))

    def insert(self, key: K, weight: float = 1.0) -> None:
        self._freq[key] = 0
        if self._ghosts.take(key):
            self._main[key] = None
        else:
            self._small[key] = None

    def touch(self, key: K) -> None:
        self._freq[key] = min(self.MAX_FREQ, self._freq[key] + 1)

    def remove(self, key: K) -> None:
        del self._freq[key]
        if self._small.pop(key, 0) is None:
            self._ghosts.add(key)
        else:
            del self._main[key]

    def victim(self, busy: Busy = _never) -> K | None:
        small, main, freq = self._small, self._main, self._freq
        # each key is looked at a bounded number of times: moved on, aged, or returned
        for _ in range(2 * len(small) + (self.MAX_FREQ + 2) * len(main) + 1):
            if small and (len(small) >= self._small_cap or not main):
                key = next(iter(small))
                if busy(key):
                    small.move_to_end(key)
                elif freq[key]:
                    del small[key]
                    main[key] = None
                    freq[key] = 0
                else:
                    return key
            elif main:
                key = next(iter(main))
                if busy(key):
                    mark("host.evict.s3fifo-main-pinned")
                    main.move_to_end(key)
                elif freq[key]:
                    freq[key] -= 1
                    main.move_to_end(key)
                else:
                    return key
            else:
                return None
        return None

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    def __len__(self) -> int:
        return len(self._freq)

    def order(self) -> list[K]:
        return [*self._small, *self._main]

    def ghosts(self) -> Iterator[K]:
        return iter(self._ghosts._q)


@register_policy("s3fifo")
class S3FIFO(_FifoWithGhosts):
    """S3-FIFO as published."""


@register_policy("prefix")
class PrefixAware(ARC):
    """ARC, fed the way a prefix cache needs, and weighing what a page saves.

    - Heads outlive tails: a request's pages arrive from last to first, so within each list a
      prompt's tail is older than its head and goes first; a page whose parent is gone (it can
      never hit again) is not left behind.
    - Weight: a page worth more than an ordinary one (a hybrid model's state, weight > 1)
      enters the frequency list T2 directly; one that a lower tier also holds (weight < 1)
      enters T1 at its old end, first to go, and leaves no ghost, since losing it costs a
      fetch, not a prefill.

    Without weights it orders pages exactly as ARC: docs/eviction.md says what else was tried
    on the traces measured and why none of it is here.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._cheap: set[K] = set()

    def insert(self, key: K, weight: float = 1.0) -> None:
        if weight < 1.0:
            self._t1[key] = None
            self._t1.move_to_end(key, last=False)
            self._cheap.add(key)
        elif weight > 1.0:
            self._b1.take(key) or self._b2.take(key)
            self._t2[key] = None
        else:
            super().insert(key, weight)

    def touch(self, key: K) -> None:
        self._cheap.discard(key)  # used again: as dear as any page
        super().touch(key)

    def remove(self, key: K) -> None:
        if key in self._cheap:
            self._cheap.discard(key)
            del self._t1[key]
            return
        super().remove(key)
