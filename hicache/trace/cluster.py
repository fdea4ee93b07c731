"""A cluster of engines behind a router, each with its own hicache, one Mooncake store shared.

`simulate_cluster` replays a trace through `instances` simulated engines. Each holds a host tier
(and optionally a disk tier) of the same size; all of them share one store tier (Mooncake).
A router picks the engine of every request (`ROUTERS`):

- ``round-robin``: request k goes to engine k mod N;
- ``session``: a session's first request goes to the engine with the fewest requests so far,
  and every later request of that session follows it (a request without a session is a
  session of its own);
- ``cache-aware``: the engine that holds the longest prefix of the prompt in its host tier as
  the router knows it from hicache's KV events (`hicache.events`: ``stored`` / ``removed`` on
  the host tier), which reach the router `event_delay_s` after the request that caused them;
  among equals (no engine known to hold the first page: all of them) the one with the fewest
  requests so far, then the lowest index.

Each engine serves its request the way hicache walks its tier chain, at page granularity:

- the longest run of leading pages in its host tier, then in its disk tier from there, then in
  the shared store from there; the hit is capped so that `min_recompute_tokens` of the prompt
  are computed (the cap takes pages off the end of the walk, the store's first);
- host placement follows `hicache.trace.simulate.PolicySim` under LRU (the prompt's held pages
  are pinned, new pages evict the least recently used others, a prompt longer than the tier
  keeps its leading pages); pages fetched from below are placed like new ones;
- writes go down as with ``write: behind``: pages the engine computed and placed in its host
  tier are put to its disk tier and to the store; pages it fetched from the store are put to
  its disk tier; pages from its disk tier are put nowhere. A put of a page a tier holds
  refreshes it. Disk and store tiers evict least recently used first (a read or a put is a use);
  a store of capacity None never evicts.

The trace's timestamps are milliseconds (as in the Mooncake traces); requests are served at
their timestamp, one at a time, with no service time: the load a router balances is the count of
requests it sent each engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hicache.trace.simulate import capped_pages
from hicache.trace.workload import TraceRequest

TIME_UNIT_S = 0.001
"""Seconds per unit of the trace's timestamps."""

DEFAULT_INSTANCES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class ClusterSetup:
    """The engines, their tiers and the router (see the module doc)."""

    instances: int
    router: str
    host_pages: int
    page_tokens: int
    page_bytes: int
    """Bytes of one page of the model's KV (for the store's traffic)."""
    disk_pages: int = 0
    """Each engine's disk tier; 0: none."""
    store_pages: int | None = None
    """The shared store; None: unbounded, 0: none."""
    event_delay_s: float = 0.0
    min_recompute_tokens: int = 1

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}; known: {', '.join(ROUTERS)}")
        if self.instances < 1:
            raise ValueError(f"instances must be >= 1, got {self.instances}")
        if self.host_pages < 1 or self.disk_pages < 0 or (self.store_pages or 0) < 0:
            raise ValueError("the host tier needs >= 1 page; disk and store sizes must be >= 0")
        if self.page_tokens <= 0 or self.page_bytes <= 0 or self.min_recompute_tokens <= 0:
            raise ValueError("page_tokens, page_bytes and min_recompute_tokens must be positive")
        if not self.event_delay_s >= 0:
            raise ValueError(f"event delay must be >= 0 s, got {self.event_delay_s}")


@dataclass
class ClusterResult:
    """What a cluster served over a trace (tokens, pages, requests per engine)."""

    prompt_tokens: int = 0
    host_tokens: int = 0
    disk_tokens: int = 0
    store_tokens: int = 0
    store_read_pages: int = 0
    store_write_pages: int = 0
    requests: list[int] = field(default_factory=list)

    def row(self, setup: ClusterSetup) -> dict[str, Any]:
        """The JSON row of this run (shares of prompt tokens, bytes through the store)."""
        total = self.prompt_tokens or 1
        mean = sum(self.requests) / len(self.requests) if self.requests else 0.0
        return {
            "router": setup.router,
            "instances": setup.instances,
            "host_pages": setup.host_pages,
            "disk_pages": setup.disk_pages,
            "store_pages": setup.store_pages,
            "event_delay_s": setup.event_delay_s,
            "hit_share": (self.host_tokens + self.disk_tokens + self.store_tokens) / total,
            "host_share": self.host_tokens / total,
            "disk_share": self.disk_tokens / total,
            "store_share": self.store_tokens / total,
            "max_over_mean_requests": max(self.requests) / mean if mean else 0.0,
            "store_read_bytes": self.store_read_pages * setup.page_bytes,
            "store_write_bytes": self.store_write_pages * setup.page_bytes,
        }


