"""The disk tier's book of its files: sizes, eviction order, the room writes reserve, and the
tenants' shares and quotas."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping

from hicache.core.marks import mark
from hicache.core.shares import Terms


def record_tenant(name: str) -> str:
    """The tenant a record's file name carries (`hicache.backends.disk.records.file_name`);
    "" for the records of no tenant."""
    return name.partition("~")[2]


class LruBook:
    """Which records the tier holds, their bytes, and the eviction order. Eviction is decided
    here and nowhere else. Thread-safe.

    Without tenants' terms, the least recently used record goes first. With them (`terms`, by
    tenant name; a record's tenant is in its name), a record goes from the tenant over its
    quota first, then from the tenant furthest over its share (its least recently used
    record), never from a tenant within its share save the tenant writing, from its own: one
    tenant's flood evicts its own records once the others are down to their shares. A tenant
    never holds more than its quota: a write past it evicts the tenant's own records first.
    The tenants not named in `terms` (and the records of no tenant) have no share and no
    quota."""

    def __init__(self, capacity: int, terms: Mapping[str, Terms] | None = None) -> None:
        self.size = capacity
        """The bound the book started with (the tier's `size`)."""
        self.capacity = capacity
        """The bound now: `size`, or less while the file system is short of space."""
        self.terms: dict[str, Terms] = dict(terms or {})
        """Each tenant's share and quota (bytes), by name; set before records are added."""
        self._lock = threading.Lock()
        self._held: OrderedDict[str, int] = OrderedDict()  # name -> bytes, oldest first
        self._own: dict[str, OrderedDict[str, None]] = {}  # a tenant's names, oldest first
        self._writing: dict[str, int] = {}  # name -> bytes reserved by a put in progress
        self.used = 0  # bytes of held and reserved records
        self.used_by: dict[str, int] = {}
        """Bytes of each tenant's held and reserved records."""
        self.evicted_by: dict[str, int] = {}
        """Bytes of each tenant's records evicted so far (for others' room or its quota)."""

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, name: str) -> bool:
        return name in self._held

    def add(self, name: str, nbytes: int) -> None:
        """Record a held record as the most recently used (at start-up, oldest first)."""
        with self._lock:
            if name not in self._held:
                self._hold(name, nbytes)
                self._charge(name, nbytes)

    def names(self) -> list[str]:
        """The records held now (least recently used first)."""
        with self._lock:
            return list(self._held)

    def touch(self, name: str) -> bool:
        """A use: `name` becomes the most recently used; whether it is held."""
        with self._lock:
            if name not in self._held:
                return False
            self._held.move_to_end(name)
            self._own[record_tenant(name)].move_to_end(name)
            return True

    def reserve(self, name: str, nbytes: int) -> list[str] | None:
        """Make room for a new record: returns the records to remove first (already out of the
        book: the caller removes them), or None when `name` is held or being written already.
        ValueError, with nothing changed, if `nbytes` exceeds the capacity or the tenant's
        quota, or no eviction can make room (the rest is reserved by puts in progress, or held
        by tenants within their shares)."""
        tenant = record_tenant(name)
        quota = self._quota(tenant)
        if nbytes > min(self.capacity, quota):
            bound = "the tier's size" if nbytes > self.capacity else f"{tenant}'s quota"
            raise ValueError(f"{nbytes} bytes exceed {bound} of {min(self.capacity, quota)}")
        with self._lock:
            if name in self._held or name in self._writing:
                return None
            if sum(self._writing.values()) + nbytes > self.capacity:
                raise ValueError("no room: the tier's size is taken by records being written")
            victims = self._plan(tenant, nbytes, quota)
            for victim in victims:
                size = self._unhold(victim)
                self._charge(victim, -size)
                owner = record_tenant(victim)
                self.evicted_by[owner] = self.evicted_by.get(owner, 0) + size
            self._writing[name] = nbytes
            self._charge(name, nbytes)
            return victims

    def _plan(self, tenant: str, nbytes: int, quota: int) -> list[str]:
        """The records whose removal makes room for `nbytes` of `tenant` (module doc), without
        changing the book; ValueError where none can."""
        used = dict(self.used_by)
        total = self.used
        queues: dict[str, Iterator[str]] = {}
        victims: list[str] = []

        def take(owner: str) -> bool:
            nonlocal total
            queue = queues.setdefault(owner, iter(self._own.get(owner, ())))
            victim = next(queue, None)
            if victim is None:
                return False
            size = self._held[victim]
            victims.append(victim)
            used[owner] -= size
            total -= size
            return True

        while used.get(tenant, 0) + nbytes > quota:
            if not take(tenant):
                raise ValueError(f"no room: {tenant}'s quota is taken by records being written")
            mark("disk.evict.quota")
        if not self.terms:  # the least recently used first, whoever's
            taken, oldest = set(victims), iter(self._held)
            while total + nbytes > self.capacity:
                victim = next(oldest)  # held records alone can make the room (checked above)
                if victim not in taken:
                    victims.append(victim)
                    total -= self._held[victim]
            return victims
        done: set[str] = set()  # tenants with no record left to give
        while total + nbytes > self.capacity:
            owner = self._victim(used, tenant, done)
            if owner is None:
                raise ValueError("no room: the other tenants hold no more than their shares")
            if not take(owner):
                done.add(owner)
            elif owner != tenant:
                mark("disk.evict.tenant")
        return victims

    def _victim(self, used: Mapping[str, int], tenant: str, done: set[str]) -> str | None:
        """The tenant to take a record from next: over its quota first, then the one furthest
        over its share; else `tenant` itself (a share guards from the others, not from
        oneself); None where every other tenant is within its share."""
        best, best_at = None, None
        for owner, held in used.items():
            if owner in done or held <= self._share(owner):
                continue
            at = (held > self._quota(owner), held - self._share(owner))
            if best_at is None or at > best_at:
                best, best_at = owner, at
        if best is None and tenant not in done:
            return tenant
        return best

    def _share(self, tenant: str) -> int:
        terms = self.terms.get(tenant)
        return terms.share if terms is not None else 0

    def _quota(self, tenant: str) -> int:
        terms = self.terms.get(tenant)
        return terms.quota if terms is not None and terms.quota is not None else self.size

    def settle(self, name: str, written: bool) -> None:
        """End a `reserve`: the record is now held (most recently used), or was not written."""
        with self._lock:
            nbytes = self._writing.pop(name)
            if written:
                self._hold(name, nbytes)
            else:
                self._charge(name, -nbytes)

    def drop(self, name: str) -> bool:
        """Forget a record that is gone (damaged); whether it was held."""
        with self._lock:
            if name not in self._held:
                return False
            self._charge(name, -self._unhold(name))
            return True

    def lower(self) -> None:
        """The file system ran out of space below the capacity: what is held and being written
        now becomes the capacity, so that later puts evict records instead of failing (until
        `lift`)."""
        with self._lock:
            self.capacity = min(self.capacity, self.used)

    @property
    def lowered(self) -> bool:
        """The bound is below the size (`lower`)."""
        return self.capacity < self.size

    def lift(self, free: int) -> None:
        """The file system has `free` bytes of room: a lowered bound rises to what is held and
        being written plus that room, at most to the size (a full file system is transient)."""
        with self._lock:
            self.capacity = max(self.capacity, min(self.size, self.used + free))

    def shrink(self) -> list[str]:
        """Records to remove so that each tenant fits its quota and the held ones fit the
        capacity (after a restart with a smaller size or quota), least recently used first."""
        with self._lock:
            victims = []
            for tenant, own in self._own.items():
                while own and self.used_by[tenant] > self._quota(tenant):
                    victims.append(next(iter(own)))
                    self._charge(victims[-1], -self._unhold(victims[-1]))
            while self.used > self.capacity and self._held:
                victim = next(iter(self._held))
                self._charge(victim, -self._unhold(victim))
                victims.append(victim)
            return victims

    def tenants(self) -> dict[str, tuple[int, int]]:
        """Per tenant with terms, and the others that hold records: (bytes held and reserved,
        bytes evicted so far)."""
        with self._lock:
            names = set(self.terms) | {t for t, n in self.used_by.items() if n}
            return {t: (self.used_by.get(t, 0), self.evicted_by.get(t, 0)) for t in names}

    def _hold(self, name: str, nbytes: int) -> None:
        self._held[name] = nbytes
        self._own.setdefault(record_tenant(name), OrderedDict())[name] = None

    def _unhold(self, name: str) -> int:
        del self._own[record_tenant(name)][name]
        return self._held.pop(name)

    def _charge(self, name: str, nbytes: int) -> None:
        tenant = record_tenant(name)
        self.used += nbytes
        self.used_by[tenant] = self.used_by.get(tenant, 0) + nbytes
