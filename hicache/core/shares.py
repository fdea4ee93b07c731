"""Tenants' shares of the host tier: quotas and isolated eviction (`TenantBooks`); the
tenants' terms on the store tiers (`Terms`, kept by each tier that keeps them) and the names
their objects carry there (`owners`).

A tenant (`hicache.config.TenantConfig`) may be given, on the host tier, a guaranteed share
(``share``: pages it keeps however hard the others push) and a quota (``quota``: pages it may
hold at most). Every published page slot belongs to the tenant of the request that stored or
fetched it (by the request's chain seed; tenant 0, "", for requests of no tenant). Eviction
takes from the tenant furthest over its share first (over its quota before all), the least
recently used of its idle pages, and never from a tenant within its share, save the tenant
asking for the slots, from its own (`reserve_as`); where none can give, a reserve gets fewer
slots, as when every slot is pinned. So one tenant flooding the cache evicts its own pages once
the others are down to their shares, and never pushes one below it. A tenant never holds more
than its quota once its pages are idle: a publish past it evicts the tenant's own least recent
idle pages, and so does the next `settle` (every `HiCache.poll`) or reserve after a release that
leaves it past it. Shares add up to at most the pool (the configuration checks).

`TenantBooks` keeps the books in Python (`hicache.core.native.books.PythonBooks`, a recency
list per tenant); the cache uses them only where a tenant has a share or a quota on the host
tier, and the compiled books otherwise.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache.core.keys import chain_seed, namespace
from hicache.core.marks import mark
from hicache.core.native.books import EvictHook, Lease, PythonBooks
from hicache.core.native.index import KeyIndex


@dataclass(frozen=True)
class Shares:
    """The tenants' terms on one pool, in slots. Tenant 0 is the requests of no tenant (no
    share, no quota)."""

    names: tuple[str, ...]
    """Tenant names by index; ``names[0]`` is ""."""
    by_seed: Mapping[bytes, int] = field(default_factory=dict)
    """The tenant of each chain seed (a tenant's requests name their pages from it)."""
    share: tuple[int, ...] = ()
    """Slots each tenant is guaranteed (0: none)."""
    quota: tuple[int, ...] = ()
    """Slots each tenant may hold at most (the pool's capacity: no limit)."""


@dataclass(frozen=True)
class Terms:
    """A tenant's terms on one store tier, in bytes."""

    share: int = 0
    """Bytes it keeps however hard the others push (0: none)."""
    quota: int | None = None
    """Bytes it may hold at most (None: no limit)."""


def store_terms(tenants: Iterable[Any], tier: str) -> dict[str, Terms]:
    """The terms of `tenants` (`TenantConfig`s) on the store tier named `tier`, by tenant name;
    empty where none has a share or a quota there."""
    return {
        t.name: Terms(t.share.get(tier, 0), t.quota.get(tier))
        for t in tenants
        if tier in t.share or tier in t.quota
    }


def owners(tenants: Iterable[Any], fingerprint: bytes) -> dict[bytes, str]:
    """Each tenant's name by the chain seeds its requests name pages from (`tenant_seeds`): the
    tenant a store tier's objects are named under (`hicache.core.keys.store_key`)."""
    return {seed: t.name for t in tenants for seed in tenant_seeds(fingerprint, t.salt or t.name)}


def tenant_seeds(fingerprint: bytes, salt: str) -> tuple[bytes, bytes]:
    """The chain seeds a tenant's requests name pages from: its salt given to `match`/`store`
    as it is, and as vLLM's connector passes a ``cache_salt`` (`hicache.core.keys.namespace`)."""
    return chain_seed(fingerprint, salt), chain_seed(fingerprint, namespace(salt=salt))


def host_shares(
    tenants: Iterable[Any], fingerprint: bytes, page_bytes: int, capacity: int
) -> Shares | None:
    """The `Shares` of `capacity` host page slots of `page_bytes` each for `tenants`
    (`TenantConfig`s; bytes rounded down to whole pages), or None where no tenant has a share
    or a quota on the host tier."""
    tenants = list(tenants)
    if not any("host" in t.share or "host" in t.quota for t in tenants):
        return None
    index = {t.name: i + 1 for i, t in enumerate(tenants)}
    by_seed = {seed: index[name] for seed, name in owners(tenants, fingerprint).items()}
    share = (0, *(t.share.get("host", 0) // page_bytes for t in tenants))
    quota = (capacity, *(t.quota.get("host", capacity * page_bytes) // page_bytes for t in tenants))
    return Shares(("", *(t.name for t in tenants)), by_seed, share, quota)


class TenantBooks(PythonBooks):
    """`PythonBooks` with a recency list per tenant and eviction by `Shares` (module doc).
    `publish_as` publishes for the tenant of a chain seed; `publish` for tenant 0."""

    def __init__(
        self, capacity: int, index: KeyIndex, shares: Shares, on_evict: EvictHook | None
    ) -> None:
        super().__init__(capacity, index, on_evict)
        n = len(shares.names)
        self.shares = shares
        self._lrus: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(n)]
        self._tenant = np.zeros(capacity, dtype=np.int32)
        self.used = [0] * n
        """Published slots of each tenant."""
        self.evicted_of = [0] * n
        """Slots of each tenant evicted so far (for another's space or its own quota)."""
        self._share = list(shares.share) or [0] * n
        self._quota = list(shares.quota) or [capacity] * n
        self._asking = 0  # the tenant whose reserve is running (`reserve_as`)
        self._over: set[int] = set()  # tenants over their quotas since their slots went idle

    def reserve_as(self, n: int, seed: bytes) -> Lease:
        """`reserve` for the tenant of chain seed `seed`: where no tenant is over its share, it
        may evict its own least recent idle slots (a share guards a tenant from the others, not
        from itself)."""
        self._asking = self.shares.by_seed.get(seed, 0)
        try:
            return self.reserve(n)
        finally:
            self._asking = 0

    def publish_as(self, slots: Sequence[int], keys: Sequence[bytes], seed: bytes) -> list[int]:
        """`publish` for the tenant of chain seed `seed`; then, where the tenant holds more
        than its quota, its least recent idle slots are evicted down to it."""
        t = self.shares.by_seed.get(seed, 0)
        fresh = self._publish_for(slots, keys, t)
        if self.used[t] > self._quota[t]:
            self._trim(t, self.used[t] - self._quota[t])
        return fresh

    def publish(self, slots: Sequence[int], keys: Sequence[bytes]) -> list[int]:
        return self._publish_for(slots, keys, 0)

    def _publish_for(self, slots: Sequence[int], keys: Sequence[bytes], t: int) -> list[int]:
        fresh = super().publish(slots, keys)
        lru, own = self._lru, self._lrus[t]
        for s in fresh:  # the parent listed them in its one list: they go in the tenant's
            del lru[s]
            own[s] = None
        if fresh:
            self._tenant[fresh] = t
            self.used[t] += len(fresh)
        return fresh

    def _went_idle(self, idle: np.ndarray) -> None:
        """As the parent's, per tenant; a tenant over its quota is noted, to evict its own least
        recent idle slots down to it at the next `settle` or reserve (not here: a release may
        come in the middle of a store, whose caller holds slot numbers it is about to pin)."""
        for s in idle.tolist():  # each the most recent of its tenant's
            if self._published[s]:
                t = int(self._tenant[s])
                self._lrus[t].move_to_end(s)
                if self.used[t] > self._quota[t]:
                    self._over.add(t)
            else:
                self._free.append(s)  # reserved, never published

    def settle(self) -> None:
        """Evict the idle slots of the tenants noted over their quotas down to them (between
        two engine calls: `HiCache.poll`, and every reserve)."""
        while self._over:
            t = self._over.pop()
            if self.used[t] > self._quota[t]:
                self._trim(t, self.used[t] - self._quota[t])

    def reserve(self, n: int) -> Lease:
        self.settle()
        return super().reserve(n)

    def _evict(self, n: int) -> list[int]:
        """Up to `n` idle slots, each from the tenant furthest over its share (over its quota
        first), its least recent; taken off its list."""
        chosen: list[int] = []
        stuck: set[int] = set()  # tenants whose every slot is pinned
        while len(chosen) < n:
            t = self._victim(stuck)
            if t is None:
                break
            slot = self._idle(t)
            if slot is None:
                stuck.add(t)
                continue
            chosen.append(slot)
            self._forget(slot, t)
        if chosen:
            mark("host.evict.tenant")
        return chosen

    def _victim(self, stuck: set[int]) -> int | None:
        """The tenant to evict from next: over its quota first, then furthest over its share;
        else the tenant asking (`reserve_as`), from its own; None where every other tenant
        holding idle slots is within its share (a reserve then gets fewer slots: a share is a
        guarantee)."""
        best, best_at = None, None
        for t, own in enumerate(self._lrus):
            if not own or t in stuck or self.used[t] <= self._share[t]:
                continue
            at = (self.used[t] > self._quota[t], self.used[t] - self._share[t])
            if best_at is None or at > best_at:
                best, best_at = t, at
        if best is None and self._lrus[self._asking] and self._asking not in stuck:
            return self._asking
        return best

    def _idle(self, t: int) -> int | None:
        """Tenant `t`'s least recent idle slot, taken off its list (pinned ones met on the way
        move to its end); None where every one is pinned."""
        own, refs = self._lrus[t], self._refs
        for _ in range(len(own)):
            s = next(iter(own))
            if refs[s] == 0:
                del own[s]
                return s
            own.move_to_end(s)
        return None

    def _forget(self, slot: int, t: int) -> None:
        self.used[t] -= 1
        self.evicted_of[t] += 1

    def _trim(self, t: int, n: int) -> None:
        """Evict up to `n` of tenant `t`'s idle slots (its quota), back to the free list."""
        chosen: list[int] = []
        while len(chosen) < n:
            slot = self._idle(t)
            if slot is None:
                break
            chosen.append(slot)
            self._forget(slot, t)
        if not chosen:
            return
        evicted = [self._key[s] for s in chosen]
        for s in chosen:
            self._key[s] = None
        self._published[chosen] = False
        self._index.remove(evicted)  # type: ignore[arg-type]
        self._free.extend(chosen)
        mark("host.evict.quota")
        self.evicted += len(chosen)
        if self.on_evict is not None:
            self.on_evict(evicted)  # type: ignore[arg-type]

    def lru(self) -> list[int]:
        return [s for own in self._lrus for s in own]
