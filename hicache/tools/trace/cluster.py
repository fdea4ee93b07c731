"""A cluster of engines behind a router, each with its own hicache, one Mooncake store shared.

`simulate_cluster` replays a trace through `instances` simulated engines. Each holds a host tier
(and optionally a disk tier) of the same size; all of them share one store tier (Mooncake).
A router picks the engine of every request (`ROUTERS`):

- ``round-robin``: request k goes to engine k mod N;
- ``session``: a session's first request goes to the engine with the fewest requests so far,
  and every later request of that session follows it (a request without a session is a
  session of its own);
- ``cache-aware``: the engine that holds the longest prefix of the prompt in its host tier as
  the router knows it from hicache's KV events (`hicache.observability.events`: ``stored`` /
  ``removed`` on the host tier), which reach the router `event_delay_s` after the request that
  caused them; among equals (no engine known to hold the first page: all of them) the one with the
  fewest requests so far, then the lowest index.

Each engine is `hicache.tools.trace.chainsim.ChainSim`, the tier chain as hicache runs it (the
planner's, checked against the real cache): an LRU host tier, its own disk tier if any, then
the store, each store tier in objects of `group_pages` pages (and tails) written behind. The
store's objects are one least-recently-used order shared by every engine; each engine's link
keeps its own books
of what it put or fetched there, so an engine puts a group that another one put already (the
bytes travel; the store keeps one copy). A store of capacity None never evicts.

The trace's timestamps are milliseconds (as in the Mooncake traces); requests are served at
their timestamp, one at a time, with no service time: the load a router balances is the count of
requests it sent each engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hicache.tools.trace.chainsim import ChainSim, Objects, StoreSim
from hicache.tools.trace.workload import TraceRequest

TIME_UNIT_S = 0.001
"""Seconds per unit of the trace's timestamps."""

DEFAULT_INSTANCES = (1, 2, 4, 8, 16, 32, 64)

UNBOUNDED = 1 << 62
"""Objects of a store that never evicts."""


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
    group_pages: int = 4
    """Pages per object of the disk and store tiers (hicache's `group_pages`)."""

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}; known: {', '.join(ROUTERS)}")
        if self.instances < 1:
            raise ValueError(f"instances must be >= 1, got {self.instances}")
        if self.host_pages < 1 or self.disk_pages < 0 or (self.store_pages or 0) < 0:
            raise ValueError("the host tier needs >= 1 page; disk and store sizes must be >= 0")
        if min(self.page_tokens, self.page_bytes, self.min_recompute_tokens, self.group_pages) <= 0:
            raise ValueError(
                "page_tokens, page_bytes, min_recompute_tokens and group_pages must be positive"
            )
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


class _Published(set):
    """A host tier's set of published pages that notes what enters and leaves it (the KV
    events of one request, read and cleared by `changes`)."""

    def __init__(self) -> None:
        super().__init__()
        self.added: list[int] = []
        self.gone: list[int] = []

    def add(self, page: int) -> None:
        super().add(page)
        self.added.append(page)

    def discard(self, page: int) -> None:
        super().discard(page)
        self.gone.append(page)

    def changes(self) -> tuple[list[int], list[int]]:
        """(stored, removed) since the last call: the net change, each page once."""
        stored = [p for p in self.added if p in self]
        removed = [p for p in dict.fromkeys(self.gone) if p not in self]
        self.added, self.gone = [], []
        return stored, removed


def _engine(setup: ClusterSetup, shared: Objects | None) -> ChainSim:
    """One engine's chain: its host tier, its disk tier if any, the store's objects `shared`."""
    G = setup.group_pages
    stores = []
    if setup.disk_pages:
        stores.append(StoreSim("disk", setup.disk_pages, G))  # capacity in pages
    if shared is not None:
        cap = setup.store_pages if setup.store_pages is not None else UNBOUNDED
        stores.append(StoreSim("mooncake", cap, G, objects=shared))
    sim = ChainSim(setup.host_pages, setup.page_tokens, stores, "lru", setup.min_recompute_tokens)
    sim.host.published = _Published()
    return sim


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
    `hicache.tools.trace.workload.page_ids` names them) through the cluster of `setup`. `advance(k)`
    is called every few thousand requests with the count done since the last call."""
    shared = None if setup.store_pages == 0 else Objects()
    engines = [_engine(setup, shared) for _ in range(setup.instances)]
    res = ClusterResult(requests=[0] * setup.instances)
    router = ROUTERS[setup.router](setup, res.requests)
    disk = 1 if setup.disk_pages else 0
    tiers = [0, 0, 0]  # pages served: host, disk, store
    prompt = 0
    for k, (req, pages) in enumerate(zip(requests, prompts), 1):
        now = req.timestamp
        i = router.route(req.session, pages, now)
        res.requests[i] += 1
        engine = engines[i]
        served = engine.request(pages, req.input_length)
        prompt += req.input_length
        tiers[0] += served.tier_pages[0]
        if disk:
            tiers[1] += served.tier_pages[1]
        if shared is not None:
            tiers[2] += served.tier_pages[1 + disk]
        router.events(i, *engine.host.published.changes(), now)  # type: ignore[attr-defined]
        if k % 4096 == 0:
            advance(4096)
    advance(len(requests) % 4096)
    P = setup.page_tokens
    res.prompt_tokens = prompt
    res.host_tokens, res.disk_tokens, res.store_tokens = (t * P for t in tiers)
    if shared is not None:
        res.store_read_pages = sum(e.stores[-1].read_pages for e in engines)
        res.store_write_pages = sum(e.stores[-1].written_pages for e in engines)
    return res
