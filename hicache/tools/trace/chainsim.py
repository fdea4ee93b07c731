"""The tier chain as hicache runs it, simulated over a trace: the host tier and the store tiers
below it (disk, Mooncake), with their writes, fetches and evictions.

The host tier is modelled at the level of its slot books (`hicache.core.slots`): pages are pinned by
leases; a page enters the eviction policy when it first becomes idle and is touched each time it
becomes idle again (a lease's pages from last to first); victims are idle pages only; a slot
reserved for a fetch whose page the host already holds goes back to the free list. A request
then runs the steps of `HiCache` (hicache/match.py, hicache/store.py, hicache/chain/walk.py,
hicache/chain/fetch.py, hicache/chain/writes.py), in their order:

1. match: the host prefix is pinned; where it is short of the cap, the walk asks the store
   tiers in order (a tier is passed over where a page reads slower than it computes, as the
   cost model says from the configured rates, and asked anyway once in `EXPLORE_EVERY` such
   fetches), each for the page groups after what the tiers above brought: exists, the leading
   run present, host slots reserved for it (evicting), the get (a disk tier's least recently
   used order is touched), the pages published, and what a tier below brought put behind to the
   write-behind tiers above it;
2. the match again: where one tier's fetch reached the cap with pages of its own, the hit is the
   host prefix and the fetched pages (their pins move to the request; those past the cap are
   released); otherwise the host prefix is released and walked again;
3. load (the hit's pages released), store (the prompt's held pages pinned, its new pages placed
   as far as room allows, then released: the new ones, then the held ones), and the puts of
   every `write: behind` tier: each full group of the prompt, and its tail, that the link has
   not put or fetched before, or that a fetch since found missing (its books of the tier learn
   of the tier's evictions only so; the link's re-offer of what it put more than
   `HELD_TRUST_S` ago, on a shared or persistent tier, is not modelled).

A store tier holds objects of `group_pages` pages and tails (`hicache.core.span`), named by
their last page, least recently used first (disk: a get touches, a put of a held object does
nothing), as many as its `capacity` holds.

It is exact against a real `HiCache` (the replay test checks hits per tier) where the real
timing cannot reorder anything: writes settled before the next request, `fetch_reserve: 0`,
one I/O thread per disk tier. Not modelled: the fetch reserve (free host slots kept for fetches,
64 MiB by default), the bound on the link's books (the last 2**20 groups), and, with more I/O
threads, the order in which one call's objects reach the disk's LRU order (here: the call's).
`write: on_evict` is not simulated.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from hicache.core.cost import EXPLORE_EVERY
from hicache.core.eviction import DEFAULT_POLICY, EvictionPolicy, make_policy
from hicache.core.span import Span

RESERVED = -1
"""A lease item for a reserved slot that holds no page (its page was held already)."""


class HostBooks:
    """The host tier's slot books at the level of pages: `capacity` slots, pins, and an
    eviction policy that sees pages as they become idle (see the module doc)."""

    def __init__(self, capacity: int, policy: str | EvictionPolicy = DEFAULT_POLICY) -> None:
        self.capacity = capacity
        self.policy = make_policy(policy, capacity) if isinstance(policy, str) else policy
        self.published: set[int] = set()
        self.fresh: set[int] = set()  # published, never idle yet: not in the policy
        self.refs: dict[int, int] = {}
        self.reserved = 0  # slots reserved and holding no page
        self.evicted = 0
        self.written = 0
        """Pages copied into the host tier (stored, or fetched from a store tier)."""

    def prefix(self, pages: Sequence[int], start: int = 0) -> int:
        """How many leading pages from `start` on are held (start + the run)."""
        n, held = start, self.published
        while n < len(pages) and pages[n] in held:
            n += 1
        return n

    def pin(self, pages: Sequence[int]) -> list[int]:
        refs = self.refs
        for p in pages:
            refs[p] = refs.get(p, 0) + 1
        return list(pages)

    def release(self, items: Sequence[int]) -> None:
        """Drop one pin of each item, the last first: idle pages enter the policy (new ones)
        or are touched; reserved slots without a page go back to the free list."""
        refs, fresh, policy = self.refs, self.fresh, self.policy
        for p in reversed(items):
            if p == RESERVED:
                self.reserved -= 1
                continue
            left = refs[p] - 1
            if left:
                refs[p] = left
                continue
            del refs[p]
            if p in fresh:
                fresh.discard(p)
                policy.insert(p)
            else:
                policy.touch(p)

    def reserve(self, n: int) -> int:
        """Up to `n` slots, free ones first, then by evicting idle pages; returns how many."""
        free = self.capacity - len(self.published) - self.reserved
        got = min(n, max(0, free))
        policy, refs = self.policy, self.refs
        while got < n:
            victim = policy.victim(refs.__contains__)
            if victim is None:
                break
            policy.remove(victim)
            self.published.discard(victim)  # type: ignore[arg-type]
            self.evicted += 1
            got += 1
        self.reserved += got
        return got

    def publish(self, pages: Sequence[int]) -> list[int]:
        """Put `pages` into as many reserved slots (pinned by the caller's lease): the lease's
        items, RESERVED for a page held already."""
        items = []
        for p in pages:
            if p in self.published:
                items.append(RESERVED)
                continue
            self.published.add(p)
            self.fresh.add(p)
            self.refs[p] = self.refs.get(p, 0) + 1
            self.reserved -= 1
            self.written += 1
            items.append(p)
        return items


class Objects(OrderedDict[int, int]):
    """A store tier's objects by their last page: their units, least recently used first, and
    `used`, the units of them all (one `Objects` may be shared by the engines of a cluster)."""

    used = 0


@dataclass
class StoreSim:
    """One store tier below the host: objects of `group_pages` pages (and shorter tails) in
    `capacity` units, least recently used first, and the link's books of what it put or
    fetched there. An object of k pages takes ``overhead + k * page_cost`` units (the defaults
    count pages; a disk tier's planner counts bytes, a record's header the overhead)."""

    name: str
    capacity: int
    group_pages: int
    write: str = "behind"
    worth: bool = True
    """Whether a page reads faster than it computes (the cost model's verdict)."""
    overhead: int = 0
    page_cost: int = 1
    objects: Objects = field(default_factory=Objects)
    known: set[int] = field(default_factory=set)
    skipped: int = 0
    read_pages: int = 0
    written_pages: int = 0
    fetches: int = 0

    def asked(self) -> bool:
        """The cost model's answer for one fetch (with its exploration)."""
        if self.worth:
            return True
        self.skipped += 1
        return self.skipped % EXPLORE_EVERY == 0

    def get(self, ends: Sequence[int], pages: int) -> None:
        """A get of the objects `ends`, `pages` pages in all."""
        for end in ends:
            self.objects.move_to_end(end)
        self.known.update(ends)
        self.read_pages += pages

    def put(self, end: int, pages: int) -> None:
        """A put of the object of `pages` pages that ends at page `end`."""
        objects = self.objects
        self.known.add(end)
        self.written_pages += pages
        if end in objects:
            return
        cost = self.overhead + pages * self.page_cost
        while objects.used + cost > self.capacity and objects:
            objects.used -= objects.popitem(last=False)[1]
        if cost <= self.capacity:
            objects[end] = cost
            objects.used += cost


@dataclass
class Part:
    """One tier's fetch of a request's walk."""

    tier: int
    host_pages: int
    lo: int = 0
    hi: int = 0
    items: list[int] | None = None


@dataclass
class Served:
    """Where one request's hit came from: pages per tier (the host first), and pages read from
    each store tier (whole groups, the held ones too)."""

    hit_pages: int
    tier_pages: list[int]
    read_pages: list[int]


class ChainSim:
    """A host tier of `host_pages` slots evicting by `policy`, and `stores` below it in walk
    order, over prompts of `page_tokens`-token pages (see the module doc)."""

    def __init__(
        self,
        host_pages: int,
        page_tokens: int,
        stores: Sequence[StoreSim] = (),
        policy: str = DEFAULT_POLICY,
        min_recompute_tokens: int = 1,
    ) -> None:
        self.host = HostBooks(host_pages, policy)
        self.stores = list(stores)
        self.P = page_tokens
        self.floor = min_recompute_tokens
        self.dropped = 0

    def request(self, pages: Sequence[int], prompt_tokens: int) -> Served:
        host = self.host
        cap = max(0, prompt_tokens - self.floor) // self.P
        found = host.prefix(pages)
        hit = min(found, cap)
        reads = [0] * len(self.stores)
        walk: list[Part] = []
        lease = host.pin(pages[:hit])  # before the walk's results arrive
        if self.stores and found < cap:
            self._walk(pages, found, cap, 0, walk, reads)
        tiers = [0] * (len(self.stores) + 1)
        if walk:
            hit = self._answer(pages, walk, lease, hit, cap, tiers)
        tiers[0] = hit - sum(tiers)
        host.release(lease)  # the load
        self._store(pages)
        return Served(hit, tiers, reads)

    # -- the walk down the store tiers ----------------------------------------------------------

    def _walk(
        self, pages: Sequence[int], reached: int, cap: int, after: int, walk: list, reads: list
    ) -> None:
        n = len(pages)
        for i in range(after, len(self.stores)):
            tier = self.stores[i]
            G = tier.group_pages
            span = Span.of(reached, cap, n, G)
            if not span.objects or not tier.asked():
                continue
            tier.fetches += 1
            part = Part(i, reached)
            walk.append(part)
            ends = [pages[e] for e in span.ends()]
            run = 0
            while run < len(ends) and ends[run] in tier.objects:
                run += 1
            tier.known.difference_update(e for e in ends[run:] if e not in tier.objects)
            if run:
                got = self.host.reserve(span.pages_of(run))
                if got < span.pages_of(run):  # the whole groups that fit
                    run = min(got // G, span.groups)
                    self.host.reserved -= got - run * G  # the others' slots: released
            if run:
                tier.get(ends[:run], span.pages_of(run))
                reads[i] += span.pages_of(run)
                part.lo = span.first_page
                part.hi = part.lo + span.pages_of(run)
                part.items = self.host.publish(pages[part.lo : part.hi])
                for above in self.stores[:i]:
                    if above.write == "behind":
                        self._put(above, pages[: part.hi])
            reached = max(part.host_pages, part.hi)
            if reached < cap:
                self._walk(pages, reached, cap, i + 1, walk, reads)
            return

    def _answer(
        self,
        pages: Sequence[int],
        walk: list[Part],
        lease: list[int],
        found: int,
        cap: int,
        tiers: list[int],
    ) -> int:
        """The match after the walk: the hit in pages; `lease` becomes its pins, `tiers` gets
        each store tier's pages of it."""
        host = self.host
        brought = [part for part in walk if part.items is not None]
        part = brought[0] if len(brought) == 1 else None
        if (
            part is not None
            and part.hi >= cap
            and part.lo <= found < cap
            and all(p != RESERVED for p in part.items[found - part.lo :])  # type: ignore[index]
        ):
            items = part.items  # type: ignore[assignment]
            host.release(items[cap - part.lo :])  # past the cap
            host.release(items[: found - part.lo])  # before the host hit: reserved slots
            lease += items[found - part.lo : cap - part.lo]
            tiers[part.tier + 1] += cap - found
            return cap
        host.release(lease)
        hit = min(host.prefix(pages), cap)
        lease[:] = host.pin(pages[:hit])
        done = 0
        for part in walk:
            begin, end = max(done, part.host_pages, part.lo), min(hit, part.hi)
            if end > begin:
                tiers[part.tier + 1] += end - begin
                done = end
        for part in walk:
            if part.items is not None:
                host.release(part.items)
        return hit

    # -- store and write-behind -----------------------------------------------------------------

    def _store(self, pages: Sequence[int]) -> None:
        host = self.host
        present = [p for p in pages if p in host.published]
        missing = [p for p in pages if p not in host.published]
        keep = host.pin(present)
        new: list[int] = []
        if missing:
            got = host.reserve(len(missing))
            self.dropped += len(missing) - got
            new = host.publish(missing[:got])
        host.release(new)
        host.release(keep)
        for tier in self.stores:
            if tier.write == "behind":
                self._put(tier, pages)

    def _put(self, tier: StoreSim, pages: Sequence[int]) -> None:
        """Put the full groups of `pages` and its tail that the link has not put or fetched,
        whose pages the host holds. The put pins their pages until it returns: released here at
        once, last first (the replay settles every put before the next request)."""
        G, held = tier.group_pages, self.host.published
        pinned: list[int] = []
        for g in range(-(-len(pages) // G)):
            group = pages[g * G : (g + 1) * G]
            if group[-1] not in tier.known and all(p in held for p in group):
                tier.put(group[-1], len(group))
                pinned += group
        self.host.release(self.host.pin(pinned))