class _LruTier:
    """A disk or store tier: pages in least-recently-used order, at most `capacity` (None: no
    bound)."""

    __slots__ = ("capacity", "pages")

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.pages: OrderedDict[int, None] = OrderedDict()

    def run(self, pages: Sequence[int], start: int) -> int:
        """How many pages from `start` on it holds in a row."""
        held, n = self.pages, 0
        for p in pages[start:]:
            if p not in held:
                break
            n += 1
        return n

    def use(self, pages: Sequence[int]) -> None:
        """`pages` (held) were read: from last to first, so that a prompt's head goes last."""
        move = self.pages.move_to_end
        for p in reversed(pages):
            move(p)

    def put(self, pages: Sequence[int]) -> int:
        """Put `pages` (from last to first); returns how many it did not hold."""
        held, move, new = self.pages, self.pages.move_to_end, 0
        for p in reversed(pages):
            if p in held:
                move(p)
            else:
                held[p] = None
                new += 1
        if self.capacity is not None:
            while len(held) > self.capacity:
                held.popitem(last=False)
        return new


class _Engine:
    """One engine's tiers: an LRU host tier with hicache's placement rules, an optional disk."""

    __slots__ = ("capacity", "disk", "host")

    def __init__(self, host_pages: int, disk_pages: int) -> None:
        self.capacity = host_pages
        self.host: OrderedDict[int, None] = OrderedDict()
        self.disk = _LruTier(disk_pages) if disk_pages else None

    def serve(
        self, pages: list[int], cap: int, store: _LruTier | None
    ) -> tuple[int, int, int, list[int], list[int]]:
        """Serve a prompt of `pages` whose hit may take at most `cap` pages. Returns the pages
        served by host, disk and store, and the pages placed in and evicted from the host."""
        host = self.host
        found = 0
        for p in pages:
            if p not in host:
                break
            found += 1
        disk = self.disk
        d = disk.run(pages, found) if disk is not None and found < cap else 0
        s = store.run(pages, found + d) if store is not None and found + d < cap else 0
        hit = min(cap, found + d + s)
        h = min(found, hit)
        dh = min(d, hit - h)
        sh = hit - h - dh
        move = host.move_to_end
        for p in reversed(pages[:h]):  # loaded: touched when the load's pins are released
            move(p)
        if dh:
            disk.use(pages[h : h + dh])  # type: ignore[union-attr]
        if sh:
            store.use(pages[h + dh : hit])  # type: ignore[union-attr]
        present = pages[:found]
        missing: list[int] = []
        for p in pages[found:]:
            (present if p in host else missing).append(p)
        evicted: list[int] = []
        if missing:
            over = len(missing) - (self.capacity - len(host))
            if over > 0:
                pinned = set(present)
                for _ in range(min(over, len(host) - len(pinned))):
                    victim = next(iter(host))
                    while victim in pinned:
                        move(victim)
                        victim = next(iter(host))
                    del host[victim]
                    evicted.append(victim)
            placed = missing[: len(missing) - max(0, over - len(evicted))]
            for p in reversed(placed):
                host[p] = None
        else:
            placed = missing
        for p in reversed(present):
            move(p)
        return h, dh, sh, placed, evicted


class Router(ABC):
    """Picks the engine of each request; told the engines' KV events. `requests[i]` is the
    count of requests sent to engine i so far (the cluster keeps it)."""

    def __init__(self, setup: ClusterSetup, requests: list[int]) -> None:
        self.n = setup.instances
        self.requests = requests

    @abstractmethod
    def route(self, session: str, pages: list[int], now: float) -> int:
        """The engine of a request of `session` with prompt `pages`, arriving at `now`."""

    def events(  # noqa: B027 (most routers ignore them)
        self, engine: int, stored: list[int], removed: list[int], now: float
    ) -> None:
        """Engine `engine` placed `stored` in and evicted `removed` from its host tier."""

    def least_loaded(self, candidates: int) -> int:
        """The engine with the fewest requests among the bits of `candidates`, lowest first."""
        best, best_load, i, load = -1, 0, 0, self.requests
        while candidates:
            if candidates & 1 and (best < 0 or load[i] < best_load):
                best, best_load = i, load[i]
            candidates >>= 1
            i += 1
        return best


class RoundRobin(Router):
    def __init__(self, setup: ClusterSetup, requests: list[int]) -> None:
        super().__init__(setup, requests)
        self._k = 0

    def route(self, session: str, pages: list[int], now: float) -> int:
        i = self._k % self.n
        self._k += 1
        return i


class SessionRouter(Router):
    def __init__(self, setup: ClusterSetup, requests: list[int]) -> None:
        super().__init__(setup, requests)
        self._home: dict[str, int] = {}
        self._all = (1 << self.n) - 1

    def route(self, session: str, pages: list[int], now: float) -> int:
        home = self._home.get(session) if session else None
        if home is None:
            home = self.least_loaded(self._all)
            if session:
                self._home[session] = home
        return home


class CacheAware(Router):
    def __init__(self, setup: ClusterSetup, requests: list[int]) -> None:
        super().__init__(setup, requests)
        self._all = (1 << self.n) - 1
        self._delay = setup.event_delay_s / TIME_UNIT_S
        self._holders: dict[int, int] = {}
        """page -> bit mask of the engines the router believes hold it."""
        self._pending: deque[tuple[float, int, list[int], list[int]]] = deque()

    def events(self, engine: int, stored: list[int], removed: list[int], now: float) -> None:
        self._pending.append((now + self._delay, engine, stored, removed))

    def _learn(self, now: float) -> None:
        holders, pending = self._holders, self._pending
        while pending and pending[0][0] <= now:
            _, engine, stored, removed = pending.popleft()
            bit = 1 << engine
            for p in removed:
                left = holders[p] & ~bit
                if left:
                    holders[p] = left
                else:
                    del holders[p]
            for p in stored:
                holders[p] = holders.get(p, 0) | bit

    def route(self, session: str, pages: list[int], now: float) -> int:
        self._learn(now)
        holders, best = self._holders, self._all
        for p in pages:
            have = best & holders.get(p, 0)
            if not have:
                break
            best = have
        return self.least_loaded(best)


ROUTERS: dict[str, type[Router]] = {
    "round-robin": RoundRobin,
    "session": SessionRouter,
    "cache-aware": CacheAware,
}


def simulate_cluster(
    requests: Sequence[TraceRequest],
    prompts: Sequence[list[int]],
    setup: ClusterSetup,
    advance: Callable[[int], None] = lambda _n: None,
) -> ClusterResult:
    """Replay `requests` (in order; `prompts[k]` the full pages of request k, as
    `hicache.trace.workload.page_ids` names them) through the cluster of `setup`. `advance(k)`
    is called every few thousand requests with the count done since the last call."""
    engines = [_Engine(setup.host_pages, setup.disk_pages) for _ in range(setup.instances)]
    store = None if setup.store_pages == 0 else _LruTier(setup.store_pages)
    res = ClusterResult(requests=[0] * setup.instances)
    router = ROUTERS[setup.router](setup, res.requests)
    P, keep = setup.page_tokens, setup.min_recompute_tokens
    host_t = disk_t = store_t = reads = writes = prompt = 0
    for k, (req, pages) in enumerate(zip(requests, prompts), 1):
        now = req.timestamp
        i = router.route(req.session, pages, now)
        res.requests[i] += 1
        engine = engines[i]
        cap = capped_pages(len(pages), req.input_length, P, keep)
        h, dh, sh, placed, evicted = engine.serve(pages, cap, store)
        prompt += req.input_length
        host_t += h
        disk_t += dh
        store_t += sh
        reads += sh
        if placed:
            to_disk = computed = placed
            if dh or sh:  # placed pages fetched from the disk go nowhere, from the store to disk
                from_disk, from_store = set(pages[h : h + dh]), set(pages[h + dh : h + dh + sh])
                to_disk = [p for p in placed if p not in from_disk]
                computed = [p for p in to_disk if p not in from_store]
            if engine.disk is not None:
                engine.disk.put(to_disk)
            if store is not None and computed:
                writes += store.put(computed)
        router.events(i, placed, evicted, now)
        if k % 4096 == 0:
            advance(4096)
    advance(len(requests) % 4096)
    res.prompt_tokens = prompt
    res.host_tokens, res.disk_tokens, res.store_tokens = host_t * P, disk_t * P, store_t * P
    res.store_read_pages, res.store_write_pages = reads, writes
    return res
